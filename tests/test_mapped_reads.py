"""READV answers as views of mapped chunk files (``ChunkStore.readv_mapped``,
``chunkserver/maps.py``): every range's bytes in request order, runs joined, nothing
answered that is not all here and all in the page cache, mappings bounded, grown with the
open chunk and kept alive by the views of an answer still being sent.  Real files and pages;
the server's use of it is in tests/test_readpath.py (a chain read back through a cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from crc32c import crc32c
from pagecache import warm
from poll import until
from procfs import mapped_paths, open_paths

from kvfs.chunkserver import store as store_mod
from kvfs.chunkserver.store import MAPPED_MAX_CHUNKS, ChunkStore, resident
from kvfs.config import FsyncMode


async def _store(tmp_path: Path, maps: int = 8, chunk_bytes: int = 256 * 1024) -> ChunkStore:
    st = ChunkStore(tmp_path / "cs", chunk_bytes=chunk_bytes, preallocate=False,
                    max_mapped_files=maps, fsync=FsyncMode.NEVER)
    st.server_id = 1
    return st


async def _put(st: ChunkStore, n: int, size: int, tag: str = "") -> tuple[list[tuple[int, int, int]], list[bytes]]:
    values = [os.urandom(size) for _ in range(n)]
    recs = [(f"{tag}{i}".encode(), size, crc32c(v), None) for i, v in enumerate(values)]
    locs = await st.append(recs, memoryview(b"".join(values)))
    return [(c, off, size) for c, off in locs], values


@contextlib.contextmanager
def _evicted(st: ChunkStore, c: int) -> Iterator[int]:
    """Chunk ``c``'s pages dropped from the page cache (skipped where the filesystem keeps
    them: tmpfs); yields an fd of its file.  Pages mapped (by a view) are never dropped."""
    fd = os.open(st.chunk_path(c), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if resident(fd, 0, st.sizes[c]):
            pytest.skip("this filesystem keeps the pages (tmpfs)")
        yield fd
    finally:
        os.close(fd)


def _read(views: list[memoryview]) -> list[bytes]:
    return [bytes(v) for v in views]


def _mapped(st: ChunkStore, ranges: list[tuple[int, int, int]]) -> list[memoryview] | None:
    """``readv_mapped``, asked again while it says no, a bounded number of times: cachestat
    can count a page short while the kernel changes its entry (writeback), and the answer
    is then read instead (rare: 2 in ~25,000 READVs of 43 ranges at load 14 here); and a
    loaded machine may have pushed the just-written pages out: the chunks are read back
    into the page cache before the next ask."""
    for _ in range(50):
        views = st.readv_mapped(ranges)
        if views is not None:
            return views
        warm(*{st.chunk_path(c) for c, _, _ in ranges})
    return None


async def test_every_range_in_request_order_from_several_chunks(tmp_path: Path) -> None:
    st = await _store(tmp_path, chunk_bytes=64 * 1024)
    try:
        ranges, values = [], []
        for j in range(5):  # 5 chunks (each APPEND of 40 KB rolls to a new one)
            r, v = await _put(st, 10, 4000, f"{j}/")
            ranges += r
            values += v
        assert len({c for c, _, _ in ranges}) == 5
        order = random.Random(3).sample(range(len(ranges)), 30)
        asked = [ranges[i] for i in order]
        c0, off0, _ = ranges[0]
        asked.insert(7, (c0, off0, 0))  # a zero-length range: an empty view in its place
        views = _mapped(st, asked)
        assert views is not None
        want = [values[i] for i in order]
        want.insert(7, b"")
        assert _read(views) == want
        assert st.mapped_spans == len(asked) and st.bytes_read == 30 * 4000
        assert 1 <= len(st.maps) <= 5
    finally:
        await st.close()


async def test_ranges_that_follow_each_other_are_one_view(tmp_path: Path) -> None:
    st = await _store(tmp_path)
    try:
        ((c, off, _),), (value,) = await _put(st, 1, 100_000)
        parts = [(c, off + a, b - a) for a, b in [(0, 10), (10, 4096), (4096, 50_000), (50_000, 100_000)]]
        views = _mapped(st, parts)
        assert views is not None and len(views) == 1 and bytes(views[0]) == value
        views = _mapped(st, parts[::-1])  # out of order: one view each
        assert views is not None and len(views) == 4
        assert b"".join(_read(views[::-1])) == value
    finally:
        await st.close()


async def test_what_is_not_all_here_and_cached_is_left_to_readv_into(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = await _store(tmp_path, chunk_bytes=16 * 1024)
    try:
        ranges, _ = await _put(st, 2, 3000)
        c, off, ln = ranges[0]
        assert st.readv_mapped([(c, off, ln), (c + 1, 0, 1)]) is None  # a chunk not here
        assert st.readv_mapped([(c, off, st.sizes[c])]) is None  # past the chunk's end
        assert st.readv_mapped([(c, -1, 10)]) is None and st.readv_mapped([(c, 10, -1)]) is None
        many = [(await _put(st, 1, 10_000, f"m{i}/"))[0][0] for i in range(MAPPED_MAX_CHUNKS + 1)]
        assert len({r[0] for r in many}) == MAPPED_MAX_CHUNKS + 1
        assert st.readv_mapped(many) is None  # too many chunks for one look each
        assert _mapped(st, many[:MAPPED_MAX_CHUNKS]) is not None
        monkeypatch.setattr(store_mod, "MAPPED_CHECK_BYTES", 1000)
        assert st.readv_mapped(ranges) is None  # the stretch to ask about is too long
        monkeypatch.setattr(store_mod, "MAPPED_CHECK_BYTES", 1 << 20)
        st.maps.max_maps = 0
        assert st.readv_mapped(ranges) is None  # no mappings allowed (--max-mapped-chunks 0)
    finally:
        await st.close()


@pytest.mark.parametrize("cachestat", [True, False], ids=["cachestat", "mincore"])
async def test_pages_not_in_the_page_cache_are_never_answered_from_the_mapping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cachestat: bool) -> None:
    """A send of a page the page cache lacks would read the disk in the event loop.  Asked
    of ``cachestat``, or of ``mincore`` on the mapping where the kernel lacks it."""
    pc = store_mod._page_cache()
    assert pc is not None
    if cachestat and not pc.cachestat:
        pytest.skip("this kernel has no cachestat(2)")
    monkeypatch.setattr(pc, "cachestat", cachestat)
    st = ChunkStore(tmp_path / "cs", chunk_bytes=1 << 20, preallocate=False, max_mapped_files=4,
                    fsync=FsyncMode.ALWAYS)  # written back: its pages can be dropped
    st.server_id = 1
    try:
        ranges, values = await _put(st, 16, 8192)
        c = ranges[0][0]
        with _evicted(st, c) as fd:
            assert st.readv_mapped(ranges) is None
            views, errors = await st.readv(ranges)  # read (from the disk, in the pool)
            assert not errors and [bytes(v) for v in views if v is not None] == values
            assert resident(fd, 0, st.sizes[c])
            got = _mapped(st, ranges)  # cached now
            assert got is not None and _read(got) == values
    finally:
        await st.close()


async def test_a_stretch_found_cached_is_believed_for_a_short_time_and_evicted_pages_still_read_right(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page cache is asked about a chunk's stretch once per ``resident_keep_s``: READVs
    inside it meanwhile are answered from the mapping without asking (of a stretch touching
    it, only the bytes past it are asked about, then joined).  A page evicted in that time is read by the send (here: Python reading
    the view): the right bytes, never a miss or others'.  With no time to believe, each READV
    asks, and evicted pages are left to readv_into."""
    asked: list[int] = []
    real = store_mod.resident

    def counted(fd: int, offset: int, length: int, addr: int | None = None) -> bool:
        asked.append(length)
        return real(fd, offset, length, addr)

    monkeypatch.setattr(store_mod, "resident", counted)
    st = ChunkStore(tmp_path / "cs", chunk_bytes=1 << 20, preallocate=False, max_mapped_files=4,
                    fsync=FsyncMode.ALWAYS)  # written back: its pages can be dropped
    st.server_id = 1
    st.resident_keep_s = 3600.0
    try:
        ranges, values = await _put(st, 16, 8192)
        got = _mapped(st, ranges[4:8])
        assert got is not None and _read(got) == values[4:8]
        n = len(asked)
        assert n >= 1
        got = st.readv_mapped(ranges[5:7])  # inside: believed
        assert got is not None and _read(got) == values[5:7] and len(asked) == n
        got = _mapped(st, ranges[:5])  # touching it on the left: asked only before it, joined
        assert got is not None and _read(got) == values[:5] and len(asked) > n
        assert asked[-1] == ranges[4][1] - ranges[0][1]  # from range 0 to range 4's start
        n = len(asked)
        got = _mapped(st, ranges[7:])  # touching it on the right: asked only past it, joined
        assert got is not None and _read(got) == values[7:] and len(asked) > n
        assert asked[-1] == ranges[-1][1] - ranges[7][1]  # from the end of range 7 to the last's
        n = len(asked)
        del got
        st._in_cache.clear()
        st.resident_keep_s = 0.0  # no time to believe: each READV of cached pages asks
        for i in (1, 2):
            got = st.readv_mapped(ranges)
            assert got is not None and _read(got) == values and len(asked) == n + i
            del got
        st.resident_keep_s = 3600.0  # the belief's time passed: asked once more, then believed
        got = st.readv_mapped(ranges)
        assert got is not None and len(asked) == n + 3
        n = len(asked)
        del got
        st.maps.clear()  # unmapped (no view left): pages mapped here are never dropped
        with _evicted(st, ranges[0][0]) as fd:
            got = st.readv_mapped(ranges[::-1])  # evicted, still believed: read by the copy
            assert got is not None and _read(got) == values[::-1] and len(asked) == n
            del got
            st.maps.clear()
            st._in_cache.clear()
            st.resident_keep_s = 0.0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            assert st.readv_mapped(ranges) is None and len(asked) == n + 1  # asked: not cached
            assert st.readv_mapped(ranges) is None and len(asked) == n + 2  # and asked again
    finally:
        await st.close()


async def test_the_open_chunk_is_mapped_again_once_reads_pass_its_mapping(tmp_path: Path) -> None:
    st = await _store(tmp_path, chunk_bytes=1 << 20)
    try:
        first, v1 = await _put(st, 4, 5000, "a")
        got = _mapped(st, first)
        assert got is not None and _read(got) == v1 and st.maps.mapped == 1
        second, v2 = await _put(st, 4, 5000, "b")
        assert second[0][0] == first[0][0]  # the same chunk, grown
        got2 = _mapped(st, first + second)
        assert got2 is not None and _read(got2) == v1 + v2 and st.maps.mapped == 2
        assert _read(got) == v1  # views of the first mapping still read right
    finally:
        await st.close()


async def test_mappings_are_bounded_and_views_outlive_their_chunk(tmp_path: Path) -> None:
    st = await _store(tmp_path, maps=2, chunk_bytes=16 * 1024)
    try:
        chunks = []
        for i in range(4):
            r, v = await _put(st, 1, 10_000, f"{i}/")
            chunks.append((r, v))
        held = []
        for r, v in chunks:
            views = _mapped(st, r)
            assert views is not None and _read(views) == v
            held.append(views)
            assert len(st.maps) <= 2
        (c, _, _), = chunks[0][0]
        assert st.open_chunk != c
        assert c in await st.delete_chunks([c])
        assert not st.chunk_path(c).exists()
        # an answer being sent still holds its views: the unlinked chunk stays mapped
        assert [_read(v) for v in held] == [v for _, v in chunks]
        assert st.readv_mapped(chunks[0][0]) is None  # gone from this server
    finally:
        await st.close()


@pytest.mark.parametrize("pushed_out", [False, True], ids=["in-the-lru", "pushed-out"])
async def test_a_deleted_chunks_mapping_is_unmapped_in_an_io_thread(tmp_path: Path, pushed_out: bool) -> None:
    """The views of an answer being sent keep a deleted chunk's mapping, and with it the
    file, past the unlink: the unmap once the last view is gone frees the file's blocks,
    which can wait for the disk, so it runs in an IO thread, not in the event loop that let
    go of the view.  Here the store's one IO thread is held: the file stays mapped until it
    is let go.  Pushed out: the mapping pushed out of the LRU (another chunk mapped) while
    the answer holds its views, before the chunk is deleted (whether a mapping is a deleted
    chunk's is decided when its last view goes, not kept with the LRU's entry)."""
    st = ChunkStore(tmp_path / "cs", chunk_bytes=16 * 1024, preallocate=False,
                    max_mapped_files=1 if pushed_out else 8, fsync=FsyncMode.NEVER, io_threads=1)
    st.server_id = 1
    try:
        r, v = await _put(st, 1, 10_000)
        r2, v2 = await _put(st, 1, 10_000, "b/")  # each a chunk of its own
        await _put(st, 1, 10_000, "next/")  # a new chunk: the first ones can be deleted
        ((c, _, _),) = r
        path = str(st.chunk_path(c))
        views = _mapped(st, r)
        assert views is not None and _read(views) == v
        if pushed_out:
            other = _mapped(st, r2)  # the first chunk's mapping pushed out of the LRU
            assert other is not None and _read(other) == v2 and len(st.maps) == 1
            del other
        assert c in await st.delete_chunks([c])
        assert f"{path} (deleted)" in mapped_paths()  # an answer being sent holds its views
        gate = threading.Event()
        held = st.pool.submit(gate.wait, 10)  # the IO thread busy
        del views
        assert f"{path} (deleted)" in mapped_paths(), "unmapped in the event loop"
        gate.set()
        assert await asyncio.wrap_future(held)
        await until(lambda: f"{path} (deleted)" not in mapped_paths(), "the mapping to go")
        assert not any(p.startswith(path) for p in open_paths())  # its blocks are freed
    finally:
        await st.close()
