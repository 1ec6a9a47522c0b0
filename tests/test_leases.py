"""Leases on lookups (``lease_s`` on exists_many, get_many, get_into, match_prefix) and
``release(keys)``: a leased key survives an eviction pass that removes an unleased one of
the same age; released, it goes at the next pass.  Leases are per holder (each client is
one): a key stays leased while any holder's lease on it lasts, and ``release`` ends only
the caller's."""

from __future__ import annotations

import asyncio
import os
import threading
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import FakeClock, ThreadCluster
from conftest import clocked_client as client
from poll import wait_child

import kvfs
from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, ClientConfig, MetaConfig
from kvfs.errors import InvalidArgument
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.redis_store import RedisMetaStore
from kvfs.meta.storeapi import Lease
from kvfs.transport import Connection

# the tests through a cluster run over both meta backends; the Redis store's own once
both_backends = pytest.mark.usefixtures("meta_backend")

VALUE = 8 * 1024
GC = PassOptions(apply=True, grace_s=0, high=0.9, low=0.8)


async def lease_by(kv: AsyncClient, how: str, keys: list[str]) -> None:
    if how == "exists_many":
        assert await kv.exists_many(keys, lease_s=30) == [True] * len(keys)
    elif how == "get_many":
        assert await kv.get_many(keys, lease_s=30) == [b"L" * VALUE] * len(keys)
    else:
        bufs = [bytearray(VALUE) for _ in keys]
        assert await kv.get_into(keys, bufs, lease_s=30) == [VALUE] * len(keys)


@both_backends
@pytest.mark.parametrize("how", ["exists_many", "get_many", "get_into"])
async def test_leased_keys_survive_eviction_until_released(tmp_path: Path, clock: FakeClock,
                                                           how: str) -> None:
    root = tmp_path / "lease"
    c = LocalCluster(root, 1, clock=clock, chunkserver=ChunkServerConfig(
        data=root, heartbeat_interval_s=0.2, chunk_bytes=64 * 1024, capacity_bytes=512 * 1024))
    async with c, client(c, clock) as kv, GarbageCollector(c.addr, token=c.admin_token) as gc:
        leased = [f"l{i}" for i in range(10)]
        unleased = [f"u{i}" for i in range(10)]  # written with them: the same age
        await kv.put_many([(k, b"L" * VALUE) for k in leased + unleased])
        await lease_by(kv, how, leased)
        assert await kv.exists_many(unleased) == [True] * 10  # no lease asked: none taken
        clock.advance(1)
        for i in range(4):  # 320 KiB more: 480 KiB, past the 90 % watermark of 512 KiB
            await kv.put_many([(f"o{i}-{j}", b"O" * VALUE) for j in range(10)])
        clock.advance(1)
        r = await gc.run_pass(GC)
        assert r.evicted_keys >= 10 and r.leased_skipped == 10
        assert await kv.exists_many(leased) == [True] * 10  # EXISTS does not count as a read
        assert await kv.exists_many(unleased) == [False] * 10  # as old, not leased: evicted
        assert await kv.release([*leased, "o0-0"]) == 10  # well before the lease's 30 s
        assert await kv.release(leased) == 0
        clock.advance(1)
        r = await gc.run_pass(PassOptions(apply=True, grace_s=0, high=0.7, low=0.6))  # evict more
        assert r.leased_skipped == 0 and r.evicted_keys >= 10
        assert await kv.exists_many(leased) == [False] * 10  # the least recently used, now unpinned
        assert await kv.exists_many([f"o3-{j}" for j in range(10)]) == [True] * 10  # the newest


@both_backends
async def test_blocking_client_leases_and_releases(cluster: LocalCluster, meta_backend: str) -> None:
    if meta_backend == "redis":
        pytest.skip("reads MetaIndex's leases in memory; the Redis store's leases: "
                    "test_redis_store_leases_on_lookups_and_release")
    assert cluster.meta is not None
    leases = cluster.meta.index.leases  # type: ignore[union-attr]
    now = cluster.clock()

    def work() -> None:
        with kvfs.Client(cluster.addr, token=cluster.token) as kv:
            me = kv.aio.lease_holder
            kv.put_many([(b"s1", b"1"), (b"s2", b"2")])
            assert kv.submit_get_into([b"s1", b"nope"], [bytearray(1), bytearray(1)],
                                      lease_s=60).result() == [1, -1]
            assert kv.submit_exists_many([b"s2"], lease_s=90).result() == [True]
            assert kv.get_many([b"s2"], lease_s=10) == [b"2"]  # never shortens a lease
            assert {k: leases.holders(k) for k in leases} == {b"s1": {me: now + 60}, b"s2": {me: now + 90}}
            assert kv.submit_release([b"s1"]).result() == 1
            assert kv.release([b"s2", b"nope"]) == 1
            assert not leases

    await asyncio.to_thread(work)


def lay(chunk: int) -> Layout:
    return Layout(10, 7, 1.0, None, (Extent(10, 9, (Replica(1, chunk, 0),)),))


@pytest.mark.redis
async def test_redis_store_leases_on_lookups_and_release(redis_store: RedisMetaStore) -> None:
    now = 1_800_000_000.0
    rows = [(b"a", lay(1)), (b"b", lay(2)), (b"c", lay(3)), (b"d", lay(4))]
    await redis_store.commit(rows, now)
    lease = Lease("h", now + 30, 32)
    assert await redis_store.lookup([b"a", b"zz"], now, lease) == [lay(1), None]
    assert await redis_store.exists([b"b", b"zz"], now, lease) == [True, False]
    assert await redis_store.match_prefix([b"c", b"zz"], now, lease) == 1
    got = await redis_store.evict(rows, now + 1)  # only the unleased one goes
    assert [k for k, _ in got] == [b"d"]
    assert await redis_store.release([b"a", b"b", b"zz"], "other") == 0  # not its leases
    assert await redis_store.release([b"a", b"b", b"zz"], "h") == 2
    assert sorted(k for k, _ in await redis_store.evict(rows[:3], now + 1)) == [b"a", b"b"]
    assert [k for k, _ in await redis_store.evict(rows[:3], now + 31)] == [b"c"]  # its lease ended


# -- per-holder leases ------------------------------------------------------------------------
def small_cluster(root: Path, clock: FakeClock, **meta: object) -> LocalCluster:
    """One chunkserver of 512 KiB in 64 KiB chunks: 60 values of 8 KiB pass 90 % of it."""
    return LocalCluster(root, 1, clock=clock, meta=MetaConfig(data=root / "meta", listen="127.0.0.1:0",
                                                                **meta),  # type: ignore[arg-type]
                        chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2,
                                                      chunk_bytes=64 * 1024, capacity_bytes=512 * 1024))


@both_backends
async def test_a_key_leased_by_two_holders_is_evictable_only_when_both_released(
        tmp_path: Path, clock: FakeClock) -> None:
    """Two clients (two holders) lease the same keys; one releasing leaves the other's
    lease: the keys survive an eviction pass that evicts their unleased neighbours of the
    same age.  Each release counts its own leases; after the second, the keys go."""
    c = small_cluster(tmp_path / "two", clock)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(c)
        a = await stack.enter_async_context(client(c, clock))
        b = await stack.enter_async_context(client(c, clock))
        gc = await stack.enter_async_context(GarbageCollector(c.addr, token=c.admin_token))
        assert a.lease_holder != b.lease_holder  # a random holder per client
        leased = [f"l{i}" for i in range(10)]
        unleased = [f"u{i}" for i in range(10)]
        await a.put_many([(k, b"L" * VALUE) for k in leased + unleased])
        assert await a.exists_many(leased, lease_s=30) == [True] * 10
        assert await b.match_prefix(leased, lease_s=30) == 10
        assert await a.release([*leased, "u0"]) == 10  # a's leases end; b's stay
        assert await a.release(leased) == 0
        clock.advance(1)
        for i in range(4):  # past the 90 % watermark
            await a.put_many([(f"o{i}-{j}", b"O" * VALUE) for j in range(10)])
        clock.advance(1)
        r = await gc.run_pass(GC)
        assert r.evicted_keys >= 10 and r.leased_skipped == 10
        assert await a.exists_many(unleased) == [False] * 10  # the unleased neighbours went
        assert await a.exists_many(leased) == [True] * 10  # b's lease kept them
        assert await b.release(leased) == 10
        clock.advance(1)
        r = await gc.run_pass(PassOptions(apply=True, grace_s=0, high=0.7, low=0.6))
        assert r.leased_skipped == 0 and r.evicted_keys >= 10
        assert await a.exists_many(leased) == [False] * 10  # unpinned by both: evicted


@both_backends
async def test_a_holder_never_shortens_a_lease_and_holders_can_be_shared(
        tmp_path: Path, clock: FakeClock) -> None:
    """A holder's shorter lease keeps its longer one; another holder's shorter lease and
    its release leave it too.  Clients configured with one ``lease_holder`` share leases."""
    c = small_cluster(tmp_path / "short", clock)
    one = ClientConfig(lease_holder="engine-1")
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(c)
        assert c.meta is not None
        ix = c.meta.index
        a = await stack.enter_async_context(client(c, clock))
        b = await stack.enter_async_context(client(c, clock))
        w1, w2 = c.client(one), c.client(one)  # one engine's two workers
        for kv in (w1, w2):
            kv.clock = clock
            await stack.enter_async_context(kv)
        t0 = clock()
        await a.put_many([("k", b"v"), ("s", b"v")])
        assert await a.get_many(["k"], lease_s=60) == [b"v"]
        assert await a.exists_many(["k"], lease_s=5) == [True]  # never shortens a's 60 s
        assert await b.exists_many(["k"], lease_s=5) == [True]
        assert await b.release(["k"]) == 1
        clock.advance(30)
        assert await ix.leased([b"k"], clock()) == {b"k"}  # a's lease: until t0 + 60
        assert await ix.leased([b"k"], t0 + 61) == set()
        assert await w1.exists_many(["s"], lease_s=30) == [True]
        assert await w2.release(["s"]) == 1  # the same holder: w1's lease ended
        assert await ix.leased([b"s"], clock()) == set()


@both_backends
async def test_past_max_lease_holders_a_lease_pins_until_it_runs_out(
        tmp_path: Path, clock: FakeClock) -> None:
    """``max_lease_holders`` (2 here) holders' unexpired leases on a key: a third holder's
    lease goes to the overflow holder, which pins the key for the lease's time and which no
    release ends.  An expired holder's place is taken by a new one.  STATS counts the
    leases given to the overflow holder (``leases_overflowed``)."""
    c = small_cluster(tmp_path / "cap", clock, max_lease_holders=2)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(c)
        assert c.meta is not None
        ix = c.meta.index
        kvs = {}
        for h in ("h1", "h2", "h3", "h4"):
            kv = kvs[h] = c.client(ClientConfig(lease_holder=h))
            kv.clock = clock
            await stack.enter_async_context(kv)
        t0 = clock()
        await kvs["h1"].put_many([("k", b"v")])
        assert await kvs["h1"].exists_many(["k"], lease_s=10) == [True]
        assert await kvs["h2"].exists_many(["k"], lease_s=30) == [True]
        assert (await kvs["h1"].stats())["leases_overflowed"] == 0
        assert await kvs["h3"].match_prefix(["k"], lease_s=60) == 1  # past the cap: overflow
        assert await kvs["h3"].release(["k"]) == 0  # not h3's own lease
        assert await kvs["h3"].get_many(["k"], lease_s=60) == [b"v"]  # the overflow's again
        assert (await kvs["h1"].stats())["leases_overflowed"] == 2
        clock.advance(20)  # h1's lease ended: h4 takes its place
        assert await kvs["h4"].exists_many(["k"], lease_s=5) == [True]
        assert (await kvs["h1"].stats())["leases_overflowed"] == 2  # h4's was its own
        assert await kvs["h4"].release(["k"]) == 1
        assert await kvs["h2"].release(["k"]) == 1
        assert await ix.leased([b"k"], clock()) == {b"k"}  # the overflow's, until t0 + 60
        assert await ix.leased([b"k"], t0 + 59) == {b"k"}
        assert await ix.leased([b"k"], t0 + 61) == set()


async def _raw(addr: str, token: str, op: rpc.Op, header: dict[str, object]) -> object:
    host, port = parse_addr(addr)
    conn = await Connection.open(host, port, token, request_timeout_s=30)
    try:
        return await conn.call_raw(op, header)
    finally:
        conn.close()


@both_backends
async def test_the_holder_on_the_wire(cluster: LocalCluster, kv: AsyncClient) -> None:
    """A request without a holder is the shared holder's (older clients); a holder of the
    wrong type, too long for the protocol or for meta's --max-lease-holder-chars, or with
    other characters is refused naming the field, and meta keeps serving."""
    assert cluster.meta is not None
    ix = cluster.meta.index
    now = cluster.clock()
    await kv.put_many([("k", b"v")])
    await _raw(cluster.addr, cluster.token, rpc.Op.EXISTS, {"keys": [b"k"], "lease_s": 30.0})
    assert await kv.release(["k"]) == 0  # a random holder: not the shared one's lease
    assert await ix.leased([b"k"], now) == {b"k"}
    await _raw(cluster.addr, cluster.token, rpc.Op.RELEASE, {"keys": [b"k"]})
    assert await ix.leased([b"k"], now) == set()
    limit = cluster.meta.config.max_lease_holder_chars
    bad: list[tuple[object, str]] = [
        (7, "Expected `str`, got `int` - at `$.holder`"),
        (["h"], "Expected `str`, got `array` - at `$.holder`"),
        ("h" * (rpc.MAX_HOLDER_CHARS + 1), f"length <= {rpc.MAX_HOLDER_CHARS} - at `$.holder`"),
        ("h" * (limit + 1), f"longer than this meta's limit of {limit} (--max-lease-holder-chars)"),
        ("a b", "matching regex"),
        ("a\n", "matching regex"),
        ("*", "matching regex"),  # the overflow holder is no request's
    ]
    for op, header in [(rpc.Op.LOOKUP, {"keys": [b"k"], "lease_s": 1.0}),
                       (rpc.Op.EXISTS, {"keys": [b"k"], "lease_s": 1.0}),
                       (rpc.Op.MATCH_PREFIX, {"keys": [b"k"], "lease_s": 1.0}),
                       (rpc.Op.RELEASE, {"keys": [b"k"]})]:
        for holder, says in bad:
            with pytest.raises(InvalidArgument, match="holder") as exc:
                await _raw(cluster.addr, cluster.token, op, {**header, "holder": holder})
            assert says in exc.value.message, (op, holder, exc.value.message)
    assert await ix.leased([b"k"], now) == set()  # none of them leased anything
    assert await kv.exists_many(["k"], lease_s=1) == [True]  # meta still serves


def test_holder_limits_in_the_configs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lease_holder must be at most 255 of the characters"):
        ClientConfig(lease_holder="engine 1")
    with pytest.raises(ValueError, match="lease_holder"):
        ClientConfig(lease_holder="e" * 256)
    assert ClientConfig(lease_holder="").lease_holder == ""  # the shared holder, as older clients
    meta = MetaConfig(data=tmp_path)
    with pytest.raises(ValueError, match="--max-lease-holder-chars must be at most 255"):
        replace(meta, max_lease_holder_chars=256)
    with pytest.raises(ValueError, match="--max-lease-holders must be at least 1"):
        replace(meta, max_lease_holders=0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_is_another_holder(tcluster: ThreadCluster) -> None:
    """An engine process forked from one that made the client leases as itself: its
    release does not end the parent's lease."""
    addr, token = tcluster.addr, tcluster.token
    with kvfs.Client(addr, token=token) as kv:
        kv.put(b"fork/leased", b"v")
        parent = kv.aio.lease_holder
        assert kv.exists_many([b"fork/leased"], lease_s=60) == [True]
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                timer = threading.Timer(30, os._exit, (3,))  # a hang ends the child, not the test
                timer.daemon = True
                timer.start()
                other = kv.aio.lease_holder != parent
                code = 0 if other and kv.release([b"fork/leased"]) == 0 else 2
                kv.close()
            finally:
                os._exit(code)
        assert wait_child(pid) == 0
        assert kv.aio.lease_holder == parent
        assert kv.release([b"fork/leased"]) == 1  # the parent's lease was still there
