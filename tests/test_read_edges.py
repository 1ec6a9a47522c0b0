"""The read path at edges the mutation pass found untested (tests/MUTATION.md): a read
that meets deleted, overwritten and intact keys at once after their bytes vanished, and
the receive buffers (in place for get_into, one pooled buffer for values returned as bytes)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import FakeClock

from kvfs.bench.reliability import flip_byte
from kvfs.config import ChunkServerConfig, ClientConfig
from kvfs.launcher import LocalCluster
from kvfs.layout import Layout

SIZE = 100_000  # above 64 KiB: answers go to a sink (get_into: in place)


@pytest.fixture
async def one(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    """One chunkserver: every value of a put lands in the same chunk."""
    root = tmp_path / "one"
    async with LocalCluster(root, 1, clock=clock,
                            chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2)) as c:
        yield c


async def test_stale_layouts_of_deleted_and_overwritten_keys_beside_good_ones(one: LocalCluster) -> None:
    """Two readers cache the layouts of d and o (chunk A). Then d is deleted, o overwritten
    and s written (both in chunk B, after a restart), and chunk A's bytes vanish. Each read
    must answer d as a miss, o with its new bytes and s intact, all in one call."""
    async with one.client() as kv:
        await kv.put_many({b"d": b"D" * SIZE, b"o": b"O" * SIZE})
    readers = [one.client(), one.client()]
    try:
        for r in readers:
            assert await r.get_many([b"d", b"o"]) == [b"D" * SIZE, b"O" * SIZE]  # layouts cached
        await one.stop_chunkserver(0)
        await one.start_chunkserver(0)  # appends go to a new chunk B from here
        async with one.client() as kv:
            chunk_a = (await kv.layout(b"d")).extents[0].replicas[0].chunk_id  # type: ignore[union-attr]
            assert await kv.delete(b"d")
            await kv.put_many({b"o": b"N" * SIZE, b"s": b"S" * SIZE})
        cs = one.chunkservers[0]
        assert cs is not None
        path = cs.store.chunk_path(chunk_a)
        await one.stop_chunkserver(0)
        os.truncate(path, 0)  # chunk A's bytes are gone (as after GC, or a lost disk)
        await one.start_chunkserver(0)
        for r in readers:
            await r.servers(refresh=True)
        # get_into: d's range fails on the server, s's lands in place beside it
        bufs = [bytearray(SIZE) for _ in range(3)]
        assert await readers[0].get_into([b"d", b"s", b"o"], bufs) == [-1, SIZE, SIZE]
        assert bufs[1:] == [b"S" * SIZE, b"N" * SIZE]
        # get_many: the miss first must not stop the overwritten key's re-read
        assert await readers[1].get_many([b"d", b"o", b"s"]) == [None, b"N" * SIZE, b"S" * SIZE]
        _, missing = readers[1].layout_cache.get_many([b"d"], 0.0)
        assert missing == [0]  # the deleted key's stale layout is dropped from the cache
    finally:
        for r in readers:
            await r.close()


async def test_get_into_reads_in_place_and_get_reuses_one_pooled_buffer(one: LocalCluster) -> None:
    n = 100_000  # answers above 64 KiB go to a sink (smaller ones are parsed inline)
    values = {f"p{i}".encode(): os.urandom(n) for i in range(3)}
    async with one.client() as kv:
        await kv.put_many(values)
        bufs = [bytearray(n) for _ in values]
        assert await kv.get_into(list(values), bufs) == [n] * 3
        assert bufs == list(values.values())
        assert kv.rx_pool_buffers == 0 and kv.rx_buffers_reused == 0  # straight into the caller's
        for i, (k, v) in enumerate(values.items()):  # one READV each, answered into one buffer
            assert await kv.get_many([k]) == [v]
            assert kv.rx_pool_buffers == 1 and kv.rx_buffers_reused == i
        big = os.urandom(900_000)
        await kv.put(b"big", big)
        assert await kv.get_many([b"big"]) == [big]
        assert kv.rx_buffers_reused == 3  # a pooled buffer holds at least 1 MiB: no new one
        assert kv.rx_pool_buffers == 1


# (duplicates: the fixture `one` above with two chunkservers; two small fixtures read plainer than a factory)
@pytest.fixture
async def two(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    """Two chunkservers: with replicas=2 every value is on both."""
    root = tmp_path / "two"
    async with LocalCluster(root, 2, clock=clock,
                            chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2)) as c:
        yield c


@pytest.mark.parametrize(("size", "ranges"), [(1000, 4096), (SIZE, 4096), (1000, 1)],
                         ids=["inline", "in-place", "one-range-per-readv"])
async def test_a_corrupt_value_ahead_of_good_ones_in_one_readv(two: LocalCluster, size: int,
                                                              ranges: int) -> None:
    """One READV to one server answers a corrupt value first and good ones after it: the
    corrupt one is read again from its other replica, and the ones after it are still
    served from this answer, with their own bytes (get_many and get_into alike).  With
    ``max_read_ranges=1`` the read is split in one READV per value, run side by side."""
    read = ClientConfig(replicas=2, max_read_ranges=ranges)
    values = {f"r{i}".encode(): os.urandom(size) for i in range(4)}
    async with two.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many(values)
        firsts = {k: (await kv.layout(k)).extents[0].replicas[0] for k in values}  # type: ignore[union-attr]
    bad = next(iter(values))
    sid = firsts[bad].server_id
    after = [k for k in values if k != bad and firsts[k].server_id == sid]
    assert after, "no other value is read from the corrupt one's server first"
    flip_byte(two, firsts[bad], size // 2)
    keys = [bad, *after]
    async with two.client(read) as kv:
        assert await kv.get_many(keys) == [values[k] for k in keys]
        bufs = [bytearray(size) for _ in keys]
        assert await kv.get_into(keys, bufs) == [size] * len(keys)
        assert bufs == [values[k] for k in keys]
    # corrupt on both replicas: a miss (on_lost="miss"), never wrong bytes, and the good
    # ones beside it still arrive
    other = next(r for r in (await _layout(two, bad)).extents[0].replicas if r.server_id != sid)
    flip_byte(two, other, size // 3)
    async with two.client(read) as kv:
        assert await kv.get_many(keys) == [None, *(values[k] for k in after)]


async def _layout(c: LocalCluster, key: bytes) -> Layout:
    async with c.client() as kv:
        lay = await kv.layout(key)
    assert lay is not None
    return lay
