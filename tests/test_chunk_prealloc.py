"""Chunk files reserve their blocks up front (fallocate KEEP_SIZE) and give back the rest when sealed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest
from poll import until

from kvfs.chunkserver import store as store_mod
from kvfs.chunkserver.records import record_header
from kvfs.chunkserver.store import ChunkStore, align_up, preallocate
from kvfs.errors import NoSpace
from kvfs.mount.mtab import unescape

CHUNK = 8 << 20


def _store(root: Path, prealloc: bool) -> ChunkStore:
    st = ChunkStore(root, chunk_bytes=CHUNK, preallocate=prealloc)
    st.server_id = 1
    return st


async def _put(st: ChunkStore, key: bytes, value: bytes) -> tuple[int, int]:
    ((cid, off),) = await st.append([(key, len(value), crc32c.crc32c(value), None)], memoryview(value))
    return cid, off


def _blocks(st: ChunkStore, cid: int) -> int:
    return os.stat(st.chunk_path(cid)).st_blocks * 512


def _supported(tmp: Path) -> bool:
    fd = os.open(tmp / "probe", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        return preallocate(fd, 1 << 20)
    finally:
        os.close(fd)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A data dir on a filesystem with fallocate (the test is skipped elsewhere)."""
    if not _supported(tmp_path):
        pytest.skip("this filesystem has no fallocate")
    return tmp_path / "cs"


@contextlib.contextmanager
def opened(root: Path, prealloc: bool = True) -> Iterator[ChunkStore]:
    st = _store(root, prealloc)
    try:
        yield st
    finally:
        st.close_now()


async def test_open_chunk_reserves_blocks_and_sealing_releases_them(root: Path) -> None:
    with opened(root) as st:
        value = os.urandom(4096)
        cid, off = await _put(st, b"k", value)
        assert os.stat(st.chunk_path(cid)).st_size == st.sizes[cid]  # the size is what was written
        assert _blocks(st, cid) >= CHUNK  # the blocks of the whole chunk are reserved
        assert await st.seal(cid, 0.0)
        assert not await st.pool.wait_idle(30)  # given back in an IO thread
        assert _blocks(st, cid) < CHUNK // 4  # sealed: the reservation past the end is given back
        views, stale = await st.readv([(cid, off, len(value))])
        assert not stale and bytes(views[0]) == value  # type: ignore[arg-type]
    # a restart finds no torn tail: the reserved blocks were never part of the file
    with opened(root) as again:
        assert again.sizes[cid] == os.stat(again.chunk_path(cid)).st_size


async def test_rolling_to_a_new_chunk_releases_the_old_one(root: Path) -> None:
    with opened(root) as st:
        first, _ = await _put(st, b"a", os.urandom(CHUNK // 2))
        second, _ = await _put(st, b"b", os.urandom(CHUNK // 2 + (64 << 10)))  # does not fit: a new chunk
        assert second != first
        assert not await st.pool.wait_idle(30)  # given back in an IO thread
        assert _blocks(st, first) < CHUNK * 3 // 4  # the unused half went back
        assert _blocks(st, second) >= CHUNK


async def test_a_new_chunk_never_waits_for_the_old_one_to_give_its_blocks_back(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeing blocks can wait for the disk (ext4 ``-o discard`` without a journal discards
    them before truncate returns): the old chunk's release runs in an IO thread, never in
    the event loop, so appends to the new chunk go on meanwhile.  Here it is held until the
    test lets it go; in the event loop it would never be let go and fails the roll."""
    gate = threading.Event()
    real = os.truncate

    def held(path: str | os.PathLike[str], size: int) -> None:
        if not gate.wait(10):
            raise OSError("the held truncate was never let go")
        real(path, size)

    with opened(root) as st:
        first, _ = await _put(st, b"a", os.urandom(CHUNK // 2 + (128 << 10)))
        assert not await st.pool.wait_idle(30)  # the next chunk reserved ahead (half full)
        monkeypatch.setattr(os, "truncate", held)
        # a new chunk, left under half full by both puts: no reservation job of its own runs
        second, _ = await _put(st, b"b", os.urandom(CHUNK // 2 - (64 << 10)))
        third, _ = await _put(st, b"c", os.urandom(4096))
        assert second != first and third == second and st.pool.running == 1  # still held
        gate.set()
        assert not await st.pool.wait_idle(30)
        monkeypatch.undo()
        assert _blocks(st, first) < CHUNK * 3 // 4


async def test_close_gives_back_the_reservation_of_the_open_chunk(root: Path) -> None:
    value = os.urandom(4096)
    with opened(root) as st:
        cid, off = await _put(st, b"k", value)
        assert _blocks(st, cid) >= CHUNK
    assert _blocks(st, cid) < CHUNK // 4  # a stopped server holds no reserved blocks
    with opened(root) as again:  # the chunk is intact and still takes appends after the restart
        views, stale = await again.readv([(cid, off, len(value))])
        assert not stale and bytes(views[0]) == value  # type: ignore[arg-type]
        cid2, off2 = await _put(again, b"k2", value)
        views, stale = await again.readv([(cid2, off2, len(value))])
        assert not stale and bytes(views[0]) == value  # type: ignore[arg-type]


async def test_preallocate_off_reserves_nothing(tmp_path: Path) -> None:
    with opened(tmp_path / "cs", False) as st:
        cid, _ = await _put(st, b"k", os.urandom(4096))
        assert _blocks(st, cid) < CHUNK // 4


def _fs_type(path: Path) -> str:
    """The type of the filesystem ``path`` is on: the longest mount point above it."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            where = unescape(parts[1])
            if (str(path) + "/").startswith(where.rstrip("/") + "/") and len(where) >= len(best):
                best, kind = where, parts[2]
    return kind


def test_preallocate_works_on_the_filesystems_that_have_fallocate(tmp_path: Path) -> None:
    """The tests above skip where preallocate() says the filesystem cannot; on ext4, xfs and
    btrfs it must not say so (a preallocate() that always gave up would pass them all)."""
    kind = _fs_type(tmp_path.resolve())
    if kind not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"the test dir is on {kind or 'an unknown filesystem'}")
    assert _supported(tmp_path)


# the next chunk reserved ahead -----------------------------------------------------------


def _unused(st: ChunkStore) -> set[int]:
    """Chunk files on disk that the store does not count as chunks: one reserved ahead."""
    return {int(p.stem, 16) for p in st.dir.glob("*.chunk")} - set(st.sizes)


async def _past_half(st: ChunkStore) -> tuple[int, int]:
    """The open chunk filled past half (AHEAD_AT), its next chunk's job let end."""
    cid, _ = await _put(st, b"half", os.urandom(CHUNK // 2 + 4096))
    assert not await st.pool.wait_idle(30)
    (ahead,) = _unused(st)
    return cid, ahead


def _hold_reservations(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Each reservation job held until the first event is set; the second is set once one
    is held."""
    gate, started = threading.Event(), threading.Event()
    real = store_mod._reserve_chunk

    def held(path: Path, nbytes: int, dir_path: Path | None) -> bool:
        started.set()
        if not gate.wait(10):
            raise OSError("the held reservation was never let go")
        return real(path, nbytes, dir_path)

    monkeypatch.setattr(store_mod, "_reserve_chunk", held)
    return gate, started


async def test_a_roll_takes_the_chunk_reserved_ahead_whose_first_write_reserves_nothing(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reserves: list[int] = []
    real = store_mod._write_at

    def spy(fd: int, bufs: list[bytes | memoryview], offset: int, reserve: int, writeback: int = 0) -> None:
        reserves.append(reserve)
        real(fd, bufs, offset, reserve, writeback)

    monkeypatch.setattr(store_mod, "_write_at", spy)
    with opened(root) as st:
        new_files: list[bool] = []
        sync = st.syncer.sync

        async def sync_spy(fd: int, *, new_file: bool = False) -> None:
            new_files.append(new_file)
            await sync(fd, new_file=new_file)

        monkeypatch.setattr(st.syncer, "sync", sync_spy)
        first, _ = await _put(st, b"a", os.urandom(CHUNK // 4))
        assert reserves == [CHUNK] and not _unused(st)  # a fresh chunk; under half: none ahead
        first_again, ahead = await _past_half(st)
        assert first_again == first and ahead > first
        # before any roll: an empty file whose blocks are reserved, not a chunk of the store's
        assert os.stat(st.chunk_path(ahead)).st_size == 0 and _blocks(st, ahead) >= CHUNK
        value = os.urandom(CHUNK // 2)
        second, off = await _put(st, b"b", value)  # does not fit: the roll
        assert second == ahead and st.open_chunk == ahead and st.sizes[ahead] > 0
        assert reserves[-1] == 0  # its first write's job reserved nothing
        assert (st.ahead_taken, st.ahead_missed) == (1, 1)  # the first chunk was made fresh
        assert new_files == [True, False, False]  # under batch, its entry was synced ahead
        views, stale = await st.readv([(second, off, len(value))])
        assert not stale and bytes(views[0]) == value  # type: ignore[arg-type]
        assert not await st.pool.wait_idle(30)
        assert _blocks(st, first) <= align_up(st.sizes[first]) and _blocks(st, ahead) >= CHUNK


async def test_a_reservation_not_ready_at_the_roll_is_not_waited_for_and_is_removed(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, started = _hold_reservations(monkeypatch)
    with opened(root) as st:
        first, _ = await _put(st, b"a", os.urandom(CHUNK // 2 + 4096))
        assert await asyncio.to_thread(started.wait, 10)
        second, _ = await _put(st, b"b", os.urandom(CHUNK // 2))  # rolls while it is held
        assert second != first and (st.ahead_taken, st.ahead_missed) == (0, 2)
        assert _blocks(st, second) >= CHUNK  # reserved by its own first write, as ever
        gate.set()
        await until(lambda: not _unused(st) and not st.pool.running, "the dropped reservation removed")
        assert sorted(p.name for p in st.dir.glob("*.chunk")) == sorted(
            st.chunk_path(c).name for c in st.sizes)


async def test_a_reservation_that_finds_the_disk_full_leaves_appends_working(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fallocate answering ENOSPC (injected: every reservation, the fresh chunks' too) leaves
    no file behind and costs no append anything."""
    calls: list[int] = []

    def full(fd: int, nbytes: int) -> bool:
        calls.append(nbytes)
        return False  # what preallocate() answers for ENOSPC

    monkeypatch.setattr(store_mod, "preallocate", full)
    with opened(root) as st:
        values = [os.urandom(CHUNK // 2 + 4096) for _ in range(3)]
        locs = [await _put(st, b"k%d" % i, v) for i, v in enumerate(values)]
        assert not await st.pool.wait_idle(30)
        assert len({c for c, _ in locs}) == 3 and len(calls) >= 4  # fresh chunks and reservations
        assert not _unused(st) and st.ahead_taken == 0
        views, stale = await st.readv([(c, off, len(v)) for (c, off), v in zip(locs, values, strict=True)])
        assert not stale and [bytes(v) for v in views] == values  # type: ignore[arg-type]


async def test_a_disk_without_room_for_it_gets_no_reservation(root: Path) -> None:
    st = ChunkStore(root, chunk_bytes=CHUNK, capacity_bytes=3 * CHUNK)  # < 3 chunks free past half
    st.server_id = 1
    try:
        await _put(st, b"a", os.urandom(CHUNK // 2 + 4096))
        assert not await st.pool.wait_idle(30)
        assert not _unused(st)
        cid, _ = await _put(st, b"b", os.urandom(CHUNK // 2))
        assert st.sizes[cid] > 0 and st.ahead_taken == 0
    finally:
        st.close_now()


async def test_an_append_refused_for_room_gives_the_reservation_back(root: Path) -> None:
    """A store with a chunk reserved ahead refuses an append that does not fit (NoSpace):
    the reservation's file is removed (its blocks are the disk's again), and appends that
    fit go on."""
    st = ChunkStore(root, chunk_bytes=CHUNK, capacity_bytes=5 * CHUNK)  # room for one ahead
    st.server_id = 1
    try:
        cid, _ = await _past_half(st)
        with pytest.raises(NoSpace):
            await _put(st, b"big", os.urandom(5 * CHUNK))
        await until(lambda: not _unused(st), "the reservation removed")
        assert (await _put(st, b"small", os.urandom(4096)))[0] == cid
    finally:
        st.close_now()


async def test_a_reservation_that_cannot_write_its_id_fails_no_append(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reservation's chunk id needs state.json rewritten (once per block of ids): when
    that write fails, the append that asked (written and counted) is still answered, no
    reservation is made, and the write is not tried again per append of that chunk."""
    with opened(root) as st:
        cid, _ = await _put(st, b"first", os.urandom(4096))  # the open chunk (its id taken)
        st.seq_reserved = st.next_seq  # the next id needs state.json written
        tries = []

        def failing(path: Path, data: bytes) -> None:  # fault injection: the disk refuses it
            tries.append(path)
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(store_mod, "replace_durably", failing)
        assert (await _put(st, b"a", os.urandom(CHUNK // 2 + 4096)))[0] == cid  # past half
        assert (await _put(st, b"b", os.urandom(4096)))[0] == cid
        assert len(tries) == 1 and not _unused(st) and st._ahead is None
        monkeypatch.undo()


async def test_close_with_a_reservation_in_flight_leaves_nothing_behind(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, started = _hold_reservations(monkeypatch)
    st = _store(root, True)
    try:
        cid, _ = await _put(st, b"a", os.urandom(CHUNK // 2 + 4096))
        assert await asyncio.to_thread(started.wait, 10)
        closing = asyncio.ensure_future(st.close())
        await until(lambda: st._closed, "the close under way")
        assert not closing.done()  # it waits for the reservation's job
        gate.set()
        assert await closing
        assert [p.name for p in st.dir.glob("*.chunk")] == [st.chunk_path(cid).name]
        assert _blocks(st, cid) < CHUNK * 3 // 4  # the open chunk's own reservation given back too
    finally:
        gate.set()
        await st.close()


_CRASH = """
import asyncio, os, sys
from pathlib import Path
import crc32c
from kvfs.chunkserver.store import ChunkStore

async def main() -> None:
    st = ChunkStore(Path(sys.argv[1]), chunk_bytes=int(sys.argv[2]))
    st.server_id = 1
    value = os.urandom(int(sys.argv[2]) // 2 + 4096)
    await st.append([(b"k", len(value), crc32c.crc32c(value), None)], memoryview(value))
    assert not await st.pool.wait_idle(30)
    os._exit(0)  # a crash: no close

asyncio.run(main())
"""


async def test_a_restart_gives_back_an_unused_reserved_chunk_and_never_reuses_its_id(root: Path) -> None:
    """A store process ends (no close) with the next chunk reserved: the restart removes it
    (its blocks back), counts nothing of it, hands its id to no chunk, and still recovers
    the torn tail of the chunk before it (the newest holding records)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _CRASH, str(root), str(CHUNK))
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    chunks = {int(p.stem, 16): p for p in (root / "chunks").glob("*.chunk")}
    (ahead,) = (c for c, p in chunks.items() if p.stat().st_size == 0)
    (data,) = set(chunks) - {ahead}
    assert ahead > data and chunks[ahead].stat().st_blocks * 512 >= CHUNK
    size = chunks[data].stat().st_size
    with open(chunks[data], "ab") as f:  # a torn last record: half a header
        f.write(record_header(b"torn", 4096, 0, None)[:20])
    with opened(root) as st:
        assert not chunks[ahead].exists() and ahead not in st.sizes
        assert st.sizes == {data: size} and st.used_bytes == size
        assert chunks[data].stat().st_size == size  # the tail cut back
        new, _ = await _put(st, b"after", os.urandom(4096))
        assert new > ahead


async def test_a_restart_recovers_the_open_chunk_even_when_a_newer_chunk_holds_records(
        root: Path) -> None:
    """Compaction takes a newer chunk id than the chunk appends go to: at a restart the
    newest chunk by id need not be the open one.  The open chunk (blocks reserved past its
    end) still has its torn tail cut and its reserved blocks given back; the newer chunk's
    records are kept as they are."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _CRASH, str(root), str(CHUNK))
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    chunks = {int(p.stem, 16): p for p in (root / "chunks").glob("*.chunk")}
    (ahead,) = (c for c, p in chunks.items() if p.stat().st_size == 0)
    (data,) = set(chunks) - {ahead}
    size = chunks[data].stat().st_size
    with open(chunks[data], "ab") as f:  # a torn last record: half a header
        f.write(record_header(b"torn", 4096, 0, None)[:20])
    value = os.urandom(4096)
    newer = chunks[data].with_name(f"{ahead + 1:016x}.chunk")  # as a compaction writes one
    newer.write_bytes(record_header(b"kept", len(value), crc32c.crc32c(value), None) + value)
    kept = newer.stat().st_size
    with opened(root) as st:
        assert st.sizes == {data: size, ahead + 1: kept}
        assert chunks[data].stat().st_size == size  # the open chunk's tail cut back
        assert _blocks(st, data) < align_up(size) + (1 << 20)  # its reservation given back
        assert newer.stat().st_size == kept
