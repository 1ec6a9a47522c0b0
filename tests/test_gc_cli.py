"""`kvfs gc ...` against a cluster: dry run vs --apply, status, pause/resume, fsck, daemon."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import FakeClock

from kvfs.client import AsyncClient
from kvfs.launcher import LocalCluster, ProcessCluster


def du(root: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in root.glob("cs*/chunks/*.chunk"))


async def kvfs(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvfs", *args, "--addr", cluster.addr,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "KVFS_TOKEN": cluster.token})
    out, _ = await proc.communicate()
    return await proc.wait(), out.decode()


async def test_cli_dry_run_then_apply(cluster: LocalCluster, kv: AsyncClient, clock: FakeClock) -> None:
    await kv.put_many([(f"t{i}", b"x" * 4096) for i in range(50)], ttl=10)
    await kv.put("keep", b"k" * 4096)
    clock.advance(11)
    before = du(cluster.root)

    rc, out = await kvfs(cluster, "gc", "run")
    assert rc == 0 and "dry run" in out and "expire:  50 keys" in out, out
    rc, out = await kvfs(cluster, "gc", "status", "--json")
    st = json.loads(out)
    assert st["expired_keys"] == 50 and st["metrics"]["keys_expired"] == 0
    assert du(cluster.root) == before

    assert (await kvfs(cluster, "gc", "pause"))[0] == 0
    rc, out = await kvfs(cluster, "gc", "run", "--apply")
    assert rc == 1 and "paused" in out
    rc, out = await kvfs(cluster, "gc", "status")
    assert "PAUSED" in out
    assert (await kvfs(cluster, "gc", "resume"))[0] == 0

    rc, out = await kvfs(cluster, "gc", "run", "--expire", "--compact", "--apply", "--grace", "0",
                         "--rate", "200MiB/s")
    assert rc == 0 and "applied" in out, out
    rc, out = await kvfs(cluster, "gc", "status", "--json")
    st = json.loads(out)
    assert st["expired_keys"] == 0 and st["metrics"]["keys_expired"] == 50
    assert st["last_run"]["expired_keys"] == 50
    rc, out = await kvfs(cluster, "gc", "status")
    assert rc == 0 and "garbage" in out and "last run:" in out, out
    rc, out = await kvfs(cluster, "stat", "--json")
    assert json.loads(out)["gc"]["metrics"]["keys_expired"] == 50
    assert du(cluster.root) < before
    assert await kv.get("keep") == b"k" * 4096


async def test_cli_fsck_finds_and_repairs_corrupt_value(cluster: LocalCluster, kv: AsyncClient) -> None:
    await kv.put_many([(f"f{i}", bytes([i]) * 5000) for i in range(10)])
    lay = await kv.layout("f3")
    assert lay is not None
    rep = lay.extents[0].replicas[0]
    (path,) = cluster.root.glob(f"cs*/chunks/{rep.chunk_id:016x}.chunk")
    with open(path, "r+b") as f:
        f.seek(rep.offset + 10)
        f.write(b"\xff")
    rc, out = await kvfs(cluster, "gc", "fsck", "--cutoff", "0", "--json")
    report = json.loads(out)
    assert rc == 2 and [r[0] for r in report["corrupt_refs"]] == ["f3"], out
    rc, out = await kvfs(cluster, "gc", "fsck", "--cutoff", "0", "--apply")
    assert rc == 0 and "keys_deleted 1" in out, out
    async with cluster.client() as fresh:
        assert await fresh.get("f3") is None  # a clean miss instead of bad bytes
        assert await fresh.get("f4") == bytes([4]) * 5000


@pytest.mark.subprocess
async def test_process_cluster_runs_gc_daemon(tmp_path: Path) -> None:
    c = ProcessCluster(tmp_path / "up", 1, listen="127.0.0.1:0", gc=True,
                       gc_args=("--interval", "0.1", "--grace", "0"))
    await c.start()
    try:
        assert c.gc is not None and c.gc.proc is not None and c.gc.proc.returncode is None
        async with c.client() as kv:
            await kv.put_many([(f"d{i}", b"d" * 1000) for i in range(20)], ttl=0.2)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while (await kv.stats())["gc"]["metrics"]["keys_expired"] < 20:
                assert loop.time() < deadline, "the gc daemon did not expire the keys"
                await asyncio.sleep(0.05)
            assert await kv.get_many([f"d{i}" for i in range(20)]) == [None] * 20
    finally:
        await c.stop()
    assert c.gc.proc.returncode == 0


@pytest.mark.parametrize("how", ["delete", "expire"])
async def test_dry_run_reports_what_apply_does(cluster: LocalCluster, kv: AsyncClient,
                                               clock: FakeClock, how: str) -> None:
    """Every chunk is still open (64 MiB chunks): --apply seals then compacts them, and the dry
    run counts them too; expired keys count as garbage in a dry run, as after the expire phase."""
    from kvfs.gc.driver import GarbageCollector, PassOptions

    keys = [f"g{i:03d}" for i in range(300)]
    for b in range(3):  # chunks holding some live keys among many dead ones
        await kv.put_many([(k, os.urandom(8192)) for k in keys[b * 100:(b + 1) * 100]],
                          ttl=5 if how == "expire" else None)
        await kv.put_many([(f"keep{i}", os.urandom(8192)) for i in range(b * 10, (b + 1) * 10)])
    if how == "delete":
        assert await kv.delete_many(keys) == len(keys)
    else:
        clock.advance(6)
    async with GarbageCollector(cluster.addr, token=cluster.token) as gc:
        dry = await gc.run_pass(PassOptions(apply=False, grace_s=0))
        applied = await gc.run_pass(PassOptions(apply=True, grace_s=0))
    assert dry.compact_candidates > 0
    assert (dry.compact_candidates, dry.delete_candidates) == (
        applied.compact_candidates, applied.delete_candidates)
    assert applied.chunks_compacted == dry.compact_candidates
    assert [len(v or b"") for v in await kv.get_many([f"keep{i}" for i in range(30)])] == [8192] * 30
