"""Chunk files reserve their blocks up front (fallocate KEEP_SIZE) and give back the rest when sealed."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest

from kvfs.chunkserver.store import ChunkStore, preallocate
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
        first, _ = await _put(st, b"a", os.urandom(CHUNK // 2))
        monkeypatch.setattr(os, "truncate", held)
        second, _ = await _put(st, b"b", os.urandom(CHUNK // 2 + (64 << 10)))  # a new chunk
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
