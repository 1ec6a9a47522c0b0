"""A put's COMMIT columns and layouts (``kvfs.writepath._Written``): the shortcut for one
server holding every value (its APPEND answer taken as it is) makes what the general way
makes, and is taken only when the answer has one location per value.  No cluster: the
write path's record of where values went, built as ``WritePath._append`` builds it."""

from __future__ import annotations

import pytest

from kvfs.layout import Extent, Layout, Replica
from kvfs.packed import pack, unpack
from kvfs.placement import place
from kvfs.writepath import _Written

MiB = 1 << 20


def _written(sizes: list[int], order: list[int], replicas: int, locs: dict[int, list[tuple[int, int]]],
             ) -> _Written:
    placed = place(sizes, order, replicas=replicas, stripe_bytes=MiB, group_bytes=16 * MiB)
    slots: list[int] = []
    seen = dict.fromkeys(order, 0)
    for servers in placed:  # each value's record index on each of its servers, in value order
        assert isinstance(servers, tuple)
        for sid in servers:
            slots.append(seen[sid])
            seen[sid] += 1
    return _Written(sizes, [1000 + i for i in range(len(sizes))], list(placed), slots, locs)


def _general(w: _Written, monkeypatch: pytest.MonkeyPatch) -> _Written:
    """The same write, its columns made the general way (per replica, by slots)."""
    monkeypatch.setattr(_Written, "_one_server", lambda self: None)
    return _Written(w.sizes, w.crcs, w.plans, w.slots, w.locs)


def test_one_server_answer_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 130
    sizes = [4096 + i for i in range(n)]
    keys = [b"k%d" % i for i in range(n)]
    locs = {2: [((2 << 40) | 7, 64 * i) for i in range(n)]}
    fast = _written(sizes, [2, 1, 3], 1, locs)
    assert fast._one_server() == 2
    packed, layouts = fast.packed(keys, None), fast.layouts(5.0, None)
    general = _general(fast, monkeypatch)
    assert packed == general.packed(keys, None) == pack(keys, layouts)
    assert layouts == general.layouts(5.0, None)
    assert layouts[7] == Layout(4103, 1007, 5.0, None,
                                (Extent(4103, 1007, (Replica(2, (2 << 40) | 7, 64 * 7),)),))
    metas: list[bytes | None] = [None if i % 3 else b"\x80" for i in range(n)]
    assert [(k, lay.meta) for k, lay in unpack(fast.packed(keys, metas), 1.0, None).staged][:4] == [
        (b"k0", b"\x80"), (b"k1", None), (b"k2", None), (b"k3", b"\x80")]


def test_shortcut_not_taken_for_other_shapes() -> None:
    n = 8
    sizes = [4096] * n
    # two replicas: every value on two servers
    two = _written(sizes, [1, 2, 3], 2, {1: [(1 << 40, 8 * i) for i in range(n)],
                                          2: [(2 << 40, 8 * i) for i in range(n)]})
    assert two._one_server() is None
    assert [len(lay.extents[0].replicas) for lay in two.layouts(1.0, None)] == [2] * n
    # runs over two servers (put_group_bytes of 4 values)
    placed = place(sizes, [1, 2], replicas=1, stripe_bytes=MiB, group_bytes=4 * 4096)
    assert placed[0] != placed[4]
    runs = _Written(sizes, [0] * n, list(placed), [0, 1, 2, 3, 0, 1, 2, 3],
                    {1: [(1 << 40, i) for i in range(4)], 2: [(2 << 40, i) for i in range(4)]})
    assert runs._one_server() is None
    assert [lay.extents[0].replicas[0].server_id for lay in runs.layouts(1.0, None)] == [1] * 4 + [2] * 4
    # one server, but an answer of more locations than values: the general way, by slots
    extra = _written(sizes, [3], 1, {3: [(3 << 40, i) for i in range(n + 1)]})
    assert extra._one_server() is None
    assert [lay.extents[0].replicas[0].offset for lay in extra.layouts(1.0, None)] == list(range(n))
