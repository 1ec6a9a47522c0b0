"""Coalescing concurrent single-item calls into one batched call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

I = TypeVar("I")  # noqa: E741
R = TypeVar("R")


class Batcher(Generic[I, R]):
    """Items submitted before the event loop runs again (or within ``window_s``) go to
    ``run`` together, as one list; each submitter gets its own result back.

    A batch is sent at once when it reaches ``max_items`` items or ``max_bytes`` of
    (declared) size.  If the batched call fails, every item is retried alone, so one
    bad item cannot fail its neighbours.  A submitter that is cancelled does not
    cancel the batch.
    """

    def __init__(self, run: Callable[[list[I]], Awaitable[list[R]]], *, max_items: int,
                 max_bytes: int, window_s: float = 0.0) -> None:
        self._run = run
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._window_s = window_s
        self._items: list[I] = []
        self._futs: list[asyncio.Future[R]] = []
        self._bytes = 0
        self._handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # keep running batches referenced
        self.batches = 0

    async def submit(self, item: I, nbytes: int = 0) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._items.append(item)
        self._futs.append(fut)
        self._bytes += nbytes
        if len(self._items) >= self._max_items or self._bytes >= self._max_bytes:
            self._flush()
        elif self._handle is None:
            self._handle = (loop.call_later(self._window_s, self._flush) if self._window_s > 0
                            else loop.call_soon(self._flush))
        return await fut

    def _flush(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if not self._items:
            return
        items, futs = self._items, self._futs
        self._items, self._futs, self._bytes = [], [], 0
        self.batches += 1
        task = asyncio.get_running_loop().create_task(self._complete(items, futs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _complete(self, items: list[I], futs: list[asyncio.Future[R]]) -> None:
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


def byte_batches(sizes: Sequence[int], limit: int) -> list[range]:
    """Consecutive runs of items whose sizes add up to at most ``limit`` bytes (an item
    larger than ``limit`` is a run of its own): how a large APPEND, READV or CHUNK_VERIFY
    is split into RPCs."""
    out: list[range] = []
    i, n = 0, len(sizes)
    while i < n:
        j, total = i, 0
        while j < n and (j == i or total + sizes[j] <= limit):
            total += sizes[j]
            j += 1
        out.append(range(i, j))
        i = j
    return out
