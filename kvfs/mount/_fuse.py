"""pyfuse3, when installed: the mount needs the ``fuse`` extra, the rest of kvfs does not.

:func:`enable_asyncio` runs pyfuse3 on asyncio with two of its shim's functions replaced.
pyfuse3's ``pyfuse3.asyncio`` waits for ``/dev/fuse`` with ``add_reader(fd,
future.set_result)`` and removes the reader from a done callback, one loop step later;
``terminate()`` fails the future (``notify_closing``).  A request arriving in that step
fires the reader on a future already done: an ``InvalidStateError`` traceback from the
loop at nearly every unmount by signal (and ``terminate()`` itself raised it when the
reader had won).  Here both wake-ups skip a future already done.

The reader stays registered from one wait to the next (the waiting worker woken through
:data:`_waiting`): registering it for each wait and removing it after cost uvloop a poll
handle made and closed and two ``epoll_ctl`` per wait (~4.6 µs, several waits per file
read).  It is removed when it fires twice in a row with no wait to wake and pyfuse3's read
lock free, so no worker on its way to read (a request queued while every worker is busy
would otherwise wake the loop at every turn), at ``terminate()`` and by
:func:`stop_watching` as the session ends, before its fd is closed.

A worker also skips that wait when a request is queued already (a ``poll`` of the fd with no
timeout, before and after one yield to the loop): under load, when requests queue, that saves
the reader's registration and removal (two ``epoll_ctl``), its future and a loop turn per
request (IOCTLs answered by libfuse itself, 4 threads: ~14.5 -> ~9.5 µs of mount CPU each).
The yield keeps the loop fair (a burst of requests does not hold it) and lets pyfuse3's next
worker queue up for the fd, as it does while a worker waits (else pyfuse3 starts a worker
task for the next request, and ends one that idles later).  While another worker waits for
the read lock already, the yield comes once in ``_YIELD_EVERY`` requests read that way in a
row; the others are read at once after the first ``poll`` (a loop turn and a ``poll`` less:
~1 µs a request; the worker holds the read lock from its ``poll`` to its read, so no other
worker takes the request meanwhile).  pyfuse3's read lock (one
acquire per request) is :class:`_ReadLock`, asyncio.Lock's FIFO hand-over without its
per-acquire scan of the waiters (~1.3 µs of mount CPU a request).

While a worker reads requests the kernel has queued, :func:`reading` is true; once it finds
none queued and is about to wait, the ``on_idle`` callback given to :func:`enable_asyncio`
runs first.  The mount's batches of lookups and reads wait for that (``--batch-hold``), so
a burst of LOOKUPs from many threads shares one LOOKUP to meta instead of one each.
"""

from __future__ import annotations

import asyncio
import collections
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["IMPORT_ERROR", "Operations", "enable_asyncio", "pyfuse3", "quiet_at", "reading",
           "stop_watching"]

if TYPE_CHECKING:
    import pyfuse3
    import pyfuse3.asyncio

    Operations = pyfuse3.Operations
    IMPORT_ERROR = ""
else:
    try:
        import pyfuse3
        import pyfuse3.asyncio

        Operations = pyfuse3.Operations
        IMPORT_ERROR = ""
    except ImportError as exc:
        pyfuse3 = None
        Operations = object
        IMPORT_ERROR = str(exc)

_waiting: dict[Any, set[asyncio.Future[None]]] = {}  # fd -> the waits on it (one, in practice)
_polls: dict[Any, select.poll] = {}  # fd -> a poll object for it (a queued request, no wait)
_closing: set[Any] = set()  # fds terminate() was called for (a wait on them ends at once)
_run: dict[Any, int] = {}  # fd -> requests read since the wait last yielded (0: yield next)
_lock: _ReadLock | None = None  # pyfuse3's read lock (the one made last)
_watched: dict[Any, asyncio.AbstractEventLoop] = {}  # fds with our reader registered, its loop
# fds whose reader last fired with no wait to wake and no worker about to read (pyfuse3
# holds its read lock from a worker's wait to its read of a request)
_unheard: set[Any] = set()
_reading = False  # a request was read since the last wait on /dev/fuse began
# a worker that finds a request queued yields to the loop once in this many such reads
_YIELD_EVERY = 4
_on_idle: Callable[[], None] | None = None  # run as a wait begins (no request queued)
_quiet_at: float | None = None  # time.monotonic() when a worker last found no request queued


def reading() -> bool:
    """Whether the mount is reading the requests the kernel queued (none of its waits for
    ``/dev/fuse`` began since it last read one): what they submit is about to come."""
    return _reading


def quiet_at() -> float:
    """When the mount last found no request queued on ``/dev/fuse`` (now, before it runs):
    every request it reads was sent by the kernel after that."""
    return time.monotonic() if _quiet_at is None else _quiet_at


def _idle() -> None:
    global _reading, _quiet_at
    _reading = False
    _quiet_at = time.monotonic()
    if _on_idle is not None:
        _on_idle()


def _queued(fd: Any) -> bool:
    """Whether ``fd`` is readable now (a request queued, or an error a read will report)."""
    p = _polls.get(fd)
    if p is None:
        p = _polls[fd] = select.poll()
        p.register(fd, select.POLLIN)
    return bool(p.poll(0))


async def _wait_readable(fd: Any) -> None:
    global _reading
    if _queued(fd):
        run = _run.get(fd, 0)
        if run and _next_reader_waits() and fd not in _closing:  # read at once
            _run[fd] = run + 1 if run + 1 < _YIELD_EVERY else 0
            _reading = True
            return
        _run[fd] = 1
        await asyncio.sleep(0)  # fair to the loop's other work; the next worker queues up
        if fd in _closing:  # terminate() ran meanwhile: no wait it would end
            raise pyfuse3.asyncio.ClosedResourceError()
        if _queued(fd):
            _reading = True
            return
    _run.pop(fd, None)
    _idle()  # nothing queued: what the requests read so far submitted goes out
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    waits = _waiting.setdefault(fd, set())
    waits.add(future)
    if _watched.get(fd) is not loop:
        _unwatch(fd)
        loop.add_reader(fd, _readable, fd)
        _watched[fd] = loop
    try:
        await future
    finally:
        waits.discard(future)
        if not waits:
            _waiting.pop(fd, None)
    _reading = True


def _readable(fd: Any) -> None:
    """The reader (kept registered): wakes the waits on ``fd``; with none to wake twice in
    a row and the read lock free it goes, until the next wait registers it again."""
    woke = False
    for future in _waiting.get(fd, ()):
        if not future.done():
            future.set_result(None)
            woke = True
    if woke:
        _unheard.discard(fd)
    elif _lock is not None and _lock.locked():  # a worker is on its way to read
        _unheard.discard(fd)  # (the lock handed to it, or it found the request queued)
    elif fd in _unheard:
        _unwatch(fd)
    else:
        _unheard.add(fd)


def _unwatch(fd: Any) -> None:
    _unheard.discard(fd)
    loop = _watched.pop(fd, None)
    if loop is not None and not loop.is_closed():
        loop.remove_reader(fd)


def stop_watching() -> None:
    """The session ends: no reader is left registered for its fd (closed next, and its
    number maybe reused)."""
    for fd in list(_watched):
        _unwatch(fd)


def _next_reader_waits() -> bool:
    """Whether another pyfuse3 worker waits for the read lock already (so none is started
    for the next request once this one is read, as when it waits)."""
    return _lock is not None and bool(_lock._waiters)


class _ReadLock:
    """pyfuse3's read lock (it uses ``async with`` only): FIFO, the lock handed to the next
    waiter as asyncio.Lock does, without its scan of the waiters and extra coroutine per
    acquire (one acquire per request)."""

    def __init__(self) -> None:
        global _lock
        self._locked = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        _lock = self  # pyfuse3 makes one per session

    def locked(self) -> bool:
        """Held, or handed to a waiter that has not run yet."""
        return self._locked

    async def __aenter__(self) -> None:
        if not self._locked:
            self._locked = True
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # handed over: it stays locked, now ours
        except asyncio.CancelledError:
            if not fut.cancelled():  # handed over as the cancellation came: to the next one
                self._release()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():  # not a cancelled wait
                fut.set_result(None)
                return
        self._locked = False


def _notify_closing(fd: Any) -> None:
    _closing.add(fd)
    _polls.pop(fd, None)
    _run.pop(fd, None)
    _unwatch(fd)
    _idle()
    for future in list(_waiting.get(fd, ())):
        if not future.done():
            future.set_exception(pyfuse3.asyncio.ClosedResourceError())


def enable_asyncio(on_idle: Callable[[], None] | None = None) -> None:
    """pyfuse3 on the running asyncio loop, its ``/dev/fuse`` wake-ups made safe; ``on_idle``
    runs whenever no request is left to read (see the module docstring)."""
    global _reading, _on_idle
    shim = pyfuse3.asyncio
    _closing.clear()  # a new session (its fd may have an old one's number)
    _polls.clear()
    _run.clear()
    stop_watching()
    _reading = False
    _on_idle = on_idle
    shim.enable()  # pyfuse3 now calls the shim module's functions as trio's
    shim.wait_readable = _wait_readable
    # pyfuse3's only lock: the read lock, made at its first wait
    shim.Lock = _ReadLock  # type: ignore[assignment]
    shim.notify_closing = _notify_closing
