"""The blocking client from engine threads: submit_* futures, another loop, fork()."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time

import pytest
from conftest import ThreadCluster

import kvfs
from kvfs import AsyncClient, LocalProtocolError
from kvfs._loop import run
from kvfs.errors import InvalidArgument


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
        other.run_until_complete(client.close())
        # once closed, the client follows the loop that uses it
        assert run(_get_and_close(client)) == [b"v"]
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
        pid = os.fork()
        if pid == 0:  # child: the IO thread is gone; the client must reconnect, not hang
            code = 1
            try:
                timer = threading.Timer(30, os._exit, (3,))  # a hang ends the child, not the test
                timer.daemon = True
                timer.start()
                kv.put(b"fork/child", b"child")
                code = 0 if kv.get_many([b"fork/k", b"fork/child"]) == [b"parent", b"child"] else 2
                kv.close()
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, "forked child did not finish"
            threading.Event().wait(0.05)
        assert os.waitstatus_to_exitcode(status) == 0
        assert kv.get(b"fork/child") == b"child"  # the parent's connections still work
