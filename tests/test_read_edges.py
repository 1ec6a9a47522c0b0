"""The read path at edges the mutation pass found untested (tests/MUTATION.md): a read
that meets deleted, overwritten and intact keys at once after their bytes vanished, and
the receive buffers (in place for get_into, one pooled buffer for values returned as bytes),
and hedged reads (a chunkserver whose READV is held in its dispatch: in-process)."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock, Hold

from kvfs.bench.reliability import flip_byte
from kvfs.config import ChunkServerConfig, ClientConfig
from kvfs.errors import ChecksumMismatch, ServerError, StaleLayout
from kvfs.launcher import LocalCluster
from kvfs.layout import Layout
from kvfs.rpc import Op

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


@pytest.mark.parametrize("second", ["gone", "corrupt"])
async def test_a_layout_that_goes_stale_twice_in_one_read(one: LocalCluster, second: str) -> None:
    """Readers hold k's first layout (chunk A); k is overwritten (chunk B), then A's bytes
    vanish, and B's are gone too or corrupt. A read finds A's stale, looks k up again and
    reads B: gone again ("changed twice": a moving layout is no proof of loss, meta keeps
    k), or corrupt (every replica answered bad bytes: reported lost, meta drops k). A miss
    under on_lost="miss", the error under "raise"."""
    async with one.client() as kv:
        await kv.put(b"k", b"1" * SIZE)
        lay_a = await kv.layout(b"k")
    readers = [one.client(), one.client(ClientConfig(on_lost="raise"))]
    try:
        for r in readers:
            assert await r.get(b"k") == b"1" * SIZE  # the first layout cached
        await one.stop_chunkserver(0)
        await one.start_chunkserver(0)  # appends go to a new chunk B from here
        async with one.client() as kv:
            await kv.put(b"k", b"2" * SIZE)
            lay_b = await kv.layout(b"k")
        assert lay_a is not None and lay_b is not None and lay_a.size == lay_b.size
        rep_a, rep_b = lay_a.extents[0].replicas[0], lay_b.extents[0].replicas[0]
        cs = one.chunkservers[0]
        assert cs is not None and rep_a.chunk_id != rep_b.chunk_id
        paths = [cs.store.chunk_path(rep_a.chunk_id), cs.store.chunk_path(rep_b.chunk_id)]
        await one.stop_chunkserver(0)
        for path in paths if second == "gone" else paths[:1]:
            os.truncate(path, 0)
        await one.start_chunkserver(0)
        if second == "corrupt":
            flip_byte(one, rep_b, SIZE // 2)
        for r in readers:
            await r.servers(refresh=True)
        if second == "gone":
            assert await readers[0].get(b"k") is None
            with pytest.raises(StaleLayout, match=r"^key b'k': its layout changed twice during one read$"):
                await readers[1].get(b"k")
            async with one.client() as kv:
                assert await kv.layout(b"k") == lay_b  # kept: its bytes may be on their way
        else:
            with pytest.raises(ChecksumMismatch, match=r"^key b'k': bytes from chunkserver"):
                await readers[1].get(b"k")
            async with one.client() as kv:
                assert await kv.layout(b"k") is None  # B's layout reported lost: dropped
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


async def test_small_get_into_destinations_share_one_pooled_receive(one: LocalCluster) -> None:
    """Values below 64 KiB on average are received into one pooled buffer per READV answer
    and copied to the caller's buffers after their CRC check (not one receive each)."""
    values = {f"s{i}".encode(): os.urandom(4096) for i in range(40)}
    async with one.client() as kv:
        await kv.put_many(values)
        bufs = [bytearray(4096) for _ in values]
        assert await kv.get_into(list(values), bufs) == [4096] * 40
        assert bufs == list(values.values())
        assert kv.rx_pool_buffers == 1 and kv.rx_buffers_reused == 0
        bufs = [bytearray(5000) for _ in values]  # larger buffers: the value's leading bytes
        assert await kv.get_into(list(values), bufs) == [4096] * 40
        assert [b[:4096] for b in bufs] == list(values.values())
        assert kv.rx_pool_buffers == 1 and kv.rx_buffers_reused == 1


# (duplicates: the fixture `one` above with two chunkservers; two small fixtures read plainer than a factory)
@pytest.fixture
async def two(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    """Two chunkservers: with replicas=2 every value is on both."""
    root = tmp_path / "two"
    async with LocalCluster(root, 2, clock=clock,
                            chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2)) as c:
        yield c


@pytest.mark.parametrize(("size", "ranges"), [(1000, 4096), (SIZE, 4096), (20_000, 4096), (1000, 1)],
                         ids=["inline", "in-place", "pooled", "one-range-per-readv"])
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


# hedged reads, in process: a chunkserver's READVs are held in its dispatch (conftest.Hold),
# so it has not begun to answer when hedge_after_s ends ------------------------------------
HEDGE_S = 0.05
HEDGED = ClientConfig(replicas=2, hedge_after_s=HEDGE_S)


def _hold_readv(c: LocalCluster, sid: int) -> Hold:
    cs = next(s for s in c.chunkservers if s is not None and s.server_id == sid)
    return Hold(cs.rpc, Op.READV)


async def _put_two_copies(c: LocalCluster, n: int) -> tuple[dict[bytes, bytes], dict[bytes, list[int]]]:
    """``n`` values above 64 KiB (answers land in place), each on both servers: the values
    and each one's replica servers, in the order a read asks them."""
    values = {f"h{i}".encode(): os.urandom(SIZE + i) for i in range(n)}
    async with c.client(HEDGED) as kv:
        await kv.put_many(values)
        order = {k: [r.server_id for r in (await kv.layout(k)).extents[0].replicas]  # type: ignore[union-attr]
                 for k in values}
    assert all(len(sids) == 2 for sids in order.values())
    return values, order


async def test_a_held_replica_is_hedged_and_its_late_answer_is_discarded(two: LocalCluster) -> None:
    """A server that has not begun to answer within hedge_after_s is given up for the read:
    its values come from their other replica (get_many and get_into), the counter says so
    once per read, and its late answer, when it comes, lands in a scratch buffer, never
    in the caller's memory."""
    values, order = await _put_two_copies(two, 6)
    sid = order[b"h0"][0]
    slow = [k for k in values if order[k][0] == sid]
    keys = list(values)
    async with two.client(HEDGED) as kv, asyncio.timeout(30):  # a read that never hedges hangs
        assert await kv.get_many(keys) == list(values.values())  # connections open
        assert kv.reader.hedged == 0
        held = _hold_readv(two, sid)
        kv.layout_cache.clear()
        assert await kv.get_many(keys) == list(values.values())
        assert held.arrived.is_set() and kv.reader.hedged == 1
        bufs = [bytearray(len(values[k])) for k in slow]
        assert await kv.get_into(slow, bufs) == [len(values[k]) for k in slow]
        assert bufs == [values[k] for k in slow]
        assert kv.reader.hedged == 2
        for b in bufs:
            b[:] = bytes(len(b))
        held.release()
        await held.drained()
        # a read from the same server, on the same connection: its answer comes after the
        # late ones, so they have been received when it returns
        assert await kv.get_many(slow) == [values[k] for k in slow]
        assert kv.reader.hedged == 2
    assert bufs == [bytes(len(values[k])) for k in slow]  # the late answers went elsewhere


async def test_the_last_replica_is_waited_for_not_hedged(two: LocalCluster) -> None:
    """Both servers held: the read gives the first up after hedge_after_s and asks the
    second, its last replica, which it then waits for, however long (no hedge, no miss)."""
    values, order = await _put_two_copies(two, 1)
    first, second = order[b"h0"]
    async with two.client(HEDGED) as kv:
        assert await kv.get(b"h0") == values[b"h0"]
        holds = [_hold_readv(two, first), _hold_readv(two, second)]
        read = asyncio.ensure_future(kv.get(b"h0"))
        try:
            await holds[0].reached(read)
            await holds[1].reached(read)  # the first was given up: the second is asked
            # a bounded wait for what must not happen: the read ending (a miss) while its
            # last replica is held, which a hedge of that replica would do
            done, _ = await asyncio.wait([read], timeout=20 * HEDGE_S)
            assert not done and kv.reader.hedged == 1
            holds[1].release()
            async with asyncio.timeout(30):
                assert await read == values[b"h0"]
        finally:
            for h in holds:
                h.release()
            read.cancel()


async def test_a_cancelled_read_leaves_no_readv_writing_into_the_callers_memory(two: LocalCluster) -> None:
    """A hedging read cancelled while a server holds its READV: that READV is cancelled
    too, so the server's later answer never lands in the caller's buffers."""
    values, order = await _put_two_copies(two, 4)
    sid = order[b"h0"][0]
    slow = [k for k in values if order[k][0] == sid]
    patient = ClientConfig(replicas=2, hedge_after_s=60.0)  # hedging on, never reached here
    async with two.client(patient) as kv, asyncio.timeout(30):
        assert await kv.get_many(slow) == [values[k] for k in slow]
        held = _hold_readv(two, sid)
        bufs = [bytearray(len(values[k])) for k in slow]
        read = asyncio.ensure_future(kv.get_into(slow, bufs))
        await held.reached(read)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        held.release()
        await held.drained()
        assert await kv.get_many(slow) == [values[k] for k in slow]  # answered after the held one
    assert bufs == [bytes(len(values[k])) for k in slow]


async def test_an_abandoned_readv_that_fails_leaves_no_unretrieved_error(two: LocalCluster) -> None:
    """The READV given up on fails later (the server answers an error): the read already
    returned right bytes, and the error is consumed, not left for asyncio to report."""
    values, order = await _put_two_copies(two, 3)
    sid = order[b"h0"][0]
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        async with two.client(HEDGED) as kv, asyncio.timeout(30):
            assert await kv.get_many(list(values)) == list(values.values())
            held = _hold_readv(two, sid)
            kv.layout_cache.clear()
            assert await kv.get_many(list(values)) == list(values.values())
            assert kv.reader.hedged == 1
            held.release(ServerError("the held READV fails"))
            await held.drained()
            assert await kv.get(b"h0") == values[b"h0"]  # answered after the error
            gc.collect()  # an unretrieved task exception is reported when the task is freed
        assert [c.get("message") for c in reported] == []
    finally:
        loop.set_exception_handler(None)
