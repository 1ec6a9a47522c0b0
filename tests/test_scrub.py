"""`kvfs gc scrub`: every referenced replica is read back and checked; a corrupt one is
repaired from a good copy (compare-and-swap), a key with no good copy is dropped and named."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock, clocked_client, kvfs_admin

from kvfs.bench.reliability import flip_byte
from kvfs.config import ChunkServerConfig, ClientConfig
from kvfs.gc import scrub as scrub_module
from kvfs.gc.driver import RELEASED_LEASE_S, GarbageCollector, PassOptions, PassReport, run_daemon
from kvfs.launcher import LocalCluster
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.repair import plan_scrub, replace_replica
from kvfs.rpc import BadReplica, GcControl, GcLayouts, GcScrubPlan


def lay(*extents: tuple[int, ...]) -> Layout:
    """One extent per argument: the server ids holding it (chunk = server * 100)."""
    return Layout(10 * len(extents), 0, 0.0, None, tuple(
        Extent(10, 0, tuple(Replica(s, s * 100, 8 * i) for s in servers))
        for i, servers in enumerate(extents)))


def bad(key: bytes, layout: Layout, extent: int, sid: int) -> BadReplica:
    r = next(r for r in layout.extents[extent].replicas if r.server_id == sid)
    return BadReplica(key, r.server_id, r.chunk_id, r.offset)


def test_plan_repairs_from_a_good_copy_and_drops_keys_with_none() -> None:
    layouts = {b"one": lay((1, 2)), b"both": lay((1, 2), (1, 2)), b"silent": lay((1, 3)),
               b"mixed": lay((1, 2), (2, 3))}
    found = [bad(b"one", layouts[b"one"], 0, 1),
             bad(b"both", layouts[b"both"], 1, 1), bad(b"both", layouts[b"both"], 1, 2),
             bad(b"silent", layouts[b"silent"], 0, 1),  # its other copy: on a silent server
             bad(b"mixed", layouts[b"mixed"], 0, 2),
             bad(b"gone", lay((1, 2)), 0, 1)]  # deleted since the scrub read it
    plan = plan_scrub(found, layouts, alive={1, 2})
    assert [(i.key, i.extent, i.lost.server_id, [s.server_id for s in i.sources], i.holders)
            for i in plan.items] == [(b"one", 0, 1, [2], [2]), (b"mixed", 0, 2, [1], [1])]
    assert plan.lost == [b"both"]
    assert sorted((d.key, d.server_id) for d in plan.drop) == [
        (b"both", 1), (b"both", 2), (b"silent", 1)]


def test_a_copy_may_replace_a_bad_replica_on_its_own_server() -> None:
    old = lay((1, 2))
    lost, new = Replica(1, 100, 0), Replica(1, 101, 0)
    switched = replace_replica(old, 0, lost, new)
    assert switched is not None and switched.extents[0].replicas == (new, Replica(2, 200, 0))
    assert replace_replica(old, 0, lost, Replica(2, 201, 0)) is None  # server 2 holds the other


# a pass that only scrubs, 40,000 bytes a server: two 20 KB keys, replicas=2 on 2 servers
SCRUB_ONLY = PassOptions(apply=True, expire=False, evict=False, compact=False, repair=False,
                         scrub_bytes=40_000)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    c = LocalCluster(tmp_path / "cluster", 2)
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


def flip(cluster: LocalCluster, replica: Replica, at: int) -> None:
    flip_byte(cluster, replica, at, 0x10)


async def test_scrub_repairs_one_bad_replica_and_drops_a_key_with_none(cluster: LocalCluster) -> None:
    values = {f"k{i}": bytes([i]) * (1000 + 331 * i) for i in range(20)}
    values["big"] = bytes(range(256)) * (12 * 1024 + 7)  # 3 MiB: striped over 3 extents
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many(list(values.items()))
        one, both = await kv.layout("big"), await kv.layout("k5")
    assert one is not None and both is not None and len(one.extents) >= 2
    flip(cluster, one.extents[1].replicas[0], 1000)
    flip(cluster, both.extents[0].replicas[0], 3)
    flip(cluster, both.extents[0].replicas[1], 7)

    rc, out = await kvfs_admin(cluster, "gc", "scrub")  # dry run: reports, changes nothing
    assert rc == 2 and "dry run" in out and "3 failing their checksum" in out, out
    assert "would repair 1 from a good copy" in out and "would drop: k5" in out, out
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        assert await kv.layout("big") == one and await kv.layout("k5") == both

    rc, out = await kvfs_admin(cluster, "gc", "scrub", "--apply", "--json", "--rate", "1GiB/s")
    assert rc == 0, out
    rep = json.loads(out)
    assert (rep["corrupt"], rep["missing"], rep["repaired"], rep["keys_dropped"], rep["lost_keys"]) == (
        3, 0, 1, 1, ["k5"]), rep
    assert rep["servers_verified"] == 2 and rep["ranges_checked"] >= 2 * 22

    async with cluster.client(ClientConfig(replicas=2)) as kv:
        fixed = await kv.layout("big")
        assert fixed is not None
        assert fixed.extents[1].replicas[0] != one.extents[1].replicas[0]  # a fresh copy ...
        assert fixed.extents[1].replicas[0].server_id == one.extents[1].replicas[0].server_id
        assert fixed.extents[0] == one.extents[0]  # ... of that extent only
        assert await kv.get("k5") is None  # no good copy: a miss, never wrong bytes
        del values["k5"]
        assert await kv.get_many(list(values)) == list(values.values())

    rc, out = await kvfs_admin(cluster, "gc", "scrub")
    assert rc == 0 and "0 failing their checksum, 0 missing" in out, out


async def test_a_keys_bad_replicas_are_planned_together_however_the_scrub_splits_its_plans(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """GC_SCRUB_PLAN requests are bounded by bytes (``PLAN_BATCH_BYTES``; here 1, so each
    key goes alone), never splitting a key's bad replicas: a key corrupt on both replicas is
    still seen to have no good copy and dropped (split, each plan would take the other
    bad replica for a good source, and the key would stay), and one corrupt replica of
    another key is repaired."""
    monkeypatch.setattr(scrub_module, "PLAN_BATCH_BYTES", 1)
    plans: list[list[bytes]] = []
    ask = GarbageCollector.meta

    async def counted(gc: GarbageCollector, request: Any) -> Any:
        if isinstance(request, GcScrubPlan):
            plans.append(sorted(b.key for b in request.bad))
        return await ask(gc, request)

    monkeypatch.setattr(GarbageCollector, "meta", counted)
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many([(f"k{i}", bytes([i]) * 5000) for i in range(6)])
        both, one = await kv.layout("k2"), await kv.layout("k4")
        assert both is not None and one is not None
        flip(cluster, both.extents[0].replicas[0], 3)
        flip(cluster, both.extents[0].replicas[1], 7)
        flip(cluster, one.extents[0].replicas[1], 9)
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            rep = await scrub_module.scrub(gc, apply=True)
        assert sorted(plans) == [[b"k2", b"k2"], [b"k4"]], plans
        assert (rep.corrupt, rep.repaired, rep.keys_dropped, rep.lost_keys) == (3, 1, 1, [b"k2"]), rep
        assert await kv.get("k2") is None
        assert await kv.get_many([f"k{i}" for i in range(6) if i != 2]) == [
            bytes([i]) * 5000 for i in range(6) if i != 2]


@contextlib.asynccontextmanager
async def twenty_four_keys(tmp_path: Path) -> AsyncIterator[tuple[LocalCluster, dict[str, bytes]]]:
    """2 chunkservers of 64 KiB chunks and 24 keys, s00-s23, of 20,000 bytes each,
    replicas=2, each its own APPEND (a chunk takes about three)."""
    root = tmp_path / "cluster"
    async with LocalCluster(root, 2, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, chunk_bytes=64 * 1024, preallocate=False)) as c:
        values = {f"s{i:02}": bytes([i]) * 20_000 for i in range(24)}
        async with c.client(ClientConfig(replicas=2)) as kv:
            for k, v in values.items():
                await kv.put(k, v)
        yield c, values


@pytest.mark.usefixtures("meta_backend")
async def test_the_daemons_background_scrub_goes_round_every_replica_in_slices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pass verifies the replicas of the keys after where the last one stopped (key
    order), about ``scrub_bytes`` a server: a bad replica nobody reads is found within one
    round of passes, mended from its good copy, and counted (bytes_scrubbed,
    replicas_scrubbed_bad); then the slices go on from the first key again.  The walk pages
    through meta's keys (GC_LAYOUTS, here 5 keys a page, so pages end mid-slice): meta never
    walks every key for it (its index's ``refs``, a walk, is not called)."""
    monkeypatch.setattr(scrub_module, "SCRUB_PAGE_KEYS", 5)
    async with twenty_four_keys(tmp_path) as (c, values):
        async with c.client(ClientConfig(replicas=2)) as kv:
            last = await kv.layout("s20")  # in one of the last chunks (chunk ids grow)
        assert last is not None
        flip(c, last.extents[0].replicas[0], 5)
        assert c.meta is not None

        def no_scan(*args: object) -> None:
            raise AssertionError("the background scrub made meta walk every key")

        monkeypatch.setattr(c.meta.index, "refs", no_scan)
        # two keys each pass: each has a replica on both servers, 20,000 bytes a server each
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            ranges = found = 0
            for _ in range(12):  # 24 replicas a server
                rep = (await gc.run_pass(SCRUB_ONLY)).scrub
                assert rep is not None and (rep.servers_verified, rep.ranges_checked) == (2, 4), rep
                ranges += rep.ranges_checked
                found += rep.corrupt
            assert (ranges, found) == (2 * 24, 1)  # each replica once, the bad one found
            again = (await gc.run_pass(SCRUB_ONLY)).scrub  # the next round
            assert again is not None and (again.ranges_checked, again.corrupt) == (4, 0)
            metrics = (await gc.status())["metrics"]
        assert metrics["replicas_scrubbed_bad"] == 1
        assert metrics["bytes_scrubbed"] == (2 * 24 + 4) * 20_000
        async with c.client(ClientConfig(replicas=2)) as kv:
            fixed = await kv.layout("s20")
            assert fixed is not None and last.extents[0].replicas[0] not in fixed.extents[0].replicas
            assert await kv.get_many(list(values)) == list(values.values())
        rc, out = await kvfs_admin(c, "gc", "scrub")  # (by hand: the same walk, every key)
        assert rc == 0 and "0 failing their checksum, 0 missing" in out, out
        assert "verified: 48 replicas" in out, out


@contextlib.asynccontextmanager
async def eight_keys(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    """2 chunkservers and 8 keys, k0-k7, of 20,000 bytes each, replicas=2."""
    root = tmp_path / "cluster"
    async with LocalCluster(root, 2, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, preallocate=False)) as c:
        async with c.client(ClientConfig(replicas=2)) as kv:
            await kv.put_many([(f"k{i}", bytes([i]) * 20_000) for i in range(8)])
        yield c


@pytest.mark.usefixtures("meta_backend")
async def test_a_daemon_goes_on_where_the_last_ones_scrub_stopped(tmp_path: Path) -> None:
    """Each pass reports the last key its scrub verified; meta keeps it, and a daemon that
    takes its turn (a restart, or another daemon) goes on after it, not from the first key."""
    async with eight_keys(tmp_path) as c:
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            for _ in range(2):  # two keys a pass
                await gc.run_pass(SCRUB_ONLY)
            assert gc.scrub_cursor == b"k3"
            assert (await gc.meta(GcControl(holder="other"))).scrub_cursor == b"k3"
            await gc.meta(GcControl(holder="other", lease_s=RELEASED_LEASE_S))  # handed on
        stop = asyncio.Event()
        passes: list[PassReport] = []

        def one(report: PassReport) -> None:
            passes.append(report)
            stop.set()

        async with asyncio.timeout(60):
            await run_daemon(c.addr, c.admin_token, SCRUB_ONLY, 0.05, stop, on_pass=one)
        assert len(passes) == 1 and passes[0].scrub is not None
        assert passes[0].scrub.ranges_checked == 4
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            assert (await gc.meta(GcControl(holder="other"))).scrub_cursor == b"k5"  # k4, k5


async def test_a_replica_moved_away_while_it_was_verified_is_not_counted_bad(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key overwritten between the slice's walk and its CHUNK_VERIFY, its old record then
    damaged: the verification finds that record bad, but no layout names it any more, so
    nothing is mended and replicas_scrubbed_bad stays 0."""
    root = tmp_path / "cluster"
    async with (LocalCluster(root, 2, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, preallocate=False)) as c,
                c.client(ClientConfig(replicas=2)) as kv):
        await kv.put("m", b"m" * 20_000)
        old = await kv.layout("m")
        assert old is not None
        verify = GarbageCollector.verify_ranges

        async def overwritten_first(gc: GarbageCollector, sid: int, flat: Any,
                                    pacer: Any = None) -> Any:
            if await kv.layout("m") == old:  # (fault injection: a racing overwrite)
                await kv.put("m", b"n" * 20_000)
                flip(c, old.extents[0].replicas[0], 5)
            return await verify(gc, sid, flat, pacer)

        monkeypatch.setattr(GarbageCollector, "verify_ranges", overwritten_first)
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            rep = (await gc.run_pass(SCRUB_ONLY)).scrub
            metrics = (await gc.status())["metrics"]
        assert rep is not None and rep.corrupt == 1 and rep.repairable == 0, rep
        assert metrics["replicas_scrubbed_bad"] == 0
        assert await kv.get("m") == b"n" * 20_000


@pytest.mark.usefixtures("meta_backend")
async def test_scrub_and_fsck_walk_meta_a_page_at_a_time_and_verify_a_batch_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole scrub (and fsck's check) walks meta's keys once in GC_LAYOUTS pages (here 5
    keys) and checks each server's ranges in CHUNK_VERIFY batches as they fill (here 4, in
    chunk order), so neither meta nor the collector ever holds, nor one frame carries, every
    key of a server (1M keys of 64-byte names used to make a 78 MB frame, past the 64 MiB
    limit, bench/RESULTS.md); meta never walks every key for it.  A chunkserver that dies
    mid-scrub is named as failed, and the other's ranges are all still checked."""
    monkeypatch.setattr(scrub_module, "SCRUB_PAGE_KEYS", 5)
    monkeypatch.setattr(scrub_module, "VERIFY_BATCH_RANGES", 4)
    async with twenty_four_keys(tmp_path) as (c, _):
        async with c.client(ClientConfig(replicas=2)) as kv:
            bad_one = await kv.layout("s13")
        assert bad_one is not None and c.meta is not None
        flip(c, bad_one.extents[0].replicas[1], 5)

        def no_scan(*args: object) -> None:
            raise AssertionError("the scrub made meta walk every key")

        monkeypatch.setattr(c.meta.index, "refs", no_scan)
        pages: list[int] = []
        batches: list[tuple[int, list[tuple[int, int]]]] = []
        verify, ask = GarbageCollector.verify_ranges, GarbageCollector.meta

        async def counted(gc: GarbageCollector, sid: int, flat: Any, pacer: Any = None) -> Any:
            batches.append((sid, [(f[1], f[2]) for f in flat]))
            return await verify(gc, sid, flat, pacer)

        async def paged(gc: GarbageCollector, request: Any) -> Any:
            answer = await ask(gc, request)
            if isinstance(request, GcLayouts):
                pages.append(len(answer.rows))
            return answer

        monkeypatch.setattr(GarbageCollector, "verify_ranges", counted)
        monkeypatch.setattr(GarbageCollector, "meta", paged)
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            rep = await scrub_module.scrub(gc, apply=False)
            assert (rep.servers_verified, rep.ranges_checked, rep.corrupt, rep.missing) == (2, 48, 1, 0), rep
            assert pages == [5, 5, 5, 5, 4, 0]  # each key once, a page at a time
            assert sorted(len(b) for _, b in batches) == [4] * 12  # 24 ranges a server
            assert all(b == sorted(b) for _, b in batches)  # chunk order within a batch

            fsck = await gc.fsck(cutoff_s=3600.0)
            assert (fsck.ranges_checked, len(fsck.corrupt_refs), len(fsck.missing_refs)) == (48, 1, 0)

            # however many servers, at most VERIFY_HELD_RANGES wait in all: past it the
            # server with the most is checked early (here each key adds one range to each)
            monkeypatch.setattr(scrub_module, "VERIFY_HELD_RANGES", 6)
            batches.clear()
            rep = await scrub_module.scrub(gc, apply=False)
            assert (rep.ranges_checked, rep.corrupt) == (48, 1), rep
            assert 3 in [len(b) for _, b in batches] and max(len(b) for _, b in batches) <= 4

            batches.clear()
            victim = c.chunkservers[1]
            assert victim is not None
            dead = victim.server_id

            async def dies_after_its_first_batch(gc: GarbageCollector, sid: int, flat: Any,
                                                 pacer: Any = None) -> Any:
                if sid == dead and any(s == dead for s, _ in batches):
                    await c.stop_chunkserver(1)  # (fault injection: it dies mid-scrub)
                return await counted(gc, sid, flat, pacer)

            monkeypatch.setattr(GarbageCollector, "verify_ranges", dies_after_its_first_batch)
            rep = await scrub_module.scrub(gc, apply=False)
        assert rep.servers_failed == [dead] and rep.servers_verified == 1, rep
        assert rep.ranges_checked == 24, rep  # every range of the live one
        assert len([b for s, b in batches if s == dead]) == 2  # not asked again once it failed


async def test_a_slice_counts_the_expired_keys_it_passes_and_moves_past_them(
        tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expired keys (by meta's clock) are not checked (compaction copies none of their
    records), but a slice counts them against ``SCRUB_MAX_KEYS`` and its cursor moves past
    them: a run of expired keys neither makes one pass page through every key nor stops
    the next from going on."""
    monkeypatch.setattr(scrub_module, "SCRUB_MAX_KEYS", 5)
    root = tmp_path / "cluster"
    async with LocalCluster(root, 2, clock=clock, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, preallocate=False)) as c:
        async with clocked_client(c, clock) as kv:
            await kv.put_many([(f"e{i}", b"e" * 1000) for i in range(8)], ttl=10)
            await kv.put_many([(f"k{i}", b"k" * 1000) for i in range(3)])
        clock.advance(11)
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            first = (await gc.run_pass(SCRUB_ONLY)).scrub
            assert first is not None and first.ranges_checked == 0 and gc.scrub_cursor == b"e4"
            second = (await gc.run_pass(SCRUB_ONLY)).scrub  # e5-e7, then the live keys
            assert second is not None and second.ranges_checked == 2 and gc.scrub_cursor == b"k1"


async def test_a_slice_takes_only_the_servers_the_pass_found_alive(tmp_path: Path) -> None:
    """A chunkserver stopped since the collector's last pass: the next slice takes only the
    live server's replicas (the stopped one's neither asked for nor counted as skipped),
    up to the budget on that server alone."""
    async with eight_keys(tmp_path) as c:
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            rep = (await gc.run_pass(SCRUB_ONLY)).scrub
            assert rep is not None and (rep.servers_verified, rep.ranges_checked) == (2, 4), rep
            await c.stop_chunkserver(1)
            rep = (await gc.run_pass(SCRUB_ONLY)).scrub
        assert rep is not None and rep.servers_skipped == [], rep
        assert (rep.servers_verified, rep.ranges_checked, rep.bytes_verified) == (1, 2, 40_000), rep


async def test_the_scrub_walk_bench_times_both_calls() -> None:
    """``python -m kvfs.bench.scrub_walk``, small (figures: bench/RESULTS.md)."""
    from kvfs.bench import scrub_walk

    res = await scrub_walk.run(2000, 100, 1)
    assert res["keys"] == 2000 and res["page"] == 100
    assert res["gc_chunk_refs_ms"] > 0 and res["gc_layouts_page_ms"] > 0
