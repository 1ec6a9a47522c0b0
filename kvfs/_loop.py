"""Event loop helpers: uvloop when installed; a task whose failure nobody may await; a gather
that ends only once every awaitable has."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)


def retrieve(fut: asyncio.Future[Any]) -> None:
    """Done-callback of a task or future whose outcome may never be awaited (an abandoned
    request, a read-ahead nobody reads): its failure is taken here, so asyncio does not log
    "exception was never retrieved"; whoever does await it still gets the failure."""
    if not fut.cancelled():
        fut.exception()


async def gather_all(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather``, but a failure is raised only once every awaitable has ended (the
    first failure, in order): none is left running.  For reads that write into buffers a
    caller gets back (get_into's, get_many's ``bytes``): a READV still landing after the
    call failed over, or returned, could change them.  Cancelled, it cancels them all and
    returns once they have ended."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]  # (no exception among them)
