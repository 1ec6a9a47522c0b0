"""``put_many(..., if_absent=True)``: present keys are neither written nor committed, and
two writers racing on a key leave one value and no error (SQLite meta, and two meta
processes over one Redis Cluster store)."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock, value_of
from poll import until_alive

from kvfs.client import AsyncClient
from kvfs.launcher import LocalCluster, ProcessCluster, ServiceProcess
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.redis_local import LocalRedisCluster
from kvfs.meta.redis_store import RedisMetaStore
from kvfs.rpc import Op

# the tests through a cluster run over both meta backends; the Redis store's own once
both_backends = pytest.mark.usefixtures("meta_backend")

NOW = 1_800_000_000.0


def written_bytes(c: LocalCluster) -> int:
    """Bytes appended to every chunkserver's chunks (their own count, not a heartbeat's)."""
    return sum(sum(cs.store.sizes.values()) for cs in c.chunkservers if cs is not None)


@both_backends
async def test_present_keys_are_not_written(cluster: LocalCluster, kv: AsyncClient,
                                            clock: FakeClock) -> None:
    old = {f"p{i}": value_of(f"p{i}") for i in range(4)}
    await kv.put_many(old)
    before, sent = written_bytes(cluster), dict(kv.rpc_counts)
    new = {**{k: b"N" * 4096 for k in old}, "fresh0": value_of("fresh0"), "fresh1": value_of("fresh1")}
    assert await kv.put_many(new, if_absent=True) == [False] * 4 + [True, True]
    assert await kv.get_many([*old, "fresh0", "fresh1"]) == [*old.values(), value_of("fresh0"),
                                                            value_of("fresh1")]
    # only the two absent values reached a chunkserver: 2 x (4 KiB + record header + key)
    grew = written_bytes(cluster) - before
    assert 2 * 4096 < grew < 2 * 4096 + 2 * 200
    assert kv.rpc_counts["EXISTS"] == sent.get("EXISTS", 0) + 1
    assert kv.rpc_counts["COMMIT"] == sent.get("COMMIT", 0) + 1
    # all present: the EXISTS alone, no APPEND and no COMMIT
    sent = dict(kv.rpc_counts)
    assert await kv.put_many(new, if_absent=True) == [False] * 6
    assert kv.rpc_counts["APPEND"] == sent["APPEND"] and kv.rpc_counts["COMMIT"] == sent["COMMIT"]
    # an expired key is absent; a repeated key is written once (its first value)
    await kv.put("short", b"s1", ttl=5)
    clock.advance(6)
    assert await kv.put_many([("short", b"s2"), ("twice", b"t1"), ("twice", b"t2")],
                             if_absent=True) == [True, True, False]
    assert await kv.get_many(["short", "twice"]) == [b"s2", b"t1"]
    assert await kv.put("short", b"s3", if_absent=True) is False
    assert await kv.put("short", b"s3") is True  # without if_absent: an overwrite
    assert await kv.put_many([], if_absent=True) == []


def commit_barrier(c: LocalCluster, n: int) -> asyncio.Event:
    """Meta applies no COMMIT until ``n`` have arrived (so every writer passed its EXISTS
    check and appended before any commits); then each runs in arrival order.  Returns an
    event set when the ``n``-th arrived."""
    assert c.meta is not None
    handlers = c.meta.rpc.handlers
    inner: Callable[..., Awaitable[Any]]
    inner, request_type = handlers[int(Op.COMMIT)]
    all_in = asyncio.Event()
    arrived = 0

    async def held(*args: Any) -> Any:
        nonlocal arrived
        arrived += 1
        if arrived >= n:
            all_in.set()
        await all_in.wait()
        return await inner(*args)

    handlers[int(Op.COMMIT)] = (held, request_type)
    return all_in


@both_backends
async def test_two_writers_racing_leave_one_value_and_no_error(cluster: LocalCluster,
                                                               clock: FakeClock) -> None:
    keys = [f"race{i}" for i in range(32)]
    async with cluster.client() as a, cluster.client() as b:
        await a.put_many({k: value_of(k + "old") for k in keys[:8]})  # some already there
        all_in = commit_barrier(cluster, 2)
        got_a, got_b = await asyncio.wait_for(asyncio.gather(
            a.put_many([(k, value_of(k + "a")) for k in keys], if_absent=True),
            b.put_many([(k, value_of(k + "b")) for k in keys], if_absent=True)), 30)
        assert all_in.is_set()  # both commits were in flight together: a real race
        async with cluster.client() as r:
            stored = await r.get_many(keys)
    assert got_a[:8] == got_b[:8] == [False] * 8
    for k, wa, wb, v in zip(keys, got_a, got_b, stored, strict=True):
        if k in keys[:8]:
            assert v == value_of(k + "old")
        else:  # exactly one writer stored it, and its value is the one read back
            assert wa != wb, k
            assert v == value_of(k + ("a" if wa else "b")), k
    assert sum(got_a) + sum(got_b) == 24


def answers_lost(c: LocalCluster, op: Op, n: int = 1) -> list[int]:
    """Fault injection: meta applies the first ``n`` requests of ``op``, then drops the
    connection each came on before answering (a meta failing over, or a network cut, after
    its commit): the client sees the connection lost and sends the request again on a new
    one.  Returns a list that grows by one per request lost this way."""
    assert c.meta is not None
    rpc_server = c.meta.rpc
    inner: Callable[..., Awaitable[Any]]
    inner, request_type = rpc_server.handlers[int(op)]
    lost: list[int] = []

    async def applied_then_cut(*args: Any) -> Any:
        answer = await inner(*args)
        if len(lost) < n:
            lost.append(1)
            for conn in list(rpc_server.connections):
                if conn.role is not None and conn.role.value == "client" and conn.transport:
                    conn.transport.abort()  # the answer is never sent
        return answer

    rpc_server.handlers[int(op)] = (applied_then_cut, request_type)
    return lost


@both_backends
async def test_a_commit_sent_again_reports_the_keys_it_committed_as_written(
        cluster: LocalCluster, kv: AsyncClient) -> None:
    """An if_absent COMMIT that meta applied but whose answer was lost is sent again (a new
    connection): the keys the first try committed are present by then, yet they hold this
    call's values: reported written (True), not "already present"; the keys really present
    before stay False; one copy of each value is referenced, nothing else is.  Once with
    one-extent values (packed COMMIT), once with a striped one among them."""
    await kv.put("before", value_of("before-old"))
    for rnd, big in ((0, 0), (1, 3 * 1024 * 1024)):
        sizes = {"before": 4096, f"again{rnd}a": 4096, f"again{rnd}b": big or 4096}
        before = written_bytes(cluster)
        lost = answers_lost(cluster, Op.COMMIT)
        got = await asyncio.wait_for(kv.put_many(
            [(k, value_of(k, n)) for k, n in sizes.items()], if_absent=True), 30)
        assert lost == [1]  # the first COMMIT's answer was lost: it was sent again
        assert got == [False, True, True]
        async with cluster.client() as other:
            assert await other.get_many(list(sizes)) == [
                value_of("before-old"), *(value_of(k, n) for k, n in list(sizes.items())[1:])]
            # each new value was appended once, and that copy is what meta references
            grew = written_bytes(cluster) - before
            new = 4096 + (big or 4096)
            assert new < grew < new + 8 * 200
            for k in list(sizes)[1:]:
                assert await other.layout(k) == kv.layout_cache.get_many([k.encode()], 0.0)[0][0]


def lay(chunk: int, expires_at: float | None = None) -> Layout:
    return Layout(10, 7, NOW, expires_at, (Extent(10, 9, (Replica(1, chunk, 0),)),))


@pytest.mark.redis
async def test_redis_store_commit_if_absent(redis_store: RedisMetaStore) -> None:
    await redis_store.commit([(b"a", lay(1))], NOW)
    await redis_store.commit([(b"e", lay(2, NOW + 1))], NOW)
    rows = [(b"a", lay(3)), (b"e", lay(4)), (b"n", lay(5)), (b"n", lay(6))]
    assert await redis_store.commit(rows, NOW + 2, if_absent=True) == [0, 3]
    assert await redis_store.peek([b"a", b"e", b"n"], NOW + 2) == [lay(1), lay(4), lay(5)]
    assert set(await redis_store.chunk_live()) == {1, 4, 5}  # the kept values' bytes only
    assert await redis_store.commit([(b"a", lay(7))], NOW + 2) == []  # plain: an overwrite
    assert await redis_store.peek([b"a"], NOW + 2) == [lay(7)]


@pytest.mark.redis
async def test_writers_on_two_metas_racing_leave_one_value(tmp_path: Path,
                                                           redis_cluster: LocalRedisCluster) -> None:
    """Real processes: two ``kvfs meta`` over one Redis store, a client on each, the same
    keys put ``if_absent`` at once, several rounds."""
    # (duplicates: test_meta_shared's two-metas setup; each test owns its processes' lifetimes)
    ns = "r" + uuid.uuid4().hex[:10]
    store = ("--store", redis_cluster.url, "--store-namespace", ns)
    c = ProcessCluster(tmp_path / "c", 2, listen="127.0.0.1:0", meta_args=store)
    await c.start()
    meta2 = ServiceProcess("meta 2", [sys.executable, "-m", "kvfs", "meta", "--data", str(tmp_path / "meta2"),
                                      "--listen", "127.0.0.1:0", *store], c.env)
    try:
        addr2 = (await meta2.start()).split()[-1]
        async with AsyncClient(c.addr, token=c.token) as a, AsyncClient(addr2, token=c.token) as b:
            await until_alive(b, 2, "meta 2")
            for rnd in range(5):
                keys = [f"r{rnd}/{i}" for i in range(64)]
                got_a, got_b = await asyncio.gather(
                    a.put_many([(k, value_of(k + "a")) for k in keys], if_absent=True),
                    b.put_many([(k, value_of(k + "b")) for k in keys], if_absent=True))
                stored = await b.get_many(keys)
                for k, wa, wb, v in zip(keys, got_a, got_b, stored, strict=True):
                    assert wa != wb, k
                    assert v == value_of(k + ("a" if wa else "b")), k
                assert await a.put_many([(k, b"x") for k in keys], if_absent=True) == [False] * 64
    finally:
        await meta2.stop()
        await c.stop()


@both_backends
async def test_a_shared_commit_lost_twice_reports_its_keys_written_on_each_calls_retry(
        cluster: LocalCluster, kv: AsyncClient) -> None:
    """Concurrent if_absent put_many calls share one put (one COMMIT).  When meta applies it
    and its answer is lost, and the COMMIT sent again loses its answer too, the shared put
    fails and each call is retried alone: its EXISTS finds the keys the shared COMMIT
    stored.  Those holding the shared put's values (its extents) are reported written
    (True), not present, and are not written again; a key present before stays False.
    Once with one-extent values (packed COMMIT), once with a striped one among them."""
    for rnd, big in ((0, 0), (1, 3 * 1024 * 1024)):
        pre = {f"pre{rnd}{i}": value_of(f"pre{rnd}{i}-old") for i in range(2)}
        await kv.put_many(pre)
        a, b = f"shared{rnd}a", f"shared{rnd}b"
        # the first call runs alone (an EXISTS, all present: no COMMIT); the next two (no
        # key in common with it, or it would go first) queue behind it and share one put
        calls = [[(f"pre{rnd}0", b"new")], [(f"pre{rnd}1", b"new"), (a, value_of(a))],
                 [(b, value_of(b, big or 4096))]]
        lost = answers_lost(cluster, Op.COMMIT, 2)
        before = written_bytes(cluster)
        got = await asyncio.wait_for(asyncio.gather(
            *(kv.put_many(c, if_absent=True) for c in calls)), 30)
        assert lost == [1, 1]  # the shared COMMIT's answer lost twice: that put failed
        assert got == [[False], [False, True], [True]]
        async with cluster.client() as other:
            assert await other.get_many([*pre, a, b]) == [
                *pre.values(), value_of(a), value_of(b, big or 4096)]
            new = 4096 + (big or 4096)
            assert new < written_bytes(cluster) - before < new + 8 * 200  # appended once
            for k in (a, b):
                assert await other.layout(k) == kv.layout_cache.get_many([k.encode()], 0.0)[0][0]
