"""Chunk files: append-only, records packed back to back, each self-describing.

The record format and the scan live in :mod:`kvfs.chunkserver.records`.
A layout's extent points at the *value*, so a read never touches record headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import json
import logging
import operator
import os
import secrets
import shutil
import socket
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, compress
from pathlib import Path
from typing import Any, NamedTuple, cast

import crc32c

from kvfs.chunkserver.durability import GroupSync, fsync_dir, replace_durably, start_writeback
from kvfs.chunkserver.iopool import IoPool
from kvfs.chunkserver.maps import ChunkMaps
from kvfs.chunkserver.records import (
    Damage,
    ScannedRecord,
    append_buffers,
    copy_header,
    only_tombstones,
    recovery_point,
    scan_records,
)
from kvfs.config import FsyncMode
from kvfs.datadir import FILE_MODE, private_dir
from kvfs.errors import InvalidArgument, NoSpace, StaleLayout, Unavailable
from kvfs.fileparts import FileParts
from kvfs.layout import make_chunk_id
from kvfs.rpc import Range

log = logging.getLogger("kvfs.chunkserver")

ALIGN = 4096
IOV_MAX = 512
# An append's bytes go to the page cache in pwritev calls of at most this many bytes.  On the
# benchmark VM, new page-cache pages filled by 4 MiB writes cost the chunkservers several
# times the CPU of the same pages filled by 256 KiB writes (the kernel sizes a new folio by
# the write that makes it, up to 2 MiB here; the large ones are the dear ones): 0.82-1.11 ->
# 0.60-0.65 s per GB put, for about 0.01-0.02 s/GB more on reads of those pages
# (bench/RESULTS.md, "Issue 11: large puts").  Each extra call costs a few us.
WRITE_PIECE = 256 * 1024


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Span(NamedTuple):
    chunk_id: int
    start: int
    end: int
    members: tuple[int, ...]  # indices into the request's ranges


_span = functools.partial(tuple.__new__, Span)  # a Span from a tuple, no Python constructor
_LENGTH = operator.itemgetter(2)  # a range's length
_sliced = cast("Callable[[memoryview, slice], memoryview]", operator.getitem)  # view[s], in C


def check_ranges(raw: Any, max_ranges: int, max_bytes: int) -> tuple[list[tuple[int, int, int]], int]:
    """A READV's ``[[chunk_id, offset, length], ...]`` as int triples and their total
    length, refused with :class:`InvalidArgument` when it names more than ``max_ranges``
    ranges, ranges that overlap, or more than ``max_bytes`` in total (so one small request
    can never ask for a reply many times its size)."""
    if not isinstance(raw, (list, tuple)):
        raise InvalidArgument(f"READV ranges must be a list, got {type(raw).__name__}")
    if len(raw) > max_ranges:
        raise InvalidArgument(f"READV names {len(raw)} ranges; the limit is {max_ranges} (max_ranges)")
    ranges: list[tuple[int, int, int]]
    if set(map(type, raw)) <= {Range}:  # decoded by msgspec: three ints, none negative
        ranges = list(raw)
        total = sum(map(_LENGTH, ranges))
    else:
        ranges, total = [], 0
        for r in raw:
            c, off, ln = r
            if not (type(c) is int and type(off) is int and type(ln) is int):
                raise InvalidArgument(f"READV range must be three integers, got {r!r:.80}")
            if c < 0 or off < 0 or ln < 0:
                raise InvalidArgument(f"READV range has a negative field: {r!r:.80}")
            total += ln
            ranges.append((c, off, ln))
    if total > max_bytes:
        raise InvalidArgument(f"READV asks for {total} bytes; the limit is {max_bytes} "
                              "(max_read_rpc_bytes): split it")
    prev_c, prev_end = -1, 0
    for c, off, ln in sorted(ranges):
        if not ln:
            continue
        if off < prev_end and c == prev_c:
            raise InvalidArgument(f"READV ranges overlap in chunk {c:016x} at offset {off}")
        prev_c, prev_end = c, off + ln
    return ranges, total


def plan_spans(ranges: Sequence[tuple[int, int, int]], merge_gap: int) -> list[Span]:
    """Sort ranges, widen to 4 KiB alignment, merge neighbours closer than ``merge_gap``.

    Every range lies inside exactly one span; spans of one chunk never overlap,
    so each byte is read at most once.
    """
    order = sorted(range(len(ranges)), key=ranges.__getitem__)  # by (chunk, offset, length)
    spans: list[Span] = []
    members: list[int] = []
    cur_c, cur_s, cur_e = -1, 0, 0
    mask = ALIGN - 1
    for i in order:
        c, off, ln = ranges[i]
        s, e = off & ~mask, (off + ln + mask) & ~mask  # align_down, align_up
        if c == cur_c and s <= cur_e + merge_gap:
            if e > cur_e:
                cur_e = e
            members.append(i)
            continue
        if members:
            spans.append(_span((cur_c, cur_s, cur_e, tuple(members))))
        cur_c, cur_s, cur_e, members = c, s, e, [i]
    if members:
        spans.append(_span((cur_c, cur_s, cur_e, tuple(members))))
    return spans


def _pwritev_all(fd: int, bufs: list[bytes | memoryview], offset: int) -> None:
    """Write ``bufs`` at ``offset`` (short writes continued); empties ``bufs`` before it
    returns or raises: in an IO thread the executor's job keeps its arguments until after
    the caller has been woken, and a view still alive then keeps an APPEND's receive buffer
    out of the server's :class:`~kvfs.protocol.ReceivePool` (a fresh, zeroed buffer for the
    next large APPEND: about one in four were, at 8 MiB x 8 with two calls in flight)."""
    try:
        _pwritev_rest(fd, bufs, offset)
    finally:
        bufs.clear()


def _unlink_chunks(paths: Sequence[Path]) -> list[int | None]:
    """Each file's size, then the file unlinked (None where it was not there)."""
    out: list[int | None] = []
    for path in paths:
        try:
            size = path.stat().st_size
            os.unlink(path)
        except FileNotFoundError:
            out.append(None)
            continue
        out.append(size)
    return out


def _close_fds(fds: Sequence[int]) -> None:
    """Close each fd; one that fails is logged, the rest still closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError as e:
            log.warning("closing a chunk file (fd %d) failed: %s", fd, e)


def _reserve_chunk(path: Path, nbytes: int, dir_path: Path | None) -> bool:
    """The next chunk reserved ahead, in an IO thread (:meth:`ChunkStore._reserve_ahead`): its
    file made empty, ``nbytes`` of blocks reserved for it (:func:`preallocate`), then with
    ``dir_path`` its directory entry made durable.  False, the file removed again, where the
    blocks could not be had (the disk full, no fallocate here); what else fails removes it too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    made = False
    try:
        if preallocate(fd, nbytes):
            if dir_path is not None:
                fsync_dir(dir_path)
            made = True
    finally:
        os.close(fd)
        if not made:
            path.unlink(missing_ok=True)
    return made


def _made(job: asyncio.Future[bool]) -> bool:
    """Whether a :func:`_reserve_chunk` job has ended with its chunk made."""
    return job.done() and not job.cancelled() and job.exception() is None and job.result()


def _write_at(fd: int, bufs: list[bytes | memoryview], offset: int, reserve: int,
              writeback: int = 0) -> None:
    """An append's job in an IO thread: ``reserve`` bytes of blocks reserved for the file
    first (a new chunk's, :func:`preallocate`: KEEP_SIZE leaves the file's size, so recovery
    and range checks see only what was written; 0: none), then :func:`_pwritev_all`; with
    ``writeback`` (its bytes), their writeback started at once (:func:`start_writeback`)."""
    if reserve:
        preallocate(fd, reserve)
    _pwritev_all(fd, bufs, offset)
    if writeback:
        start_writeback(fd, offset, writeback)


def _pwritev_rest(fd: int, bufs: list[bytes | memoryview], offset: int) -> None:
    """``bufs`` written at ``offset``, at most :data:`WRITE_PIECE` bytes (and ``IOV_MAX``
    buffers) per ``pwritev``: a buffer longer than a piece is cut into views of one first;
    each call's buffers are found by bisecting their running ends (Python per piece, not
    per buffer: an APPEND of small records has two buffers each)."""
    if bufs and max(map(len, bufs)) > WRITE_PIECE:  # (large values: few buffers)
        bufs = [v[k : k + WRITE_PIECE] for b in bufs for v in (memoryview(b),)
                for k in range(0, len(v), WRITE_PIECE)]
    ends = list(accumulate(map(len, bufs)))
    i = done = 0
    while i < len(bufs):
        j = min(bisect_right(ends, done + WRITE_PIECE, i), i + IOV_MAX)
        offset = _pwritev_full(fd, bufs[i:j], offset, ends[j - 1] - done)
        done, i = ends[j - 1], j


def _pwritev_full(fd: int, batch: list[bytes | memoryview], offset: int, want: int) -> int:
    """One ``pwritev`` of ``batch`` (``want`` bytes) at ``offset``, short writes continued;
    the offset after it."""
    while True:
        n = os.pwritev(fd, batch, offset)
        offset += n
        if n == want:
            return offset
        want -= n
        # short write: drop what was written and go on
        rest: list[bytes | memoryview] = []
        for b in batch:
            if n >= len(b):
                n -= len(b)
                continue
            rest.append(memoryview(b)[n:])
            n = 0
        batch = rest


INLINE_READ_BYTES = 8 * 1024 * 1024
# readv_mapped asks the page cache about a chunk's bytes from the first range asked of it to
# the end of the last (one cachestat: ~1 us up to 1 MiB, ~17 us for 32 MiB here, whatever is
# cached) only where that stretch averages at most this much per range (~0.5 us a range at
# most, where a preadv of a 4 KiB range costs ~1.1): sparser reads are read with preadv
MAPPED_CHECK_BYTES = 1024 * 1024
MAPPED_MAX_CHUNKS = 8  # readv_mapped: more chunks in one READV are read with preadv
# readv_mapped remembers, per chunk, the stretch the page cache was last found to hold in full
# (a stretch touching the one believed is joined to it, another replaces it) and asks again only for bytes past
# it or once this long has passed since it was first asked: a READV's cachestat cost ~16 us of
# a ~150 us READV of 43 random 4 KiB ranges (bench/RESULTS.md, issue 11).  A page evicted
# meanwhile is read by the answer's send, in the event loop (at most the READV's own ranges,
# INLINE_READ_BYTES): the window in which that can happen is this long, not a few us.
RESIDENT_KEEP_S = 0.05
# chunk ids reserved by one write of state.json: a new chunk rewrites it (temp file, fsync,
# rename, directory fsync) once per this many chunks, not once each (in the event loop, once
# per 64 MiB appended, it took 20 ms median behind the group syncs: bench/RESULTS.md,
# "Durable puts (issue 11): where a 1 MiB x 32 put's time goes").  A restart skips the ids
# reserved and never handed out (at most this many of 2^40).
SEQ_BLOCK = 1024
# An APPEND's space check asks the filesystem (statvfs) again only where its last answer is
# older than this, or what was written since (each roll's preallocation counted in full) could
# bring the disk within FREE_MARGIN_CHUNKS chunks of full.  It asked twice per APPEND (1.75 us
# of CPU a check here, 0.33 without the syscall; an event loop in statvfs in up to ~20 % of a
# put-serving chunkserver's wall-clock samples: bench/RESULTS.md).  Near full every check
# asks, as before; a write the disk cannot take past the check (another process's writes,
# within FREE_CHECK_S) is still ENOSPC, answered NoSpace.
FREE_CHECK_S = 0.1
FREE_MARGIN_CHUNKS = 2
# The GC reserve's default (--gc-reserve): this many chunks, at most this share of the
# capacity (under a high watermark of 0.9, so GC evicts before values reach the reserve).
# Values are refused that much short of full; compaction's copies and tombstones may fill it.
# Without it a full server whose chunks were all partly live (eviction takes the least
# recently used keys, from every chunk) could compact none of them, so freed nothing.
GC_RESERVE_CHUNKS = 2
GC_RESERVE_SHARE = 1 / 20
# Once the open chunk is this full, an IO-thread job makes the next chunk's file and reserves
# its blocks (and under --fsync batch/always syncs its directory entry): the roll that takes it
# then waits for no fallocate under the append lock.  A roll's fallocate waited 0.6-0.7 s there
# behind writeback (ext4 reading block bitmaps), and every append of the server with it
# (bench/RESULTS.md, "Issue 11, large puts: where a 1 MiB x 32 / 8 MiB x 8 put waits").
AHEAD_AT = 0.5
# A chunk with at least this many bytes of blocks reserved past its size was open (taking
# appends, preallocated) when its store stopped: a restart recovers its tail (_scan_dir).
OPEN_SIGN_BYTES = 1 << 20
# An append of at most ``inline_write_bytes`` (not a fresh chunk's first when preallocating,
# none that starts its writeback, not under --fsync always) is written by the event loop's
# own pwritev, not handed to an IO thread: the hop there and back cost more CPU than a small
# write into the page cache (one chunkserver, --fsync never, CPU per APPEND of 1 record
# ~115 -> ~50 us, of 128 x 4 KiB ~705 -> ~635: bench/RESULTS.md, "small appends written by
# the event loop").  ext4 refuses RWF_NOWAIT for buffered writes, so such a write can still
# wait (dirty-page throttling, the journal): one that held the loop longer than
# INLINE_STALL_S sends the appends to the IO threads again for INLINE_BACKOFF_S.
INLINE_STALL_S = 0.005
INLINE_BACKOFF_S = 1.0
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
# what preadv(RWF_NOWAIT) raises where a filesystem refuses the flag (tmpfs: EOPNOTSUPP)
_NOWAIT_REFUSED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


@contextlib.contextmanager
def _full_is_nospace(what: str) -> Iterator[None]:
    """ENOSPC/EDQUOT from a write becomes :class:`NoSpace`, never a server error."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"{what}: the disk is full ({exc.strerror})") from exc
        raise


def _preadv_all(fd: int, iov: list[memoryview], offset: int, flags: int) -> int:
    """Fill ``iov`` from ``offset`` on (``IOV_MAX`` buffers a call, short reads continued);
    returns the bytes read, fewer only where the file ends."""
    preadv = os.preadv
    got = i = 0
    while i < len(iov):
        batch = iov[i : i + IOV_MAX]
        want = sum([v.nbytes for v in batch])
        n = preadv(fd, batch, offset, flags) if want else 0
        got += n
        offset += n
        if n == want:
            i += len(batch)
            continue
        if n == 0:
            return got
        rest: list[memoryview] = []  # a short read (rare): go on from where it stopped
        for v in batch:
            if n >= v.nbytes:
                n -= v.nbytes
                continue
            rest.append(v[n:])
            n = 0
        iov = rest + iov[i + len(batch) :]
        i = 0
    return got


# one read of a span: (chunk id, first byte, the buffers its bytes go to in order, bytes,
# the indices of the ranges it reads)
SpanRead = tuple[int, int, list[memoryview], int, Sequence[int]]


def _read_scatter(fds: dict[int, int], reads: Sequence[SpanRead], nowait: bool = False) -> list[bool]:
    """Read each span once, with one ``preadv`` straight into its buffers (the caller's
    reply, a scratch buffer for the gaps).  With ``nowait`` (RWF_NOWAIT) a span that is not
    wholly in the page cache is answered False instead of blocking, for the thread pool to
    read; without it, a chunk that ends early is an OSError."""
    flags = _NOWAIT if nowait else 0
    out: list[bool] = []
    preadv = os.preadv
    for chunk, start, iov, need, _ in reads:
        try:  # one preadv the common case; a short read (rare) read again, in full
            got = preadv(fds[chunk], iov, start, flags) if need and len(iov) <= IOV_MAX else -2
            if got != need:
                got = _preadv_all(fds[chunk], iov, start, flags)
        except BlockingIOError:
            got = -1
        if got < need:
            if nowait:
                out.append(False)
                continue
            raise OSError(f"chunk {chunk:016x} ended at {start + got}, expected {start + need}")
        out.append(True)
    return out


_FALLOC_FL_KEEP_SIZE = 1


@functools.cache
def _fallocate() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn


def preallocate(fd: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` of blocks for ``fd`` without changing its size; False where unsupported."""
    fn = _fallocate()
    return fn is not None and int(fn(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes)) == 0


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback",
                                               "nr_evicted", "nr_recently_evicted")]


class _PageCache:
    """How many pages of a file range the page cache holds, through libc (the stdlib has no
    binding): ``cachestat(2)`` (Linux 6.5+, one call, about 1.5 us for 64 KiB here), else
    ``mincore(2)`` on a short-lived mapping of the range, never touched (nothing is read
    or faulted in; 25 us for 64 KiB, 200 us for 8 MiB here: mmap, mincore, munmap)."""

    PROT_READ, MAP_SHARED = 1, 1
    PAGE = os.sysconf("SC_PAGE_SIZE")
    SYS_CACHESTAT = 451  # the same number on every architecture (the generic table)

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.syscall = libc.syscall
        self.syscall.restype = ctypes.c_long
        self.cachestat = True  # until the kernel (or a seccomp filter) refuses it
        self.mmap, self.mincore, self.munmap = libc.mmap, libc.mincore, libc.munmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int64]
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.failed = ctypes.c_void_p(-1).value

    def resident(self, fd: int, offset: int, length: int, addr: int | None = None) -> bool:
        """``addr``: where the file is mapped already (:meth:`mapped` asks that mapping
        where ``cachestat`` cannot be had, not a mapping of its own)."""
        if length <= 0:
            return True
        if self.cachestat:
            rng, st = _CachestatRange(offset, length), _Cachestat()
            if self.syscall(self.SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) == 0:
                page = self.PAGE
                return bool(st.nr_cache >= (offset + length - 1) // page - offset // page + 1)
            log.info("cachestat(2) refused (%s); asking mincore(2) which pages are cached",
                     os.strerror(ctypes.get_errno()))
            self.cachestat = False
        if addr is not None:
            return self.mapped(addr, offset, length)
        page = self.PAGE
        start = offset - offset % page
        size = -(-(offset + length) // page) * page - start
        addr = self.mmap(None, size, self.PROT_READ, self.MAP_SHARED, fd, start)
        if addr is None or addr == self.failed:
            return False
        try:
            return self.mapped(addr, 0, size)
        finally:
            self.munmap(addr, size)

    def mapped(self, addr: int, offset: int, length: int) -> bool:
        """Whether the page cache holds every page of ``length`` bytes at ``offset`` of a file
        mapped at ``addr`` (page-aligned): ``mincore(2)``, which answers a page mapped here
        without looking it up (about 5 us for 32 MiB of pages already touched through this
        mapping) and looks up the others (140 us for 32 MiB never touched through it, where
        ``cachestat`` takes 17 us for any: why ``cachestat`` is asked first)."""
        if length <= 0:
            return True
        page = self.PAGE
        start = offset - offset % page
        size = offset + length - start
        pages = -(-size // page)
        vec = ctypes.create_string_buffer(pages)
        if self.mincore(addr + start, size, vec) != 0:
            return False
        # bit 0 of each byte (the others are reserved, 0 so far): a byte that is not exactly 1
        # counts as a page not held, so a kernel that sets other bits only costs a preadv
        return vec.raw == b"\x01" * pages


@functools.cache
def _page_cache() -> _PageCache | None:
    try:
        return _PageCache()
    except (OSError, AttributeError):
        return None


def resident(fd: int, offset: int, length: int, addr: int | None = None) -> bool:
    """Whether the page cache holds every page of ``length`` bytes at ``offset`` of ``fd``
    (False where it cannot be asked; ``addr``: where ``fd`` is mapped, if it is): a
    ``sendfile`` of them, or a send from that mapping, will not wait for the disk.
    A page can still be evicted between the question and the send (the send then waits
    for it, in the event loop: rare, bounded by one read)."""
    pc = _page_cache()
    return pc is not None and pc.resident(fd, offset, length, addr)


class ChunkStore:
    """The chunk files of one chunkserver data dir."""

    def __init__(self, root: Path, *, chunk_bytes: int, io_threads: int = 4,
                 fsync: FsyncMode = FsyncMode.BATCH, fsync_window_s: float = 0.0,
                 writeback_start_bytes: int = 1 << 20,
                 capacity_bytes: int | None = None, gc_reserve_bytes: int | None = None,
                 merge_gap_bytes: int = 64 * 1024,
                 max_open_files: int = 4096, max_mapped_files: int = 0, preallocate: bool = True,
                 close_timeout_s: float = 30.0, free_check_s: float = FREE_CHECK_S,
                 inline_write_bytes: int = 0) -> None:
        self.root = root
        self.dir = private_dir(root / "chunks")
        self.max_open_files = max(max_open_files, 2)
        self.chunk_bytes = chunk_bytes
        self.fsync = FsyncMode(fsync)
        self.preallocate = preallocate
        self.capacity_bytes = capacity_bytes
        self.gc_reserve_bytes = gc_reserve_bytes  # None: GC_RESERVE_CHUNKS, GC_RESERVE_SHARE
        self.merge_gap = merge_gap_bytes
        self.pool = IoPool(io_threads)
        self.close_timeout_s = close_timeout_s
        self.syncer = GroupSync(self.pool, self.dir, fsync_window_s)
        # batch: appends of at least this many bytes start their writeback when written (0: none)
        self.writeback_start = writeback_start_bytes if self.fsync is FsyncMode.BATCH else 0
        self.sizes: dict[int, int] = {}  # set through _set_size only
        self.used_bytes = 0  # the sum of sizes
        self.grown_bytes = 0  # bytes chunks grew by (and their blocks reserved, at a roll or ahead), ever: _check_space
        self.free_check_s = free_check_s
        self.inline_write_bytes = 0 if self.fsync is FsyncMode.ALWAYS else inline_write_bytes
        if self.writeback_start:  # none that starts its writeback
            self.inline_write_bytes = min(self.inline_write_bytes, self.writeback_start - 1)
        self.inline_stall_s = INLINE_STALL_S
        self._inline_after = 0.0  # monotonic: inline writes only from then on (a stall's back-off)
        self.inline_writes = 0  # appends written by the event loop
        self.inline_stalls = 0  # inline writes that held the loop past inline_stall_s
        self._disk: tuple[float, int, int, int] = (-1e18, 0, 0, 0)  # statvfs: (when, total, free, grown_bytes then)
        self._reserve = 0  # gc_reserve() of the capacity at that statvfs
        self._fds: OrderedDict[int, int] = OrderedDict()  # an LRU of open chunk files
        self.maps = ChunkMaps(max_mapped_files, self._unmap)  # small cached reads answered from these
        # chunk id -> (start, end, until): bytes the page cache held in full (readv_mapped's
        # _resident), believed until then; at most one per mapping (cleared past that)
        self._in_cache: dict[int, tuple[int, int, float]] = {}
        self.resident_keep_s = RESIDENT_KEEP_S
        self._open: int | None = None
        # the next chunk reserved ahead (AHEAD_AT): (its id, the IO job making it: True once
        # its file and blocks are there); and one a roll did not wait for, its file removed
        # when its job ends.  At most one of the two at a time: one chunk reserved per store.
        self._ahead: tuple[int, asyncio.Future[bool]] | None = None
        self._dropping: tuple[int, asyncio.Future[bool]] | None = None
        self._ahead_at = int(chunk_bytes * AHEAD_AT) if preallocate else 1 << 62
        self._ahead_off: int | None = None  # the open chunk whose reservation could take no id
        self.ahead_taken = 0  # rolls that took a chunk reserved ahead
        self.ahead_missed = 0  # rolls that found none ready (its job running, failed, or none)
        self._lock = asyncio.Lock()
        self._writes: set[asyncio.Task[None]] = set()  # appends' writes, kept to the end if their callers go
        self._closed = False
        self._abandoned = False  # close() gave up on disk IO still running: files left open
        self.server_id: int | None = None
        self.key = ""  # proves to meta that a re-registration comes from this data dir
        self.cluster_id: str | None = None  # the meta's, stored at the first registration
        self.next_seq = 1  # the next chunk's sequence number
        self.seq_reserved = 1  # state.json's next_seq: no id at or past it was handed out
        self.spans_read = 0
        self.inline_spans = 0
        self.lent_fds = 0  # fds of answers being sent (readv_files), at most max_open_files
        self.file_spans = 0  # spans answered as file bytes (readv_files: sendfile; TLS: read)
        self.mapped_spans = 0  # spans answered as views of chunk mappings (readv_mapped)
        self.bytes_read = 0
        self._reads_in_flight = 0
        self._last_append = time.monotonic()
        self.wanted_bytes = 0  # the last append refused for space: GC evicts to make it fit
        self._close_later: list[tuple[int, int]] = []  # (chunk id, fd): _close_idle
        self._scratch = bytearray(self.merge_gap + 2 * ALIGN)  # the bytes between a span's ranges
        self.nowait = bool(_NOWAIT)  # read page-cache hits inline; off where the filesystem refuses it
        self.damage: dict[int, list[Damage]] = {}  # found by recovery: runs without a valid record
        self.bad_records = 0  # records recovery found with a bad value CRC (kept, reported)
        self._load_state()
        self._scan_dir()

    # state ---------------------------------------------------------------
    def _load_state(self) -> None:
        try:
            st = json.loads((self.root / "state.json").read_text())
        except FileNotFoundError:
            return
        self.server_id = st.get("server_id")
        self.cluster_id = st.get("cluster_id")
        self.next_seq = self.seq_reserved = int(st.get("next_seq", 1))
        self.key = str(st.get("key", ""))

    def save_state(self, reserve: int = 0) -> None:
        """state.json replaced durably; ``reserve``: chunk ids past ``next_seq`` it reserves
        (handed out later without writing it again)."""
        if not self.key:
            self.key = secrets.token_hex(16)
        reserved = max(self.seq_reserved, self.next_seq + reserve)
        state = json.dumps({"server_id": self.server_id, "next_seq": reserved,
                            "key": self.key, "cluster_id": self.cluster_id}).encode()
        with _full_is_nospace("writing state.json"):
            replace_durably(self.root / "state.json", state)
        self.seq_reserved = reserved

    def chunk_path(self, chunk_id: int) -> Path:
        return self.dir / f"{chunk_id:016x}.chunk"

    def _scan_dir(self) -> None:
        """The chunks on disk.  An empty one holds no record (a chunk reserved ahead and
        never taken, or one whose first write never landed): it is removed, giving its
        reserved blocks back, never counted, its id still past ``next_seq``.  The others
        that appends may have been going to when the store stopped have their tails
        recovered: each with blocks reserved past its end (``OPEN_SIGN_BYTES``: an open
        chunk's, where chunks are preallocated; a compaction's chunk, whose id can be newer
        than the open one's, has none), and the newest by id (without preallocation)."""
        newest = None
        opened: list[int] = []
        for p in self.dir.glob("*.chunk"):
            try:
                cid = int(p.stem, 16)
            except ValueError:
                continue
            self.next_seq = max(self.next_seq, (cid & ((1 << 40) - 1)) + 1)
            st = p.stat()
            if not st.st_size:
                log.info("chunk %016x: empty (reserved, never written); removed", cid)
                p.unlink(missing_ok=True)
                continue
            self._set_size(cid, st.st_size)
            newest = cid if newest is None or cid > newest else newest
            if st.st_blocks * 512 - align_up(st.st_size) >= OPEN_SIGN_BYTES:
                opened.append(cid)
        for cid in sorted({*opened, *(() if newest is None else (newest,))}):
            self._recover_tail(cid, give_back=cid in opened)

    def _recover_tail(self, chunk_id: int, give_back: bool = False) -> None:
        """Cut a torn last record of a chunk appends may have been going to; report damage
        before it, cut nothing else.  ``give_back``: its blocks reserved past its records
        too (no append goes to it again: a restarted store rolls to a new chunk)."""
        path = self.chunk_path(chunk_id)
        data = path.read_bytes()
        keep, damage, bad = recovery_point(data)
        for d in damage:
            log.warning("chunk %016x: bytes %d..%d hold no valid record; skipped, the records after "
                        "them are kept", chunk_id, d.start, d.end)
        for rec in bad:
            log.warning("chunk %016x: record of key %r at %d fails its CRC-32C; kept (reads of it "
                        "fail their check)", chunk_id, rec.key[:64], rec.record_offset)
        self.damage[chunk_id] = damage
        self.bad_records += len(bad)
        if keep < len(data):
            log.warning("chunk %016x: truncating torn tail at %d (file had %d bytes)", chunk_id, keep, len(data))
        if keep < len(data) or give_back:
            os.truncate(path, keep)
            self._set_size(chunk_id, keep)

    async def close(self) -> bool:
        """Stop once every append that holds or waits for the lock has written and counted
        its size (its caller may be gone), the group sync queued has run, and the IO
        threads' jobs (reads, syncs, compactions) have ended: only then is the open chunk cut
        back to its records and the files closed, never under a write (whose fd number
        another file could have taken by then).  Appends arriving later are refused.

        All of it within ``close_timeout_s``: past it (a write or sync hanging on the
        disk) what is still running is logged and abandoned, every file is left open (a
        job still running may use any of them) and False is returned; the caller keeps the
        data directory locked, so no server reopens it under the running write."""
        if self._closed:
            return not self._abandoned
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.close_timeout_s
        try:
            await asyncio.wait_for(self._lock.acquire(), self.close_timeout_s)
            locked = True
        except TimeoutError:
            locked = False  # an append's write holds it still
        try:
            self._closed = True  # appends still waiting for the lock are refused when they get it
            synced = await self.syncer.close(max(0.0, deadline - loop.time()))
            self.pool.shutdown(wait=False)  # jobs queued still run; none can be added
            running = await self.pool.wait_idle(max(0.0, deadline - loop.time()))
            if locked and synced and not running:
                self.pool.shutdown(wait=True)  # its threads, idle now, end
                self._close_files()
                return True
            self._abandoned = True
            writes = sum(not w.done() for w in self._writes)
            log.error("chunk store %s: close gave up after %gs (close_timeout_s) with disk IO "
                      "still running: %d append writes, %d IO-thread jobs, group sync %s; "
                      "abandoned: its %d chunk files are left open (never closed under a "
                      "running write) and appends still queued are refused", self.dir,
                      self.close_timeout_s, writes, running, "done" if synced else "running",
                      len(self._fds) + len(self._close_later))
            return False
        finally:
            if locked:
                self._lock.release()

    def close_now(self) -> None:
        """Close a store no append is writing to (a failed start); otherwise ``await close()``."""
        if any(not w.done() for w in self._writes):
            raise RuntimeError("ChunkStore.close_now() under a running append: await close() instead")
        self._closed = True
        self.pool.shutdown(wait=True)  # reads, syncs and compactions in the pool end on open fds
        self._close_files()

    def _close_files(self) -> None:
        """The open chunk cut back to its records, every fd closed (no job uses them now)."""
        if self._open is not None:  # a stopped server keeps no reservation (64 MiB per data dir)
            try:
                self._release(self._open)
            except OSError as e:
                log.warning("chunk %016x: could not give back its reserved blocks: %s", self._open, e)
        for ahead in (self._ahead, self._dropping):  # their jobs have ended (no job runs now)
            if ahead is not None:
                try:
                    self.chunk_path(ahead[0]).unlink(missing_ok=True)
                except OSError as e:
                    log.warning("chunk %016x (reserved ahead): could not remove it: %s", ahead[0], e)
        self._ahead = self._dropping = None
        _close_fds([*self._fds.values(), *(fd for _, fd in self._close_later)])
        self._fds.clear()
        self.maps.clear()
        self._close_later.clear()

    def _fd(self, chunk_id: int) -> int:
        """The chunk's open file, from an LRU of ``max_open_files``; a file pushed out
        while a read or an append runs is closed once none does (it may be theirs)."""
        fds = self._fds
        fd = fds.get(chunk_id)
        if fd is not None:
            fds.move_to_end(chunk_id)
            return fd
        fd = os.open(self.chunk_path(chunk_id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        fds[chunk_id] = fd
        while len(fds) > self.max_open_files:  # least recently used first; appends keep theirs
            victim = next((c for c in fds if c != self._open and c != chunk_id), None)
            if victim is None:
                break
            self._close_later.append((victim, fds.pop(victim)))
        self._close_idle()
        return fd

    def _close_idle(self) -> None:
        """Close the files pushed out of the LRU or deleted once no read or append runs:
        here, or in an IO thread (:meth:`_free_later`) where the chunk is deleted (out of
        ``sizes``): a deleted chunk's fd held by a read past the unlink is the file's last
        reference, and its close frees the blocks."""
        if self._close_later and not self._reads_in_flight and not self._lock.locked():
            later, self._close_later = self._close_later, []
            self._close_chunk_fds(later)

    def _close_chunk_fds(self, fds: Sequence[tuple[int, int]]) -> None:
        """Close ``(chunk id, fd)`` pairs: here, or in an IO thread (:meth:`_free_later`)
        where the chunk is deleted (out of ``sizes``), as its close may be the file's last."""
        sizes = self.sizes
        _close_fds([fd for cid, fd in fds if cid in sizes])
        deleted = [fd for cid, fd in fds if cid not in sizes]
        if deleted:
            self._free_later(_close_fds, deleted)

    def _unmap(self, cid: int, close: Callable[[], None]) -> None:
        """A chunk mapping's last view is gone: unmapped here, or in an IO thread where the
        chunk is deleted (out of ``sizes``: :meth:`delete_chunks`), whose last unmap frees
        its blocks (:meth:`_free_later`)."""
        if cid in self.sizes:
            close()
        else:
            self._free_later(close)

    def _free_later(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)``, closing a file or a mapping that may be a deleted chunk's last,
        in an IO thread, not waited for: the last close frees the chunk's blocks, which
        waits for the disk as the unlink does (:meth:`delete_chunks`), and in the event
        loop would stall the server.  Right here where the pool takes no more jobs (the
        store closing) or no event loop runs; a close waits for the pool's jobs."""
        try:
            fut = self.pool.run(fn, *args)
        except RuntimeError:
            fn(*args)
            return
        fut.add_done_callback(self._freed)

    def _freed(self, fut: asyncio.Future[object]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            log.warning("chunk store %s: freeing a deleted chunk's file or mapping failed: %s",
                        self.dir, exc)

    # capacity --------------------------------------------------------------
    @property
    def disk_id(self) -> str | None:
        """The filesystem the chunk files live on (``host:st_dev``), so meta can count a disk
        several chunkservers share once; None with a configured capacity (that one is this
        server's own, not shared)."""
        if self.capacity_bytes:
            return None
        return f"{socket.gethostname()}:{os.stat(self.dir).st_dev}"

    def _set_size(self, cid: int, size: int) -> None:
        """A chunk's size, and ``used_bytes`` (their sum, kept up to date: ``usage()`` runs
        twice per append, and summing the sizes there cost ~67 us per 10,000 chunks, each
        time: ~1 us per key of a 4 KiB x 128 APPEND on a server holding 640 GiB)."""
        grown = size - self.sizes.get(cid, 0)
        self.used_bytes += grown
        if grown > 0:
            self.grown_bytes += grown
        self.sizes[cid] = size

    def usage(self) -> tuple[int, int, int]:
        """(capacity, free, used) in bytes, the disk asked now (``statvfs``); ``free`` is
        what values may still take, the GC reserve left out (:meth:`gc_reserve`)."""
        used = self.used_bytes
        disk = shutil.disk_usage(self.dir)
        self._disk = (time.monotonic(), disk.total, disk.free, self.grown_bytes)
        capacity = self.capacity_bytes or disk.total
        self._reserve = self.gc_reserve(capacity)
        free = max(0, min(capacity - used, disk.free) - self._reserve)
        return capacity, free, used

    def gc_reserve(self, capacity: int) -> int:
        """The room, of ``capacity``, that only compaction's copies and tombstones may fill."""
        if self.gc_reserve_bytes is not None:
            return self.gc_reserve_bytes
        return min(GC_RESERVE_CHUNKS * self.chunk_bytes, int(capacity * GC_RESERVE_SHARE))

    @property
    def open_chunk(self) -> int | None:
        """The chunk appends go to; every other chunk is sealed."""
        return self._open

    def _room(self) -> tuple[int, float]:
        """``(bytes values can still take, when the disk was asked)``: the disk's free
        bytes at its last ``statvfs`` (:meth:`usage`) less what this store wrote or reserved
        since (:attr:`grown_bytes`), within the capacity, less the GC reserve; no syscall."""
        at, total, disk_free, grown = self._disk
        return min((self.capacity_bytes or total) - self.used_bytes,
                   disk_free - (self.grown_bytes - grown)) - self._reserve, at

    def _check_space(self, nbytes: int, *, records: Sequence[Sequence[Any]] = (),
                     gc: bool = False) -> None:
        """:class:`NoSpace` unless ``nbytes`` fit: values' outside the GC reserve; ``gc``
        (compaction's copies) or ``records`` all tombstones (a delete's, an eviction's) may
        fill it.  The disk is asked again (:meth:`usage`) where its last answer
        (:meth:`_room`) is older than ``free_check_s`` or leaves less than
        ``FREE_MARGIN_CHUNKS`` chunks beside ``nbytes``: far from full, no syscall."""
        room, at = self._room()
        if (room - nbytes >= FREE_MARGIN_CHUNKS * self.chunk_bytes
                and time.monotonic() - at <= self.free_check_s):
            return
        capacity, free, used = self.usage()
        if nbytes <= free:
            return
        if (gc or (records and only_tombstones(records))) and nbytes <= min(capacity - used, self._disk[2]):
            return  # (the disk's free bytes, just asked)
        self.wanted_bytes = nbytes
        self._drop_ahead()  # its blocks are the disk's again
        raise NoSpace(f"chunkserver {self.server_id} is full: {nbytes} bytes do not fit "
                      f"({used} of {capacity} used, {free} free beside the {self._reserve} kept for GC), "
                      f"and GC has not freed room for them "
                      f"(`kvfs gc status` shows each server's live and garbage bytes)")

    # append ----------------------------------------------------------------
    def _new_chunk_id(self) -> int:
        assert self.server_id is not None, "chunkserver is not registered yet"
        if self.next_seq >= self.seq_reserved:  # on disk before the id is used
            self.save_state(reserve=SEQ_BLOCK)
        cid = make_chunk_id(self.server_id, self.next_seq)
        self.next_seq += 1
        return cid

    def _roll(self) -> tuple[int, bool]:
        """A new open chunk: ``(its id, fresh)``.  The chunk reserved ahead where its job has
        ended well (its blocks reserved, its directory entry durable under --fsync
        batch/always); else, ``fresh``, one made here, whose blocks its first write's job
        reserves and whose entry its first sync makes durable (a reservation still running
        is not waited for: its file is removed when it ends)."""
        if self._open is not None:
            self._release_later(self._open)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and _made(ahead[1]):
            cid = ahead[0]  # its blocks were counted in grown_bytes when asked for
            self.ahead_taken += 1
            fresh = False
        else:
            if ahead is not None:
                self._drop(ahead)
            self.ahead_missed += 1
            cid = self._new_chunk_id()
            fresh = True
            if self.preallocate:  # the disk's free space shrinks by all of it (_check_space)
                self.grown_bytes += self.chunk_bytes
        self._fd(cid)  # created here where fresh; its blocks are reserved by its first write's job
        self._set_size(cid, 0)
        self._open = cid
        return cid, fresh

    def _reserve_ahead(self) -> None:
        """Start the job that reserves the next chunk (:func:`_reserve_chunk`), unless one is
        reserved or being made or dropped, or the disk could not spare it with
        ``FREE_MARGIN_CHUNKS`` chunks still free (then there is none: appends do not miss
        it), by the space estimate the append that asks has just checked (:meth:`_room`: no
        ``statvfs`` of its own, per append where the disk is nearly full).  Its id is taken
        now, by the rule every chunk's is (on disk before use); its blocks count as used
        (``grown_bytes``) from now until it is taken or removed."""
        if (self._ahead is not None or self._dropping is not None or self._closed
                or self._ahead_off == self._open):
            return
        if self._room()[0] < (FREE_MARGIN_CHUNKS + 1) * self.chunk_bytes:
            return
        try:
            cid = self._new_chunk_id()
        except OSError as exc:  # state.json not written (NoSpace too): the append that asked
            # is written and counted, so it must not fail; none for this chunk (not a write
            # of state.json per append), the roll's own id tries (and reports) it again
            self._ahead_off = self._open
            log.warning("chunk store %s: no chunk reserved ahead: %s", self.dir, exc)
            return
        dir_path = None if self.fsync is FsyncMode.NEVER else self.dir
        try:
            fut = self.pool.run(_reserve_chunk, self.chunk_path(cid), self.chunk_bytes, dir_path)
        except RuntimeError:  # the IO threads are shut down (closing)
            return
        self.grown_bytes += self.chunk_bytes
        self._ahead = (cid, fut)
        fut.add_done_callback(functools.partial(self._reserved, cid))

    def _reserved(self, cid: int, fut: asyncio.Future[bool]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:  # (a full disk is no news: appends are told)
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            log.log(logging.INFO if full else logging.WARNING, "chunk %016x: reserving it ahead "
                    "failed (%s); the roll makes its own", cid, exc)

    def _drop_ahead(self) -> None:
        """The chunk reserved ahead given back, if any (the disk is full)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._drop(ahead)

    def _drop(self, ahead: tuple[int, asyncio.Future[bool]]) -> None:
        """A chunk reserved ahead that no roll takes: its file removed in an IO thread (the
        unlink frees its blocks, which can wait for the disk: :meth:`_free_later`) once its
        job has ended; until then it is ``_dropping`` and no other is reserved."""
        self._dropping = ahead
        fut = ahead[1]
        if fut.done():
            self._dropped(ahead, fut)
        else:
            fut.add_done_callback(functools.partial(self._dropped, ahead))

    def _dropped(self, ahead: tuple[int, asyncio.Future[bool]], fut: asyncio.Future[bool]) -> None:
        if self._dropping is not ahead:  # removed by a close meanwhile
            return
        self._dropping = None
        if _made(fut):  # (else no file was left)
            self._free_later(functools.partial(self.chunk_path(ahead[0]).unlink, missing_ok=True))

    def _release(self, cid: int) -> None:
        """A chunk stops taking appends: give back the blocks reserved past its end."""
        if self.preallocate:  # by path: the fd may have left the LRU of open files
            os.truncate(self.chunk_path(cid), self.sizes[cid])

    def _release_later(self, cid: int) -> None:
        """:meth:`_release` in an IO thread, not waited for: freeing blocks waits for the
        disk where the filesystem discards them as they are freed (ext4 ``-o discard``
        without a journal: a synchronous discard, up to 86 ms traced under writeback), and
        in the event loop that stalled every connection of the server at each new chunk
        (bench/RESULTS.md, "Issue 11: the chunkservers' CPU per GB").  The chunk takes no
        more appends and its size is final, so nothing waits for the truncate (to that very
        size: no read or compaction sees other bytes); a close waits for it with the pool's
        other jobs."""
        if self.preallocate:
            self.pool.run(os.truncate, self.chunk_path(cid), self.sizes[cid]).add_done_callback(
                functools.partial(self._released, cid))

    def _released(self, cid: int, fut: asyncio.Future[None]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if isinstance(exc, FileNotFoundError):  # deleted meanwhile (GC): nothing to give back
            return
        if exc is not None:
            log.warning("chunk %016x: could not give back its reserved blocks: %s", cid, exc)

    async def append(self, records: Sequence[Sequence[Any]], payload: memoryview) -> list[tuple[int, int]]:
        """Write all records with one vectored write; return each value's (chunk_id, offset)."""
        bufs, rel, total = append_buffers(records, payload)
        self._check_space(total, records=records)  # refuse early without waiting for the lock ...
        await self._lock.acquire()
        inline = False  # written here: the lock is released below, whatever happens
        try:
            if self._closed:
                raise Unavailable(f"chunkserver {self.server_id} is shutting down; append elsewhere")
            self._check_space(total, records=records)  # ... and for sure: writes ahead of us took space
            cid = self._open
            fresh = False  # a chunk made by this roll: blocks to reserve, an entry to sync
            if cid is None or (self.sizes[cid] and self.sizes[cid] + total > self.chunk_bytes):
                cid, fresh = self._roll()
            assert cid is not None
            base = self.sizes[cid]
            fd = self._fd(cid)
            inline = (total <= self.inline_write_bytes and not (fresh and self.preallocate)
                      and time.monotonic() >= self._inline_after)
            if inline:
                try:
                    self._write_inline(cid, fd, bufs, base, total)
                finally:
                    self._lock.release()
                    self._close_idle()
        except BaseException:
            if not inline:
                self._lock.release()
            raise
        if not inline:
            # The write and its bookkeeping run in a task of their own that holds the lock
            # until the chunk's size covers them: a caller cancelled mid-write (shutdown, a
            # dropped connection) leaves no pwritev running that the next append would land on.
            write = asyncio.get_running_loop().create_task(self._write(cid, fd, bufs, base, total, fresh))
            self._writes.add(write)
            write.add_done_callback(self._write_done)
            await asyncio.shield(write)
        if self.fsync is FsyncMode.BATCH:  # outside the lock: later appends join this sync
            with _full_is_nospace(f"chunkserver {self.server_id} syncing an append"):
                await self.syncer.sync(fd, new_file=fresh)
        return [(cid, base + r) for r in rel]

    @contextlib.contextmanager
    def _appending(self, fd: int, base: int, total: int) -> Iterator[None]:
        """Around an append's write: a full disk is :class:`NoSpace`, the chunk cut back to
        ``base`` (what the half-done write took given back) and ``total`` kept for MAKE_ROOM."""
        try:
            with _full_is_nospace(f"chunkserver {self.server_id} appending {total} bytes"):
                yield
        except NoSpace:
            self.wanted_bytes = total
            with contextlib.suppress(OSError):
                os.ftruncate(fd, base)
            raise

    def _appended(self, cid: int, size: int, now: float) -> None:
        self._set_size(cid, size)
        self._last_append = now
        self.wanted_bytes = 0
        if size >= self._ahead_at and self._ahead is None:
            self._reserve_ahead()

    def _write_inline(self, cid: int, fd: int, bufs: list[bytes | memoryview], base: int,
                      total: int) -> None:
        """A small append written here, in the event loop (INLINE_STALL_S), under the lock."""
        start = time.monotonic()
        with self._appending(fd, base, total):
            _pwritev_all(fd, bufs, base)
        now = time.monotonic()
        self.inline_writes += 1
        if now - start > self.inline_stall_s:  # the kernel held the loop: threads for a while
            self.inline_stalls += 1
            self._inline_after = now + INLINE_BACKOFF_S
        self._appended(cid, base + total, now)

    async def _write(self, cid: int, fd: int, bufs: list[bytes | memoryview], base: int, total: int,
                     fresh: bool) -> None:
        """An append's write at ``base`` (the lock held by its caller), then its size; releases
        the lock.  ``fresh``: the first into a chunk its roll made (:meth:`_roll`)."""
        try:
            # Appends into blocks reserved up front skip the filesystem's block
            # allocation: 16 MiB appends ran 2.5x faster here (bench/RESULTS.md).  A fresh
            # chunk's are reserved in the IO thread, before its first write (in the event
            # loop a reservation that waits for the disk stalls every connection); a chunk
            # reserved ahead has them already.
            reserve = self.chunk_bytes if fresh and self.preallocate else 0
            with self._appending(fd, base, total):
                start = 0 < self.writeback_start <= total
                await self.pool.run(_write_at, fd, bufs, base, reserve, total if start else 0)
            if self.fsync is FsyncMode.ALWAYS:
                with _full_is_nospace(f"chunkserver {self.server_id} syncing an append"):
                    await self.pool.run(os.fdatasync, fd)
                    if fresh:
                        await self.pool.run(fsync_dir, self.dir)
            self._appended(cid, base + total, time.monotonic())
        finally:
            self._lock.release()
            self._close_idle()

    def _write_done(self, task: asyncio.Task[None]) -> None:
        self._writes.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller cancelled meanwhile no longer waits for it

    async def seal(self, chunk_id: int, idle_s: float, *, apply: bool = True) -> bool:
        """Stop appending to ``chunk_id`` if it is open and saw no append for ``idle_s``.
        With ``apply=False`` only say whether it would (a GC dry run)."""
        async with self._lock:
            if self._open != chunk_id:
                return True
            if time.monotonic() - self._last_append < idle_s:
                return False
            if apply:
                self._release_later(chunk_id)
                self._open = None
            return True

    # read ------------------------------------------------------------------
    async def readv(self, ranges: Sequence[tuple[int, int, int]]) -> tuple[list[memoryview | None], dict[int, StaleLayout]]:
        """Read many ranges (:meth:`readv_into`): a view of each one's bytes (None where
        the range is an error)."""
        _, out, errors = await self.readv_into(ranges)
        return out, errors

    async def readv_into(self, ranges: Sequence[tuple[int, int, int]]
                         ) -> tuple[memoryview, list[memoryview | None], dict[int, StaleLayout]]:
        """Read many ranges into one buffer: ``(payload, views, errors)``, the payload being
        the bytes of every range not in ``errors``, in request order (a READV's answer), each
        range's view a slice of it.  Ranges are grouped into spans and each span is read
        once, with one ``preadv`` straight into the payload (the bytes between its ranges
        into a scratch buffer): from the page cache right here, no thread hop
        (:meth:`_read_cached`, or :func:`plan_spans` with no merge gap where some range is
        not here); what is not cached (or every range, where reads cannot be asked not to
        wait, or past ``INLINE_READ_BYTES``) planned again with ``merge_gap_bytes`` (a disk
        read saved) and read in the pool."""
        cached = self._read_cached(ranges) if self.nowait else None
        if cached is not None:
            if cached[2]:  # not all in the page cache
                views = cast("list[memoryview]", cached[1])  # every range here has its view
                self.spans_read += await self._read_in_pool(ranges, views, cached[2])
            return cached[0], cached[1], {}
        ok, ok_idx, errors = self._present(ranges)
        out: list[memoryview | None] = [None] * len(ranges)
        payload = memoryview(bytearray(sum([r[2] for r in ok])))
        if not ok:
            return payload, out, errors
        dests: list[memoryview] = []
        pos = 0
        for (_, _, ln), i in zip(ok, ok_idx, strict=True):
            out[i] = view = payload[pos : pos + ln]
            dests.append(view)
            pos += ln
        # From the page cache a gap costs a copy of its bytes and saves only a syscall: spans
        # merge only where their 4 KiB pages meet.
        back: list[int] = list(range(len(ok)))  # what the pool reads
        if self.nowait and pos <= INLINE_READ_BYTES:
            reads = self._span_reads(plan_spans(ok, 0), ok, dests)
            self._reads_in_flight += 1  # before taking fds: none of them is closed under us
            try:
                fds = {c: self._fd(c) for c in {r[0] for r in reads}}
                got = [False] * len(reads)
                try:
                    got = _read_scatter(fds, reads, nowait=True)
                except OSError as exc:
                    if exc.errno not in _NOWAIT_REFUSED:
                        raise
                    self._nowait_refused(exc)
            finally:
                self._reads_done()
            done = sum(got)
            self.inline_spans += done
            self.spans_read += done
            back = [j for r, g in zip(reads, got, strict=True) if not g for j in r[4]]
        self.bytes_read += pos
        if back:
            self.spans_read += await self._read_in_pool(ok, dests, back)
        return payload, out, errors

    def _nowait_refused(self, exc: OSError) -> None:
        log.info("%s refuses RWF_NOWAIT reads (%s); reading in the thread pool", self.dir,
                 exc.strerror)
        self.nowait = False

    async def _read_in_pool(self, ok: Sequence[tuple[int, int, int]], dests: Sequence[memoryview],
                            back: Sequence[int]) -> int:
        """Read the ranges ``ok[j]`` for ``j`` in ``back`` into ``dests[j]`` in the pool (the
        disk), planned with ``merge_gap_bytes``; returns the spans read."""
        spans = [Span(sp.chunk_id, sp.start, sp.end, tuple(back[m] for m in sp.members))
                 for sp in plan_spans([ok[j] for j in back], self.merge_gap)]
        reads = self._span_reads(spans, ok, dests)
        self._reads_in_flight += 1  # before taking fds: none of them is closed under us
        try:
            fds = {c: self._fd(c) for c in {r[0] for r in reads}}
            await asyncio.get_running_loop().run_in_executor(self.pool, _read_scatter, fds, reads)
        finally:
            self._reads_done()
        return len(reads)

    def _read_cached(self, ranges: Sequence[tuple[int, int, int]]
                     ) -> tuple[memoryview, list[memoryview | None], list[int]] | None:
        """Ranges that are all here and fit ``INLINE_READ_BYTES``, read from the page cache
        with ``preadv(RWF_NOWAIT)``: ``(payload, views, back)``, ``back`` the indices of the
        ranges whose span was not wholly cached (not read: for the pool); None where some
        range is not here, or too many bytes are asked (:meth:`readv_into` plans those the
        long way), or the filesystem refuses RWF_NOWAIT (from then on every read goes to the
        pool).

        One pass in request order, nothing sorted, each span read as soon as it is known: a
        range joins the span before it where it lies in the same chunk past that span's end
        and their 4 KiB pages meet (the values of one put, read in order), as
        :func:`plan_spans` with no merge gap would join them; other ranges are spans of
        their own.  This runs for every READV, one step per key: a 4 KiB get's CPU on the
        chunkserver (bench/RESULTS.md)."""
        total = sum(map(_LENGTH, ranges))
        if total > INLINE_READ_BYTES:
            return None
        payload = memoryview(bytearray(total))
        out: list[memoryview | None] = [None] * len(ranges)
        back: list[int] = []
        sizes, gap, fd_of, mask = self.sizes, self._gap, self._fd, ALIGN - 1
        preadv, flags = os.preadv, _NOWAIT
        pos = lo = start = spans = 0
        cur_c = fd_c = fd = -1
        cur_end = 0
        iov: list[memoryview] = []
        self._reads_in_flight += 1  # before taking fds: none of them is closed under us
        try:
            # the last span is read after the loop, by one more step past the end (i == n)
            n = len(ranges)
            for i in range(n + 1):
                if i < n:
                    c, off, ln = ranges[i]
                    size = sizes.get(c)
                    if size is None or off < 0 or ln < 0 or off + ln > size:
                        return None  # not here: readv_into answers it as stale
                    out[i] = view = payload[pos : pos + ln]
                    pos += ln
                    if not ln:
                        continue
                    if c == cur_c and cur_end <= off and off & ~mask <= (cur_end + mask) & ~mask:
                        if off > cur_end:
                            iov.append(gap(off - cur_end))
                        iov.append(view)
                        cur_end = off + ln
                        continue
                if iov:  # the span before this range (or the last one) is complete: read it
                    need = cur_end - start
                    try:  # one preadv the common case; a short read (rare) read again, in full
                        got = preadv(fd, iov, start, flags) if len(iov) <= IOV_MAX else -2
                        if got != need:
                            got = _preadv_all(fd, iov, start, flags)
                    except BlockingIOError:
                        got = -1
                    if got < need:
                        back.extend(range(lo, i))
                    else:
                        spans += 1
                if i < n:
                    if c != fd_c:
                        fd, fd_c = fd_of(c), c
                    cur_c, start, cur_end, lo, iov = c, off, off + ln, i, [view]
        except OSError as exc:
            if exc.errno not in _NOWAIT_REFUSED:
                raise
            self._nowait_refused(exc)
            return None
        finally:
            self._reads_done()
        self.inline_spans += spans
        self.spans_read += spans
        self.bytes_read += total
        return payload, out, back

    def _present(self, ranges: Sequence[tuple[int, int, int]]
                 ) -> tuple[list[tuple[int, int, int]], list[int], dict[int, StaleLayout]]:
        """``(ok, ok_idx, errors)``: the ranges this server holds and their indices, and a
        :class:`StaleLayout` for each other one (its chunk or its bytes not here)."""
        errors: dict[int, StaleLayout] = {}
        ok: list[tuple[int, int, int]] = []
        ok_idx: list[int] = []
        sizes = self.sizes
        for i, (c, off, ln) in enumerate(ranges):
            size = sizes.get(c)
            if size is None:
                errors[i] = StaleLayout(f"chunk {c:016x} is not on this server")
            elif off < 0 or ln < 0 or off + ln > size:
                errors[i] = StaleLayout(f"chunk {c:016x} has no bytes at {off}+{ln} (size {size})")
            else:
                ok.append((c, off, ln))
                ok_idx.append(i)
        return ok, ok_idx, errors

    def readv_files(self, ranges: Sequence[tuple[int, int, int]], min_bytes: int
                    ) -> tuple[FileParts | None, dict[int, StaleLayout]]:
        """A READV's answer as the chunk files' bytes themselves, for ``sendfile``:
        ``(parts, errors)``, the parts being every range not in ``errors``, in request order
        (neighbours in one file joined), on fds of their own.  ``parts`` is None (read it
        with :meth:`readv_into`) unless the ranges average at least ``min_bytes`` (0: never)
        and the page cache holds every page of them, so that no send waits for the disk
        in the event loop.  Where no range is that long (a batch of small values) the
        answer is known without looking: ``(None, {})``."""
        if not min_bytes or not ranges or max(map(_LENGTH, ranges)) < min_bytes:
            return None, {}
        ok, _, errors = self._present(ranges)
        total = sum([r[2] for r in ok])
        if not ok or total < min_bytes * len(ok):
            return None, errors
        chunks = {r[0] for r in ok}
        if self.lent_fds + len(chunks) > self.max_open_files:  # as many as the open chunks' LRU
            return None, errors
        segments: list[tuple[int, int, int]] = []
        self._reads_in_flight += 1  # before taking fds: none of them is closed under us
        try:
            fds = {c: self._fd(c) for c in chunks}
            for sp in plan_spans(ok, 0):
                if not resident(fds[sp.chunk_id], sp.start, sp.end - sp.start):
                    return None, errors
            own: dict[int, int] = {}
            try:
                for c, fd in fds.items():
                    own[c] = os.dup(fd)
            except OSError as exc:  # out of file descriptors: read into a buffer instead
                log.warning("chunkserver %s: no fd to send chunk bytes from (%s); reading them "
                            "into a buffer", self.server_id, exc)
                _close_fds(list(own.values()))
                return None, errors
        finally:
            self._reads_done()
        for c, off, ln in ok:
            if not ln:
                continue
            fd = own[c]
            if segments and segments[-1][0] == fd and segments[-1][1] + segments[-1][2] == off:
                segments[-1] = (fd, segments[-1][1], segments[-1][2] + ln)
            else:
                segments.append((fd, off, ln))
        self.spans_read += len(segments)
        self.file_spans += len(segments)
        self.bytes_read += total
        self.lent_fds += len(own)
        return FileParts(segments, list(own.values()),
                         functools.partial(self._fds_back, {fd: c for c, fd in own.items()})), errors

    def readv_mapped(self, ranges: Sequence[tuple[int, int, int]]) -> list[memoryview] | None:
        """A READV's answer as views of the chunk files' mappings (:mod:`.maps`), one per
        range in request order (one in all where they follow each other in one chunk): sent
        with its header by one vectored write, no ``preadv`` per range, no reply buffer.
        None (read it: :meth:`readv_into`) unless every range is here, they fit
        ``INLINE_READ_BYTES`` and lie in at most ``MAPPED_MAX_CHUNKS`` chunks, and the page
        cache holds every page from the first byte asked of each chunk to the last (one
        ``cachestat`` per chunk, so no send waits for the disk in the event loop; asked
        only where that stretch is at most ``MAPPED_CHECK_BYTES`` per range: a longer one
        costs more to ask about than its ranges cost to read; a stretch found held is
        believed for ``resident_keep_s``: :meth:`_resident`).  As with ``sendfile``
        (:meth:`readv_files`), a page can be evicted between the question (or the belief)
        and the send; the send then waits for it (rare, at most the READV's own ranges).

        Each pass over the ranges is a C loop (``map``, ``min``, ``max``): this runs for
        every small READV answered from the page cache, once per key."""
        maps = self.maps
        if not maps.max_maps or not ranges:
            return None
        cids, offs, lens = zip(*ranges, strict=True)  # the columns, in one pass
        chunks = set(cids)
        if len(chunks) > MAPPED_MAX_CHUNKS:  # known first: random keys of a large server
            return None
        total = sum(lens)
        if total > INLINE_READ_BYTES or min(lens) < 0:
            return None
        if min(offs) < 0:  # (a READV's never are: its ranges were checked)
            return None
        ends = tuple(map(operator.add, offs, lens))
        views: dict[int, memoryview] = {}
        self._reads_in_flight += 1  # before taking fds: none of them is closed under us
        try:
            for c in chunks:
                if len(chunks) == 1:
                    lo, hi, n = min(offs), max(ends), len(offs)
                else:
                    mine = list(map(c.__eq__, cids))
                    lo, hi, n = min(compress(offs, mine)), max(compress(ends, mine)), sum(mine)
                size = self.sizes.get(c)
                if size is None or hi > size or hi - lo > MAPPED_CHECK_BYTES * n:
                    return None  # not here (readv_into answers it as stale), or too sparse
                fd = self._fd(c)
                got = maps.view(c, fd, hi)
                if got is None or not self._resident(c, fd, lo, hi, got[1]):
                    return None
                views[c] = got[0]
        finally:
            self._reads_done()
        if len(views) == 1:
            (view,) = views.values()
            if ends[:-1] == offs[1:]:  # one run (a put's values read in order)
                out = [view[offs[0] : ends[-1]]]
            else:
                out = list(map(view.__getitem__, map(slice, offs, ends)))
        else:
            out = list(map(_sliced, map(views.__getitem__, cids), map(slice, offs, ends)))
        self.spans_read += len(out)
        self.mapped_spans += len(out)
        self.bytes_read += total
        return out

    def _resident(self, c: int, fd: int, lo: int, hi: int, addr: int) -> bool:
        """:func:`resident` for bytes ``lo`` to ``hi`` of chunk ``c`` (``fd``, mapped at
        ``addr``), believed without asking for ``resident_keep_s`` after the page cache was
        found to hold them.  A stretch touching the one believed is asked about only past
        it (a few pages: the walk costs by the pages asked about) and joined to it, keeping
        its end of belief."""
        now = time.monotonic()
        held = self._in_cache.get(c)
        if held is not None and now < held[2] and lo <= held[1] and held[0] <= hi:
            start, end, until = held
            if start <= lo and hi <= end:
                return True
            if lo < start and not resident(fd, lo, start - lo, addr):
                return False
            if end < hi and not resident(fd, end, hi - end, addr):
                return False
            self._in_cache[c] = (min(lo, start), max(hi, end), until)
            return True
        if not resident(fd, lo, hi - lo, addr):
            return False
        if c not in self._in_cache and len(self._in_cache) >= self.maps.max_maps:
            self._in_cache.clear()  # (bounded as the mappings are: readv_mapped needs one)
        self._in_cache[c] = (lo, hi, now + self.resident_keep_s)
        return True

    def _fds_back(self, chunk_of: dict[int, int], fds: list[int]) -> None:
        """A :meth:`readv_files` answer's close: its ``fds`` (of the chunks ``chunk_of``
        names) closed as the LRU's are (:meth:`_close_chunk_fds`): a chunk deleted during
        the send has the file's last fd here."""
        self.lent_fds -= len(fds)
        self._close_chunk_fds([(chunk_of[fd], fd) for fd in fds])

    def _span_reads(self, spans: Sequence[Span], ok: Sequence[tuple[int, int, int]],
                    dests: Sequence[memoryview]) -> list[SpanRead]:
        """One read per span: its ranges' bytes straight into their ``dests``, the bytes
        between them into a scratch buffer; a span whose ranges overlap (a caller's own
        ranges: a READV's never do) is read range by range instead."""
        reads: list[SpanRead] = []
        for sp in spans:
            members = sp.members
            if len(members) == 1:
                j = members[0]
                c, off, ln = ok[j]
                reads.append((c, off, [dests[j]], ln, members))
                continue
            first = ok[members[0]][1]
            cursor = first
            iov: list[memoryview] = []
            for j in members:  # in offset order (plan_spans sorts them)
                _, off, ln = ok[j]
                if not ln:
                    continue
                if off < cursor:
                    break
                if off > cursor:
                    iov.append(self._gap(off - cursor))
                iov.append(dests[j])
                cursor = off + ln
            else:
                reads.append((sp.chunk_id, first, iov, cursor - first, members))
                continue
            reads.extend((c, off, [dests[j]], ln, (j,)) for j in members for c, off, ln in (ok[j],))
        return reads

    def _gap(self, n: int) -> memoryview:
        """``n`` bytes to read a gap into and drop (one scratch buffer, grown as needed; its
        bytes are never read)."""
        if len(self._scratch) < n:
            self._scratch = bytearray(max(n, 2 * len(self._scratch)))
        return memoryview(self._scratch)[:n]

    # garbage collection ----------------------------------------------------
    def _reads_done(self) -> None:
        self._reads_in_flight -= 1
        self._close_idle()

    def mtimes(self) -> dict[int, float]:
        out = {}
        for cid in self.sizes:
            try:
                out[cid] = self.chunk_path(cid).stat().st_mtime
            except FileNotFoundError:
                continue
        return out

    async def compact(self, sources: Sequence[tuple[int, Sequence[tuple[int, int]]]]
                      ) -> tuple[int | None, int, list[list[int | None]]]:
        """Copy the records whose values start at the given (offset, length) of each source
        chunk into one new sealed chunk (fsynced before returning).

        Returns (new chunk id or None when nothing was copied, its size, per source the new
        value offset of each wanted range or None where the record is gone or corrupt).
        """
        loop = asyncio.get_running_loop()
        bufs: list[bytes | memoryview] = []
        locations: list[list[int | None]] = []
        total = 0
        for cid, wanted in sources:
            if cid == self._open:
                raise InvalidArgument(f"chunk {cid:016x} is open for appends; it cannot be compacted")
            if cid not in self.sizes:
                locations.append([None] * len(wanted))
                continue
            try:
                data = await loop.run_in_executor(self.pool, self.chunk_path(cid).read_bytes)
            except FileNotFoundError:
                locations.append([None] * len(wanted))
                continue
            recs = {r.value_offset: r for r in scan_records(data)}
            locs: list[int | None] = []
            for off, ln in wanted:
                rec = recs.get(off)
                if rec is None or rec.length != ln or not rec.value_ok:
                    locs.append(None)
                    continue
                head = copy_header(rec)
                bufs.append(head)
                if rec.length:
                    bufs.append(memoryview(data)[rec.value_offset : rec.value_offset + rec.length])
                locs.append(total + len(head))
                total += len(head) + rec.length
            locations.append(locs)
        if not bufs:
            return None, 0, locations
        self._check_space(total, gc=True)
        new = self._new_chunk_id()
        path = self.chunk_path(new)
        tmp = path.with_suffix(".tmp")

        def write() -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            try:
                _pwritev_all(fd, bufs, 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
            os.close(fd)
            os.replace(tmp, path)
            fsync_dir(self.dir)  # the new chunk survives a crash before meta switches to it

        with _full_is_nospace(f"chunkserver {self.server_id} compacting into a new chunk"):
            await loop.run_in_executor(self.pool, write)
        self._set_size(new, total)
        return new, total, locations

    async def scan(self, chunk_id: int) -> list[ScannedRecord]:
        """Every record of a chunk, each value checked against its CRC (meta rebuild, scrub)."""
        if chunk_id not in self.sizes:
            raise StaleLayout(f"chunk {chunk_id:016x} is not on this server")
        size = self.sizes[chunk_id]

        def read() -> list[ScannedRecord]:
            with open(self.chunk_path(chunk_id), "rb") as f:
                return list(scan_records(f.read(size)))

        return await asyncio.get_running_loop().run_in_executor(self.pool, read)

    async def delete_chunks(self, chunk_ids: Sequence[int]) -> dict[int, int]:
        """Unlink sealed chunks; reads already running finish on their open fds.  The chunks
        leave ``sizes`` at once (no read or append starts on them), their files are unlinked
        in an IO thread (:func:`_unlink_chunks`): an unlink frees the chunk's blocks, which
        waits for the disk where the filesystem discards them as they are freed, as a sealed
        chunk's truncate does (:meth:`_release_later`).  Shielded: a caller that goes away
        does not leave chunks forgotten here and still on disk."""
        doomed: list[tuple[int, int | None]] = []
        for cid in chunk_ids:
            if cid == self._open:
                continue
            size = self.sizes.pop(cid, None)
            self.used_bytes -= size or 0
            self.maps.drop(cid)
            self._in_cache.pop(cid, None)
            fd = self._fds.pop(cid, None)
            if fd is not None:
                self._close_later.append((cid, fd))
                self._close_idle()
            doomed.append((cid, size))
        if not doomed:
            return {}
        found = await asyncio.shield(self.pool.run(_unlink_chunks, [self.chunk_path(c) for c, _ in doomed]))
        deleted: dict[int, int] = {}
        for (cid, size), st_size in zip(doomed, found, strict=True):
            if st_size is not None:
                deleted[cid] = st_size
            elif size is not None:  # already unlinked (a crash between unlink and answer)
                deleted[cid] = size
        return deleted

    async def verify(self, ranges: Sequence[tuple[int, int, int, int]]) -> tuple[list[int], list[int]]:
        """(missing, bad): indices of ranges not on this server / failing their CRC-32C."""
        missing: list[int] = []
        bad: list[int] = []
        plain = []
        idx = []
        for i, (c, off, ln, _crc) in enumerate(ranges):
            size = self.sizes.get(c)
            if size is None or off < 0 or off + ln > size:
                missing.append(i)
            else:
                plain.append((c, off, ln))
                idx.append(i)
        if plain:
            views, _ = await self.readv(plain)
            for j, v in enumerate(views):
                i = idx[j]
                if v is None:
                    missing.append(i)
                elif crc32c.crc32c(v) != ranges[i][3]:
                    bad.append(i)
        return sorted(missing), bad
