"""When chunk bytes reach the disk: group commit, directory syncs, files replaced durably.

``FsyncMode`` (``ChunkServerConfig.fsync``) picks the rule for appends:

- ``always``: each append is ``fdatasync``-ed before it is answered;
- ``batch`` (default): each append is durable before it is answered, and the
  appends that finish while one ``fdatasync`` runs (or within
  ``fsync_window_s``) share the next one (:class:`GroupSync`); an append of
  ``writeback_start_bytes`` or more starts its writeback as soon as it is
  written (:func:`start_writeback`), so the round it waits for finds it on its way;
- ``never``: appends are answered from the page cache; a power loss (not a
  process crash) can lose acknowledged values, which then read as misses or
  checksum errors, never as wrong bytes.

In every mode a new chunk's directory entry is synced before an append to it
is answered (``never`` excepted; a chunk reserved ahead had its entry synced by
its reservation's job), compactions are synced before meta is told,
and ``state.json`` is replaced by temp file + fsync + rename.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import logging
import os
from pathlib import Path
from typing import Any

from kvfs.chunkserver.iopool import IoPool
from kvfs.errors import Unavailable

log = logging.getLogger("kvfs.chunkserver")


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (new, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that after a crash it holds either the old or the new bytes."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private, like the data dir
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: the group fdatasync writes everything
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``offset`` of ``fd`` to the disk, not waiting for them
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``).  Nothing is promised by it: the group
    ``fdatasync`` that covers these bytes still makes them durable (and reports a failure), it
    only finds them written or on their way.  An append that waits for a round already
    running would otherwise start its writeback only when the next round does
    (bench/RESULTS.md, "Durable puts ...: writeback started at the write")."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # (-1: the fdatasync will tell)


def _sync_files(fds: set[int], dir_path: Path | None) -> None:
    for fd in fds:
        try:
            os.fdatasync(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:  # the chunk was deleted meanwhile: nothing to keep
                raise
    if dir_path is not None:
        fsync_dir(dir_path)


class GroupSync:
    """Group commit for one chunk directory.

    ``await sync(fd)`` returns once an ``fdatasync`` that started after the call covered
    ``fd``.  Callers arriving while a sync runs share the next one, so N concurrent
    appends cost about two syncs, not N.  :meth:`close` ends it: a round waiting out its
    window runs at once, later calls are refused (:class:`Unavailable`), and a caller
    never waits for a round that will not run.

    Driven by callbacks, not a task: a round is one :meth:`IoPool.call`, whose answer
    (:meth:`_synced`, straight from the IO thread's ``call_soon_threadsafe``) answers its
    callers in one pass of the loop (a task waiting on the pool's future took three: the
    future's callback, the task's step, then its callers') and schedules the next round
    (:meth:`_next`).
    """

    def __init__(self, pool: IoPool, directory: Path, window_s: float = 0.0) -> None:
        self.pool = pool
        self.directory = directory
        self.window_s = window_s
        self.rounds = 0  # fdatasync rounds run
        self._fds: set[int] = set()
        self._dir = False
        self._waiters: list[asyncio.Future[None]] = []
        self._busy = False  # a round runs or waits out its window
        self._timer: asyncio.Handle | None = None  # the next round's start, not run yet
        self._idle: list[asyncio.Future[None]] = []  # close's, answered when no round runs
        self._closed = False

    @property
    def waiting(self) -> int:
        """Callers queued for the next round."""
        return len(self._waiters)

    @property
    def busy(self) -> bool:
        """A round runs or waits out its window."""
        return self._busy

    def _refused(self) -> Unavailable:
        return Unavailable(f"{self.directory}: the chunkserver is shutting down; an append "
                           "written but not synced is not acknowledged: append elsewhere")

    async def sync(self, fd: int, *, new_file: bool = False) -> None:
        if self._closed:
            raise self._refused()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._fds.add(fd)
        self._dir |= new_file
        self._waiters.append(fut)
        if not self._busy:
            self._next()
        await fut

    def _next(self) -> None:
        """The next round for the callers queued: after the window (if any, and not
        closing), else in the loop's next pass (every caller of this pass joins it)."""
        self._busy = True
        loop = self._waiters[0].get_loop()  # (not get_running_loop: a getpid each in 3.11)
        if self.window_s > 0 and not self._closed:
            self._timer = loop.call_later(self.window_s, self._start)
        else:
            self._timer = loop.call_soon(self._start)

    def _start(self) -> None:
        self._timer = None
        waiters, fds, new_dir = self._waiters, self._fds, self._dir
        self._waiters, self._fds, self._dir = [], set(), False
        try:
            self.pool.call(_sync_files, (fds, self.directory if new_dir else None),
                           functools.partial(self._synced, waiters))
        except RuntimeError:  # the IO threads were shut down (a close that gave up)
            self._synced(waiters, None, self._refused())

    def _synced(self, waiters: list[asyncio.Future[None]], _: object,
                exc: BaseException | None) -> None:
        """A round ended: its callers answered (its error, if any), then the next round
        started, or close's waiters told that none runs."""
        if exc is not None and not isinstance(exc, (OSError, Unavailable)):  # a bug, not the disk
            log.error("%s: group sync failed", self.directory, exc_info=exc)
            exc = Unavailable(f"{self.directory}: the group sync failed ({type(exc).__name__}: "
                              f"{exc}); an append written but not synced is not acknowledged: "
                              "append elsewhere")
        for w in waiters:
            if not w.done():
                if exc is None:
                    w.set_result(None)
                else:
                    w.set_exception(exc)
        self.rounds += 1
        if self._waiters:
            self._next()
            return
        self._busy = False
        for w in self._idle:
            if not w.done():
                w.set_result(None)
        self._idle.clear()

    async def close(self, timeout_s: float) -> bool:
        """Refuse new syncs and run the round queued now (its window cut short); True once
        no round runs, False if one still does after ``timeout_s`` (a sync hanging on the
        disk: its callers wait on with it)."""
        self._closed = True
        if self._timer is not None:  # (in its window)
            self._timer.cancel()
            self._start()
        if not self._busy:
            return True
        idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle.append(idle)
        done, _ = await asyncio.wait([idle], timeout=timeout_s)
        return bool(done)
