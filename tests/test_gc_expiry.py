"""GC: TTL expiry sweep, restart safety, metrics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import FakeClock

from kvfs import rpc
from kvfs.client import AsyncClient
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster

pytestmark = pytest.mark.usefixtures("meta_backend")  # each test over SQLite and Redis


def du(root: Path) -> int:
    """Bytes the chunk files of every data dir take on disk (like ``du``)."""
    total = 0
    for p in root.glob("cs*/chunks/*"):
        total += os.stat(p).st_blocks * 512
    return total


def written(root: Path) -> int:
    """Bytes written to the chunk files of every data dir.  Unlike :func:`du` this leaves out
    the blocks reserved ahead of an open chunk's appends (``preallocate``, 64 MiB each): a
    compaction's copy may open a new chunk, and its reservation is not garbage left behind."""
    return sum(os.stat(p).st_size for p in root.glob("cs*/chunks/*"))


def gc_for(cluster: LocalCluster) -> GarbageCollector:
    return GarbageCollector(cluster.addr, token=cluster.admin_token)


async def test_expire_10000_keys_reclaims_disk(cluster: LocalCluster, kv: AsyncClient,
                                               clock: FakeClock) -> None:
    value = b"x" * 1000
    for b in range(10):
        await kv.put_many([(f"ttl/{b}/{i}", value) for i in range(1000)], ttl=60)
    await kv.put("keep", b"forever")
    before, before_written = du(cluster.root), written(cluster.root)
    assert before_written >= 10_000 * 1000
    clock.advance(61)
    got = await kv.get_many([f"ttl/{b}/{i}" for b in range(10) for i in range(0, 1000, 97)])
    assert got == [None] * len(got)
    async with gc_for(cluster) as gc:
        dry = await gc.run_pass(PassOptions(apply=False, grace_s=0))
        assert dry.expired_keys == 10_000 and dry.expired_bytes >= 10_000 * len(value)
        asked = await gc.meta(rpc.GcExpire(apply=False))  # a dry run counts them all at once
        assert (asked.keys, asked.bytes, asked.more) == (10_000, dry.expired_bytes, False)
        assert du(cluster.root) == before
        report = await gc.run_pass(PassOptions(apply=True, grace_s=0, expire_batch=3000))
        assert report.expired_keys == 10_000
        assert report.chunks_deleted >= 1
        status = await gc.status()
    after = written(cluster.root)
    assert after < before_written // 10, (before_written, after)
    assert await kv.get("keep") == b"forever"
    fresh = cluster.client()
    async with fresh:
        assert await fresh.get_many([f"ttl/{b}/{i}" for b in range(10) for i in range(1000)]) == [None] * 10_000
    assert status["expired_keys"] == 0
    assert status["metrics"]["keys_expired"] == 10_000
    assert status["metrics"]["bytes_expired"] == report.expired_bytes == dry.expired_bytes
    assert status["metrics"]["bytes_reclaimed"] > 0
    st = await kv.stats()
    assert st["gc"]["metrics"]["keys_expired"] == 10_000
    assert st["gc"]["last_run"]["expired_keys"] == 10_000


async def test_expired_key_never_comes_back_after_meta_restart(cluster: LocalCluster, kv: AsyncClient,
                                                               clock: FakeClock) -> None:
    await kv.put_many([(f"a{i}", b"v" * 100) for i in range(10)], ttl=5)
    await kv.put("b", b"stays")
    clock.advance(6)
    await cluster.stop_meta()
    await cluster.start_meta()  # swept nothing yet: still a miss after restart
    fresh = cluster.client()
    async with fresh:
        assert await fresh.get("a0") is None
        async with gc_for(cluster) as gc:
            r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
            assert r.expired_keys == 10
        await cluster.stop_meta()
        await cluster.start_meta()
        fresh2 = cluster.client()
        async with fresh2:
            assert await fresh2.get_many([f"a{i}" for i in range(10)]) == [None] * 10
            assert await fresh2.list("a") == []
            assert await fresh2.get("b") == b"stays"
            st = await fresh2.stats()
            assert st["keys_stored"] == 1
            assert st["gc"]["metrics"]["keys_expired"] == 10  # metrics survive a restart
