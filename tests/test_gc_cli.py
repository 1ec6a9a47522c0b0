"""`kvfs gc ...` against a cluster: dry run vs --apply, status, pause/resume, fsck, daemon."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import FakeClock, hold

from kvfs.client import AsyncClient
from kvfs.gc.driver import GarbageCollector
from kvfs.launcher import LocalCluster, ProcessCluster
from kvfs.layout import Replica
from kvfs.rpc import Op

pytestmark = pytest.mark.usefixtures("meta_backend")  # each test over SQLite and Redis


def du(root: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in root.glob("cs*/chunks/*.chunk"))


async def kvfs(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvfs", *args, "--addr", cluster.addr,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "KVFS_ADMIN_TOKEN": cluster.admin_token, "KVFS_TOKEN": cluster.token})
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
    last = next(line for line in out.splitlines() if line.startswith("last run:"))
    assert ": expired 50 keys, evicted 0, compacted " in last, last  # counts, not 50.0
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


def flip_byte(cluster: LocalCluster, rep: Replica) -> None:
    (path,) = cluster.root.glob(f"cs*/chunks/{rep.chunk_id:016x}.chunk")
    with open(path, "r+b") as f:
        f.seek(rep.offset + 10)
        f.write(b"\xff")


async def test_fsck_repair_drops_only_bad_replicas_and_yields_to_racing_writes(
        cluster: LocalCluster, kv: AsyncClient) -> None:
    """Three striped, 2-replica values with one corrupt replica each (in their first extent).
    While the repair (GC_DROP_REPLICAS) is held, the first key found is deleted and the second
    overwritten: the repair skips both and drops only the third's bad replica, which keeps its
    good one and reads back whole."""
    size = (1 << 20) + (1 << 19)  # two extents
    names = ["s0", "s1", "s2"]
    await kv.put_many([(k, bytes([i + 1]) * size) for i, k in enumerate(names)], replicas=2)
    layouts = {}
    for k in names:
        lay = await kv.layout(k)
        assert lay is not None and len(lay.extents) == 2
        layouts[k] = lay
        flip_byte(cluster, lay.extents[0].replicas[0])
    async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
        found = await gc.fsck(cutoff_s=0)
        order = [k.decode() for k, *_ in found.corrupt_refs]
        assert sorted(order) == names
        deleted, overwritten, repaired = order
        drop = hold(cluster, Op.GC_DROP_REPLICAS)
        fsck = asyncio.create_task(gc.fsck(cutoff_s=0, apply=True))
        await drop.reached(fsck)
        await kv.delete(deleted)
        await kv.put(overwritten, b"new", replicas=2)
        drop.release()
        rep = await fsck
    assert rep.repaired["replicas_dropped"] == 1 and rep.repaired["keys_deleted"] == 0
    async with cluster.client() as fresh:
        lay = await fresh.layout(repaired)
        old = layouts[repaired]
        assert lay is not None and lay.size == old.size and lay.crc == old.crc
        assert lay.extents[0].replicas == old.extents[0].replicas[1:]
        assert lay.extents[1] == old.extents[1]
        assert await fresh.get(repaired) == bytes([names.index(repaired) + 1]) * size
        assert await fresh.get(overwritten) == b"new"
        assert await fresh.get(deleted) is None


@pytest.mark.subprocess
async def test_process_cluster_runs_gc_daemon(tmp_path: Path) -> None:
    # a grace past the test's time: with none, a pass could seal and compact the chunk the put
    # is writing before its COMMIT, which meta then refuses (StaleLayout; seen under load,
    # 2026-12-03); the daemon's expiry, which this test is about, does not wait for the grace
    c = ProcessCluster(tmp_path / "up", 1, listen="127.0.0.1:0", gc=True,
                       gc_args=("--interval", "0.1", "--grace", "60"))
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
async def test_dry_run_reports_what_apply_does(tmp_path: Path, clock: FakeClock, how: str) -> None:
    """Every chunk is still open (64 MiB chunks): --apply seals then compacts them, and the dry
    run counts them too; expired keys count as garbage in a dry run, as after the expire phase.
    One chunkserver, so live and dead keys share chunks (with three, random placement put
    them apart about one run in three and nothing was to compact)."""

    async with LocalCluster(tmp_path / "one", 1, clock=clock) as cluster:
        kv = cluster.client()
        kv.clock = clock
        async with kv:
            await _dry_run_matches_apply(cluster, kv, clock, how)


async def _dry_run_matches_apply(cluster: LocalCluster, kv: AsyncClient, clock: FakeClock,
                                 how: str) -> None:
    from kvfs.gc.driver import GarbageCollector, PassOptions

    keys = [f"g{i:03d}" for i in range(300)]
    # chunks holding some live keys among many dead ones (one chunkserver: they share chunks)
    for b in range(3):
        await kv.put_many([(k, os.urandom(8192)) for k in keys[b * 100:(b + 1) * 100]],
                          ttl=5 if how == "expire" else None)
        await kv.put_many([(f"keep{i}", os.urandom(8192)) for i in range(b * 10, (b + 1) * 10)])
    if how == "delete":
        assert await kv.delete_many(keys) == len(keys)
    else:
        clock.advance(6)
    async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
        dry = await gc.run_pass(PassOptions(apply=False, grace_s=0))
        applied = await gc.run_pass(PassOptions(apply=True, grace_s=0))
    assert dry.compact_candidates > 0
    assert (dry.compact_candidates, dry.delete_candidates) == (
        applied.compact_candidates, applied.delete_candidates)
    assert applied.chunks_compacted == dry.compact_candidates
    assert [len(v or b"") for v in await kv.get_many([f"keep{i}" for i in range(30)])] == [8192] * 30


async def test_dry_run_report_equals_apply_report(tmp_path: Path, clock: FakeClock) -> None:
    """Expired, deleted, leased and least recently used keys on a server over its high
    watermark: the dry run's counts and bytes (expire, evict, compact, delete) are the ones
    --apply then reports, evictions included."""
    from kvfs.config import ChunkServerConfig
    from kvfs.gc.driver import PassOptions

    root = tmp_path / "same"
    async with LocalCluster(root, 1, clock=clock, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, chunk_bytes=64 * 1024,
            capacity_bytes=2 * 1024 * 1024)) as cluster:
        kv = cluster.client()
        kv.clock = clock
        async with kv:
            value = 8 * 1024
            await kv.put_many([(f"lease{i}", b"l" * value) for i in range(5)])  # the oldest
            await kv.put_many([(f"old{i}", b"o" * value) for i in range(40)])
            await kv.put_many([(f"ttl{i}", b"t" * value) for i in range(20)], ttl=5)
            await kv.put_many([(f"gone{i}", b"g" * value) for i in range(20)])
            assert await kv.match_prefix([f"lease{i}" for i in range(5)], lease_s=60) == 5
            clock.advance(1)
            await kv.put_many([(f"new{i}", b"n" * value) for i in range(25)])
            assert await kv.delete_many([f"gone{i}" for i in range(20)]) == 20
            clock.advance(6)  # the ttl keys expire
            async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
                opts = PassOptions(apply=False, grace_s=0, high=0.3, low=0.2)
                dry = await gc.run_pass(opts)
                applied = await gc.run_pass(dataclasses.replace(opts, apply=True))
    fields = ("expired_keys", "expired_bytes", "evicted_keys", "evicted_bytes", "leased_skipped",
              "compact_candidates", "delete_candidates")
    assert dry.expired_keys == 20 and dry.evicted_keys > 0 and dry.leased_skipped == 5
    assert dry.compact_candidates + dry.delete_candidates > 0
    assert {f: getattr(dry, f) for f in fields} == {f: getattr(applied, f) for f in fields}
    # what the dry run says it would free is what --apply freed: chunk files deleted, less
    # the live bytes compaction copied into new ones
    assert dry.reclaimable_bytes == applied.bytes_reclaimed - applied.bytes_copied, (dry, applied)
