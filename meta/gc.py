"""Meta's side of garbage collection: expiry, eviction, compaction switches, chunk retirement.

Meta never touches chunk files; :mod:`kvfs.gc` drives a pass and meta answers
with plans and applies each destructive step as a compare-and-swap in its index
(:class:`kvfs.meta.storeapi.GcIndex`): over SQLite one transaction in one event-loop
step, so no other RPC sees half of it; over Redis Cluster one Lua script per master,
so it holds per key (and per master), and the GCs of several metas sharing the store
never undo each other's work:

- GC_EXPIRE removes keys whose ``expires_at`` passed (an expiry index);
- GC_EVICT removes least-recently-used, unleased keys of servers over the high
  watermark until their live bytes fit under the low watermark;
- a key with an older record that could outlive its current one (overwritten, or put
  again after a delete: :meth:`GcIndex.shadowed`) is not removed by either: it is
  answered as ``shadowed``, the GC writes its tombstone, and GC_TOMBSTONE removes it
  keeping that tombstone (compare-and-swap), so a rebuild of meta never serves the
  older record; when no chunkserver takes the tombstones, GC_EVICT with ``older=False``
  passes over such keys and chooses among those that go without one;
- GC_RELOCATE points a replica at its compacted copy only if the layout still
  names the old (chunk, offset): a concurrent overwrite or delete wins;
- GC_RETIRE marks a chunk dead only if no layout references it; a dead chunk
  id is refused by COMMIT forever after (ids are never reused), so a late
  commit can never produce a dangling key;
- the tombstones meta keeps (:mod:`kvfs.meta.tombstones`) are live data: GC_CHUNK_REFS
  names them, GC_RELOCATE moves them, and GC_DELETED drops those no older record of
  their key can outlive any more.

MAKE_ROOM (a client's write found the cluster full) and REPORT_BAD (a reader found
replicas failing their CRC-32C) are the exceptions to "driven from outside": meta runs
:mod:`kvfs.gc` against itself (MAKE_ROOM: one pass, as the daemon runs it less its scrub; REPORT_BAD:
the reported replicas checked on their servers and mended as a scrub mends, in a task of
its own, the reports held meanwhile up to ``suspect_replicas``), so a client never runs GC.

GC's state (paused, counters, draining servers, retired chunks) lives in the index's
store, so every meta sharing a store sees one GC.  GC daemons take turns by a lease in
the store (GC_CONTROL with ``holder``): one runs passes, another takes over when its
lease (three intervals) runs out.  Grace clocks (``zero_since``) are per meta: a meta
starts one when it first sees a chunk without live bytes, never before the switch that
emptied it, so every meta's grace period covers reads that began before the switch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import msgspec

from kvfs import rpc
from kvfs.errors import InvalidArgument, StaleLayout, Unavailable
from kvfs.layout import Extent, Layout, Replica, misfiled, misfiled_why, server_of_chunk
from kvfs.meta.index import WRITE_PAGE, MetaIndex, ServerInfo, add_live, disk_bytes, pages
from kvfs.meta.repair import RepairSummary, plan_repairs, plan_scrub, replace_replica
from kvfs.meta.storeapi import GcIndex
from kvfs.meta.tombstones import tomb_layout
from kvfs.server import Reply

if TYPE_CHECKING:
    from kvfs.gc.driver import GarbageCollector

log = logging.getLogger("kvfs.meta.gc")

METRIC_NAMES = (
    "keys_expired", "bytes_expired", "keys_evicted", "bytes_evicted", "chunks_compacted",
    "bytes_copied", "keys_relocated", "chunks_deleted", "bytes_reclaimed", "replicas_dropped",
    "passes", "pass_duration_s", "last_pass_duration_s", "extents_repaired", "bytes_repaired",
    "tombstones_dropped", "keys_lost", "replicas_reported_bad", "bytes_scrubbed",
    "replicas_scrubbed_bad",
    # writers that found the cluster full (MAKE_ROOM): their requests, the seconds they
    # waited in all, those answered that no room was made (the write fails as full), and
    # the passes run for them
    "room_requests", "room_wait_s", "room_refused", "room_passes",
)
DAEMON_LEASE = "gc-daemon"  # the lease GC daemons take turns by (GC_CONTROL's holder)
NO_ROOM = rpc.RoomMade(expired_keys=0, evicted_keys=0, bytes_reclaimed=0)
MAX_SHADOWED = 4096  # keys left for a tombstone per GC_EXPIRE or GC_EVICT answer (the rest: next call)


def server_live(s: ServerInfo, live: dict[int, int]) -> int:
    """Live bytes on a server."""
    return sum(live.get(c, 0) for c in s.chunks)


async def tombstone_layouts(ix: GcIndex, keys: Sequence[bytes], where: Sequence[Sequence[Replica]],
                            now: float) -> list[Layout]:
    """The tombstone kept for each key (DELETE's, GC_TOMBSTONE's), checked like a commit's
    layouts: one replica per server, each on a server meta knows, in no retired chunk."""
    if not {r.server_id for reps in where for r in reps} <= ix.servers.keys():
        await ix.refresh()
    tombs: list[Layout] = []
    async for page in pages(list(zip(keys, where, strict=True)), WRITE_PAGE):  # (a page a step)
        tombs += _tombstone_layouts(ix, page, now)
    return tombs


def _tombstone_layouts(ix: GcIndex, rows: Sequence[tuple[bytes, Sequence[Replica]]],
                       now: float) -> list[Layout]:
    tombs: list[Layout] = []
    for key, reps in rows:
        if len({r.server_id for r in reps}) != len(reps):
            raise InvalidArgument(f"tombstone of {key[:64]!r} names one chunkserver twice")
        for r in reps:
            if r.server_id not in ix.servers:
                raise InvalidArgument(f"tombstone of {key[:64]!r} names unknown chunkserver {r.server_id}")
        lay = tomb_layout(reps, now)
        if (bad := misfiled(lay)) is not None:
            raise InvalidArgument(f"tombstone of {key[:64]!r}: {misfiled_why(bad.server_id, bad.chunk_id)}")
        # (only SQLite's index keeps tombstones: the Redis store drops them)
        if isinstance(ix, MetaIndex) and ix.dead_in(lay) is not None:
            raise StaleLayout(f"tombstone of {key[:64]!r} is in a chunk garbage collection already "
                              "reclaimed (the delete took longer than the GC grace period); retry the delete")
        tombs.append(lay)
    return tombs


def _range_of(layout: Layout | None, b: rpc.BadReplica) -> rpc.VerifyRange | None:
    """The range and CRC-32C ``layout`` gives replica ``b`` (None: it names no such replica)."""
    if layout is not None:
        for e in layout.extents:
            for r in e.replicas:
                if (r.server_id, r.chunk_id, r.offset) == (b.server_id, b.chunk_id, b.offset):
                    return rpc.VerifyRange(r.chunk_id, r.offset, e.length, e.crc)
    return None


def dead_in(layout: Layout, dead: Collection[int]) -> bool:
    return bool(dead) and any(r.chunk_id in dead for e in layout.extents for r in e.replicas)


class _Finishing:
    """Eviction's chunks left partly live (:meth:`MetaGc._evict_victims`): what the LRU
    victims free in each chunk, and, on each server whose need is met, the keys that come
    next in the LRU order and leave a chunk the victims started on with nothing live, so
    compaction deletes it instead of copying what was left.  A chunk is emptied whole or
    not at all: its keys are held back until the last is found (one in another chunk too,
    leased, or left for a tombstone: it is given up).  Bounded: a server's extra eviction to
    at most what it needed and at most its largest chunk, and the keys walked past on it to
    twice that."""

    def __init__(self, need: dict[int, int], live: dict[int, int], servers: dict[int, ServerInfo]) -> None:
        self.need = need  # server id -> bytes still short (the walk's own, updated by it)
        self.live = live
        self.freed: dict[int, int] = {}  # chunk id -> its live bytes the victims take (add_live's)
        # server id -> bytes it may still evict past its need, and walk past
        self.budget = {sid: min(n, max(servers[sid].chunks.values(), default=0)) for sid, n in need.items()}
        self.walk = {sid: 2 * n for sid, n in self.budget.items()}
        # chunk id -> its keys held back until its last is found: (need's bytes, live bytes, keys)
        self.held: dict[int, tuple[int, int, list[tuple[bytes, Layout]]]] = {}
        self.given_up: set[int] = set()

    def add(self, key: bytes, lay: Layout) -> None:
        """A victim: the bytes it frees in each chunk."""
        add_live(self.freed, lay, +1, key)

    def _emptying(self, cid: int) -> bool:
        """A chunk the victims started on, on a server whose need is met, with live bytes
        left and not given up (its left bytes within twice the server's budget: a first
        filter, in ``live``'s units; :meth:`take` holds each key to the budget exactly)."""
        if cid not in self.freed or cid in self.given_up:
            return False
        sid = server_of_chunk(cid)
        if self.need.get(sid, 1) > 0:
            return False
        left = self.live.get(cid, 0) - self.freed.get(cid, 0)
        return 0 < left <= 2 * self.budget.get(sid, 0)

    def done(self) -> bool:
        """Every need met, and no chunk left to empty (or nothing more to walk)."""
        return all(v <= 0 for v in self.need.values()) and (
            all(v <= 0 for v in self.walk.values()) or not any(map(self._emptying, self.freed)))

    def take(self, key: bytes, lay: Layout, per: dict[int, int], may_go: bool) -> list[tuple[bytes, Layout]]:
        """A key the need did not take (on servers whose need is met): the keys that go
        now, this one and those held back for its chunk, once they leave that chunk empty."""
        if any(self.walk.get(sid, 1) <= 0 for sid in per):  # walked far enough on that server
            return []
        chunks = {r.chunk_id for x in lay.extents for r in x.replicas}
        mine = [c for c in chunks if self._emptying(c)]
        if not mine:
            for sid, n in per.items():
                if sid in self.walk:
                    self.walk[sid] -= n
            return []
        if not may_go or len(chunks) > 1 or len(per) > 1:  # (a key in one chunk only is taken)
            self.given_up.update(mine)
            for c in mine:
                self.held.pop(c, None)
            return []
        (cid,), ((sid, n),) = mine, per.items()
        spent, found, keys = self.held.pop(cid, (0, 0, []))
        mine_live: dict[int, int] = {}
        add_live(mine_live, lay, +1, key)
        spent, found = spent + n, found + mine_live[cid]
        if spent > self.budget.get(sid, 0):
            self.given_up.add(cid)
            return []
        keys.append((key, lay))
        if found < self.live.get(cid, 0) - self.freed.get(cid, 0):
            self.held[cid] = (spent, found, keys)
            return []
        self.budget[sid] -= spent  # the chunk's last key: they all go
        for k, kl in keys:
            self.add(k, kl)
        return keys


class MetaGc:
    """Meta's GC component: its RPC handlers work on the index it is handed (SQLite's
    :class:`~kvfs.meta.index.MetaIndex` or Redis's :class:`~kvfs.meta.shared_index.SharedIndex`,
    both a :class:`~kvfs.meta.storeapi.GcIndex`); GC's state is in the index's store."""

    def __init__(self, index: GcIndex) -> None:
        self.index = index
        self.draining: set[int] = set()  # being decommissioned (read from the store: refresh())
        self.decommissioned: set[int] = set()  # ids never reused
        self.zero_since: dict[int, float] = {}
        self.home: tuple[str, str] | None = None  # (meta's address, token), set once it listens
        self._room_lock = asyncio.Lock()
        self._room_started = 0  # MAKE_ROOM passes started
        self._room_running = False  # one of them runs now
        self._room_made = NO_ROOM  # the last pass's answer
        # the MAKE_ROOM passes' collector, kept from one pass to the next with its connections
        # (to meta itself and each chunkserver); dropped when a pass fails, made at the next
        self._room_gc: GarbageCollector | None = None
        # replicas readers reported bad (REPORT_BAD), each with its range, until checked
        self._suspects: dict[rpc.BadReplica, rpc.VerifyRange] = {}
        self._checking: asyncio.Task[None] | None = None
        self._dropping = False  # reports are being dropped (--suspect-replicas): logged once
        self._closed = False
        self._counting: asyncio.Future[RepairSummary] | None = None  # repair_summary's, in flight

    async def close(self) -> None:
        """Stop checking reported replicas (those not yet checked are forgotten); reports
        that come later are not taken; close the MAKE_ROOM passes' connections."""
        self._closed = True
        for task in (self._checking, self._counting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        gc, self._room_gc = self._room_gc, None
        if gc is not None:  # (a pass in flight fails; meta's RPC server, closed next, cancels it)
            await gc.aclose()

    async def refresh(self) -> None:
        """Read the decommissioning state again (another meta sharing the store may change it)."""
        ix = self.index
        self.draining = set(await ix.get_state("draining") or [])
        self.decommissioned = set(await ix.get_state("decommissioned") or [])

    async def _count(self, **inc: float) -> None:
        await self.index.add_counts(inc)

    async def summary(self) -> rpc.GcSummary:
        ix = self.index
        counts = await ix.counts()
        return rpc.GcSummary(paused=bool(await ix.get_state("paused") or False),
                             metrics={n: counts.get(n, 0) for n in METRIC_NAMES},
                             last_run=await ix.get_state("last_run"),
                             dead_chunks=await ix.retired_count(),
                             repair=(await self.repair_summary()).state())

    async def _repair_plan(self, limit_bytes: int, summary: RepairSummary | None) -> list[rpc.RepairItem]:
        ix = self.index
        gone = ix.gone_servers() | self.draining
        if not gone:  # nothing to scan
            return []
        alive = {sid for sid, s in ix.servers.items() if ix.alive(s)}
        now, items, planned = ix.clock(), list[rpc.RepairItem](), 0
        async with contextlib.aclosing(ix.refs(servers=gone)) as walk:
            async for rows in walk:  # (each page planned in its step)
                more = plan_repairs(rows, gone, alive, limit_bytes=limit_bytes - planned, now=now,
                                    summary=summary, first=not items,
                                    limit_items=rpc.MAX_REPAIR_PLAN_ITEMS - len(items))
                items += more
                planned += sum(it.length for it in more)
                if summary is None and (len(items) >= rpc.MAX_REPAIR_PLAN_ITEMS or planned >= limit_bytes):
                    break  # full, and no totals to count: the rest is for the next plans
        return items

    async def repair_summary(self) -> RepairSummary:
        """Under-replicated extents now (the keys on gone servers, only while one is gone).
        The callers that ask while one count is under way share it: each costs O(the gone
        servers' keys), and ``STATS`` (every ``kvfs stat``, every ``df`` on a mount) and
        ``GC_STATUS`` ask for one."""
        if self._counting is None:
            self._counting = asyncio.ensure_future(self._count_repairs())
            self._counting.add_done_callback(self._counted)
        return await asyncio.shield(self._counting)

    async def _count_repairs(self) -> RepairSummary:
        summary = RepairSummary()
        await self._repair_plan(0, summary)
        return summary

    def _counted(self, done: asyncio.Future[RepairSummary]) -> None:
        if self._counting is done:
            self._counting = None
        if not done.cancelled():
            done.exception()  # (retrieved: every caller may have gone meanwhile)

    async def _live_after(self, now: float, *, expire: bool,
                          evict: rpc.Watermarks | None) -> tuple[dict[int, int], set[bytes]]:
        """A dry run: each chunk's live bytes as the phases before it would leave them
        (``expire``: expired keys gone; ``evict``: the keys GC_EVICT with those watermarks
        would pick gone too), and the keys they would remove; nothing changes."""
        ix = self.index
        live_map = dict(await ix.live_bytes())
        gone: set[bytes] = set()
        if expire:
            async for rows in ix.expired_rows(now):
                for k, lay in rows:
                    if k not in gone:
                        add_live(live_map, lay, -1, k)
                        gone.add(k)
        if evict is not None:
            victims, *_ = await self._evict_victims(evict.high, evict.low, None, now, live_map, gone)
            async for page in pages(victims):
                for k, lay in page:
                    add_live(live_map, lay, -1, k)
                    gone.add(k)
        return live_map, gone

    async def _evict_victims(self, high: float, low: float, only: int | None, now: float,
                             live_map: dict[int, int] | None = None, gone: Collection[bytes] = (),
                             *, older: bool = True, stop_at_shadowed: int | None = None,
                             after: tuple[float, bytes] | None = None,
                             ) -> tuple[list[tuple[bytes, Layout]], int, dict[int, rpc.EvictTarget],
                                        dict[int, int], tuple[float, bytes] | None]:
        """Least recently used, unleased keys of the servers over ``high`` until they fit under
        ``low``: (victims with their layouts, leased keys skipped, live and target per server,
        bytes still short).  ``live_map`` and ``gone``: a dry run's view after the expire phase.
        ``older=False``: the keys with older records (:meth:`GcIndex.shadowed`) are passed
        over, not chosen: those the GC could not write tombstones for.
        ``stop_at_shadowed``: the walk stops once that many of its victims have older records
        (they go with tombstones first, a call's worth at a time: GC_EVICT's answer holds
        :data:`MAX_SHADOWED`), need met or not; the next call goes on from there: the last
        item is where (the last use and key of the last key of the LRU batch before the one
        it stopped in, or ``after`` if that was the first; None: it did not stop), which the
        next call's ``after`` names, so that it walks only what comes after it, not again the
        keys it passed over (leased, or on servers that needed no room).  Choosing every victim each
        call, to answer with a few thousand, made the calls of one eviction quadratic: 11 of
        them for 42k keys of 4 KiB, 0.2-1.3 s each, while a writer's MAKE_ROOM waited; walking
        again from the start each time, 6,000 to 28,000 keys a call for some 4,400 victims
        (bench/RESULTS.md).

        Then whole chunks: the chunks the victims left partly live (on a server that needed
        room) are emptied too where the keys left in them come next in the LRU order
        (:class:`_Finishing`), so compaction deletes those chunks instead of copying what
        is left of them.  Keys written in order are evicted in order, and without this each
        eviction left its last chunk partly live on each server, for compaction to copy: a
        quarter of the bytes evicted, in a full cluster's steady state (bench/RESULTS.md)."""
        ix = self.index
        live = await ix.live_bytes() if live_map is None else live_map
        need: dict[int, int] = {}
        report: dict[int, rpc.EvictTarget] = {}
        for s in ix.servers.values():
            if s.capacity <= 0 or (only is not None and s.server_id != only):
                continue
            wanted = s.wanted
            # the room values have: its written bytes and the room it said values have beside
            # its GC reserve (``--gc-reserve``), at most its capacity.  A reserve larger than
            # the room above the high watermark stops values short of it, and the daemon's
            # passes never evicted ahead: each write waited for a pass that made its own room,
            # and many writers at once failed as full (bench/RESULTS.md); the watermarks of
            # such a server are of its room
            room = min(s.capacity, ix.used(s) + s.free)
            basis = s.capacity if room >= high * s.capacity else room
            if ix.used(s) > high * basis or wanted:
                have, target = server_live(s, live), int(low * basis)
                report[s.server_id] = rpc.EvictTarget(have, target)
                # a write it refused fits once its live bytes are down to that room less
                # what the write wanted (the garbage compacted away).  Counted against the
                # capacity, with a reserve larger than the room over the low watermark (37.5 %
                # in the test) a server refused every write with its live bytes under that
                # watermark, and no pass evicted: every write failed as full, for good
                short = max(have - target, have + wanted - room)
                if short > 0:
                    need[s.server_id] = short
        victims: list[tuple[bytes, Layout]] = []
        leased = 0
        stopped_at: tuple[float, bytes] | None = None

        def needed(per: dict[int, int]) -> bool:
            return any(need.get(sid, 0) > 0 for sid in per)

        if need:
            whole = _Finishing(need, live, ix.servers)
            with_older = 0  # victims so far with older records (counted with stop_at_shadowed)
            walked = after  # the last key of the batches walked whole
            async for rows in ix.lru_order(after=after):
                if whole.done():
                    break
                start = len(victims)
                candidates = []
                for k, lay, _ in rows:
                    if k in gone:
                        continue
                    per: dict[int, int] = defaultdict(int)
                    for x in lay.extents:
                        for r in x.replicas:
                            per[r.server_id] += x.length
                    if any(sid in need for sid in per):
                        candidates.append((k, lay, per))
                held = await ix.leased([k for k, _, _ in candidates], now) if candidates else set()
                passed = (await ix.shadowed([k for k, _, _ in candidates], now)
                          if candidates and not older else set())
                for k, lay, per in candidates:
                    if not needed(per):
                        victims += whole.take(k, lay, per, k not in passed and (k not in held or lay.expired(now)))
                        continue
                    if k in passed:
                        continue
                    if k in held and not lay.expired(now):
                        leased += 1
                        continue
                    victims.append((k, lay))
                    whole.add(k, lay)
                    for sid, n in per.items():
                        if sid in need:
                            need[sid] -= n
                if stop_at_shadowed is not None and len(victims) > start:
                    with_older += len(await ix.shadowed((k for k, _ in victims[start:]), now))
                    if with_older >= stop_at_shadowed:
                        stopped_at = walked
                        break
                if rows:
                    walked = (rows[-1][2], rows[-1][0])
        return victims, leased, report, need, stopped_at

    async def _chunk_victims(self, cid: int, now: float, *, older: bool) -> tuple[list[tuple[bytes, Layout]], int]:
        """GC_EVICT's ``chunk``: every key with a replica in that chunk (``older=False``: less
        those with older records, :meth:`GcIndex.shadowed`), or none if any of them is
        leased (the chunk could not be emptied: the GC tries another); and how many were
        leased.  O(the chunk's keys), from the per-chunk key index."""
        ix = self.index
        rows: list[tuple[bytes, Layout]] = []
        async for page in ix.refs([cid]):
            rows += page
        keys = [k for k, _ in rows]
        held = await ix.leased(keys, now) if rows else set()
        leased = sum(1 for k, lay in rows if k in held and not lay.expired(now))
        if leased:
            return [], leased
        passed = await ix.shadowed(keys, now) if rows and not older else set()
        return [(k, lay) for k, lay in rows if k not in passed], 0

    # RPCs ------------------------------------------------------------------------
    async def rpc_gc_control(self, req: rpc.GcControl, payload: memoryview) -> Reply:
        ix = self.index
        paused = bool(await ix.get_state("paused") or False)
        if req.paused is not None and req.paused != paused:
            paused = req.paused
            await ix.put_state("paused", paused)
            log.info("gc %s", "paused" if paused else "resumed")
        granted, cursor = True, None
        if req.holder is not None:
            granted = await ix.claim(DAEMON_LEASE, req.holder, req.lease_s)
            saved = await ix.get_state("scrub_cursor")
            cursor = bytes.fromhex(saved) if saved else None
        return rpc.GcControlled(paused=paused, granted=granted, scrub_cursor=cursor), ()

    async def rpc_gc_report(self, req: rpc.GcReport, payload: memoryview) -> Reply:
        ix = self.index
        run = dict(req.run)
        # whole microseconds: Redis's HINCRBYFLOAT keeps 17 decimal places, so a finer sum
        # would no longer equal the pass's own figure
        d = run["duration_s"] = round(float(run.get("duration_s", 0.0)), 6)
        await ix.put_state("last_run", run)
        if req.scrub_cursor is not None:
            await ix.put_state("scrub_cursor", req.scrub_cursor.hex())
        if run.get("apply"):
            await ix.add_counts({"passes": 1, "pass_duration_s": d,
                                 # the background scrub's share of the pass (kvfs.gc.scrub)
                                 "bytes_scrubbed": int(run.get("scrub_bytes_verified", 0)),
                                 # found bad and still named by their layouts (one a racing
                                 # compaction or overwrite moved is "missing", not bad)
                                 "replicas_scrubbed_bad": int(run.get("scrub_repairable", 0))
                                 + int(run.get("scrub_replicas_dropped", 0))},
                                {"last_pass_duration_s": d})
        return rpc.Empty(), ()

    async def rpc_gc_status(self, req: rpc.GcStatus, payload: memoryview) -> Reply:
        ix = self.index
        now = ix.clock()
        expired: dict[int, int] = defaultdict(int)
        seen: set[bytes] = set()
        async for rows in ix.expired_rows(now):
            for k, lay in rows:
                if k not in seen:
                    seen.add(k)
                    for sid in {r.server_id for x in lay.extents for r in x.replicas}:
                        expired[sid] += 1
        expired_total = len(seen)
        live_by = await ix.server_live()
        dead = await ix.retired_among(c for s in ix.servers.values() for c in s.chunks)
        servers = []
        for s in sorted(ix.servers.values(), key=lambda s: s.server_id):
            used = ix.used(s)
            live = live_by.get(s.server_id, 0)
            garbage = max(0, used - live)
            servers.append(rpc.GcServerStatus(
                server_id=s.server_id, addr=s.addr, alive=ix.alive(s),
                capacity=s.capacity, used=used, live=live, garbage=garbage,
                ratio=garbage / used if used else 0.0, chunks=len(s.chunks),
                dead_chunks=sum(1 for c in s.chunks if c in dead),
                expired_keys=expired.get(s.server_id, 0),
                fill=used / s.capacity if s.capacity else 0.0))
        summary = await self.summary()
        return rpc.GcStatusReply(time=now, servers=servers, expired_keys=expired_total,
                                 paused=summary.paused, metrics=summary.metrics,
                                 last_run=summary.last_run, dead_chunks=summary.dead_chunks,
                                 repair=summary.repair), ()

    async def rpc_gc_expire(self, req: rpc.GcExpire, payload: memoryview) -> Reply:
        ix = self.index
        now = ix.clock()
        if not req.apply:
            sizes: dict[bytes, int] = {}
            async for rows in ix.expired_rows(now):
                sizes.update((k, disk_bytes(lay)) for k, lay in rows)
            n, nbytes = len(sizes), sum(sizes.values())
            return rpc.Expired(keys=n, bytes=nbytes, more=False), ()
        removed, more, shadowed = await ix.expire(now, req.limit)
        if len(shadowed) > MAX_SHADOWED:
            shadowed, more = shadowed[:MAX_SHADOWED], True
        n, nbytes = len(removed), sum(disk_bytes(lay) for _, lay in removed)
        if n:
            await self._count(keys_expired=n, bytes_expired=nbytes)
        return rpc.Expired(keys=n, bytes=nbytes, more=more,
                           shadowed=[rpc.Shadowed(k, lay) for k, lay in shadowed]), ()

    async def rpc_gc_evict(self, req: rpc.GcEvict, payload: memoryview) -> Reply:
        ix = self.index
        now = ix.clock()
        if req.chunk is not None:
            victims, leased = await self._chunk_victims(req.chunk, now, older=req.older)
            report: dict[int, rpc.EvictTarget] = {}
            need: dict[int, int] = {}
            stopped_at = None
        else:
            live_map, gone = (await self._live_after(now, expire=True, evict=None)  # as --apply would see it
                              if not req.apply and req.after_expire else (None, set()))
            victims, leased, report, need, stopped_at = await self._evict_victims(
                req.high, req.low, req.server_id, now, live_map, gone, older=req.older,
                stop_at_shadowed=MAX_SHADOWED if req.apply else None, after=req.after)
        shadowed: list[rpc.Shadowed] = []
        if req.apply:
            older = await ix.shadowed((k for k, _ in victims), now)
            if older:  # left for a tombstone (GC_TOMBSTONE); past MAX_SHADOWED, for the next call
                shadowed = [rpc.Shadowed(k, lay) for k, lay in victims if k in older][:MAX_SHADOWED]
                victims = [(k, lay) for k, lay in victims if k not in older]
            victims = await ix.evict(victims, now)  # those still unleased and unchanged
        n, nbytes = len(victims), 0
        async for page in pages(victims):
            nbytes += sum(disk_bytes(lay) for _, lay in page)
        if req.apply and n:
            await self._count(keys_evicted=n, bytes_evicted=nbytes)
            log.info("evicted %d keys (%d bytes)", n, nbytes)
        return rpc.Evicted(keys=n, bytes=nbytes, leased=leased, servers=report,
                           short={sid: v for sid, v in need.items() if v > 0}, shadowed=shadowed,
                           stopped_at=None if stopped_at is None or not shadowed else rpc.LruAt(*stopped_at)), ()

    async def rpc_gc_tombstone(self, req: rpc.GcTombstone, payload: memoryview) -> Reply:
        """Remove the keys GC_EXPIRE or GC_EVICT left for a tombstone, each keeping the
        tombstone the GC wrote (compare-and-swap: still that layout, still expired or, for
        an eviction, unleased)."""
        ix = self.index
        keys = [it.key for it in req.items]
        if len(set(keys)) != len(keys):
            raise InvalidArgument("GC_TOMBSTONE names a key twice")
        now = ix.clock()
        tombs = await tombstone_layouts(ix, keys, [it.tombstone for it in req.items], now)
        removed = await ix.drop_tombstoned([(it.key, it.layout, t) for it, t in zip(req.items, tombs, strict=True)],
                                           now, evict=req.evict)
        n, nbytes = len(removed), sum(disk_bytes(lay) for _, lay in removed)
        if n:
            if req.evict:
                await self._count(keys_evicted=n, bytes_evicted=nbytes)
            else:
                await self._count(keys_expired=n, bytes_expired=nbytes)
        return rpc.Tombstoned(keys=n, bytes=nbytes), ()

    async def rpc_gc_plan(self, req: rpc.GcPlan, payload: memoryview) -> Reply:
        ix = self.index
        threshold, grace_s, high = req.threshold, req.grace_s, req.high
        now = ix.clock()
        compact: list[rpc.CompactCandidate] = []
        delete: list[rpc.DeleteCandidate] = []
        seal: list[rpc.SealCandidate] = []
        waiting = 0
        zero_since = self.zero_since
        if req.after_expire or req.after_evict:  # a dry run: as if those phases had run first
            live_map, _ = await self._live_after(now, expire=req.after_expire, evict=req.after_evict)
            zero_since = dict(zero_since)  # and start no grace clocks for it
        else:
            live_map = await ix.live_bytes()
        dead = await ix.retired_among(c for s in ix.servers.values() for c in s.chunks)
        for s in ix.servers.values():
            pressure = s.capacity > 0 and (ix.used(s) > high * s.capacity or s.wanted)
            open_chunk = s.open_chunk
            for cid, written in s.chunks.items():
                if cid == open_chunk:
                    live = live_map.get(cid, 0)
                    if live <= 0 and written > 0:
                        since = zero_since.setdefault(cid, now)
                        if now - since >= grace_s:
                            seal.append(rpc.SealCandidate(s.server_id, cid, written, max(live, 0)))
                    elif written > 0 and written - live > 0 and (
                            (written - live) / written > threshold or pressure):
                        seal.append(rpc.SealCandidate(s.server_id, cid, written, live))
                    continue
                if cid in dead:  # retired, file still there: delete again
                    delete.append(rpc.DeleteCandidate(s.server_id, cid, written))
                    continue
                live = live_map.get(cid, 0)
                if live <= 0:
                    since = zero_since.setdefault(cid, now)
                    if now - since >= grace_s:
                        delete.append(rpc.DeleteCandidate(s.server_id, cid, written))
                    else:
                        waiting += 1
                    continue
                zero_since.pop(cid, None)
                garbage = written - live
                if written > 0 and garbage > 0 and (garbage / written > threshold or pressure):
                    compact.append(rpc.CompactCandidate(s.server_id, cid, written, live))
        compact.sort(key=lambda c: c.live - c.written)  # most garbage first
        return rpc.Plan(compact=compact, delete=delete, seal=seal, waiting=waiting), ()

    async def rpc_gc_chunk_refs(self, req: rpc.GcChunkRefs, payload: memoryview) -> Reply:
        """References into the given chunks (kept tombstones too: length 0, for compaction to
        copy): O(their keys), from the per-chunk key index."""
        ix = self.index
        chunks = set(req.chunks)
        now = ix.clock()
        refs: dict[int, list[rpc.Ref]] = {c: [] for c in chunks}
        async for rows in ix.refs(chunks):
            for k, lay in rows:
                if lay.expired(now):
                    continue
                for x in lay.extents:
                    for r in x.replicas:
                        if r.chunk_id in chunks:
                            refs[r.chunk_id].append(rpc.Ref(k, r.offset, x.length, x.crc))
        tombs, dropped = await ix.tombstone_refs(chunks)
        for cid, k, off in tombs:
            refs[cid].append(rpc.Ref(k, off, 0, 0))
        if dropped:
            await self._count(tombstones_dropped=dropped)
        return rpc.ChunkRefs(refs=refs), ()

    async def rpc_gc_layouts(self, req: rpc.GcLayouts, payload: memoryview) -> Reply:
        """A page of the stored keys after ``start_after`` with their layouts, read from
        the store's key order (SQLite's primary key, Redis's sorted indexes): O(the page),
        never a walk of every key, so the scrub's walks (its background slices, ``kvfs gc
        scrub``, fsck) cost meta a page a step; ``time``: this meta's clock, for their expiry."""
        now = self.index.clock()
        rows = await self.index.list_keys(b"", req.start_after, req.limit)
        return rpc.KeyLayouts(rows=[rpc.KeyLayout(k, lay) for k, lay in rows], time=now), ()

    async def rpc_gc_relocate(self, req: rpc.GcRelocate, payload: memoryview) -> Reply:
        """Point each moved replica at its copy, compare-and-swap: only where the layout still
        names the old (chunk, offset), and never into a chunk retired since the copy."""
        ix = self.index
        sid, new_chunk, moves = req.server_id, req.new_chunk, req.moves
        now = ix.clock()
        if server_of_chunk(new_chunk) != sid:
            raise InvalidArgument(f"GC_RELOCATE to chunkserver {sid}: {misfiled_why(sid, new_chunk)}")
        by_key: dict[bytes, dict[tuple[int, int], int]] = defaultdict(dict)
        for key, old_chunk, old_off, new_off in moves:
            by_key[key][(old_chunk, old_off)] = new_off
        if await ix.retired_among([new_chunk]):  # (kept tombstones' copies are not counted)
            tombed = await ix.tombstoned(by_key)
            return rpc.Relocated(moved=0, skipped=sum(m[0] not in tombed for m in moves)), ()
        handled, tomb_moves = await ix.relocate_tombstones(sid, new_chunk, by_key)
        keys = [k for k in by_key if k not in handled]
        rows: list[tuple[bytes, Layout, Layout]] = []
        changes: list[int] = []
        dropped: list[bytes] = []
        for key, lay in zip(keys, await ix.layouts(keys), strict=True):
            if lay is None or lay.expired(now):
                dropped.append(key)
                continue
            mapping = by_key[key]
            exts = []
            changed = 0
            for x in lay.extents:
                reps = []
                for r in x.replicas:
                    no = mapping.get((r.chunk_id, r.offset)) if r.server_id == sid else None
                    if no is None:
                        reps.append(r)
                    else:
                        reps.append(Replica(sid, new_chunk, no))
                        changed += 1
                exts.append(Extent(x.length, x.crc, tuple(reps)))
            if changed:
                rows.append((key, lay, msgspec.structs.replace(lay, extents=tuple(exts))))
                changes.append(changed)
        switched = await ix.switch(rows)
        if dropped:  # dropped (or expiring) since the copy: the copy is a dropped record
            await ix.ghost_copies((k, new_chunk) for k in dropped)
        moved = sum(n for n, ok in zip(changes, switched, strict=True) if ok)
        if moved or tomb_moves:
            s = ix.servers.get(sid)
            if s is not None and req.new_size is not None:
                s.chunks[new_chunk] = req.new_size
        if moved:
            await self._count(keys_relocated=sum(switched))
        old_chunks = list({c for m in by_key.values() for c, _ in m})
        live = await ix.live_bytes(old_chunks)
        for old_chunk in old_chunks:
            if live.get(old_chunk, 0) <= 0:
                self.zero_since.setdefault(old_chunk, now)
        return rpc.Relocated(moved=moved, skipped=len(moves) - moved - tomb_moves), ()

    async def rpc_gc_retire(self, req: rpc.GcRetire, payload: memoryview) -> Reply:
        """Mark dead the chunks no layout references (compare-and-swap in the index; never the
        server's open chunk); a dead chunk is refused by COMMIT and GC_RELOCATE forever after."""
        ix = self.index
        sid = req.server_id
        s = ix.servers.get(sid)
        open_chunk = s.open_chunk if s is not None else None
        dead = await ix.retired_among(req.chunks)
        retired = await ix.retire(sid, [c for c in req.chunks if c in dead or c != open_chunk], ix.clock())
        for c in retired:
            self.zero_since.pop(c, None)
        return rpc.Retired(retired=retired), ()

    async def rpc_gc_deleted(self, req: rpc.GcDeleted, payload: memoryview) -> Reply:
        ix = self.index
        s = ix.servers.get(req.server_id)
        deleted = req.deleted
        if s is not None:
            for c in deleted:
                s.chunks.pop(c, None)
        inc: dict[str, float] = {}
        if deleted:
            await ix.chunks_deleted(deleted.keys())
            inc.update(chunks_deleted=len(deleted), bytes_reclaimed=sum(deleted.values()))
            dropped = await ix.drop_passed()  # chunks gone: tombstones' horizons may have passed
            if dropped:
                inc.update(tombstones_dropped=dropped)
        if req.compacted:
            inc.update(chunks_compacted=req.compacted, bytes_copied=req.copied)
        if inc:
            await self._count(**inc)
        return rpc.Empty(), ()

    # decommission ------------------------------------------------------------------
    async def drain_left(self, sids: Collection[int]) -> dict[int, tuple[int, int]]:
        """(extents, bytes) with a replica on each of servers ``sids``, expired keys too."""
        left = {sid: [0, 0] for sid in sids}
        async for rows in self.index.refs(servers=sids):
            for _, lay in rows:
                for x in lay.extents:
                    for sid in {r.server_id for r in x.replicas if r.server_id in left}:
                        left[sid][0] += 1
                        left[sid][1] += x.length
        return {sid: (n, b) for sid, (n, b) in left.items()}

    async def _referenced(self, sid: int) -> bool:
        """Whether a stored key (expired ones too) has a replica on server ``sid``: the walk
        of :meth:`drain_left` up to the first such key (each repair plan asks)."""
        async with contextlib.aclosing(self.index.refs(servers=[sid])) as walk:
            async for rows in walk:
                if rows:
                    return True
        return False

    async def _save_drains(self) -> None:
        ix = self.index
        await ix.put_state("draining", sorted(self.draining))
        await ix.put_state("decommissioned", sorted(self.decommissioned))

    async def forget_drained(self) -> list[int]:
        """Forget each draining server nothing references any more; its id is never reused."""
        if not self.draining:
            return []
        done = [sid for sid in sorted(self.draining) if not await self._referenced(sid)]
        for sid in done:
            self.draining.discard(sid)
            self.decommissioned.add(sid)
            await self.index.delete_server(sid)
            log.info("chunkserver %d drained and forgotten", sid)
        if done:
            await self._save_drains()
        return done

    async def rpc_gc_decommission(self, req: rpc.GcDecommission, payload: memoryview) -> Reply:
        """Start (or cancel) draining a chunkserver; forget it once drained; its state now."""
        sid = req.server_id
        await self.refresh()
        if sid in self.decommissioned:
            return rpc.DrainState(server_id=sid, draining=False, forgotten=True, extents_left=0,
                                  bytes_left=0), ()
        if sid not in self.index.servers:
            raise InvalidArgument(f"unknown chunkserver {sid} (kvfs stat lists them)")
        if req.cancel and sid in self.draining:
            self.draining.discard(sid)
            await self._save_drains()
            log.info("chunkserver %d: drain cancelled", sid)
        elif req.start and not req.cancel and sid not in self.draining:
            self.draining.add(sid)
            await self._save_drains()
            log.info("chunkserver %d draining: no new placements, repair copies its extents away", sid)
        forgotten = sid in await self.forget_drained()
        n, nbytes = (0, 0) if forgotten else (await self.drain_left([sid]))[sid]
        return rpc.DrainState(server_id=sid, draining=sid in self.draining, forgotten=forgotten,
                              extents_left=n, bytes_left=nbytes), ()

    async def rpc_gc_repair_plan(self, req: rpc.GcRepairPlan, payload: memoryview) -> Reply:
        """Extents with a replica on a gone server, readable from a live one (kvfs.meta.repair);
        draining servers that nothing references any more are forgotten first."""
        await self.forget_drained()
        summary = RepairSummary() if req.totals else None
        items = await self._repair_plan(req.limit_bytes, summary)
        st = (summary or RepairSummary()).state()
        return rpc.RepairPlan(items=items, under_replicated_extents=st.under_replicated_extents,
                              under_replicated_bytes=st.under_replicated_bytes,
                              unrepairable_extents=st.unrepairable_extents), ()

    async def _switch_by_key(self, rows: Sequence[tuple[bytes, Layout, Layout]]) -> set[bytes]:
        """:meth:`GcIndex.switch`; the keys switched."""
        ok = await self.index.switch(rows)
        return {k for (k, _, _), done in zip(rows, ok, strict=True) if done}

    async def rpc_gc_repair(self, req: rpc.GcRepair, payload: memoryview) -> Reply:
        """Switch each lost replica to its new copy, compare-and-swap (kvfs.meta.repair).
        Planned a page of keys per step, switched a page per step (:meth:`GcIndex.switch`): a
        plan's 16,384 switches in one step held the loop 0.55-0.9 s at 300k keys
        (bench/RESULTS.md); a key changed between the two keeps its change."""
        ix = self.index
        by_key: dict[bytes, list[rpc.ReplicaSwitch]] = {}
        for it in req.items:
            by_key.setdefault(it.key, []).append(it)
        staged: dict[bytes, tuple[Layout, Layout, int, int]] = {}  # key -> old, new, extents, bytes
        gone: list[tuple[bytes, int]] = []
        skipped = 0
        async for keys in pages(list(by_key), WRITE_PAGE):
            current = dict(zip(keys, await ix.layouts(keys), strict=True))
            items = [it for k in keys for it in by_key[k]]
            dead = await ix.retired_among({*(r.chunk_id for lay in current.values() if lay is not None
                                             for e in lay.extents for r in e.replicas),
                                           *(it.new.chunk_id for it in items)})
            for key, extent, lost, new in items:
                old = current.get(key)
                if old is None:  # deleted since the plan: its copy is an older record its
                    gone.append((key, new.chunk_id))  # tombstone must outlive (below)
                if (old is None or new.server_id not in ix.servers
                        or server_of_chunk(new.chunk_id) != new.server_id):
                    skipped += 1
                    continue
                _, cur, n, nb = staged.get(key, (old, old, 0, 0))
                switched = replace_replica(cur, extent, lost, new)
                if switched is None or dead_in(switched, dead):
                    skipped += 1
                    continue
                staged[key] = (old, switched, n + 1, nb + switched.extents[extent].length)
        done = await self._switch_by_key([(k, old, new) for k, (old, new, _, _) in staged.items()])
        await ix.raise_horizons(gone)
        await ix.ghost_copies(gone)  # (or dropped by the GC: a dropped record, if put again)
        repaired = nbytes = 0
        for k, (_, _, n, nb) in staged.items():
            if k in done:
                repaired, nbytes = repaired + n, nbytes + nb
            else:  # changed since the plan: that change wins
                skipped += n
        if repaired:
            await self._count(extents_repaired=repaired, bytes_repaired=nbytes)
        return rpc.Repaired(repaired=repaired, skipped=skipped), ()

    async def rpc_gc_scrub_plan(self, req: rpc.GcScrubPlan, payload: memoryview) -> Reply:
        """Replicas a scrub found bad: repair from a good copy, or drop (kvfs.meta.repair)."""
        ix = self.index
        keys = list(dict.fromkeys(b[0] for b in req.bad))
        layouts = {k: lay for k, lay in zip(keys, await ix.peek(keys, ix.clock()), strict=True)
                   if lay is not None}
        alive = {sid for sid, s in ix.servers.items() if ix.alive(s)} - ix.gone_servers()
        plan = plan_scrub(req.bad, layouts, alive)
        return rpc.ScrubPlanned(items=plan.items, drop=plan.drop, lost=plan.lost), ()

    async def rpc_gc_drop_replicas(self, req: rpc.GcDropReplicas, payload: memoryview) -> Reply:
        """fsck repair: forget replicas whose bytes are missing or corrupt; a key left with an
        extent without replicas is deleted (a cache miss is correct, wrong bytes never are).
        Both compare-and-swap: a key changed since keeps its change."""
        ix = self.index
        bad: dict[bytes, set[tuple[int, int, int]]] = defaultdict(set)
        for key, sid, cid, off in req.items:
            bad[key].add((sid, cid, off))
        keys = list(bad)
        staged: list[tuple[bytes, Layout, Layout]] = []
        doomed: list[tuple[bytes, Layout]] = []
        drops: dict[bytes, int] = {}
        for key, old in zip(keys, await ix.layouts(keys), strict=True):
            if old is None:
                continue
            which = bad[key]
            exts = []
            n = 0
            for x in old.extents:
                reps = tuple(r for r in x.replicas if (r.server_id, r.chunk_id, r.offset) not in which)
                n += len(x.replicas) - len(reps)
                exts.append(Extent(x.length, x.crc, reps))
            if not n:
                continue
            drops[key] = n
            if any(not x.replicas for x in exts):
                doomed.append((key, old))
            else:
                staged.append((key, old, msgspec.structs.replace(old, extents=tuple(exts))))
        done = await self._switch_by_key(staged)
        n_deleted = await ix.drop_lost(doomed) if doomed else 0
        dropped = sum(drops[k] for k in done) + sum(drops[k] for k, _ in doomed)
        if dropped:
            await self._count(replicas_dropped=dropped, keys_lost=n_deleted)
        return rpc.Dropped(dropped=dropped, deleted_keys=n_deleted), ()

    async def rpc_report_bad(self, req: rpc.ReportBad, payload: memoryview) -> Reply:
        """Replicas a reader found failing their CRC-32C: each that its key's layout still
        names is held (with the range and CRC-32C the layout gives it) for :meth:`_check_reported`,
        up to ``suspect_replicas``; nothing changes on a reader's word.  A report costs at
        most a lookup of the keys there is room for."""
        ix = self.index
        limit = ix.config.suspect_replicas
        items = [b for b in dict.fromkeys(req.items) if b not in self._suspects]
        room = limit - len(self._suspects)
        if len(items) > room and limit:
            if not self._dropping:
                log.warning("%d replicas reported bad are waiting to be checked "
                            "(--suspect-replicas): more reports dropped until they are", len(self._suspects))
            self._dropping = True
        items = items[:max(0, room)]
        if not items or self._closed or self.home is None:  # (home: set once meta listens)
            return rpc.BadNoted(queued=0), ()
        keys = list(dict.fromkeys(b.key for b in items))
        layouts = dict(zip(keys, await ix.peek(keys, ix.clock()), strict=True))
        queued = 0
        for b in items:
            rng = _range_of(layouts.get(b.key), b)
            if rng is not None and b not in self._suspects and len(self._suspects) < limit:
                self._suspects[b] = rng
                queued += 1
        if queued and not self._closed and (self._checking is None or self._checking.done()):
            self._checking = asyncio.get_running_loop().create_task(self._check_reported())
        return rpc.BadNoted(queued=queued), ()

    async def _check_reported(self) -> None:
        """Check the reported replicas on their servers and mend the bad ones
        (:func:`kvfs.gc.scrub.check_reported`, with the admin token), until none is left."""
        from kvfs.gc.driver import GarbageCollector
        from kvfs.gc.scrub import check_reported

        assert self.home is not None
        addr, token = self.home
        while self._suspects:
            batch = dict(self._suspects)
            try:
                async with GarbageCollector(addr, token=token, tls=self.index.config) as gc:
                    r = await check_reported(gc, batch)
                found = r.repairable + r.replicas_dropped  # bad, and still named by a layout
                if found:
                    await self._count(replicas_reported_bad=found)
                log.info("replicas readers reported bad: %d checked, %d found bad, %d repaired "
                         "from a good copy, %d dropped", r.ranges_checked, found, r.repaired,
                         r.replicas_dropped)
            except Exception as exc:  # any failure: these are forgotten (a scrub finds them)
                log.warning("checking %d replicas readers reported bad failed: %s", len(batch), exc)
            finally:
                for b in batch:
                    self._suspects.pop(b, None)
        self._dropping = False

    async def rpc_make_room(self, req: rpc.MakeRoom, payload: memoryview) -> Reply:
        """One GC pass (apply, no grace period, no repair: copies would take room, not make
        it) on behalf of a writer that found the cluster full.  Requests that arrive while a
        pass runs wait for it and have its answer if it made room (the writer tries again,
        and asks again should others have taken that room: a pass already under way
        usually frees more than a write needs, as it evicts to the low watermark); if it made
        none, they wait for the next one, which they share (it starts after their refused
        appends were reported: meta knows the room they want).  Each waited for a whole pass
        more before: a writer's MAKE_ROOM took up to two (bench/RESULTS.md).  The passes
        share one collector and its connections: a new
        one per pass cost meta some 4 ms of CPU and a connection to itself and to each
        chunkserver (bench/RESULTS.md).

        Each request is counted (``kvfs gc status``: how often writers found the cluster
        full, how long they waited, and how many were told no room was made, so their
        writes failed as full), with the passes run for them."""
        start = time.monotonic()
        try:
            made, ran = await self._make_room()
        except Exception:
            with contextlib.suppress(Exception):  # (the request's own error is the one to raise)
                await self._count(room_requests=1, room_wait_s=round(time.monotonic() - start, 6),
                                  room_refused=1)
            raise
        await self._count(room_requests=1, room_wait_s=round(time.monotonic() - start, 6),
                          room_refused=0 if made.freed else 1, room_passes=int(ran))
        return made, ()

    async def _make_room(self) -> tuple[rpc.RoomMade, bool]:
        """MAKE_ROOM's answer, and whether this request ran the pass (else it shared one)."""
        from kvfs.gc.driver import GarbageCollector, PassOptions  # the daemon's pass (no scrub)

        ran = False
        if self.home is None:
            raise Unavailable("meta is not listening yet")
        ticket, running = self._room_started, self._room_running
        async with self._room_lock:
            # no pass started since this request arrived, and the one running then made no room
            if self._room_started == ticket and not (running and self._room_made.freed):
                if self._closed:  # (no collector made that close() would not close)
                    raise Unavailable("meta is shutting down")
                self._room_started += 1
                self._room_running = True
                addr, token = self.home
                log.info("cluster full: a GC pass on a writer's request")
                gc = self._room_gc
                if gc is None:
                    gc = self._room_gc = GarbageCollector(addr, token=token, tls=self.index.config)
                try:
                    r = await gc.run_pass(PassOptions(apply=True, grace_s=0.0, repair=False, only_needed=True))
                except BaseException:
                    self._room_gc = None
                    self._room_made = NO_ROOM  # (those waiting for it run the next)
                    gc.close()
                    raise
                finally:
                    self._room_running = False
                self._room_made = rpc.RoomMade(expired_keys=r.expired_keys, evicted_keys=r.evicted_keys,
                                               bytes_reclaimed=r.bytes_reclaimed)
                ran = True
        return self._room_made, ran
