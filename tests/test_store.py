"""ChunkStore on real files, without a server: the edges of compact, delete, scan, seal,
verify and recovery that the cluster tests do not reach. The mutation pass found them
(tests/MUTATION.md): each test here fails under at least one mutant that survived before."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import re
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from crc32c import crc32c
from pagecache import warm
from poll import until
from procfs import open_paths

from kvfs.chunkserver import store as store_mod
from kvfs.chunkserver.records import scan_records
from kvfs.chunkserver.store import (
    ALIGN,
    FREE_MARGIN_CHUNKS,
    ChunkStore,
    Span,
    check_ranges,
    plan_spans,
)
from kvfs.datadir import FILE_MODE
from kvfs.errors import InvalidArgument, NoSpace, StaleLayout, Unavailable
from kvfs.layout import MAX_KEY_BYTES, make_chunk_id
from kvfs.rpc import Range

CHUNK = 64 * 1024


def open_store(root: Path) -> ChunkStore:
    st = ChunkStore(root, chunk_bytes=CHUNK, preallocate=False)
    st.server_id = 1
    return st


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ChunkStore]:
    st = open_store(tmp_path / "cs")
    try:
        yield st
    finally:
        await st.close()


def value_of(key: bytes, size: int = 3000) -> bytes:
    return (key * (size // len(key) + 1))[:size]


async def put(st: ChunkStore, key: bytes, value: bytes) -> tuple[int, int]:
    ((cid, off),) = await st.append([(key, len(value), crc32c(value), None)], memoryview(value))
    return cid, off


async def sealed(st: ChunkStore, *keys: bytes) -> tuple[int, dict[bytes, int]]:
    """Append ``keys`` (value_of each) into one chunk and seal it: (chunk id, value offsets)."""
    offsets: dict[bytes, int] = {}
    cids = set()
    for k in keys:
        cid, offsets[k] = await put(st, k, value_of(k))
        cids.add(cid)
    (cid,) = cids
    assert await st.seal(cid, 0.0)
    return cid, offsets


async def read(st: ChunkStore, cid: int, off: int, length: int) -> bytes:
    views, stale = await st.readv([(cid, off, length)])
    assert not stale, stale
    view = views[0]
    assert view is not None
    return bytes(view)


def temp_files(st: ChunkStore) -> list[str]:
    return sorted(p.name for p in st.dir.iterdir() if not p.name.endswith(".chunk"))


# compact -----------------------------------------------------------------------------------
async def test_compact_skips_unknown_and_vanished_sources_and_copies_the_rest(store: ChunkStore) -> None:
    a, a_offs = await sealed(store, b"a1", b"a2")
    b, b_offs = await sealed(store, b"b1")
    os.unlink(store.chunk_path(b))  # gone from disk while meta still plans with it
    unknown = make_chunk_id(1, 999)
    new, size, locations = await store.compact([
        (unknown, [(100, 10)]),
        (b, [(b_offs[b"b1"], 3000)]),
        (a, [(a_offs[b"a1"], 3000), (a_offs[b"a2"], 3000)]),
    ])
    assert new is not None
    assert locations[0] == [None] and locations[1] == [None]
    at1, at2 = locations[2]
    assert at1 is not None and at2 is not None
    assert await read(store, new, at1, 3000) == value_of(b"a1")
    assert await read(store, new, at2, 3000) == value_of(b"a2")
    assert size == store.sizes[new] == os.stat(store.chunk_path(new)).st_size
    assert os.stat(store.chunk_path(new)).st_mode & 0o777 == FILE_MODE  # private, as appended chunks
    assert temp_files(store) == []


async def test_compact_copies_only_whole_intact_records(store: ChunkStore) -> None:
    a, offs = await sealed(store, b"k1", b"k2", b"k3")
    with open(store.chunk_path(a), "r+b") as f:  # k3's value no longer matches its CRC
        f.seek(offs[b"k3"] + 7)
        f.write(b"\xff")
    wanted = [(offs[b"k1"] + 1, 2999),  # not where a value starts
              (offs[b"k2"], 2999),  # a record, but not its length
              (offs[b"k3"], 3000),  # a record whose value is corrupt
              (offs[b"k1"], 3000)]
    new, size, [locs] = await store.compact([(a, wanted)])
    assert locs[:3] == [None, None, None] and locs[3] is not None and new is not None
    assert await read(store, new, locs[3], 3000) == value_of(b"k1")
    assert size == store.sizes[new]
    # nothing to copy: no new chunk, nothing written
    chunks = set(store.sizes)
    assert await store.compact([(a, wanted[:3])]) == (None, 0, [[None, None, None]])
    assert set(store.sizes) == chunks


async def test_compact_refuses_the_chunk_open_for_appends(store: ChunkStore) -> None:
    cid, off = await put(store, b"k", value_of(b"k"))
    with pytest.raises(InvalidArgument, match=f"chunk {cid:016x} is open for appends"):
        await store.compact([(cid, [(off, 3000)])])


async def test_compact_on_a_full_disk_is_nospace_and_leaves_nothing_behind(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    a, offs = await sealed(store, b"k1")
    fds_before = len(open_paths())

    real_fsync = os.fsync

    def full(fd: int) -> None:  # fault injection: the disk fills while the copy is synced
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == str(store.dir):  # the copy
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(NoSpace, match="compacting into a new chunk: the disk is full"):
        await store.compact([(a, [(offs[b"k1"], 3000)])])
    monkeypatch.undo()
    assert temp_files(store) == []
    assert len(open_paths()) == fds_before  # the temp file's fd was closed
    assert set(store.sizes) == {a}
    assert await read(store, a, offs[b"k1"], 3000) == value_of(b"k1")


# delete ------------------------------------------------------------------------------------
async def test_delete_chunks_skips_the_open_chunk_and_unknown_ids(store: ChunkStore) -> None:
    a, a_offs = await sealed(store, b"a")
    gone, _ = await sealed(store, b"g")
    gone_size = store.sizes[gone]
    os.unlink(store.chunk_path(gone))  # already unlinked (a crash between unlink and answer)
    assert await read(store, a, a_offs[b"a"], 3000) == value_of(b"a")  # a's fd is open now
    a_size = store.sizes[a]
    o, o_off = await put(store, b"o", value_of(b"o"))
    deleted = await store.delete_chunks([o, a, gone, make_chunk_id(1, 999)])
    assert deleted == {a: a_size, gone: gone_size}
    assert not store.chunk_path(a).exists()
    await until(lambda: not any(str(store.chunk_path(a)) in p for p in open_paths()),
                "a's fd to be closed (in an IO thread)")  # its blocks are freed
    assert await read(store, o, o_off, 3000) == value_of(b"o")  # the open chunk stays
    views, stale = await store.readv([(a, a_offs[b"a"], 3000)])
    assert views == [None] and isinstance(stale[0], StaleLayout)


async def test_a_chunk_being_deleted_never_holds_the_event_loop(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unlink frees the chunk's blocks, which can wait for the disk (ext4 ``-o discard``
    without a journal discards them before unlink returns): it runs in an IO thread, so
    appends go on meanwhile.  Here it is held until the test lets it go; in the event loop it
    would never be let go and fails the delete."""
    a, _ = await sealed(store, b"a")
    gate = threading.Event()
    real = os.unlink

    def held(path: str | os.PathLike[str]) -> None:
        if not gate.wait(10):
            raise OSError("the held unlink was never let go")
        real(path)

    monkeypatch.setattr(os, "unlink", held)
    deleting = asyncio.ensure_future(store.delete_chunks([a]))
    o, off = await put(store, b"o", value_of(b"o"))  # the loop runs while the unlink is held
    assert not deleting.done()
    gate.set()
    assert list(await deleting) == [a]
    monkeypatch.undo()
    assert not store.chunk_path(a).exists() and a not in store.sizes
    assert await read(store, o, off, 3000) == value_of(b"o")


async def test_a_deleted_chunks_last_fd_is_closed_in_an_io_thread(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read running when its chunk is deleted keeps the chunk's fd open past the unlink;
    the close after the read is then the file's last, which frees its blocks and can wait
    for the disk as the unlink does (test above): it runs in an IO thread, never in the
    event loop."""
    a, offs = await sealed(store, b"a")
    assert await read(store, a, offs[b"a"], 3000) == value_of(b"a")  # a's fd is open now
    fd = store._fds[a]
    store.nowait = False  # the next read goes to the pool, where it is held
    started, gate = threading.Event(), threading.Event()
    real_read, real_close = store_mod._read_scatter, os.close

    def held(*args: object, **kwargs: object) -> list[bool]:
        started.set()
        if not gate.wait(10):
            raise OSError("the held read was never let go")
        return real_read(*args, **kwargs)  # type: ignore[arg-type]

    closed_in: list[threading.Thread] = []

    def close(n: int) -> None:
        if n == fd and not closed_in:
            closed_in.append(threading.current_thread())
        real_close(n)

    monkeypatch.setattr(store_mod, "_read_scatter", held)
    monkeypatch.setattr(os, "close", close)
    reading = asyncio.ensure_future(read(store, a, offs[b"a"], 3000))
    await until(started.is_set, "the read to start in the pool")
    assert list(await store.delete_chunks([a])) == [a]
    assert not store.chunk_path(a).exists() and not closed_in  # the read's fd is open still
    gate.set()
    assert await reading == value_of(b"a")
    await until(lambda: bool(closed_in), "the deleted chunk's fd to be closed")
    monkeypatch.undo()
    assert closed_in[0] is not threading.current_thread(), "closed in the event loop"
    # (recorded just before the close itself, in that thread: polled, as the test below does)
    await until(lambda: not any(str(store.chunk_path(a)) in p for p in open_paths()),
                "the deleted chunk's fd to be closed")  # its blocks are freed


async def test_a_deleted_chunks_fd_lent_to_a_sendfile_answer_is_closed_in_an_io_thread(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer sent with ``sendfile`` (:meth:`ChunkStore.readv_files`) holds fds of its
    own; where its chunk is deleted during the send, the answer's close is the file's last
    (the test above): in an IO thread.  A chunk still there has its fd closed at once."""
    a, a_offs = await sealed(store, b"a")
    b, b_offs = await sealed(store, b"b")
    parts, errors = store.readv_files([(a, a_offs[b"a"], 3000), (b, b_offs[b"b"], 3000)], 1)
    assert parts is not None and not errors and store.lent_fds == 2
    a_fd, b_fd = (s[0] for s in parts.segments)
    assert list(await store.delete_chunks([a])) == [a]
    closed_in: dict[int, threading.Thread] = {}
    real_close = os.close

    def close(n: int) -> None:
        if n in (a_fd, b_fd):
            closed_in.setdefault(n, threading.current_thread())
        real_close(n)

    monkeypatch.setattr(os, "close", close)
    parts.close()
    assert closed_in.get(b_fd) is threading.current_thread() and store.lent_fds == 0
    await until(lambda: a_fd in closed_in, "the deleted chunk's lent fd to be closed")
    monkeypatch.undo()
    assert closed_in[a_fd] is not threading.current_thread(), "closed in the event loop"
    await until(lambda: not any(str(store.chunk_path(a)) in p for p in open_paths()),
                "every fd of the deleted chunk to be closed")  # its blocks are freed
    assert await read(store, b, b_offs[b"b"], 3000) == value_of(b"b")


# usage -------------------------------------------------------------------------------------
def on_disk(st: ChunkStore) -> int:
    return sum(p.stat().st_size for p in st.dir.glob("*.chunk"))


async def test_used_bytes_follow_appends_rolls_compaction_deletes_and_recovery(tmp_path: Path) -> None:
    """The bytes used, kept as they change (not summed per append), are the chunks' bytes
    after every kind of change, and after a restart that cuts a torn tail."""
    st = open_store(tmp_path / "cs")
    try:
        a, offs = await sealed(st, b"a1", b"a2")
        keys = [b"r%d" % i for i in range(30)]  # 30 x 3000 bytes: past CHUNK, so a roll
        for k in keys:
            await put(st, k, value_of(k))
        assert len(st.sizes) >= 3 and st.usage()[2] == st.used_bytes == on_disk(st)
        new, _, _ = await st.compact([(a, [(offs[b"a1"], 3000)])])
        assert new is not None and st.used_bytes == on_disk(st)
        await st.delete_chunks([a])
        assert st.used_bytes == on_disk(st) == sum(st.sizes.values())
        last = max(st.sizes)
    finally:
        await st.close()
    with open(st.chunk_path(last), "ab") as f:
        f.write(b"KVR2 torn")  # an append cut short
    again = open_store(tmp_path / "cs")
    try:
        assert again.used_bytes == on_disk(again) == sum(again.sizes.values()) == st.used_bytes
    finally:
        await again.close()


class FakeDisk:
    """A filesystem's statvfs answer, faked (fault injection): ``free`` less what the store
    has on disk, counted per call."""

    def __init__(self, st: ChunkStore, free: int) -> None:
        self.st, self.free, self.calls = st, free, 0

    def __call__(self, path: object) -> shutil._ntuple_diskusage:
        self.calls += 1
        free = self.free - on_disk(self.st)
        return shutil._ntuple_diskusage(1 << 40, (1 << 40) - free, free)


async def test_appends_far_from_full_skip_statvfs_and_are_refused_once_what_they_wrote_fills_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The space check counts what the store wrote since its last statvfs (never a stale
    figure that lets writes past the disk's free bytes), asks again within
    FREE_MARGIN_CHUNKS chunks of full, and only there: 600 KiB free, values of 3000 bytes.
    Values stop short of the GC reserve (2 chunks here); tombstones, which free room, may
    still take it."""
    st = ChunkStore(tmp_path / "cs", chunk_bytes=CHUNK, preallocate=False, free_check_s=3600.0)
    st.server_id = 1
    disk = FakeDisk(st, 600 * 1024)
    monkeypatch.setattr(store_mod.shutil, "disk_usage", disk)
    try:
        appends = 0
        with pytest.raises(NoSpace, match="is full"):
            for i in range(1000):
                await put(st, b"f%d" % i, value_of(b"f%d" % i))
                appends += 1
        reserve = st.gc_reserve(1 << 40)
        assert reserve == 2 * CHUNK
        assert on_disk(st) <= disk.free - reserve  # no value written into the reserve
        assert disk.free - reserve - on_disk(st) < 3000 + 64  # refused only once a record no longer fits
        tombstones = [(b"t%d" % i, 0, crc32c(b""), None, 1, None, None, 0, True) for i in range(1024)]
        assert len(await st.append(tombstones, memoryview(b""))) == 1024  # ~40 KiB: into the reserve
        with pytest.raises(NoSpace, match=f"beside the {reserve} kept for GC"):
            await put(st, b"v", b"v")
        margin = FREE_MARGIN_CHUNKS * CHUNK // 3000 + 1  # appends within the margin ask (x2)
        assert disk.calls <= 2 * margin + 2 < appends
    finally:
        await st.close()


async def test_space_taken_by_others_is_seen_within_free_check_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer fills the disk: the store's last statvfs (far from full) is trusted
    for free_check_s at most, then appends are refused."""
    st = ChunkStore(tmp_path / "cs", chunk_bytes=CHUNK, preallocate=False, free_check_s=0.05)
    st.server_id = 1
    disk = FakeDisk(st, 1 << 30)
    monkeypatch.setattr(store_mod.shutil, "disk_usage", disk)
    try:
        await put(st, b"a", value_of(b"a"))
        disk.free = on_disk(st)  # the disk is full now
        deadline = asyncio.get_running_loop().time() + 10
        with pytest.raises(NoSpace, match="is full"):
            while asyncio.get_running_loop().time() < deadline:
                await put(st, b"b", value_of(b"b"))
                await asyncio.sleep(0.01)
    finally:
        await st.close()


# scan, seal, verify, mtimes ----------------------------------------------------------------
async def test_scan_reads_only_the_bytes_appends_were_answered_for(store: ChunkStore) -> None:
    cid, _ = await put(store, b"k", value_of(b"k"))
    with open(store.chunk_path(cid), "rb") as f:
        record = f.read()
    with open(store.chunk_path(cid), "ab") as f:  # an append in flight: written, not answered
        f.write(record)
    assert [r.key for r in await store.scan(cid)] == [b"k"]
    with pytest.raises(StaleLayout, match=f"chunk {cid + 1:016x} is not on this server"):
        await store.scan(cid + 1)


async def test_seal_needs_the_open_chunk_to_be_idle(store: ChunkStore) -> None:
    cid, _ = await put(store, b"k", value_of(b"k"))
    assert await store.seal(make_chunk_id(1, 999), 60.0)  # not open: sealed already
    assert not await store.seal(cid, 60.0)  # appended to just now
    assert store.open_chunk == cid
    assert await store.seal(cid, 0.0, apply=False)  # a dry run says it would ...
    assert store.open_chunk == cid  # ... and changes nothing
    assert await store.seal(cid, 0.0)
    assert store.open_chunk is None
    cid2, _ = await put(store, b"k2", value_of(b"k2"))
    assert cid2 != cid  # a sealed chunk takes no more appends


def first_bytes(bufs: list[bytes | memoryview], n: int) -> list[memoryview]:
    """Views of the first ``n`` bytes of ``bufs``: a write that takes only those (a short write)."""
    cut: list[memoryview] = []
    for b in bufs:
        if not n:
            break
        cut.append(memoryview(b)[:n])
        n -= cut[-1].nbytes
    return cut


@pytest.mark.parametrize("step", [None, 1000])
async def test_an_append_of_many_records_survives_short_writes(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch, step: int | None) -> None:
    """600 records in one APPEND: 1200 buffers, written IOV_MAX at a time; with short writes
    (``step`` bytes a call, fault injection) each goes on from where it stopped. Every value
    reads back whole."""
    real = os.pwritev

    def short(fd: int, bufs: list[bytes | memoryview], offset: int) -> int:
        assert step
        return real(fd, first_bytes(bufs, step), offset)

    if step:
        monkeypatch.setattr(os, "pwritev", short)
    keys = [f"k{i}".encode() for i in range(600)]
    values = [value_of(k, 100 + i) for i, k in enumerate(keys)]
    payload = b"".join(values)
    locs = await store.append([(k, len(v), crc32c(v), None) for k, v in zip(keys, values, strict=True)],
                              memoryview(payload))
    monkeypatch.undo()
    views, stale = await store.readv([(c, off, len(v)) for (c, off), v in zip(locs, values, strict=True)])
    assert not stale and [bytes(v) for v in views] == values  # type: ignore[arg-type]
    assert [r.key for r in await store.scan(locs[0][0])] == keys


@pytest.mark.parametrize("step", [None, 100_000])
async def test_large_values_are_written_in_pieces_of_at_most_write_piece_bytes(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch, step: int | None) -> None:
    """An APPEND of values larger than ``WRITE_PIECE`` (and of sizes that do not divide it)
    reaches the page cache in pwritev calls of at most ``WRITE_PIECE`` bytes each (large ones
    cost far more on the benchmark VM, bench/RESULTS.md), at consecutive offsets, short writes
    (``step`` bytes a call, fault injection) continued; every value reads back whole."""
    real = os.pwritev
    calls: list[tuple[int, int]] = []

    def spy(fd: int, bufs: list[bytes | memoryview], offset: int) -> int:
        size = sum(memoryview(b).nbytes for b in bufs)
        assert size <= store_mod.WRITE_PIECE, size
        n = real(fd, first_bytes(bufs, step) if step else bufs, offset)
        calls.append((offset, n))
        return n

    monkeypatch.setattr(os, "pwritev", spy)
    keys = [b"a", b"b", b"c", b"d"]
    values = [os.urandom(n) for n in (3 * store_mod.WRITE_PIECE + 17, 1, 700_001, 1 << 20)]
    locs = await store.append([(k, len(v), crc32c(v), None) for k, v in zip(keys, values, strict=True)],
                              memoryview(b"".join(values)))
    monkeypatch.undo()
    assert len(calls) > sum(len(v) for v in values) // store_mod.WRITE_PIECE
    assert all(off + n == nxt for (off, n), (nxt, _) in itertools.pairwise(calls))
    views, stale = await store.readv([(c, off, len(v)) for (c, off), v in zip(locs, values, strict=True)])
    assert not stale and [bytes(v) for v in views] == values  # type: ignore[arg-type]


async def test_small_appends_are_written_by_the_loop_and_a_stall_sends_them_to_the_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``inline_write_bytes``, an append that fits is written by the event loop (no IO
    thread: a job given to one here is counted), but not a new chunk's first (its blocks are
    reserved in a thread) nor a larger one.  A write that holds the loop past
    ``inline_stall_s`` sends the appends to the IO threads for INLINE_BACKOFF_S."""
    st = ChunkStore(tmp_path / "cs", chunk_bytes=CHUNK, inline_write_bytes=8192)
    st.server_id = 1
    jobs: list[str] = []
    real_run = st.pool.run

    def counted(fn, *args):  # type: ignore[no-untyped-def]
        jobs.append(fn.__name__)
        return real_run(fn, *args)

    monkeypatch.setattr(st.pool, "run", counted)
    try:
        cid, _ = await put(st, b"k1", value_of(b"k1"))  # a new chunk: reserved and written in a thread
        assert "_write_at" in jobs and st.inline_writes == 0
        jobs.clear()
        got = [await put(st, k, value_of(k)) for k in (b"k2", b"k3")]
        assert "_write_at" not in jobs and st.inline_writes == 2  # (the group syncs: threads)
        await put(st, b"k4", value_of(b"k4", 9000))  # over inline_write_bytes
        assert jobs.count("_write_at") == 1 and st.inline_writes == 2
        for (c, off), k in zip(got, (b"k2", b"k3"), strict=True):
            assert c == cid and await read(st, c, off, 3000) == value_of(k)
        monkeypatch.setattr(store_mod, "INLINE_BACKOFF_S", 3600.0)  # (not over before k6)
        st.inline_stall_s = -1.0  # every write now "held the loop"
        jobs.clear()
        await put(st, b"k5", value_of(b"k5"))
        assert st.inline_writes == 3 and st.inline_stalls == 1 and "_write_at" not in jobs
        c6, off6 = await put(st, b"k6", value_of(b"k6"))  # backed off: an IO thread writes it
        assert st.inline_writes == 3 and jobs.count("_write_at") == 1
        assert await read(st, c6, off6, 3000) == value_of(b"k6")
        assert [r.key for r in await st.scan(cid)] == [b"k1", b"k2", b"k3", b"k4", b"k5", b"k6"]
    finally:
        await st.close()


async def test_an_append_cancelled_mid_write_finishes_before_the_next_append_writes(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """An append whose caller is cancelled (shutdown, a dropped connection) while its pwritev
    runs in the pool: the write and its size bookkeeping still finish before the next append
    takes the lock, so the next one lands after it, and every record reads back whole."""
    cid, _ = await put(store, b"k1", value_of(b"k1"))
    real = os.pwritev
    entered, go = threading.Event(), threading.Event()

    def slow(fd: int, bufs: list[bytes | memoryview], offset: int) -> int:
        if not entered.is_set():  # fault injection: the first write waits in its thread
            entered.set()
            assert go.wait(60), "the test never let the write go on"
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    v2, v3 = value_of(b"k2", 5000), value_of(b"k3", 1000)  # k2 longer: an overlap leaves its tail
    first = asyncio.create_task(store.append([(b"k2", len(v2), crc32c(v2), None)], memoryview(v2)))
    assert await asyncio.to_thread(entered.wait, 60)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.create_task(put(store, b"k3", v3))
    go.set()
    cid3, off3 = await second
    monkeypatch.undo()
    assert cid3 == cid
    assert await read(store, cid, off3, len(v3)) == v3
    recs = await store.scan(cid)
    assert [(r.key, r.value_ok) for r in recs] == [(b"k1", True), (b"k2", True), (b"k3", True)]
    assert recs[1].value_offset < off3 and os.path.getsize(store.chunk_path(cid)) == store.sizes[cid]


async def test_close_waits_for_a_running_append_before_it_cuts_the_chunk_or_closes_its_fd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() at shutdown while an append's pwritev runs in the pool (its caller already
    cancelled): the write finishes into its own chunk file before the chunk is cut back to
    its size and its fd closed; a file opened meanwhile (it would take a closed fd's number)
    gets nothing, and the chunk holds both whole records with its size counted."""
    st = ChunkStore(tmp_path / "cs", chunk_bytes=CHUNK)  # preallocate: close cuts the chunk back
    st.server_id = 1
    cid, _ = await put(st, b"k1", value_of(b"k1"))
    real = os.pwritev
    entered, go = threading.Event(), threading.Event()
    wrote_to: list[int] = []

    def held(fd: int, bufs: list[bytes | memoryview], offset: int) -> int:
        entered.set()  # fault injection: the write waits in its thread
        assert go.wait(60), "the test never let the write go on"
        wrote_to.append(os.fstat(fd).st_ino)  # EBADF had its fd been closed
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", held)
    v2 = value_of(b"k2", 5000)
    append = asyncio.create_task(st.append([(b"k2", len(v2), crc32c(v2), None)], memoryview(v2)))
    assert await asyncio.to_thread(entered.wait, 60)
    append.cancel()  # the server's shutdown cancels the handler first
    with pytest.raises(asyncio.CancelledError):
        await append
    closing = asyncio.create_task(st.close())
    await asyncio.sleep(0)  # one step: close does all it may do before the write ends
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        go.set()
        async with asyncio.timeout(60):
            await closing
        assert os.fstat(other).st_size == 0  # nothing went to a reused fd number
    finally:
        os.close(other)
    monkeypatch.undo()
    path = st.chunk_path(cid)
    assert wrote_to == [path.stat().st_ino]
    assert path.stat().st_size == st.sizes[cid]
    assert [(r.key, r.value_ok) for r in scan_records(path.read_bytes())] == [(b"k1", True), (b"k2", True)]
    with pytest.raises(Unavailable, match="shutting down"):
        await st.append([(b"k3", len(v2), crc32c(v2), None)], memoryview(v2))


async def test_close_gives_up_on_a_write_hanging_on_the_disk_and_closes_no_fd_under_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """close() while an append's pwritev hangs on the disk (fault injection) returns after
    close_timeout_s, says what it abandoned, and leaves the files open: the write, once the
    disk lets it go, lands whole in its own chunk.  That append and the one queued behind it
    are refused (not acknowledged), never left hanging."""
    st = ChunkStore(tmp_path / "cs", chunk_bytes=CHUNK, close_timeout_s=0.2)
    st.server_id = 1
    cid, _ = await put(st, b"k1", value_of(b"k1"))
    fd = st._fds[cid]
    real = os.pwritev
    entered, go = threading.Event(), threading.Event()
    wrote_to: list[int] = []

    def hangs(fd: int, bufs: list[bytes | memoryview], offset: int) -> int:
        entered.set()  # fault injection: the disk does not answer until the test says so
        assert go.wait(60), "the test never let the write go on"
        wrote_to.append(os.fstat(fd).st_ino)  # EBADF had its fd been closed
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", hangs)
    v2, v3 = value_of(b"k2", 5000), value_of(b"k3")
    hung = asyncio.create_task(st.append([(b"k2", len(v2), crc32c(v2), None)], memoryview(v2)))
    assert await asyncio.to_thread(entered.wait, 60)
    queued = asyncio.create_task(st.append([(b"k3", len(v3), crc32c(v3), None)], memoryview(v3)))
    try:
        with caplog.at_level(logging.ERROR, logger="kvfs.chunkserver"):
            async with asyncio.timeout(20):  # (without a bound, close waits for the disk)
                assert await st.close() is False
        assert "close gave up after 0.2s (close_timeout_s) with disk IO still running: 1 " \
               "append writes, 1 IO-thread jobs" in caplog.text
        assert os.fstat(fd).st_size  # the chunk's fd is still open (no EBADF)
        assert await st.close() is False  # closed already: the same answer
    finally:
        go.set()
    async with asyncio.timeout(60):
        with pytest.raises(Unavailable, match="shutting down"):
            await hung  # written, but not synced: not acknowledged
        with pytest.raises(Unavailable, match="shutting down"):
            await queued
    monkeypatch.undo()
    path = st.chunk_path(cid)
    assert wrote_to == [path.stat().st_ino]
    assert [(r.key, r.value_ok) for r in scan_records(path.read_bytes())] == [(b"k1", True), (b"k2", True)]
    for left in (*st._fds.values(), *st._close_later):  # what close left open
        os.close(left)


async def test_close_runs_the_group_sync_waiting_in_its_window_and_ends_it_cleanly(
        tmp_path: Path) -> None:
    """An append waiting out the group sync's window at close: the round runs at once, before
    the IO threads stop (it used to meet a shut pool: a RuntimeError in a task nobody awaited,
    its waiters cancelled); the append is acknowledged, no round is left running, and a sync
    asked for afterwards is refused."""
    # a window far longer than the test's bound: only a close that cuts it short ends in time
    st = ChunkStore(tmp_path / "cs", chunk_bytes=CHUNK, fsync_window_s=3600.0)
    st.server_id = 1
    v = value_of(b"k1")
    append = asyncio.create_task(st.append([(b"k1", len(v), crc32c(v), None)], memoryview(v)))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not st.syncer.waiting:  # the append written, waiting in the window
        assert loop.time() < deadline, "the append never reached the group sync"
        await asyncio.sleep(0.005)
    assert st.syncer.busy and st.syncer.rounds == 0
    async with asyncio.timeout(20):
        assert await st.close() is True
        ((cid, _),) = await append
    assert not st.syncer.busy and st.syncer.rounds == 1
    assert [r.key for r in scan_records(st.chunk_path(cid).read_bytes())] == [b"k1"]
    with pytest.raises(Unavailable, match="shutting down"):
        await st.syncer.sync(0)


async def test_append_refuses_bad_keys_and_a_payload_its_records_do_not_describe(store: ChunkStore) -> None:
    """The server's decoder bounds keys first; the store checks again (its own callers)."""
    v = b"v" * 10
    for key in (b"", b"k" * (MAX_KEY_BYTES + 1), "k"):
        with pytest.raises(InvalidArgument, match=r"^append record with a bad key$"):
            await store.append([(key, 10, crc32c(v), None)], memoryview(v))
    with pytest.raises(InvalidArgument, match=r"^append sent 20 bytes but its records describe 10$"):
        await store.append([(b"k", 10, crc32c(v), None)], memoryview(v + v))
    assert store.open_chunk is None  # nothing was written
    ((cid, _),) = await store.append([(b"k" * MAX_KEY_BYTES, 10, crc32c(v), None)], memoryview(v))
    assert [r.key for r in await store.scan(cid)] == [b"k" * MAX_KEY_BYTES]


async def test_append_writes_each_records_fields(store: ChunkStore) -> None:
    """A record's expiry goes to disk; the rebuild fields a client leaves out are written as
    their defaults (the same record as one that names them)."""
    v = value_of(b"a")
    base = (len(v), crc32c(v))
    locs = await store.append([(b"a", *base, 1_800_000_000.5), (b"b", *base, None),
                               (b"c", *base, None, 0, None, None, 0, False),
                               (b"d", *base, None, 7, 99, 5, 2, True)], memoryview(v * 4))
    recs = await store.scan(locs[0][0])
    assert recs[0].expires_at == 1_800_000_000.5 and recs[1].expires_at is None
    fields = [(r.write_id, r.total_size, r.total_crc, r.index, r.tombstone) for r in recs]
    assert fields[1] == fields[2] != fields[3] == (7, 99, 5, 2, True)


@pytest.mark.parametrize("inline", [0, 1 << 20], ids=["io-thread", "inline"])
async def test_an_append_that_runs_out_of_space_mid_write_is_cut_back(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch, inline: int) -> None:
    """ENOSPC partway through an append (written in an IO thread, or by the loop itself):
    NoSpace naming the server and the size, the chunk file cut back to where the append
    began, and the size wanted kept for MAKE_ROOM."""
    store.inline_write_bytes = inline
    cid, _ = await put(store, b"k1", value_of(b"k1"))
    size = store.sizes[cid]
    real = os.pwritev
    threads: list[threading.Thread] = []

    def full(fd: int, bufs: list[bytes | memoryview], offset: int) -> int:
        threads.append(threading.current_thread())
        real(fd, [memoryview(bufs[0])[:10]], offset)  # fault injection: 10 bytes land, then ENOSPC
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", full)
    v = value_of(b"k2")
    with pytest.raises(NoSpace, match=rf"^chunkserver {store.server_id} appending \d+ bytes: the disk is full"):
        await store.append([(b"k2", len(v), crc32c(v), None)], memoryview(v))
    monkeypatch.undo()
    assert threads and all((t is threading.main_thread()) == bool(inline) for t in threads)
    assert os.path.getsize(store.chunk_path(cid)) == size == store.sizes[cid]
    assert store.wanted_bytes > len(v)
    assert [r.key for r in await store.scan(cid)] == [b"k1"]


async def test_a_zero_length_range_is_answered_empty(store: ChunkStore) -> None:
    """READV allows empty ranges (check_ranges): one inside the chunk, or at its end, is
    answered with no bytes, not as stale; past the end it is stale."""
    a, offs = await sealed(store, b"k1")
    size = store.sizes[a]
    views, stale = await store.readv([(a, offs[b"k1"], 0), (a, size, 0), (a, offs[b"k1"], 3000)])
    assert not stale and [bytes(v) for v in views] == [b"", b"", value_of(b"k1")]  # type: ignore[arg-type]
    views, stale = await store.readv([(a, size + 1, 0)])
    assert views == [None] and list(stale) == [0]


async def test_verify_names_missing_and_corrupt_ranges(store: ChunkStore) -> None:
    a, offs = await sealed(store, b"k1", b"k2")
    with open(store.chunk_path(a), "r+b") as f:
        f.seek(offs[b"k2"])
        f.write(b"\x00")
    good = (a, offs[b"k1"], 3000, crc32c(value_of(b"k1")))
    bad = (a, offs[b"k2"], 3000, crc32c(value_of(b"k2")))
    past_end = (a, store.sizes[a] - 10, 20, 0)
    unknown = (make_chunk_id(1, 999), 0, 10, 0)
    assert await store.verify([unknown, good, bad, past_end]) == ([0, 3], [2])
    assert await store.verify([past_end, unknown]) == ([0, 1], [])
    assert await store.verify([good]) == ([], [])


async def test_mtimes_of_the_chunks_on_disk(store: ChunkStore) -> None:
    a, _ = await sealed(store, b"a")
    b, _ = await sealed(store, b"b")
    assert store.mtimes() == {c: os.stat(store.chunk_path(c)).st_mtime for c in (a, b)}
    os.unlink(store.chunk_path(a))  # the first one gone: the ones after it are still listed
    assert store.mtimes() == {b: os.stat(store.chunk_path(b)).st_mtime}


# recovery ----------------------------------------------------------------------------------
async def test_a_clean_restart_cuts_nothing_and_warns_of_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    st = open_store(tmp_path / "cs")
    try:
        cid, off = await put(st, b"k", value_of(b"k"))
        size = st.sizes[cid]
    finally:
        await st.close()
    with caplog.at_level(logging.WARNING, logger="kvfs.chunkserver"):
        again = open_store(tmp_path / "cs")
    try:
        assert caplog.records == []
        assert again.sizes[cid] == size and again.bad_records == 0 and again.damage[cid] == []
        assert await read(again, cid, off, 3000) == value_of(b"k")
    finally:
        await again.close()


# READV's pure parts: check_ranges, plan_spans ---------------------------------------------
@pytest.mark.parametrize(("raw", "message"), [
    ({"a": 1}, "READV ranges must be a list, got dict"),
    ([[1, 0, 1]] * 5, "READV names 5 ranges; the limit is 4 (max_ranges)"),
    ([[1, "0", 1]], "READV range must be three integers, got [1, '0', 1]"),
    ([[1, 0, 1.0]], "READV range must be three integers"),
    ([[1.0, 0, 1]], "READV range must be three integers"),
    ([[-1, 0, 1]], "READV range has a negative field: [-1, 0, 1]"),
    ([[1, -1, 1]], "READV range has a negative field"),
    ([[1, 0, -1]], "READV range has a negative field"),
    ([[1, 0, 600], [2, 0, 500]], "READV asks for 1100 bytes; the limit is 1000 (max_read_rpc_bytes)"),
    ([[1, 0, 100], [1, 99, 10]], "READV ranges overlap in chunk 0000000000000001 at offset 99"),
])
def test_check_ranges_refuses_naming_what_is_wrong(raw: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        check_ranges(raw, max_ranges=4, max_bytes=1000)


def test_check_ranges_takes_zeros_touching_ranges_and_decoded_ranges() -> None:
    raw = [[0, 0, 0], [0, 0, 10], [0, 10, 10], [1, 5, 0], [1, 5, 20]]  # chunk 0, empty, adjacent
    assert check_ranges(raw, max_ranges=5, max_bytes=40) == ([tuple(r) for r in raw], 40)
    decoded = [Range(3, 0, 10), Range(3, 10, 10)]
    assert check_ranges(decoded, max_ranges=2, max_bytes=20) == (decoded, 20)
    with pytest.raises(InvalidArgument, match="overlap"):
        check_ranges([Range(3, 0, 10), Range(3, 9, 1)], max_ranges=2, max_bytes=20)


def test_plan_spans_exactly() -> None:
    # the first span starts where its range does, not at 0
    assert plan_spans([(1, 3 * ALIGN + 5, 100)], 64 * 1024) == [Span(1, 3 * ALIGN, 4 * ALIGN, (0,))]
    # a span reaching exactly the next range's aligned start takes it in (merge gap 0) ...
    assert plan_spans([(0, 0, ALIGN), (0, ALIGN, 10)], 0) == [Span(0, 0, 2 * ALIGN, (0, 1))]
    # ... a gap of one page more than allowed does not; nor does another chunk
    assert plan_spans([(0, 2 * ALIGN, 1), (0, 0, 1), (2, 0, 1)], ALIGN - 1) == [
        Span(0, 0, ALIGN, (1,)), Span(0, 2 * ALIGN, 3 * ALIGN, (0,)), Span(2, 0, ALIGN, (2,))]


# _read_spans: short reads, the page-cache probe, the LRU of open files -----------------------
@pytest.mark.parametrize("step", [1000, 1])
async def test_reads_survive_short_reads_and_a_file_ending_early(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    a, offs = await sealed(store, b"k1", b"k2")
    real = os.preadv

    def short(fd: int, bufs: list[bytearray | memoryview], offset: int, *flags: int) -> int:
        return real(fd, [memoryview(bufs[0])[:step]], offset, *flags)  # fault injection: step bytes a call

    monkeypatch.setattr(os, "preadv", short)
    whole = (a, 0, store.sizes[a])
    views, stale = await store.readv([whole, (a, offs[b"k2"], 3000)])
    assert not stale
    assert bytes(views[0]) == store.chunk_path(a).read_bytes()  # type: ignore[arg-type]
    assert bytes(views[1]) == value_of(b"k2")  # type: ignore[arg-type]
    os.truncate(store.chunk_path(a), store.sizes[a] - 1)  # the file lost its last byte
    with pytest.raises(OSError, match=f"chunk {a:016x} ended at {store.sizes[a] - 1}, expected {store.sizes[a]}"):
        await store.readv([whole])


async def test_spans_not_in_the_page_cache_are_read_in_the_pool(
        store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    a, offs = await sealed(store, b"k1")
    b, _ = await sealed(store, b"k2")
    if not store.nowait:
        pytest.skip("no RWF_NOWAIT here")
    real = os.preadv
    probes: list[int] = []

    def cold(fd: int, bufs: list[bytearray | memoryview], offset: int, *flags: int) -> int:
        if flags and flags[0]:  # fault injection: chunk a is not in the page cache
            probes.append(fd)
            if os.readlink(f"/proc/self/fd/{fd}") == str(store.chunk_path(a)):
                raise BlockingIOError(errno.EAGAIN, "would block")
        return real(fd, bufs, offset, *flags)

    warm(store.chunk_path(b))  # b's pages cached (a loaded machine may have pushed them out)
    monkeypatch.setattr(os, "preadv", cold)
    views, stale = await store.readv([(a, offs[b"k1"], 1), (b, store.sizes[b] - 1, 1)])
    assert not stale and len(probes) == 2
    assert bytes(views[0]) == value_of(b"k1")[:1]  # type: ignore[arg-type]
    assert bytes(views[1]) == store.chunk_path(b).read_bytes()[-1:]  # type: ignore[arg-type]
    assert store.inline_spans == 1  # b from the page cache, a from the pool


async def test_cached_reads_join_a_puts_values_in_request_order_and_answer_every_order(
        store: ChunkStore) -> None:
    """From the page cache the ranges are taken in request order, nothing sorted: the values of
    one append asked in order are one span (one preadv); any other order reads the same bytes,
    one span each; a range not here is stale and the others are still read."""
    if not store.nowait:
        pytest.skip("no RWF_NOWAIT here")
    keys = [b"v%d" % i for i in range(4)]
    locs = await store.append([(k, 3000, crc32c(value_of(k)), None) for k in keys],
                              memoryview(b"".join(value_of(k) for k in keys)))
    ranges = [(c, off, 3000) for c, off in locs]
    want = [value_of(k) for k in keys]
    warm(*{store.chunk_path(c) for c, _ in locs})  # cached (a loaded machine may push them out)
    views, stale = await store.readv(ranges)
    assert not stale and [bytes(v) for v in views if v is not None] == want
    assert store.inline_spans == 1
    order = [2, 0, 3, 1]
    views, stale = await store.readv([ranges[i] for i in order])
    assert not stale and [bytes(v) for v in views if v is not None] == [want[i] for i in order]
    assert store.inline_spans == 1 + 4
    cid = ranges[0][0]
    views, stale = await store.readv([ranges[1], (cid, store.sizes[cid], 1), ranges[0]])
    assert list(stale) == [1] and views[1] is None
    assert bytes(views[0]) == want[1] and bytes(views[2]) == want[0]  # type: ignore[arg-type]


def test_a_failed_close_is_logged_and_the_other_fds_still_closed(
        caplog: pytest.LogCaptureFixture) -> None:
    r, w = os.pipe()
    os.close(r)
    with caplog.at_level(logging.WARNING, logger="kvfs.chunkserver"):
        store_mod._close_fds([-1, w])  # -1: never an fd, its close fails
    assert "fd -1" in caplog.text
    with pytest.raises(OSError):
        os.fstat(w)  # closed


async def test_files_pushed_out_of_the_lru_are_closed_once_reads_end(tmp_path: Path) -> None:
    st = ChunkStore(tmp_path / "cs", chunk_bytes=CHUNK, preallocate=False, max_open_files=2)
    st.server_id = 1
    try:
        chunks = [await sealed(st, k) for k in (b"a", b"b", b"c", b"d")]
        for cid, offs in chunks:
            ((key, off),) = offs.items()
            assert await read(st, cid, off, 3000) == value_of(key)
        open_chunks = [p for p in open_paths() if p.startswith(str(st.dir))]
        assert len(open_chunks) == 2, open_chunks  # closed in the event loop: none deleted
    finally:
        await st.close()
