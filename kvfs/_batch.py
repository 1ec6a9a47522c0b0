"""Coalescing concurrent single-item calls into one batched call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

I = TypeVar("I")  # noqa: E741
R = TypeVar("R")


def run_end(sizes: Sequence[int], start: int, *, max_bytes: int, max_items: int | None = None,
            keys: Sequence[Hashable] | None = None) -> int:
    """The end of the batch that starts at ``sizes[start]``: at most ``max_items`` items
    of at most ``max_bytes`` in all, and always at least one item (a larger one goes alone).
    With ``keys``, a batch also ends before an item whose key is already in it (a
    chunkserver refuses a READV with overlapping ranges: the same extent asked twice goes
    in another one)."""
    end, total = start + 1, sizes[start]
    seen = None if keys is None else {keys[start]}
    while (end < len(sizes) and (max_items is None or end - start < max_items)
           and total + sizes[end] <= max_bytes):
        if seen is not None and keys is not None:
            if keys[end] in seen:
                break
            seen.add(keys[end])
        total += sizes[end]
        end += 1
    return end


def split_batches(sizes: Sequence[int], *, max_bytes: int, max_items: int | None = None,
                  keys: Sequence[Hashable] | None = None) -> list[range]:
    """Consecutive index ranges of ``sizes``, each a batch as :func:`run_end` bounds it: the
    one splitter of a large request (APPEND, READV, CHUNK_VERIFY, the mount's moves)."""
    n = len(sizes)
    if (n > 1 and (max_items is None or n <= max_items) and sum(sizes) <= max_bytes
            and (keys is None or len(set(keys)) == n)):
        return [range(n)]  # the usual case, all in one batch: checked in C, not item by item
    out, start = [], 0
    while start < len(sizes):
        end = run_end(sizes, start, max_items=max_items, max_bytes=max_bytes, keys=keys)
        out.append(range(start, end))
        start = end
    return out


class Batcher(Generic[I, R]):
    """Concurrent single-item calls go to ``run`` together, as one list; each
    submitter gets its own result back.

    Two ways to decide when a batch goes out:

    - by time (``max_inflight=None``, the client's get/exists and fsspec
      puts): items submitted before the event loop runs again (or within
      ``window_s``) go together; a batch is sent at once when it reaches
      ``max_items`` items or ``max_bytes`` of (declared) size.
    - by load (``max_inflight=N``, the FUSE mount's reads, which reach the
      loop one request at a time and rarely share a tick): an item goes out
      at once while fewer than N batches are running; otherwise it waits,
      and what queued up goes out together (up to ``max_items`` /
      ``max_bytes`` per batch) when a batch finishes. Idle: no added
      latency; busy: batches as large as the backlog.

    By load, with ``hold`` (the FUSE mount's: whether it is still reading requests the
    kernel has queued), an item that finds a free slot waits while ``hold()`` is true, at
    most ``hold_s``, for the items those requests are about to submit; :meth:`release`
    (the mount, once it has read every queued request) sends what waits, and so does a
    full batch. Idle: no added latency; a burst of requests: one batch, not one each.

    An item may stand for several keys (a whole ``get_into`` or ``put_many``
    call): ``submit(..., count=n)`` counts it as ``n`` towards ``max_items`` in
    the by-time mode (by load, an item counts one).

    If the batched call fails, every item is retried alone, so one bad item
    cannot fail its neighbours. A submitter that is cancelled does not cancel
    the batch; with ``cancel_waits`` (items naming memory the batch writes or reads:
    ``get_into``'s buffers, ``put_many``'s values) its item is taken out if still queued,
    and otherwise its cancellation returns only once that batch has ended, so the memory
    is not touched after it.
    """

    def __init__(self, run: Callable[[list[I]], Awaitable[list[R]]], *, max_items: int,
                 max_bytes: int, window_s: float = 0.0, max_inflight: int | None = None,
                 cancel_waits: bool = False, hold: Callable[[], bool] | None = None,
                 hold_s: float = 0.0) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"Batcher: max_inflight must be at least 1, got {max_inflight}")
        if hold is not None and (max_inflight is None or hold_s <= 0):
            raise ValueError("Batcher: hold needs max_inflight and a positive hold_s")
        self._run = run
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._window_s = window_s
        self._max_inflight = max_inflight
        self._items: list[I] = []
        self._futs: list[asyncio.Future[R]] = []
        self._sizes: list[int] = []
        self._counts: list[int] = []
        self._bytes = 0
        self._count = 0
        self._handle: asyncio.Handle | asyncio.TimerHandle | None = None
        # running batches (kept referenced) and their submitters' futures
        self._tasks: dict[asyncio.Task[None], list[asyncio.Future[R]]] = {}
        self._cancel_waits = cancel_waits
        self._hold = hold
        self._hold_s = hold_s
        self.inflight = 0
        self.batches = 0

    async def submit(self, item: I, nbytes: int = 0, *, count: int = 1, eager: bool = False) -> R:
        """``eager`` (by time only): with nothing queued and no batch running, the item
        runs at once, alone, in the caller's task (no added latency or task for a call
        made alone); items submitted while it runs are batched as usual."""
        if eager and self._max_inflight is None and not self._items and not self.inflight:
            self.inflight += 1
            try:
                return (await self._run([item]))[0]
            finally:
                self.inflight -= 1
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        if (self._max_inflight is None and self._items
                and (self._count + count > self._max_items or self._bytes + nbytes > self._max_bytes)):
            self._flush()  # what is queued goes first: a batch stays within the limits
        self._items.append(item)
        self._futs.append(fut)
        self._sizes.append(nbytes)
        self._counts.append(count)
        self._bytes += nbytes
        self._count += count
        if self._max_inflight is not None:
            if (self._hold is None or self._count >= self._max_items
                    or self._bytes >= self._max_bytes or not self._hold()):
                self._pump()
            elif self._handle is None:
                self._handle = loop.call_later(self._hold_s, self.release)
        elif self._count >= self._max_items or self._bytes >= self._max_bytes:
            self._flush()
        elif self._handle is None:
            self._handle = (loop.call_later(self._window_s, self._flush) if self._window_s > 0
                            else loop.call_soon(self._flush))
        if not self._cancel_waits:
            return await fut
        try:
            return await fut
        except asyncio.CancelledError:
            await self._withdraw(fut)
            raise

    async def _withdraw(self, fut: asyncio.Future[R]) -> None:
        """A cancelled submitter's item: out of the queue, or, once sent, its batch waited
        for (cancelled again meanwhile: still waited for)."""
        for i, f in enumerate(self._futs):
            if f is fut:
                del self._items[i], self._futs[i]
                self._bytes -= self._sizes.pop(i)
                self._count -= self._counts.pop(i)
                return
        task = next((t for t, fs in self._tasks.items() if any(f is fut for f in fs)), None)
        while task is not None and not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                continue

    def _flush(self) -> None:
        """By time: everything queued goes out now."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._items:
            self._send(len(self._items))

    def release(self) -> None:
        """By load, with ``hold``: the items waiting go out (as many batches as may run;
        the rest when a batch ends)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._pump()

    def _pump(self) -> None:
        """By load: send batches from the queue while fewer than ``max_inflight`` run."""
        assert self._max_inflight is not None
        while self._items and self.inflight < self._max_inflight:
            self._send(run_end(self._sizes, 0, max_items=self._max_items, max_bytes=self._max_bytes))
        if self._handle is not None and not self._items:  # hold: none waits any more
            self._handle.cancel()
            self._handle = None

    def _send(self, n: int) -> None:
        items, futs = self._items[:n], self._futs[:n]
        del self._items[:n], self._futs[:n]
        self._bytes -= sum(self._sizes[:n])
        self._count -= sum(self._counts[:n])
        del self._sizes[:n], self._counts[:n]
        self.batches += 1
        self.inflight += 1
        task = asyncio.get_running_loop().create_task(self._complete(items, futs))
        self._tasks[task] = futs
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        del self._tasks[task]

    async def _complete(self, items: list[I], futs: list[asyncio.Future[R]]) -> None:
        try:
            await self._answer(items, futs)
        finally:
            self.inflight -= 1
            if self._max_inflight is not None:
                self._pump()

    async def _answer(self, items: list[I], futs: list[asyncio.Future[R]]) -> None:
        try:
            results = await self._run(items)
        except BaseException as exc:
            if len(items) == 1 or isinstance(exc, asyncio.CancelledError):
                for f in futs:
                    if not f.done():
                        f.set_exception(exc)
                return
            alone = await asyncio.gather(*(self._run([item]) for item in items),
                                         return_exceptions=True)
            for f, res in zip(futs, alone, strict=True):
                if f.done():
                    continue
                if isinstance(res, BaseException):
                    f.set_exception(res)
                else:
                    f.set_result(res[0])
            return
        for f, r in zip(futs, results, strict=True):
            if not f.done():
                f.set_result(r)
