"""Pausing GC is meta's state: it survives a restart of meta (found by the mutation pass:
no test restarted meta while GC was paused, tests/MUTATION.md)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import FakeClock

from kvfs import rpc
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


async def test_gc_daemons_take_turns_by_the_lease(tmp_path: Path, clock: FakeClock) -> None:
    """GC_CONTROL with a holder: one daemon holds the lease and renews it; another is refused
    until the lease runs out (meta's monotonic clock), then holds it and refuses the first.
    Asking without a holder takes nothing."""
    root = tmp_path / "c"
    async with LocalCluster(root, 1, clock=clock,
                            chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2)) as c, \
            GarbageCollector(c.addr, token=c.admin_token) as gc:

        async def claim(holder: str, lease_s: float = 30.0) -> bool:
            return (await gc.meta(rpc.GcControl(holder=holder, lease_s=lease_s))).granted

        assert await gc.meta(rpc.GcControl()) == rpc.GcControlled(paused=False, granted=True)
        assert await claim("a")
        assert not await claim("b")
        assert await claim("a", lease_s=0.05)  # renewed, briefly
        deadline = time.monotonic() + 30
        while not await claim("b"):  # a's lease runs out
            assert time.monotonic() < deadline, "the lease never ran out"
            await asyncio.sleep(0.02)
        assert not await claim("a")
        assert await gc.meta(rpc.GcControl()) == rpc.GcControlled(paused=False, granted=True)
