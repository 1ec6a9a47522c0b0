"""The chunk store's IO threads: the blocking file calls (an append's ``pwritev``, the group
``fdatasync``, reads not in the page cache, compactions) run here, off the event loop.

Three ways in.  ``await pool.run(fn, *args)`` (an append's write) hands the job to a thread
through one queue and is answered with one ``call_soon_threadsafe`` on the loop: no
``concurrent.futures.Future`` (a condition variable each), work item, idle semaphore or
chained futures, which cost as much CPU again as the hop itself (52-56 vs 28-30 us a hop
here: bench/RESULTS.md, "Chunkserver CPU per key on the 4 KiB put path").
``pool.call(fn, args, done)`` (the group sync) is the same hop with no future at all:
``done(result, exc)`` is that ``call_soon_threadsafe``'s callback, so the answer takes one
pass of the loop, not two (a future's callbacks run in a later pass).  ``submit`` is an
``Executor``'s, for ``loop.run_in_executor``.  All three count their jobs until they end, so a
store's close can wait for them (:meth:`IoPool.wait_idle`), bounded, before it closes the
files they use.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# a job: (fn, args, the loop to answer on, its future or done callback) or (fn, args, None,
# a Future)
_Job = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.AbstractEventLoop | None", Any]
Done = Callable[[Any, "BaseException | None"], object]


class IoPool(Executor):
    """``threads`` threads taking jobs from one queue, in order, started with the first job.

    Called from its event loop's thread only.  After :meth:`shutdown` new jobs are refused
    (``RuntimeError``, as an ``Executor``'s) and the ones queued still run.  The threads are
    daemons: a process that exits without closing its store does not wait for them (a write
    cut there is a torn append, which recovery cuts back)."""

    def __init__(self, threads: int) -> None:
        self.size = max(1, threads)
        self.jobs: set[Future[Any]] = set()  # submit's jobs not ended
        self.running = 0  # run's and call's jobs not ended (counted in the loop's thread)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle: list[asyncio.Future[None]] = []  # wait_idle's, woken when running is 0
        self._shutdown = False

    def _start(self) -> None:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if not self._threads:
            for i in range(self.size):
                t = threading.Thread(target=self._work, name=f"kvfs-io_{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` in an IO thread; the future is answered on the running loop.  A job
        whose future is cancelled before a thread takes it does not run; one running then
        still ends (and is counted in ``running`` until it does)."""
        self._start()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self.running += 1
        self._queue.put((fn, args, loop, fut))
        return fut

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], done: Done) -> None:
        """``fn(*args)`` in an IO thread, then ``done(result, None)`` or ``done(None, exc)``
        in the running loop's thread, straight from the thread's ``call_soon_threadsafe``."""
        self._start()
        loop = asyncio.get_running_loop()
        self.running += 1
        self._queue.put((fn, args, loop, done))

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        self._start()
        fut: Future[T] = Future()
        self.jobs.add(fut)
        fut.add_done_callback(self.jobs.discard)  # (from an IO thread: one set operation)
        call: Callable[..., T] = (lambda: fn(*args, **kwargs)) if kwargs else fn
        self._queue.put((call, () if kwargs else args, None, fut))
        return fut

    def _work(self) -> None:
        get = self._queue.get
        while True:
            job = get()
            if job is None:
                return
            fn, args, loop, to = job
            del job
            if loop is None:  # submit's
                if to.set_running_or_notify_cancel():
                    try:
                        to.set_result(fn(*args))
                    except BaseException as exc:
                        to.set_exception(exc)
            else:
                result: Any = None
                exc_: BaseException | None = None
                if not (isinstance(to, asyncio.Future) and to.cancelled()):  # run's, cancelled: not run
                    try:
                        result = fn(*args)
                    except BaseException as exc:
                        exc_ = exc
                with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                    loop.call_soon_threadsafe(self._ended, to, result, exc_)
            del fn, args, loop, to  # the job's buffers are not kept alive until the next job

    def _ended(self, to: asyncio.Future[Any] | Done, result: Any, exc: BaseException | None) -> None:
        self.running -= 1
        try:
            if not isinstance(to, asyncio.Future):  # call's
                to(result, exc)
            elif not to.done():
                if exc is None:
                    to.set_result(result)
                else:
                    to.set_exception(exc)
        finally:
            if not self.running:
                for w in self._idle:
                    if not w.done():
                        w.set_result(None)
                self._idle.clear()

    async def wait_idle(self, timeout_s: float) -> int:
        """Wait, at most ``timeout_s``, until every job given so far has ended; returns
        how many are still running."""
        jobs = list(self.jobs)
        waits: list[asyncio.Future[Any]] = [asyncio.wrap_future(j) for j in jobs]
        if self.running:
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle.append(w)
            waits.append(w)
        if waits:
            await asyncio.wait(waits, timeout=timeout_s)
        return sum(not j.done() for j in jobs) + self.running

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more jobs; those queued still run.  ``wait``: until the threads have ended."""
        if not self._shutdown:
            self._shutdown = True
            for _ in self._threads:
                self._queue.put(None)
        if wait:
            for t in self._threads:
                t.join()
