"""Capacity per disk: chunkservers that share a filesystem share its space, counted once."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig
from kvfs.launcher import LocalCluster


async def _servers(kv: AsyncClient, n: int) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        servers = (await kv.stats())["servers"]
        if len(servers) == n and all(s["capacity"] for s in servers):
            return list(servers)
        assert loop.time() < deadline, servers
        await asyncio.sleep(0.05)


async def test_chunkservers_on_one_disk_count_it_once(cluster: LocalCluster,
                                                      kv: AsyncClient) -> None:
    disk = shutil.disk_usage(cluster.root)
    servers = await _servers(kv, 3)
    assert [s["shared_by"] for s in servers] == [3, 3, 3]
    assert disk.total - 3 <= sum(s["capacity"] for s in servers) <= disk.total
    assert sum(s["free"] for s in servers) <= disk.total // 3 * 3
    async with cluster.client() as other:  # gc status reads the same shares
        from kvfs.gc.driver import GarbageCollector

        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            st = await gc.status()
        assert sum(s["capacity"] for s in st["servers"]) <= disk.total
        del other


async def test_a_configured_capacity_is_not_shared(tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with LocalCluster(root, 2, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, capacity_bytes=64 << 20)) as c, c.client() as kv:
        servers = await _servers(kv, 2)
    assert [(s["capacity"], s["shared_by"]) for s in servers] == [(64 << 20, 1)] * 2
