"""The blocking client from engine threads: submit_* futures, another loop, fork()."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import pytest
from conftest import Hold, ThreadCluster
from poll import wait_child

import kvfs
from kvfs import AsyncClient, LocalProtocolError
from kvfs._loop import run
from kvfs.config import ClientConfig
from kvfs.errors import InvalidArgument
from kvfs.rpc import Op


def test_submit_from_many_threads(tcluster: ThreadCluster) -> None:
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        def worker(t: int) -> None:
            keys = [f"sub/{t}/{i}" for i in range(8)]
            vals = [os.urandom(4096 + i) for i in range(8)]
            stores = kv.submit_put_many(dict(zip(keys, vals, strict=True)))
            assert isinstance(stores, concurrent.futures.Future)
            stores.result(30)
            bufs = [bytearray(5000) for _ in keys]
            loads = kv.submit_get_into([*keys, f"sub/{t}/nope"], [*bufs, bytearray(1)])
            sizes = loads.result(30)
            assert sizes == [len(v) for v in vals] + [-1]
            assert [bytes(b[:n]) for b, n in zip(bufs, sizes, strict=False)] == vals
            assert kv.submit_exists_many(keys).result(30) == [True] * 8
            assert kv.submit_match_prefix(keys).result(30) == 8
            assert kv.submit_get_many(keys[:1]).result(30) == vals[:1]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for f in [pool.submit(worker, t) for t in range(8)]:
                f.result(60)


def test_blocking_calls_from_many_threads_get_their_own_answers_and_errors(tcluster: ThreadCluster) -> None:
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        def worker(t: int) -> None:
            keys = [f"blk/{t}/{i}".encode() for i in range(4)]
            kv.put_many({k: k * 100 for k in keys})
            for _ in range(20):
                assert kv.get_many([*keys, b"blk/none"]) == [k * 100 for k in keys] + [None]
                assert kv.exists_many(keys) == [True] * 4
                assert kv.match_prefix([*keys[:2], b"blk/none", keys[2]]) == 2
            with pytest.raises(InvalidArgument, match="empty key"):  # raised on the IO loop
                kv.get(b"")

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for f in [pool.submit(worker, t) for t in range(8)]:
                f.result(60)
        kv.close()
        with pytest.raises(LocalProtocolError, match="closed"):
            kv.get(b"blk/0/0")


def test_submit_from_the_io_thread_does_not_block(tcluster: ThreadCluster) -> None:
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        kv.put(b"io/k", b"v")
        chained: concurrent.futures.Future[concurrent.futures.Future[list[bytes | None]]] = (
            concurrent.futures.Future())

        def on_done(_: object) -> None:  # runs on the client's IO thread
            chained.set_result(kv.submit_get_many([b"io/k"]))

        kv.submit_exists_many([b"io/k"]).add_done_callback(on_done)
        assert chained.result(30).result(30) == [b"v"]
        with pytest.raises(LocalProtocolError, match="own IO loop"):  # the blocking form is refused
            asyncio.run_coroutine_threadsafe(_blocking_on_io_loop(kv), kv._loop).result(30)


async def _blocking_on_io_loop(kv: kvfs.Client) -> None:
    kv.get(b"io/k")


def test_async_client_on_a_second_loop_fails_at_once(tcluster: ThreadCluster) -> None:
    client = AsyncClient(tcluster.addr, token=tcluster.token)
    other = asyncio.new_event_loop()
    try:
        other.run_until_complete(client.open())  # connections now live on `other`
        other.run_until_complete(client.put(b"loop/k", b"v"))
        started = time.monotonic()
        with pytest.raises(LocalProtocolError, match="another event loop"):
            run(client.get_many([b"loop/k"]))
        assert time.monotonic() - started < client.config.request_timeout_s  # no hang
        # (the refused call read the key's layout from the cache: its TOUCH goes out here)
        other.run_until_complete(client.close())
        # once closed, the client follows the loop that uses it; its close() there waits for
        # nothing of the other loop's (a loop not running runs no callback: it would never end)
        started = time.monotonic()
        assert run(_get_and_close(client)) == [b"v"]
        assert time.monotonic() - started < client.config.request_timeout_s  # no hang
    finally:
        other.close()


async def _get_and_close(client: AsyncClient) -> list[bytes | None]:
    try:
        return await client.get_many([b"loop/k"])
    finally:
        await client.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_client_survives_fork(tcluster: ThreadCluster) -> None:
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        kv.put(b"fork/k", b"parent")
        assert kv.get(b"fork/k") == b"parent"
        assert kv.exists_many([b"fork/k"]) == [True]  # on a blocking socket to meta, kept
        (sock,) = kv._meta_sockets._idle
        pid = os.fork()
        if pid == 0:  # child: the IO thread is gone; the client must reconnect, not hang
            code = 1
            try:
                timer = threading.Timer(30, os._exit, (3,))  # a hang ends the child, not the test
                timer.daemon = True
                timer.start()
                kv.put(b"fork/child", b"child")
                code = 0 if kv.get_many([b"fork/k", b"fork/child"]) == [b"parent", b"child"] else 2
                if kv.match_prefix([b"fork/k", b"fork/child"]) != 2 or sock in kv._meta_sockets._idle:
                    code = 4  # not answered, or on the parent's socket
                kv.close()
            finally:
                os._exit(code)
        assert wait_child(pid) == 0
        assert kv.get(b"fork/child") == b"child"  # the parent's connections still work
        assert kv.exists_many([b"fork/child"]) == [True]
        assert kv._meta_sockets._idle == [sock]  # its own socket, left alone by the child


BIG = 32 * 1024 * 1024  # far more than the client's socket holds: an answer takes many receives


def _read_arriving(c: ThreadCluster, kv: kvfs.Client, value: bytes,
                   ) -> tuple[Hold, bytearray, Callable[[], None], Callable[[], None]]:
    """``value`` stored as b"big"; its READV held at the chunkserver.  Returns the hold, a
    buffer for it, a function that lets the READV go and returns once the answer's first
    bytes have landed in the buffer, the rest not yet received (the client's connection
    stops reading there: the answer cannot end however late the test's next step runs),
    and a function that lets the connection read on."""
    cs = c.cluster.chunkservers[0]
    assert cs is not None
    # fault injection: a small receive buffer on the client's socket (fixed before it carries
    # anything, so TCP never widens it) makes the answer arrive in many pieces
    conn = asyncio.run_coroutine_threadsafe(kv.aio._link.server_conn(cs.server_id), kv._loop).result(30)
    sock = conn._proto.transport.get_extra_info("socket")  # type: ignore[union-attr]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    kv.put(b"big", value)
    held = c.hold(cs.rpc)
    buf = bytearray(len(value))

    transport = conn._proto.transport
    assert transport is not None
    paused = threading.Event()

    def pause_once_begun() -> None:  # on the client's loop, between its receives
        if buf[:4096] == value[:4096]:
            transport.pause_reading()
            paused.set()
        else:
            kv._loop.call_later(0.0005, pause_once_begun)

    def let_go() -> None:
        held.reached_from_thread(what="the READV")
        kv._loop.call_soon_threadsafe(pause_once_begun)
        c.loop.call_soon_threadsafe(held.release)
        assert paused.wait(30), "the answer never began to land"

    def read_on() -> None:
        kv._loop.call_soon_threadsafe(transport.resume_reading)

    return held, buf, let_go, read_on


def _interrupted_get_into(kv: kvfs.Client, key: bytes, buf: bytearray, when: Callable[[], None]) -> bytes:
    """``get_into(key, buf)`` in this thread (the main one, where SIGINT is handled),
    interrupted by SIGINT sent once ``when()`` returns in another thread: it raises
    KeyboardInterrupt; then the caller reuses its buffer (a marker written, and returned)."""
    assert threading.current_thread() is threading.main_thread()

    def interrupt() -> None:
        when()
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    # SIGINT raises KeyboardInterrupt here, as at a terminal, whatever this process inherited:
    # a pytest started as a background job of a script (`cmd &`) has SIGINT ignored (POSIX
    # shells start such jobs so; Python then installs no handler), and the interrupt would
    # never come (the call then ran into its request timeout: "DID NOT RAISE")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=interrupt)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            kv.get_into([key], [buf])
        marker = b"\xa5" * len(buf)
        buf[:] = marker
    finally:
        t.join(30)
        if previous is not None:  # (None: a handler not set from Python, left as ours)
            signal.signal(signal.SIGINT, previous)
    return marker


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill()")
def test_a_blocking_get_into_interrupted_leaves_the_callers_buffer_alone(one_cs: ThreadCluster) -> None:
    """Ctrl-C (SIGINT) in a thread blocked in ``get_into`` while the answer is landing in its
    buffer: the KeyboardInterrupt is raised only once the call has ended, so a caller that
    then reuses its buffer keeps what it wrote; the connection goes on serving."""
    value = os.urandom(BIG)
    assert threading.current_thread() is threading.main_thread()  # where SIGINT is handled
    with kvfs.Client(one_cs.addr, token=one_cs.token) as kv:
        held, buf, let_go, read_on = _read_arriving(one_cs, kv, value)
        try:
            marker = _interrupted_get_into(kv, b"big", buf, let_go)
        finally:
            read_on()
            one_cs.loop.call_soon_threadsafe(held.release)
        one_cs.call(held.drained())
        assert kv.get(b"big") == value  # answered after the cancelled one, same connection
    assert buf == marker


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill()")
def test_an_interrupted_read_in_the_callers_thread_leaves_the_buffer_alone(one_cs: ThreadCluster) -> None:
    """Ctrl-C while a small get_into waits for its READV on the client's own socket (made
    in the caller's thread): KeyboardInterrupt is raised, the buffer is never written
    afterwards (the bytes are copied in only once the whole answer is in and checked), the
    socket with the unread answer is closed, and the next read is answered."""
    cs = one_cs.cluster.chunkservers[0]
    assert cs is not None
    value = os.urandom(4096)
    with kvfs.Client(one_cs.addr, token=one_cs.token) as kv:
        kv.put(b"k", value)
        assert kv.get_many([b"k"]) == [value]
        (pool,) = kv._server_sockets._pools.values()
        held = one_cs.hold(cs.rpc)
        buf = bytearray(4096)
        try:
            marker = _interrupted_get_into(kv, b"k", buf,
                                           lambda: held.reached_from_thread(what="the READV"))
            assert not pool._busy and not pool._idle  # the socket went
        finally:
            one_cs.loop.call_soon_threadsafe(held.release)
        one_cs.call(held.drained())
        assert kv.get_many([b"k"]) == [value]
    assert buf == marker


def test_a_cancelled_submit_get_into_leaves_the_callers_buffer_alone(one_cs: ThreadCluster) -> None:
    """``cancel()`` of a ``submit_get_into`` future while the answer lands in the buffer (what
    the engine plug-ins do on a timeout) returns once the call has ended: the buffer is
    the caller's again."""
    value = os.urandom(BIG)
    with kvfs.Client(one_cs.addr, token=one_cs.token) as kv:
        held, buf, let_go, read_on = _read_arriving(one_cs, kv, value)
        fut = kv.submit_get_into([b"big"], [buf])
        try:
            let_go()
            assert fut.cancel() and fut.cancelled()
            marker = b"\xa5" * BIG
            buf[:] = marker  # the caller reuses its buffer
        finally:
            read_on()
            one_cs.loop.call_soon_threadsafe(held.release)
        with pytest.raises(concurrent.futures.CancelledError):
            fut.result(0)
        one_cs.call(held.drained())
        assert kv.get(b"big") == value
        assert fut.cancel()  # already cancelled: says so again, waits for nothing
    assert buf == marker


def test_submit_futures_complete_and_fail_like_blocking_calls(tcluster: ThreadCluster) -> None:
    """A ``submit_*`` future carries the call's result or its exception, runs its done
    callbacks, and is seen by ``concurrent.futures.wait``; cancelled before the IO loop
    starts it, the call never runs."""
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        kv.put(b"fut/k", b"v")
        seen: list[object] = []
        ok = kv.submit_get_many([b"fut/k", b"fut/none"])
        ok.add_done_callback(seen.append)
        bad = kv.submit_get_many([b""])
        done, _ = concurrent.futures.wait([ok, bad], timeout=30)
        assert done == {ok, bad}
        assert ok.result() == [b"v", None] and seen == [ok]
        with pytest.raises(InvalidArgument, match="empty key"):
            bad.result()
        gate = threading.Event()
        kv._loop.call_soon_threadsafe(gate.wait, 30)  # holds the IO loop: the call waits
        try:
            late = kv.submit_delete_many([b"fut/k"])
            cancelled: list[bool] = []
            canceller = threading.Thread(target=lambda: cancelled.append(late.cancel()))
            canceller.start()
            # cancel() asks the loop to cancel, then waits for the call's end, which needs the
            # loop: free it once the canceller waits (its stack, polled with a deadline)
            deadline = time.monotonic() + 30
            while not _waiting_in(canceller, "wait_ended"):
                assert canceller.is_alive() and time.monotonic() < deadline
                threading.Event().wait(0.001)
        finally:
            gate.set()
        canceller.join(30)
        assert cancelled == [True] and late.cancelled()
        assert kv.get(b"fut/k") == b"v"  # the cancelled delete never ran
        # on a thread running an event loop (here the IO thread itself) cancel() must not
        # block: it asks for the cancellation, says False, and the future ends afterwards
        asked = kv.submit_exists_many([b"fut/k"])
        answers: concurrent.futures.Future[bool] = concurrent.futures.Future()
        kv._loop.call_soon_threadsafe(lambda: answers.set_result(asked.cancel()))
        assert answers.result(30) is False
        concurrent.futures.wait([asked], timeout=30)
        assert asked.cancelled() or asked.result() == [True]


def _waiting_in(t: threading.Thread, function: str) -> bool:
    frame = sys._current_frames().get(t.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_close_ends_calls_other_threads_have_in_flight(one_cs: ThreadCluster) -> None:
    """``close()`` while other threads are blocked in calls (a get whose READV is held at the
    chunkserver; a call that only ends when cancelled): each caller gets an answer (the get a
    miss or an error, the other an error naming the close), none waits forever."""
    cs = one_cs.cluster.chunkservers[0]
    assert cs is not None
    kv = kvfs.Client(one_cs.addr, token=one_cs.token)
    kv.put(b"k", b"v" * 4096)
    kv.aio.layout_cache.clear()
    held = one_cs.hold(cs.rpc)
    outcomes: dict[str, BaseException | object] = {}

    def call(name: str, fn: Callable[[], object]) -> None:
        try:
            outcomes[name] = fn()
        except BaseException as exc:
            outcomes[name] = exc

    never = asyncio.Event()  # fault injection: a call that never ends by itself
    threads = [threading.Thread(target=call, args=("get", lambda: kv.get(b"k"))),
               threading.Thread(target=call, args=("wait", lambda: kv._run(never.wait())))]
    try:
        for t in threads:
            t.start()
        held.reached_from_thread(what="the READV")
        kv.close()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a caller still waits after close()"
    finally:
        one_cs.loop.call_soon_threadsafe(held.release)
    assert outcomes["get"] is None or isinstance(outcomes["get"], kvfs.KVFSError), outcomes
    got = outcomes["wait"]
    assert isinstance(got, LocalProtocolError) and "closed" in str(got), got


def test_one_meta_rpc_calls_are_made_in_the_callers_thread(tcluster: ThreadCluster) -> None:
    """exists_many, match_prefix and release go out on a blocking socket to meta from the
    calling thread: they are answered while the client's IO loop is held."""
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        kv.put_many({b"own/a": b"1", b"own/b": b"2"})
        counts = kv.aio.rpc_counts
        before = dict(counts)
        gate = threading.Event()
        kv._loop.call_soon_threadsafe(gate.wait, 30)  # holds the IO loop: a hop would wait
        try:
            assert kv.exists_many([b"own/a", b"own/none", b"own/b"], lease_s=60) == [True, False, True]
            assert kv.match_prefix([b"own/a", b"own/b", b"own/none"]) == 2
            assert kv.release([b"own/a", b"own/b", b"own/none"]) == 2  # this client's leases
            assert kv.exists_many([]) == [] and kv.match_prefix([]) == 0 and kv.release([]) == 0
            with pytest.raises(InvalidArgument, match="lease_s"):  # checked before anything is sent
                kv.exists_many([b"own/a"], lease_s=-1)
        finally:
            gate.set()
        assert [counts[op] - before.get(op, 0) for op in ("EXISTS", "MATCH_PREFIX", "RELEASE")] == [1, 1, 1]
        assert len(kv._meta_sockets._idle) == 1  # one caller: one socket, reused


def test_meta_sockets_are_bounded_and_calls_past_them_take_the_io_loop(one_cs: ThreadCluster) -> None:
    """With ``meta_sockets=1``: while a match_prefix holds the one socket (held at meta),
    another thread's exists_many goes through the IO loop; no second socket is opened."""
    assert one_cs.cluster.meta is not None
    with kvfs.Client(one_cs.addr, token=one_cs.token, config=ClientConfig(meta_sockets=1)) as kv:
        kv.put(b"b/k", b"v")
        held = one_cs.hold(one_cs.cluster.meta.rpc, Op.MATCH_PREFIX)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(kv.match_prefix, [b"b/k"])
            try:
                held.reached_from_thread(lambda: not first.done(), "the lookup")
                assert len(kv._meta_sockets._busy) == 1
                assert kv.exists_many([b"b/k", b"b/none"]) == [True, False]  # the IO loop's way
                assert len(kv._meta_sockets._busy) == 1 and not kv._meta_sockets._idle
            finally:
                one_cs.loop.call_soon_threadsafe(held.release)
            assert first.result(30) == 1
    with kvfs.Client(one_cs.addr, token=one_cs.token, config=ClientConfig(meta_sockets=0)) as kv:
        assert kv.exists_many([b"b/k"]) == [True]
        assert not kv._meta_sockets._idle  # none opened
    with pytest.raises(ValueError, match="meta_sockets must be >= 0"):
        ClientConfig(meta_sockets=-1)


def test_a_lost_meta_socket_is_dropped_and_its_call_answered(tcluster: ThreadCluster) -> None:
    """A blocking socket meta closed (restarted, or its idle timeout): the call on it is
    made again through the IO loop, and the socket is not used again."""
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        kv.put(b"lost/k", b"v")
        assert kv.exists_many([b"lost/k"]) == [True]
        (sock,) = kv._meta_sockets._idle
        sock.sock.shutdown(socket.SHUT_RDWR)  # fault injection: the connection ends
        assert kv.match_prefix([b"lost/k"]) == 1
        assert sock not in kv._meta_sockets._idle and sock.sock.fileno() == -1
        assert kv.exists_many([b"lost/k"]) == [True]  # on a new socket
        assert len(kv._meta_sockets._idle) == 1


def test_a_meta_socket_meta_closed_as_idle_is_dropped_and_its_call_answered(tcluster: ThreadCluster) -> None:
    """Meta closes a pooled socket that waited past its idle timeout with an error frame
    (``_close_with``, as its idle timer does): the next call on it is not failed by that
    stale frame; it is made through the IO loop and the socket dropped."""
    assert tcluster.cluster.meta is not None
    server = tcluster.cluster.meta.rpc
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        kv.put(b"idle/k", b"v")
        assert kv.exists_many([b"idle/k"]) == [True]
        (sock,) = kv._meta_sockets._idle
        mine = sock.sock.getsockname()

        async def close_as_idle() -> None:  # fault injection: the idle timer's own close
            (conn,) = [c for c in server.connections if c.transport is not None
                       and c.transport.get_extra_info("peername") == mine]
            conn._close_with(kvfs.Unavailable("connection idle for 300.0s; closed"))

        tcluster.call(close_as_idle())
        assert kv.match_prefix([b"idle/k"]) == 1
        assert sock not in kv._meta_sockets._idle
        assert kv.exists_many([b"idle/k", b"idle/none"]) == [True, False]


def test_a_lookup_on_a_meta_socket_times_out_naming_it(one_cs: ThreadCluster) -> None:
    """A lookup held at meta past ``request_timeout_s`` raises Timeout naming the RPC and
    meta; its socket is dropped, so its late answer is never taken for another call's."""
    assert one_cs.cluster.meta is not None
    config = ClientConfig(request_timeout_s=0.5)
    with kvfs.Client(one_cs.addr, token=one_cs.token, config=config) as kv:
        kv.put(b"slow/k", b"v")
        assert kv.match_prefix([b"slow/k"]) == 1
        (sock,) = kv._meta_sockets._idle
        held = one_cs.hold(one_cs.cluster.meta.rpc, Op.EXISTS)
        try:
            with pytest.raises(kvfs.Timeout, match=r"EXISTS to .* got no answer within 0\.5s"):
                kv.exists_many([b"slow/k"])
            assert sock.sock.fileno() == -1 and not kv._meta_sockets._idle
        finally:
            one_cs.loop.call_soon_threadsafe(held.release)
        assert kv.match_prefix([b"slow/k"]) == 1  # a new socket


def test_a_timeout_meta_answers_on_a_meta_socket_is_raised_as_it_is(one_cs: ThreadCluster) -> None:
    """An error frame carrying meta's own Timeout is meta's answer, raised with meta's
    words, not taken for this socket's request timeout."""
    assert one_cs.cluster.meta is not None
    with kvfs.Client(one_cs.addr, token=one_cs.token) as kv:
        held = one_cs.hold(one_cs.cluster.meta.rpc, Op.EXISTS)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(kv.exists_many, [b"t/k"])
            try:
                held.reached_from_thread(lambda: not fut.done(), "the lookup")
                assert kv._meta_sockets._busy  # on a blocking socket
            finally:
                one_cs.loop.call_soon_threadsafe(held.release, kvfs.Timeout("meta's own deadline"))
            with pytest.raises(kvfs.Timeout, match="meta's own deadline"):
                fut.result(30)


def test_meta_errors_on_a_meta_socket_name_what_was_wrong(tcluster: ThreadCluster) -> None:
    """An error meta answers on the blocking socket is raised in the caller, naming what was
    wrong, and the socket goes on serving."""
    limit = tcluster.cluster.meta.config.max_lease_holder_chars  # type: ignore[union-attr]
    config = ClientConfig(lease_holder="h" * (limit + 1))  # the protocol allows it; meta does not
    with kvfs.Client(tcluster.addr, token=tcluster.token, config=config) as kv:
        kv.put(b"err/k", b"v")
        assert kv.exists_many([b"err/k"]) == [True]
        (sock,) = kv._meta_sockets._idle
        with pytest.raises(InvalidArgument, match="--max-lease-holder-chars"):
            kv.exists_many([b"err/k"], lease_s=5)
        assert kv.match_prefix([b"err/k"]) == 1
        assert kv._meta_sockets._idle == [sock]


@pytest.mark.parametrize("what", ["lookup, no meta socket", "lookup", "read"])
def test_close_ends_a_call_another_thread_has_in_flight_on_its_socket(one_cs: ThreadCluster, what: str) -> None:
    """``close()`` while another thread waits for an exists_many held at meta (on a blocking
    socket, or through the IO loop) or for a get_into's READV held at the chunkserver (on
    the client's own socket): the caller gets an error naming the close, at once."""
    assert one_cs.cluster.meta is not None
    cs = one_cs.cluster.chunkservers[0]
    assert cs is not None
    kv = kvfs.Client(one_cs.addr, token=one_cs.token,
                     config=ClientConfig(meta_sockets=0 if "no meta" in what else 4))
    if what == "read":
        kv.put(b"k", b"v" * 4096)
        held = one_cs.hold(cs.rpc, Op.READV)
    else:
        held = one_cs.hold(one_cs.cluster.meta.rpc, Op.EXISTS)
    outcome: list[BaseException | object] = []

    def call() -> None:
        try:
            outcome.append(kv.get_into([b"k"], [bytearray(4096)]) if what == "read"
                           else kv.exists_many([b"k"]))
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=call)
    try:
        t.start()
        held.reached_from_thread(lambda: t.is_alive(), held.op.name)
        if what == "read":
            assert any(p._busy for p in kv._server_sockets._pools.values())  # on its own socket
        kv.close()
        t.join(30)
        assert not t.is_alive(), "the caller still waits after close()"
    finally:
        one_cs.loop.call_soon_threadsafe(held.release)
    (got,) = outcome
    assert isinstance(got, LocalProtocolError) and "closed" in str(got), got
    with pytest.raises(LocalProtocolError, match="closed"):
        kv.match_prefix([b"k"])
