"""Meta's dict of every key, split over many (kvfs.meta.keymap): the same answers as one
dict under any sequence of changes, its keys spread evenly, and the index keeps no dict
of every key, so growing it never copies more than a shard's."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
from conftest import FakeClock

from kvfs.bench.meta_stall import stalled
from kvfs.config import MetaConfig
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.meta import index
from kvfs.meta.index import MetaIndex, listed, walked
from kvfs.meta.keymap import SHARDS, KeyMap
from kvfs.meta.localstore import open_local
from kvfs.meta.storeapi import Lease
from kvfs.meta.tombstones import tomb_layout


def key(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).hexdigest().encode()


def test_a_keymap_answers_as_one_dict_under_random_changes() -> None:
    rng = random.Random(7)
    model: dict[bytes, int] = {}
    km: KeyMap[int] = KeyMap()
    pool = [key(i) for i in range(300)] + [b"", b"\x00", b"k" * 300]
    for step in range(6000):
        k, op = rng.choice(pool), rng.random()
        if op < 0.4:
            model[k] = km[k] = step
        elif op < 0.55:
            assert km.pop(k, None) == model.pop(k, None)
        elif op < 0.6 and k in model:
            del model[k]
            del km[k]
        elif op < 0.9:
            assert km.get(k) == model.get(k)
            assert km.get(k, -1) == model.get(k, -1)
            assert (k in km) == (k in model)
        elif op < 0.999:
            assert len(km) == len(model) and bool(km) == bool(model)
            assert sorted(km) == sorted(model)
            assert sorted(km.items()) == sorted(model.items())
            assert sorted(km.values()) == sorted(model.values())
        else:
            km.clear()
            model.clear()
    for k in pool:
        if k in model:
            assert km[k] == model[k] and km.pop(k) == model.pop(k)
        else:
            with pytest.raises(KeyError):
                km[k]
    assert not km and len(km) == 0 and dict(KeyMap([(b"a", 1)]).items()) == {b"a": 1}


def test_a_keymaps_keys_spread_over_its_shards() -> None:
    """No shard holds more than twice its share: a shard's growth copies at most that."""
    n = SHARDS * 256
    km = KeyMap((key(i), i) for i in range(n))
    assert len(km) == n
    assert max(map(len, km.shards)) <= 2 * n // SHARDS
    assert all(k in km.shards[hash(k) & km.mask] for k in (key(0), key(n - 1)))  # (the index's pick)


async def test_the_index_keeps_no_dict_of_every_key(tmp_path: Path, clock: FakeClock) -> None:
    """Committed twice (so each key has an older record), read with a lease (so each has an
    access time, not yet written, and a lease; half of them released), loaded again at a
    restart, and half deleted with tombstones: the index's per-key maps hold every key and
    answer for it, and no one dict of them holds more than twice a shard's share."""
    n = SHARDS * 64

    def lay(i: int) -> Layout:
        return Layout(10, 7, 100.0, None, (Extent(10, 7, (Replica(1, make_chunk_id(1, i // 4096), i * 50),)),))

    keys = [key(i) for i in range(n)]
    ix = MetaIndex(MetaConfig(data=tmp_path), open_local(tmp_path, "rocksdb"), clock)
    try:
        await ix.commit([(k, lay(i)) for i, k in enumerate(keys)], 100.0, None)
        await ix.commit([(k, lay(n + i)) for i, k in enumerate(keys)], 110.0, None)  # (each key: an older record)
        assert all(lay is not None for lay in await ix.lookup(keys, 150.0, Lease("h", 1e9, 8)))
        assert len(ix.dirty_access) == n and max(map(len, ix.dirty_access.shards)) <= 2 * n // SHARDS
        assert len(ix.leases) == n and max(map(len, ix.leases.ends.shards)) <= 2 * n // SHARDS
        assert await ix.leased(keys, 150.0) == set(keys)
        assert await ix.release(keys[::2], "h") == n // 2
        assert await ix.leased(keys, 150.0) == set(keys[1::2]) and len(ix.leases) == n // 2
        await ix.flush()
    finally:
        await ix.close()
    ix = MetaIndex(MetaConfig(data=tmp_path), open_local(tmp_path, "rocksdb"), clock)
    try:
        ix.load()
        for m in (ix.entries, ix.accessed, ix.older):
            assert len(m) == n and max(map(len, m.shards)) <= 2 * n // SHARDS
        assert [ix.last_access(k) for k in keys] == [150.0] * n
        assert await ix.exists([*keys, key(n)], 160.0) == [True] * n + [False]
        gone = keys[: n // 2]  # deleted, each keeping its tombstone
        assert await ix.delete(gone, [tomb_layout([Replica(1, make_chunk_id(1, 9), 64 * i)], 170.0)
                                      for i in range(len(gone))]) == len(gone)
        assert len(ix.tombstones) == len(gone) and max(map(len, ix.tombstones.shards)) <= 2 * len(gone) // SHARDS
        assert await ix.exists(keys, 180.0) == [False] * len(gone) + [True] * (n - len(gone))
    finally:
        await ix.close()


async def test_a_keymap_is_listed_a_shard_per_loop_step() -> None:
    """``listed`` (the walks of every key in an order: eviction's LRU order, the access-time
    flush) hands back every key once, and the loop runs other tasks between shards:
    ``list()`` of the map would hold it for every key at once."""
    n = SHARDS * 40
    km = KeyMap((key(i), i) for i in range(n))
    got: list[bytes] = []

    async def walk() -> None:
        got.extend(await listed(km))

    _, _, ticks = await stalled(walk)  # (the steps other tasks had while it ran)
    assert sorted(got) == sorted(key(i) for i in range(n))
    assert ticks >= SHARDS - 1


async def test_a_keymap_is_walked_a_page_per_loop_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``walked`` (the walks of every key in no order: the drop of passed tombstones, of
    ended leases) hands back every key once, a page at a time, and other tasks run
    between pages."""
    monkeypatch.setattr(index, "WALK_PAGE", 16)
    n = SHARDS * 40
    km = KeyMap((key(i), i) for i in range(n))
    got: list[bytes] = []
    longest = [0]

    async def walk() -> None:
        async for page in walked(km):
            got.extend(page)
            longest[0] = max(longest[0], len(page))

    _, _, ticks = await stalled(walk)
    assert sorted(got) == sorted(key(i) for i in range(n))
    assert longest[0] == 16 and ticks >= n // 16
