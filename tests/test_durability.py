"""Durability is a setting: always / batch (group commit) / never, and what each one syncs."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import crc32c
import pytest
from poll import until

from kvfs.chunkserver import durability
from kvfs.chunkserver.iopool import IoPool
from kvfs.chunkserver.records import scan_records
from kvfs.chunkserver.service import ChunkServer
from kvfs.chunkserver.store import ChunkStore
from kvfs.config import ChunkServerConfig, FsyncMode, MetaConfig
from kvfs.datadir import DataDirInUse
from kvfs.errors import Unavailable
from kvfs.launcher import LocalCluster
from kvfs.meta.index import MetaIndex
from kvfs.meta.localstore import open_local
from kvfs.meta.store import MetaStore


class SyncSpy:
    """Counts fdatasync calls; with ``hold`` the first one blocks until released (a slow disk)."""

    def __init__(self, hold: bool = False) -> None:
        self.calls = 0
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.real = os.fdatasync

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if not self.gate.wait(30):
            raise TimeoutError("the test never released the held fdatasync")
        self.real(fd)


@pytest.fixture
async def make_store(tmp_path: Path) -> AsyncIterator[object]:
    stores: list[ChunkStore] = []

    def make(mode: FsyncMode) -> ChunkStore:
        st = ChunkStore(tmp_path / f"cs-{mode}", chunk_bytes=1 << 20, fsync=mode)
        st.server_id = 1
        stores.append(st)
        return st

    yield make
    for st in stores:
        await st.close()


def _append_args(key: bytes, value: bytes) -> tuple[list[list[object]], memoryview]:
    return [[key, len(value), crc32c.crc32c(value), None]], memoryview(value)


async def _poll(cond: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_batch_appends_are_synced_before_they_are_answered_and_share_syncs(
        make_store: object, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = SyncSpy(hold=True)
    monkeypatch.setattr(durability.os, "fdatasync", spy)
    st = make_store(FsyncMode.BATCH)  # type: ignore[operator]
    first = asyncio.create_task(st.append(*_append_args(b"k0", b"v" * 100)))
    await _poll(lambda: spy.calls == 1, "the first sync to start")
    rest = [asyncio.create_task(st.append(*_append_args(b"k%d" % i, b"v" * 100))) for i in range(1, 8)]
    await _poll(lambda: st.syncer.waiting == 7, "7 appends written and queued for the next sync")
    assert not first.done() and not any(t.done() for t in rest)  # nothing answered before its sync
    spy.gate.set()
    await asyncio.gather(first, *rest)
    assert spy.calls == 2  # 8 appends, 2 fdatasyncs: one for the first, one shared by the 7 others
    assert st.syncer.rounds == 2


@pytest.mark.parametrize("fault", [OSError(errno.EIO, os.strerror(errno.EIO)), TypeError("a bug")])
async def test_a_failed_group_sync_fails_its_appends_and_the_next_round_runs(
        make_store: object, monkeypatch: pytest.MonkeyPatch, fault: Exception) -> None:
    """Appends whose round's sync fails are each answered with the failure (the disk's
    OSError as it is; anything else as Unavailable), none left waiting, none acknowledged;
    once the disk syncs again the next append gets a round that syncs."""
    st = make_store(FsyncMode.BATCH)  # type: ignore[operator]
    await st.append(*_append_args(b"k0", b"v" * 100))
    synced: list[int] = []
    failing = True
    real = os.fdatasync

    def sync(fd: int) -> None:  # fault injection: syncs fail until the test says otherwise
        synced.append(fd)
        if failing:
            raise fault
        real(fd)

    monkeypatch.setattr(durability.os, "fdatasync", sync)
    rounds = st.syncer.rounds
    async with asyncio.timeout(20):
        got = await asyncio.gather(*(st.append(*_append_args(b"k%d" % i, b"v" * 100))
                                     for i in (1, 2, 3)), return_exceptions=True)
    want = type(fault) if isinstance(fault, OSError) else Unavailable
    assert [type(g) for g in got] == [want] * 3
    assert st.syncer.rounds == rounds + len(synced) and not st.syncer.busy
    failing = False
    failed = len(synced)
    async with asyncio.timeout(20):
        await st.append(*_append_args(b"k4", b"w" * 100))
    assert len(synced) == failed + 1 and st.syncer.rounds == rounds + failed + 1


async def test_a_sync_queued_behind_a_hung_round_when_close_gives_up_is_refused_not_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round whose ``fdatasync`` hangs outlives close's timeout; the IO threads are then
    shut down (as a store's close does).  When the hung sync returns, its caller is answered
    (synced), and the caller queued behind it, whose round can no longer be started, is
    refused as shutting down: never left waiting."""
    release = threading.Event()
    entered = threading.Event()

    def hang(fd: int) -> None:  # fault injection: the disk holds the sync until released
        entered.set()
        release.wait(30)

    monkeypatch.setattr(durability.os, "fdatasync", hang)
    pool = IoPool(2)
    syncer = durability.GroupSync(pool, tmp_path)
    try:
        hung = asyncio.ensure_future(syncer.sync(0))
        await until(entered.is_set, "the round in fdatasync")
        queued = asyncio.ensure_future(syncer.sync(1))
        await until(lambda: syncer.waiting == 1, "the second sync queued for the next round")
        assert await syncer.close(timeout_s=0.05) is False  # the round still hangs
        pool.shutdown(wait=False)
        release.set()
        async with asyncio.timeout(20):
            await hung  # its round ended: answered
            with pytest.raises(Unavailable, match="shutting down"):
                await queued
        assert not syncer.busy
    finally:
        release.set()
        pool.shutdown(wait=True)


async def test_always_syncs_each_append_and_never_syncs_none(make_store: object,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spy = SyncSpy()
    monkeypatch.setattr(durability.os, "fdatasync", spy)
    monkeypatch.setattr("kvfs.chunkserver.store.os.fdatasync", spy)
    always = make_store(FsyncMode.ALWAYS)  # type: ignore[operator]
    await asyncio.gather(*(always.append(*_append_args(b"a%d" % i, b"x" * 10)) for i in range(5)))
    assert spy.calls == 5
    spy.calls = 0
    never = make_store(FsyncMode.NEVER)  # type: ignore[operator]
    await asyncio.gather(*(never.append(*_append_args(b"n%d" % i, b"x" * 10)) for i in range(5)))
    assert spy.calls == 0


async def test_a_new_chunk_syncs_its_directory(make_store: object, monkeypatch: pytest.MonkeyPatch) -> None:
    dirs: list[Path] = []
    real = durability.fsync_dir

    def spy(path: Path) -> None:
        dirs.append(path)
        real(path)

    monkeypatch.setattr(durability, "fsync_dir", spy)
    st = make_store(FsyncMode.BATCH)  # type: ignore[operator]
    await st.append(*_append_args(b"a", b"x" * 10))  # rolls the first chunk
    assert st.dir in dirs
    dirs.clear()
    await st.append(*_append_args(b"b", b"x" * 10))  # same chunk: no directory sync
    assert st.dir not in dirs


async def test_a_large_batch_append_starts_its_writeback_before_its_group_sync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``batch`` an append of ``writeback_start_bytes`` or more starts writing its pages
    as soon as they are written (sync_file_range WRITE on its range), before the group
    fdatasync that makes it durable; a smaller one, ``never`` and 0 leave them to the sync."""
    if durability._sync_file_range() is None:
        pytest.skip("no sync_file_range here")
    events: list[tuple[object, ...]] = []
    real_sfr, real_sync = durability._sync_file_range(), os.fdatasync

    def sfr(fd: int, offset: int, nbytes: int, flags: int) -> int:
        events.append(("writeback", offset, nbytes, flags))
        return int(real_sfr(fd, offset, nbytes, flags))

    def sync(fd: int) -> None:
        events.append(("fdatasync",))
        real_sync(fd)

    monkeypatch.setattr(durability, "_sync_file_range", lambda: sfr)
    monkeypatch.setattr(durability.os, "fdatasync", sync)
    big, small = os.urandom(256 << 10), os.urandom(4096)
    for mode, start, want in [(FsyncMode.BATCH, 64 << 10, True), (FsyncMode.BATCH, 0, False),
                              (FsyncMode.NEVER, 64 << 10, False)]:
        st = ChunkStore(tmp_path / f"cs-{mode}-{start}", chunk_bytes=8 << 20, fsync=mode,
                        writeback_start_bytes=start)
        st.server_id = 1
        try:
            events.clear()
            (cid, off), = await st.append(*_append_args(b"big", big))
            end = st.sizes[cid]
            if want:  # the whole record (header, key, value), then the sync that covers it
                assert events == [("writeback", 0, end, 2), ("fdatasync",)]
                assert off + len(big) == end
            else:
                assert not [e for e in events if e[0] == "writeback"]
            events.clear()
            await st.append(*_append_args(b"small", small))  # under the threshold: left to the sync
            assert not [e for e in events if e[0] == "writeback"]
        finally:
            await st.close()


def test_state_json_is_replaced_whole(tmp_path: Path) -> None:
    st = ChunkStore(tmp_path, chunk_bytes=1 << 20)
    try:
        st.server_id = 7
        st.save_state()
        assert json.loads((tmp_path / "state.json").read_text())["server_id"] == 7
        assert not list(tmp_path.glob("*.tmp"))
    finally:
        st.close_now()


async def test_new_chunks_take_their_ids_from_a_block_state_json_reserved_once(tmp_path: Path) -> None:
    """state.json (replaced durably: two fsyncs, each a flush of the disk's cache) is written
    once per ``SEQ_BLOCK`` new chunks, not once each; after a restart with every chunk file
    gone (GC deleted them) the next id is still past every id handed out before."""
    st = ChunkStore(tmp_path, chunk_bytes=8192)  # a 4 KiB value each: every append a new chunk
    st.server_id = 1
    ids: list[int] = []
    inodes: set[int] = set()
    for i in range(5):
        ((cid, _),) = await st.append(*_append_args(b"k%d" % i, b"x" * 4096))
        ids.append(cid)
        inodes.add(os.stat(tmp_path / "state.json").st_ino)
    assert len(set(ids)) == 5 and len(inodes) == 1  # five chunks, state.json replaced once
    assert await st.close()
    for cid in ids:
        os.unlink(st.chunk_path(cid))
    again = ChunkStore(tmp_path, chunk_bytes=8192)
    again.server_id = 1
    try:
        ((cid, _),) = await again.append(*_append_args(b"after", b"x" * 4096))
        assert cid > max(ids)
    finally:
        await again.close()


async def test_meta_gc_transactions_are_synced_in_every_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--fsync never`` (the store at NORMAL): a delete is answered unsynced, a GC change
    (a chunk retirement) only after an ``fdatasync`` of the WAL."""
    full = MetaStore(tmp_path / "a.sqlite3")
    assert full.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL by default
    full.close()
    ms = MetaStore(tmp_path / "b.sqlite3", synchronous="NORMAL")
    ix = MetaIndex(MetaConfig(data=tmp_path, fsync=FsyncMode.NEVER), ms, time.time)
    synced: list[str] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    try:
        assert ms.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert await ix.delete([b"absent"]) == 0 and synced == []
        assert await ix.retire(1, [5], 0.0) == [5]
        assert synced == [str(ms.wal_path)]
        assert ms.load_dead() == [(5, 1, 0.0)]
    finally:
        await ix.close()
    with pytest.raises(ValueError, match="synchronous"):
        MetaStore(tmp_path / "c.sqlite3", synchronous="OFF")


async def test_meta_gc_changes_are_synced_in_every_mode_on_rocksdb(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on RocksDB, the default store: under ``--fsync never`` (every batch written
    unsynced) a delete is answered with no sync of the WAL, a GC change after one."""
    ms = open_local(tmp_path, "rocksdb", synchronous="NORMAL")
    ix = MetaIndex(MetaConfig(data=tmp_path, fsync=FsyncMode.NEVER), ms, time.time)
    synced: list[int] = []
    real = ms.sync_wal

    def sync_wal() -> None:
        synced.append(1)
        real()

    monkeypatch.setattr(ms, "sync_wal", sync_wal)
    try:
        assert await ix.delete([b"absent"]) == 0 and synced == []
        assert await ix.retire(1, [5], 0.0) == [5]
        assert synced == [1]
        assert ms.load_dead() == [(5, 1, 0.0)]
    finally:
        await ix.close()


async def test_a_chunkserver_stopped_over_a_hanging_write_keeps_its_data_dir_locked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunkserver stopped while an append's write hangs on the disk (fault injection)
    stops within its close timeout and keeps its data directory locked: a server started on
    it meanwhile is refused, so none appends where the abandoned write lands.  The append is
    refused once the write ends (not acknowledged), and the chunk holds its record whole."""
    root = tmp_path / "c"
    cluster = LocalCluster(root, 1, chunkserver=ChunkServerConfig(
        data=root, heartbeat_interval_s=0.2, close_timeout_s=0.2))
    await cluster.start()
    try:
        cs = cluster.chunkservers[0]
        assert cs is not None
        real = os.pwritev
        entered, go = threading.Event(), threading.Event()

        def hangs(fd: int, bufs: list[bytes | memoryview], offset: int) -> int:
            entered.set()
            assert go.wait(60), "the test never let the write go on"
            return real(fd, bufs, offset)

        monkeypatch.setattr(os, "pwritev", hangs)
        v = b"v" * 4096
        hung = asyncio.create_task(cs.store.append([(b"k", len(v), crc32c.crc32c(v), None)],
                                                   memoryview(v)))
        try:
            assert await asyncio.to_thread(entered.wait, 60)
            async with asyncio.timeout(30):  # (without a bound: as long as the disk hangs)
                await cluster.stop_chunkserver(0)
            with pytest.raises(DataDirInUse, match="in use by another chunkserver"):
                ChunkServer(cluster.cs_config(0), tokens=cluster.tokens)
        finally:
            go.set()
        with pytest.raises(Unavailable, match="shutting down"):
            async with asyncio.timeout(60):
                await hung
        monkeypatch.undo()
        cid = cs.store.open_chunk
        assert cid is not None
        assert [(r.key, r.value_ok) for r in await asyncio.to_thread(
            lambda: list(scan_records(cs.store.chunk_path(cid).read_bytes())))] == [(b"k", True)]
        for fd in (*cs.store._fds.values(), *cs.store._close_later):  # left open by its close
            os.close(fd)
        cs.lock.release()  # (the process's exit would)
        await cluster.start_chunkserver(0)
    finally:
        async with asyncio.timeout(60):
            await cluster.stop()
