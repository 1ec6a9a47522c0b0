"""Meta's walks of keys over SQLite (its in-memory index): STATS, GC status,
compaction's and fsck's chunk references, the expire / evict / plan dry runs,
eviction's LRU order, the repair plan, the access times' flush give the loop back after
each page of ``WALK_PAGE`` keys, so a meta
with millions of keys goes on answering its clients while one runs (it held the loop
for the whole walk: 6-10 s at 1M keys, bench/RESULTS.md).  ``kvfs.bench.meta_stall``
times them; here its ticker counts how often another task ran during each call."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvfs import rpc
from kvfs.bench import meta_stall
from kvfs.bench.metastore import NOW, LocalMeta, fill, key, layout
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta import index
from kvfs.meta.repair import RepairSummary, plan_repairs
from kvfs.meta.storeapi import Lease
from kvfs.meta.tombstones import tomb_layout
from kvfs.server import reply_of


@pytest.fixture
async def meta(tmp_path: Path) -> AsyncIterator[LocalMeta]:
    """A SQLite meta's RPC handlers in this process (kvfs.bench.metastore's), no keys yet."""
    m = LocalMeta(tmp_path / "meta")
    await m.open()
    try:
        yield m
    finally:
        await m.close()


async def test_every_walk_of_every_key_gives_the_loop_back_between_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index, "WALK_PAGE", 10)
    res = await meta_stall.run(keys=200, tries=1, expired=100)
    assert (res["keys"], res["expired"]) == (200, 100)
    # STATS, GC_STATUS and the expire dry run visit the 100 expired keys (the expiry index),
    # GC_LAYOUTS only its page (a step of its own), the others every key (all 200 in one
    # chunk and on one server): a page of 10 a step
    pages = {name: 100 // 10 if name in ("STATS", "GC_STATUS", "GC_EXPIRE dry run")
             else 0 if name == "GC_LAYOUTS page" else 200 // 10 for name in res["rpcs"]}
    held = {name: r["ticks"] for name, r in res["rpcs"].items() if r["ticks"] < pages[name]}
    assert not held, f"held the loop (other tasks ran fewer times than the walk has pages): {held}"


async def test_lru_order_across_pages_is_least_recently_used_first_and_skips_keys_read_since(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index, "WALK_PAGE", 7)
    await fill(meta, 100, 100, "k")
    ix = meta.meta.index
    rng = random.Random(5)
    for k in rng.sample(sorted(ix.entries), 60):  # read since the put, at other times
        ix.accessed[k] = NOW + rng.uniform(1, 1000)
    last_use = {k: ix.accessed.get(k, lay.created) for k, lay in ix.entries.items()}
    walk = ix.lru_order(batch=9)
    first = await anext(walk)
    assert len(first) == 9
    read_now = max(last_use, key=lambda k: last_use[k])  # the walk's last key is read again
    ix.accessed[read_now] = NOW + 5000
    gone = sorted(k for k in ix.entries if k not in {k for k, *_ in first})[0]
    ix.remove([gone])  # and one key is gone
    rest = [row async for page in walk for row in page]
    order = [k for k, *_ in first + rest]
    assert order == sorted(set(last_use) - {read_now, gone}, key=lambda k: (last_use[k], k))
    assert all(lay is ix.entries[k] and t == last_use[k] for k, lay, t in rest)


@pytest.mark.parametrize("sorted_first", [True, False])
async def test_an_lru_walk_after_a_place_in_the_order_walks_only_the_keys_after_it(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch, sorted_first: bool) -> None:
    """``lru_order(after=(last use, key))``, where a GC_EVICT stopped: the keys after that
    place, in order, and none before it, whether the kept order has merged that far already
    (``sorted_first``: a walk went through it) or not yet; a tie in last use is ordered by key."""
    monkeypatch.setattr(index, "WALK_PAGE", 7)
    await fill(meta, 100, 100, "k")
    ix = meta.meta.index
    rng = random.Random(7)
    for k in rng.sample(sorted(ix.entries), 60):  # read since the put, at other times
        ix.accessed[k] = NOW + rng.randint(1, 20)  # (whole seconds: many ties)
    everything = sorted(ix.entries, key=lambda k: (ix.accessed.get(k, ix.entries[k].created), k))
    if sorted_first:
        assert [k async for rows in ix.lru_order(batch=9) for k, *_ in rows] == everything
    for cut in (0, 1, 37, 63, 99):
        k = everything[cut]
        at = (ix.accessed.get(k, ix.entries[k].created), k)
        got = [k async for rows in ix.lru_order(batch=9, after=at) for k, *_ in rows]
        assert got == everything[cut + 1:], cut


async def test_lru_order_goes_on_from_the_last_sort(meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction's walks go on from the order the last sort made (kvfs.meta.lruorder): a walk
    that needs the first keys sorts none; a key gone, or read since, is passed over where the
    sort put it; the keys read or put since come after every key the sort saw, in a second
    sort once the walk has gone through the first's order, and no key is yielded twice."""
    monkeypatch.setattr(index, "WALK_PAGE", 7)
    await fill(meta, 100, 100, "k")
    ix = meta.meta.index
    rng = random.Random(7)
    keys = sorted(ix.entries)
    rng.shuffle(keys)
    for i, k in enumerate(keys):  # the LRU order: this one
        ix.accessed[k] = NOW + 1 + i

    async def first_rows(n: int) -> list[bytes]:
        got: list[bytes] = []
        walk = ix.lru_order(batch=5)
        async for rows in walk:
            got += [k for k, *_ in rows]
            if len(got) >= n:
                break
        await walk.aclose()
        return got

    assert await first_rows(10) == keys[:10] and ix._lru.sorts == 1
    assert await first_rows(10) == keys[:10] and ix._lru.sorts == 1  # no sort again
    ix.remove([keys[0], keys[50]])
    read = keys[3]
    ix.accessed[read] = NOW + 1000  # read since: the most recent
    await fill(meta, 1, 1, "new")
    (new,) = [k for k in ix.entries if k.startswith(b"new")]
    ix.accessed[new] = NOW + 2000
    assert await first_rows(10) == [k for k in keys if k not in (keys[0], keys[50], read)][:10]
    assert ix._lru.sorts == 1
    whole = [k for rows in [r async for r in ix.lru_order(batch=5)] for k, *_ in rows]
    assert whole == [k for k in keys if k not in (keys[0], keys[50], read)] + [read, new]
    assert ix._lru.sorts == 2
    assert ix._lru.order.at == 0  # (the second sort's order: its first key is still there)


async def test_a_key_removed_while_the_lru_walk_gives_the_loop_back_is_left_out(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk gives the loop back every page of entries it looks at, with keys it has found
    but not yet handed out: one removed meanwhile is left out of its batch, not looked up
    (a KeyError there failed the GC_EVICT)."""
    monkeypatch.setattr(index, "WALK_PAGE", 7)
    await fill(meta, 100, 100, "k")
    ix = meta.meta.index
    sorting = ix.lru_order(batch=5)
    (oldest, *_), *_ = await anext(sorting)  # (the order sorted, kept)
    await sorting.aclose()
    walk = ix.lru_order(batch=50)
    batch = asyncio.ensure_future(anext(walk))
    await asyncio.sleep(0)  # the walk has looked at a page and given the loop back
    assert not batch.done()
    ix.remove([oldest])  # found by the walk, not yet handed out
    rows = await batch
    await walk.aclose()
    assert [k for k, *_ in rows] == sorted(ix.entries)[:49]  # (every key put at once: ties in key order)


def derived_chunk_keys(ix: index.MetaIndex) -> dict[int, index.KeySet]:
    out: dict[int, index.KeySet] = {}
    for k, lay in ix.entries.items():
        for e in lay.extents:
            for r in e.replicas:
                out.setdefault(r.chunk_id, {})[k] = None
    return out


def key_stats(ix: index.MetaIndex, now: float) -> tuple[int, int, int]:
    live = [lay.size for lay in ix.entries.values() if not lay.expired(now)]
    return len(live), len(ix.entries), sum(live)


def sized(n: int, chunk: int, offset: int) -> Layout:
    return Layout(n, 7, NOW, None, (Extent(n, 9, (Replica(1, (1 << 40) | chunk, offset),)),))


async def test_chunk_keys_and_stats_follow_commits_overwrites_deletes_relocations_evictions_and_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compaction's references (GC_CHUNK_REFS of chunks) come from ``chunk_keys``, not from
    a walk of every key: a key missing there would have its record dropped by compaction.
    STATS' counts come from ``value_bytes`` less the expired keys, read from the expiry
    index two at a time (five of one expiry: the pages go by key within it)."""
    monkeypatch.setattr(index, "WALK_PAGE", 2)
    m = LocalMeta(tmp_path / "meta")
    await m.open()
    try:
        await fill(m, 60, 60, "k", per_chunk=10)  # chunks 0-5 of server 1, 10 keys each
        ix = m.meta.index
        await m.commit([(key(i, "k"), sized(300 + i, 7, 400 * i)) for i in range(10)], NOW)  # to chunk 7
        await m.commit([(key(i, "k"), layout(i + 5, 10)) for i in range(10, 15)], NOW)  # within chunk 1
        await m.delete([key(i, "k") for i in range(20, 25)])
        moved = [(key(i, "k"), ix.entries[key(i, "k")], layout(60 + i, 10)) for i in range(30, 35)]
        assert await ix.switch(moved) == [True] * 5  # compaction's relocation, chunk 3 -> 9
        gone = await ix.evict([(key(i, "k"), ix.entries[key(i, "k")]) for i in range(40, 43)], NOW)
        assert len(gone) == 3
        await ix.commit([(key(i, "k"), ix.entries[key(i, "k")].stamped(NOW - 10, NOW - 1))  # (expired)
                         for i in range(50, 55)], NOW - 10, NOW - 1)
        assert await ix.key_stats(NOW) == key_stats(ix, NOW) == (47, 52, 3045 + 37 * 100)
        assert ix.chunk_keys == derived_chunk_keys(ix)
        for c in [*sorted(ix.chunk_keys), (1 << 40) | 99]:  # (and one no key names)
            refs = (await reply_of(m.meta.gc.rpc_gc_chunk_refs(rpc.GcChunkRefs(chunks=[c]), memoryview(b""))))[0]
            named = sorted(k for k in ix.chunk_keys.get(c, ()) if not ix.entries[k].expired(NOW))
            assert sorted(r.key for r in refs.refs.get(c, [])) == named, c  # (expired ones left out)
        live = {c: n for c, n in ix.chunk_live.items() if n}
        high = dict(ix.seq_high)
    finally:
        await m.close()
    again = LocalMeta(tmp_path / "meta")  # a restart loads them, and the live bytes, as they were
    await again.open()
    try:
        ix = again.meta.index
        assert ix.chunk_keys == derived_chunk_keys(ix) != {}
        assert {c: n for c, n in ix.chunk_live.items() if n} == live and ix.seq_high == high == {1: 9}
        assert await ix.key_stats(NOW) == key_stats(ix, NOW) == (47, 52, 3045 + 37 * 100)
    finally:
        await again.close()


async def test_the_per_key_state_made_since_start_up_is_left_out_of_the_cycle_collectors_walks(tmp_path: Path) -> None:
    """``chunk_keys`` and ``tomb_chunks`` hold a key per stored key, ``tombstones`` a Tomb
    per kept tombstone: tracked by the cycle collector (a set is, a dataclass is), every full
    collection walked them all (37 ms at 1M keys committed since start-up's gc.freeze(),
    65 ms at 300k tombstones, bench/RESULTS.md).  After one, none of them is tracked, nor
    after more keys go in."""
    m = LocalMeta(tmp_path / "meta")
    await m.open()
    try:
        ix = m.meta.index
        await fill(m, 40, 40, "k", per_chunk=10)
        await m.meta.rpc_register(rpc.Register(server_id=1, addr="127.0.0.1:1"), memoryview(b""))
        await ix.delete([key(i, "k") for i in range(5)],
                        [tomb_layout([Replica(1, (1 << 40) | 20, 64 * i)], NOW) for i in range(5)])
        assert ix.chunk_keys and ix.tomb_chunks
        gc.collect()
        await fill(m, 10, 10, "n", per_chunk=5)  # (into the untracked ones, and new ones)
        gc.collect()
        assert not [c for c, ks in (*ix.chunk_keys.items(), *ix.tomb_chunks.items()) if gc.is_tracked(ks)]
        assert len(ix.tombstones) == 5 and not [k for k, t in ix.tombstones.items() if gc.is_tracked(t)]
    finally:
        await m.close()


async def test_the_lru_order_kept_is_left_out_of_the_cycle_collectors_walks(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LRU order kept between eviction's walks (kvfs.meta.lruorder) names every key: kept
    in one list, each full collection walked it (9.6 ms at 1M keys).  Its pages and what was
    merged of them are tuples of keys, which a collection stops tracking: after one, nothing
    of the order that holds keys is tracked but its list of blocks, a reference a page."""
    monkeypatch.setattr(index, "WALK_PAGE", 10)
    await fill(meta, 100, 100, "k")
    ix = meta.meta.index
    walk = ix.lru_order(batch=30)
    assert len(await anext(walk)) == 30
    await walk.aclose()
    o = ix._lru.order
    gc.collect()
    assert o.blocks and not [b for b in o.blocks if gc.is_tracked(b)]
    assert len(o.blocks) <= 30 // 10 + 1 and all(len(b) <= 10 for b in o.blocks)


async def test_the_leases_of_keys_with_one_holder_are_left_out_of_the_cycle_collectors_walks(
        tmp_path: Path) -> None:
    """A key leased by one holder (an engine's lookups lease every key they find) is held
    by no container the cycle collector tracks: a dict of key to holder-to-end dicts was,
    and every full collection walked every leased key (bench/RESULTS.md, "meta's
    leases").  Only a key with several holders has a tracked dict of them."""
    m = LocalMeta(tmp_path / "meta")
    await m.open()
    try:
        ix = m.meta.index
        await fill(m, 60, 60, "k")
        keys = [key(i, "k") for i in range(60)]
        ix.lease(keys[:20], NOW, Lease("a", NOW + 60, 8))
        gc.collect()
        ix.lease(keys[20:], NOW, Lease("a", NOW + 60, 8))  # new keys, after the collection
        ix.lease(keys[:5], NOW, Lease("b", NOW + 90, 8))  # a second holder on these
        for k in keys[5:]:  # (what holds them: the per-key maps, this test's list)
            held = [r for r in gc.get_referrers(k) if isinstance(r, dict)]
            assert not held, (k, [len(d) for d in held])
        for k in keys[:5]:
            assert [r for r in gc.get_referrers(k) if isinstance(r, dict)] == [ix.leases.shared], k
        assert [ix.lease_end(k) for k in keys] == [NOW + 90] * 5 + [NOW + 60] * 55
    finally:
        await m.close()


def derived_tomb_chunks(ix: index.MetaIndex) -> dict[int, index.KeySet]:
    out: dict[int, index.KeySet] = {}
    for k, t in ix.tombstones.items():
        for r in t.layout.extents[0].replicas:
            out.setdefault(r.chunk_id, {})[k] = None
    return out


async def test_a_chunks_tombstones_come_from_its_index_through_puts_moves_and_a_restart(tmp_path: Path) -> None:
    """GC_CHUNK_REFS of a chunk names the tombstones kept in it (compaction copies them
    forward; one left out would be dropped, and a rebuild would bring its key back), read
    from ``tomb_chunks``, not from a walk of every tombstone kept (400k of them held meta's
    loop 260-420 ms on every call, bench/RESULTS.md): a put again forgets one, a
    relocation moves one, a restart loads them."""
    m = LocalMeta(tmp_path / "meta")
    await m.open()
    t1, t2, t3 = ((1 << 40) | c for c in (20, 21, 22))

    async def refs(c: int) -> list[bytes]:
        got = (await reply_of(m.meta.gc.rpc_gc_chunk_refs(rpc.GcChunkRefs(chunks=[c]), memoryview(b""))))[0]
        return sorted(r.key for r in got.refs.get(c, []))

    try:
        await fill(m, 40, 40, "k", per_chunk=10)  # chunks 0-3 of server 1
        ix = m.meta.index
        await m.meta.rpc_register(rpc.Register(server_id=1, addr="127.0.0.1:1"), memoryview(b""))
        # keys 0-9 deleted, their tombstones in chunk t1 (0-4) and t2 (5-9): kept (no chunk
        # table from server 1 since meta started)
        await ix.delete([key(i, "k") for i in range(10)],
                        [tomb_layout([Replica(1, t1 if i < 5 else t2, 64 * i)], NOW) for i in range(10)])
        assert await refs(t1) == [key(i, "k") for i in range(5)]
        assert await refs(t2) == [key(i, "k") for i in range(5, 10)]
        assert await refs((1 << 40) | 1) == [key(i, "k") for i in range(10, 20)]  # no tombstone there
        await m.commit([(key(0, "k"), layout(0, 10))], NOW)  # put again: its tombstone forgotten
        handled, moved = await ix.relocate_tombstones(1, t3, {key(1, "k"): {(t1, 64): 0}})
        assert handled == {key(1, "k")} and moved == 1
        assert await refs(t1) == [key(i, "k") for i in range(2, 5)] and await refs(t3) == [key(1, "k")]
        assert ix.tomb_chunks == derived_tomb_chunks(ix)
    finally:
        await m.close()
    again = LocalMeta(tmp_path / "meta")
    await again.open()
    try:  # (the tombstones' chunks named by no chunk table yet: not asked for, they would pass)
        ix = again.meta.index
        assert set(ix.tombstones) == {key(i, "k") for i in range(1, 10)}
        assert ix.tomb_chunks == derived_tomb_chunks(ix) and set(ix.tomb_chunks) == {t1, t2, t3}
        assert set(ix.tomb_chunks[t1]) == {key(i, "k") for i in range(2, 5)}
        assert set(ix.tomb_chunks[t3]) == {key(1, "k")}
    finally:
        await again.close()


async def test_passed_tombstones_are_dropped_a_page_at_a_time(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """GC_DELETED's drop of the tombstones that passed walks them a page a step (it walked
    every kept tombstone in one step: 2.7-3.1 s with 400k passed, bench/RESULTS.md), and forgets
    each, with its index entries, once no chunk at or below its horizon is left."""
    monkeypatch.setattr(index, "WALK_PAGE", 5)
    await fill(meta, 12, 12, "k", per_chunk=10)
    ix = meta.meta.index
    hb = rpc.Heartbeat(server_id=1, addr="127.0.0.1:1", capacity=1 << 30, free=1 << 30, used=0, chunks={})
    await meta.meta.rpc_register(rpc.Register(server_id=1, addr="127.0.0.1:1"), memoryview(b""))
    await ix.delete([key(i, "k") for i in range(12)],
                    [tomb_layout([Replica(1, (1 << 40) | 20, 64 * i)], NOW) for i in range(12)])
    assert len(ix.tombstones) == 12
    assert await ix.drop_passed() == 0  # no chunk table from server 1 since the deletes
    await meta.meta.rpc_heartbeat(hb, memoryview(b""))  # now one: its chunks all gone
    forgotten: list[int] = []  # each step's (each transaction's) tombstones
    forget = ix.forget_tombstones

    def forget_tombstones(keys: Sequence[bytes]) -> None:
        forgotten.append(len(keys))
        forget(keys)

    monkeypatch.setattr(ix, "forget_tombstones", forget_tombstones)
    assert await ix.drop_passed() == 12
    assert forgotten == [5, 5, 2] and not ix.tombstones and not ix.tomb_chunks
    assert not list(ix.store.load_tombstones())



async def test_the_drop_of_passed_tombstones_walks_only_what_may_have_passed_since_its_last_walk(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """GC_DELETED asks for the drop after every batch a pass compacts (a walk of every
    tombstone each time was 10 % of meta's CPU in the full-cluster soak, bench/RESULTS.md).
    With the chunk tables as the last walk found them, nothing is walked; with only chunk
    tables heard since, the tombstones younger than those; with a chunk gone, every one,
    and what passed goes."""
    await fill(meta, 15, 15, "k", per_chunk=10)
    ix = meta.meta.index
    await meta.meta.rpc_register(rpc.Register(server_id=1, addr="127.0.0.1:1"), memoryview(b""))

    async def delete(ids: range) -> None:
        await ix.delete([key(i, "k") for i in ids],
                        [tomb_layout([Replica(1, (1 << 40) | 20, 64 * i)], NOW) for i in ids])

    await delete(range(12))
    checked: list[int] = []
    real = index.passed

    def counted(t: Any, floor: Any, compacting: int | None = None) -> bool:
        checked.append(t.layout.extents[0].replicas[0].offset // 64)
        return real(t, floor, compacting)

    monkeypatch.setattr(index, "passed", counted)
    assert await ix.drop_passed() == 0 and len(checked) == 12  # no chunk table since the deletes
    assert await ix.drop_passed() == 0 and len(checked) == 12  # nothing changed: no walk
    hb = rpc.Heartbeat(server_id=1, addr="127.0.0.1:1", capacity=1 << 30, free=1 << 30, used=0,
                       chunks={(1 << 40) | 1: 1000, (1 << 40) | 20: 12 * 64})  # (20: the horizon)
    await meta.meta.rpc_heartbeat(hb, memoryview(b""))  # a table: every one walked, none passed
    assert await ix.drop_passed() == 0 and len(checked) == 24
    await delete(range(12, 15))
    await meta.meta.rpc_heartbeat(hb, memoryview(b""))  # the same table heard again
    del checked[:]
    assert await ix.drop_passed() == 0 and sorted(checked) == [12, 13, 14]  # the younger ones
    later = msgspec.structs.replace(hb, chunks={(1 << 40) | 30: 100})  # every chunk to 20 gone
    await meta.meta.rpc_heartbeat(later, memoryview(b""))
    assert await ix.drop_passed() == 15 and len(checked) == 18
    assert not ix.tombstones


async def test_a_repair_plan_made_a_page_at_a_time_is_the_plan_of_every_key_at_once(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """GC_REPAIR_PLAN (and GC_STATUS's repair summary) plan each page of the dead server's
    keys in its own step: the same items within the same limit, at least one, and the same
    totals as one plan over every key."""
    monkeypatch.setattr(index, "WALK_PAGE", 7)
    svc = meta.meta
    await svc.rpc_register(rpc.Register(server_id=2, addr="127.0.0.1:2"), memoryview(b""))
    rows = [(key(i, "r"), Layout(100 + i, 0, NOW, None, (
        Extent(100 + i, i, (Replica(1, (1 << 40) | 1, 300 * i), Replica(2, (2 << 40) | 1, 300 * i))),)))
            for i in range(60)]
    rows += [(key(i, "u"), layout(i)) for i in range(10)]  # on the dead server only: unrepairable
    await meta.commit(rows, NOW)
    ix = svc.index
    ix.started = ix.servers[1].last_heartbeat = -1e18  # server 1 dead (fault injection)
    stored = [row async for rows in ix.refs(servers={1}) for row in rows]  # (in the plan's order)
    assert sorted(k for k, _ in stored) == sorted(ix.entries)
    for limit in (1, 350, 1000, 10_000, 1 << 20):
        got = (await reply_of(svc.gc.rpc_gc_repair_plan(rpc.GcRepairPlan(limit_bytes=limit), memoryview(b""))))[0]
        whole = RepairSummary()
        want = plan_repairs(stored, {1}, {2}, limit_bytes=limit, now=NOW, summary=whole)
        assert got.items == want and len(want) >= 1, limit
        assert sum(it.length for it in want[1:]) < limit
        assert (got.under_replicated_extents, got.unrepairable_extents) == (70, 10)
        assert (whole.under_replicated_extents, whole.unrepairable_extents) == (70, 10)
    # and at most MAX_REPAIR_PLAN_ITEMS extents, however small: an answer of every key of a
    # server with tiny values was a frame past the limit (bench/RESULTS.md)
    monkeypatch.setattr(rpc, "MAX_REPAIR_PLAN_ITEMS", 12)
    got = (await reply_of(svc.gc.rpc_gc_repair_plan(rpc.GcRepairPlan(limit_bytes=1 << 20), memoryview(b""))))[0]
    want = plan_repairs(stored, {1}, {2}, limit_bytes=1 << 20, now=NOW, limit_items=12)
    assert got.items == want and len(want) == 12 and got.under_replicated_extents == 70


async def test_the_access_times_are_written_a_page_at_a_time_and_never_lowered(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """Meta's periodic flush of the keys' last access (LRU order across restarts) writes
    them in key order, a page per step and transaction; a time older than the row's (a put
    since) leaves the row's."""
    monkeypatch.setattr(index, "WALK_PAGE", 5)
    await fill(meta, 40, 40, "k")
    ix = meta.meta.index
    read = {key(i, "k"): NOW + 100 + i for i in range(0, 40, 2)}
    ix.dirty_access.update(read)
    ix.dirty_access[key(1, "k")] = NOW - 50  # older than its put (NOW)
    written: list[list[bytes]] = []
    touch = ix.store.touch_many

    def touch_many(rows: Iterable[tuple[float, bytes]]) -> None:  # (each transaction's keys)
        rows = list(rows)
        written.append([k for _, k in rows])
        touch(rows)

    monkeypatch.setattr(ix.store, "touch_many", touch_many)
    _, _, ticks = await meta_stall.stalled(ix.flush)
    assert [len(w) for w in written] == [5, 5, 5, 5, 1] and ticks >= 5 and not ix.dirty_access
    assert [k for w in written for k in w] == sorted([*read, key(1, "k")])
    stored = {k: t for k, _, t in ix.store.load()}
    assert {k: stored[k] for k in read} == read
    assert stored[key(1, "k")] == NOW and stored[key(3, "k")] == NOW


async def test_the_keys_whose_every_lease_ended_are_forgotten_by_the_flush(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction asks which of its candidates are leased, batch after batch: the answer looks
    at those keys only, and the leases that ended go at the index's periodic flush."""
    monkeypatch.setattr(index, "WALK_PAGE", 3)
    await fill(meta, 20, 20, "k")
    ix = meta.meta.index
    ended, live = [key(i, "k") for i in range(10)], [key(i, "k") for i in range(10, 14)]
    ix.lease(ended, NOW - 10, Lease("a", NOW - 1, 8))
    ix.lease(live, NOW - 10, Lease("a", NOW - 1, 8))
    ix.lease(live, NOW - 10, Lease("b", NOW + 60, 8))  # another holder's, still on
    assert await ix.leased([*ended, *live, key(15, "k")], NOW) == set(live)
    assert len(ix.leases) == 14  # (forgotten only by the flush)
    await ix.flush()
    assert set(ix.leases) == set(live) and await ix.leased(live, NOW) == set(live)


async def test_callers_asking_for_the_repair_summary_meanwhile_share_one_count(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a server is dead, STATS and GC_STATUS each ask for the repair summary, O(its
    keys): the calls that arrive while one count pages through them share it."""
    monkeypatch.setattr(index, "WALK_PAGE", 3)
    await fill(meta, 30, 30, "k")
    svc = meta.meta
    svc.index.started = svc.index.servers[1].last_heartbeat = -1e18  # server 1 dead (fault injection)
    counts = 0
    plan = svc.gc._repair_plan

    async def counted(*args: Any, **kw: Any) -> Any:
        nonlocal counts
        counts += 1
        return await plan(*args, **kw)

    monkeypatch.setattr(svc.gc, "_repair_plan", counted)
    none = memoryview(b"")
    stats = await asyncio.gather(*(reply_of(svc.rpc_stats(rpc.Stats(), none)) for _ in range(3)))
    status = (await reply_of(svc.gc.rpc_gc_status(rpc.GcStatus(), none)))[0]
    assert counts == 2  # (the three STATS shared one; GC_STATUS came after it ended)
    assert {r.gc.repair for r, _ in stats} == {status.repair}
    assert status.repair.under_replicated_extents == status.repair.unrepairable_extents == 30


async def test_a_flush_stopped_midway_hands_the_access_times_it_did_not_write_back(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """Meta's close cancels the periodic flush, then writes what is left: a flush cancelled
    after its first page leaves the others' times to that write."""
    monkeypatch.setattr(index, "WALK_PAGE", 5)
    await fill(meta, 20, 20, "k")
    ix = meta.meta.index
    read = {key(i, "k"): NOW + 100 + i for i in range(20)}
    ix.dirty_access.update(read)
    flush = asyncio.ensure_future(ix.flush())
    touch = ix.store.touch_many

    def first_page_then_cancel(rows: Iterable[tuple[float, bytes]]) -> None:
        touch(rows)
        flush.cancel()

    monkeypatch.setattr(ix.store, "touch_many", first_page_then_cancel)
    with pytest.raises(asyncio.CancelledError):
        await flush
    ix.dirty_access[key(19, "k")] = NOW + 500  # read again meanwhile: the later time stays
    stored = {k: t for k, _, t in ix.store.load()}
    written = sorted(read)[:5]
    assert {k: stored[k] for k in written} == {k: read[k] for k in written}
    assert dict(ix.dirty_access.items()) == {**{k: read[k] for k in sorted(read)[5:]}, key(19, "k"): NOW + 500}


async def test_eviction_spares_a_victim_read_after_it_was_chosen(meta: LocalMeta) -> None:
    """GC_EVICT chooses its victims over many loop steps: one read meanwhile is not removed."""
    await fill(meta, 6, 6, "k")
    ix = meta.meta.index
    victims = [(k, ix.entries[k]) for k in sorted(ix.entries)[:4]]
    ix.accessed[victims[1][0]] = NOW + 1  # read after NOW, when they were chosen
    removed = await ix.evict(victims, NOW)
    assert [k for k, _ in removed] == [victims[i][0] for i in (0, 2, 3)]
    assert victims[1][0] in ix.entries


class _Ticker:
    """A task that gives the loop back at once, counting how often it ran, and the count
    at each call of the store's ``name`` (a transaction): strictly increasing counts mean
    the loop served others between those transactions."""

    def __init__(self, ix: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ticks = 0
        self.at: list[int] = []
        write = getattr(ix.store, name)

        def counted(*args: Any, **kw: Any) -> Any:
            self.at.append(self.ticks)
            return write(*args, **kw)

        monkeypatch.setattr(ix.store, name, counted)
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.ticks += 1

    def stop(self) -> None:
        self._task.cancel()


async def test_a_large_delete_writes_a_page_a_transaction_with_the_loop_free_between(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DELETE of many keys writes ``WRITE_PAGE`` of them a transaction, the loop free
    between them (16,384 in one held meta's loop 0.7-0.9 s at 300k keys,
    bench/RESULTS.md); a tombstone whose chunk GC retired meanwhile is not kept, its key
    deleted all the same (as a GC drop: its records noted as ghosts)."""
    monkeypatch.setattr(index, "WRITE_PAGE", 10)
    monkeypatch.setattr(index, "WALK_PAGE", 10)
    await fill(meta, 30, 30, "k", per_chunk=100)
    svc, ix = meta.meta, meta.meta.index
    tomb_chunk = (1 << 40) | 20
    ticker = _Ticker(ix, "delete_many", monkeypatch)
    retire_after_first = ix.store.delete_many

    def delete_many(*args: Any, **kw: Any) -> Any:
        out = retire_after_first(*args, **kw)
        ix.retired[tomb_chunk] = NOW  # GC retired the tombstones' chunk after the first page
        return out

    monkeypatch.setattr(ix.store, "delete_many", delete_many)
    keys = [key(i, "k") for i in range(25)]
    req = rpc.Delete(keys=keys, tombstones=[[Replica(1, tomb_chunk, 64 * i)] for i in range(25)])
    try:
        got = (await reply_of(svc.rpc_delete(req, memoryview(b""))))[0]
    finally:
        ticker.stop()
    assert got.deleted == 25
    assert len(ticker.at) == 3 and ticker.at[0] < ticker.at[1] < ticker.at[2], ticker.at
    assert sorted(ix.tombstones) == keys[:10]  # the first page's: its chunk not retired yet
    assert not any(k in ix.entries for k in keys) and len(ix.entries) == 5
    assert sorted(k for k, _, _ in ix.store.load_tombstones()) == keys[:10]


async def test_a_repairs_switches_write_a_page_a_transaction_with_the_loop_free_between(
        meta: LocalMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    """GC_REPAIR plans a page of keys per step and switches ``WRITE_PAGE`` a transaction,
    the loop free between them (a plan's 16,384 in one step held the loop 0.55-0.9 s at
    300k keys); a key changed between plan and switch keeps its change."""
    monkeypatch.setattr(index, "WRITE_PAGE", 10)
    monkeypatch.setattr(index, "WALK_PAGE", 10)
    await fill(meta, 25, 25, "k", per_chunk=100)
    svc, ix = meta.meta, meta.meta.index
    await svc.rpc_register(rpc.Register(server_id=2, addr="127.0.0.1:2"), memoryview(b""))
    changed = key(24, "k")
    moved = Layout(7, 0, NOW, None, (Extent(7, 0, (Replica(1, (1 << 40) | 3, 0),)),))
    ticker = _Ticker(ix, "put_many", monkeypatch)
    switch = ix.switch_layouts
    first = True

    def switch_layouts(staged: Any) -> None:
        nonlocal first
        if first:  # between the plan and the switch of the last page: a put of one key
            first = False
            ix.entries[changed] = moved
        switch(staged)

    monkeypatch.setattr(ix, "switch_layouts", switch_layouts)
    items = [rpc.ReplicaSwitch(key(i, "k"), 0, layout(i, 100).extents[0].replicas[0],
                               Replica(2, (2 << 40) | 1, 200 * i)) for i in range(25)]
    try:
        got = (await reply_of(svc.gc.rpc_gc_repair(rpc.GcRepair(items=items), memoryview(b""))))[0]
    finally:
        ticker.stop()
    assert (got.repaired, got.skipped) == (24, 1)
    assert len(ticker.at) == 3 and ticker.at[0] < ticker.at[1] < ticker.at[2], ticker.at
    assert ix.entries[changed] == moved
    assert all(ix.entries[key(i, "k")].extents[0].replicas[0].server_id == 2 for i in range(24))
