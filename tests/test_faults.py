"""Bad input and faults: each gives a clear error, no server dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import raw_connect as _raw
from conftest import read_frame as _read_frame

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.chunkserver.records import RECORD
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig
from kvfs.errors import (
    AuthError,
    ChecksumMismatch,
    FrameTooLarge,
    InvalidArgument,
    RemoteProtocolError,
    StaleLayout,
    Timeout,
    Unavailable,
    VersionMismatch,
    from_wire,
)
from kvfs.launcher import LocalCluster, ProcessCluster
from kvfs.layout import Replica
from kvfs.protocol import (
    FIXED,
    MAGIC,
    PROTOCOL_VERSION,
    frame_bytes,
)
from kvfs.rpc import Op
from kvfs.transport import Connection


async def _assert_serving(cluster: LocalCluster) -> None:
    async with cluster.client() as kv:
        await kv.put(b"still", b"alive")
        assert await kv.get(b"still") == b"alive"


async def _first_replica(cluster: LocalCluster, kv: AsyncClient, key: bytes) -> tuple[int, Replica, Path]:
    """(chunkserver index, replica, chunk file) of the first extent of ``key``."""
    layout = await kv.layout(key)
    assert layout is not None
    rep = layout.extents[0].replicas[0]
    idx = cluster.index_of(rep.server_id)
    cs = cluster.chunkservers[idx]
    assert cs is not None
    return idx, rep, cs.store.chunk_path(rep.chunk_id)


async def test_wrong_token(cluster: LocalCluster) -> None:
    with pytest.raises(AuthError, match="wrong cluster token"):
        async with AsyncClient(cluster.addr, token="not-the-token"):
            pass
    await _assert_serving(cluster)


async def test_no_token_anywhere(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVFS_TOKEN", raising=False)
    monkeypatch.setenv("KVFS_CONFIG_DIR", str(tmp_path / "empty"))
    with pytest.raises(AuthError, match="no token for"):
        AsyncClient(cluster.addr)


async def test_wrong_protocol_version_in_auth(cluster: LocalCluster) -> None:
    reader, writer, _ = await _raw(cluster.addr)
    writer.write(frame_bytes(Op.AUTH, 1, {"version": 99, "mac": b"x"}))
    err = await _read_frame(reader)
    assert err.is_error and isinstance(from_wire(err.header), VersionMismatch)
    assert "99" in err.header["message"]
    writer.close()
    await _assert_serving(cluster)


async def test_wrong_protocol_version_in_frame(cluster: LocalCluster) -> None:
    reader, writer, _ = await _raw(cluster.addr)
    writer.write(frame_bytes(Op.AUTH, 1, {}, version=7))
    err = await _read_frame(reader)
    assert isinstance(from_wire(err.header), VersionMismatch)
    assert await reader.read() == b""  # that connection is closed
    writer.close()
    await _assert_serving(cluster)


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 16,
                                     os.urandom(64)])
async def test_garbage_frame(cluster: LocalCluster, garbage: bytes) -> None:
    reader, writer, _ = await _raw(cluster.addr)
    writer.write(garbage)
    err = await _read_frame(reader)
    assert isinstance(from_wire(err.header), RemoteProtocolError)
    writer.close()
    await _assert_serving(cluster)


async def test_truncated_frame_then_close(cluster: LocalCluster) -> None:
    _, writer, _ = await _raw(cluster.addr)
    writer.write(frame_bytes(Op.AUTH, 1, {"version": 1}, [b"x" * 100])[:40])
    writer.close()
    await writer.wait_closed()
    await _assert_serving(cluster)


async def test_100gib_payload_is_refused(cluster: LocalCluster) -> None:
    cs = cluster.chunkservers[0]
    assert cs is not None
    reader, writer, _ = await _raw("kvfs://" + cs.addr)
    writer.write(FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.APPEND, 0, 1, 0, 100 << 30))
    err = await _read_frame(reader)
    assert isinstance(from_wire(err.header), FrameTooLarge)
    assert "107374182400" in err.header["message"]
    writer.close()
    await _assert_serving(cluster)


async def test_malformed_request_gets_error_and_server_keeps_serving(cluster: LocalCluster) -> None:
    host, port = parse_addr(cluster.addr)
    conn = await Connection.open(host, port, cluster.token)
    try:
        with pytest.raises(InvalidArgument, match=r"bad LOOKUP request.*no_keys"):
            await conn.call_raw(Op.LOOKUP, {"no_keys": 1})
        with pytest.raises(InvalidArgument, match=r"bad LOOKUP request.*\$\.keys\[1\]"):
            await conn.call_raw(Op.LOOKUP, {"keys": [b"a", 7]})
        with pytest.raises(InvalidArgument, match="not served"):
            await conn.call_raw(Op.READV, {"ranges": []})
        with pytest.raises(InvalidArgument, match="unknown chunkserver"):
            await conn.call_raw(Op.COMMIT, {"items": [[b"k", [1, 0, 0.0, None, [[1, 0, [[999, 999 << 40, 0]]]]]]]})
        with pytest.raises(InvalidArgument, match=r"^layout for b'k': chunk id 0x3e70000000001 is "
                                                  r"chunkserver 999's, not chunkserver 1's"):
            await conn.call_raw(Op.COMMIT, {"items": [[b"k", [1, 0, 0.0, None, [[1, 0, [[1, 999 << 40 | 1, 0]]]]]]]})
        assert (await conn.call(rpc.Ping())).service == "meta"
    finally:
        conn.close()


async def test_append_with_bad_crc_is_refused(cluster: LocalCluster) -> None:
    cs = cluster.chunkservers[0]
    assert cs is not None
    host, port = parse_addr(cs.addr)
    conn = await Connection.open(host, port, cluster.token)
    try:
        with pytest.raises(ChecksumMismatch, match="arrived corrupted"):
            await conn.call(rpc.Append(records=[rpc.RecordHead(b"k", 3, 12345, None)]), [b"abc"])
        with pytest.raises(InvalidArgument, match="describe"):
            await conn.call(rpc.Append(records=[rpc.RecordHead(b"k", 30, 0, None)]), [b"abc"])
    finally:
        conn.close()


async def test_unknown_server_address(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a bound, never-listening port: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(Unavailable, match=f"127.0.0.1:{port}"):
            async with AsyncClient(f"kvfs://127.0.0.1:{port}", token="t"):
                pass
    with pytest.raises(InvalidArgument, match="bad address"):
        AsyncClient("http://nowhere", token="t")


async def test_flipped_byte_is_a_checksum_error(cluster: LocalCluster, kv: AsyncClient) -> None:
    value = os.urandom(10_000)
    await kv.put(b"victim", value)
    layout = await kv.layout(b"victim")
    assert layout is not None
    rep = layout.extents[0].replicas[0]
    cs = next(c for c in cluster.chunkservers if c and c.server_id == rep.server_id)
    path = cs.store.chunk_path(rep.chunk_id)
    with open(path, "r+b") as f:
        f.seek(rep.offset + 1234)
        b = f.read(1)
        f.seek(rep.offset + 1234)
        f.write(bytes([b[0] ^ 0xFF]))
    async with cluster.client(ClientConfig(on_lost="raise")) as strict:
        with pytest.raises(ChecksumMismatch, match="victim"):
            await strict.get(b"victim")
    assert await kv.get(b"victim") is None  # the default, on_lost="miss" (tests/test_lost.py)


async def test_torn_tail_is_truncated_on_restart(cluster: LocalCluster, kv: AsyncClient) -> None:
    await kv.put_many({b"t1": b"a" * 5000, b"t2": b"b" * 5000})
    idx, _, path = await _first_replica(cluster, kv, b"t2")
    await cluster.stop_chunkserver(idx)
    with open(path, "ab") as f:  # a record header with half its value: a crash mid-append
        f.write(RECORD.pack(b"KVR2", 1, 0, 0, 4096, 0.0, 0, 4096, 0, 0, 0) + b"k" + b"z" * 100)
    size_with_torn = path.stat().st_size
    await cluster.start_chunkserver(idx)
    assert path.stat().st_size == size_with_torn - RECORD.size - 101
    kv.layout_cache.clear()
    assert await kv.get_many([b"t1", b"t2"]) == [b"a" * 5000, b"b" * 5000]


async def test_missing_bytes_are_detected(cluster: LocalCluster, kv: AsyncClient) -> None:
    await kv.put(b"gone", b"x" * 5000)
    idx, rep, path = await _first_replica(cluster, kv, b"gone")
    await cluster.stop_chunkserver(idx)
    os.truncate(path, rep.offset)  # the committed bytes are lost
    await cluster.start_chunkserver(idx)
    async with cluster.client(ClientConfig(on_lost="raise")) as strict:
        with pytest.raises(StaleLayout, match="gone"):
            await strict.get(b"gone")


# real processes -----------------------------------------------------------------
@pytest.mark.subprocess
async def test_sigkill_chunkserver_while_reading(proc_cluster: ProcessCluster) -> None:
    async with proc_cluster.client(config=ClientConfig(on_lost="raise")) as kv:
        for i in range(60):  # separate puts: placement spreads them over the servers
            await kv.put(f"k{i}", os.urandom(200_000))
        layouts = [await kv.layout(f"k{i}") for i in range(60)]
        servers = await kv.servers()
        victim_sid = layouts[0].extents[0].replicas[0].server_id  # type: ignore[union-attr]
        victim_addr = next(s.addr for s in servers if s.server_id == victim_sid)
        victim = next(p for p in proc_cluster.chunkservers if victim_addr in p.ready_line)

        async def reader() -> None:
            for _ in range(1000):
                await kv.get_many([f"k{i}".encode() for i in range(60)])

        task = asyncio.create_task(reader())
        await kv.get(b"k0")
        victim.kill(signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(Unavailable, match=f"chunkserver {victim_sid}"):
            await task
        assert time.monotonic() - start < 30  # bounded: no hang
        # keys that lived elsewhere are still readable
        others = [f"k{i}".encode() for i, lay in enumerate(layouts)
                  if lay and all(r.server_id != victim_sid for e in lay.extents for r in e.replicas)]
        assert others and None not in await kv.get_many(others)


@pytest.mark.subprocess
async def test_restarts_keep_committed_data(proc_cluster: ProcessCluster) -> None:
    items = {f"r{i}".encode(): os.urandom(1000 + i) for i in range(500)}
    items[b"big"] = os.urandom(5 << 20)
    async with proc_cluster.client() as kv:
        await kv.put_many(items)
    await proc_cluster.restart_chunkserver(0)
    await proc_cluster.restart_meta()
    async with proc_cluster.client() as kv:
        assert await kv.get_many(list(items)) == list(items.values())
        st = await kv.stats()
        assert st["keys"] == len(items)


async def test_key_deleted_while_its_bytes_vanish_is_a_miss(cluster: LocalCluster, kv: AsyncClient) -> None:
    await kv.put(b"d", b"x" * 5000)
    idx, rep, path = await _first_replica(cluster, kv, b"d")  # the layout is now cached by kv
    async with cluster.client() as other:
        assert await other.delete(b"d")
    await cluster.stop_chunkserver(idx)
    os.truncate(path, rep.offset)  # as if GC reclaimed the chunk after the delete
    await cluster.start_chunkserver(idx)
    assert await kv.get_many([b"d"]) == [None]  # the stale cached layout is refreshed: a clean miss
    assert await kv.get_into([b"d"], [bytearray(5000)]) == [-1]


async def test_reads_from_cached_layouts_reach_meta_lru(cluster: LocalCluster, kv: AsyncClient,
                                                        clock: object) -> None:
    await kv.put(b"hot", b"v")
    meta = cluster.meta
    assert meta is not None
    before = meta.index.last_access(b"hot")
    clock.advance(100)  # type: ignore[attr-defined]
    for _ in range(3):
        assert await kv.get_many([b"hot"]) == [b"v"]  # served from the layout cache
    await kv.close()  # flushes pending touches
    assert meta.index.last_access(b"hot") == before + 100


async def test_corrupt_replica_falls_back_to_a_good_one(cluster: LocalCluster, kv: AsyncClient) -> None:
    value = os.urandom(50_000)
    await kv.put(b"two", value, replicas=2)
    layout = await kv.layout(b"two")
    assert layout is not None
    rep = layout.extents[0].replicas[0]
    cs = next(c for c in cluster.chunkservers if c and c.server_id == rep.server_id)
    with open(cs.store.chunk_path(rep.chunk_id), "r+b") as f:
        f.seek(rep.offset + 10)
        f.write(bytes([value[10] ^ 0x01]))
    assert await kv.get(b"two") == value  # the first replica fails its CRC; the second is read


async def test_an_answer_cut_short_times_out_saying_it_began(cluster: LocalCluster, kv: AsyncClient,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunkserver that stops in the middle of a READV answer (fault injection: its
    connections write the answer's header and first 1,000 payload bytes, then nothing of
    it): the read times out, and the error says the answer began and how much of it came,
    not that there was no answer."""
    from kvfs.server import _ServerProtocol

    value = os.urandom(100_000)  # under sendfile_min_bytes: the answer is written, not sendfile'd
    await kv.put(b"cut", value)
    write = _ServerProtocol.write

    def cut(self: _ServerProtocol, buffers: list[bytes | bytearray | memoryview], nbytes: int = -1) -> None:
        data = b"".join(buffers)
        _, _, op, _, _, hlen, plen = FIXED.unpack_from(data)
        if op == Op.READV and plen:
            data = data[:FIXED.size + hlen + 1000]
        write(self, [data])

    monkeypatch.setattr(_ServerProtocol, "write", cut)
    async with cluster.client(ClientConfig(on_lost="raise", request_timeout_s=2.0)) as reader:
        with pytest.raises(Unavailable, match=r"READV to \S+: its answer began but did not end within "
                                              r"2\.0s \(1000 of its \d+ payload bytes received\)"):
            await reader.get(b"cut")


async def test_calls_to_a_server_that_stops_reading_time_out(cluster: LocalCluster) -> None:
    """A server that stops reading (fault injection: its side of the connection pauses):
    one call's bytes fill the write buffer, so a second call waits for room to write; both
    end with the request timeout (the waiting one too, not only the one whose answer never
    came), and the connection is closed, not left half closed for later calls to wait on."""
    assert cluster.meta is not None
    host, port = parse_addr(cluster.addr)
    conn = await Connection.open(host, port, cluster.token, request_timeout_s=0.5)
    try:
        for sc in cluster.meta.rpc.connections:
            assert sc.transport is not None
            sc.transport.pause_reading()
        big = asyncio.ensure_future(conn.call_raw(Op.PING, None, [bytes(64 * 1024 * 1024)]))
        small = asyncio.ensure_future(conn.call(rpc.Ping()))
        async with asyncio.timeout(30):  # a hang fails here, not the run
            done = await asyncio.gather(big, small, return_exceptions=True)
            await conn.wait_closed()
        assert all(isinstance(e, Unavailable) for e in done), done
        with pytest.raises(Unavailable):
            await conn.call(rpc.Ping())
    finally:
        conn.close()


async def test_each_call_times_out_at_its_own_deadline(cluster: LocalCluster) -> None:
    """A connection's calls share one timer (set for the earliest deadline): a call with a
    shorter timeout than one already waiting times out at its own, and a call made after an
    answered one times out when the timer, fired for the answered call's deadline, is set
    again for it (fault injection: meta's side of the connection stops reading)."""
    assert cluster.meta is not None
    host, port = parse_addr(cluster.addr)
    for first_answered in (False, True):
        conn = await Connection.open(host, port, cluster.token, request_timeout_s=60.0)
        try:
            if first_answered:  # its deadline, 2 s on, is where the timer is set (room
                await conn.call(rpc.Ping(), timeout_s=2.0)  # for its answer on a busy machine)
            for sc in cluster.meta.rpc.connections:
                assert sc.transport is not None
                sc.transport.pause_reading()
            waiting = asyncio.ensure_future(conn.call(rpc.Ping()))  # the 60 s timeout
            await asyncio.sleep(0)  # (sent: its deadline is the timer's unless a call's is earlier)
            async with asyncio.timeout(20):  # a hang (its timer never set) fails here
                with pytest.raises(Timeout, match=r"PING to \S+ got no answer within 3\.0s"):
                    await conn.call(rpc.Ping(), timeout_s=3.0)  # (its deadline after the timer's)
                with pytest.raises(Unavailable):  # the timed-out call aborted the connection
                    await waiting
        finally:
            conn.close()
            for sc in cluster.meta.rpc.connections:
                if sc.transport is not None and not sc.transport.is_closing():
                    sc.transport.resume_reading()
