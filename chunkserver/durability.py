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
is answered (``never`` excepted), compactions are synced before meta is told,
and ``state.json`` is replaced by temp file + fsync + rename.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import os
from pathlib import Path
from typing import Any

from kvfs.chunkserver.iopool import IoPool
from kvfs.errors import Unavailable


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
    """

    def __init__(self, pool: IoPool, directory: Path, window_s: float = 0.0) -> None:
        self.pool = pool
        self.directory = directory
        self.window_s = window_s
        self.rounds = 0  # fdatasync rounds run
        self._fds: set[int] = set()
        self._dir = False
        self._waiters: list[asyncio.Future[None]] = []
        self._inflight: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None
        self._flush = asyncio.Event()  # set by close(): the window ends now
        self._closed = False

    @property
    def waiting(self) -> int:
        """Callers queued for the next round."""
        return len(self._waiters)

    def _refused(self) -> Unavailable:
        return Unavailable(f"{self.directory}: the chunkserver is shutting down; an append "
                           "written but not synced is not acknowledged: append elsewhere")

    async def sync(self, fd: int, *, new_file: bool = False) -> None:
        if self._closed:
            raise self._refused()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._fds.add(fd)
        self._dir |= new_file
        self._waiters.append(fut)
        if self._task is None:
            self._task = loop.create_task(self._run())
        await fut

    async def _run(self) -> None:
        try:
            while self._waiters:
                if self.window_s > 0 and not self._closed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._flush.wait(), self.window_s)
                waiters, fds, new_dir = self._waiters, self._fds, self._dir
                self._inflight = waiters
                self._waiters, self._fds, self._dir = [], set(), False
                err: BaseException | None = None
                try:
                    await self.pool.run(_sync_files, fds, self.directory if new_dir else None)
                except OSError as exc:
                    err = exc
                except RuntimeError:  # the IO threads were shut down (a close that gave up)
                    err = self._refused()
                if err is not None:
                    for w in waiters:
                        if not w.done():
                            w.set_exception(err)
                else:
                    for w in waiters:
                        if not w.done():
                            w.set_result(None)
                self.rounds += 1
        finally:
            self._task = None
            for w in (*self._inflight, *self._waiters):  # this task cancelled: nobody hangs
                if not w.done():
                    w.set_exception(self._refused())

    async def close(self, timeout_s: float) -> bool:
        """Refuse new syncs and run the round queued now (its window cut short); True once
        no round runs, False if one still does after ``timeout_s`` (a sync hanging on the
        disk: its callers wait on with it)."""
        self._closed = True
        self._flush.set()
        task = self._task
        if task is None:
            return True
        done, _ = await asyncio.wait([task], timeout=timeout_s)
        return bool(done)
