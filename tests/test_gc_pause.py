"""Pausing GC is meta's state: it survives a restart of meta (found by the mutation pass:
no test restarted meta while GC was paused, tests/MUTATION.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FakeClock

from kvfs.config import ChunkServerConfig
from kvfs.gc.driver import GarbageCollector
from kvfs.launcher import LocalCluster

pytestmark = pytest.mark.usefixtures("meta_backend")  # each test over SQLite and Redis


async def test_a_paused_gc_stays_paused_across_a_meta_restart(tmp_path: Path, clock: FakeClock) -> None:
    root = tmp_path / "c"
    async with LocalCluster(root, 1, clock=clock,
                            chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2)) as c:
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            assert await gc.set_paused(True) is True
            assert await gc.set_paused(None) is True  # None asks, changes nothing
        await c.stop_meta()
        await c.start_meta()
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            assert (await gc.status())["paused"] is True
            assert await gc.set_paused(False) is False
        await c.stop_meta()
        await c.start_meta()
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            assert (await gc.status())["paused"] is False
