"""Leases on lookups (``lease_s`` on exists_many, get_many, get_into, match_prefix) and
``release(keys)``: a leased key survives an eviction pass that removes an unleased one of
the same age; released, it goes at the next pass."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import FakeClock
from conftest import clocked_client as client

import kvfs
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.redis_store import RedisMetaStore

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
            kv.put_many([(b"s1", b"1"), (b"s2", b"2")])
            assert kv.submit_get_into([b"s1", b"nope"], [bytearray(1), bytearray(1)],
                                      lease_s=60).result() == [1, -1]
            assert kv.submit_exists_many([b"s2"], lease_s=90).result() == [True]
            assert kv.get_many([b"s2"], lease_s=10) == [b"2"]  # never shortens a lease
            assert leases == {b"s1": now + 60, b"s2": now + 90}
            assert kv.submit_release([b"s1"]).result() == 1
            assert kv.release([b"s2", b"nope"]) == 1
            assert leases == {}

    await asyncio.to_thread(work)


def lay(chunk: int) -> Layout:
    return Layout(10, 7, 1.0, None, (Extent(10, 9, (Replica(1, chunk, 0),)),))


@pytest.mark.redis
async def test_redis_store_leases_on_lookups_and_release(redis_store: RedisMetaStore) -> None:
    now = 1_800_000_000.0
    rows = [(b"a", lay(1)), (b"b", lay(2)), (b"c", lay(3)), (b"d", lay(4))]
    await redis_store.commit(rows, now)
    assert await redis_store.lookup([b"a", b"zz"], now, now + 30) == [lay(1), None]
    assert await redis_store.exists([b"b", b"zz"], now, now + 30) == [True, False]
    assert await redis_store.match_prefix([b"c", b"zz"], now, now + 30) == 1
    got = await redis_store.evict(rows, now + 1)  # only the unleased one goes
    assert [k for k, _ in got] == [b"d"]
    assert await redis_store.release([b"a", b"b", b"zz"]) == 2
    assert sorted(k for k, _ in await redis_store.evict(rows[:3], now + 1)) == [b"a", b"b"]
    assert [k for k, _ in await redis_store.evict(rows[:3], now + 31)] == [b"c"]  # its lease ended
