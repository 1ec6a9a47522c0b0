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
    _fuse.stop_watching()  # as the mount does before it closes /dev/fuse
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


async def test_the_reader_stays_between_waits_and_goes_with_none_to_wake(
        pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader registered by a wait stays for the next one (no add and remove per wait),
    and while pyfuse3's read lock is held (a worker on its way to read); fired twice in a
    row with no wait to wake and the lock free (a request queued while every worker is busy)
    it goes, so that the loop does not wake at every turn, and the next wait registers it
    again; terminate() and stop_watching() leave none registered."""
    r, w = pipe
    loop = asyncio.get_running_loop()
    added: list[int] = []
    removed: list[int] = []
    add_reader, remove_reader = loop.add_reader, loop.remove_reader

    def counting_add(fd: int, *args: object) -> None:
        added.append(fd)
        add_reader(fd, *args)

    def counting_remove(fd: int) -> bool:
        removed.append(fd)
        return remove_reader(fd)

    monkeypatch.setattr(loop, "add_reader", counting_add)
    monkeypatch.setattr(loop, "remove_reader", counting_remove)

    async def worker() -> None:
        await _fuse._wait_readable(r)
        os.read(r, 1)  # reads the request as it wakes, as pyfuse3's worker does

    async def wait_for_one() -> None:
        task = asyncio.ensure_future(worker())
        async with asyncio.timeout(5):
            while r not in _fuse._waiting:  # registered its wait
                await asyncio.sleep(0)
        os.write(w, b"x")
        await asyncio.wait_for(task, 5)

    monkeypatch.setattr(_fuse, "_lock", None)
    await wait_for_one()
    await wait_for_one()
    assert added == [r] and removed == []  # one registration for both waits
    lock = _fuse._ReadLock()  # pyfuse3's read lock (made at its first wait)
    await lock.__aenter__()  # held: a worker is on its way to read what is queued
    os.write(w, b"y")
    for _ in range(5):  # loop turns, each firing the reader with no wait to wake
        await asyncio.sleep(0)
    assert r in _fuse._watched and removed == []
    await lock.__aexit__(None, None, None)  # free: nobody will read it
    async with asyncio.timeout(5):
        while r not in _fuse._unheard:
            await asyncio.sleep(0)
    assert r in _fuse._watched and removed == []  # once: a worker may read it next step
    async with asyncio.timeout(5):
        while r in _fuse._watched:
            await asyncio.sleep(0)
    assert removed == [r]
    os.read(r, 1)
    await wait_for_one()
    assert added == [r, r]
    _fuse._notify_closing(r)  # terminate(): no reader left on the fd
    assert r not in _fuse._watched and removed == [r, r]
    _fuse._closing.discard(r)
    await wait_for_one()
    _fuse.stop_watching()  # the session ends
    assert not _fuse._watched and removed == [r, r, r]
    assert not remove_reader(r)  # nothing registered on the loop either


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


def test_requests_are_dated_by_when_the_mount_last_found_none_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """``quiet_at``: every request the mount reads was sent by the kernel after the last time
    a worker found ``/dev/fuse`` empty (a bound however long it waited there); before any
    wait, now."""
    import time

    monkeypatch.setattr(_fuse, "_quiet_at", None)
    monkeypatch.setattr(_fuse, "_on_idle", None)
    t0 = time.monotonic()
    assert _fuse.quiet_at() >= t0  # never idle: now
    _fuse._idle()  # a wait begins: none queued
    at = _fuse.quiet_at()
    assert at >= t0 and _fuse.quiet_at() == at  # requests read from now on: sent after it
