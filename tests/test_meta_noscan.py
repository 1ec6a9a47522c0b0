"""``kvfs stat``, ``kvfs gc status``, a dry GC pass, a compaction's chunk references, a drain's
state and a repair plan while a server is gone give the same answers over both meta backends; over
Redis they read the store's counters, expiry index, chunk index and server index, and a
read of every key (``RedisMetaStore.scan``, made to fail here: fault injection) is never
made.  What each costs in Redis commands is tests/test_redis_index.py's."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import FakeClock
from poll import until_dead

from kvfs import rpc
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig, MetaConfig
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.gc.scrub import verify_all
from kvfs.launcher import LocalCluster
from kvfs.layout import Layout, server_of_chunk
from kvfs.meta.index import add_live

pytestmark = pytest.mark.usefixtures("meta_backend")  # each test over SQLite and Redis


@pytest.fixture(autouse=True)
def no_full_reads(meta_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On Redis, reading every key fails the test."""
    if meta_backend == "redis":
        from kvfs.meta.redis_store import RedisMetaStore

        def refuse(self: RedisMetaStore, batch: int = 1000) -> AsyncIterator[list[tuple[bytes, Layout]]]:
            raise AssertionError("meta read every key of the store (RedisMetaStore.scan)")

        monkeypatch.setattr(RedisMetaStore, "scan", refuse)


@pytest.fixture
async def cluster(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    root = tmp_path / "cluster"
    # (duplicates: test_repair's cluster fixture, here on a fake clock and over both backends)
    c = LocalCluster(root, 3, clock=clock, meta=MetaConfig(
        data=root / "meta", listen="127.0.0.1:0", heartbeat_timeout_s=0.5, dead_after_s=1.0))
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


async def test_stat_status_refs_and_repair_plan_without_reading_every_key(
        cluster: LocalCluster, clock: FakeClock, meta_backend: str) -> None:
    keep = {f"k{i}": bytes([i]) * (500 + 37 * i) for i in range(30)}
    ttl = {f"t{i}": b"t" * (200 + i) for i in range(6)}
    kv: AsyncClient = cluster.client(ClientConfig(replicas=2))
    kv.clock = clock
    async with kv:
        await kv.put_many(list(keep.items()))
        await kv.put_many(list(ttl.items()), ttl=10)
        lays = {k: await kv.layout(k) for k in [*keep, *ttl]}
        assert all(v is not None for v in lays.values())

        st = await kv.stats()
        assert (st["keys"], st["keys_stored"]) == (36, 36)
        assert st["bytes"] == sum(map(len, keep.values())) + sum(map(len, ttl.values()))
        clock.advance(11)
        st = await kv.stats()
        assert (st["keys"], st["keys_stored"], st["bytes"]) == (30, 36, sum(map(len, keep.values())))

        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            status = await gc.status()
            assert status["expired_keys"] == 6
            if meta_backend == "redis":  # (SQLite's follow the chunk tables heartbeats bring)
                # live bytes per server, in stat and gc status, are the store's counters:
                # exactly what the layouts add up to
                by_chunk: dict[int, int] = {}
                for k, v in lays.items():
                    add_live(by_chunk, v, 1, k.encode())
                want = Counter[int]()
                for c, n in by_chunk.items():
                    want[server_of_chunk(c)] += n
                live = {s["server_id"]: s["live"] for s in st["servers"]}
                assert live == {s["server_id"]: s["live"] for s in status["servers"]}
                assert live == {sid: want[sid] for sid in live} and sum(live.values()) > 0
            per_server = Counter(sid for k in ttl for sid in
                                 {r.server_id for x in lays[k].extents for r in x.replicas})
            assert {s["server_id"]: s["expired_keys"] for s in status["servers"]} == {
                sid: per_server.get(sid, 0) for sid in (s["server_id"] for s in status["servers"])}
            dry = await gc.meta(rpc.GcExpire(apply=False, limit=1000))
            assert (dry.keys, dry.more) == (6, False)

            # a compaction's references: every unexpired key in those chunks, nothing else
            some = lays["k3"].extents[0].replicas[0]
            chunks = {some.chunk_id, lays["k17"].extents[0].replicas[-1].chunk_id}
            want = {(c, k, r.offset) for k in keep for x in lays[k].extents for r in x.replicas
                    if (c := r.chunk_id) in chunks}
            got = (await gc.meta(rpc.GcChunkRefs(chunks=sorted(chunks)))).refs
            assert {(c, r.key.decode(), r.offset) for c, rs in got.items() for r in rs} == want
            # fsck's and the scrub's walk (GC_LAYOUTS pages): every unexpired key's range on
            # the server, nothing else, and none of them bad
            checked, failed = await verify_all(gc, [some.server_id])
            v = checked[some.server_id]
            assert not failed and not v.missing and not v.corrupt
            assert v.ranges == sum(1 for k in keep for x in lays[k].extents for r in x.replicas
                                   if r.server_id == some.server_id and x.length)

            # a dry GC pass (its expire, evict and compaction dry runs) and a drain's question
            dry_pass = await gc.run_pass(PassOptions(apply=False, grace_s=0.0))
            assert dry_pass.expired_keys == 6
            victim = some.server_id
            extents = [x for v in lays.values() for x in v.extents
                       if any(r.server_id == victim for r in x.replicas)]  # expired ones too
            drain = await gc.meta(rpc.GcDecommission(server_id=victim, start=False))
            assert (drain.draining, drain.extents_left, drain.bytes_left) == (
                False, len(extents), sum(x.length for x in extents))

            # a server gone: the plan names every extent of an unexpired key it held
            await cluster.stop_chunkserver(cluster.index_of(victim))
            await until_dead(cluster, victim)
            plan = await gc.meta(rpc.GcRepairPlan(limit_bytes=1 << 30))
            held = {(k, i) for k in keep for i, x in enumerate(lays[k].extents)
                    if any(r.server_id == victim for r in x.replicas)}
            assert held
            assert {(it.key.decode(), it.extent) for it in plan.items} == held
            assert plan.under_replicated_extents == len(held)
            assert plan.unrepairable_extents == 0
            status = await gc.status()
            assert status["repair"]["under_replicated_extents"] == len(held)
            assert (await kv.stats())["keys"] == 30
