"""Meta's WAL syncs, off its event loop: every change (a COMMIT's group, a DELETE, GC's
changes, the access-time flush, a registration) is written to SQLite's WAL unsynced on the
loop, and its answer waits here for one ``fdatasync`` of the WAL run in meta's one sync
thread, which covers it and every transaction written before it (:class:`WalSync`).

SQLite's connection is used on the loop only: the thread opens the ``-wal`` file by path
and syncs it (:meth:`kvfs.meta.store.MetaStore.sync_wal`).  With ``checkpoint`` (meta's
``--fsync batch``/``always``) the thread also runs the WAL's checkpoints, on a second
SQLite connection of its own (:class:`kvfs.meta.store.Checkpointer`), so lookups are not
held by them either: after a sync returned and before its answer is handed back, so no
commit group is written meanwhile (the next waits for the answer), the checkpoint copies
the whole WAL, and the thread restarts it too (the first transaction after such a
checkpoint rewinds the WAL and syncs its new header: :meth:`Checkpointer._restart`), so
the next write on the loop appends without a sync (a checkpoint running beside the writes
never catches up: measured, bench/RESULTS.md).  The answer waits for the checkpoint and
the restart, as it waited for the loop's.  The loop's connection checkpoints itself only
if the WAL outgrows the bound (:data:`kvfs.meta.store.LOOP_CHECKPOINT_FRAMES`: the thread
fell behind, or failed).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvfs.errors import ServerError
from kvfs.meta.store import Checkpointer

if TYPE_CHECKING:
    from kvfs.meta.localstore import LocalStore

log = logging.getLogger("kvfs.meta")

SyncDone = Callable[[BaseException | None], None]
Durable = Callable[[ServerError | None], None]  # called once its transactions are durable, or with why not


class SyncThread:
    """Meta's one sync thread: runs each sync handed to it, in order, and calls its ``done``
    with the outcome (None, or what it raised) on the loop that asked.  Leaner than an
    executor: one queue put and one loop wake-up per sync, no futures' bookkeeping taking
    the GIL from the loop in between."""

    def __init__(self, checkpointer: Checkpointer | None = None) -> None:
        self.checkpointer = checkpointer  # used in this thread only
        self._requests: queue.SimpleQueue[
            tuple[Callable[[], None], asyncio.AbstractEventLoop, SyncDone] | None] = queue.SimpleQueue()
        # a daemon: a process that exits without close() (a crash) is not held up by it; a
        # sync cut short there answered no one (close() itself stops it, syncs done)
        self._thread = threading.Thread(target=self._run, name="kvfs-meta-sync", daemon=True)
        self._thread.start()

    def submit(self, sync: Callable[[], None], done: SyncDone) -> None:
        self._requests.put((sync, asyncio.get_running_loop(), done))

    def _run(self) -> None:
        while (req := self._requests.get()) is not None:
            sync, loop, done = req
            outcome: BaseException | None = None
            try:
                sync()
            except BaseException as exc:  # handed to the loop: the changes' answer
                outcome = exc
            if self.checkpointer is not None and outcome is None:
                try:  # (a failed checkpoint loses nothing: its frames stay in the WAL)
                    self.checkpointer.run_if_due()
                except Exception:
                    log.exception("meta's WAL checkpoint in the sync thread failed; the loop's "
                                  "connection checkpoints past its bound")
            with contextlib.suppress(RuntimeError):  # the loop closed: no one waits
                loop.call_soon_threadsafe(done, outcome)
        if self.checkpointer is not None:
            self.checkpointer.close()

    def stop(self) -> None:
        """End the thread once the syncs handed to it are done."""
        self._requests.put(None)
        self._thread.join()


class WalSync:
    """The transactions written unsynced and the syncs that make them durable.

    - :meth:`unsynced` wraps a change's transactions: written to the WAL without a sync
      (``synchronous=NORMAL``), counted as owed one;
    - :meth:`after` / :meth:`settle`: once every transaction written so far is durable
      (at once when none is owed).  One sync runs at a time, in the sync thread; the
      transactions written while it runs are covered by the next one, started when it
      returns, together (the WAL is written in order, so a sync covers every transaction
      written before it started);
    - a failed sync fails every change waiting (:class:`ServerError` naming the failure)
      and every change after it (:meth:`unsynced` refuses) until meta is restarted: after
      a failed ``fdatasync`` Linux may have dropped the written pages, so a later sync
      that succeeds proves nothing.
    """

    def __init__(self, store: LocalStore, *, checkpoint: bool = False) -> None:
        self.store = store
        # the WAL's checkpoints in the sync thread (the loop's connection's raised to the bound)
        self._checkpointer = store.checkpoint_off_loop() if checkpoint else None
        self.failed: ServerError | None = None
        self.syncs = 0  # syncs that returned
        self._written = 0  # transactions written unsynced since start
        self._synced = 0  # of them, those covered by a sync that returned
        self._waiting: collections.deque[tuple[int, Durable]] = collections.deque()
        self._running: asyncio.Future[None] | None = None  # the sync in flight (done: it ended)
        self._thread: SyncThread | None = None

    @contextlib.contextmanager
    def unsynced(self) -> Iterator[None]:
        """Transactions inside are written without a sync and owed one (refused after a
        failed sync)."""
        if self.failed is not None:
            raise self.failed
        try:
            with self.store.unsynced():
                yield
        finally:  # (a transaction before a failing one may have been written)
            self._written += 1

    @property
    def owed(self) -> bool:
        """Some transaction written is not durable yet."""
        return self._synced < self._written

    def after(self, done: Durable) -> None:
        """Call ``done(None)`` once every transaction written so far is durable (now, when
        it is), or ``done(error)`` when the sync covering them failed (or one before)."""
        if self.failed is not None:
            done(self.failed)
        elif not self.owed:
            done(None)
        else:
            self._waiting.append((self._written, done))
            if self._running is None:
                self._start()

    async def settle(self) -> None:
        """Return once every transaction written before this call is durable; raises
        :class:`ServerError` if the sync covering them failed."""
        if self.failed is None and not self.owed:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done(exc: ServerError | None) -> None:
            if not fut.done():  # (a cancelled waiter: no one to tell)
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

        self.after(done)
        await fut

    def _start(self) -> None:
        if self._thread is None:
            self._thread = SyncThread(self._checkpointer)
        target = self._written
        self._running = asyncio.get_running_loop().create_future()
        self._thread.submit(self.store.sync_wal, lambda exc: self._ended(exc, target))

    def _ended(self, exc: BaseException | None, target: int) -> None:
        running, self._running = self._running, None
        assert running is not None
        running.set_result(None)
        if exc is None:
            self.syncs += 1
            self._synced = max(self._synced, target)
            while self._waiting and self._waiting[0][0] <= target:
                self._waiting.popleft()[1](None)  # (may write and wait again: started below)
            if self._waiting and self._running is None:
                self._start()
            return
        self.failed = ServerError(
            f"meta's database sync (fdatasync of {self.store.wal_path}) failed: {exc!r}; the "
            "changes it covered are not known to be on disk, and meta refuses every commit, "
            "delete and GC change until it is restarted (after a failed sync the kernel may "
            "have dropped written pages, so a later sync proves nothing)")
        log.error("%s", self.failed)
        waiting, self._waiting = self._waiting, collections.deque()
        for _, done in waiting:
            done(self.failed)

    @property
    def checkpoints(self) -> int:
        """Checkpoints run in the sync thread."""
        return 0 if self._checkpointer is None else self._checkpointer.checkpoints

    async def close(self) -> None:
        """Wait for the syncs owed to waiting changes, then end the sync thread (its
        checkpoint connection closed in it; the loop's, closed last, checkpoints the rest)."""
        while self._running is not None:
            await asyncio.wait([self._running])
        if self._thread is not None:
            self._thread.stop()  # (idle now: returns at once)
            self._thread = None
