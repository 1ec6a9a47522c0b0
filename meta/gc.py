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
  commit can never produce a dangling key.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from typing import Any

from kvfs import rpc
from kvfs.chunkserver.records import RECORD  # the record format: meta counts its bytes
from kvfs.config import MetaConfig
from kvfs.layout import Extent, Layout, Replica, encode_layout
from kvfs.meta.repair import RepairSummary, plan_repairs, replace_replica
from kvfs.meta.store import MetaStore
from kvfs.server import Reply

log = logging.getLogger("kvfs.meta.gc")

METRIC_NAMES = (
    "keys_expired", "bytes_expired", "keys_evicted", "bytes_evicted", "chunks_compacted",
    "bytes_copied", "keys_relocated", "chunks_deleted", "bytes_reclaimed", "replicas_dropped",
    "passes", "pass_duration_s", "last_pass_duration_s", "extents_repaired", "bytes_repaired",
)
RECORD_OVERHEAD_BYTES = RECORD.size  # a chunk record's fixed header; its key follows


def _disk_bytes(layout: Layout) -> int:
    return sum(n for _, n in layout.chunk_bytes())


class MetaGc:
    """Mixin of :class:`kvfs.meta.MetaService` holding the GC RPC handlers."""

    # provided by MetaService
    config: MetaConfig
    clock: Callable[[], float]
    store: MetaStore
    entries: dict[bytes, Any]
    chunk_live: dict[int, int]
    servers: dict[int, Any]
    leases: dict[bytes, float]
    _dirty_access: dict[bytes, float]

    def alive(self, s: Any) -> bool:
        raise NotImplementedError

    def gone_servers(self) -> set[int]:
        raise NotImplementedError

    def _add_live(self, layout: Layout, sign: int, key: bytes,
                  live: dict[int, int] | None = None) -> None:
        raise NotImplementedError

    # state ---------------------------------------------------------------------
    def _init_gc(self) -> None:
        self.gc_paused = bool(self.store.get_state("paused") or False)
        saved = self.store.get_state("metrics") or {}
        self.gc_metrics: dict[str, float] = {n: saved.get(n, 0) for n in METRIC_NAMES}
        self.gc_last_run: dict[str, Any] | None = self.store.get_state("last_run")
        self.dead_chunks: dict[int, float] = {c: t for c, _, t in self.store.load_dead()}
        self.zero_since: dict[int, float] = {}

    def _count(self, **inc: float) -> None:
        for k, v in inc.items():
            self.gc_metrics[k] = self.gc_metrics.get(k, 0) + v
        self.store.put_state("metrics", self.gc_metrics)

    def gc_summary(self) -> rpc.GcSummary:
        return rpc.GcSummary(paused=self.gc_paused, metrics=dict(self.gc_metrics),
                             last_run=self.gc_last_run, dead_chunks=len(self.dead_chunks),
                             repair=self.repair_summary().state())

    def _repair_plan(self, limit_bytes: int, summary: RepairSummary | None) -> list[rpc.RepairItem]:
        alive = {sid for sid, s in self.servers.items() if self.alive(s)}
        return plan_repairs(((k, e.layout) for k, e in self.entries.items()), self.gone_servers(),
                            alive, limit_bytes=limit_bytes, now=self.clock(), summary=summary)

    def repair_summary(self) -> RepairSummary:
        """Under-replicated extents now (a scan of the index, only while a server is gone)."""
        summary = RepairSummary()
        self._repair_plan(0, summary)
        return summary

    def check_not_dead(self, layout: Layout) -> bool:
        dead = self.dead_chunks
        return not dead or all(r.chunk_id not in dead for e in layout.extents for r in e.replicas)

    def _switch_layouts(self, staged: list[tuple[bytes, Any, Layout]]) -> None:
        """Replace the layouts of existing entries: one SQLite transaction, then the index."""
        if not staged:
            return
        with self.store.durable():
            self.store.put_many((k, encode_layout(lay), lay.expires_at, e.last_access)
                                for k, e, lay in staged)
        for k, e, lay in staged:
            self._add_live(e.layout, -1, k)
            e.layout = lay
            self._add_live(lay, +1, k)

    def _remove(self, keys: Iterable[bytes]) -> tuple[int, int]:
        """Delete keys from SQLite (one transaction) and the index; returns (keys, disk bytes)."""
        gone = [k for k in keys if k in self.entries]
        if not gone:
            return 0, 0
        with self.store.durable():
            self.store.delete_many(gone)
        nbytes = 0
        for k in gone:
            lay = self.entries.pop(k).layout
            nbytes += _disk_bytes(lay)
            self._add_live(lay, -1, k)
            self._dirty_access.pop(k, None)
            self.leases.pop(k, None)
        return len(gone), nbytes

    def _used(self, s: Any) -> int:
        return int(sum(s.chunks.values()))

    def _server_live(self, s: Any, live_map: dict[int, int] | None = None) -> int:
        live = self.chunk_live if live_map is None else live_map
        return int(sum(live.get(c, 0) for c in s.chunks))

    def _live_after(self, now: float, *, expire: bool,
                    evict: rpc.Watermarks | None) -> tuple[dict[int, int], set[bytes]]:
        """A dry run: each chunk's live bytes as the phases before it would leave them
        (``expire``: expired keys gone; ``evict``: the keys GC_EVICT with those watermarks
        would pick gone too), and the keys they would remove; nothing changes."""
        live_map = dict(self.chunk_live)
        gone: set[bytes] = set()
        if expire:
            for k, e in self.entries.items():
                if e.layout.expired(now):
                    self._add_live(e.layout, -1, k, live_map)
                    gone.add(k)
        if evict is not None:
            victims, _, _, _ = self._evict_victims(evict.high, evict.low, None, now, live_map, gone)
            for k in victims:
                self._add_live(self.entries[k].layout, -1, k, live_map)
                gone.add(k)
        return live_map, gone

    def _evict_victims(self, high: float, low: float, only: int | None, now: float,
                       live_map: dict[int, int] | None = None, gone: Collection[bytes] = (),
                       ) -> tuple[list[bytes], int, dict[int, rpc.EvictTarget], dict[int, int]]:
        """Least recently used, unleased keys of the servers over ``high`` until they fit under
        ``low``: (victims, leased keys skipped, live and target per server, bytes still short).
        ``live_map`` and ``gone``: a dry run's view after the expire phase."""
        need: dict[int, int] = {}
        report: dict[int, rpc.EvictTarget] = {}
        for s in self.servers.values():
            if s.capacity <= 0 or (only is not None and s.server_id != only):
                continue
            wanted = s.wanted
            if self._used(s) > high * s.capacity or wanted:
                live, target = self._server_live(s, live_map), int(low * s.capacity)
                report[s.server_id] = rpc.EvictTarget(live, target)
                short = max(live - target, live + wanted - s.capacity)
                if short > 0:
                    need[s.server_id] = short
        victims: list[bytes] = []
        leased = 0
        if need:
            order = sorted(((k, e) for k, e in self.entries.items() if k not in gone),
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
                if self.leases.get(k, 0.0) > now and not e.layout.expired(now):
                    leased += 1
                    continue
                victims.append(k)
                for sid, n in per.items():
                    if sid in need:
                        need[sid] -= n
        return victims, leased, report, need

    # RPCs ------------------------------------------------------------------------
    async def rpc_touch(self, req: rpc.Touch, payload: memoryview) -> Reply:
        now = self.clock()
        for k in req.keys:
            e = self.entries.get(k)
            if e is not None:
                e.last_access = now
                self._dirty_access[k] = now
        return rpc.Empty(), ()

    async def rpc_gc_control(self, req: rpc.GcControl, payload: memoryview) -> Reply:
        paused = req.paused
        if paused is not None and paused != self.gc_paused:
            self.gc_paused = paused
            self.store.put_state("paused", self.gc_paused)
            log.info("gc %s", "paused" if self.gc_paused else "resumed")
        return rpc.GcControlled(paused=self.gc_paused), ()

    async def rpc_gc_report(self, req: rpc.GcReport, payload: memoryview) -> Reply:
        run = dict(req.run)
        self.gc_last_run = run
        self.store.put_state("last_run", run)
        if run.get("apply"):
            d = float(run.get("duration_s", 0.0))
            self.gc_metrics["last_pass_duration_s"] = d
            self._count(passes=1, pass_duration_s=d)
        return rpc.Empty(), ()

    async def rpc_gc_status(self, req: rpc.GcStatus, payload: memoryview) -> Reply:
        now = self.clock()
        expired: dict[int, int] = defaultdict(int)
        expired_total = 0
        for e in self.entries.values():
            if e.layout.expired(now):
                expired_total += 1
                for sid in {r.server_id for x in e.layout.extents for r in x.replicas}:
                    expired[sid] += 1
        servers = []
        for s in sorted(self.servers.values(), key=lambda s: s.server_id):
            used = self._used(s)
            live = self._server_live(s)
            garbage = max(0, used - live)
            servers.append(rpc.GcServerStatus(
                server_id=s.server_id, addr=s.addr, alive=self.alive(s),
                capacity=s.capacity, used=used, live=live, garbage=garbage,
                ratio=garbage / used if used else 0.0, chunks=len(s.chunks),
                dead_chunks=sum(1 for c in s.chunks if c in self.dead_chunks),
                expired_keys=expired.get(s.server_id, 0),
                fill=used / s.capacity if s.capacity else 0.0))
        summary = self.gc_summary()
        return rpc.GcStatusReply(time=now, servers=servers, expired_keys=expired_total,
                                 paused=summary.paused, metrics=summary.metrics,
                                 last_run=summary.last_run, dead_chunks=summary.dead_chunks,
                                 repair=summary.repair), ()

    async def rpc_gc_expire(self, req: rpc.GcExpire, payload: memoryview) -> Reply:
        now = self.clock()
        if not req.apply:
            n = nbytes = 0
            for e in self.entries.values():
                if e.layout.expired(now):
                    n += 1
                    nbytes += _disk_bytes(e.layout)
            return rpc.Expired(keys=n, bytes=nbytes, more=False), ()
        keys = self.store.expired(now, req.limit)
        n, nbytes = self._remove(k for k in keys if self.entries.get(k) is None
                                 or self.entries[k].layout.expired(now))
        if n:
            self._count(keys_expired=n, bytes_expired=nbytes)
        return rpc.Expired(keys=n, bytes=nbytes, more=len(keys) == req.limit), ()

    async def rpc_gc_evict(self, req: rpc.GcEvict, payload: memoryview) -> Reply:
        now = self.clock()
        for k, v in list(self.leases.items()):
            if v <= now:
                del self.leases[k]
        live_map, gone = (self._live_after(now, expire=True, evict=None)  # as --apply would see it
                          if not req.apply and req.after_expire else (None, set()))
        victims, leased, report, need = self._evict_victims(req.high, req.low, req.server_id, now,
                                                            live_map, gone)
        if req.apply:
            n, nbytes = self._remove(victims)
            if n:
                self._count(keys_evicted=n, bytes_evicted=nbytes)
                log.info("evicted %d keys (%d bytes)", n, nbytes)
        else:
            n, nbytes = len(victims), sum(_disk_bytes(self.entries[k].layout) for k in victims)
        return rpc.Evicted(keys=n, bytes=nbytes, leased=leased, servers=report,
                           short={sid: v for sid, v in need.items() if v > 0}), ()

    async def rpc_gc_plan(self, req: rpc.GcPlan, payload: memoryview) -> Reply:
        threshold, grace_s, high = req.threshold, req.grace_s, req.high
        now = self.clock()
        compact: list[rpc.CompactCandidate] = []
        delete: list[rpc.DeleteCandidate] = []
        seal: list[rpc.SealCandidate] = []
        waiting = 0
        live_map = self.chunk_live
        zero_since = self.zero_since
        if req.after_expire or req.after_evict:  # a dry run: as if those phases had run first
            live_map, _ = self._live_after(now, expire=req.after_expire, evict=req.after_evict)
            zero_since = dict(zero_since)  # and start no grace clocks for it
        for s in self.servers.values():
            pressure = s.capacity > 0 and (self._used(s) > high * s.capacity or s.wanted)
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
        """References into the given chunks, or (``server_id``) into every chunk of a server."""
        chunks = set(req.chunks)
        sid = req.server_id
        now = self.clock()
        refs: dict[int, list[rpc.Ref]] = {c: [] for c in chunks}
        for k, e in self.entries.items():
            if e.layout.expired(now):
                continue
            for x in e.layout.extents:
                for r in x.replicas:
                    if r.chunk_id in chunks or r.server_id == sid:
                        refs.setdefault(r.chunk_id, []).append(rpc.Ref(k, r.offset, x.length, x.crc))
        return rpc.ChunkRefs(refs=refs), ()

    async def rpc_gc_relocate(self, req: rpc.GcRelocate, payload: memoryview) -> Reply:
        sid, new_chunk, moves = req.server_id, req.new_chunk, req.moves
        if new_chunk in self.dead_chunks:
            return rpc.Relocated(moved=0, skipped=len(moves)), ()
        now = self.clock()
        by_key: dict[bytes, dict[tuple[int, int], int]] = defaultdict(dict)
        for key, old_chunk, old_off, new_off in moves:
            by_key[key][(old_chunk, old_off)] = new_off
        staged: list[tuple[bytes, Any, Layout]] = []
        moved = 0
        for key, mapping in by_key.items():
            e = self.entries.get(key)
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
                staged.append((key, e, Layout(old.size, old.crc, old.created, old.expires_at, tuple(exts))))
                moved += changed
        if staged:
            self._switch_layouts(staged)
            s = self.servers.get(sid)
            if s is not None and req.new_size is not None:
                s.chunks[new_chunk] = req.new_size
            self._count(keys_relocated=len(staged))
        for old_chunk, _ in {k for m in by_key.values() for k in m}:
            if self.chunk_live.get(old_chunk, 0) <= 0:
                self.zero_since.setdefault(old_chunk, now)
        return rpc.Relocated(moved=moved, skipped=len(moves) - moved), ()

    async def rpc_gc_retire(self, req: rpc.GcRetire, payload: memoryview) -> Reply:
        sid = req.server_id
        s = self.servers.get(sid)
        open_chunk = s.open_chunk if s is not None else None
        now = self.clock()
        retired = [c for c in req.chunks
                   if c in self.dead_chunks
                   or (self.chunk_live.get(c, 0) <= 0 and c != open_chunk)]
        fresh = [c for c in retired if c not in self.dead_chunks]
        if fresh:
            with self.store.durable():  # on disk before the GC driver unlinks anything
                self.store.add_dead((c, sid, now) for c in fresh)
            for c in fresh:
                self.dead_chunks[c] = now
                self.zero_since.pop(c, None)
                self.chunk_live.pop(c, None)
        return rpc.Retired(retired=retired), ()

    async def rpc_gc_deleted(self, req: rpc.GcDeleted, payload: memoryview) -> Reply:
        s = self.servers.get(req.server_id)
        deleted = req.deleted
        if s is not None:
            for c in deleted:
                s.chunks.pop(c, None)
        inc: dict[str, float] = {}
        if deleted:
            inc.update(chunks_deleted=len(deleted), bytes_reclaimed=sum(deleted.values()))
        if req.compacted:
            inc.update(chunks_compacted=req.compacted, bytes_copied=req.copied)
        if inc:
            self._count(**inc)
        return rpc.Empty(), ()

    async def rpc_gc_repair_plan(self, req: rpc.GcRepairPlan, payload: memoryview) -> Reply:
        """Extents with a replica on a gone server, readable from a live one (kvfs.meta.repair)."""
        summary = RepairSummary()
        items = self._repair_plan(req.limit_bytes, summary)
        st = summary.state()
        return rpc.RepairPlan(items=items, under_replicated_extents=st.under_replicated_extents,
                              under_replicated_bytes=st.under_replicated_bytes,
                              unrepairable_extents=st.unrepairable_extents), ()

    async def rpc_gc_repair(self, req: rpc.GcRepair, payload: memoryview) -> Reply:
        """Switch each lost replica to its new copy, compare-and-swap (kvfs.meta.repair)."""
        staged: dict[bytes, tuple[Any, Layout]] = {}
        repaired = skipped = nbytes = 0
        for key, index, lost, new in req.items:
            e = self.entries.get(key)
            if e is None or new.server_id not in self.servers:
                skipped += 1
                continue
            switched = replace_replica(staged.get(key, (e, e.layout))[1], index, lost, new)
            if switched is None or not self.check_not_dead(switched):
                skipped += 1
                continue
            staged[key] = (e, switched)
            repaired += 1
            nbytes += switched.extents[index].length
        self._switch_layouts([(k, e, lay) for k, (e, lay) in staged.items()])
        if repaired:
            self._count(extents_repaired=repaired, bytes_repaired=nbytes)
        return rpc.Repaired(repaired=repaired, skipped=skipped), ()

    async def rpc_gc_drop_replicas(self, req: rpc.GcDropReplicas, payload: memoryview) -> Reply:
        """fsck repair: forget replicas whose bytes are missing or corrupt; a key left with an
        extent without replicas is deleted (a cache miss is correct, wrong bytes never are)."""
        bad: dict[bytes, set[tuple[int, int, int]]] = defaultdict(set)
        for key, sid, cid, off in req.items:
            bad[key].add((sid, cid, off))
        staged: list[tuple[bytes, Any, Layout]] = []
        doomed: list[bytes] = []
        dropped = 0
        for key, which in bad.items():
            e = self.entries.get(key)
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
                staged.append((key, e, Layout(old.size, old.crc, old.created, old.expires_at, tuple(exts))))
        self._switch_layouts(staged)
        n_deleted, _ = self._remove(doomed)
        if dropped:
            self._count(replicas_dropped=dropped)
        return rpc.Dropped(dropped=dropped, deleted_keys=n_deleted), ()
