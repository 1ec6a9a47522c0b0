"""Write-behind for the mount (``--write-behind SIZE``; off by default): a close returns once
the file is held here, and held files are committed in batches.

Without it, a close (FUSE flush) returns once the file is committed: its bytes on the
chunkservers and meta's COMMIT done, so every node sees it and a failure is the close's
error.  With it:

- **A close holds the file**: it returns once the file's bytes are kept here (the kernel's
  buffers as they came, not copied).  Held files take at most ``write_behind_bytes`` and
  ``write_behind_files`` in all; when full, a close waits for room (within ``--timeout``).
  A file larger than ``write_behind_bytes``, or streamed (over ``--write-buffer``), is
  committed at its close as without write-behind.
- **Held files are committed in batches**, as reads are: one ``put_many`` (one APPEND per
  chunkserver, one COMMIT) for the files held while earlier batches ran, at most
  ``--max-batch-items`` / ``--max-batch`` each and ``--batches-in-flight`` at once.  A
  held file waits up to ``write_behind_delay_s`` for the files closed after it, so that
  a stream of closes makes few, full batches (each batch costs an APPEND per chunkserver
  and a COMMIT, and sending them one by one interleaves that work with the FUSE requests
  the writers wait on); a full batch, an fsync waiting for it and a close waiting for
  room send at once.
- **This mount sees a held file at once** (lookups, listings, reads answer from the held
  bytes; its mtime is the one the kernel was told while it was written); other nodes see
  it once committed.  Each commit learns the layout meta committed the file with
  (:attr:`Held.layout`), so that the kernel's pages a file was written through stay that
  value's after the commit, as after a close that commits
  (:meth:`kvfs.mount.files.FileIO._behind_committed`).
- **One version of a path is committed at a time, in order**: a newer close of a path
  replaces its held version not yet sent (which is then never sent), and waits for one
  being committed.  A newer close that is not held (streamed, or larger than
  ``write_behind_bytes``) waits for the version being committed, and supersedes the one
  not sent yet (sent after all only if that close's commit fails); a version held while it
  commits waits for it.  So the last close's bytes win, as on a disk.
- **A rename of a held file moves the held bytes** to the new name (no commit, no read
  back), and holds a delete of the old name, ordered like a version of it; none when the
  file was created here where the name was missing and none of its versions was sent yet
  (HiCacheFile's tmp renamed before its batch went: the cluster has nothing of that name
  to delete, and a file another client commits there meanwhile stays).  An unlink of
  such a file sends no DELETE either.
- **A committed file's bytes stay here while there is room** (they count towards
  ``write_behind_bytes`` and ``write_behind_files`` and are the first to go when a close
  needs the room), so that renaming it soon after its commit (HiCacheFile's tmp +
  ``os.replace``, when the tmp's commit won the race) moves them too, without reading them
  back, once meta's layout of the old name shows the same size and CRC-32C: the value
  there is still those bytes.
- **unlink** drops the held version and waits for one being committed before it deletes,
  so no commit lands after the delete.
- ``fsync`` of a file, and of a directory (every held file under it), waits for the
  commit and reports its failure; fsync of the root is the mount-wide sync.  A failure
  that came before the fsync is reported too, once (the last ``write_behind_files``
  such paths are remembered until an fsync of the file or a directory above it).  (``sync``
  and ``syncfs`` cannot: the kernel sends ``FUSE_SYNCFS`` to virtiofs, not to a
  ``/dev/fuse`` daemon.)
- **A commit that fails after the close** (retried alone if its batch failed) makes the file
  a miss on this mount too: it is dropped, counted and logged, never answered with other
  bytes.  A file that replaced an older value leaves that older value in place.
- **Unmount** waits up to ``write_behind_drain_s`` for held files; what is not committed
  by then is lost (a miss), counted and logged.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import itertools
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import crc32c

from kvfs.config import MountConfig

if TYPE_CHECKING:
    from kvfs.client import AsyncClient
    from kvfs.layout import Layout

__all__ = ["Held", "WriteBehind"]

log = logging.getLogger("kvfs.mount")

Piece = bytes | bytearray
Value = Piece | list[Piece]


def _fail(fut: asyncio.Future[None], exc: BaseException) -> None:
    """``fut`` failed with ``exc``, taken as retrieved: a version nobody waits for is logged by
    the committer (``_report``), not by asyncio as "exception was never retrieved"; whoever
    awaits it still gets the failure.  (No done-callback per held file for that.)"""
    fut.set_exception(exc)
    fut.exception()


@dataclass(eq=False)
class Held:
    """One held version of a path: its bytes (``pieces``, in order), or a delete (None)."""

    path: str
    pieces: list[Piece] | None
    nbytes: int
    done: asyncio.Future[None]  # committed (None) or failed
    created: float = field(default_factory=time.time)
    queued: float = 0.0  # the loop's time it was queued (a replaced version's, in its place)
    # nothing of its path has reached the cluster from here since a create found the name
    # missing (this version and those it replaced were never sent): dropping it, or renaming
    # it away, leaves nothing to delete there
    new: bool = False
    # the layout meta committed it with (``AsyncClient.put_layouts``), once committed
    layout: Layout | None = None
    # the versions it replaced before they were sent: they end as it ends (their waiters get
    # its outcome)
    replaced: list[Held] | None = None
    # where each piece starts (and the end), made at the first read (most are never read here)
    _starts: list[int] | None = None

    def read(self, off: int, size: int) -> bytes | memoryview:
        """``size`` bytes from ``off`` (fewer at the end), without a copy when in one piece."""
        assert self.pieces is not None
        end = min(off + size, self.nbytes)
        if off >= end:
            return b""
        starts = self._starts
        if starts is None:
            starts = self._starts = list(itertools.accumulate((len(p) for p in self.pieces),
                                                              initial=0))
        i = bisect.bisect_right(starts, off) - 1
        parts = []
        pos = off
        while pos < end:
            start = starts[i]
            piece = self.pieces[i]
            parts.append(memoryview(piece)[pos - start : min(end, start + len(piece)) - start])
            pos = start + len(piece)
            i += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def value(self) -> bytes:
        assert self.pieces is not None
        return b"".join(self.pieces)

    def crc(self) -> int:
        """The CRC-32C of its bytes, as a committed value's layout has it."""
        assert self.pieces is not None
        c = 0
        for p in self.pieces:
            c = crc32c.crc32c(p, c)
        return c


class WriteBehind:
    """The mount's held files and their committer (see the module docstring)."""

    def __init__(self, client: AsyncClient, config: MountConfig, *, ttl: float | None = None,
                 committed: Callable[[Held], None] = lambda e: None,
                 ended: Callable[[Held], None] = lambda e: None) -> None:
        self.client = client
        self.ttl = ttl
        self.limit_bytes = config.write_behind_bytes
        self.limit_files = config.write_behind_files
        self.max_items = config.max_batch_items
        self.max_bytes = config.max_batch_bytes
        self.in_flight = config.batches_in_flight
        self.delay_s = config.write_behind_delay_s
        self._committed = committed
        self._ended = ended
        self._queue: OrderedDict[str, Held] = OrderedDict()  # not sent yet, oldest first
        # paths whose commit after close failed, not reported by an fsync yet (at most
        # ``write_behind_files``, the oldest dropped first): an fsync that comes after the
        # failure still reports it, once, as the kernel's errseq does for writeback
        self._failures: OrderedDict[str, OSError] = OrderedDict()
        self._sent: dict[str, Held] = {}  # being committed: at most one version per path
        self._sending: Counter[str] = Counter()  # paths committed by a stream or put meanwhile
        self._bytes = 0  # of everything held, queued or being committed
        self._files = 0
        self._dirs: Counter[str] = Counter()  # held files (not deletes) under each "dir/"
        # files committed from here, their bytes kept while there is room (oldest first): a
        # rename soon after moves them without a read back (see the module docstring)
        self._recent: OrderedDict[str, Held] = OrderedDict()
        self._recent_bytes = 0
        self._freed = asyncio.Event()  # room was made (a batch ended, a version dropped)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._hurry = 0  # an fsync or a close waits: held files go without the delay
        self._timer: asyncio.TimerHandle | None = None
        self.committed = 0  # files (and deletes) committed
        self.failed = 0  # files whose commit failed after their close (misses)
        self.batches = 0

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    @property
    def held_files(self) -> int:
        return self._files

    def get(self, path: str) -> Held | None:
        """The newest held version of ``path`` (a delete: ``pieces`` is None), or None."""
        return self._queue.get(path) or self._sent.get(path)

    def has_under(self, prefix: str) -> bool:
        """Whether a held file (not a delete) lies under ``prefix`` (``"dir/"``): counted per
        directory, so a lookup's miss asks it cheaply; looked at only when one may."""
        return self._dirs[prefix] > 0 and any(e.pieces is not None for e in self.under(prefix))

    def _count(self, e: Held, n: int) -> None:
        """``e`` held (n=1) or no longer (n=-1): its bytes, its file, its directories."""
        self._bytes += n * e.nbytes
        self._files += n
        if e.pieces is None:
            return
        i = e.path.find("/")
        while i >= 0:
            d = e.path[: i + 1]
            self._dirs[d] += n
            if not self._dirs[d]:
                del self._dirs[d]
            i = e.path.find("/", i + 1)

    def under(self, prefix: str) -> list[Held]:
        """The newest held version of every path under ``prefix`` (``""``: all)."""
        paths = {p for p in itertools.chain(self._queue, self._sent) if p.startswith(prefix)}
        return [e for p in sorted(paths) if (e := self.get(p)) is not None]

    # holding ---------------------------------------------------------------------------
    def _fits(self, more_bytes: int, more_files: int) -> bool:
        self._trim_recent(more_bytes, more_files)  # held files first
        return (self._bytes + more_bytes <= self.limit_bytes
                and self._files + more_files <= self.limit_files)

    # committed files' bytes, kept for a rename ----------------------------------------------
    def _trim_recent(self, more_bytes: int = 0, more_files: int = 0) -> None:
        """Committed files' bytes dropped, oldest first, until held files (and ``more``) and
        they fit the limits together."""
        while self._recent and (
                self._bytes + self._recent_bytes + more_bytes > self.limit_bytes
                or self._files + len(self._recent) + more_files > self.limit_files):
            _, e = self._recent.popitem(last=False)
            self._recent_bytes -= e.nbytes

    def _forget(self, path: str) -> None:
        e = self._recent.pop(path, None)
        if e is not None:
            self._recent_bytes -= e.nbytes

    def _keep(self, e: Held) -> None:
        """``e`` committed: its bytes kept, unless a newer version of its path is held."""
        self._forget(e.path)
        if e.pieces is None or self.get(e.path) is not None or self._closed:
            return
        self._recent[e.path] = e
        self._recent_bytes += e.nbytes
        self._trim_recent()

    def kept(self, path: str, size: int, crc: int) -> Held | None:
        """The bytes this mount last committed as ``path``, if still kept and if they are
        the value of that size and CRC-32C (meta's layout of ``path`` now); else None."""
        e = self._recent.get(path)
        if e is None or e.nbytes != size or e.crc() != crc:
            return None
        return e

    async def _room(self) -> None:
        """Wait until a batch ends or a held version is dropped (what is held goes now)."""
        self._freed.clear()
        async with self._hurried():
            await self._freed.wait()

    @contextlib.asynccontextmanager
    async def _hurried(self) -> AsyncIterator[None]:
        """While someone waits for commits: held files are sent without the delay."""
        self._hurry += 1
        self._pump()
        try:
            yield
        finally:
            self._hurry -= 1

    async def hold(self, path: str, value: Value, nbytes: int,
                   wanted: Callable[[], bool] = lambda: True, *, new: bool = False,
                   created: float | None = None) -> Held | bool:
        """Hold ``value`` (``nbytes`` in all; its buffers are not changed afterwards) as
        ``path``'s newest version, once there is room, and return that version.  False: not
        held (larger than the whole buffer, or write-behind is off); commit it now instead.
        ``wanted()`` is asked once there is room: false (the file was unlinked meanwhile)
        holds nothing (True).  ``new``: the file was created here where its name was
        missing, and not committed since (:attr:`Held.new`, unless a version of ``path`` was
        sent meanwhile).  ``created``: its mtime (default: now)."""
        if not self.enabled or nbytes > self.limit_bytes or self._closed:
            return False
        while True:
            old = self._queue.get(path)
            if self._fits(nbytes - (old.nbytes if old else 0), 0 if old else 1):
                break
            await self._room()
        if not wanted():
            return True
        pieces = value if isinstance(value, list) else [value]
        e = self._new(path, pieces, nbytes, created)
        old = self._queue.get(path)
        e.new = new and (old.new if old is not None else path not in self._sent
                         and path not in self._recent and path not in self._sending)
        self._add(e)
        return e

    def _new(self, path: str, pieces: list[Piece] | None, nbytes: int,
             created: float | None = None) -> Held:
        loop = asyncio.get_running_loop()
        return Held(path, pieces, nbytes, loop.create_future(), queued=loop.time(),
                    created=time.time() if created is None else created)

    def _add(self, e: Held) -> None:
        """``e`` queued as its path's newest version (replacing a queued one: never sent)."""
        self._forget(e.path)
        old = self._queue.get(e.path)
        if old is not None:
            e.queued = old.queued  # its place in the queue, and its wait
            self._count(old, -1)
            self._chain(old, e)
        self._queue[e.path] = e
        self._count(e, 1)
        self._pump()

    async def rename(self, src: str, dst: str, kept: Held | None = None) -> bool:
        """A held file ``src`` renamed to ``dst``: its bytes held as ``dst`` (replacing a
        held version of it), and a delete of ``src`` held.  ``kept``: ``src``'s bytes kept
        after its commit (:meth:`kept`), moved the same way when ``src`` has no
        held version.  False: ``src`` is not a held file (rename it in the cluster)."""
        while True:
            e = self.get(src) or kept
            if e is None or e.pieces is None or self._closed:
                return False
            queued = self._queue.get(src) is e
            d = self._queue.get(dst)
            more_bytes = (0 if queued else e.nbytes) - (d.nbytes if d else 0)
            more_files = (0 if queued else 1) + (0 if d else 1)
            if self._fits(more_bytes, more_files):
                break
            await self._room()
        moved = self._new(dst, e.pieces, e.nbytes)
        moved.created = e.created
        if queued:
            del self._queue[src]
            self._count(e, -1)
            self._chain(e, moved)
        self._add(moved)
        if not (queued and e.new):  # never sent, nothing there before it: nothing to delete
            self._add(self._new(src, None, 0))
        return True

    @contextlib.asynccontextmanager
    async def sending(self, path: str) -> AsyncIterator[None]:
        """A value of ``path`` committed in the ``with`` body other than through this queue (a
        streamed or unheld commit) is ordered with its held versions as the closes were: a
        version being committed ends first (whatever its outcome); the queued one (closed
        before) is not sent meanwhile, and never once the body commits (it is superseded: its
        waiters see that commit); one held meanwhile (closed after) waits for the body.  The
        queued version is no longer :attr:`Held.new`: a value of ``path`` goes to the cluster."""
        if not self.enabled:
            yield
            return
        e = self._queue.get(path)
        if e is not None:
            e.new = False
        self._sending[path] += 1
        committed = False
        try:
            s = self._sent.get(path)
            if s is not None:
                await asyncio.wait([s.done])
            yield
            committed = True
        finally:
            self._sending[path] -= 1
            if not self._sending[path]:
                del self._sending[path]
            if committed and e is not None and self._queue.get(path) is e:
                del self._queue[path]
                self._count(e, -1)
                self._end(e)
            self._freed.set()
            self._pump()

    # dropping and waiting ----------------------------------------------------------------
    async def drop(self, path: str) -> bool:
        """``path`` unlinked (or about to be replaced): its queued version is never sent,
        and one being committed is waited for (whatever its outcome).  True: that queued
        version was :attr:`Held.new` (the cluster has nothing of ``path`` from here)."""
        self._forget(path)
        e = self._queue.pop(path, None)
        new = e is not None and e.new and path not in self._sent
        if e is not None:
            self._count(e, -1)
            self._end(e)
            self._freed.set()
        s = self._sent.get(path)
        if s is not None:
            await asyncio.wait([s.done])
            self._forget(path)
        return new

    async def sync(self, path: str) -> None:
        """Wait for the commit of ``path``'s held versions; raise if it failed (or if its
        last commit failed before this was asked, not reported yet)."""
        async with self._hurried():
            for e in (self._sent.get(path), self._queue.get(path)):
                if e is not None:
                    try:
                        await asyncio.shield(e.done)
                    except OSError as failed:
                        if self._failures.get(path) is failed:  # reported here: not again
                            del self._failures[path]
                        raise
        exc = self._failures.pop(path, None)
        if exc is not None:
            raise OSError(errno.EIO, exc.strerror)

    async def sync_under(self, prefix: str, *, check: bool = True) -> None:
        """Wait for the commit of everything held under ``prefix`` (``""``: all) now; with
        ``check``, raise if any of it failed."""
        futs = [e.done for e in itertools.chain(self._queue.values(), self._sent.values())
                if e.path.startswith(prefix)]
        bad: list[BaseException] = []
        if futs:
            async with self._hurried():
                for f in futs:  # in turn: most are done by the time the ones before them are
                    if not f.done():
                        await asyncio.wait((f,))  # (a cancelled wait leaves f as it is)
                    exc = asyncio.CancelledError() if f.cancelled() else f.exception()
                    if exc is not None:
                        bad.append(exc)
        if check and self._failures:  # and those that failed before this fsync came
            for path in [p for p in self._failures if p.startswith(prefix)]:
                exc = self._failures.pop(path)
                if not any(b is exc for b in bad):
                    bad.append(exc)
        if bad and check:
            raise OSError(errno.EIO, f"{len(bad)} held file(s) under {prefix or '/'!r} failed to "
                          f"commit (they are misses); the first: {bad[0]}")

    async def drain(self, timeout_s: float) -> int:
        """At unmount: wait up to ``timeout_s`` for everything held to be committed; what is
        not by then is lost.  Returns how many files were lost."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._queue or self._sent:
                    await self._room()
        except TimeoutError:
            pass
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._recent.clear()
        self._recent_bytes = 0
        lost = [e for e in itertools.chain(self._queue.values(), self._sent.values())
                if e.pieces is not None]
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for e in list(self._queue.values()):
            self._end(e, OSError(errno.EIO, "unmounted before it was committed"))
        self._queue.clear()
        if lost:
            log.error("write-behind: %d held file(s) not committed within %ss of unmount are lost "
                      "(misses): %s", len(lost), timeout_s,
                      ", ".join(e.path for e in lost[:20]) + (" ..." if len(lost) > 20 else ""))
        log.info("write-behind: %d committed in %d batches, %d failed after their close, %d lost "
                 "at unmount", self.committed, self.batches, self.failed, len(lost))
        return len(lost)

    # committing --------------------------------------------------------------------------
    def _pump(self) -> None:
        """Send batches from the queue while fewer than ``batches_in_flight`` run; a path
        with a version being committed waits for it; a batch that is not full waits until
        its oldest file has been held ``delay_s`` (unless someone waits for commits)."""
        if self._waits():
            return
        while not self._closed and len(self._tasks) < self.in_flight and self._queue:
            batch: list[Held] = []
            size = 0
            for path, e in self._queue.items():
                if path in self._sent or path in self._sending:
                    continue
                if batch and (len(batch) >= self.max_items or size + e.nbytes > self.max_bytes):
                    break
                batch.append(e)
                size += e.nbytes
            if not batch:
                return
            for e in batch:
                del self._queue[e.path]
                self._sent[e.path] = e
            self.batches += 1
            task = asyncio.get_running_loop().create_task(self._commit(batch))
            self._tasks.add(task)

    def _waits(self) -> bool:
        """Whether the queue waits for more closes (a timer sends it when its oldest file has
        waited ``delay_s``)."""
        if not self.delay_s or self._hurry or not self._queue or self._closed:
            return False
        if len(self._queue) >= self.max_items:
            return False
        oldest = next(iter(self._queue.values()))
        left = oldest.queued + self.delay_s - asyncio.get_running_loop().time()
        if left <= 0 or (self._bytes >= self.max_bytes  # (all held bytes: the queue's bound)
                         and sum(e.nbytes for e in self._queue.values()) >= self.max_bytes):
            return False
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(left, self._due)
        return True

    def _due(self) -> None:
        self._timer = None
        self._pump()

    async def _send(self, batch: list[Held]) -> None:
        puts = [e for e in batch if e.pieces is not None]
        deletes = [os.fsencode(e.path) for e in batch if e.pieces is None]
        calls: list[Coroutine[Any, Any, Any]] = []
        if puts:
            calls.append(self._put(puts))
        if deletes:
            calls.append(self.client.delete_many(deletes))
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, BaseException):
                raise r

    async def _put(self, puts: list[Held]) -> None:
        """One ``put_many`` of held files; each learns the layout it was committed with."""
        layouts = await self.client.put_layouts(
            [(os.fsencode(e.path), e.pieces) for e in puts if e.pieces is not None], ttl=self.ttl)
        for e, layout in zip(puts, layouts, strict=True):
            e.layout = layout

    async def _commit(self, batch: list[Held]) -> None:
        errors: list[BaseException | None] = [None] * len(batch)
        try:
            try:
                await self._send(batch)
            except Exception as exc:
                if len(batch) == 1:
                    errors = [exc]
                else:  # one bad file cannot fail its neighbours: each again, alone
                    alone = await asyncio.gather(*(self._send([e]) for e in batch),
                                                 return_exceptions=True)
                    errors = [r if isinstance(r, BaseException) else None for r in alone]
        except asyncio.CancelledError as exc:  # unmounted: the drain's time is up
            errors = [exc] * len(batch)
        finally:
            task = asyncio.current_task()
            self._tasks.discard(task)
            failed: list[tuple[Held, BaseException]] = []
            for e, err in zip(batch, errors, strict=True):
                if self._sent.get(e.path) is e:
                    del self._sent[e.path]
                self._count(e, -1)
                if err is not None and not e.done.done():
                    failed.append((e, err))
                self._settle(e, err)
            if failed:
                self._report(failed)
            self._freed.set()
            self._pump()

    def _settle(self, e: Held, err: BaseException | None) -> None:
        if e.done.done():
            return
        if err is None:
            self.committed += 1
            self._failures.pop(e.path, None)  # its value now is this version's
            self._keep(e)
            self._committed(e)
            self._end(e)
            return
        if e.pieces is not None and not isinstance(err, asyncio.CancelledError):
            self.failed += 1
        exc = OSError(errno.EIO, f"{e.path}: its commit after close failed ({_reason(err)}); "
                      "the file is a miss")
        self._failures.pop(e.path, None)
        self._failures[e.path] = exc
        while len(self._failures) > self.limit_files:
            self._failures.popitem(last=False)
        self._end(e, exc)

    def _chain(self, old: Held, new: Held) -> None:
        """``old`` (not sent) was replaced by ``new``: it ends as ``new`` does, and so do the
        versions it replaced (one flat list: no recursion however often a path is replaced)."""
        if new.replaced is None:
            new.replaced = []
        new.replaced.append(old)
        if old.replaced:
            new.replaced += old.replaced
            old.replaced = None

    def _end(self, e: Held, exc: BaseException | None = None) -> None:
        """``e`` ends, and the versions it replaced with it: committed, superseded or dropped
        (``exc`` None), or failed; then the ``ended`` hook.  Synchronous: no done-callback
        (a loop callback each) per held file."""
        if not e.done.done():
            if exc is None:
                e.done.set_result(None)
            else:
                _fail(e.done, exc)
            self._ended(e)
        if e.replaced:
            replaced, e.replaced = e.replaced, None
            for r in replaced:
                self._end(r, exc)  # (their own lists were moved here: flat)

    def _report(self, failed: list[tuple[Held, BaseException]]) -> None:
        """One warning per failed batch (naming its first files), not one per file."""
        names = ", ".join(f"{e.path!r}" + (" (delete of the old name)" if e.pieces is None else "")
                          for e, _ in failed[:5])
        more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
        log.warning("write-behind: %d held file(s) were not committed after their close (%s); "
                    "they are misses: %s%s (%d failed since the mount started)", len(failed),
                    _reason(failed[0][1]), names, more, self.failed)


def _reason(err: BaseException) -> str:
    return "unmounted" if isinstance(err, asyncio.CancelledError) else f"{type(err).__name__}: {err}"
