"""The read path at edges the mutation pass found untested (tests/MUTATION.md): a read
that meets deleted, overwritten and intact keys at once after their bytes vanished, and
the receive buffers (in place for get_into, one pooled buffer for values returned as bytes),
and hedged reads (a chunkserver whose READV is held in its dispatch: in-process)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FakeClock, Hold, reports_checked

from kvfs import FAILED, TOO_SMALL
from kvfs.bench.reliability import flip_byte
from kvfs.buffers import Parts, regions
from kvfs.config import ChunkServerConfig, ClientConfig
from kvfs.errors import ChecksumMismatch, ServerError, StaleLayout, Unavailable
from kvfs.launcher import LocalCluster
from kvfs.layout import Layout
from kvfs.readpath import RELOOKUPS
from kvfs.rpc import Op, ReadV
from kvfs.stream import ValueReader
from kvfs.sync import Client

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
    readers = [one.client(), one.client(), one.client()]
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
        # the same, each value scattered over two halves: d's two ranges fail, the others'
        # halves land in place beside them
        halves = [[bytearray(SIZE // 2), bytearray(SIZE - SIZE // 2)] for _ in range(3)]
        assert await readers[2].get_into([b"d", b"s", b"o"], halves) == [-1, SIZE, SIZE]
        assert [a + b for a, b in halves[1:]] == [b"S" * SIZE, b"N" * SIZE]
        # get_many: the miss first must not stop the overwritten key's re-read
        assert await readers[1].get_many([b"d", b"o", b"s"]) == [None, b"N" * SIZE, b"S" * SIZE]
        _, missing = readers[1].layout_cache.get_many([b"d"], 0.0)
        assert missing == [0]  # the deleted key's stale layout is dropped from the cache
    finally:
        for r in readers:
            await r.close()


@pytest.mark.parametrize("made", ["lists", "regions"])
async def test_values_scattered_over_interleaved_regions_arrive_in_place(one: LocalCluster,
                                                                       made: str) -> None:
    """SGLang's layer_first host pool: page i's value is its 16 KiB region of each of 8
    rows, and the regions of consecutive pages are adjacent.  The answer is received
    straight into the regions (vectored receives of many regions at once); every byte
    lands where it belongs, and nothing outside the asked regions is written.  The same
    whether the regions are lists of views or ``kvfs.buffers.regions``' checked Parts."""
    pages, rows, region = 6, 8, 16 * 1024
    pool = np.full((rows, pages + 1, region), 7, dtype=np.uint8)  # a spare page, never read
    flat = memoryview(pool.reshape(-1))

    def parts(i: int) -> list[memoryview]:
        return [flat[(r * (pages + 1) + i) * region : (r * (pages + 1) + i + 1) * region]
                for r in range(rows)]

    values = {f"pg{i}".encode(): os.urandom(rows * region) for i in range(pages)}
    async with one.client() as kv:
        await kv.put_many(values)
        order = [3, 0, 5, 1, 4, 2]  # asked out of address order
        keys = [list(values)[i] for i in order]
        if made == "lists":
            dests: list[Any] = [parts(i) for i in order]
        else:
            offs = [(r * (pages + 1) + i) * region for i in order for r in range(rows)]
            dests = regions(pool, offs, [region] * len(offs), rows, writable=True)
            assert all(type(d) is Parts and d.nbytes == rows * region for d in dests)
        assert await kv.get_into(keys, dests) == [rows * region] * pages
    for i, v in enumerate(values.values()):
        assert b"".join(bytes(p) for p in parts(i)) == v
    assert (pool[:, pages] == 7).all()


@pytest.mark.parametrize("second", ["gone", "corrupt"])
async def test_a_layout_that_goes_stale_twice_in_one_read(one: LocalCluster, second: str) -> None:
    """Readers hold k's first layout (chunk A); k is overwritten (chunk B), then A's bytes
    vanish, and B's are gone too or corrupt. A read finds A's stale, looks k up again and
    reads B: gone again, with meta still naming B after it (no move: the bytes are lost), or
    corrupt (every replica answered bad bytes). Either way reported lost, and meta drops k:
    the error under on_lost="raise", and a miss for the next reader."""
    async with one.client() as kv:
        await kv.put(b"k", b"1" * SIZE)
        lay_a = await kv.layout(b"k")
    readers = [one.client(ClientConfig(on_lost="raise")), one.client()]
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
            with pytest.raises(StaleLayout, match=r"^key b'k': its bytes are gone from the chunkserver "
                                                  r"named by its layout \(lost or reclaimed\)$"):
                await readers[0].get(b"k")
        else:
            with pytest.raises(ChecksumMismatch, match=r"^key b'k': bytes from chunkserver"):
                await readers[0].get(b"k")
        async with one.client() as kv:
            assert await kv.layout(b"k") is None  # B's layout reported lost: dropped
        assert await readers[1].get(b"k") is None
    finally:
        for r in readers:
            await r.close()


@pytest.mark.parametrize("how", ["get", "get_into", "get_ranges"])
@pytest.mark.parametrize("moves", [RELOOKUPS, RELOOKUPS + 1])
async def test_a_key_that_moves_at_each_re_read(one: LocalCluster, moves: int, how: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A reader's cached layout of k goes stale, and so does each layout it looks up next:
    ``moves`` times in all, the chunk read emptied and k written anew just after meta
    answered (as when the GC's compaction moves a key again and again). Up to RELOOKUPS
    re-reads, the read finds k's newest bytes. One move more, it fails as still moving, the
    error under on_lost="raise", and meta keeps k: a moving key is no proof of loss."""
    async with one.client() as kv:
        await kv.put(b"k", b"0" * SIZE)
    reader = one.client(ClientConfig(on_lost="raise"))
    writes = 0

    async def move() -> None:  # empty the chunk of k's layout now, and write k anew
        nonlocal writes
        lay = await _layout(one, b"k")
        cs = one.chunkservers[0]
        assert cs is not None
        path = cs.store.chunk_path(lay.extents[0].replicas[0].chunk_id)
        await one.stop_chunkserver(0)
        os.truncate(path, 0)
        await one.start_chunkserver(0)  # appends go to a new chunk from here
        writes += 1
        async with one.client() as kv:
            await kv.put(b"k", str(writes).encode() * SIZE)
        await reader.servers(refresh=True)

    relookup = reader.reader._relookup

    async def moving(keys: list[bytes]) -> list[Layout | None]:  # fault injection
        got = await relookup(keys)
        if writes < moves:
            await move()
        return got

    try:
        assert await reader.get(b"k") == b"0" * SIZE  # the first layout cached
        await move()
        reader.reader._relookup = moving
        lookup = reader.lookup
        if how == "get_ranges":  # its own loop looks up through the client

            async def ranged_moving(keys: Any, **kw: Any) -> list[Layout | None]:
                got = await lookup(keys, **kw)
                if not kw.get("use_cache", True) and writes < moves:
                    await move()
                return got

            reader.lookup = ranged_moving  # type: ignore[method-assign]

        async def read() -> bytes | None:
            if how == "get":
                return await reader.get(b"k")
            if how == "get_into":  # its failure is a result (FAILED), not an error
                buf = bytearray(SIZE)
                if (got := await reader.get_into([b"k"], [buf])) == [FAILED]:
                    raise StaleLayout(caplog.records[-1].getMessage().partition("first: ")[2])
                assert got == [SIZE]
                return bytes(buf)
            return (await reader.get_ranges([(b"k", None, None)]))[0]

        if moves == RELOOKUPS:
            assert await read() == str(moves).encode() * SIZE
        else:
            word = "ranged read" if how == "get_ranges" else "read"
            with pytest.raises(StaleLayout, match=rf"^key b'k': its layout changed {moves} times "
                                                  rf"during one {word}$"):
                await read()
            async with one.client() as kv:
                assert await kv.get(b"k") == str(moves).encode() * SIZE  # kept
        assert writes == moves
    finally:
        await reader.close()


async def test_a_lost_key_ahead_of_an_overwritten_one_in_one_read(one: LocalCluster) -> None:
    """A reader holds the layouts of x and y (chunk A); y is overwritten (chunk B), then A's
    bytes vanish. One read of both: x, whose fresh layout is the one read, is a miss; y,
    after it, is still looked up again and read from B."""
    async with one.client() as kv:
        await kv.put_many({b"x": b"X" * SIZE, b"y": b"Y" * SIZE})
        chunk_a = (await _layout(one, b"x")).extents[0].replicas[0].chunk_id
    async with one.client() as reader:
        assert await reader.get_many([b"x", b"y"]) == [b"X" * SIZE, b"Y" * SIZE]  # cached
        await one.stop_chunkserver(0)
        await one.start_chunkserver(0)  # appends go to a new chunk B from here
        async with one.client() as kv:
            await kv.put(b"y", b"N" * SIZE)
        cs = one.chunkservers[0]
        assert cs is not None
        path = cs.store.chunk_path(chunk_a)
        await one.stop_chunkserver(0)
        os.truncate(path, 0)
        await one.start_chunkserver(0)
        await reader.servers(refresh=True)
        assert await reader.get_many([b"x", b"y"]) == [None, b"N" * SIZE]


async def test_get_into_reads_in_place_and_get_reuses_one_pooled_buffer(one: LocalCluster) -> None:
    n = 100_000  # answers above 64 KiB go to a sink (smaller ones are parsed inline)
    values = {f"p{i}".encode(): os.urandom(n) for i in range(3)}
    async with one.client() as kv:
        await kv.put_many(values)
        bufs = [bytearray(n) for _ in values]
        assert await kv.get_into(list(values), bufs) == [n] * 3
        assert bufs == list(values.values())
        assert kv.rx_pool_buffers == 0 and kv.rx_buffers_reused == 0  # straight into the caller's
        for k, v in values.items():  # values of 64 KiB or more: straight into the bytes returned
            assert await kv.get_many([k]) == [v]
        assert kv.rx_pool_buffers == 0 and kv.rx_buffers_reused == 0
        small = {f"q{i}".encode(): os.urandom(10_000) for i in range(8)}  # one 80 KB answer
        await kv.put_many(small)
        for i in range(3):  # copied out of one pooled buffer, kept for the next answer
            assert await kv.get_many(list(small)) == list(small.values())
            assert kv.rx_pool_buffers == 1 and kv.rx_buffers_reused == i
        many = {f"r{i}".encode(): os.urandom(9000) for i in range(100)}  # one 900 KB answer
        await kv.put_many(many)
        assert await kv.get_many(list(many)) == list(many.values())
        assert kv.rx_buffers_reused == 3  # a pooled buffer holds at least 1 MiB: no new one
        assert kv.rx_pool_buffers == 1


async def test_small_get_into_destinations_are_received_in_place_together(
        one: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Values of one extent each read into flat views they fill are received straight into
    them, by vectored receives of many views each (not one receive per value), and checked
    there: no pooled buffer.  Views a value does not fill (its leading bytes) are received
    into one pooled buffer per READV answer and copied after their CRC check."""
    values = {f"s{i}".encode(): os.urandom(4096) for i in range(100)}
    async with one.client() as kv:
        await kv.put_many(values)
        receives: list[int] = []
        readv = os.readv

        def counted(fd: int, views: list[memoryview]) -> int:
            receives.append(len(views))
            return readv(fd, views)

        monkeypatch.setattr(os, "readv", counted)
        bufs = [bytearray(4096) for _ in values]
        assert await kv.get_into(list(values), bufs) == [4096] * 100
        monkeypatch.undo()
        assert bufs == list(values.values())
        assert kv.rx_pool_buffers == 0 and len(receives) < len(values)
        bufs = [bytearray(5000) for _ in values]  # larger buffers: the value's leading bytes
        assert await kv.get_into(list(values), bufs) == [4096] * 100
        assert [b[:4096] for b in bufs] == list(values.values())
        assert kv.rx_pool_buffers == 1 and kv.rx_buffers_reused == 0


async def test_read_pool_bytes_bounds_the_kept_receive_buffers(one: LocalCluster) -> None:
    """ClientConfig.read_pool_bytes: 0 keeps no receive buffer (a fresh one per answer);
    1 MiB keeps one answer's buffer of the two received at once.  (Values under 64 KiB,
    two an answer: larger ones are received straight into the bytes returned.)"""
    values = {f"q{i}".encode(): os.urandom(40_000) for i in range(4)}
    pairs = [list(values)[:2], list(values)[2:]]
    with pytest.raises(ValueError, match="read_pool_bytes must be >= 0"):
        ClientConfig(read_pool_bytes=-1)
    async with one.client(ClientConfig(read_pool_bytes=0)) as kv:
        await kv.put_many(values)
        for _ in range(2):
            assert await kv.get_many(list(values)) == list(values.values())
        assert kv.rx_pool_buffers == 0 and kv.rx_buffers_reused == 0
    async with one.client(ClientConfig(read_pool_bytes=1 << 20, batch=False)) as kv:
        got = await asyncio.gather(*(kv.get_many(p) for p in pairs))  # two READVs at once
        assert got == [[values[k] for k in p] for p in pairs]
        assert kv.rx_pool_buffers == 1  # the second 1 MiB buffer would pass the bound


# (duplicates: the fixture `one` above with two chunkservers; two small fixtures read plainer than a factory)
@pytest.fixture
async def two(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    """Two chunkservers: with replicas=2 every value is on both."""
    root = tmp_path / "two"
    async with LocalCluster(root, 2, clock=clock,
                            chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2)) as c:
        yield c


async def test_a_small_value_overwritten_striped_at_its_size_is_read_whole(one: LocalCluster) -> None:
    """A reader's cached layout of a small one-extent value goes stale (its chunk's bytes
    gone), and the value was overwritten meanwhile, same size, by a writer that stripes at
    1 KiB: the fresh lookup's layout has three extents, and the value read is all of it,
    not its first extent."""
    async with one.client() as kv:
        await kv.put(b"w", b"W" * 3000)
    reader = one.client()
    try:
        assert await reader.get_many([b"w"]) == [b"W" * 3000]  # the layout cached
        await one.stop_chunkserver(0)
        await one.start_chunkserver(0)  # appends go to a new chunk from here
        new = os.urandom(3000)
        async with one.client() as kv:
            chunk_a = (await kv.layout(b"w")).extents[0].replicas[0].chunk_id  # type: ignore[union-attr]
        async with one.client(ClientConfig(stripe_bytes=1024)) as kv:
            await kv.put(b"w", new)
            assert len((await kv.layout(b"w")).extents) == 3  # type: ignore[union-attr]
        cs = one.chunkservers[0]
        assert cs is not None
        path = cs.store.chunk_path(chunk_a)
        await one.stop_chunkserver(0)
        os.truncate(path, 0)  # the old chunk's bytes are gone (as after GC)
        await one.start_chunkserver(0)
        await reader.servers(refresh=True)
        assert await reader.get_many([b"w"]) == [new]
    finally:
        await reader.close()


@pytest.mark.parametrize("new_size", [0, 2000, 3000, 150_000])
async def test_a_value_overwritten_at_a_new_size_is_read_at_it(one: LocalCluster, new_size: int) -> None:
    """Readers' cached layouts of a 2,500-byte value go stale (its chunk's bytes gone, as
    after the GC), and the value was overwritten meanwhile at another size (empty, smaller,
    larger, or striped at 64 KiB): the fresh lookup's layout is read at its size, by get_many into
    new bytes and by get_into into the buffer where it fits (TOO_SMALL where it does not),
    by the async and the blocking client.  It was a miss each."""
    async with one.client() as kv:
        await kv.put(b"r", b"R" * 2500)
        chunk_a = (await kv.layout(b"r")).extents[0].replicas[0].chunk_id  # type: ignore[union-attr]
    readers = [one.client() for _ in range(3)]
    blocking = await asyncio.to_thread(Client, one.addr, token=one.token)
    try:
        for r in readers:
            assert await r.get_many([b"r"]) == [b"R" * 2500]  # the layout cached
        assert await asyncio.to_thread(blocking.get_many, [b"r"]) == [b"R" * 2500]
        addr = await one.stop_chunkserver(0)  # restarted on its address: no reader looks it up
        await one.start_chunkserver(0, addr)  # appends go to a new chunk from here
        new = os.urandom(new_size)
        async with one.client(ClientConfig(stripe_bytes=64 * 1024)) as kv:
            await kv.put(b"r", new)
        cs = one.chunkservers[0]
        assert cs is not None
        path = cs.store.chunk_path(chunk_a)
        await one.stop_chunkserver(0)
        os.truncate(path, 0)  # the old chunk's bytes are gone (as after GC)
        await one.start_chunkserver(0, addr)
        assert await readers[0].get_many([b"r"]) == [new]
        fits, short = bytearray(200_000), bytearray(2500)  # short: the old size's buffer
        assert await readers[1].get_into([b"r"], [[memoryview(fits)[:7], memoryview(fits)[7:]]]) == [new_size]
        assert fits[:new_size] == new
        fits_short = new_size <= len(short)
        assert await readers[2].get_into([b"r"], [short]) == [new_size if fits_short else TOO_SMALL]
        assert short[:new_size] == new if fits_short else short == bytes(2500)  # TOO_SMALL: unwritten
        assert await asyncio.to_thread(blocking.get_many, [b"r"]) == [new]
        short[:] = bytes(2500)
        assert await asyncio.to_thread(blocking.get_into, [b"r"], [short]) == [
            new_size if fits_short else TOO_SMALL]
        assert short[:new_size] == new if fits_short else short == bytes(2500)
    finally:
        for r in readers:
            await r.close()
        await asyncio.to_thread(blocking.close)


async def test_a_split_read_that_fails_over_leaves_no_readv_landing(two: LocalCluster) -> None:
    """A read split into several READVs to one server (``max_read_ranges=1``), the first of
    them failing: the others are waited for before the values go to the other replica, so
    none of them can land in the bytes (or buffers) a call has handed back.  The others are
    held until the read fails over (where it does so early) or for 0.3 s (a bound for the
    read that waits: its fail-over comes only after them)."""
    values = {f"sp{i}".encode(): os.urandom(SIZE) for i in range(4)}
    async with two.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many(values)
        firsts = {(await kv.layout(k)).extents[0].replicas[0].server_id for k in values}  # type: ignore[union-attr]
    assert len(firsts) == 1, "the values' first replicas are on both servers"
    victim = firsts.pop()
    async with two.client(ClientConfig(replicas=2, max_read_ranges=1)) as kv:
        link = kv.link
        real = link.call_server
        raised: list[int] = []
        in_flight: list[int] = []  # the victim's READVs running
        overlaps: list[int] = []  # of them, how many ran as each READV of the fail-over began
        gate, failed_over = asyncio.Event(), asyncio.Event()

        async def release() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(failed_over.wait(), 0.3)
            gate.set()

        async def faulty(sid: int, request: Any, *args: Any, **kw: Any) -> Any:
            if not isinstance(request, ReadV):
                return await real(sid, request, *args, **kw)
            if sid != victim:  # the fail-over (every first replica is on the victim)
                overlaps.append(len(in_flight))
                failed_over.set()
                return await real(sid, request, *args, **kw)
            if not raised:
                raised.append(sid)
                releaser.append(asyncio.ensure_future(release()))
                raise Unavailable("injected: the first READV of the split read fails")
            in_flight.append(sid)
            try:
                await gate.wait()  # the split read's other READVs, still running
                return await real(sid, request, *args, **kw)
            finally:
                in_flight.remove(sid)

        releaser: list[asyncio.Future[None]] = []
        link.call_server = faulty  # type: ignore[method-assign]
        got = await kv.get_many(list(values))
        await asyncio.gather(*releaser)
        assert raised and overlaps, "the read did not fail over"
        assert not any(overlaps), "the read failed over while READVs to the first server ran"
        assert not in_flight, "a READV of the call was still running when it returned"
        assert got == list(values.values())


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
    # ones beside it still arrive.  The reads above reported the bad replica (read repair):
    # once meta has mended it, every copy the layout names now is damaged
    await reports_checked(two)
    for r in (await _layout(two, bad)).extents[0].replicas:
        flip_byte(two, r, size // 3)
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


async def _put_two_copies(c: LocalCluster, n: int, size: int = SIZE,
                          ) -> tuple[dict[bytes, bytes], dict[bytes, list[int]]]:
    """``n`` values (by default above 64 KiB: answers land in place), each on both servers:
    the values and each one's replica servers, in the order a read asks them."""
    values = {f"h{i}".encode(): os.urandom(size + i) for i in range(n)}
    async with c.client(HEDGED) as kv:
        await kv.put_many(values)
        order = {k: [r.server_id for r in (await kv.layout(k)).extents[0].replicas]  # type: ignore[union-attr]
                 for k in values}
    assert all(len(sids) == 2 for sids in order.values())
    return values, order


@pytest.mark.parametrize(("size", "ranges"), [(SIZE, 4096), (1000, 4096), (SIZE, 1)],
                         ids=["in-place", "inline", "one-range-per-readv"])
async def test_a_held_replica_is_hedged_and_its_late_answer_is_discarded(two: LocalCluster, size: int,
                                                                         ranges: int) -> None:
    """A server that has not begun to answer within hedge_after_s is given up for the read:
    its values come from their other replica (get_many and get_into), the counter says so
    once per read, and its late answer, when it comes, lands in a scratch buffer, never
    in the caller's memory. Answers small enough to be parsed whole, and reads split in one
    READV per value, alike."""
    values, order = await _put_two_copies(two, 6, size)
    sid = order[b"h0"][0]
    slow = [k for k in values if order[k][0] == sid]
    keys = list(values)
    cfg = ClientConfig(replicas=2, hedge_after_s=HEDGE_S, max_read_ranges=ranges)
    async with two.client(cfg) as kv, asyncio.timeout(30):  # a read that never hedges hangs
        # the first read opens the connections, unhedged: on a loaded machine it can take longer
        # than HEDGE_S, and a hedge would mark the server down for the reads that follow
        hedge, kv.reader._hedge_after_s = kv.reader._hedge_after_s, None
        assert await kv.get_many(keys) == list(values.values())  # connections open
        kv.reader._hedge_after_s = hedge
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


async def test_a_read_cancelled_while_its_answer_arrives_leaves_the_callers_buffer_alone(
        one: LocalCluster) -> None:
    """A get_into cancelled once its answer has begun landing in the caller's buffer: when
    the cancel returns, the rest of the answer no longer goes there (it is received and
    dropped), so a caller reusing its buffer keeps what it wrote; the connection goes on
    serving the next read, whose answer follows the dropped one."""
    size = 32 * 1024 * 1024  # far more than the sockets hold: the answer takes many receives
    value = os.urandom(size)
    sid = one.chunkservers[0].server_id  # type: ignore[union-attr]
    async with one.client() as kv, asyncio.timeout(60):
        # fault injection: a small receive buffer on the client's socket (fixed before it
        # carries anything, so TCP never widens it) makes the answer arrive in many pieces
        conn = await kv._link.server_conn(sid)
        sock = conn._proto.transport.get_extra_info("socket")  # type: ignore[union-attr]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        await kv.put(b"big", value)
        held = _hold_readv(one, sid)
        buf = bytearray(size)
        read = asyncio.ensure_future(kv.get_into([b"big"], [buf]))
        await held.reached(read)
        held.release()
        while buf[:4096] != value[:4096]:  # the answer's first bytes landed (polled each tick)
            assert not read.done(), read
            await asyncio.sleep(0)
        assert buf != value  # ... and not all of it: cancelled mid-answer
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        marker = b"\xa5" * size
        buf[:] = marker  # the caller reuses its buffer
        await held.drained()
        assert await kv.get(b"big") == value  # answered after the cancelled one, same connection
    assert buf == marker


async def test_a_batched_read_cancelled_leaves_the_callers_buffer_alone(one: LocalCluster) -> None:
    """A get_into that joined a batch (another call's read was running) and is cancelled
    while the batch's READV is held: when the cancel returns, the batch no longer writes
    into its buffer (the cancel waits for the batch it is part of)."""
    a, b = os.urandom(SIZE), os.urandom(SIZE)
    sid = one.chunkservers[0].server_id  # type: ignore[union-attr]
    async with one.client() as kv, asyncio.timeout(30):
        await kv.put_many({b"a": a, b"b": b})
        assert await kv.get_many([b"a", b"b"]) == [a, b]  # layouts cached, connection open
        held = _hold_readv(one, sid)
        buf_a, buf_b = bytearray(SIZE), bytearray(SIZE)
        first = asyncio.ensure_future(kv.get_into([b"a"], [buf_a]))  # runs at once, alone
        await held.reached(first)
        second = asyncio.ensure_future(kv.get_into([b"b"], [buf_b]))  # joins a batch
        while held._inside < 2:  # the batch's READV is held too (polled each tick)
            assert not second.done(), second
            await asyncio.sleep(0)
        second.cancel()
        held.release()
        with pytest.raises(asyncio.CancelledError):
            await second
        marker = b"\xa5" * SIZE
        buf_b[:] = marker  # the caller reuses its buffer
        assert await first == [SIZE] and buf_a == a
        await held.drained()
        assert await kv.get(b"b") == b  # answered after any other READV answer
    assert buf_b == marker


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


async def test_a_read_skips_a_replica_whose_server_it_found_down(two: LocalCluster) -> None:
    """A server a call could not reach is marked down (``down_for_s``): later reads ask
    each value's other replica first, without calling the down server again."""
    values, order = await _put_two_copies(two, 4)
    sid = order[b"h0"][0]
    firsts = [k for k in values if order[k][0] == sid]
    async with two.client(ClientConfig(replicas=2, down_for_s=3600)) as kv:
        assert await kv.get_many(firsts) == [values[k] for k in firsts]
        await two.stop_chunkserver(two.index_of(sid))
        assert await kv.get_many(firsts) == [values[k] for k in firsts]  # found down here
        assert next(s for s in await kv.servers(refresh=True) if s.server_id == sid).down
        before = kv.rpc_counts["READV"]
        assert await kv.get_many(firsts) == [values[k] for k in firsts]
        assert kv.rpc_counts["READV"] - before == 1  # one READV, to the other server


async def test_a_value_gone_from_both_replicas_is_a_miss_and_dropped(two: LocalCluster) -> None:
    """Every replica answers that the bytes are gone (and a fresh lookup names the same
    layout): a miss, not an endless round of retries, and, every server having answered,
    the key is reported lost and meta drops it."""
    await _put_two_copies(two, 1)
    async with two.client(HEDGED) as kv:
        lay = await _layout(two, b"h0")
        paths = [cs.store.chunk_path(r.chunk_id) for r in lay.extents[0].replicas
                 for cs in two.chunkservers if cs is not None and cs.server_id == r.server_id]
        for i in range(2):
            await two.stop_chunkserver(i)
        for path in paths:
            os.truncate(path, 0)
        for i in range(2):
            await two.start_chunkserver(i)
        await kv.servers(refresh=True)
        async with asyncio.timeout(30):
            assert await kv.get(b"h0") is None
        assert await kv.layout(b"h0") is None


async def test_a_value_whose_servers_are_all_down_is_a_miss_and_kept(two: LocalCluster) -> None:
    """Both servers of a value down: a miss (on_lost="raise": the error names the key and
    the server), not an endless round of retries; meta keeps the key (unreachable is not
    lost). Back up, the value is read though the client still marks both servers down:
    with no replica left on a live server, the first is tried all the same."""
    values, _ = await _put_two_copies(two, 1)
    sticky = ClientConfig(replicas=2, down_for_s=3600)
    async with two.client(sticky) as kv, two.client(ClientConfig(replicas=2, on_lost="raise")) as strict:
        assert await kv.get(b"h0") == await strict.get(b"h0") == values[b"h0"]
        for i in range(2):
            await two.stop_chunkserver(i)
        async with asyncio.timeout(30):
            assert await kv.get(b"h0") is None
            with pytest.raises(Unavailable, match=r"^key b'h0': chunkserver \d+ holding its bytes failed to answer"):
                await strict.get(b"h0")
        assert all(s.down for s in await kv.servers(refresh=True))
        assert await kv.layout(b"h0") is not None
        for i in range(2):
            await two.start_chunkserver(i)
        assert await kv.get(b"h0") == values[b"h0"]


async def test_get_into_scatters_a_small_value_over_several_buffers(one: LocalCluster) -> None:
    """A key's buffer given as a list: the value fills them in order (an answer small enough
    to be parsed whole, then copied out part by part)."""
    value = os.urandom(1000)
    async with one.client() as kv:
        await kv.put(b"s", value)
        parts = [bytearray(100), bytearray(200), bytearray(700)]
        assert await kv.get_into([b"s"], [parts]) == [1000]
        assert b"".join(parts) == value


async def test_a_streamed_read_of_a_corrupt_value_raises_naming_the_key(one: LocalCluster) -> None:
    """ValueReader (the mount's reads of large values) reads one replica's bytes that fail
    their CRC, with no replica left: the ChecksumMismatch is raised, naming the key."""
    async with one.client() as kv:
        await kv.put(b"c", os.urandom(SIZE))
        lay = await _layout(one, b"c")
        flip_byte(one, lay.extents[0].replicas[0], 7)
        with pytest.raises(ChecksumMismatch, match=r"^key b'c': bytes from chunkserver"):
            await ValueReader(kv, b"c", lay).read(0, 10)


async def test_a_raised_read_error_frees_the_destination(one: LocalCluster) -> None:
    """The read path's per-extent jobs are not tracked by Python's GC (``_Job``), so the
    error ``fetch`` raises must not be one a job holds: its traceback holds the frames that
    hold the jobs, a cycle through an untracked object that the GC never frees (and with it
    the caller's destination).  The destination is gone once the error is."""
    async with one.client() as kv:
        await kv.put(b"c", os.urandom(4096))
        lay = await _layout(one, b"c")
        flip_byte(one, lay.extents[0].replicas[0], 7)
        dest = np.zeros(4096, dtype=np.uint8)
        alive = weakref.ref(dest)
        with pytest.raises(ChecksumMismatch, match=r"^key b'c': bytes from chunkserver"):
            await kv.reader.fetch([b"c"], [lay], [[memoryview(dest)]], None)
        del dest
        deadline = asyncio.get_running_loop().time() + 10  # the READV's tasks let go of it
        while alive() is not None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
            gc.collect()
        assert alive() is None
