"""The client batcher coalesces concurrent single-key calls (counted in RPCs, not timed)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

from kvfs.client import AsyncClient
from kvfs.config import ClientConfig
from kvfs.launcher import LocalCluster


def _readv_calls(cluster: LocalCluster) -> int:
    return sum(cs.readv_calls for cs in cluster.chunkservers if cs is not None)


async def test_128_concurrent_gets_share_rpcs(cluster: LocalCluster, kv: AsyncClient) -> None:
    items = {f"b{i}".encode(): os.urandom(4096) for i in range(128)}
    await kv.put_many(items)
    kv.layout_cache.clear()
    lookups, readvs = kv.rpc_counts["LOOKUP"], _readv_calls(cluster)
    got = await asyncio.gather(*(kv.get(k) for k in items))
    assert got == list(items.values())
    assert kv.rpc_counts["LOOKUP"] - lookups == 1
    assert _readv_calls(cluster) - readvs == 1  # one put_many -> one server -> one readv


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
