"""Membership and repair: meta declares a silent chunkserver dead after ``dead_after_s``;
exists/match_prefix stop counting keys held only there; the GC's repair step copies every
extent that lost a replica to a live server (compare-and-swap), and a server that comes
back has its unreferenced chunks reclaimed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import hold, kvfs_admin
from poll import until_dead

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.bench.reliability import flip_byte
from kvfs.config import ChunkServerConfig, ClientConfig, MetaConfig
from kvfs.errors import InvalidArgument
from kvfs.gc import GarbageCollector, PassOptions
from kvfs.gc.repair import RepairReport, copy_extents
from kvfs.handshake import Role
from kvfs.launcher import LocalCluster
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.meta import index
from kvfs.meta.index import MetaIndex
from kvfs.meta.repair import RepairSummary, plan_repairs, readable, replace_replica
from kvfs.meta.tombstones import chunk_seq
from kvfs.rpc import Op
from kvfs.transport import Connection

# every test over each store meta keeps its own index in (the SQLite half: marker meta_sqlite)
pytestmark = pytest.mark.usefixtures("local_meta")

DEAD_AFTER_S = 1.0
REPAIR_ONLY = PassOptions(apply=True, expire=False, evict=False, compact=False, repair=True)


def lay(*extents: tuple[int, ...]) -> Layout:
    """One extent per argument: the server ids holding it (chunk = server * 100)."""
    return Layout(10 * len(extents), 0, 0.0, None, tuple(
        Extent(10, 0, tuple(Replica(s, s * 100, 8 * i) for s in servers))
        for i, servers in enumerate(extents)))


def test_plan_lists_extents_with_a_lost_replica_and_a_live_one() -> None:
    entries = [(b"a", lay((1, 2))), (b"b", lay((2, 3), (3, 4))), (b"c", lay((1,))), (b"d", lay((1, 4)))]
    summary = RepairSummary()
    items = plan_repairs(entries, gone={1}, alive={2, 3}, limit_bytes=1 << 20, now=0.0, summary=summary)
    assert [(i.key, i.extent, i.lost.server_id, [r.server_id for r in i.sources]) for i in items] == [
        (b"a", 0, 1, [2])]  # c: no copy left; d: its other copy is not alive (silent, not dead yet)
    assert (summary.under_replicated_extents, summary.under_replicated_bytes,
            summary.unrepairable_extents, summary.unrepairable_keys) == (3, 30, 2, [b"c", b"d"])
    assert plan_repairs(entries, gone=set(), alive={1, 2, 3, 4}, limit_bytes=1 << 20, now=0.0) == []
    # a batch holds at least one item, then stops at the byte limit
    two = [(b"a", lay((1, 2))), (b"e", lay((1, 3)))]
    assert len(plan_repairs(two, gone={1}, alive={2, 3}, limit_bytes=1, now=0.0)) == 1
    # ... and at the item limit, however small the extents; the summary counts them all
    many = [(b"k%d" % i, lay((1, 2))) for i in range(50)]
    summary = RepairSummary()
    assert len(plan_repairs(many, gone={1}, alive={2}, limit_bytes=1 << 30, now=0.0, summary=summary,
                            limit_items=7)) == 7
    assert summary.under_replicated_extents == 50
    assert plan_repairs(many, gone={1}, alive={2}, limit_bytes=1 << 30, now=0.0, first=False,
                        limit_items=0) == []  # a later page, the limit used up


def test_replace_replica_is_a_compare_and_swap() -> None:
    old = lay((1, 2), (3, 4))
    lost, new = Replica(3, 300, 8), Replica(5, 500, 0)
    switched = replace_replica(old, 1, lost, new)
    assert switched is not None and switched.extents[1].replicas == (new, Replica(4, 400, 8))
    assert switched.extents[0] == old.extents[0]
    assert replace_replica(switched, 1, lost, new) is None  # already repaired
    assert replace_replica(old, 0, lost, new) is None  # not in that extent
    assert replace_replica(old, 1, lost, Replica(4, 401, 0)) is None  # server 4 holds a copy
    assert replace_replica(old, 7, lost, new) is None


def test_readable_needs_a_replica_off_the_gone_servers_for_every_extent() -> None:
    assert readable(lay((1, 2)), {1})
    assert not readable(lay((1, 2)), {1, 2})
    assert not readable(lay((2,), (1,)), {1})
    assert readable(lay((1,)), set())


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    root = tmp_path / "cluster"
    c = LocalCluster(root, 3, meta=MetaConfig(data=root / "meta", listen="127.0.0.1:0",
                                              heartbeat_timeout_s=0.5, dead_after_s=DEAD_AFTER_S))
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


async def test_a_dead_server_is_repaired_and_reclaimed_when_it_returns(cluster: LocalCluster) -> None:
    values = {f"k{i}": bytes([i % 251]) * (1000 + 997 * i) for i in range(60)}
    values["big"] = b"B" * (3 * 1024 * 1024 + 5)  # striped: 4 extents
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        for k, v in values.items():  # one put each: placement spreads them over the servers
            await kv.put(k, v)
        async with cluster.client(ClientConfig(replicas=1)) as kv1:
            await kv1.put("only-on-one", b"x" * 100)
            lone = await kv1.layout("only-on-one")
        assert lone is not None
        victim_sid = lone.extents[0].replicas[0].server_id
        victim = cluster.index_of(victim_sid)
        held = [k for k in values if any(r.server_id == victim_sid
                                         for e in (await kv.layout(k)).extents for r in e.replicas)]
        assert len(held) >= 2, "the victim holds too few replicas of the replicas=2 keys"
        await cluster.stop_chunkserver(victim)
        await until_dead(cluster, victim_sid)

        # exists / match_prefix: a key whose every replica is on a dead server is not counted
        assert await kv.exists_many(["only-on-one", held[0]]) == [False, True]
        assert await kv.match_prefix([held[0], "only-on-one", held[1]]) == 1

        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            before = (await gc.status())["repair"]
            assert before["under_replicated_extents"] >= len(held)
            assert before["unrepairable_extents"] == 1  # only-on-one
            report = await gc.run_pass(REPAIR_ONLY)
            assert report.repair is not None
            assert report.repair.extents_repaired == before["under_replicated_extents"] - 1
            assert (report.repair.under_replicated_extents, report.repair.under_replicated_bytes,
                    report.repair.unrepairable_extents) == (before["under_replicated_extents"],
                                                            before["under_replicated_bytes"], 1)
            after = (await gc.status())["repair"]
            assert after["under_replicated_extents"] == after["unrepairable_extents"] == 1

        live = {cs.server_id for cs in cluster.chunkservers if cs is not None}
        for k in values:
            layout = await kv.layout(k)
            assert layout is not None
            assert all(len({r.server_id for r in e.replicas} & live) == 2 for e in layout.extents), k
        async with cluster.client(ClientConfig(replicas=2)) as fresh:
            assert await fresh.get_many(list(values)) == list(values.values())

        # the victim returns: nothing references its old replicas; GC reclaims their chunks
        returned = await cluster.start_chunkserver(victim)
        assert returned.server_id == victim_sid
        old_chunks = {r.chunk_id for k in held for e in (await kv.layout(k) or lone).extents
                      for r in e.replicas if r.server_id == victim_sid}
        assert not old_chunks
        assert await kv.get("only-on-one") == b"x" * 100  # back with its server
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            await gc.run_pass(PassOptions(apply=True, grace_s=0.0, repair=False))
        # compacted or deleted: what the server keeps is only-on-one's record
        now_lone = await kv.layout("only-on-one")
        assert now_lone is not None
        assert set(returned.store.sizes) <= {now_lone.extents[0].replicas[0].chunk_id,
                                             returned.store.open_chunk}
        assert await kv.get_many([*values, "only-on-one"]) == [*values.values(), b"x" * 100]


async def test_a_short_append_answer_costs_repair_only_that_servers_copies(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunkserver answering a repair's APPEND with fewer locations than records: those
    copies are skipped (which went where is not known), the pass goes on; the next pass, with
    honest answers, repairs them."""
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        for i in range(6):
            await kv.put(f"s{i}", bytes([i]) * 1000)
        first = await kv.layout("s0")
        assert first is not None
        victim_sid = first.extents[0].replicas[0].server_id
        await cluster.stop_chunkserver(cluster.index_of(victim_sid))
        await until_dead(cluster, victim_sid)
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            real = gc.chunkserver

            async def short(sid: int, request: Any, payload: Any = ()) -> Any:
                got = await real(sid, request, payload)
                return rpc.Appended(locations=got.locations[:-1]) if isinstance(request, rpc.Append) else got

            monkeypatch.setattr(gc, "chunkserver", short)
            report = await gc.run_pass(REPAIR_ONLY)  # (was: zip's ValueError ended the pass)
            assert report.repair is not None
            assert report.repair.extents_repaired == 0 and report.repair.skipped >= 1
            monkeypatch.undo()
            report = await gc.run_pass(REPAIR_ONLY)
            assert report.repair is not None and report.repair.extents_repaired >= 1
        assert await kv.get("s0") == bytes([0]) * 1000


async def test_repair_loses_to_a_racing_overwrite(cluster: LocalCluster) -> None:
    # (duplicates: picks its victim as the test above does: the server of a key's first replica)
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put("k", b"old" * 1000)
        layout = await kv.layout("k")
        assert layout is not None
        victim_sid = layout.extents[0].replicas[0].server_id
        victim = cluster.index_of(victim_sid)
        await cluster.stop_chunkserver(victim)
        await until_dead(cluster, victim_sid)
        holders = {r.server_id for r in layout.extents[0].replicas}
        spare = next(cs.server_id for cs in cluster.chunkservers
                     if cs is not None and cs.server_id not in holders)
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            plan = await gc.meta(rpc.GcRepairPlan(limit_bytes=1 << 20))
            (item,) = plan.items
            switch = rpc.ReplicaSwitch(item.key, item.extent, item.lost,
                                       Replica(spare, make_chunk_id(spare, 1), 0))
            async with cluster.client(ClientConfig(replicas=1)) as kv1:
                await kv1.put("k", b"new")  # an overwrite between the plan and the switch
            r = await gc.meta(rpc.GcRepair(items=[switch]))
            assert (r.repaired, r.skipped) == (0, 1)
        async with cluster.client() as fresh:
            assert await fresh.get("k") == b"new"
            now = await fresh.layout("k")
            assert now is not None and switch.new not in now.extents[0].replicas


async def test_decommission_drains_a_server_then_forgets_it(cluster: LocalCluster) -> None:
    values = {f"d{i}": bytes([i % 251]) * (2000 + 977 * i) for i in range(40)}
    values["big"] = b"D" * (3 * 1024 * 1024 + 11)  # striped: 4 extents
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        for k, v in values.items():
            await kv.put(k, v)
        async with cluster.client(ClientConfig(replicas=1)) as kv1:
            await kv1.put("single", b"s" * 5000)
            lone = await kv1.layout("single")
        assert lone is not None
        values["single"] = b"s" * 5000
        victim = lone.extents[0].replicas[0].server_id

        def on_victim(layout: Layout | None) -> bool:
            assert layout is not None
            return any(r.server_id == victim for e in layout.extents for r in e.replicas)

        rc, out = await kvfs_admin(cluster, "gc", "decommission", str(victim))
        assert rc == 0 and f"chunkserver {victim}: draining" in out, out
        rc, out = await kvfs_admin(cluster, "stat", "--json")
        row = next(s for s in json.loads(out)["servers"] if s["server_id"] == victim)
        assert row["draining"] and row["live"] > 0
        async with cluster.client(ClientConfig(replicas=2)) as fresh:  # no new placements on it
            for i in range(10):
                await fresh.put(f"new{i}", b"n" * 3000)
                assert not on_victim(await fresh.layout(f"new{i}"))
                values[f"new{i}"] = b"n" * 3000

        rc, out = await kvfs_admin(cluster, "gc", "decommission", str(victim), "--wait")
        assert rc == 0 and "drained and forgotten" in out, out
        rc, out = await kvfs_admin(cluster, "stat", "--json")
        assert victim not in [s["server_id"] for s in json.loads(out)["servers"]]
        rc, out = await kvfs_admin(cluster, "gc", "decommission", str(victim), "--status")
        assert rc == 0 and "forgotten" in out, out
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            assert await gc.meta(rpc.GcDecommission(server_id=victim, start=False)) == rpc.DrainState(
                server_id=victim, draining=False, forgotten=True, extents_left=0, bytes_left=0)

    idx = next(i for i, cs in enumerate(cluster.chunkservers) if cs is not None and cs.server_id == victim)
    await cluster.stop_chunkserver(idx)  # gone: every value is read from elsewhere
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        for k in values:
            assert not on_victim(await kv.layout(k)), k
        assert await kv.get_many(list(values)) == list(values.values())
    # its id is never taken again: neither its registration nor its heartbeat is accepted
    assert cluster.meta is not None
    host, port = parse_addr(cluster.addr)
    conn = await Connection.open(host, port, cluster.tokens[Role.SERVER])
    try:
        for req in (rpc.Register(server_id=victim, addr="127.0.0.1:1", cluster_id=cluster.meta.cluster_id),
                    rpc.Heartbeat(server_id=victim, addr="127.0.0.1:1", capacity=1, free=1, used=0, chunks={})):
            with pytest.raises(InvalidArgument, match=f"chunkserver {victim} was decommissioned"):
                await conn.call(req)
        assert victim not in cluster.meta.index.servers
    finally:
        conn.close()


async def test_a_drain_visits_each_key_of_the_drained_server_a_few_times_not_every_key_each_plan(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repair plan walks the keys still on the gone servers (their chunks' keys), and stops
    at its bounds unless asked for its totals (once a pass): a drain in plans of 10 visits
    each key a few times.  It walked every key of the cluster in every plan, and counted
    every key left on the server for each plan (800k keys: 305 s, bench/RESULTS.md)."""
    monkeypatch.setattr(rpc, "MAX_REPAIR_PLAN_ITEMS", 10)
    monkeypatch.setattr(index, "WALK_PAGE", 5)
    assert cluster.meta is not None and isinstance(cluster.meta.index, MetaIndex)
    values = {f"k{i}": bytes([i % 251]) * (100 + i) for i in range(150)}
    async with cluster.client(ClientConfig(replicas=1)) as kv:
        for k, v in values.items():  # (one put each: spread over the servers)
            await kv.put(k, v)
        where = {k: lay.extents[0].replicas[0].server_id
                 for k, lay in zip(values, [await kv.layout(k) for k in values], strict=True) if lay is not None}
        victim = where["k0"]
        on = [k for k in values if where[k] == victim]
        assert len(on) >= 20
        visited = 0  # keys meta's walks looked at (its pages; not the pages of a request's
        pages = index.pages  # own keys, WRITE_PAGE: the copies' switches)

        async def counting(rows: Sequence[Any], size: int | None = None) -> AsyncIterator[Sequence[Any]]:
            nonlocal visited
            async for page in pages(rows, size):
                if size is None:
                    visited += len(page)
                yield page

        monkeypatch.setattr(index, "pages", counting)
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            await gc.meta(rpc.GcDecommission(server_id=victim))
            visited = 0
            report = await gc.run_pass(REPAIR_ONLY)
            assert report.repair is not None and report.repair.extents_repaired == len(on)
            assert visited <= 3 * len(on), (visited, len(on))  # was (plans + 1) x every key, twice
            state = await gc.meta(rpc.GcDecommission(server_id=victim, start=False))
        assert state.forgotten
        assert await kv.get_many(list(values)) == list(values.values())


async def test_a_ttl_key_keeps_its_expiry_through_fsck_and_repair(cluster: LocalCluster) -> None:
    """fsck --apply forgets a corrupt replica, then repair copies the extent whose replica's
    server died: each rewrites the key's layout, and each keeps its expiry."""
    async with cluster.client(ClientConfig(replicas=3)) as kv:
        await kv.put("ttl", b"t" * 5000, ttl=3600)
        before = await kv.layout("ttl")
        assert before is not None and before.expires_at is not None
        corrupt, dies, stays = before.extents[0].replicas
        flip_byte(cluster, corrupt, 10)
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            report = await gc.fsck(cutoff_s=0, apply=True)
        assert report.repaired["replicas_dropped"] == 1
        dropped = await kv.layout("ttl")
        assert dropped is not None and dropped.extents[0].replicas == (dies, stays)
        assert dropped.expires_at == before.expires_at
        await cluster.stop_chunkserver(cluster.index_of(dies.server_id))
        await until_dead(cluster, dies.server_id)
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            report = await gc.run_pass(REPAIR_ONLY)
        assert report.repair is not None and report.repair.extents_repaired == 1
        repaired = await kv.layout("ttl")
        assert repaired is not None and dies not in repaired.extents[0].replicas
        assert stays in repaired.extents[0].replicas and len(repaired.extents[0].replicas) == 2
        assert repaired.expires_at == before.expires_at
        assert await kv.get("ttl") == b"t" * 5000


async def test_gc_repair_judges_each_switch_on_its_own(cluster: LocalCluster) -> None:
    """One GC_REPAIR holding, in this order: a key deleted since the plan, a copy on a server
    meta does not know, a lost replica the layout no longer holds, a copy in a chunk another
    GC retired since (found unreferenced: GC_RETIRE first), a copy whose chunk id names
    another server than the copy's (each skipped), then two extents
    of one striped key and a small key (each switched). A skipped item never stops the ones
    after it; two switches of one key both land; the counts are exact.  The copies are named
    by hand (meta checks the layout, not the bytes): no server has to die."""
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many([(k, k.encode() * 700) for k in ("gone", "a", "b", "c", "d", "e")])
        await kv.put("big", b"B" * (3 * 1024 * 1024 + 5))  # striped: 4 extents
        lay = {k: await kv.layout(k) for k in ("gone", "a", "b", "c", "d", "e", "big")}
        await kv.delete("gone")
    servers = {cs.server_id for cs in cluster.chunkservers if cs is not None}
    made: list[int] = []

    def switch(key: str, extent: int, *, to: int | None = None, stale: bool = False,
               misfiled: bool = False) -> rpc.ReplicaSwitch:
        layout = lay[key]
        assert layout is not None
        x = layout.extents[extent]
        lost = x.replicas[0]
        if stale:  # not where the layout has it (an overwrite or compaction moved it)
            lost = Replica(lost.server_id, lost.chunk_id, lost.offset + 1)
        spare = to if to is not None else (servers - {r.server_id for r in x.replicas}).pop()
        seq = 900 + len(made)  # a chunk of its own: only the one retired below is retired
        made.append(seq)
        named = lost.server_id if misfiled else spare  # (misfiled: a chunk of the lost replica's server)
        return rpc.ReplicaSwitch(key.encode(), extent, lost, Replica(spare, make_chunk_id(named, seq), 0))

    items = [switch("gone", 0), switch("a", 0, to=99), switch("b", 0, stale=True), switch("d", 0),
             switch("e", 0, misfiled=True), switch("big", 0), switch("big", 1), switch("c", 0)]
    retired = items[3].new
    async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
        got = await gc.meta(rpc.GcRetire(server_id=retired.server_id, chunks=[retired.chunk_id]))
        assert list(got.retired) == [retired.chunk_id]
        r = await gc.meta(rpc.GcRepair(items=items))
        assert (r.repaired, r.skipped) == (3, 5)
        metrics = (await gc.status())["metrics"]
    big, c = lay["big"], lay["c"]
    assert big is not None and c is not None
    assert (metrics["extents_repaired"], metrics["bytes_repaired"]) == (
        3, big.extents[0].length + big.extents[1].length + c.extents[0].length)
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        assert await kv.layout("gone") is None
        for k in ("a", "b", "d", "e"):
            assert await kv.layout(k) == lay[k], k
        now_big, now_c = await kv.layout("big"), await kv.layout("c")
        assert now_big is not None and now_c is not None
        for i, it in ((0, items[5]), (1, items[6])):  # the new copy in the lost replica's place
            assert now_big.extents[i].replicas == (it.new, *big.extents[i].replicas[1:])
        assert now_big.extents[2:] == big.extents[2:]
        assert now_c.extents[0].replicas == (items[7].new, *c.extents[0].replicas[1:])


async def test_keys_deleted_while_their_repair_copies_are_switched_keep_tombstones_covering_them(
        tmp_path: Path) -> None:
    """A repair copies two keys' records, one to each of the two other servers (into chunks
    meta has not heard of: no heartbeat since); the keys are deleted before GC_REPAIR
    arrives.  The copies are older records of deleted keys, so each tombstone's horizon must
    reach its copy's chunk (a rebuild after the tombstone went would bring the key back from
    the copy), and still does after a restart of meta (written through).  The tombstones
    land on one server: at least one copy is on another, where only GC_REPAIR raises it."""
    root = tmp_path / "c"
    quiet = ChunkServerConfig(data=root, heartbeat_interval_s=3600, capacity_bytes=64 << 20)
    async with (LocalCluster(root, 3, chunkserver=quiet) as c, c.client() as kv,
                GarbageCollector(c.addr, token=c.admin_token) as gc):
        await kv.put_many({"k1": b"1" * 5000, "k2": b"2" * 5000})  # one APPEND: one server
        lays = [await kv.layout(k) for k in ("k1", "k2")]
        srcs = [lay.extents[0].replicas[0] for lay in lays if lay is not None]
        (a,) = {r.server_id for r in srcs}
        b, d = sorted({cs.server_id for cs in c.chunkservers if cs is not None} - {a})
        items = [rpc.RepairItem(k, 0, lay.extents[0].length, lay.extents[0].crc, None, (src,), src, holders)
                 for k, lay, src, holders in zip((b"k1", b"k2"), lays, srcs, ((a, d), (a, b)), strict=True)
                 if lay is not None]
        await gc.sync_usage()  # the free space copy_extents places by (b and d empty)
        repair = hold(c, Op.GC_REPAIR)
        copying = asyncio.create_task(copy_extents(gc, items, RepairReport()))
        await repair.reached(copying)  # both copies appended, not switched yet
        copies = {}  # key -> (server, chunk) of its copy
        for key, sid in ((b"k1", b), (b"k2", d)):
            cs = c.chunkservers[c.index_of(sid)]
            assert cs is not None
            (copies[key],) = ((sid, chunk) for chunk in cs.store.sizes)  # its only chunk
        assert await kv.delete_many(["k1", "k2"]) == 2
        repair.release()
        assert await copying == 0  # deleted since the plan: nothing switched

        def tombs_cover_the_copies() -> None:
            assert c.meta is not None and isinstance(c.meta.index, MetaIndex)
            for key, (sid, chunk) in copies.items():
                horizon = c.meta.index.tombstones[key].horizon
                seq = horizon.get(sid)
                assert seq is not None and seq >= chunk_seq(chunk), (key, sid, chunk, horizon)

        tombs_cover_the_copies()
        await c.stop_meta()
        await c.start_meta()
        tombs_cover_the_copies()


async def test_a_drain_is_asked_about_started_and_cancelled(cluster: LocalCluster) -> None:
    """GC_DECOMMISSION with start=False only asks (a server not draining stays so); start
    drains it (its extents and bytes counted); cancel ends the drain, nothing forgotten;
    asking again does not start it."""
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many([(f"c{i}", bytes([i]) * 3000) for i in range(12)])
        lays = [await kv.layout(f"c{i}") for i in range(12)]
    assert lays[0] is not None
    sid = lays[0].extents[0].replicas[0].server_id  # a server holding replicas
    mine = [x for lay in lays if lay is not None for x in lay.extents
            if any(r.server_id == sid for r in x.replicas)]

    def state(draining: bool) -> rpc.DrainState:
        return rpc.DrainState(server_id=sid, draining=draining, forgotten=False, extents_left=len(mine),
                              bytes_left=sum(x.length for x in mine))

    async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
        assert await gc.meta(rpc.GcDecommission(server_id=sid, start=False)) == state(False)
        assert await gc.meta(rpc.GcDecommission(server_id=sid, start=False)) == state(False)
        assert await gc.meta(rpc.GcDecommission(server_id=sid)) == state(True)
        assert await gc.meta(rpc.GcDecommission(server_id=sid, start=False)) == state(True)
        assert await gc.meta(rpc.GcDecommission(server_id=sid, cancel=True)) == state(False)
        assert await gc.meta(rpc.GcDecommission(server_id=sid, start=False)) == state(False)
    rc, out = await kvfs_admin(cluster, "stat", "--json")
    row = next(s for s in json.loads(out)["servers"] if s["server_id"] == sid)
    assert rc == 0 and not row["draining"]
