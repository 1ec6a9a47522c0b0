"""The three GC safety guards of :mod:`kvfs.meta.gc`, each driven through its race.

Each test holds one RPC in meta's dispatch (:class:`Hold`) so that meta applies
racing RPCs in the order the test chooses, then checks the bytes a fresh
client reads back. Each fails when its guard is removed (see tests/MUTATION.md):

- GC_RETIRE refuses a chunk that a committed layout references
  (``chunk_live <= 0``);
- COMMIT refuses a layout naming a retired chunk (``MetaIndex.dead_in``);
- GC_RELOCATE switches only a replica still at the copied (chunk, offset),
  and never into a chunk another GC has retired since the copy.

One chunkserver, so every put lands on the server being collected: placement
plays no part and every interleaving is deterministic. The cluster runs on a
fake clock; the passes use ``grace_s=0`` (the chunkserver's seal idles on the
real monotonic clock), so no step waits on time.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import conftest
import pytest
from conftest import FakeClock, Hold, hold
from conftest import clocked_client as client

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.config import ChunkServerConfig
from kvfs.errors import StaleLayout
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster
from kvfs.meta.index import RECORD_OVERHEAD_BYTES, stale
from kvfs.packed import unpack
from kvfs.rpc import Op
from kvfs.transport import Connection

pytestmark = pytest.mark.usefixtures("meta_backend")  # each test over SQLite and Redis

NOW = PassOptions(apply=True, grace_s=0)


value_of = functools.partial(conftest.value_of, size=8192)


@pytest.fixture
async def one(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    root = tmp_path / "one"
    c = LocalCluster(root, 1, clock=clock, chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2))
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def chunk_files(c: LocalCluster) -> set[str]:
    return {p.name for p in c.root.glob("cs*/chunks/*.chunk")}


async def test_retire_refuses_a_chunk_a_commit_made_live(one: LocalCluster, clock: FakeClock) -> None:
    """put appends; GC plans the (still unreferenced) chunk for deletion; the commit lands;
    then GC_RETIRE arrives: it must see the new reference and retire nothing."""
    commit = hold(one, Op.COMMIT)
    retire = hold(one, Op.GC_RETIRE)
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        put = asyncio.create_task(kv.put("k", value_of("k")))
        await commit.reached(put)  # the bytes are appended, meta has not seen them
        gc_pass = asyncio.create_task(gc.run_pass(NOW))
        await retire.reached(gc_pass)  # sealed, planned for deletion as unreferenced
        files = chunk_files(one)
        assert len(files) == 1
        commit.release()
        await put  # the commit wins: the chunk was not retired yet
        retire.release()
        report = await gc_pass
        assert report.chunks_deleted == 0
        assert chunk_files(one) == files
    async with client(one, clock) as fresh:
        assert await fresh.get("k") == value_of("k")


async def _open_chunk_of_one_ttl_key(one: LocalCluster, clock: FakeClock) -> tuple[int, int]:
    """Put one key with a 60 s TTL; (chunk id, server id) of the open chunk it went to, once
    meta knows that chunk as the server's open one (from a heartbeat)."""
    async with client(one, clock) as kv:
        await kv.put("k", value_of("k"), ttl=60)
        lay = await kv.layout("k")
    assert lay is not None and one.meta is not None
    open_chunk, sid = lay.extents[0].replicas[0].chunk_id, lay.extents[0].replicas[0].server_id
    s = one.meta.index.servers[sid]
    deadline = time.monotonic() + 30
    while s.open_chunk != open_chunk:
        assert time.monotonic() < deadline, s.open_chunk
        await asyncio.sleep(0.05)
    return open_chunk, sid


async def test_retire_never_takes_a_servers_open_chunk(one: LocalCluster, clock: FakeClock) -> None:
    """The chunk appends go to holds no live bytes once its only key expired; GC_RETIRE
    naming it (a plan made before the server opened it) retires nothing: the next put lands
    in it and reads back."""
    open_chunk, sid = await _open_chunk_of_one_ttl_key(one, clock)
    clock.advance(61)
    host, port = parse_addr(one.addr)
    conn = await Connection.open(host, port, one.admin_token)
    try:
        expired = await conn.call(rpc.GcExpire(apply=True))
        assert expired.keys == 1  # the chunk holds no live bytes now
        r = await conn.call(rpc.GcRetire(server_id=sid, chunks=[open_chunk]))
    finally:
        conn.close()
    assert r.retired == []
    async with client(one, clock) as kv:
        await kv.put("k", value_of("k"))
        lay = await kv.layout("k")
        assert lay is not None and lay.extents[0].replicas[0].chunk_id == open_chunk
        assert await kv.get("k") == value_of("k")


async def test_an_open_chunk_without_live_bytes_is_sealed_after_the_grace_period(
        one: LocalCluster, clock: FakeClock) -> None:
    """GC_PLAN plans sealing the open chunk once its only key expired, but not before
    ``grace_s`` has passed since it first saw the chunk without live bytes (a commit into
    it may still be on its way), and it reports the chunk's bytes as none live."""
    open_chunk, sid = await _open_chunk_of_one_ttl_key(one, clock)
    clock.advance(61)
    host, port = parse_addr(one.addr)
    conn = await Connection.open(host, port, one.admin_token)
    try:
        assert (await conn.call(rpc.GcExpire(apply=True))).keys == 1
        first = await conn.call(rpc.GcPlan(grace_s=100, threshold=0.3))
        clock.advance(99)
        early = await conn.call(rpc.GcPlan(grace_s=100, threshold=0.3))
        clock.advance(1)
        due = await conn.call(rpc.GcPlan(grace_s=100, threshold=0.3))
    finally:
        conn.close()
    assert first.seal == early.seal == []
    assert [(c.server_id, c.chunk_id, c.live) for c in due.seal] == [(sid, open_chunk, 0)]
    assert due.seal[0].written >= len(value_of("k"))


async def test_a_retired_chunk_still_listed_is_planned_for_deletion_again(
        one: LocalCluster, clock: FakeClock) -> None:
    """A chunk retired by a GC that stopped before the chunkserver deleted it is planned for
    deletion at once by the next GC_PLAN, whatever its grace period."""
    async with client(one, clock) as kv:
        await kv.put("k", value_of("k"), ttl=60)
        lay = await kv.layout("k")
    assert lay is not None and one.meta is not None
    old, sid = lay.extents[0].replicas[0].chunk_id, lay.extents[0].replicas[0].server_id
    await one.stop_chunkserver(0)
    await one.start_chunkserver(0)  # appends go to a new chunk from here
    async with client(one, clock) as kv:
        await kv.put("k2", value_of("k2"))
    s = one.meta.index.servers[sid]
    deadline = time.monotonic() + 30
    while s.open_chunk in (None, old) or old not in s.chunks:  # a heartbeat from the restarted server
        assert time.monotonic() < deadline, (s.open_chunk, s.chunks)
        await asyncio.sleep(0.05)
    clock.advance(61)
    host, port = parse_addr(one.addr)
    conn = await Connection.open(host, port, one.admin_token)
    try:
        assert (await conn.call(rpc.GcExpire(apply=True))).keys == 1
        assert (await conn.call(rpc.GcRetire(server_id=sid, chunks=[old]))).retired == [old]
        plan = await conn.call(rpc.GcPlan(grace_s=100))
    finally:
        conn.close()
    assert [(d.server_id, d.chunk_id, d.written) for d in plan.delete] == [(sid, old, s.chunks[old])]
    assert plan.waiting == 0


async def test_commit_refuses_a_layout_naming_a_retired_chunk_and_the_client_writes_it_again(
        one: LocalCluster, clock: FakeClock) -> None:
    """put appends; a whole GC pass retires and deletes the unreferenced chunk; then the commit
    arrives: meta must refuse it (StaleLayout), never make a key whose bytes are gone.  The
    client then appends the value again, into a chunk that is there, and commits it."""
    assert one.meta is not None
    sent: list[rpc.Commit] = []
    commit = Hold(one.meta.rpc, Op.COMMIT, when=lambda req: sent.append(req) is None and len(sent) == 1)
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        put = asyncio.create_task(kv.put("k", value_of("k")))
        await commit.reached(put)
        report = await gc.run_pass(NOW)
        assert report.chunks_deleted == 1 and chunk_files(one) == set()
        commit.release()
        assert await put is True
        assert len(sent) == 2 and kv.writer.rewritten == 1  # refused (its chunk was retired), then again
        first, again = (unpack(req.packed, 0.0, None).staged[0][1].extents[0].replicas[0].chunk_id
                         for req in sent)
        assert first != again and chunk_files(one) != set()
        async with client(one, clock) as fresh:
            assert await fresh.get("k") == value_of("k")
            assert (await fresh.layout("k")).extents[0].replicas[0].chunk_id == again  # type: ignore[union-attr]


async def test_a_put_refused_twice_for_retired_chunks_says_so(
        one: LocalCluster, clock: FakeClock, meta_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client writes a refused put's values again once: refused again (injected: meta
    finds every layout's chunk retired), the StaleLayout reaches the caller, the key's
    value before stays, and an if_absent put of a new key stores nothing."""
    if meta_backend == "redis":
        pytest.skip("injected into the local index's check (a meta on Redis checks in its COMMIT script)")
    assert one.meta is not None
    ix = one.meta.index
    commits = 0

    def all_dead(rows: Any, chunks: Any = None) -> None:
        nonlocal commits
        commits += 1
        for key, lay in rows:
            raise stale(key, lay.extents[0].replicas[0].chunk_id)

    async with client(one, clock) as kv:
        await kv.put("k", value_of("k"))
        monkeypatch.setattr(ix, "check_not_dead", all_dead)
        with pytest.raises(StaleLayout, match="retry the put"):
            await kv.put("k", value_of("other"))
        assert commits == 2 and kv.writer.rewritten == 1
        with pytest.raises(StaleLayout, match="retry the put"):
            await kv.put("new", value_of("new"), if_absent=True)
        assert commits == 4 and kv.writer.rewritten == 2
        monkeypatch.undo()
        assert await kv.get("k") == value_of("k")
        assert await kv.get("new") is None
        assert await kv.put("new", value_of("new"), if_absent=True) is True


async def test_an_if_absent_put_whose_commit_was_refused_after_a_part_applied_stored_every_key(
        one: LocalCluster, clock: FakeClock, meta_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A COMMIT written in parts: the first applied, the second refused (injected: a retired
    chunk).  The client's second try finds the first part's keys present, holding what its
    first try sent: they are this put's (True), not another writer's, and the rest are written."""
    if meta_backend == "redis":
        pytest.skip("injected into the local index's check (a meta on Redis checks in its COMMIT script)")
    assert one.meta is not None
    ix = one.meta.index
    monkeypatch.setattr(ix, "config", replace(ix.config, commit_group_max_keys=4))
    check = ix.check_not_dead
    parts = 0

    def second_refused(rows: Any, chunks: Any = None) -> None:
        nonlocal parts
        parts += 1
        if parts == 2:
            key, lay = rows[0]
            raise stale(key, lay.extents[0].replicas[0].chunk_id)
        check(rows, chunks)

    monkeypatch.setattr(ix, "check_not_dead", second_refused)
    keys = [f"k{i}" for i in range(10)]
    async with client(one, clock) as kv:
        assert await kv.put_many([(k, value_of(k)) for k in keys], if_absent=True) == [True] * 10
        # the first try's two parts; the second try writes the 6 keys absent, in two parts
        assert parts == 2 + 2
        assert await kv.get_many(keys) == [value_of(k) for k in keys]


async def test_delete_refuses_a_tombstone_in_a_retired_chunk_and_the_client_writes_it_again(
        one: LocalCluster, clock: FakeClock, meta_backend: str) -> None:
    """delete appends its tombstone (alone in a chunk: the server restarted since the put);
    a whole GC pass retires and deletes that unreferenced chunk; then the DELETE arrives: meta
    must refuse it (StaleLayout), never keep a tombstone whose bytes are gone.  The client
    then writes the tombstone again, into a chunk that is there, and the key is deleted."""
    if meta_backend == "redis":
        pytest.skip("tombstones are SQLite's (kvfs.meta.tombstones): a meta on Redis keeps none, "
                    "so its DELETE has no tombstone to refuse")
    async with client(one, clock) as kv:
        await kv.put("k", value_of("k"))
    await one.stop_chunkserver(0)
    await one.start_chunkserver(0)  # appends go to a new chunk from here
    sent: list[rpc.Delete] = []
    assert one.meta is not None
    delete = Hold(one.meta.rpc, Op.DELETE, when=lambda req: sent.append(req) is None)
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        gone = asyncio.create_task(kv.delete("k"))
        await delete.reached(gone)  # the tombstone is appended, meta has not seen it
        files = chunk_files(one)
        report = await gc.run_pass(NOW)
        assert report.chunks_deleted == 1 and len(chunk_files(one)) == len(files) - 1
        delete.release()
        assert await gone is True
        assert len(sent) == 2 and kv.writer.rewritten == 1  # refused (the first tombstone's chunk was retired), then again
        first, again = (req.tombstones[0][0].chunk_id for req in sent)
        assert first != again and one.meta.index.tombstones[b"k"].layout.extents[0].replicas[0].chunk_id == again
        assert await kv.get("k") is None


async def test_a_delete_refused_twice_for_retired_tombstone_chunks_says_so(
        one: LocalCluster, clock: FakeClock, meta_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client writes a refused delete's tombstones again once: refused again (injected:
    meta finds every tombstone's chunk retired), the StaleLayout reaches the caller, and the
    key stays."""
    if meta_backend == "redis":
        pytest.skip("a meta on Redis keeps no tombstones, so its DELETE has none to refuse")
    assert one.meta is not None
    ix = one.meta.index
    monkeypatch.setattr(ix, "dead_in", lambda lay: lay.extents[0].replicas[0].chunk_id)
    async with client(one, clock) as kv:
        await kv.put("k", value_of("k"))
        with pytest.raises(StaleLayout, match="retry the delete"):
            await kv.delete("k")
        monkeypatch.undo()
        assert await kv.get("k") == value_of("k")


async def test_relocate_never_undoes_an_overwrite_made_during_compaction(
        one: LocalCluster, clock: FakeClock) -> None:
    """GC copies a chunk's live records; an overwrite and a delete land; then GC_RELOCATE
    arrives: the overwritten key keeps its new bytes, the deleted key stays deleted."""
    keys = [f"k{i:03d}" for i in range(60)]
    newer = b""
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        await kv.put_many([(k, value_of(k)) for k in keys], ttl=3600)  # the clock stands still
        await kv.delete_many(keys[::2])  # half garbage: the chunk is compacted
        live = keys[1::2]
        over, gone, rest = live[0], live[1], live[2:]
        relocate = hold(one, Op.GC_RELOCATE)
        gc_pass = asyncio.create_task(gc.run_pass(NOW))
        await relocate.reached(gc_pass)  # live records copied to a new chunk, layouts not switched
        newer = value_of("newer")  # as long as the copied value: only its CRC tells them apart
        await kv.put(over, newer)  # on the same server: the only one
        await kv.delete(gone)
        relocate.release()
        report = await gc_pass
        assert report.chunks_compacted == 1 and report.chunks_deleted == 1
        assert report.relocations_lost == 2
        assert report.keys_relocated == len(rest)
    async with client(one, clock) as fresh:
        assert await fresh.get(over) == newer
        assert await fresh.get(gone) is None
        assert await fresh.get_many(rest) == [value_of(k) for k in rest]
        assert await fresh.get_many(keys[::2]) == [None] * len(keys[::2])


async def test_relocate_refuses_a_copy_another_gc_reclaimed(one: LocalCluster, clock: FakeClock) -> None:
    """GC A copies a chunk's live records to a new chunk, then stalls; GC B finds the copy
    unreferenced and deletes it; then A's GC_RELOCATE arrives: it must switch nothing (the
    keys stay on the old chunk, which A then may not delete)."""
    keys = [f"k{i:03d}" for i in range(60)]
    async with client(one, clock) as kv:
        await kv.put_many([(k, value_of(k)) for k in keys])
        await kv.delete_many(keys[::2])
        live = keys[1::2]
        relocate = hold(one, Op.GC_RELOCATE)
        async with GarbageCollector(one.addr, token=one.admin_token) as a, \
                GarbageCollector(one.addr, token=one.admin_token) as b:
            stalled = asyncio.create_task(a.run_pass(NOW))
            await relocate.reached(stalled)
            copies = chunk_files(one)
            assert len(copies) == 2  # the old chunk and its compacted copy
            # B compacts nothing (threshold 1: no chunk is all garbage) but deletes the copy
            late = await b.run_pass(PassOptions(apply=True, grace_s=0, threshold=1.0))
            assert late.chunks_deleted == 1 and len(chunk_files(one)) == 1
            relocate.release()
            report = await stalled
        assert report.keys_relocated == 0 and report.relocations_lost == len(live)
        assert report.chunks_deleted == 0 and chunk_files(one) < copies
    async with client(one, clock) as fresh:
        assert await fresh.get_many(live) == [value_of(k) for k in live]


async def test_a_restarted_chunkserver_never_reuses_a_retired_chunk_id(
        one: LocalCluster, clock: FakeClock) -> None:
    """COMMIT refuses retired chunk ids forever, so they must never come back: after GC
    deleted every chunk file, a restarted chunkserver continues its sequence (state.json)."""
    async with client(one, clock) as kv:
        await kv.put("old", value_of("old"))
        before = await kv.layout("old")
        assert before is not None
        await kv.delete("old")
        async with GarbageCollector(one.addr, token=one.admin_token) as gc:
            assert (await gc.run_pass(NOW)).chunks_deleted == 1
        assert chunk_files(one) == set()
        await one.stop_chunkserver(0)
        await one.start_chunkserver(0)
        await kv.servers(refresh=True)
        await kv.put("new", value_of("new"))  # refused (StaleLayout) if it reused the dead id
        after = await kv.layout("new")
        assert after is not None
        assert after.extents[0].replicas[0].chunk_id > before.extents[0].replicas[0].chunk_id
    async with client(one, clock) as fresh:
        assert await fresh.get("new") == value_of("new")


async def test_chunk_refs_skip_expired_keys_and_list_every_live_one(one: LocalCluster, clock: FakeClock) -> None:
    """GC_CHUNK_REFS (what compaction copies) names every live value in the chunk, the ones
    after an expired key too, and never the expired key (the expire phase may not have run:
    ``kvfs gc --no-expire``, or a key that expired during the pass)."""
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        await kv.put("old", value_of("old"), ttl=5)
        live = [f"k{i}" for i in range(5)]
        await kv.put_many([(k, value_of(k)) for k in live])
        lays = {k: await kv.layout(k) for k in ["old", *live]}
        chunk = {lay.extents[0].replicas[0].chunk_id for lay in lays.values() if lay is not None}
        assert len(chunk) == 1  # one server, one open chunk
        clock.advance(6)
        got = await gc.meta(rpc.GcChunkRefs(chunks=list(chunk)))
    want = []
    for k in live:
        lay = lays[k]
        assert lay is not None
        x = lay.extents[0]
        want.append(rpc.Ref(k.encode(), x.replicas[0].offset, x.length, x.crc))
    (cid,) = chunk
    assert list(got.refs) == [cid] and sorted(got.refs[cid]) == want  # in scan order (Redis: any)


async def test_each_emptied_chunk_waits_its_own_grace_period(one: LocalCluster, clock: FakeClock) -> None:
    """GC_PLAN deletes a sealed chunk only ``grace_s`` after it first saw it without live
    bytes (reads that began before the delete may still be reading it), each chunk on its own
    clock: one emptied 20 s after another is still waiting when the first goes."""
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        chunks = []
        for k in ("a", "b"):  # each in a chunk of its own, sealed
            await kv.put(k, value_of(k))
            lay = await kv.layout(k)
            assert lay is not None
            r = lay.extents[0].replicas[0]
            assert (await gc.chunkserver(r.server_id, rpc.ChunkSeal(chunk_id=r.chunk_id))).sealed
            chunks.append(r.chunk_id)
        await kv.put("live", value_of("live"))  # the open chunk: live

        async def plan() -> rpc.Plan:
            await gc.sync_usage()
            return await gc.meta(rpc.GcPlan(grace_s=30, threshold=1.0))

        await kv.delete("a")
        assert ((p := await plan()).delete, p.waiting) == ([], 1)  # a's chunk: its clock starts
        clock.advance(20)
        await kv.delete("b")
        assert ((p := await plan()).delete, p.waiting) == ([], 2)  # b's chunk: its own clock
        clock.advance(11)  # 31 s after a's chunk emptied, 11 s after b's
        p = await plan()
        assert [d.chunk_id for d in p.delete] == [chunks[0]] and p.waiting == 1
        clock.advance(20)
        p = await plan()
        assert [d.chunk_id for d in p.delete] == chunks and p.waiting == 0
        assert await kv.get("live") == value_of("live")


async def test_a_chunk_that_holds_live_bytes_again_gets_a_fresh_grace_period(
        one: LocalCluster, clock: FakeClock) -> None:
    """A sealed chunk GC_PLAN saw without live bytes (a put's append, its COMMIT still on the
    way) starts its grace clock; the COMMIT lands, so the chunk is live again and its clock
    is forgotten; emptied later (the key deleted), it waits a whole ``grace_s`` from then,
    not from the first time: a read that began after the COMMIT may still be reading it."""
    commit = hold(one, Op.COMMIT)
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        put = asyncio.create_task(kv.put("k", value_of("k")))
        await commit.reached(put)  # appended, not committed
        cs = one.chunkservers[0]
        assert cs is not None and cs.server_id is not None and cs.store.open_chunk is not None
        chunk = cs.store.open_chunk
        assert (await gc.chunkserver(cs.server_id, rpc.ChunkSeal(chunk_id=chunk))).sealed

        async def plan() -> rpc.Plan:
            await gc.sync_usage()
            return await gc.meta(rpc.GcPlan(grace_s=30, threshold=1.0))

        assert ((p := await plan()).delete, p.waiting) == ([], 1)  # no live bytes: its clock starts
        clock.advance(20)
        commit.release()
        await put
        assert ((p := await plan()).delete, p.waiting) == ([], 0)  # live again
        clock.advance(20)  # 40 s after the clock first started
        await kv.delete("k")
        assert ((p := await plan()).delete, p.waiting) == ([], 1)  # a fresh clock
        clock.advance(30)
        assert [d.chunk_id for d in (await plan()).delete] == [chunk]


async def test_relocate_skips_a_key_that_expired_since_the_copy_and_moves_the_rest(
        one: LocalCluster, clock: FakeClock) -> None:
    """GC copies a chunk's live records; the first of them expires before GC_RELOCATE
    arrives: that key is not switched (it is gone for readers), every key after it is."""
    keys = [f"k{i:03d}" for i in range(40)]
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        await kv.put("soon", value_of("soon"), ttl=10)  # first in the chunk
        await kv.put_many([(k, value_of(k)) for k in keys])
        await kv.delete_many(keys[::2])  # half garbage: the chunk is compacted
        live = keys[1::2]
        soon = await kv.layout("soon")
        assert soon is not None
        old = soon.extents[0].replicas[0].chunk_id
        relocate = hold(one, Op.GC_RELOCATE)
        gc_pass = asyncio.create_task(gc.run_pass(NOW))
        await relocate.reached(gc_pass)  # "soon" was copied too: not expired yet
        clock.advance(11)
        relocate.release()
        report = await gc_pass
        assert report.chunks_compacted == 1 and report.keys_relocated == len(live)
        assert report.relocations_lost == 1
    async with client(one, clock) as fresh:
        assert await fresh.get_many(live) == [value_of(k) for k in live]
        assert await fresh.get("soon") is None
        for k in live:  # every live key moved to the copy
            lay = await fresh.layout(k)
            assert lay is not None and lay.extents[0].replicas[0].chunk_id != old, k


async def test_gc_status_counts_each_servers_bytes_and_expired_keys(one: LocalCluster, clock: FakeClock) -> None:
    """GC_STATUS per server: nothing written is no garbage (ratio 0); then live bytes are each
    stored record (header, key, value; expired keys until GC_EXPIRE removes them), garbage
    is what else was written (a chunk of only garbage counts none), the ratio is garbage over
    used, and expired keys are counted. A dry pass counts as no pass; an applied one does."""
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.admin_token) as gc:
        await gc.sync_usage()
        (s,) = (await gc.status())["servers"]
        assert (s["used"], s["live"], s["garbage"], s["ratio"], s["expired_keys"], s["dead_chunks"]) == (
            0, 0, 0, 0.0, 0, 0)
        await kv.put("k2", value_of("k2"))
        lay = await kv.layout("k2")
        assert lay is not None
        r = lay.extents[0].replicas[0]
        assert (await gc.chunkserver(r.server_id, rpc.ChunkSeal(chunk_id=r.chunk_id))).sealed
        await kv.put("k2", value_of("k2 again"))  # its first record is garbage, its chunk all garbage
        await kv.put_many([("t1", value_of("t1")), ("t2", value_of("t2"))], ttl=10)
        await kv.put("k1", value_of("k1"))
        clock.advance(11)
        await gc.sync_usage()
        st = await gc.status()
        (s,) = st["servers"]
        assert s["live"] == sum(RECORD_OVERHEAD_BYTES + len(k) + 8192 for k in ("t1", "t2", "k1", "k2"))
        assert s["garbage"] == s["used"] - s["live"] > 0 and s["ratio"] == s["garbage"] / s["used"]
        assert s["expired_keys"] == st["expired_keys"] == 2
        assert s["dead_chunks"] == 0 and s["chunks"] == 2 and s["fill"] == s["used"] / s["capacity"] > 0
        # a dry pass is no pass; an applied one counts, with its duration
        await gc.run_pass(PassOptions(apply=False, grace_s=0))
        assert (await gc.status())["metrics"]["passes"] == 0
        await gc.run_pass(NOW)
        st = await gc.status()
    m = st["metrics"]
    assert m["passes"] == 1 and m["pass_duration_s"] == m["last_pass_duration_s"] == st["last_run"]["duration_s"] > 0


async def test_a_reported_pass_duration_is_the_same_figure_in_every_counter(one: LocalCluster) -> None:
    """A duration finer than Redis's HINCRBYFLOAT keeps (17 decimal places) is kept in whole
    microseconds, so the sum of passes, the last pass and the last run all read the same figure
    (CI saw 0.06129971100017428 against 0.061299711000174284 on a meta over Redis)."""
    async with GarbageCollector(one.addr, token=one.admin_token) as gc:
        await gc.meta(rpc.GcReport(run={"apply": True, "duration_s": 0.061299711000174284}))
        st = await gc.status()
    m = st["metrics"]
    assert m["passes"] == 1
    assert m["pass_duration_s"] == m["last_pass_duration_s"] == st["last_run"]["duration_s"] == 0.0613
