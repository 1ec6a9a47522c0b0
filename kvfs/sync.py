"""The blocking client: the async client running on a dedicated IO thread.

Every call blocks; every ``submit_*`` call returns a :class:`concurrent.futures.Future`
at once, from any thread (an engine's scheduler, a worker pool, the IO loop itself),
so engines can start loads and stores and collect them later.  A client inherited
through ``fork()`` notices in the child and reconnects there on its next call.

A blocking call that is one meta RPC (``exists_many``, ``match_prefix``, ``release``) is
made in the caller's own thread, on one of the client's few blocking sockets to meta
(:mod:`kvfs.blocking`), when one is free: the IO thread's hop costs more thread wake-ups
than such a call costs CPU.  So is the common case of ``get_many`` and ``get_into``
(cached layouts or one LOOKUP, one READV per chunkserver, small values:
:meth:`kvfs.readpath.ReadPath.fetch_now`); anything else about such a read (a server down,
a range's error, a bad CRC, striped or large values, no socket free) makes it again
through the IO thread, with the async client's failover and records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from kvfs._loop import new_event_loop
from kvfs.blocking import MetaSockets, ServerSockets
from kvfs.client import AsyncClient, KeyInfo, Value, into_call, into_dests, many_dests
from kvfs.config import ClientConfig
from kvfs.errors import LocalProtocolError
from kvfs.layout import Key, Layout, norm_keys
from kvfs.layoutcache import Flat
from kvfs.rpc import R, Request

T = TypeVar("T")
_STOPPED_POLL_S = 0.1  # an interrupted call's wait looks this often whether the IO loop stopped
_CLOSE_WAIT_S = 5.0  # close(): how long calls still running are given to end once cancelled
_CLOSED = "kvfs.Client was closed while this call was running"


class _Call:
    """One call on the IO loop: a task that runs ``coro``, keeps its outcome and wakes the
    caller the moment it ends (``_ended``, in the task's last step: no done callback a
    loop turn later, no ``concurrent.futures.Future`` chain for a blocking call)."""

    __slots__ = ("calls", "cancelled", "closing", "coro", "done", "ended", "exc", "result", "started",
                 "task")

    def __init__(self, coro: Coroutine[Any, Any, Any], calls: set[_Call]) -> None:
        self.coro = coro
        self.done = threading.Lock()  # held until the call has ended: nothing of it runs after
        self.done.acquire()
        self.task: asyncio.Task[None] | None = None
        self.cancelled = self.started = self.closing = self.ended = False
        self.calls = calls  # the client's calls not yet ended (close() ends those left)
        calls.add(self)
        self.result: Any = None
        self.exc: BaseException | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the IO loop."""
        self.task = loop.create_task(self._run())

    async def _run(self) -> None:
        if self.cancelled:  # cancelled before its first step: it never runs
            self.coro.close()
            self.exc = asyncio.CancelledError()
        else:
            self.started = True
            try:
                self.result = await self.coro
            except BaseException as exc:  # handed to the caller, raised in its thread
                self.exc = exc
        if self.closing and isinstance(self.exc, asyncio.CancelledError):
            self.exc = LocalProtocolError(_CLOSED)
        self._ended()

    def _ended(self) -> None:
        self.ended = True
        self.calls.discard(self)
        self.done.release()

    def abandon(self) -> None:
        """After the IO loop has stopped for good (nothing of the call runs any more): end
        a call that never ended, with an error naming the close."""
        if not self.ended:
            if not self.started:  # (a started one's task is left to the closed loop)
                self.coro.close()
            self.exc = LocalProtocolError(_CLOSED)
            self._ended()

    def cancel(self) -> None:
        """On the IO loop: the call stops as its async form does when cancelled (a
        ``get_into`` ends only once nothing writes its buffers)."""
        self.cancelled = True
        if self.started and self.task is not None:  # (not yet started: _run sees the flag)
            self.task.cancel()

    def close_cancel(self) -> None:
        """On the IO loop, from close(): cancelled, its caller told the client was closed."""
        self.closing = True
        self.cancel()

    def wait_ended(self, loop: asyncio.AbstractEventLoop) -> None:
        """Blocks until the call has ended, or ``loop`` has stopped (nothing of the call
        runs any more); an interrupt meanwhile (a second Ctrl-C) is held back until then,
        as the async client's cancelled ``get_into`` does."""
        held: BaseException | None = None
        while True:
            try:
                if not self.done.acquire(timeout=_STOPPED_POLL_S):
                    if loop.is_running():
                        continue
                else:
                    self.done.release()
            except BaseException as exc:
                held = held or exc
                continue
            if held is not None:
                raise held
            return

    def outcome(self) -> Any:
        """The call's result, or its exception raised (in the caller's thread)."""
        exc = self.exc
        if exc is not None:
            self.exc = None  # no cycle through the traceback
            raise exc
        return self.result


class _FutureCall(_Call):
    """A ``submit_*`` call: its outcome also goes to a :class:`_Future` (before the caller
    of ``cancel()``, waiting for the call's end, is woken)."""

    __slots__ = ("future",)
    future: _Future[Any]

    def _ended(self) -> None:
        f = self.future
        exc, self.exc = self.exc, None  # no cycle through the traceback
        if isinstance(exc, asyncio.CancelledError) and not f.done():
            concurrent.futures.Future.cancel(f)  # the base class's: no wait, this is the end
        if f.set_running_or_notify_cancel():  # False: cancelled (waiters are told now)
            if exc is None:
                f.set_result(self.result)
            else:
                f.set_exception(exc)
        self.result = None
        super()._ended()


class _Future(concurrent.futures.Future[T]):
    """What ``submit_*`` returns.  ``cancel()`` stops the call on the IO loop and returns
    once it has ended, so a cancelled ``submit_get_into`` writes no buffer afterwards (as
    the async ``get_into``'s cancellation); False if it had already finished.  Called from
    a thread running an event loop (the IO thread, or another loop through
    ``asyncio.wrap_future``), which must not block, it asks for the cancellation and
    returns False: the future stays pending until the call has ended, then ends cancelled
    (or with the result that won the race)."""

    def __init__(self, call: _FutureCall, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._call = call
        self._loop = loop

    def cancel(self) -> bool:
        if self.done():
            return self.cancelled()
        call = self._call
        try:
            self._loop.call_soon_threadsafe(call.cancel)
        except RuntimeError:  # the loop is closed: the call can no longer run
            super().cancel()
            self.set_running_or_notify_cancel()  # concurrent.futures.wait() is told too
            return True
        if _on_a_loop():
            return False
        call.wait_ended(self._loop)
        return self.cancelled()


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Client:
    """``with kvfs.Client(addr) as kv: kv.put(b"k", b"v")`` -- the async API, blocking."""

    def __init__(self, addr: str | None = None, *, token: str | None = None,
                 config: ClientConfig | None = None) -> None:
        self._fork_lock = threading.Lock()
        self._forked: list[object] = []  # the parent's loop and thread, never touched in a child
        self._calls: set[_Call] = set()  # calls started and not yet ended, from every thread
        self._closing = False
        self._start_io()
        try:
            self.aio = aio = AsyncClient(addr, token=token, config=config)
            self._run(aio.open())
        except BaseException:
            self._stop()
            raise
        cfg = aio.config
        self._meta_sockets = MetaSockets(aio.link, most=cfg.meta_sockets,
                                         connect_timeout_s=cfg.connect_timeout_s,
                                         request_timeout_s=cfg.request_timeout_s,
                                         down_for_s=cfg.down_for_s)
        self._server_sockets = ServerSockets(aio.link, most=cfg.server_sockets,
                                             connect_timeout_s=cfg.connect_timeout_s,
                                             request_timeout_s=cfg.request_timeout_s,
                                             down_for_s=cfg.down_for_s,
                                             pool_bytes=cfg.read_pool_bytes)

    def _start_io(self) -> None:
        self._pid = os.getpid()
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvfs-io", daemon=True)
        self._thread.start()

    def _after_fork(self) -> None:
        """In a child of ``fork()`` the IO thread does not exist: start a new one (the
        async client then drops the parent's connections and reconnects)."""
        with self._fork_lock:
            if self._pid != os.getpid():
                self._forked.append((self._loop, self._thread))
                self._calls = set()  # the parent's calls run in the parent only
                self._start_io()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Starts ``coro`` on the IO loop; its future is completed by the call's own task
        (one hop each way, as for a blocking call)."""
        loop = self._io_loop(coro)
        call = _FutureCall(coro, self._calls)
        fut: _Future[T] = _Future(call, loop)
        call.future = fut
        self._admit(call)
        loop.call_soon_threadsafe(call.start, loop)
        return fut

    def _io_loop(self, coro: Coroutine[Any, Any, Any]) -> asyncio.AbstractEventLoop:
        """This process's IO loop for a new call (refused once the client is closed)."""
        if self._pid != os.getpid():
            self._after_fork()
        loop = self._loop
        if loop.is_closed():
            coro.close()
            raise LocalProtocolError("kvfs.Client is closed")
        return loop

    def _admit(self, call: _Call) -> None:
        """A new call, already counted among the running ones, is refused once close() has
        begun (counted first: close() either sees it or is seen here)."""
        if self._closing:
            call.abandon()
            raise LocalProtocolError("kvfs.Client is closed")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the IO loop and blocks until it is done.  The hop is one
        ``call_soon_threadsafe`` there and one lock release back, from the call's own task
        as it ends (no ``concurrent.futures.Future``, whose condition variable and chained
        callbacks cost about as much CPU as a 128-key ``exists_many``).  Interrupted (e.g.
        KeyboardInterrupt), the call is cancelled and waited for before the interrupt is
        raised, so it writes none of the caller's buffers afterwards."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise LocalProtocolError("blocking kvfs call made on the client's own IO loop; "
                                     "use kvfs.connect() there, or a submit_* call")
        loop = self._io_loop(coro)
        call = _Call(coro, self._calls)
        self._admit(call)
        return self._wait(call, loop)

    def _here(self) -> bool:
        """Whether a call may be made in this thread, on the blocking sockets (not on the
        IO thread, where ``_run`` says why no blocking call is; refused once closed)."""
        if self._pid != os.getpid():
            self._after_fork()
        if self._closing or self._loop.is_closed():
            raise LocalProtocolError("kvfs.Client is closed")
        return threading.current_thread() is not self._thread

    def _meta(self, request: Request[R]) -> R:
        """One meta RPC, blocking: sent and answered in this thread on a free blocking
        socket (:mod:`kvfs.blocking`), else through the IO loop as every other call.
        close() meanwhile ends it with ``LocalProtocolError`` (closed)."""
        if self._here():
            answer = self._meta_sockets.call(request)
            if answer is not None:
                return answer
            if self._closing:
                raise LocalProtocolError(_CLOSED)
        return self._run(self.aio.link.call_meta(request))

    def _layouts(self, keys: list[bytes], lease_s: float | None) -> list[Layout | None]:
        """``AsyncClient.lookup`` made in this thread: the cache, then one LOOKUP (``_meta``)."""
        aio = self.aio
        out, missing, request = aio.lookup_request(keys, lease_s=lease_s)
        if request is not None:
            aio.looked_up(keys, out, missing, self._meta(request).layouts)
        return out

    def _read_here(self, keys: list[bytes], layouts: Sequence[Layout | None], dests: Sequence[Any],
                   out: list[bytes | None] | None, late: set[int],
                   flat: Sequence[Flat] | None = None) -> bool:
        """The values read in this thread (``ReadPath.fetch_now``); False: read them again
        through the IO loop, which skips the servers added to ``late`` (not answering in
        time: one wait for a hung server, not two).  close() meanwhile ends it with
        ``LocalProtocolError``."""
        if self._server_sockets.most and self.aio.reader.fetch_now(
                keys, layouts, dests, out, self._server_sockets.readvs, late, flat):
            return True
        if self._closing:
            raise LocalProtocolError(_CLOSED)
        return False

    @staticmethod
    def _wait(call: _Call, loop: asyncio.AbstractEventLoop) -> Any:
        loop.call_soon_threadsafe(call.start, loop)
        try:
            call.done.acquire()
        except BaseException:  # e.g. KeyboardInterrupt in the caller: stop the call too
            loop.call_soon_threadsafe(call.cancel)
            call.wait_ended(loop)
            raise
        return call.outcome()

    def _stop(self) -> None:
        self._closing = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        for call in list(self._calls):  # never started, or did not end when cancelled
            call.abandon()

    async def _close(self) -> None:
        """On the IO loop: the async client closed (its connections' calls fail), then the
        calls other threads still have running are cancelled and given a while to end."""
        await self.aio.close()
        me = asyncio.current_task()
        left = [c for c in list(self._calls) if c.task is not me]
        for c in left:
            c.close_cancel()
        tasks = [c.task for c in left if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)

    def close(self) -> None:
        """Closes the connections and stops the IO thread.  Calls other threads still have
        running end first: cancelled, they raise ``LocalProtocolError`` (closed)."""
        if self._pid != os.getpid():
            self._after_fork()
        if self._loop.is_closed():
            return
        self._closing = True  # calls made from now on are refused
        self._meta_sockets.close()  # and those on the blocking sockets end now
        self._server_sockets.close()
        try:
            self._wait(_Call(self._close(), self._calls), self._loop)
        finally:
            self._stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(self, key: Key, value: Value, *, ttl: float | None = None, replicas: int | None = None,
            if_absent: bool = False, meta: Mapping[str, Any] | None = None) -> bool:
        return self._run(self.aio.put(key, value, ttl=ttl, replicas=replicas, if_absent=if_absent,
                                      meta=meta))

    def put_many(self, items: Mapping[Key, Value] | Iterable[tuple[Key, Value]], *,
                 ttl: float | None = None, replicas: int | None = None,
                 if_absent: bool = False, meta: Sequence[Mapping[str, Any] | None] | None = None,
                 ) -> list[bool]:
        return self._run(self.aio.put_many(items, ttl=ttl, replicas=replicas, if_absent=if_absent,
                                           meta=meta))

    def get_meta(self, keys: Iterable[Key]) -> list[dict[str, Any] | None]:
        return self._run(self.aio.get_meta(keys))

    def get(self, key: Key) -> bytes | None:
        return self._run(self.aio.get(key))

    def get_many(self, keys: Iterable[Key], *, lease_s: float | None = None) -> list[bytes | None]:
        """In this thread when it can (see the module's doc), else through the IO loop."""
        ks = norm_keys(keys)
        if not ks:
            return []
        late: set[int] = set()
        if self._here() and self.aio.parts(ks) is None:  # (a call in parts: the IO loop's)
            cached = self.aio.cached(ks, lease_s)
            layouts, flat = cached or (self._layouts(ks, lease_s), None)
            whole = many_dests(layouts, flat)
            if whole is not None:
                out, dests = whole
                if self._read_here(ks, layouts, dests, out, late, flat):
                    return out
        return self._run(self.aio.get_many(ks, lease_s=lease_s, skip=late))

    def get_ranges(self, requests: Sequence[tuple[Key, int | None, int | None]]) -> list[bytes | None]:
        return self._run(self.aio.get_ranges(requests))

    def get_into(self, keys: Iterable[Key], buffers: Sequence[Any], *,
                 lease_s: float | None = None) -> list[int]:
        """In this thread when it can (see the module's doc), else through the IO loop."""
        ks, views, rooms = into_call(keys, buffers, lease_s)
        if not ks:
            return []
        late: set[int] = set()
        if self._here() and self.aio.parts(ks) is None:
            cached = self.aio.cached(ks, lease_s)
            layouts, flat = cached or (self._layouts(ks, lease_s), None)
            result, dests = into_dests(layouts, views, rooms, flat)
            if self._read_here(ks, layouts, dests, None, late, flat):
                return result
        return self._run(self.aio.get_into(ks, buffers, lease_s=lease_s, skip=late))

    def exists(self, key: Key) -> bool:
        return self._run(self.aio.exists(key))

    def exists_many(self, keys: Iterable[Key], *, lease_s: float | None = None) -> list[bool]:
        request = self.aio.exists_request(keys, lease_s)
        if request is None:
            return []
        if self.aio.parts(request.keys) is not None:  # in parts: through the IO loop
            return self._run(self.aio.exists_many(request.keys, lease_s=lease_s))
        return self._meta(request).exists

    def release(self, keys: Iterable[Key]) -> int:
        request = self.aio.release_request(keys)
        if request is None:
            return 0
        if self.aio.parts(request.keys) is not None:
            return self._run(self.aio.release(request.keys))
        return self._meta(request).released

    def match_prefix(self, keys: Iterable[Key], *, lease_s: float | None = None) -> int:
        request = self.aio.match_prefix_request(keys, lease_s)
        if request is None:
            return 0
        if self.aio.parts(request.keys) is not None:
            return self._run(self.aio.match_prefix(request.keys, lease_s=lease_s))
        return self._meta(request).n

    # futures: start now, collect later (from any thread) ---------------------
    def submit_put_many(self, items: Mapping[Key, Value] | Iterable[tuple[Key, Value]], *,
                        ttl: float | None = None, replicas: int | None = None,
                        if_absent: bool = False,
                        meta: Sequence[Mapping[str, Any] | None] | None = None,
                        ) -> concurrent.futures.Future[list[bool]]:
        """Start a ``put_many``; the values must stay unchanged until the future is done."""
        return self._submit(self.aio.put_many([*items.items()] if isinstance(items, Mapping)
                                              else [*items], ttl=ttl, replicas=replicas,
                                              if_absent=if_absent,
                                              meta=None if meta is None else [*meta]))

    def submit_get_meta(self, keys: Iterable[Key]) -> concurrent.futures.Future[list[dict[str, Any] | None]]:
        return self._submit(self.aio.get_meta([*keys]))

    def submit_get_many(self, keys: Iterable[Key], *, lease_s: float | None = None,
                        ) -> concurrent.futures.Future[list[bytes | None]]:
        return self._submit(self.aio.get_many([*keys], lease_s=lease_s))

    def submit_get_ranges(self, requests: Sequence[tuple[Key, int | None, int | None]],
                          ) -> concurrent.futures.Future[list[bytes | None]]:
        return self._submit(self.aio.get_ranges([*requests]))

    def submit_get_into(self, keys: Iterable[Key], buffers: Sequence[Any], *,
                        lease_s: float | None = None) -> concurrent.futures.Future[list[int]]:
        """Start a ``get_into``; the buffers must stay alive until the future is done."""
        return self._submit(self.aio.get_into([*keys], [*buffers], lease_s=lease_s))

    def submit_exists_many(self, keys: Iterable[Key], *, lease_s: float | None = None,
                           ) -> concurrent.futures.Future[list[bool]]:
        return self._submit(self.aio.exists_many([*keys], lease_s=lease_s))

    def submit_release(self, keys: Iterable[Key]) -> concurrent.futures.Future[int]:
        return self._submit(self.aio.release([*keys]))

    def submit_match_prefix(self, keys: Iterable[Key], *, lease_s: float | None = None,
                            ) -> concurrent.futures.Future[int]:
        return self._submit(self.aio.match_prefix([*keys], lease_s=lease_s))

    def submit_delete_many(self, keys: Iterable[Key]) -> concurrent.futures.Future[int]:
        return self._submit(self.aio.delete_many([*keys]))

    def delete(self, key: Key) -> bool:
        return self._run(self.aio.delete(key))

    def delete_many(self, keys: Iterable[Key]) -> int:
        return self._run(self.aio.delete_many(keys))

    def list(self, prefix: Key = b"", *, limit: int | None = None) -> list[KeyInfo]:
        return self._run(self.aio.list(prefix, limit=limit))

    def stats(self) -> dict[str, Any]:
        return self._run(self.aio.stats())

    def layout(self, key: Key) -> Layout | None:
        return self._run(self.aio.layout(key))
