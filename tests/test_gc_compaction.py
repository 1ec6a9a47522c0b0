"""GC: compaction, zero-live chunk deletion, races with reads/overwrites, crash between copy and switch."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock, value_of
from conftest import clocked_client as client

from kvfs import rpc
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, ClientConfig, MetaConfig
from kvfs.errors import InvalidArgument
from kvfs.gc import driver
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster, ProcessCluster

pytestmark = pytest.mark.usefixtures("meta_backend")  # each test over SQLite and Redis


def du(root: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in root.glob("cs*/chunks/*.chunk"))


@pytest.fixture
async def small(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    """Three chunkservers with 256 KiB chunks, so a few puts seal several chunks."""
    root = tmp_path / "small"
    c = LocalCluster(root, 3, clock=clock, chunkserver=ChunkServerConfig(
        data=root, heartbeat_interval_s=0.2, chunk_bytes=256 * 1024))
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


async def fill(kv: AsyncClient, n: int = 400, batch: int = 20) -> list[str]:
    keys = [f"k{i:04d}" for i in range(n)]
    for i in range(0, n, batch):
        await kv.put_many([(k, value_of(k)) for k in keys[i : i + batch]])
    return keys


@pytest.mark.parametrize(("dead", "only_needed", "trimmed"), [
    (1, False, True),  # under the threshold (1 of 7 values): only while the server needs room
    (3, False, False),  # over it (3 of 7): every one, as before
    (3, True, True),  # over it, for a writer (MAKE_ROOM's pass): only while the server needs room
])
async def test_a_server_under_pressure_compacts_only_until_it_is_at_its_low_watermark(
        tmp_path: Path, clock: FakeClock, dead: int, only_needed: bool, trimmed: bool) -> None:
    """Over its high watermark, every chunk of a server with any garbage is a candidate
    (meta's plan), and a pass copied them all, mostly live: a writer's MAKE_ROOM pass on a
    full cluster took up to 2-3 s (bench/RESULTS.md).  Now it takes those under the garbage
    threshold, most garbage first, only until what they free brings the server's used
    bytes to its low watermark (with ``only_needed``, MAKE_ROOM's, those over it too); the
    rest wait for a pass that needs them."""
    root = tmp_path / "pressure"
    value = 8 * 1024
    async with LocalCluster(root, 1, clock=clock, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, chunk_bytes=64 * 1024, capacity_bytes=4 << 20)) as c:
        async with client(c, clock) as kv:
            keys = [f"p{i:03d}" for i in range(120)]
            for k in keys:
                await kv.put(k, value_of(k, value))
            by_chunk: dict[int, list[str]] = {}
            for k in keys:
                by_chunk.setdefault((await kv.layout(k)).extents[0].replicas[0].chunk_id, []).append(k)
            sealed = [ks for ks in by_chunk.values() if len(ks) == 7]  # (the open one: fewer)
            assert len(sealed) >= 12, [len(ks) for ks in by_chunk.values()]
            doomed = [k for ks in sealed for k in ks[:dead]]
            await kv.delete_many(doomed)
            cs = c.chunkservers[0]
            assert cs is not None
            capacity, _, used = cs.store.usage()
            # over its watermarks, with 3.5 chunks' garbage to free
            mark = (used - 3.5 * dead * value) / capacity
            opts = PassOptions(apply=True, grace_s=0, evict=False, expire=False, high=mark, low=mark,
                               only_needed=only_needed)
            async with GarbageCollector(c.addr, token=c.admin_token) as gc:
                r = await gc.run_pass(opts)
                planned = r.chunks_compacted + r.compact_deferred  # (the sealed ones, and on a
                assert planned >= len(sealed), r  # Redis meta the tombstones' chunk: none kept)
                if not trimmed:  # (every sealed one: over the threshold)
                    assert r.chunks_compacted >= len(sealed), r
                else:
                    assert 4 <= r.chunks_compacted <= 5, r
                    _, _, after = cs.store.usage()
                    assert after <= mark * capacity, (after, mark * capacity)
                    first = r.chunks_compacted
                    r = await gc.run_pass(dataclasses.replace(opts, high=0.0, low=0.0))  # (every byte wanted)
                    assert (r.chunks_compacted, r.compact_deferred) == (planned - first, 0), r
        async with client(c, clock) as fresh:
            live = [k for k in keys if k not in doomed]
            assert await fresh.get_many(live) == [value_of(k, value) for k in live]


async def test_compaction_keeps_live_keys_and_shrinks_disk(small: LocalCluster, clock: FakeClock) -> None:
    async with client(small, clock) as kv:
        ttl = [f"ttl{i}" for i in range(3)]
        await kv.put_many([(k, value_of(k)) for k in ttl], ttl=3600)
        ttl_before = {k: await kv.layout(k) for k in ttl}
        keys = await fill(kv)
        rng = random.Random(1)
        dead = set(rng.sample(keys, 280))
        await kv.delete_many(sorted(dead))
        before = du(small.root)
        async with GarbageCollector(small.addr, token=small.admin_token) as gc:
            dry = await gc.run_pass(PassOptions(apply=False, grace_s=0))
            assert dry.compact_candidates > 0 and dry.reclaimable_bytes > 0
            assert du(small.root) == before
            r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
            assert r.chunks_compacted > 0 and r.chunks_deleted > 0
            assert r.relocations_lost == 0
            st = await gc.status()
        after = du(small.root)
        assert after < before * 0.6, (before, after)
        assert st["metrics"]["chunks_compacted"] == r.chunks_compacted
    async with client(small, clock) as fresh:
        live = [k for k in keys if k not in dead]
        assert await fresh.get_many(live) == [value_of(k) for k in live]
        assert await fresh.get_many(sorted(dead)) == [None] * len(dead)
        # TTL keys moved by compaction keep their expiry: still there until it, gone after
        for k, lay in ttl_before.items():
            moved = await fresh.layout(k)
            assert lay is not None and moved is not None and moved.extents != lay.extents
            assert moved.expires_at == lay.expires_at
        assert await fresh.get_many(ttl) == [value_of(k) for k in ttl]
    clock.advance(3601)
    async with client(small, clock) as fresh:
        assert await fresh.get_many(ttl) == [None] * len(ttl)


async def test_compaction_relocates_many_small_values_in_requests_meta_accepts(
        small: LocalCluster, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of small values makes many moves: its GC_RELOCATE goes in requests of at most
    RELOCATE_BATCH_BYTES of moves (here about 10), not one (800k keys of 16-byte values made
    a 21-31 MB request, past meta's 16 MiB limit, so such chunks were never compacted:
    bench/RESULTS.md); every move is applied, and nothing is lost."""
    monkeypatch.setattr(driver, "RELOCATE_BATCH_BYTES", 10 * (5 + driver.MOVE_OVERHEAD))
    sent: list[int] = []
    ask = GarbageCollector.meta

    async def counted(gc: GarbageCollector, request: Any) -> Any:
        if isinstance(request, rpc.GcRelocate):
            sent.append(len(request.moves))
        return await ask(gc, request)

    monkeypatch.setattr(GarbageCollector, "meta", counted)
    async with client(small, clock) as kv:
        keys = await fill(kv)
        dead = set(keys[::2])
        await kv.delete_many(sorted(dead))
        async with GarbageCollector(small.addr, token=small.admin_token) as gc:
            r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
    assert r.chunks_compacted > 0 and r.relocations_lost == 0, r
    assert max(sent) == 10 and len(sent) > r.chunks_compacted, sent  # (keys of 5 bytes)
    assert 0 < r.keys_relocated <= sum(sent)  # (on SQLite the deletes' tombstones move too)
    async with client(small, clock) as fresh:
        live = [k for k in keys if k not in dead]
        assert await fresh.get_many(live) == [value_of(k) for k in live]


async def test_compaction_keeps_its_relocations_under_the_limit_meta_tells(tmp_path: Path) -> None:
    """A meta run with a small ``--max-header`` (here 64 KiB, which it names at AUTH): a
    compaction's moves go in requests of at most half of it, so the chunks of 6,000 small
    values (about 160 KB of moves) are still compacted."""
    root = tmp_path / "c"
    async with (LocalCluster(root, 1, meta=MetaConfig(data=root / "meta", listen="127.0.0.1:0",
                                                      max_header_bytes=64 * 1024),
                             chunkserver=ChunkServerConfig(data=root, chunk_bytes=256 * 1024)) as c,
                c.client() as kv):
        keys = [b"k%05d" % i for i in range(12_000)]
        for i in range(0, len(keys), 500):  # (calls under meta's limit too)
            await kv.put_many([(k, b"v") for k in keys[i : i + 500]])
            await kv.delete_many(keys[i : i + 500 : 2])
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
        assert r.chunks_compacted > 0 and r.keys_relocated >= 6_000 and r.relocations_lost == 0, r
        assert [v for i in range(1, 12_000, 1000)
                for v in await kv.get_many(keys[i : i + 999 : 2])] == [b"v"] * 6_000


async def test_compaction_of_replicated_values_keeps_the_other_replica(small: LocalCluster,
                                                                       clock: FakeClock) -> None:
    """GC_RELOCATE switches one server's replicas at a time: a key with two replicas keeps
    the other server's replica (switched by that server's own GC_RELOCATE, or not at all)."""
    kv = small.client(ClientConfig(replicas=2))
    kv.clock = clock
    async with kv:
        keys = await fill(kv, n=200)
        dead = set(random.Random(2).sample(keys, 140))
        await kv.delete_many(sorted(dead))
        live = [k for k in keys if k not in dead]
        before = {k: await kv.layout(k) for k in live}
        async with GarbageCollector(small.addr, token=small.admin_token) as gc:
            r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
        assert r.chunks_compacted > 0 and r.relocations_lost == 0
    async with client(small, clock) as fresh:
        moved = 0
        for k, old in before.items():
            new = await fresh.layout(k)
            assert old is not None and new is not None
            reps = [rep for e in new.extents for rep in e.replicas]
            assert len({rep.server_id for rep in reps}) == len(reps) == 2, (k, new)
            moved += new.extents != old.extents
        assert moved > 0
        assert await fresh.get_many(live) == [value_of(k) for k in live]


async def test_grace_period_keeps_old_chunk_for_in_flight_reads(small: LocalCluster, clock: FakeClock) -> None:
    async with client(small, clock) as kv:
        keys = await fill(kv, 200)
        await kv.delete_many(keys[::2])
        async with GarbageCollector(small.addr, token=small.admin_token) as gc:
            r = await gc.run_pass(PassOptions(apply=True, grace_s=60))
            assert r.chunks_compacted > 0
            assert r.waiting_grace > 0
            # a reader holding a pre-compaction layout still reads the old chunk
            assert await kv.get_many(keys[1::2]) == [value_of(k) for k in keys[1::2]]
            clock.advance(61)
            r2 = await gc.run_pass(PassOptions(apply=True, grace_s=60))
            assert r2.chunks_deleted > 0
        # the cached layouts now name deleted chunks: StaleLayout -> re-lookup -> right bytes
        assert await kv.get_many(keys[1::2]) == [value_of(k) for k in keys[1::2]]


async def test_reads_racing_compaction_return_right_bytes(small: LocalCluster, clock: FakeClock) -> None:
    """Readers holding pre-compaction layouts read during and after a pass that copies and
    deletes (no grace) every chunk: a live key always comes back with its exact bytes,
    through StaleLayout -> re-lookup, never as a miss."""
    async with client(small, clock) as kv:
        keys = await fill(kv)
        await kv.delete_many(keys[::2])
        live = keys[1::2]
        want = [value_of(k) for k in live]
        warm = [asyncio.Event() for _ in range(4)]
        done = asyncio.Event()
        reads = 0
        lookups: list[int] = []

        async def reader(seed: int) -> None:
            nonlocal reads
            rng = random.Random(seed)
            async with client(small, clock) as r:
                assert await r.get_many(live) == want  # every live layout cached, pre-compaction
                warm[seed].set()
                while not done.is_set():
                    sample = rng.sample(live, 16)
                    got = await r.get_many(sample)
                    for k, v in zip(sample, got, strict=True):
                        assert v == value_of(k), k  # a live key: never a miss
                    reads += 1
                    await asyncio.sleep(0)
                # after the pass every chunk of the cached layouts is gone
                assert await r.get_many(live) == want
                lookups.append(r.rpc_counts["LOOKUP"])

        tasks = [asyncio.create_task(reader(i)) for i in range(4)]
        try:
            async with asyncio.timeout(60):
                await asyncio.gather(*(w.wait() for w in warm))
            async with GarbageCollector(small.addr, token=small.admin_token) as gc:
                r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
                assert r.chunks_compacted > 0 and r.chunks_deleted > 0
        finally:
            done.set()
            await asyncio.gather(*tasks)
        assert reads > 0
        assert all(n > 1 for n in lookups), lookups  # each reader re-looked-up stale layouts
    async with client(small, clock) as fresh:
        assert await fresh.get_many(live) == want


async def test_compaction_leaves_a_corrupt_record_behind(small: LocalCluster, clock: FakeClock) -> None:
    """A live value whose bytes rotted on disk is not copied forward (its key keeps pointing
    at the old chunk, which is then kept); every other record of that chunk is copied."""
    async with client(small, clock) as kv:
        keys = await fill(kv, 100)
        await kv.delete_many(keys[::2])
        live = keys[1::2]
        bad = live[len(live) // 2]
        before = {k: await kv.layout(k) for k in live}
        lay = before[bad]
        assert lay is not None
        rep = lay.extents[0].replicas[0]
        neighbours = [k for k, v in before.items() if k != bad and v is not None
                      and v.extents[0].replicas[0].chunk_id == rep.chunk_id]
        assert neighbours
        (path,) = small.root.glob(f"cs*/chunks/{rep.chunk_id:016x}.chunk")
        with open(path, "r+b") as f:
            f.seek(rep.offset + 100)
            f.write(b"\x00" if value_of(bad)[100] else b"\x01")
        async with GarbageCollector(small.addr, token=small.admin_token) as gc:
            r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
        assert r.chunks_compacted > 0 and r.relocations_lost == 0
        assert path.exists()  # still referenced by the corrupt key
    async with client(small, clock) as fresh:
        assert await fresh.layout(bad) == lay
        for k in neighbours:
            moved = await fresh.layout(k)
            assert moved is not None and moved.extents[0].replicas[0].chunk_id != rep.chunk_id
        good = [k for k in live if k != bad]
        assert await fresh.get_many(good) == [value_of(k) for k in good]
        assert await fresh.get(bad) is None  # a miss (on_lost="miss"), never wrong bytes


async def copy_only(gc: GarbageCollector, kv: AsyncClient) -> tuple[int, int, rpc.Compacted, list[rpc.Ref]]:
    """The first half of a compaction: copy one chunk's live records, do not switch yet."""
    await gc.sync_usage()
    plan = await gc.meta(rpc.GcPlan(threshold=0.0, grace_s=1e9, high=1.0))
    sid, cid, _, _ = plan.compact[0]
    refs = (await gc.meta(rpc.GcChunkRefs(chunks=[cid]))).refs[cid]
    res = await gc.chunkserver(sid, rpc.ChunkCompact(
        sources=[rpc.CompactSource(cid, [rpc.Span(r.offset, r.length) for r in refs])]))
    assert res.chunk_id is not None
    return sid, cid, res, refs


async def test_overwrite_and_delete_racing_compaction_win(small: LocalCluster, clock: FakeClock) -> None:
    async with client(small, clock) as kv:
        keys = await fill(kv)
        await kv.delete_many(keys[::3])
        async with GarbageCollector(small.addr, token=small.admin_token) as gc:
            sid, cid, res, refs = await copy_only(gc, kv)
            over, gone = refs[0].key.decode(), refs[1].key.decode()
            await kv.put(over, b"newer value")  # lands between copy and switch
            await kv.delete(gone)
            assert res.chunk_id is not None
            moves = [rpc.Move(r.key, cid, r.offset, loc) for r, loc in zip(refs, res.locations[0], strict=True)
                     if loc is not None]
            with pytest.raises(InvalidArgument, match=rf"^GC_RELOCATE to chunkserver {sid + 1}: chunk id "
                                                      rf"\S+ is chunkserver {sid}'s"):  # (its id names sid)
                await gc.meta(rpc.GcRelocate(server_id=sid + 1, new_chunk=res.chunk_id, new_size=res.size,
                                             moves=moves))
            rel = await gc.meta(rpc.GcRelocate(server_id=sid, new_chunk=res.chunk_id, new_size=res.size,
                                               moves=moves))
            assert rel.skipped == 2 and rel.moved == len(refs) - 2
            await gc.run_pass(PassOptions(apply=True, grace_s=0))
        async with client(small, clock) as fresh:
            assert await fresh.get(over) == b"newer value"
            assert await fresh.get(gone) is None
            rest = [k for k in keys[1:] if k not in (over, gone) and k not in keys[::3]]
            assert await fresh.get_many(rest) == [value_of(k) for k in rest]


async def test_a_pass_seals_compacts_and_deletes_only_on_the_servers_it_reached(
        small: LocalCluster, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    """A chunkserver that is down (meta has not declared it dead yet) costs a pass its failed
    CHUNK_STATS: the pass seals, compacts and deletes on the others, and sends it none of
    those (each failed, and logged, again on every pass; meta's MAKE_ROOM passes on a full
    cluster run back to back).  It is said once: the next pass's warning about it is held
    back (kvfs.gc.logs).  Once it is back, a pass compacts its chunks too."""
    async with client(small, clock) as kv:
        keys = await fill(kv)
        await kv.delete_many(keys[::3] + keys[1::3])
    down = small.chunkservers[0]
    assert down is not None
    sid = down.server_id
    async with GarbageCollector(small.addr, token=small.admin_token) as gc:
        await gc.sync_usage()  # meta knows each server's chunks as the deletes left them
        plan = await gc._plan(PassOptions(apply=True, grace_s=0))
        assert any(c.server_id == sid for c in (*plan.seal, *plan.compact, *plan.delete))
    await small.stop_chunkserver(0)
    sent: list[tuple[int, str]] = []
    async with GarbageCollector(small.addr, token=small.admin_token) as gc:
        real = gc.chunkserver

        async def spy(server_id: int, request: Any, *args: Any, **kw: Any) -> Any:
            sent.append((server_id, type(request).__name__))
            return await real(server_id, request, *args, **kw)

        gc.chunkserver = spy  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="kvfs.gc"):
            r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
            assert r.chunks_compacted > 0 and r.chunks_deleted > 0  # on the servers it reached
            assert {op for s, op in sent if s == sid} <= {"ChunkStats"}, sent  # (none once meta says it is dead)
            await gc.run_pass(PassOptions(apply=True, grace_s=0))  # the same again: held back
        said = [m.getMessage() for m in caplog.records if m.name.startswith("kvfs.gc")]
        assert len(said) == 1 and said[0].startswith(f"chunkserver {sid} ("), said
        await small.start_chunkserver(0)
        sent.clear()
        r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
        assert r.chunks_compacted > 0
        assert {"ChunkStats", "ChunkCompact"} <= {op for s, op in sent if s == sid}, sent


async def test_gc_abandoned_after_copy_leaves_reclaimable_leftover(small: LocalCluster, clock: FakeClock) -> None:
    async with client(small, clock) as kv:
        keys = await fill(kv)
        await kv.delete_many(keys[::2])
        async with GarbageCollector(small.addr, token=small.admin_token) as gc:
            _, _, res, _ = await copy_only(gc, kv)  # ... and the GC dies here
        (leftover,) = small.root.glob(f"cs*/chunks/{res.chunk_id:016x}.chunk")
        assert leftover.exists()
        async with client(small, clock) as fresh:
            assert await fresh.get_many(keys[1::2]) == [value_of(k) for k in keys[1::2]]
        async with GarbageCollector(small.addr, token=small.admin_token) as gc:
            await gc.run_pass(PassOptions(apply=True, grace_s=0))
        assert not leftover.exists()
        async with client(small, clock) as fresh:
            assert await fresh.get_many(keys[1::2]) == [value_of(k) for k in keys[1::2]]


@pytest.mark.subprocess
async def test_kill_9_meta_between_copy_and_switch(proc_cluster: ProcessCluster) -> None:
    async with proc_cluster.client() as kv:
        keys = [f"p{i:03d}" for i in range(120)]
        for i in range(0, len(keys), 10):
            await kv.put_many([(k, value_of(k, 8192)) for k in keys[i : i + 10]])
        await kv.delete_many(keys[::2])
        async with GarbageCollector(proc_cluster.addr, token=proc_cluster.admin_token) as gc:
            stats = await gc.sync_usage()
            for sid, st in stats.items():  # seal the open chunks so they can be compacted
                if st.open is None:  # placement is random: a server may have got no batch
                    continue
                assert (await gc.chunkserver(sid, rpc.ChunkSeal(chunk_id=st.open, idle_s=0))).sealed
            _, _, res, _ = await copy_only(gc, kv)
        (leftover,) = proc_cluster.data.glob(f"cs*/chunks/{res.chunk_id:016x}.chunk")
        assert leftover.exists()
        assert proc_cluster.meta is not None
        proc_cluster.meta.kill()  # SIGKILL
        await proc_cluster.meta.stop()
        await proc_cluster.start_meta(proc_cluster.addr.removeprefix("kvfs://"))
    async with proc_cluster.client() as fresh:
        live = keys[1::2]
        assert await fresh.get_many(live) == [value_of(k, 8192) for k in live]
        async with GarbageCollector(proc_cluster.addr, token=proc_cluster.admin_token) as gc:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while len([s for s in await gc.servers() if s.alive]) < 3:  # chunkservers re-register
                assert loop.time() < deadline, "chunkservers did not come back"
                await asyncio.sleep(0.05)
            await gc.run_pass(PassOptions(apply=True, grace_s=0))
        assert not leftover.exists()
        assert await fresh.get_many(live) == [value_of(k, 8192) for k in live]
