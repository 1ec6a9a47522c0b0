"""The client batcher coalesces concurrent single-key calls (counted in RPCs, not timed)."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

import kvfs
from kvfs.buffers import Source
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig
from kvfs.errors import Unavailable
from kvfs.launcher import LocalCluster
from kvfs.writepath import _listed
from tests.conftest import ThreadCluster, readv_calls


async def test_128_concurrent_gets_share_rpcs(cluster: LocalCluster, kv: AsyncClient) -> None:
    items = {f"b{i}".encode(): os.urandom(4096) for i in range(128)}
    await kv.put_many(items)
    kv.layout_cache.clear()
    lookups, readvs = kv.rpc_counts["LOOKUP"], readv_calls(cluster)
    got = await asyncio.gather(*(kv.get(k) for k in items))
    assert got == list(items.values())
    assert kv.rpc_counts["LOOKUP"] - lookups == 1
    assert readv_calls(cluster) - readvs == 1  # one put_many -> one server -> one readv


async def test_batch_is_flushed_at_max_keys(cluster: LocalCluster) -> None:
    cfg = replace(ClientConfig(), batch_max_keys=32)
    async with cluster.client(cfg) as kv:
        await kv.put_many({f"m{i}".encode(): b"v" for i in range(100)})
        kv.layout_cache.clear()
        before = kv.get_batches
        await asyncio.gather(*(kv.get(f"m{i}") for i in range(100)))
        assert kv.get_batches - before == 4  # 32 + 32 + 32 + 4


async def test_batcher_disabled_sends_one_rpc_per_get(cluster: LocalCluster) -> None:
    async with cluster.client(replace(ClientConfig(), batch=False)) as kv:
        await kv.put_many({f"d{i}".encode(): b"v" for i in range(16)})
        kv.layout_cache.clear()
        before = kv.rpc_counts["LOOKUP"]
        await asyncio.gather(*(kv.get(f"d{i}") for i in range(16)))
        assert kv.rpc_counts["LOOKUP"] - before == 16


async def test_one_bad_key_does_not_fail_its_batch(kv: AsyncClient) -> None:
    await kv.put(b"good", b"v")
    results = await asyncio.gather(kv.get(b"good"), kv.get(b"x" * 2000), kv.get(b"miss"),
                                   return_exceptions=True)
    assert results[0] == b"v" and results[2] is None
    assert isinstance(results[1], ValueError)


async def test_concurrent_exists_are_batched(kv: AsyncClient) -> None:
    await kv.put(b"e1", b"v")
    before = kv.rpc_counts["EXISTS"]
    assert await asyncio.gather(kv.exists(b"e1"), kv.exists(b"e2")) == [True, False]
    assert kv.rpc_counts["EXISTS"] - before == 1


# -- whole get_into / put_many calls coalesced (issue 12 item 8) ---------------------------------
# A call made while nothing is queued or running goes at once, alone (no added latency for a
# lone caller); the calls made while it runs share one batch.  So N concurrent calls of one
# tick cost 2 rounds of RPCs: the first call's, and everyone else's.
def _val(i: int, n: int = 4096) -> bytes:
    return bytes([i % 251]) * n


async def test_concurrent_get_into_calls_share_rpcs(cluster: LocalCluster, kv: AsyncClient) -> None:
    items = {f"gi{i}".encode(): _val(i) for i in range(32)}
    await kv.put_many(items)
    kv.layout_cache.clear()
    keys = list(items)
    bufs = [bytearray(4096) for _ in keys]
    lookups, readvs = kv.rpc_counts["LOOKUP"], readv_calls(cluster)
    calls = [kv.get_into(keys[i : i + 2], bufs[i : i + 2]) for i in range(0, 32, 2)]
    results = await asyncio.gather(*calls)
    assert results == [[4096, 4096]] * 16
    assert [bytes(b) for b in bufs] == list(items.values())
    assert kv.rpc_counts["LOOKUP"] - lookups == 2  # 16 calls: the first alone, 15 in one
    assert readv_calls(cluster) - readvs == 2  # one server holds them all: a readv each


async def test_coalesced_get_into_calls_keep_their_own_results(kv: AsyncClient) -> None:
    await kv.put_many({b"r-big": _val(1, 8192), b"r-ok": _val(2), b"r-dup": _val(3)})
    kv.layout_cache.clear()
    small, ok = bytearray(4096), bytearray(4096)
    miss, dup1, dup2 = bytearray(16), bytearray(4096), bytearray(4096)
    halves = [memoryview(dup2)[:100], memoryview(dup2)[100:]]
    lookups = kv.rpc_counts["LOOKUP"]
    first, a, b, c, d = await asyncio.gather(
        kv.get_into([b"r-ok"], [bytearray(4096)]),  # goes alone: the four below share a batch
        kv.get_into([b"r-big", b"r-ok"], [small, ok]),  # one too-small buffer, one good
        kv.get_into([b"r-none"], [miss]),
        kv.get_into([b"r-dup"], [dup1]),
        kv.get_into([b"r-dup"], [halves]))  # the same key, another call, scattered
    assert first == [4096]
    assert a == [kvfs.TOO_SMALL, 4096] and b == [kvfs.MISS] and c == [4096] and d == [4096]
    assert bytes(small) == bytes(4096) and bytes(ok) == _val(2)
    assert bytes(dup1) == bytes(dup2) == _val(3) and bytes(miss) == bytes(16)
    assert kv.rpc_counts["LOOKUP"] - lookups == 2


async def test_coalesced_get_into_reads_once_per_lease(kv: AsyncClient) -> None:
    await kv.put_many({b"l1": _val(1), b"l2": _val(2), b"l3": _val(3)})
    kv.layout_cache.clear()
    bufs = [bytearray(4096) for _ in range(3)]
    lookups = kv.rpc_counts["LOOKUP"]
    got = await asyncio.gather(kv.get_into([b"l-none"], [bytearray(4096)]),  # alone, at once
                               kv.get_into([b"l1"], [bufs[0]], lease_s=30),
                               kv.get_into([b"l2"], [bufs[1]]),
                               kv.get_into([b"l3"], [bufs[2]], lease_s=30))
    assert got == [[kvfs.MISS]] + [[4096]] * 3
    assert [bytes(b) for b in bufs] == [_val(1), _val(2), _val(3)]
    assert kv.rpc_counts["LOOKUP"] - lookups == 3  # the first; then the leased two, the other
    assert await kv.release([b"l1", b"l2", b"l3"]) == 2


async def test_concurrent_put_many_calls_share_rpcs(kv: AsyncClient) -> None:
    appends, commits = kv.rpc_counts["APPEND"], kv.rpc_counts["COMMIT"]
    items = [{f"pm{i}a".encode(): _val(i), f"pm{i}b".encode(): _val(i + 100)} for i in range(16)]
    assert await asyncio.gather(*(kv.put_many(it) for it in items)) == [[True, True]] * 16
    assert kv.rpc_counts["COMMIT"] - commits == 2  # 16 calls: the first alone, 15 in one
    assert kv.rpc_counts["APPEND"] - appends == 2  # 120 KiB: one run on one server
    kv.layout_cache.clear()
    merged = {k: v for it in items for k, v in it.items()}
    assert await kv.get_many(list(merged)) == list(merged.values())


async def test_puts_with_other_options_or_the_same_key_are_not_merged(kv: AsyncClient) -> None:
    commits = kv.rpc_counts["COMMIT"]
    await asyncio.gather(kv.put_many({b"o1": b"a"}, ttl=600), kv.put_many({b"o2": b"b"}),
                         kv.put_many({b"o3": b"c"}, replicas=2))
    assert kv.rpc_counts["COMMIT"] - commits == 3
    commits = kv.rpc_counts["COMMIT"]
    await asyncio.gather(kv.put_many({b"same": b"first"}), kv.put_many({b"same": b"second"}))
    assert kv.rpc_counts["COMMIT"] - commits == 2  # one after another, in call order
    kv.layout_cache.clear()
    assert await kv.get(b"same") == b"second"
    commits = kv.rpc_counts["COMMIT"]
    stored = await asyncio.gather(kv.put_many({b"ia-0": b"0"}, if_absent=True),
                                  kv.put_many({b"same": b"third"}, if_absent=True),
                                  kv.put_many({b"ia-new": b"x"}, if_absent=True))
    assert stored == [[True], [False], [True]]  # the last two merged, each its own answer
    assert await kv.get(b"same") == b"second" and await kv.get(b"ia-new") == b"x"
    assert kv.rpc_counts["COMMIT"] - commits == 2


async def test_coalesced_puts_keep_each_keys_meta(kv: AsyncClient) -> None:
    commits = kv.rpc_counts["COMMIT"]
    await asyncio.gather(kv.put_many({b"m-0": b"0"}),  # alone, at once
                         kv.put_many({b"m-a": b"1", b"m-b": b"2"}, meta=[{"layer": 1}, None]),
                         kv.put_many({b"m-c": b"3"}),
                         kv.put_many({b"m-d": b"4"}, meta=[{"dtype": "bf16"}]))
    assert kv.rpc_counts["COMMIT"] - commits == 2
    kv.layout_cache.clear()
    assert await kv.get_meta([b"m-a", b"m-b", b"m-c", b"m-d"]) == [{"layer": 1}, {}, {},
                                                                   {"dtype": "bf16"}]


async def test_a_failed_shared_put_fails_only_its_own_call(kv: AsyncClient,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    real = kv.writer.put

    async def refuse_bad(keys: list[bytes], views: list[Source], **kw: Any) -> Any:
        if b"bad" in keys:  # fault injection: this key's write always fails
            raise Unavailable("injected: no server takes key bad")
        return await real(keys, views, **kw)

    monkeypatch.setattr(kv.writer, "put", refuse_bad)
    commits = kv.rpc_counts["COMMIT"]
    results = await asyncio.gather(kv.put_many({b"n0": b"0"}), kv.put_many({b"n1": b"1"}),
                                   kv.put_many({b"bad": b"2"}), kv.put_many({b"n3": b"3", b"n4": b"4"}),
                                   return_exceptions=True)
    assert results[0] == [True] and results[1] == [True] and results[3] == [True, True]
    assert isinstance(results[2], Unavailable)
    assert kv.rpc_counts["COMMIT"] - commits == 3  # n0 alone; the shared put failed: each call alone
    kv.layout_cache.clear()
    assert await kv.get_many([b"n0", b"n1", b"bad", b"n3", b"n4"]) == [b"0", b"1", None, b"3", b"4"]


async def test_calls_of_a_whole_batch_go_alone(cluster: LocalCluster) -> None:
    # (the client's group commit off: each put's own COMMIT counted; tests/test_commit_group.py)
    async with cluster.client(replace(ClientConfig(), batch_max_keys=4, commit_group_bytes=0)) as kv:
        commits = kv.rpc_counts["COMMIT"]
        await asyncio.gather(*(kv.put_many({f"w{i}{j}".encode(): b"v" for j in range(4)})
                               for i in range(3)))
        assert kv.rpc_counts["COMMIT"] - commits == 3
        commits = kv.rpc_counts["COMMIT"]
        await asyncio.gather(*(kv.put_many({f"s{i}{j}".encode(): b"v" for j in range(2)})
                               for i in range(4)))
        assert kv.rpc_counts["COMMIT"] - commits == 3  # the first alone; 2 + 2 keys; 2: at most 4 a batch


async def test_coalescing_off(cluster: LocalCluster) -> None:
    async with cluster.client(replace(ClientConfig(), batch=False, commit_group_bytes=0)) as kv:
        commits = kv.rpc_counts["COMMIT"]
        await asyncio.gather(*(kv.put_many({f"f{i}".encode(): b"v"}) for i in range(4)))
        assert kv.rpc_counts["COMMIT"] - commits == 4


def test_get_into_and_put_many_from_threads_share_batches(tcluster: ThreadCluster) -> None:
    """Calls from 8 threads through the blocking client, queued while its IO loop is held
    (so they reach it in one tick), go out as one batch each way."""
    with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:
        gate = threading.Event()
        kv._loop.call_soon_threadsafe(gate.wait, 30)  # holds the IO loop: calls queue up
        with ThreadPoolExecutor(8) as pool:
            puts = list(pool.map(lambda t: kv.submit_put_many({f"th{t}".encode(): _val(t)}), range(8)))
        commits = kv.aio.rpc_counts["COMMIT"]
        gate.set()
        assert [f.result(30) for f in puts] == [[True]] * 8
        assert kv.aio.rpc_counts["COMMIT"] - commits == 2  # the first alone, seven in one
        kv.aio.layout_cache.clear()
        bufs = [bytearray(4096) for _ in range(8)]
        gate.clear()
        kv._loop.call_soon_threadsafe(gate.wait, 30)
        with ThreadPoolExecutor(8) as pool:
            gets = list(pool.map(lambda t: kv.submit_get_into([f"th{t}".encode()], [bufs[t]]), range(8)))
        lookups = kv.aio.rpc_counts["LOOKUP"]
        gate.set()
        assert [f.result(30) for f in gets] == [[4096]] * 8
        assert kv.aio.rpc_counts["LOOKUP"] - lookups == 2
        assert [bytes(b) for b in bufs] == [_val(t) for t in range(8)]


async def test_puts_of_one_key_commit_in_call_order_even_when_the_first_is_slow(
        kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone put runs at once in its caller's task; a second put of the same key made while
    it runs waits for it, even when the first is slow: the later call's value stays."""
    real = kv.writer.put
    wake, second_in, second_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow_first(keys: list[bytes], views: list[Source], **kw: Any) -> Any:
        if b"".join(_listed(views[0])) == b"first":  # fault injection: hold the first put back
            await wake.wait()  # set by the test, or by the second put starting
            if second_in.is_set():  # the second put was let through: it commits first
                await second_done.wait()
            return await real(keys, views, **kw)
        second_in.set()
        wake.set()
        try:
            return await real(keys, views, **kw)
        finally:
            second_done.set()

    monkeypatch.setattr(kv.writer, "put", slow_first)
    first = asyncio.ensure_future(kv.put_many({b"order": b"first"}))
    second = asyncio.ensure_future(kv.put_many({b"order": b"second"}))
    for _ in range(50):  # loop turns (no time passes) for the second put to start, were it let
        await asyncio.sleep(0)
    assert not second_in.is_set()
    wake.set()
    await asyncio.gather(first, second)
    kv.layout_cache.clear()
    assert await kv.get(b"order") == b"second"


async def test_a_put_that_waited_for_another_of_its_key_is_waited_for_in_turn(
        kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three puts of one key: the second waits for the first, and when the first ends it
    leaves the key to the second (its entry in the running-puts table is the second's now),
    so the third waits for the second: the last call's value stays, and the table empties."""
    real = kv.writer.put
    entered: list[bytes] = []
    gates = {b"1": asyncio.Event(), b"2": asyncio.Event(), b"3": asyncio.Event()}
    gates[b"3"].set()
    moved = asyncio.Event()

    async def held(keys: list[bytes], views: list[Source], **kw: Any) -> Any:
        value = b"".join(_listed(views[0]))
        entered.append(value)
        moved.set()
        await gates[value].wait()  # fault injection: each put held until the test lets it go
        return await real(keys, views, **kw)

    monkeypatch.setattr(kv.writer, "put", held)
    async with asyncio.timeout(30):
        puts = [asyncio.ensure_future(kv.put_many({b"turn": b"1"}))]
        await moved.wait()
        moved.clear()
        puts.append(asyncio.ensure_future(kv.put_many({b"turn": b"2"})))
        gates[b"1"].set()
        await moved.wait()  # the second put, once the first has ended
        assert entered == [b"1", b"2"] and puts[0].done()
        puts.append(asyncio.ensure_future(kv.put_many({b"turn": b"3"})))
        for _ in range(50):  # loop turns (no time passes) for the third put to start, were it let
            await asyncio.sleep(0)
        assert entered == [b"1", b"2"]  # the third waits for the second
        gates[b"2"].set()
        await asyncio.gather(*puts)
    assert entered == [b"1", b"2", b"3"]
    assert not kv._putting and not kv._overtaken
    kv.layout_cache.clear()
    assert await kv.get(b"turn") == b"3"


async def test_a_put_cancelled_while_waiting_for_another_of_its_key_keeps_the_call_order(
        kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three puts of one key, the second cancelled while it waits for the first: the key stays
    held until the first ends, so the third still waits for the first and its value stays
    (not the first's, committed after it)."""
    real = kv.writer.put
    entered: list[bytes] = []
    gate, moved = asyncio.Event(), asyncio.Event()

    async def held(keys: list[bytes], views: list[Source], **kw: Any) -> Any:
        value = b"".join(_listed(views[0]))
        entered.append(value)
        moved.set()
        if value == b"1":
            await gate.wait()  # fault injection: the first put held until the test lets it go
        return await real(keys, views, **kw)

    monkeypatch.setattr(kv.writer, "put", held)
    async with asyncio.timeout(30):
        first = asyncio.ensure_future(kv.put_many({b"cancel": b"1"}))
        await moved.wait()
        second = asyncio.ensure_future(kv.put_many({b"cancel": b"2"}))
        for _ in range(50):  # loop turns (no time passes): the second waits for the first
            await asyncio.sleep(0)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        third = asyncio.ensure_future(kv.put_many({b"cancel": b"3"}))
        for _ in range(50):  # loop turns for the third put to start, were it let
            await asyncio.sleep(0)
        assert entered == [b"1"]  # the third waits for the first
        gate.set()
        await asyncio.gather(first, third)
    assert entered == [b"1", b"3"]
    assert not kv._putting and not kv._overtaken
    kv.layout_cache.clear()
    assert await kv.get(b"cancel") == b"3"


async def test_a_cancelled_submitter_leaves_its_batch_with_cancel_waits() -> None:
    """``cancel_waits`` (get_into: a batch writes its callers' buffers): a submitter
    cancelled while its item is queued takes it out (it is never run); one cancelled once
    its batch is running gets its cancellation only after that batch has ended."""
    from kvfs._batch import Batcher

    ran: list[list[str]] = []
    started, gate = asyncio.Event(), asyncio.Event()

    async def run(items: list[str]) -> list[str]:
        started.set()
        await gate.wait()
        ran.append(items)
        return items

    b: Batcher[str, str] = Batcher(run, max_items=2, max_bytes=1 << 20, window_s=60.0,
                                   cancel_waits=True)
    async with asyncio.timeout(30):
        queued = asyncio.ensure_future(b.submit("x"))
        while not b._items:  # queued (the window is long: not sent)
            await asyncio.sleep(0)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        both = asyncio.gather(b.submit("y"), b.submit("z"))  # two items: sent at once
        await started.wait()
        late = asyncio.ensure_future(b.submit("w"))
        while b._count < 1:  # "w" queued behind the running batch; send it alone
            await asyncio.sleep(0)
        b._flush()
        while len(b._tasks) < 2:
            await asyncio.sleep(0)
        late.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await late
        assert ["w"] in ran  # its batch ended before its cancellation returned
        assert await both == ["y", "z"]
    assert ["x"] not in ran and all("x" not in items for items in ran)


async def test_a_cancelled_put_many_never_stores_what_its_buffer_holds_after(
        kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put_many batched with others reads its caller's buffer when its batch runs. Once its
    cancellation has returned the caller may reuse the buffer: the key must then hold the
    value it was given or nothing, never what the buffer held afterwards (that would be
    another value under this key, with a CRC to match)."""
    real = kv.writer.put
    gate, in_put = asyncio.Event(), asyncio.Event()

    async def held(keys: list[bytes], views: list[Source], **kw: Any) -> Any:
        if b"reused" in keys:
            in_put.set()
        await gate.wait()  # fault injection: every write waits here, before reading its values
        return await real(keys, views, **kw)

    monkeypatch.setattr(kv.writer, "put", held)
    buf = bytearray(b"given" * 1000)
    async with asyncio.timeout(30):
        first = asyncio.ensure_future(kv.put_many({b"first": b"x" * 100}))  # runs at once, alone
        for _ in range(5):
            await asyncio.sleep(0)
        put = asyncio.ensure_future(kv.put_many({b"reused": buf}))  # a batch of its own, held
        await in_put.wait()
        put.cancel()
        reused = asyncio.Event()

        async def caller() -> None:
            with pytest.raises(asyncio.CancelledError):
                await put
            buf[:] = b"other" * 1000  # the caller's next value, in the same buffer
            reused.set()

        owner = asyncio.ensure_future(caller())
        for _ in range(50):  # loop turns (no time passes): were the cancel not to wait, it is back
            await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, owner)
        assert reused.is_set()
        while kv._put_batcher.inflight:  # whatever write still runs ends before the check
            await asyncio.sleep(0.01)
    kv.layout_cache.clear()
    assert await kv.get(b"reused") in (None, b"given" * 1000)


async def test_by_load_with_hold_items_wait_for_release_and_go_together() -> None:
    """``hold`` (the mount: still reading queued FUSE requests): an item that could go at
    once waits while hold() is true, until release() sends everything waiting as one
    batch; a full batch goes at once; without hold() the item goes at once; and an item
    nobody releases goes after ``hold_s``."""
    from kvfs._batch import Batcher

    ran: list[list[int]] = []
    holding = [True]

    async def run(items: list[int]) -> list[int]:
        ran.append(items)
        return items

    b: Batcher[int, int] = Batcher(run, max_items=4, max_bytes=1 << 20, max_inflight=2,
                                   hold=lambda: holding[0], hold_s=60.0)
    async with asyncio.timeout(30):
        waiting = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        while len(b._items) < 3:  # all three queued, none sent (a slot is free)
            await asyncio.sleep(0)
        assert ran == [] and b.inflight == 0
        b.release()
        assert await asyncio.gather(*waiting) == [0, 1, 2]
        assert ran == [[0, 1, 2]]
        assert await asyncio.gather(*(b.submit(i) for i in range(4, 8))) == [4, 5, 6, 7]
        assert ran[1:] == [[4, 5, 6, 7]]  # full: sent without a release
        holding[0] = False
        assert await b.submit(9) == 9
        assert ran[2:] == [[9]]
    late: Batcher[int, int] = Batcher(run, max_items=4, max_bytes=1 << 20, max_inflight=2,
                                      hold=lambda: True, hold_s=0.01)
    assert await asyncio.wait_for(late.submit(10), 30) == 10  # never released: sent anyway
    with pytest.raises(ValueError):
        Batcher(run, max_items=4, max_bytes=1 << 20, hold=lambda: True, hold_s=0.01)


async def test_get_into_sends_what_get_many_sends(cluster: LocalCluster, kv: AsyncClient) -> None:
    # the bench's 4 KiB x 128, iodepth 4 read: get_into's calls may cost no more RPCs, ranges
    # or spans read than get_many's of the same keys (issue 11: get_into ran slower)
    items = {f"r{i}".encode(): os.urandom(4096) for i in range(1024)}
    for at in range(0, 1024, 256):
        await kv.put_many(dict(list(items.items())[at : at + 256]))
    keys = list(items)
    calls = [keys[q::4][:128] for q in range(4)]  # 4 calls of 128 keys, spread over the puts
    bufs = [[bytearray(4096) for _ in range(128)] for _ in calls]

    def sent() -> tuple[int, int, int, int]:
        return (kv.rpc_counts["LOOKUP"], kv.rpc_counts["TOUCH"], readv_calls(cluster),
                sum(cs.store.spans_read for cs in cluster.chunkservers if cs is not None))

    costs = []
    for api in ("get_many", "get_into", "get_many", "get_into"):
        kv.layout_cache.clear()  # each api's first pass with a cold layout cache, then warm
        for _ in range(2):
            before = sent()
            if api == "get_many":
                got = await asyncio.gather(*(kv.get_many(ks) for ks in calls))
                assert [v for vs in got for v in vs] == [items[k] for ks in calls for k in ks]
            else:
                sizes = await asyncio.gather(*(kv.get_into(ks, b) for ks, b in zip(calls, bufs, strict=True)))
                assert sizes == [[4096] * 128] * 4
                assert [bytes(x) for bs in bufs for x in bs] == [items[k] for ks in calls for k in ks]
            costs.append((api, tuple(a - b for a, b in zip(sent(), before, strict=True))))
    many = [c for api, c in costs if api == "get_many"]
    into = [c for api, c in costs if api == "get_into"]
    assert into == many, costs
    assert many[0][0] == 4 and many[1][0] == 0  # cold: a LOOKUP a call; warm: none
