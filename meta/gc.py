"""Meta's side of garbage collection: expiry, eviction, compaction switches, chunk retirement.

Meta never touches chunk files; :mod:`kvfs.gc` drives a pass and meta answers
with plans and applies each destructive step as a compare-and-swap inside one
SQLite transaction (and one event-loop step, so no other RPC sees half of it):

- GC_EXPIRE removes keys whose ``expires_at`` passed (the ``kv_expiry`` index);
- GC_EVICT removes least-recently-used, unleased keys of servers over the high
  watermark until their live bytes fit under the low watermark;
- GC_RELOCATE points a replica at its compacted copy only if the layout still
  names the old (chunk, offset): a concurrent overwrite or delete wins;
- GC_RETIRE marks a chunk dead only if no layout references it; a dead chunk
  id is refused by COMMIT forever after (ids are never reused), so a late
  commit can never produce a dangling key;
- the tombstones meta keeps (:mod:`kvfs.meta.tombstones`) are live data: GC_CHUNK_REFS
  names them, GC_RELOCATE moves them, and GC_DELETED drops those no older record of
  their key can outlive any more.

MAKE_ROOM (a client's write found the cluster full) is the one exception to
"driven from outside": meta runs one :mod:`kvfs.gc` pass against itself, the
same pass the daemon runs, so a client never runs GC.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Collection

import msgspec

from kvfs import rpc
from kvfs.errors import InvalidArgument, Unavailable
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.index import Entry, MetaIndex, disk_bytes
from kvfs.meta.repair import RepairSummary, plan_repairs, plan_scrub, replace_replica
from kvfs.meta.tombstones import floors, passed, raise_horizon, tomb_layout
from kvfs.server import Reply

log = logging.getLogger("kvfs.meta.gc")

METRIC_NAMES = (
    "keys_expired", "bytes_expired", "keys_evicted", "bytes_evicted", "chunks_compacted",
    "bytes_copied", "keys_relocated", "chunks_deleted", "bytes_reclaimed", "replicas_dropped",
    "passes", "pass_duration_s", "last_pass_duration_s", "extents_repaired", "bytes_repaired",
    "tombstones_dropped",
)


class MetaGc:
    """Meta's GC component: its RPC handlers work on the :class:`MetaIndex` it is handed,
    and it keeps GC's own state (paused, metrics, retired chunks)."""

    def __init__(self, index: MetaIndex) -> None:
        self.index = index
        store = index.store
        self.paused = bool(store.get_state("paused") or False)
        saved = store.get_state("metrics") or {}
        self.metrics: dict[str, float] = {n: saved.get(n, 0) for n in METRIC_NAMES}
        self.last_run: dict[str, float | bool] | None = store.get_state("last_run")
        self.dead_chunks: dict[int, float] = {c: t for c, _, t in store.load_dead()}
        self.draining: set[int] = set(store.get_state("draining") or [])  # being decommissioned
        self.decommissioned: set[int] = set(store.get_state("decommissioned") or [])  # ids never reused
        self.zero_since: dict[int, float] = {}
        self.home: tuple[str, str] | None = None  # (meta's address, token), set once it listens
        self._room_lock = asyncio.Lock()
        self._room_started = 0  # MAKE_ROOM passes started
        self._room_made = rpc.RoomMade(expired_keys=0, evicted_keys=0, bytes_reclaimed=0)

    def _count(self, **inc: float) -> None:
        for k, v in inc.items():
            self.metrics[k] = self.metrics.get(k, 0) + v
        self.index.store.put_state("metrics", self.metrics)

    def summary(self) -> rpc.GcSummary:
        return rpc.GcSummary(paused=self.paused, metrics=dict(self.metrics),
                             last_run=self.last_run, dead_chunks=len(self.dead_chunks),
                             repair=self.repair_summary().state())

    def _repair_plan(self, limit_bytes: int, summary: RepairSummary | None) -> list[rpc.RepairItem]:
        ix = self.index
        alive = {sid for sid, s in ix.servers.items() if ix.alive(s)}
        return plan_repairs(((k, e.layout) for k, e in ix.entries.items()),
                            ix.gone_servers() | self.draining,
                            alive, limit_bytes=limit_bytes, now=ix.clock(), summary=summary)

    def repair_summary(self) -> RepairSummary:
        """Under-replicated extents now (a scan of the index, only while a server is gone)."""
        summary = RepairSummary()
        self._repair_plan(0, summary)
        return summary

    def check_not_dead(self, layout: Layout) -> bool:
        dead = self.dead_chunks
        return not dead or all(r.chunk_id not in dead for e in layout.extents for r in e.replicas)

    def _live_after(self, now: float, *, expire: bool,
                    evict: rpc.Watermarks | None) -> tuple[dict[int, int], set[bytes]]:
        """A dry run: each chunk's live bytes as the phases before it would leave them
        (``expire``: expired keys gone; ``evict``: the keys GC_EVICT with those watermarks
        would pick gone too), and the keys they would remove; nothing changes."""
        ix = self.index
        live_map = dict(ix.chunk_live)
        gone: set[bytes] = set()
        if expire:
            for k, e in ix.entries.items():
                if e.layout.expired(now):
                    ix.add_live(e.layout, -1, k, live_map)
                    gone.add(k)
        if evict is not None:
            victims, _, _, _ = self._evict_victims(evict.high, evict.low, None, now, live_map, gone)
            for k in victims:
                ix.add_live(ix.entries[k].layout, -1, k, live_map)
                gone.add(k)
        return live_map, gone

    def _evict_victims(self, high: float, low: float, only: int | None, now: float,
                       live_map: dict[int, int] | None = None, gone: Collection[bytes] = (),
                       ) -> tuple[list[bytes], int, dict[int, rpc.EvictTarget], dict[int, int]]:
        """Least recently used, unleased keys of the servers over ``high`` until they fit under
        ``low``: (victims, leased keys skipped, live and target per server, bytes still short).
        ``live_map`` and ``gone``: a dry run's view after the expire phase."""
        ix = self.index
        need: dict[int, int] = {}
        report: dict[int, rpc.EvictTarget] = {}
        for s in ix.servers.values():
            if s.capacity <= 0 or (only is not None and s.server_id != only):
                continue
            wanted = s.wanted
            if ix.used(s) > high * s.capacity or wanted:
                live, target = ix.server_live(s, live_map), int(low * s.capacity)
                report[s.server_id] = rpc.EvictTarget(live, target)
                short = max(live - target, live + wanted - s.capacity)
                if short > 0:
                    need[s.server_id] = short
        victims: list[bytes] = []
        leased = 0
        if need:
            order = sorted(((k, e) for k, e in ix.entries.items() if k not in gone),
                           key=lambda kv: kv[1].last_access)
            for k, e in order:
                if all(v <= 0 for v in need.values()):
                    break
                per: dict[int, int] = defaultdict(int)
                for x in e.layout.extents:
                    for r in x.replicas:
                        per[r.server_id] += x.length
                if not any(need.get(sid, 0) > 0 for sid in per):
                    continue
                if ix.leases.get(k, 0.0) > now and not e.layout.expired(now):
                    leased += 1
                    continue
                victims.append(k)
                for sid, n in per.items():
                    if sid in need:
                        need[sid] -= n
        return victims, leased, report, need

    # RPCs ------------------------------------------------------------------------
    async def rpc_gc_control(self, req: rpc.GcControl, payload: memoryview) -> Reply:
        ix = self.index
        paused = req.paused
        if paused is not None and paused != self.paused:
            self.paused = paused
            ix.store.put_state("paused", self.paused)
            log.info("gc %s", "paused" if self.paused else "resumed")
        return rpc.GcControlled(paused=self.paused), ()

    async def rpc_gc_report(self, req: rpc.GcReport, payload: memoryview) -> Reply:
        ix = self.index
        run = dict(req.run)
        self.last_run = run
        ix.store.put_state("last_run", run)
        if run.get("apply"):
            d = float(run.get("duration_s", 0.0))
            self.metrics["last_pass_duration_s"] = d
            self._count(passes=1, pass_duration_s=d)
        return rpc.Empty(), ()

    async def rpc_gc_status(self, req: rpc.GcStatus, payload: memoryview) -> Reply:
        ix = self.index
        now = ix.clock()
        expired: dict[int, int] = defaultdict(int)
        expired_total = 0
        for e in ix.entries.values():
            if e.layout.expired(now):
                expired_total += 1
                for sid in {r.server_id for x in e.layout.extents for r in x.replicas}:
                    expired[sid] += 1
        servers = []
        for s in sorted(ix.servers.values(), key=lambda s: s.server_id):
            used = ix.used(s)
            live = ix.server_live(s)
            garbage = max(0, used - live)
            servers.append(rpc.GcServerStatus(
                server_id=s.server_id, addr=s.addr, alive=ix.alive(s),
                capacity=s.capacity, used=used, live=live, garbage=garbage,
                ratio=garbage / used if used else 0.0, chunks=len(s.chunks),
                dead_chunks=sum(1 for c in s.chunks if c in self.dead_chunks),
                expired_keys=expired.get(s.server_id, 0),
                fill=used / s.capacity if s.capacity else 0.0))
        summary = self.summary()
        return rpc.GcStatusReply(time=now, servers=servers, expired_keys=expired_total,
                                 paused=summary.paused, metrics=summary.metrics,
                                 last_run=summary.last_run, dead_chunks=summary.dead_chunks,
                                 repair=summary.repair), ()

    async def rpc_gc_expire(self, req: rpc.GcExpire, payload: memoryview) -> Reply:
        ix = self.index
        now = ix.clock()
        if not req.apply:
            n = nbytes = 0
            for e in ix.entries.values():
                if e.layout.expired(now):
                    n += 1
                    nbytes += disk_bytes(e.layout)
            return rpc.Expired(keys=n, bytes=nbytes, more=False), ()
        keys = ix.store.expired(now, req.limit)
        n, nbytes = ix.remove(k for k in keys if ix.entries.get(k) is None
                                 or ix.entries[k].layout.expired(now))
        if n:
            self._count(keys_expired=n, bytes_expired=nbytes)
        return rpc.Expired(keys=n, bytes=nbytes, more=len(keys) == req.limit), ()

    async def rpc_gc_evict(self, req: rpc.GcEvict, payload: memoryview) -> Reply:
        ix = self.index
        now = ix.clock()
        for k, v in list(ix.leases.items()):
            if v <= now:
                del ix.leases[k]
        live_map, gone = (self._live_after(now, expire=True, evict=None)  # as --apply would see it
                          if not req.apply and req.after_expire else (None, set()))
        victims, leased, report, need = self._evict_victims(req.high, req.low, req.server_id, now,
                                                            live_map, gone)
        if req.apply:
            n, nbytes = ix.remove(victims)
            if n:
                self._count(keys_evicted=n, bytes_evicted=nbytes)
                log.info("evicted %d keys (%d bytes)", n, nbytes)
        else:
            n, nbytes = len(victims), sum(disk_bytes(ix.entries[k].layout) for k in victims)
        return rpc.Evicted(keys=n, bytes=nbytes, leased=leased, servers=report,
                           short={sid: v for sid, v in need.items() if v > 0}), ()

    async def rpc_gc_plan(self, req: rpc.GcPlan, payload: memoryview) -> Reply:
        ix = self.index
        threshold, grace_s, high = req.threshold, req.grace_s, req.high
        now = ix.clock()
        compact: list[rpc.CompactCandidate] = []
        delete: list[rpc.DeleteCandidate] = []
        seal: list[rpc.SealCandidate] = []
        waiting = 0
        live_map = ix.chunk_live
        zero_since = self.zero_since
        if req.after_expire or req.after_evict:  # a dry run: as if those phases had run first
            live_map, _ = self._live_after(now, expire=req.after_expire, evict=req.after_evict)
            zero_since = dict(zero_since)  # and start no grace clocks for it
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
                if cid in self.dead_chunks:  # retired, file still there: delete again
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
        copy), or (``server_id``) into every chunk of a server (values only)."""
        ix = self.index
        chunks = set(req.chunks)
        sid = req.server_id
        now = ix.clock()
        refs: dict[int, list[rpc.Ref]] = {c: [] for c in chunks}
        for k, e in ix.entries.items():
            if e.layout.expired(now):
                continue
            for x in e.layout.extents:
                for r in x.replicas:
                    if r.chunk_id in chunks or r.server_id == sid:
                        refs.setdefault(r.chunk_id, []).append(rpc.Ref(k, r.offset, x.length, x.crc))
        if chunks and ix.tombstones:
            floor = floors(ix.servers)
            done = []
            for k, t in ix.tombstones.items():
                mine = [r for r in t.layout.extents[0].replicas if r.chunk_id in chunks]
                if not mine:
                    continue
                if any(passed(t, floor, compacting=r.chunk_id) for r in mine):
                    done.append(k)  # needed no more: not copied
                    continue
                for r in mine:
                    refs[r.chunk_id].append(rpc.Ref(k, r.offset, 0, 0))
            if done:
                with ix.store.durable():
                    ix.forget_tombstones(done)
                self._count(tombstones_dropped=len(done))
        return rpc.ChunkRefs(refs=refs), ()

    async def rpc_gc_relocate(self, req: rpc.GcRelocate, payload: memoryview) -> Reply:
        ix = self.index
        sid, new_chunk, moves = req.server_id, req.new_chunk, req.moves
        if new_chunk in self.dead_chunks:  # (kept tombstones' copies are not counted)
            return rpc.Relocated(moved=0, skipped=sum(m[0] not in ix.tombstones for m in moves)), ()
        now = ix.clock()
        by_key: dict[bytes, dict[tuple[int, int], int]] = defaultdict(dict)
        for key, old_chunk, old_off, new_off in moves:
            by_key[key][(old_chunk, old_off)] = new_off
        staged: list[tuple[bytes, Entry, Layout]] = []
        tombs: list[tuple[bytes, Layout]] = []
        raised: list[bytes] = []
        moved = tomb_moves = 0  # tombstones moved count as neither moved keys nor lost ones
        for key, mapping in by_key.items():
            e = ix.entries.get(key)
            t = ix.tombstones.get(key) if e is None else None
            if t is not None:  # a tombstone copied forward, or a record of the key copied
                reps = []          # while the key was deleted
                n = 0
                for r in t.layout.extents[0].replicas:
                    no = mapping.get((r.chunk_id, r.offset)) if r.server_id == sid else None
                    reps.append(r if no is None else Replica(sid, new_chunk, no))
                    n += no is not None
                if n:
                    tombs.append((key, tomb_layout(reps, t.layout.created)))
                    tomb_moves += n
                elif raise_horizon(t, new_chunk):  # an older record now in new_chunk
                    raised.append(key)
                continue
            if e is None or e.layout.expired(now):
                continue
            exts = []
            changed = 0
            for x in e.layout.extents:
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
                old = e.layout
                staged.append((key, e, msgspec.structs.replace(old, extents=tuple(exts))))  # meta kept
                moved += changed
        if tombs:
            ix.move_tombstones(tombs)
        if raised:
            ix.save_tombstones(raised)
        if staged or tombs:
            ix.switch_layouts(staged)
            s = ix.servers.get(sid)
            if s is not None and req.new_size is not None:
                s.chunks[new_chunk] = req.new_size
            self._count(keys_relocated=len(staged))
        for old_chunk, _ in {k for m in by_key.values() for k in m}:
            if ix.chunk_live.get(old_chunk, 0) <= 0:
                self.zero_since.setdefault(old_chunk, now)
        return rpc.Relocated(moved=moved, skipped=len(moves) - moved - tomb_moves), ()

    async def rpc_gc_retire(self, req: rpc.GcRetire, payload: memoryview) -> Reply:
        ix = self.index
        sid = req.server_id
        s = ix.servers.get(sid)
        open_chunk = s.open_chunk if s is not None else None
        now = ix.clock()
        retired = [c for c in req.chunks
                   if c in self.dead_chunks
                   or (ix.chunk_live.get(c, 0) <= 0 and c != open_chunk)]
        fresh = [c for c in retired if c not in self.dead_chunks]
        if fresh:
            with ix.store.durable():  # on disk before the GC driver unlinks anything
                ix.store.add_dead((c, sid, now) for c in fresh)
            for c in fresh:
                self.dead_chunks[c] = now
                self.zero_since.pop(c, None)
                ix.chunk_live.pop(c, None)
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
            inc.update(chunks_deleted=len(deleted), bytes_reclaimed=sum(deleted.values()))
            dropped = ix.drop_passed_tombstones()  # chunks gone: horizons may have passed
            if dropped:
                inc.update(tombstones_dropped=dropped)
        if req.compacted:
            inc.update(chunks_compacted=req.compacted, bytes_copied=req.copied)
        if inc:
            self._count(**inc)
        return rpc.Empty(), ()

    # decommission ------------------------------------------------------------------
    def drain_left(self, sid: int) -> tuple[int, int]:
        """(extents, bytes) with a replica on server ``sid``, expired keys too."""
        n = nbytes = 0
        for e in self.index.entries.values():
            for x in e.layout.extents:
                if any(r.server_id == sid for r in x.replicas):
                    n += 1
                    nbytes += x.length
        return n, nbytes

    def _save_drains(self) -> None:
        store = self.index.store
        store.put_state("draining", sorted(self.draining))
        store.put_state("decommissioned", sorted(self.decommissioned))

    def forget_drained(self) -> list[int]:
        """Forget each draining server nothing references any more; its id is never reused."""
        done = [sid for sid in sorted(self.draining) if self.drain_left(sid)[0] == 0]
        for sid in done:
            self.draining.discard(sid)
            self.decommissioned.add(sid)
            self.index.servers.pop(sid, None)
            self.index.store.delete_server(sid)
            log.info("chunkserver %d drained and forgotten", sid)
        if done:
            self._save_drains()
        return done

    async def rpc_gc_decommission(self, req: rpc.GcDecommission, payload: memoryview) -> Reply:
        """Start (or cancel) draining a chunkserver; forget it once drained; its state now."""
        sid = req.server_id
        if sid in self.decommissioned:
            return rpc.DrainState(server_id=sid, draining=False, forgotten=True, extents_left=0,
                                  bytes_left=0), ()
        if sid not in self.index.servers:
            raise InvalidArgument(f"unknown chunkserver {sid} (kvfs stat lists them)")
        if req.cancel and sid in self.draining:
            self.draining.discard(sid)
            self._save_drains()
            log.info("chunkserver %d: drain cancelled", sid)
        elif req.start and not req.cancel and sid not in self.draining:
            self.draining.add(sid)
            self._save_drains()
            log.info("chunkserver %d draining: no new placements, repair copies its extents away", sid)
        forgotten = sid in self.forget_drained()
        n, nbytes = (0, 0) if forgotten else self.drain_left(sid)
        return rpc.DrainState(server_id=sid, draining=sid in self.draining, forgotten=forgotten,
                              extents_left=n, bytes_left=nbytes), ()

    async def rpc_gc_repair_plan(self, req: rpc.GcRepairPlan, payload: memoryview) -> Reply:
        """Extents with a replica on a gone server, readable from a live one (kvfs.meta.repair);
        draining servers that nothing references any more are forgotten first."""
        self.forget_drained()
        summary = RepairSummary()
        items = self._repair_plan(req.limit_bytes, summary)
        st = summary.state()
        return rpc.RepairPlan(items=items, under_replicated_extents=st.under_replicated_extents,
                              under_replicated_bytes=st.under_replicated_bytes,
                              unrepairable_extents=st.unrepairable_extents), ()

    async def rpc_gc_repair(self, req: rpc.GcRepair, payload: memoryview) -> Reply:
        """Switch each lost replica to its new copy, compare-and-swap (kvfs.meta.repair)."""
        ix = self.index
        staged: dict[bytes, tuple[Entry, Layout]] = {}
        repaired = skipped = nbytes = 0
        raised: list[bytes] = []
        for key, extent, lost, new in req.items:
            e = ix.entries.get(key)
            if e is None and (t := ix.tombstones.get(key)) is not None and raise_horizon(t, new.chunk_id):
                raised.append(key)  # deleted since the plan: its copy is an older record
            if e is None or new.server_id not in ix.servers:
                skipped += 1
                continue
            switched = replace_replica(staged.get(key, (e, e.layout))[1], extent, lost, new)
            if switched is None or not self.check_not_dead(switched):
                skipped += 1
                continue
            staged[key] = (e, switched)
            repaired += 1
            nbytes += switched.extents[extent].length
        ix.switch_layouts([(k, e, lay) for k, (e, lay) in staged.items()])
        ix.save_tombstones(raised)
        if repaired:
            self._count(extents_repaired=repaired, bytes_repaired=nbytes)
        return rpc.Repaired(repaired=repaired, skipped=skipped), ()

    async def rpc_gc_scrub_plan(self, req: rpc.GcScrubPlan, payload: memoryview) -> Reply:
        """Replicas a scrub found bad: repair from a good copy, or drop (kvfs.meta.repair)."""
        ix = self.index
        now = ix.clock()
        layouts = {}
        for key, *_ in req.bad:
            e = ix.get(key, now)
            if e is not None:
                layouts[key] = e.layout
        alive = {sid for sid, s in ix.servers.items() if ix.alive(s)} - ix.gone_servers()
        plan = plan_scrub(req.bad, layouts, alive)
        return rpc.ScrubPlanned(items=plan.items, drop=plan.drop, lost=plan.lost), ()

    async def rpc_gc_drop_replicas(self, req: rpc.GcDropReplicas, payload: memoryview) -> Reply:
        """fsck repair: forget replicas whose bytes are missing or corrupt; a key left with an
        extent without replicas is deleted (a cache miss is correct, wrong bytes never are)."""
        ix = self.index
        bad: dict[bytes, set[tuple[int, int, int]]] = defaultdict(set)
        for key, sid, cid, off in req.items:
            bad[key].add((sid, cid, off))
        staged: list[tuple[bytes, Entry, Layout]] = []
        doomed: list[bytes] = []
        dropped = 0
        for key, which in bad.items():
            e = ix.entries.get(key)
            if e is None:
                continue
            exts = []
            n = 0
            for x in e.layout.extents:
                reps = tuple(r for r in x.replicas if (r.server_id, r.chunk_id, r.offset) not in which)
                n += len(x.replicas) - len(reps)
                exts.append(Extent(x.length, x.crc, reps))
            if not n:
                continue
            dropped += n
            if any(not x.replicas for x in exts):
                doomed.append(key)
            else:
                old = e.layout
                staged.append((key, e, msgspec.structs.replace(old, extents=tuple(exts))))  # meta kept
        ix.switch_layouts(staged)
        n_deleted, _ = ix.remove(doomed)
        if dropped:
            self._count(replicas_dropped=dropped)
        return rpc.Dropped(dropped=dropped, deleted_keys=n_deleted), ()

    async def rpc_make_room(self, req: rpc.MakeRoom, payload: memoryview) -> Reply:
        """One GC pass (apply, no grace period, no repair: copies would take room, not make
        it) on behalf of a writer that found the cluster full.  Requests that arrive while a pass runs wait for the next one, which they
        share (it starts after their refused appends were reported)."""
        from kvfs.gc.driver import GarbageCollector, PassOptions  # the pass the daemon runs

        if self.home is None:
            raise Unavailable("meta is not listening yet")
        ticket = self._room_started
        async with self._room_lock:
            if self._room_started == ticket:  # no pass started since this request arrived
                self._room_started += 1
                addr, token = self.home
                log.info("cluster full: a GC pass on a writer's request")
                async with GarbageCollector(addr, token=token, tls=self.index.config) as gc:
                    r = await gc.run_pass(PassOptions(apply=True, grace_s=0.0, repair=False))
                self._room_made = rpc.RoomMade(expired_keys=r.expired_keys, evicted_keys=r.evicted_keys,
                                               bytes_reclaimed=r.bytes_reclaimed)
        return self._room_made, ()
