"""Limits before work: what an unauthenticated or overloading peer may cost a server.

In-process servers with short timeouts and small limits, real sockets.  The
heavier versions (1,000 connections, slow-loris, RSS from /proc of server
processes) are in test_hostile.py (marker ``hostile``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import chunkserver_connection, raw_connect, read_frame
from crc32c import crc32c

import kvfs
from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.chunkserver.store import ChunkStore
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, ClientConfig, MetaConfig
from kvfs.datadir import raise_nofile_limit
from kvfs.errors import (
    FrameTooLarge,
    InvalidArgument,
    RemoteProtocolError,
    ServerError,
    StaleLayout,
    Timeout,
    Unavailable,
    from_wire,
)
from kvfs.launcher import LocalCluster, ProcessCluster
from kvfs.protocol import FIXED, MAGIC, PROTOCOL_VERSION, Frame, frame_bytes
from kvfs.ratelog import RateLimitedLog
from kvfs.rpc import Op
from kvfs.server import _ServerProtocol
from kvfs.transport import Connection

MiB = 1024 * 1024


@pytest.fixture
async def tight(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    """One chunkserver with short timeouts and small in-flight limits."""
    limits = dict(handshake_timeout_s=0.5, idle_timeout_s=1.0, max_connections=8,
                  max_inflight_requests=4, max_inflight_bytes=2 * MiB)
    c = LocalCluster(tmp_path / "c", 1,
                     meta=MetaConfig(data=tmp_path / "c" / "meta", listen="127.0.0.1:0", **limits),
                     chunkserver=ChunkServerConfig(data=tmp_path / "c", heartbeat_interval_s=0.2,
                                                   max_ranges=64, max_read_rpc_bytes=4 * MiB,
                                                   **limits))
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


async def _eof(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes (fails if it never does)."""
    async with asyncio.timeout(timeout_s):
        return await reader.read()


def _one_server(tmp_path: Path, **chunkserver: Any) -> LocalCluster:
    """A cluster of meta and one chunkserver (heartbeats every 0.2 s) with ``chunkserver``'s
    options, not started."""
    return LocalCluster(tmp_path / "c", 1,
                        meta=MetaConfig(data=tmp_path / "c" / "meta", listen="127.0.0.1:0"),
                        chunkserver=ChunkServerConfig(data=tmp_path / "c", heartbeat_interval_s=0.2,
                                                      **chunkserver))


def _cs_addr(c: LocalCluster) -> str:
    cs = c.chunkservers[0]
    assert cs is not None
    return "kvfs://" + cs.addr


@pytest.mark.parametrize("payload", [512 * MiB, 100 << 30])
async def test_a_header_announcing_a_large_payload_before_auth_is_refused(
        tight: LocalCluster, payload: int) -> None:
    reader, writer, _ = await raw_connect(_cs_addr(tight))
    writer.write(FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.AUTH, 0, 1, 0, payload))
    err = await read_frame(reader)
    assert isinstance(from_wire(err.header), FrameTooLarge)
    assert str(payload) in err.header["message"]
    await _eof(reader)
    writer.close()


async def test_only_auth_is_accepted_before_auth(tight: LocalCluster) -> None:
    reader, writer, _ = await raw_connect(_cs_addr(tight))
    writer.write(frame_bytes(Op.READV, 1, {"ranges": [[1, 0, 10]]}))
    err = await read_frame(reader)
    assert isinstance(from_wire(err.header), RemoteProtocolError)
    assert "op 33 is not accepted" in err.header["message"]
    await _eof(reader)
    writer.close()


async def test_a_large_msgpack_header_before_auth_is_refused(tight: LocalCluster) -> None:
    reader, writer, _ = await raw_connect(tight.addr)
    writer.write(FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.AUTH, 0, 1, 64 * 1024, 0))
    err = await read_frame(reader)
    assert isinstance(from_wire(err.header), FrameTooLarge)
    writer.close()


# (duplicates: the raw-frame tests read alike on purpose: each sends one bad frame and checks the answer)
async def test_a_connection_that_does_not_authenticate_is_closed(tight: LocalCluster) -> None:
    reader, writer, _ = await raw_connect(tight.addr)
    writer.write(frame_bytes(Op.AUTH, 1, {"version": PROTOCOL_VERSION})[:20])  # half a frame
    err = await read_frame(reader)
    assert isinstance(from_wire(err.header), Timeout)
    assert "no AUTH within 0.5s" in err.header["message"]
    await _eof(reader)
    writer.close()


async def test_an_idle_connection_is_closed_and_the_client_reconnects(tight: LocalCluster) -> None:
    host, port = parse_addr(tight.addr)
    conn = await Connection.open(host, port, tight.token)
    async with asyncio.timeout(10):
        await conn.wait_closed()
    async with tight.client() as kv:
        await kv.put(b"k", b"v")
        cs = tight.chunkservers[0]
        assert cs is not None
        async with asyncio.timeout(10):  # the client's own connection goes idle too
            while cs.rpc.connections:
                await asyncio.sleep(0.05)
        assert await kv.get(b"k") == b"v"


async def test_connections_past_max_connections_are_refused_at_accept(tight: LocalCluster) -> None:
    cs = tight.chunkservers[0]
    assert cs is not None
    open_now = len(cs.rpc.connections)
    held = [await raw_connect(_cs_addr(tight)) for _ in range(8 - open_now)]
    host, port = parse_addr(_cs_addr(tight))
    reader, writer = await asyncio.open_connection(host, port)
    err = await read_frame(reader)
    assert isinstance(from_wire(err.header), Unavailable)
    assert "max_connections" in err.header["message"]
    await _eof(reader)
    assert cs.rpc.refused_connections == 1
    for _, w, _ in [*held, (reader, writer, None)]:
        w.close()


async def test_readv_limits(tight: LocalCluster) -> None:
    async with tight.client() as kv:
        await kv.put(b"one", os.urandom(MiB))
        lay = await kv.layout(b"one")
        assert lay is not None
        rep = lay.extents[0].replicas[0]
        rng = rpc.Range(rep.chunk_id, rep.offset, MiB)
        cs = tight.chunkservers[0]
        assert cs is not None
        conn = await Connection.open(*parse_addr(_cs_addr(tight)), tight.token)
        try:
            with pytest.raises(InvalidArgument, match="overlap"):
                await conn.call(rpc.ReadV(ranges=[rng, rng]))
            with pytest.raises(InvalidArgument, match="1000 ranges; the limit is 64"):
                await conn.call(rpc.ReadV(ranges=[rng] * 1000))
            with pytest.raises(InvalidArgument, match="the limit is 4194304"):
                await conn.call(rpc.ReadV(ranges=[rpc.Range(rep.chunk_id, i * MiB, MiB)
                                                  for i in range(5)]))
            with pytest.raises(InvalidArgument, match=r"Expected `int`, got `str` - at `\$.ranges\[0\]\[1\]`"):
                await conn.call_raw(Op.READV, {"ranges": [[rep.chunk_id, "0", 1]]})
            ok = await conn.call_raw(Op.READV, rpc.ReadV(ranges=[rng]))
            assert len(ok.payload) == MiB
        finally:
            conn.close()
        # the client splits what a server would refuse: the same key twice, many keys
        assert await kv.get_many([b"one", b"one"]) == [await kv.get(b"one")] * 2
        small = {f"s{i}".encode(): b"x" * 10 for i in range(200)}
        await kv.put_many(small)
    async with tight.client(ClientConfig(max_read_ranges=64)) as kv:
        assert await kv.get_many(list(small)) == list(small.values())


async def _ranges(kv: AsyncClient, n: int, size: int, prefix: str = "v"
                  ) -> tuple[list[rpc.Range], bytes]:
    """Put ``prefix``0..``n``-1 of ``size`` bytes each; their READV ranges on the (one)
    chunkserver, and their bytes in that order."""
    values = {f"{prefix}{i}": os.urandom(size) for i in range(n)}
    await kv.put_many(values)
    ranges = []
    for key in values:
        lay = await kv.layout(key)
        assert lay is not None
        rep = lay.extents[0].replicas[0]
        ranges.append(rpc.Range(rep.chunk_id, rep.offset, size))
    return ranges, b"".join(values.values())


async def test_a_client_that_never_reads_is_paused_and_others_are_served(
        tight: LocalCluster) -> None:
    async with tight.client() as kv:
        ranges = (await _ranges(kv, 4, MiB))[0]
        raw, proto, _ = await chunkserver_connection(tight)
        assert raw._proto.transport is not None
        raw._proto.transport.pause_reading()  # never reads a reply
        for rid in range(1000, 1100):
            raw._proto.write([frame_bytes(Op.READV, rid, {"ranges": ranges})])
        async with asyncio.timeout(20):
            while not proto.holding:
                await asyncio.sleep(0.01)
        for _ in range(20):
            assert await kv.get("v1") is not None  # another client is served meanwhile
        assert proto.holding  # still paused: nothing drained
        assert proto.peak_inflight_requests <= 4
        assert proto.peak_inflight_bytes <= 2 * MiB + 4 * MiB  # the limit + one request's answer
        assert proto.inflight_requests < 100  # the rest wait unread in the socket
        raw.close()


async def test_cached_readvs_are_answered_at_once_and_held_once_the_transport_is_full(
        tight: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A READV of small page-cache ranges is answered from the receive callback, no task.
    To a client that stops reading, such answers go out until the transport is past its
    high-water mark; from there each is held, counted against max_inflight_*, until the
    client reads: reading pauses within the limits and every answer arrives, right."""
    started: list[str] = []
    start = _ServerProtocol._start

    def counted(self: _ServerProtocol, coro: Any, got: object = None) -> None:
        started.append(coro.__qualname__)
        start(self, coro, got)

    monkeypatch.setattr(_ServerProtocol, "_start", counted)
    async with tight.client() as kv:
        ranges, want = await _ranges(kv, 64, 4096, "small")  # a 256 KiB answer
        conn, proto, _ = await chunkserver_connection(tight)
        try:
            started.clear()
            _, body = await conn.exchange(rpc.ReadV(ranges=ranges))
            assert bytes(body) == want
            assert started == []  # no task
            assert conn._proto.transport is not None
            conn._proto.transport.pause_reading()  # reads no answer for now
            calls = [asyncio.ensure_future(conn.exchange(rpc.ReadV(ranges=ranges)))
                     for _ in range(200)]  # 50 MiB of answers: past the socket's buffers
            deadline = asyncio.get_running_loop().time() + 20
            while not proto.holding:
                assert asyncio.get_running_loop().time() < deadline, "reading never paused"
                await asyncio.sleep(0.01)
            assert "_ServerProtocol._until_room" in started  # the first answer past the mark
            assert proto.peak_inflight_requests <= 4
            assert proto.peak_inflight_bytes <= 2 * MiB + 4 * MiB
            conn._proto.transport.resume_reading()
            async with asyncio.timeout(30):
                for call in calls:
                    assert bytes((await call)[1]) == want
            assert proto.inflight_requests == 0 and proto.inflight_bytes == 0
        finally:
            conn.close()


@pytest.mark.parametrize("raised", [StaleLayout("gone meanwhile"), RuntimeError("a bug")])
async def test_a_readv_that_raises_before_any_await_is_answered_and_the_connection_serves_on(
        tight: LocalCluster, monkeypatch: pytest.MonkeyPatch, raised: Exception) -> None:
    """Fault injection: the store's mapped read raises inside the answer made at once.  A
    KVFSError goes back as itself, anything else as ServerError; the next READV is served."""
    async with tight.client() as kv:
        ranges, want = await _ranges(kv, 8, 4096, "small")
        cs = tight.chunkservers[0]
        assert cs is not None
        conn = await Connection.open(*parse_addr(_cs_addr(tight)), tight.token)
        try:
            with monkeypatch.context() as m:
                def fail(*args: Any) -> None:
                    raise raised
                m.setattr(cs.store, "readv_mapped", fail)
                with pytest.raises(type(raised) if isinstance(raised, StaleLayout) else ServerError,
                                   match=str(raised)):
                    await conn.call(rpc.ReadV(ranges=ranges))
            _, body = await conn.exchange(rpc.ReadV(ranges=ranges))
            assert bytes(body) == want
        finally:
            conn.close()


async def test_a_request_cancelled_before_its_task_began_leaves_no_coroutine_unawaited(
        tight: LocalCluster) -> None:
    """The server's close cancels the requests in flight, maybe one whose task has not run
    yet: the handler's coroutine (made as the request arrived) is closed with it, never
    reported "never awaited"."""
    conn, proto, _ = await chunkserver_connection(tight)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            # no such chunk: not answered at once, read in a task
            proto.frame_received(Frame(op=Op.READV, request_id=7, header={"ranges": [[12345, 0, 10]]}))
            (task,) = proto.tasks
            task.cancel()
            await asyncio.wait([task])
            del task
            gc.collect()
        assert [str(w.message) for w in seen] == []
        assert not proto.tasks
    finally:
        conn.close()


async def test_a_client_that_stops_reading_is_aborted_after_send_timeout(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Its answers wait at most send_timeout_s for it to read; then the connection is
    aborted and the requests it held end (the idle timer never fires while they wait)."""
    limits = dict(send_timeout_s=0.5, max_inflight_requests=4, max_inflight_bytes=2 * MiB)
    c = _one_server(tmp_path, **limits)
    async with asyncio.timeout(60):
        await c.start()
        try:
            async with c.client() as kv:
                ranges = (await _ranges(kv, 4, MiB))[0]
                cs = c.chunkservers[0]
                assert cs is not None
                raw, proto, port_here = await chunkserver_connection(c)  # authenticated
                try:
                    assert raw._proto.transport is not None
                    raw._proto.transport.pause_reading()  # never reads an answer
                    with caplog.at_level(logging.INFO, logger="kvfs.server"):
                        for rid in range(1000, 1100):
                            raw._proto.write([frame_bytes(Op.READV, rid, {"ranges": ranges})])
                        deadline = asyncio.get_running_loop().time() + 20
                        while proto in cs.rpc.connections or proto.tasks:
                            assert asyncio.get_running_loop().time() < deadline, (
                                f"a connection that stopped reading is still open "
                                f"({proto.inflight_requests} requests in flight)")
                            await asyncio.sleep(0.02)
                    assert proto.inflight_requests == 0 and proto.inflight_bytes == 0
                    assert proto.peak_inflight_requests > 0  # it did hold answers before
                    assert any("send_timeout_s" in r.getMessage() and str(port_here) in r.getMessage()
                               for r in caplog.records)
                    raw._proto.transport.resume_reading()  # the client sees the close
                    await asyncio.wait_for(raw.wait_closed(), 10)
                finally:
                    raw.abort()  # without the fix the server would wait on it for ever
                assert await kv.get("v1") is not None  # the server serves others as before
        finally:
            await c.stop()


async def test_a_broken_stream_from_a_client_that_stops_reading_is_aborted(
        tmp_path: Path) -> None:
    """A frame that breaks the protocol gets an error frame and a close; a close waits to
    flush what is buffered, so from a peer that reads nothing it must end in an abort after
    send_timeout_s: nothing may hold the connection, its buffered answers and its slot in
    max_connections for ever."""
    c = _one_server(tmp_path, send_timeout_s=0.5)
    async with asyncio.timeout(60):
        await c.start()
        try:
            async with c.client() as kv:
                ranges = (await _ranges(kv, 4, MiB))[0]
                cs = c.chunkservers[0]
                assert cs is not None
                raw, proto, _ = await chunkserver_connection(c)
                try:
                    assert raw._proto.transport is not None
                    raw._proto.transport.pause_reading()  # never reads an answer
                    loop = asyncio.get_running_loop()
                    deadline = loop.time() + 20
                    rid = 1000
                    while proto.writable():  # until its answers fill the socket
                        assert loop.time() < deadline, "the server's writes never backed up"
                        raw._proto.write([frame_bytes(Op.READV, rid, {"ranges": ranges[:1]})])
                        rid += 1
                        await asyncio.sleep(0.01)
                    raw._proto.write([b"not a frame" * 4])  # the server answers and closes
                    while proto in cs.rpc.connections:
                        assert loop.time() < deadline, (
                            "a connection closed for a protocol error waits for ever on a peer "
                            f"that reads nothing ({proto.inflight_requests} requests in flight)")
                        await asyncio.sleep(0.02)
                    assert proto.transport is not None and proto.transport.is_closing()
                finally:
                    raw.abort()
                assert await kv.get("v1") is not None  # the server serves others as before
        finally:
            await c.stop()


async def test_a_broken_stream_from_a_server_that_stops_reading_is_aborted(
        tmp_path: Path) -> None:
    """The client's side of the same: a server that sends a frame breaking the protocol
    and reads nothing (fault injection: the real server's end of the connection paused and
    fed bad bytes) while the client has requests buffered for it.  The client aborts at
    once: a close would wait for ever to flush them (the server's idle timer, 300 s, is all
    that would end it), and the calls waiting on the connection fail now, with the protocol
    error, not at their timeout."""
    c = _one_server(tmp_path)
    async with asyncio.timeout(60):
        await c.start()
        try:
            cs = c.chunkservers[0]
            assert cs is not None
            raw, proto, _ = await chunkserver_connection(c)
            try:
                assert raw._proto.transport is not None
                assert proto.transport is not None
                proto.transport.pause_reading()  # the server reads nothing more
                raw._proto.write([bytes(64 * MiB)])  # more than the sockets hold: buffered
                assert not raw._proto.writable()
                waiting = asyncio.ensure_future(raw.call(rpc.Lookup(keys=[b"k"]), timeout_s=60))
                proto.transport.write(b"not a frame" * 4)
                async with asyncio.timeout(20):  # the call's own timeout is 60 s
                    with pytest.raises(RemoteProtocolError, match="bad frame magic"):
                        await waiting
                    await raw._proto.closed.wait()
            finally:
                raw.abort()
        finally:
            await c.stop()


def test_bad_requests_are_logged_once_per_peer_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    plog = RateLimitedLog(logging.getLogger("kvfs.server"), 60.0, held="from this host")
    with caplog.at_level(logging.WARNING, logger="kvfs.server"):
        for _ in range(1000):
            plog.warning("10.0.0.1", "bad request from %s", "10.0.0.1:1234")
        plog.warning("10.0.0.2", "bad request from %s", "10.0.0.2:99")
    assert [r.getMessage() for r in caplog.records] == [
        "bad request from 10.0.0.1:1234", "bad request from 10.0.0.2:99"]
    plog.interval_s = 0.0
    with caplog.at_level(logging.WARNING, logger="kvfs.server"):
        plog.warning("10.0.0.1", "bad request from %s", "x")
    assert "999 more from this host" in caplog.records[-1].getMessage()
    few = RateLimitedLog(logging.getLogger("kvfs.server"), 60.0, max_subjects=3)
    for i in range(50):  # each within the interval: the oldest forgotten, never more than 3
        few.warning(f"10.0.1.{i}", "bad request from %s", i)
        assert len(few._last) <= 3


@pytest.mark.subprocess
async def test_everything_kvfs_up_creates_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       local_meta: str) -> None:
    """Data dirs 0700; chunk files, meta's store (RocksDB's files, or SQLite's), state, locks
    and tokens 0600."""
    monkeypatch.setenv("KVFS_CONFIG_DIR", str(tmp_path / "config"))
    pc = ProcessCluster(tmp_path / "data", 2, listen="127.0.0.1:0", gc=True)
    await pc.start()
    try:
        pc.write_user_token()
        async with pc.client() as kv:
            await kv.put_many({f"k{i}": os.urandom(4096) for i in range(10)})
    finally:
        await pc.stop()
    store = "CURRENT" if local_meta == "rocksdb" else ".sqlite3"  # (one file of each store)
    seen = {".chunk": 0, store: 0, "token": 0}
    for root in (tmp_path / "data", tmp_path / "config" / "tokens"):
        for p in [root, *root.rglob("*")]:
            mode = p.stat().st_mode & 0o777
            if p.is_dir():
                assert mode == 0o700, f"{p} is {mode:o}"
            else:
                assert mode == 0o600, f"{p} is {mode:o}"
                for end in seen:
                    seen[end] += p.name.endswith(end)
    assert seen[".chunk"] >= 1 and seen[store] == 1 and seen["token"] == 3


def test_chunk_files_are_kept_open_in_an_lru(tmp_path: Path) -> None:
    async def main() -> None:
        store = ChunkStore(tmp_path / "cs", chunk_bytes=8192, max_open_files=2)
        store.server_id = 1
        try:
            locs = []
            for i in range(6):  # each append fills a chunk: 6 chunk files
                value = bytes([i]) * 6000
                (loc,) = await store.append([[b"k%d" % i, len(value), crc32c(value), None]],
                                            memoryview(value))
                locs.append((loc, value))
            assert len(store.sizes) == 6
            for (cid, off), value in locs * 2:
                views, errors = await store.readv([(cid, off, len(value))])
                assert not errors and views[0] == value
                assert len(store._fds) <= 2
        finally:
            await store.close()

    asyncio.run(main())


def test_a_server_raises_its_file_limit_to_the_hard_limit() -> None:
    import resource

    raise_nofile_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY


async def test_a_packed_commit_is_bounded_by_metas_max_header_bytes(tmp_path: Path) -> None:
    """A COMMIT's packed layouts (kvfs.packed) travel in its header: meta's
    ``max_header_bytes`` bounds them, checked on the fixed header before the blob is read."""
    from kvfs.layout import Extent, Layout, Replica
    from kvfs.packed import pack

    c = LocalCluster(tmp_path / "c", 1, meta=MetaConfig(data=tmp_path / "c" / "meta",
                                                        listen="127.0.0.1:0", max_header_bytes=64 * 1024))
    await c.start()
    try:
        host, port = parse_addr(c.addr)
        lay = Layout(1, 0, 0.0, None, (Extent(1, 0, (Replica(999, 999 << 40, 0),)),))

        def commit(n: int) -> rpc.Commit:
            return rpc.Commit(packed=pack([b"k%063d" % i for i in range(n)], [lay] * n))

        assert len(commit(400).packed or b"") < 64 * 1024
        assert len(commit(2000).packed or b"") > 64 * 1024
        conn = await Connection.open(host, port, c.token)
        try:  # under the limit: read and checked (the server named is unknown)
            with pytest.raises(InvalidArgument, match="unknown chunkserver 999"):
                await conn.call(commit(400))
        finally:
            conn.close()
        conn = await Connection.open(host, port, c.token)
        assert conn.max_header == 64 * 1024  # (meta said so in its AUTH answer)
        conn.max_header = 0  # as a client that does not check: the server's own check
        try:
            with pytest.raises(FrameTooLarge, match="exceeds the limit of 65536"):
                await conn.call(commit(2000))
        finally:
            conn.close()
        async with c.client() as kv:  # meta still serves
            await kv.put("after", b"v")
            assert await kv.get("after") == b"v"
    finally:
        await c.stop()


async def test_a_request_past_the_servers_limit_is_refused_unsent_and_fails_no_other_call(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request larger than meta takes (``max_header_bytes``, which it tells each client
    at AUTH) fails in the caller, naming the RPC, the sizes and what to do, and is never
    sent: sent, meta would close the shared connection, failing the other calls on it
    (with 400k keys of 64 bytes, 8 concurrent small calls failed so).  The blocking
    client's own sockets check the same (meta closes none of them either).  (The client's
    batch calls cut themselves under the limit: the next test; these requests are made
    whole, past that.)"""
    c = LocalCluster(tmp_path / "c", 1, meta=MetaConfig(data=tmp_path / "c" / "meta",
                                                        listen="127.0.0.1:0", max_header_bytes=64 * 1024))
    await c.start()
    try:
        async with c.client() as kv:
            await kv.put_many([(b"small%d" % i, b"x") for i in range(10)])
            small = [b"small%d" % i for i in range(10)]
            big = [b"k%063d" % i for i in range(2000)]  # ~132 KB of keys
            stop = asyncio.Event()
            answers: list[list[bool]] = []

            async def others() -> None:
                while not stop.is_set():
                    answers.append(await kv.exists_many(small))

            task = asyncio.create_task(others())
            async with asyncio.timeout(30):
                while not answers and not task.done():  # (the other calls are under way)
                    await asyncio.sleep(0)
                for request in (rpc.Exists(keys=big), rpc.Lookup(keys=big), rpc.MatchPrefix(keys=big)):
                    with pytest.raises(FrameTooLarge, match=r"request header of \d+ bytes exceeds the "
                                       r"limit of 65536 that .* takes \(--max-header\); not sent: split "
                                       r"the batch"):
                        await kv.link.call_meta(request)
                seen = len(answers)
                while len(answers) < seen + 3 and not task.done():  # more calls, answered
                    await asyncio.sleep(0)
                assert not task.done(), task  # (an error of the other calls: raised here)
                stop.set()
                await task
            assert all(a == [True] * 10 for a in answers)
            assert await kv.link.call_meta(rpc.Exists(keys=big[:400]))  # under the limit: sent

        def blocking() -> None:
            with kvfs.Client(c.addr, token=c.token) as bk:
                assert bk.exists_many(small) == [True] * 10  # (its own socket to meta, open)
                with pytest.raises(FrameTooLarge, match="not sent: split the batch"):
                    bk._meta_sockets.call(rpc.Exists(keys=big))
                assert bk.exists_many(small) == [True] * 10

        await asyncio.to_thread(blocking)
        closed = [r.getMessage() for r in caplog.records if "exceeds the limit" in r.getMessage()
                  and "closing" in r.getMessage()]
        assert not closed, closed  # meta never had to close a connection for its size
    finally:
        await c.stop()


@pytest.mark.parametrize("key_bytes", [64, 1024])
async def test_batch_calls_past_the_servers_limit_are_made_in_parts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, key_bytes: int) -> None:
    """Every batch call whose request would pass the limit the servers told the client
    (here 64 KiB: 2,000 keys of 64 bytes are about 132 KB of keys) is cut into parts made
    one after another (``ClientConfig.call_max_bytes``: half the smallest ``--max-header``),
    and answers as one call would: nothing is refused, no server closes a connection."""
    tiny = dict(max_header_bytes=64 * 1024)
    c = LocalCluster(tmp_path / "c", 2,
                     meta=MetaConfig(data=tmp_path / "c" / "meta", listen="127.0.0.1:0", **tiny),
                     chunkserver=ChunkServerConfig(data=tmp_path / "c", heartbeat_interval_s=0.2,
                                                   **tiny))
    await c.start()
    keys = [b"k%0*d" % (key_bytes - 1, i) for i in range(2000)]
    try:
        async with c.client(ClientConfig(replicas=2)) as kv:
            counts = kv.rpc_counts
            assert await kv.put_many([(k, k[-8:]) for k in keys[:1500]]) == [True] * 1500
            assert counts["COMMIT"] >= 6, dict(counts)  # (a key counts its bytes + 64 + 24 a replica: 28 KiB a part)
            metas = [{"i": i, "dtype": "bfloat16", "shape": [8, 128]} for i in range(500)]
            assert await kv.put_many([(k, k[-8:]) for k in keys[1500:]], meta=metas) == [True] * 500
            assert await kv.put_many([(k, b"again") for k in keys[1000:]], if_absent=True) \
                == [False] * 1000
            assert await kv.get_many(keys) == [k[-8:] for k in keys]
            assert await kv.get_meta(keys[1400:1600]) == [{}] * 100 + metas[:100]
            assert await kv.get_ranges([(k, 2, 5) for k in keys]) == [k[-6:-3] for k in keys]
            bufs = [bytearray(8) for _ in keys]
            assert await kv.get_into([*keys, b"absent"], [*bufs, bytearray(8)]) == [8] * 2000 + [kvfs.MISS]
            assert [bytes(b) for b in bufs] == [k[-8:] for k in keys]
            assert await kv.exists_many([*keys, b"absent"]) == [True] * 2000 + [False]
            assert await kv.match_prefix(keys) == 2000
            assert await kv.match_prefix([*keys[:1700], b"absent", *keys[1700:]], lease_s=60) == 1700
            assert await kv.release(keys) == 1700
            lookups = counts["LOOKUP"]
            kv.layout_cache.clear()
            assert await kv.get_many(keys) == [k[-8:] for k in keys]
            assert counts["LOOKUP"] - lookups >= 4  # (a key counts its bytes + 4: 28 KiB a part)

            def blocking() -> None:
                with kvfs.Client(c.addr, token=c.token) as bk:
                    assert bk.exists_many(keys) == [True] * 2000
                    assert bk.match_prefix(keys, lease_s=60) == 2000
                    assert bk.release(keys) == 2000
                    assert bk.get_many(keys) == [k[-8:] for k in keys]
                    out = [bytearray(8) for _ in keys]
                    assert bk.get_into(keys, out) == [8] * 2000
                    assert [bytes(b) for b in out] == [k[-8:] for k in keys]

            await asyncio.to_thread(blocking)
            assert await kv.delete_many(keys[:1800]) == 1800
            assert await kv.exists_many(keys) == [False] * 1800 + [True] * 200
        refused = [r.getMessage() for r in caplog.records if "exceeds the limit" in r.getMessage()]
        assert not refused, refused
    finally:
        await c.stop()


async def test_a_batch_call_of_more_than_call_max_keys_is_made_in_parts(tmp_path: Path) -> None:
    """``call_max_keys`` bounds the keys of one request (and so meta's answer to it)."""
    c = LocalCluster(tmp_path / "c", 1)
    await c.start()
    try:
        async with c.client(ClientConfig(call_max_keys=100, batch=False)) as kv:
            keys = [b"key%d" % i for i in range(350)]
            assert await kv.put_many([(k, k) for k in keys]) == [True] * 350
            assert kv.rpc_counts["COMMIT"] == 4
            assert await kv.exists_many(keys) == [True] * 350
            assert kv.rpc_counts["EXISTS"] == 4
            assert await kv.match_prefix([*keys[:150], b"absent", *keys[150:]]) == 150
            assert kv.rpc_counts["MATCH_PREFIX"] == 2  # (stopped at the part with the miss)
        with pytest.raises(ValueError, match="call_max_keys must be >= 1, got 0"):
            ClientConfig(call_max_keys=0)
        with pytest.raises(ValueError, match="call_max_bytes must be >= 64 KiB"):
            ClientConfig(call_max_bytes=1000)
    finally:
        await c.stop()
