"""Reads of cached one-extent, one-replica layouts through their flat forms
(:meth:`kvfs.layoutcache.LayoutCache.flat_many`): never a stale or expired value, and the
same results as the general path."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest

import kvfs
from kvfs.bench.reliability import flip_byte
from kvfs.client import MISS, TOO_SMALL, AsyncClient
from kvfs.errors import Unavailable
from kvfs.launcher import LocalCluster
from kvfs.layoutcache import LayoutCache
from tests.conftest import FakeClock, ThreadCluster, value_of


def _flat_keys(kv: AsyncClient) -> set[bytes]:
    return set(kv.layout_cache._flat)


async def test_get_many_and_get_into_read_cached_values_through_flat_forms(kv: AsyncClient) -> None:
    keys = [f"f/{i}".encode() for i in range(40)]
    await kv.put_many([(k, value_of(k.decode())) for k in keys])
    assert await kv.get_many(keys) == [value_of(k.decode()) for k in keys]
    assert _flat_keys(kv) == set(keys)  # made by that read, used by the next ones
    flat = kv.layout_cache.flat_many(keys, kv.clock())
    assert flat is not None and [rec[5] for rec in flat] == await kv.lookup(keys)
    bufs = [bytearray(4096) for _ in keys]
    assert await kv.get_into(keys, bufs) == [4096] * len(keys)
    assert [bytes(b) for b in bufs] == [value_of(k.decode()) for k in keys]
    assert await kv.get_many(keys[::-1] + keys[:3]) == [value_of(k.decode())
                                                       for k in keys[::-1] + keys[:3]]


async def test_an_overwrite_or_delete_is_read_not_the_flat_form_of_before(kv: AsyncClient) -> None:
    """A put of a key drops its flat form (made of the layout it replaces), as a delete does:
    the next read sees the new value, or a miss (not by a StaleLayout and a fresh lookup:
    its flat form is of the new layout)."""
    keys = [b"o/a", b"o/b", b"o/c"]
    await kv.put_many([(k, b"old" * 1000) for k in keys])
    assert await kv.get_many(keys) == [b"old" * 1000] * 3
    await kv.put(b"o/a", b"new" * 1000)
    await kv.put_many([(b"o/b", b"two" * 1000)])
    assert await kv.delete(b"o/c")
    assert await kv.get_many(keys) == [b"new" * 1000, b"two" * 1000, None]
    flat = kv.layout_cache.flat_many(keys[:2], kv.clock())  # of the layouts meta holds now
    assert flat is not None and [rec[5] for rec in flat] == [await kv.layout(k) for k in keys[:2]]
    bufs = [bytearray(3000) for _ in keys]
    assert await kv.get_into(keys, bufs) == [3000, 3000, MISS]
    assert bufs[:2] == [bytearray(b"new" * 1000), bytearray(b"two" * 1000)]


async def test_an_expired_value_is_a_miss_through_the_flat_forms(kv: AsyncClient, clock: FakeClock) -> None:
    await kv.put_many([(b"t/1", b"x" * 100)], ttl=10)
    await kv.put_many([(b"t/2", b"y" * 100)])
    assert await kv.get_many([b"t/1", b"t/2"]) == [b"x" * 100, b"y" * 100]
    clock.advance(11)
    assert await kv.get_many([b"t/1", b"t/2"]) == [None, b"y" * 100]
    assert await kv.get_into([b"t/1", b"t/2"], [bytearray(100), bytearray(100)]) == [MISS, 100]


async def test_keys_without_a_flat_form_read_as_before(kv: AsyncClient) -> None:
    """Two replicas, an empty value, a key not cached, a buffer too small: the same call
    takes the general path, each key its own result."""
    await kv.put_many([(b"m/1", b"one" * 100)])
    await kv.put_many([(b"m/2", b"two" * 100)], replicas=2)
    await kv.put_many([(b"m/3", b"")])
    keys = [b"m/1", b"m/2", b"m/3", b"m/none"]
    assert await kv.get_many(keys) == [b"one" * 100, b"two" * 100, b"", None]
    assert await kv.get_many([b"m/1"]) == [b"one" * 100]
    bufs = [bytearray(300), bytearray(299), bytearray(0), bytearray(9)]
    assert await kv.get_into(keys, bufs) == [300, TOO_SMALL, 0, MISS]
    assert bufs[0] == bytearray(b"one" * 100) and bufs[1] == bytearray(299)


async def test_a_corrupt_value_read_through_its_flat_form_is_a_miss_alone(
        cluster: LocalCluster, kv: AsyncClient) -> None:
    keys = [f"c/{i}".encode() for i in range(8)]
    await kv.put_many([(k, os.urandom(4096)) for k in keys])
    values = await kv.get_many(keys)
    assert _flat_keys(kv) == set(keys)
    (lay,) = await kv.lookup([b"c/3"])
    assert lay is not None
    flip_byte(cluster, lay.extents[0].replicas[0], 100)
    got = await kv.get_many(keys)
    assert got[3] is None and got[:3] + got[4:] == values[:3] + values[4:]


async def test_get_into_in_place_checks_again_before_it_calls_a_value_lost(
        cluster: LocalCluster, kv: AsyncClient) -> None:
    """Values received straight into the caller's views and not all good there are read
    once more into a pooled buffer, checked before they are copied: a corrupt value is a
    miss alone, and views given twice (the second value landing over the first) do not
    pass for a corrupt replica (no key reported lost and dropped)."""
    keys = [f"ip/{i}".encode() for i in range(64)]  # answers above 64 KiB: through the sink
    values = [os.urandom(4096) for _ in keys]
    await kv.put_many(list(zip(keys, values, strict=True)))
    assert await kv.get_many(keys) == values
    region = memoryview(bytearray(4096 * len(keys)))
    views = [region[i * 4096 : (i + 1) * 4096] for i in range(len(keys))]
    shared = views[:]
    shared[1] = shared[0]  # keys 0 and 1 into the same view
    assert await kv.get_into(keys, shared) == [4096] * len(keys)
    assert bytes(views[0]) in (values[0], values[1])
    assert await kv.get_many(keys) == values  # nothing reported lost
    (lay,) = await kv.lookup([keys[5]])
    assert lay is not None
    flip_byte(cluster, lay.extents[0].replicas[0], 100)
    got = await kv.get_into(keys, views)
    assert got == [MISS if i == 5 else 4096 for i in range(len(keys))]
    assert [bytes(v) for i, v in enumerate(views) if i != 5] == values[:5] + values[6:]


async def test_get_into_in_place_sums_large_values_as_their_bytes_land(
        cluster: LocalCluster, kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """get_into of 256 KiB values, into one view each or into two halves each (a key's K
    and V), sums each value's bytes as the receive lands them (the read path's fold: the
    bytes it was given counted, every byte once); 4 KiB values (an answer the caches hold)
    are summed once the answer is in, without it.  A range answered with an error among
    keys read into halves leaves the others' sums in line (that key is read again from a
    fresh layout); a byte flipped in a key's second half fails that key's sum: a miss for
    it alone, the others good."""
    import crc32c
    import msgspec

    from kvfs import readpath

    folded: list[int] = []

    def counting(view: memoryview, acc: int) -> int:
        folded.append(view.nbytes)
        return crc32c.crc32c(view, acc)

    monkeypatch.setattr(readpath, "_CRC", counting)
    size = 256 * 1024
    small = {f"sm/{i}".encode(): os.urandom(4096) for i in range(64)}
    big = {f"bg/{i}".encode(): os.urandom(size) for i in range(6)}
    await kv.put_many({**small, **big})
    bufs = [bytearray(4096) for _ in small]
    assert await kv.get_into(list(small), bufs) == [4096] * len(small)
    assert bufs == list(small.values()) and folded == []
    keys = list(big)
    whole = [bytearray(size) for _ in keys]
    assert await kv.get_into(keys, whole) == [size] * len(keys)
    assert whole == list(big.values()) and sum(folded) == size * len(keys)
    folded.clear()

    def halves() -> list[list[memoryview]]:
        return [[memoryview(bytearray(size // 2)), memoryview(bytearray(size // 2))] for _ in keys]

    got = halves()
    assert await kv.get_into(keys, got) == [size] * len(keys)
    assert [b"".join(map(bytes, h)) for h in got] == list(big.values())
    assert sum(folded) == size * len(keys)
    (lay,) = await kv.lookup([keys[1]])  # its cached layout names a chunk gone from its server
    assert lay is not None
    e = lay.extents[0]
    gone = msgspec.structs.replace(e.replicas[0], chunk_id=e.replicas[0].chunk_id + 1000)
    kv.layout_cache.put(keys[1], msgspec.structs.replace(
        lay, extents=(msgspec.structs.replace(e, replicas=(gone,)),)))
    got = halves()
    assert await kv.get_into(keys, got) == [size] * len(keys)
    assert [b"".join(map(bytes, h)) for h in got] == list(big.values())
    (lay,) = await kv.lookup([keys[2]])
    assert lay is not None
    flip_byte(cluster, lay.extents[0].replicas[0], size - 100)
    got = halves()
    assert await kv.get_into(keys, got) == [MISS if i == 2 else size for i in range(len(keys))]
    assert [b"".join(map(bytes, h)) for i, h in enumerate(got) if i != 2] == [
        v for i, v in enumerate(big.values()) if i != 2]


async def test_get_into_in_place_takes_a_range_error_without_reading_again(kv: AsyncClient) -> None:
    """A READV answer received in place that carries a range's error (the key's cached
    layout names a chunk gone from its server, as after a GC compaction) is settled from
    that answer: the key is looked up again and read from its fresh layout, the other
    values stay as received, and no second READV of the group is sent."""
    import msgspec

    keys = [f"st/{i}".encode() for i in range(64)]  # one put: one server; over 64 KiB: the sink
    values = [os.urandom(4096) for _ in keys]
    await kv.put_many(list(zip(keys, values, strict=True)))
    assert await kv.get_many(keys) == values  # every layout cached, flat forms made
    (lay,) = await kv.lookup([keys[5]])
    assert lay is not None
    e = lay.extents[0]
    gone = msgspec.structs.replace(e.replicas[0], chunk_id=e.replicas[0].chunk_id + 1000)
    kv.layout_cache.put(keys[5], msgspec.structs.replace(
        lay, extents=(msgspec.structs.replace(e, replicas=(gone,)),)))
    region = memoryview(bytearray(4096 * len(keys)))
    views = [region[i * 4096 : (i + 1) * 4096] for i in range(len(keys))]
    readvs, lookups = kv.rpc_counts["READV"], kv.rpc_counts["LOOKUP"]
    assert await kv.get_into(keys, views) == [4096] * len(keys)
    assert [bytes(v) for v in views] == values
    assert kv.rpc_counts["LOOKUP"] - lookups == 1  # the stale key's fresh layout
    assert kv.rpc_counts["READV"] - readvs == 2  # the group's, then the stale key's again
    assert await kv.lookup([keys[5]]) == [lay]


async def test_a_first_round_of_one_readv_that_fails_is_a_miss_not_its_error(
        kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first round of one READV (one key, or keys of one server) is awaited without a
    task of its own: its server's failure still makes each key a miss (``on_lost="miss"``,
    no replica left), as a round of several READVs does, not an error raised by the call."""
    keys = [b"one/a", b"one/b"]  # one put: one server
    await kv.put_many([(k, os.urandom(4096)) for k in keys])
    assert None not in await kv.get_many(keys)
    assert _flat_keys(kv) == set(keys)

    async def refuse(sid: int, request: Any, payload: Any = (), sink: Any = None) -> Any:
        raise Unavailable(f"chunkserver {sid}: refused (fault injected)")

    monkeypatch.setattr(kv._link, "call_server", refuse)
    assert await kv.get_many(keys) == [None, None]
    assert await kv.get_many(keys[:1]) == [None]
    dest = bytearray(4096)
    gc.disable()  # the caller's buffer is free as the call returns, not after a collection
    try:
        assert await kv.get_into(keys[:1], [dest]) == [MISS]
        dest.extend(b"x")  # BufferError while a frame kept alive by the error still holds a view
    finally:
        gc.enable()


def test_the_first_rounds_columns_from_flat_forms_are_those_from_layouts() -> None:
    """``ReadPath._groups`` from the flat forms (one server: built in C) gives the columns
    the layouts give, per server, slots in order; a value not read leaves them to the loop."""
    import random

    from kvfs.layout import Extent, Layout, Replica
    from kvfs.layoutcache import flatten
    from kvfs.readpath import WHOLE, ReadPath

    rp = ReadPath(None, max_rpc_bytes=1 << 20, max_ranges=1024,  # type: ignore[arg-type]
                  relookup=None, forget=lambda key: None)  # type: ignore[arg-type]
    rng = random.Random(7)
    region = memoryview(bytearray(100 * 64))
    for servers in (1, 3):
        lays: list[Layout | None] = [
            Layout(100, 0, 1.0, None, (Extent(100, rng.getrandbits(32),
                                              (Replica(rng.randrange(servers), 9, i * 100),)),))
            for i in range(64)]
        flat = [flatten(lay) for lay in lays if lay is not None]
        assert None not in flat
        views = [region[i * 100 : (i + 1) * 100] for i in range(64)]
        some = [None if i % 5 == 0 else WHOLE for i in range(64)]
        for dests in ([WHOLE] * 64, views, some):
            want = rp._groups(lays, dests)
            got = rp._groups(lays, dests, flat)  # type: ignore[arg-type]
            assert want is not None and got is not None
            assert len(want) == servers
            assert {sid: (g.slots, g.ranges, g.crcs, g.total) for sid, g in got.items()} == {
                sid: (g.slots, g.ranges, g.crcs, g.total) for sid, g in want.items()}


def test_the_flat_forms_are_bounded_by_the_cache() -> None:
    """Only cached layouts have one: evicted, popped or cleared, it goes too."""
    from kvfs.layout import Extent, Layout, Replica

    cache = LayoutCache(None, 2)  # type: ignore[arg-type]  # (no TOUCH is sent here)
    lays = [Layout(10, 1, 1.0, None, (Extent(10, 1, (Replica(1, 2, i * 10),)),)) for i in range(3)]
    cache.put_many([b"a", b"b"], lays[:2])
    assert cache._flatten([b"a", b"b"], [None, None])
    cache.put_many([b"c"], lays[2:])  # evicts b"a"
    assert set(cache._flat) == {b"b"}
    cache.pop(b"b")
    assert cache._flat == {}
    assert cache._flatten([b"c"], [None])
    cache.clear()
    assert cache._flat == {} and len(cache) == 0


def test_the_blocking_clients_reads_in_its_callers_thread_take_the_flat_forms(
        tcluster: ThreadCluster) -> None:
    """``kvfs.Client`` reads cached keys in the caller's thread by their flat forms too
    (``ReadPath.fetch_now``): the values put, and an overwrite's new value (a corrupt one:
    tests/test_sync_reads.py)."""
    keys = [f"bf/{i}".encode() for i in range(30)]
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        kv.put_many([(k, value_of(k.decode())) for k in keys])
        assert kv.get_many(keys) == [value_of(k.decode()) for k in keys]
        assert set(kv.aio.layout_cache._flat) == set(keys)
        bufs = [bytearray(4096) for _ in keys]
        assert kv.get_into(keys, bufs) == [4096] * len(keys)
        assert [bytes(b) for b in bufs] == [value_of(k.decode()) for k in keys]
        kv.put(b"bf/0", b"new")
        assert kv.get_many(keys[:2]) == [b"new", value_of("bf/1")]
