"""READV answers sent from the chunk files with sendfile (``ChunkStore.readv_files``,
``kvfs/fileparts.py``, ``FrameProtocol.send_file``): every byte right through partial
sends and a reader that pauses, one frame at a time on a connection, a reader that stops
reading aborted (bounded), a chunk deleted mid-send still sent whole, a chunk cut short
mid-send ending the connection (never wrong or misframed bytes).  Real servers and sockets;
the pausing reader is a real client whose transport stops reading."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import chunkserver_connection
from crc32c import crc32c
from pagecache import warm
from poll import until

from kvfs import rpc
from kvfs.chunkserver import store as store_mod
from kvfs.chunkserver.service import ChunkServer
from kvfs.chunkserver.store import ChunkStore, resident
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, ClientConfig, MetaConfig
from kvfs.errors import InvalidArgument, Unavailable
from kvfs.fileparts import FileParts, ShortFile
from kvfs.launcher import LocalCluster
from kvfs.protocol import frame_bytes
from kvfs.rpc import Op
from kvfs.server import _ServerProtocol
from kvfs.transport import Connection

MiB = 1024 * 1024


# FileParts on its own -------------------------------------------------------------------
def _pair(sndbuf: int = 64 * 1024) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    a.setblocking(False)
    return a, b


def test_parts_send_what_the_socket_takes_and_go_on_where_they_stopped(tmp_path: Path) -> None:
    data = os.urandom(3 * MiB)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    segs = [(fd, 100, MiB), (fd, 2 * MiB, 500_000), (fd, 1_500_000, 10), (fd, 7, 0)]
    want = data[100 : 100 + MiB] + data[2 * MiB : 2 * MiB + 500_000] + data[1_500_000 : 1_500_010]
    a, b = _pair()
    with a, b, FileParts(segs, [fd]) as parts:
        assert parts.nbytes == len(want)
        got = bytearray()
        sends = []
        while not parts.done:
            sends.append(parts.send(a.fileno()))  # until the socket is full (no exception)
            got += b.recv(4 * MiB)
        a.shutdown(socket.SHUT_WR)
        while chunk := b.recv(4 * MiB):
            got += chunk
    assert bytes(got) == want
    assert len(sends) > 3 and all(n > 0 for n in sends)  # many partial sends, each went on
    with pytest.raises(OSError):
        os.fstat(fd)  # the parts owned it: closed


def test_a_file_cut_short_is_short_file_in_send_and_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(2 * MiB))
    fd = os.open(path, os.O_RDONLY)
    os.truncate(path, MiB + 5)
    a, b = _pair(4 * MiB)
    with a, b, FileParts([(fd, MiB, MiB)], [fd]) as parts:
        with pytest.raises(ShortFile, match=f"file ended at {MiB + 5}"):
            while not parts.done:
                parts.send(a.fileno())
                b.recv(4 * MiB)
        with pytest.raises(ShortFile):
            parts.read()


def test_parts_read_the_bytes_of_a_deleted_file_through_their_own_fd(tmp_path: Path) -> None:
    data = os.urandom(MiB)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    own = os.dup(fd)
    parts = FileParts([(own, 10, 1000), (own, 5000, 20)], [own])
    os.close(fd)
    path.unlink()
    assert bytes(parts.read()) == data[10:1010] + data[5000:5020]
    parts.close()


@pytest.mark.parametrize("ask", ["cachestat", "mincore"])
def test_resident_says_whether_the_page_cache_holds_a_range(
        tmp_path: Path, ask: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pc = store_mod._page_cache()
    assert pc is not None
    if ask == "mincore":
        monkeypatch.setattr(pc, "cachestat", False)  # as where the kernel has no cachestat(2)
    elif not pc.cachestat:
        pytest.skip("this kernel refuses cachestat(2)")
    path = tmp_path / "f"
    path.write_bytes(os.urandom(MiB))
    warm(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert resident(fd, 5, MiB - 5)  # just read: every page cached
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
        if resident(fd, 0, MiB):
            pytest.skip("this filesystem keeps the pages (tmpfs)")
        os.pread(fd, 4096, 8192)
        assert resident(fd, 8192, 4096) and resident(fd, 8200, 100)
        assert not resident(fd, 8192, 8193)
    finally:
        os.close(fd)


# the store's side -----------------------------------------------------------------------
async def _chunks(st: ChunkStore, n: int, size: int = 3000) -> list[tuple[int, int, int]]:
    """``n`` sealed chunks of one value each: their (chunk, offset, length)."""
    out = []
    for i in range(n):
        value = bytes([i + 1]) * size
        ((cid, off),) = await st.append([(b"k%d" % i, size, crc32c(value), None)], memoryview(value))
        assert await st.seal(cid, 0.0)
        out.append((cid, off, size))
    return out


async def test_readv_files_lends_at_most_max_open_files_fds(tmp_path: Path) -> None:
    st = ChunkStore(tmp_path / "cs", chunk_bytes=64 * 1024, preallocate=False, max_open_files=2)
    st.server_id = 1
    try:
        r = await _chunks(st, 3)
        warm(*(st.chunk_path(c) for c, _, _ in r))  # cached: only the fd budget says no below
        first, errors = st.readv_files([r[0], r[1], (999, 0, 1)], 1)
        assert first is not None and list(errors) == [2] and st.lent_fds == 2
        assert st.readv_files([r[2]], 1)[0] is None  # the budget is lent: read into a buffer
        assert bytes(first.read()) == b"\x01" * 3000 + b"\x02" * 3000
        first.close()
        assert st.lent_fds == 0
        third, _ = st.readv_files([r[2]], 1)
        assert third is not None and bytes(third.read()) == b"\x03" * 3000
        third.close()
    finally:
        await st.close()


async def test_readv_files_leaves_small_ranges_and_cold_pages_to_readv_into(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = ChunkStore(tmp_path / "cs", chunk_bytes=64 * 1024, preallocate=False)
    st.server_id = 1
    try:
        r = await _chunks(st, 2)
        assert st.readv_files(r, 3001)[0] is None  # the ranges average 3000 bytes
        assert st.readv_files(r, 0)[0] is None  # 0: never
        monkeypatch.setattr(store_mod, "resident", lambda fd, off, ln: fd != -5 and off > 10**9)
        assert st.readv_files(r, 1)[0] is None  # not in the page cache: no send may wait on disk
        assert st.lent_fds == 0 and st.file_spans == 0
        views, errors = await st.readv(r)
        assert not errors and [bytes(v) for v in views if v is not None] == [b"\x01" * 3000, b"\x02" * 3000]
    finally:
        await st.close()


# through a chunkserver -------------------------------------------------------------------
@pytest.fixture
async def one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalCluster]:
    """One chunkserver (every range on it), a short send timeout, and every range a READV
    would send from the chunk files (``readv_files``) counted as held by the page cache:
    these tests are about the send, which a page evicted by a loaded machine (CI, stop 35:
    24 MiB just written, its READVs answered through a buffer) would take off the sendfile
    path.  A send of a page not held waits for the disk.  Views of mapped chunks
    (``readv_mapped``, which asks with the mapping's address) are still asked about."""
    real = store_mod.resident
    monkeypatch.setattr(store_mod, "resident", lambda fd, off, ln, addr=None:
                        addr is None or real(fd, off, ln, addr))
    c = LocalCluster(tmp_path / "c", 1,
                     meta=MetaConfig(data=tmp_path / "c" / "meta", listen="127.0.0.1:0"),
                     chunkserver=ChunkServerConfig(data=tmp_path / "c", heartbeat_interval_s=0.2,
                                                   send_timeout_s=1.0))
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def _cs(c: LocalCluster) -> ChunkServer:
    cs = c.chunkservers[0]
    assert cs is not None
    return cs


async def _ranges(kv: AsyncClient, keys: list[str]) -> list[list[int]]:
    out = []
    for k in keys:
        lay = await kv.layout(k)
        assert lay is not None
        for ext in lay.extents:
            rep = ext.replicas[0]
            out.append([rep.chunk_id, rep.offset, ext.length])
    return out


async def _raw(c: LocalCluster) -> tuple[Connection, _ServerProtocol]:
    """A connection of our own to the chunkserver, and the server's side of it."""
    conn, proto, _ = await chunkserver_connection(c)
    return conn, proto


async def test_large_reads_are_sent_from_the_chunk_files(one: LocalCluster) -> None:
    values = {f"big{i}": os.urandom(MiB - 1000 * i) for i in range(6)}
    values["striped"] = os.urandom(5 * MiB + 3)
    async with one.client() as kv:
        await kv.put_many(values)
        store = _cs(one).store
        before = store.file_spans
        bufs = [bytearray(len(v)) for v in values.values()]
        assert await kv.get_into(list(values), bufs) == [len(v) for v in values.values()]
        assert [bytes(b) for b in bufs] == list(values.values())
        assert await kv.get_many(list(values)) == list(values.values())
        assert store.file_spans - before >= 2 * len(values)
        # a READV mixing ranges that are gone with ranges that are there
        conn, _ = await _raw(one)
        try:
            ranges = await _ranges(kv, ["big1", "big3"])
            asked = [ranges[0], [ranges[0][0], 1 << 40, 10], [12345, 0, MiB], ranges[1]]
            head, payload = await conn.exchange(rpc.ReadV(ranges=asked))  # type: ignore[arg-type]
            assert sorted(head.errors) == [1, 2]
            assert bytes(payload) == values["big1"] + values["big3"]
        finally:
            conn.close()


async def test_file_answers_are_read_into_a_buffer_on_a_connection_without_a_socket(
        one: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's own fallback (a connection sendfile cannot write): the same bytes."""
    monkeypatch.setattr(_ServerProtocol, "can_send_files", property(lambda self: False))
    values = {f"nosock{i}": os.urandom(MiB - i) for i in range(6)}
    async with one.client() as kv:
        await kv.put_many(values)
        before = _cs(one).store.file_spans
        assert await kv.get_many(list(values)) == list(values.values())
        assert _cs(one).store.file_spans - before == len(values)


async def test_a_reader_that_pauses_mid_answer_gets_every_byte_and_frames_stay_whole(
        one: LocalCluster) -> None:
    """An answer larger than the sockets hold: the server sends what the socket takes, waits,
    goes on; a small answer and an error asked meanwhile on the same connection come after it,
    whole (the decoder would fail on an interleaved frame)."""
    values = {f"v{i}": os.urandom(MiB) for i in range(24)}
    values["small"] = os.urandom(4096)
    async with one.client() as kv:
        await kv.put_many(values)
        ranges = await _ranges(kv, [f"v{i}" for i in range(24)])
        small = await _ranges(kv, ["small"])
    conn, proto = await _raw(one)
    try:
        assert conn._proto.transport is not None
        conn._proto.transport.pause_reading()
        big = asyncio.ensure_future(conn.exchange(rpc.ReadV(ranges=ranges)))  # type: ignore[arg-type]
        await until(lambda: proto._raw_wait is not None, "the server to wait for room")
        also = asyncio.ensure_future(conn.exchange(rpc.ReadV(ranges=small)))  # type: ignore[arg-type]
        bad = asyncio.ensure_future(conn.exchange(rpc.ReadV(ranges=[[1, 2]])))  # type: ignore[list-item]
        await until(lambda: proto.inflight_requests == 2, "the small READV to wait its turn")
        assert proto._raw  # still the big answer's turn
        conn._proto.transport.resume_reading()
        async with asyncio.timeout(30):
            head, payload = await big
            assert not head.errors and bytes(payload) == b"".join(values[f"v{i}"] for i in range(24))
            assert bytes((await also)[1]) == values["small"]
            with pytest.raises(InvalidArgument, match="READV"):
                await bad
        assert not conn.is_closed
        assert proto.inflight_requests == 0 and proto.inflight_bytes == 0
    finally:
        conn.close()


async def test_concurrent_answers_on_one_connection_never_interleave(one: LocalCluster) -> None:
    values = {f"c{i}": os.urandom((i % 5) * 700_000 + 4096 * (i % 3) + 1) for i in range(40)}
    async with one.client(ClientConfig(batch=False)) as kv:
        await kv.put_many(values)
        keys = list(values)

        async def into(k: str) -> bytes:
            buf = bytearray(len(values[k]))
            assert await kv.get_into([k], [buf]) == [len(buf)]
            return bytes(buf)

        for _ in range(3):
            got = await asyncio.gather(*(into(k) if i % 2 else kv.get(k) for i, k in enumerate(keys)),
                                       kv.get_many(keys[:10]), kv.get("nope"))
            assert got[:-2] == [values[k] for k in keys]
            assert got[-2] == [values[k] for k in keys[:10]]
            assert got[-1] is None
        assert len(kv.connections()) == 2  # meta and the one chunkserver: all on one connection
    assert _cs(one).store.file_spans > 0


async def test_a_reader_that_stops_reading_mid_answer_is_aborted(
        one: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    values = {f"s{i}": os.urandom(MiB) for i in range(24)}
    async with one.client() as kv:
        await kv.put_many(values)
        ranges = await _ranges(kv, list(values))
        conn, proto = await _raw(one)
        try:
            assert conn._proto.transport is not None
            conn._proto.transport.pause_reading()  # for good
            with caplog.at_level(logging.INFO, logger="kvfs.server"):
                for rid in range(1000, 1004):
                    conn._proto.write([rpc_frame(rid, ranges)])
                await until(lambda: proto._raw_wait is not None, "the server to wait for room")
                await until(lambda: proto not in _cs(one).rpc.connections and not proto.tasks,
                             "the connection to be aborted")
            assert proto.inflight_requests == 0 and proto.inflight_bytes == 0
            assert any("send_timeout_s" in r.getMessage() for r in caplog.records)
        finally:
            conn.abort()
        assert await kv.get_many(list(values)[:3]) == list(values.values())[:3]  # others served


def rpc_frame(rid: int, ranges: list[list[int]]) -> bytes:
    return frame_bytes(Op.READV, rid, {"ranges": ranges})


async def _sealed(one: LocalCluster, kv: AsyncClient, values: dict[str, bytes],
                  ) -> tuple[int, list[list[int]]]:
    """Put ``values`` in one chunk, seal it; its id and the values' ranges."""
    await kv.put_many(values)
    ranges = await _ranges(kv, list(values))
    (cid,) = {r[0] for r in ranges}
    assert await _cs(one).store.seal(cid, 0.0)
    return cid, ranges


async def _held_answer(one: LocalCluster, ranges: list[list[int]],
                       ) -> tuple[Connection, asyncio.Future[Any]]:
    """A READV of ``ranges`` on a connection of our own that reads nothing (resume its
    reading to let the answer through), once the server's sendfile waits for room."""
    conn, proto = await _raw(one)
    try:
        assert conn._proto.transport is not None
        conn._proto.transport.pause_reading()
        answer = asyncio.ensure_future(conn.exchange(rpc.ReadV(ranges=ranges)))  # type: ignore[arg-type]
        await until(lambda: proto._raw_wait is not None, "the server to wait for room")
    except BaseException:
        conn.abort()
        raise
    return conn, answer


async def test_a_chunk_deleted_mid_send_is_still_sent_whole(one: LocalCluster) -> None:
    values = {f"d{i}": os.urandom(MiB) for i in range(24)}
    async with one.client() as kv:
        cid, ranges = await _sealed(one, kv, values)
    conn, answer = await _held_answer(one, ranges)
    try:
        assert conn._proto.transport is not None
        store = _cs(one).store
        assert cid in await store.delete_chunks([cid])
        assert not store.chunk_path(cid).exists()
        conn._proto.transport.resume_reading()
        async with asyncio.timeout(30):
            head, payload = await answer
        assert not head.errors and bytes(payload) == b"".join(values.values())
        # and a read now: the bytes are gone, a per-range error
        head, payload = await conn.exchange(rpc.ReadV(ranges=ranges[:1]))  # type: ignore[arg-type]
        assert list(head.errors) == [0] and not payload
    finally:
        conn.close()


async def test_a_chunk_cut_short_mid_send_ends_the_connection_never_wrong_bytes(
        one: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    values = {f"t{i}": os.urandom(MiB) for i in range(24)}
    async with one.client() as kv:
        cid, ranges = await _sealed(one, kv, values)
        conn, answer = await _held_answer(one, ranges)
        try:
            assert conn._proto.transport is not None
            os.truncate(_cs(one).store.chunk_path(cid), MiB)  # by hand: kvfs never cuts a sealed chunk
            with caplog.at_level(logging.WARNING, logger="kvfs.server"):
                conn._proto.transport.resume_reading()
                async with asyncio.timeout(30):
                    with pytest.raises(Unavailable):
                        await answer
            assert any("shrank" in r.getMessage() for r in caplog.records)
            assert conn.is_closed
        finally:
            conn.abort()
        # the client: a miss (the bytes are gone), never other bytes
        got = await kv.get_many(list(values))
        assert all(g is None or g == values[k] for k, g in zip(values, got, strict=True))
        assert got[-1] is None
    async with one.client() as kv:  # the server serves on
        await kv.put("after", b"x" * MiB)
        assert await kv.get("after") == b"x" * MiB
