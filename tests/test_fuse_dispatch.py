"""kvfs/mount/_fuse.py's wait for ``/dev/fuse``, on a pipe: a queued request is read without
a reader registered on the loop, and a wait that ``terminate()`` overtakes ends instead of
hanging (no mount needed: pyfuse3's shim functions are called directly)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from kvfs.mount import _fuse

pytestmark = pytest.mark.skipif(_fuse.pyfuse3 is None, reason="pyfuse3 is not installed")


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    _fuse._polls.pop(r, None)
    _fuse._run.pop(r, None)
    _fuse._closing.discard(r)
    yield r, w
    _fuse._polls.pop(r, None)
    _fuse._run.pop(r, None)
    _fuse._closing.discard(r)
    os.close(r)
    os.close(w)


async def test_a_queued_request_is_read_without_a_reader(pipe: tuple[int, int]) -> None:
    r, w = pipe
    loop = asyncio.get_running_loop()
    added: list[int] = []
    add_reader = loop.add_reader

    def counting_add_reader(fd: int, *args: object) -> None:
        added.append(fd)
        add_reader(fd, *args)

    loop.add_reader = counting_add_reader  # type: ignore[method-assign]
    try:
        os.write(w, b"x")  # a request already queued
        await asyncio.wait_for(_fuse._wait_readable(r), 5)
        assert added == []
        os.read(r, 1)  # none queued: the wait registers a reader and ends once one comes
        task = asyncio.ensure_future(_fuse._wait_readable(r))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not task.done()
        assert added == [r]
        os.write(w, b"y")
        await asyncio.wait_for(task, 5)
    finally:
        del loop.add_reader


async def test_queued_requests_in_a_row_yield_to_the_loop_once_in_yield_every(
        pipe: tuple[int, int]) -> None:
    """A worker that finds requests queued while another worker waits for the read lock reads
    most of them at once: it yields to the loop (as fairness asks) for the first of a run and
    then once in YIELD_EVERY; a wait that finds none queued starts the count again.  With no
    other worker waiting, every such read yields (so pyfuse3 starts no worker for the next
    request)."""
    r, w = pipe
    k = _fuse._YIELD_EVERY
    turns = 0

    async def ticker() -> None:  # one step per loop turn this task gives up
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    async def reads(n: int) -> int:
        start = turns
        for _ in range(n):
            await _fuse._wait_readable(r)
            os.read(r, 1)
        return turns - start

    tick = asyncio.ensure_future(ticker())
    lock = _fuse._ReadLock()  # pyfuse3's, as it makes it
    await lock.__aenter__()  # held by the worker reading
    try:
        os.write(w, b"x" * (2 * k))
        assert await reads(2 * k) == 2 * k  # nobody else waits for the lock: each yields
        other = asyncio.ensure_future(lock.__aenter__())  # another worker waits for it
        await asyncio.sleep(0)
        os.write(w, b"x" * (2 * k))
        assert await reads(2 * k) == 2  # the 1st and the (k+1)th
        waiting = asyncio.ensure_future(_fuse._wait_readable(r))  # none queued: a reader
        await asyncio.sleep(0)
        assert not waiting.done()
        os.write(w, b"yz")
        await asyncio.wait_for(waiting, 5)
        os.read(r, 1)
        assert await reads(1) == 1  # a new run: its first read yields again
        other.cancel()
    finally:
        tick.cancel()
        _fuse._lock = None


async def test_a_wait_overtaken_by_terminate_ends(pipe: tuple[int, int]) -> None:
    """terminate() (notify_closing) during the yield of a wait that found a request queued,
    which is then gone: the wait ends with ClosedResourceError, as a registered one does,
    instead of waiting on a reader nobody will wake."""
    r, w = pipe
    os.write(w, b"x")
    task = asyncio.ensure_future(_fuse._wait_readable(r))
    await asyncio.sleep(0)  # the wait saw the request queued and yielded
    assert not task.done()
    _fuse._notify_closing(r)
    os.read(r, 1)
    with pytest.raises(_fuse.pyfuse3.asyncio.ClosedResourceError):
        await asyncio.wait_for(task, 5)


async def test_the_read_lock_is_handed_over_in_order_and_past_cancelled_waits() -> None:
    lock = _fuse._ReadLock()
    order: list[str] = []
    release = asyncio.Event()

    async def take(name: str) -> None:
        async with lock:
            order.append(name)
            if name == "a":
                await release.wait()

    a = asyncio.ensure_future(take("a"))
    await asyncio.sleep(0)
    waiters = [asyncio.ensure_future(take(n)) for n in "bcd"]
    await asyncio.sleep(0)
    waiters[1].cancel()  # c gives up while waiting: never holds it
    await asyncio.sleep(0)
    assert order == ["a"]
    release.set()
    await asyncio.wait_for(asyncio.gather(a, waiters[0], waiters[2]), 5)
    assert waiters[1].cancelled()
    assert order == ["a", "b", "d"]
    async with lock:  # free again
        pass


async def test_a_read_lock_handed_to_a_cancelled_waiter_goes_on() -> None:
    """Cancelled just as the lock was handed to it: the next waiter gets it (no hang)."""
    lock = _fuse._ReadLock()
    await lock.__aenter__()
    b = asyncio.ensure_future(lock.__aenter__())
    got: list[str] = []

    async def c() -> None:
        async with lock:
            got.append("c")

    c_task = asyncio.ensure_future(c())
    await asyncio.sleep(0)
    await lock.__aexit__(None, None, None)  # handed to b ...
    b.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await b
    await asyncio.wait_for(c_task, 5)
    assert got == ["c"]


async def test_the_idle_callback_runs_as_a_wait_for_a_request_begins(
        pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """reading() is true from the read of a request until the next wait on /dev/fuse: the
    mount's batches of lookups and reads wait for the requests queued (--batch-hold), and
    on_idle sends them as that wait begins, with nothing queued."""
    r, w = pipe
    idle: list[bool] = []
    monkeypatch.setattr(_fuse, "_on_idle", lambda: idle.append(_fuse.reading()))
    monkeypatch.setattr(_fuse, "_reading", False)
    os.write(w, b"x")  # queued: read at once, no wait
    await asyncio.wait_for(_fuse._wait_readable(r), 5)
    assert idle == [] and _fuse.reading()
    os.read(r, 1)
    task = asyncio.ensure_future(_fuse._wait_readable(r))
    async with asyncio.timeout(5):
        while not idle:
            await asyncio.sleep(0)
    assert idle == [False] and not task.done()  # ran as the wait began, reading() false
    os.write(w, b"y")
    await asyncio.wait_for(task, 5)
    assert _fuse.reading() and idle == [False]
    _fuse._notify_closing(r)  # unmount: nothing waits for a request that never comes
    assert idle == [False, False] and not _fuse.reading()
