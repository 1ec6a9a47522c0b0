"""One GC pass, driven from outside meta and the chunkservers.

A pass: refresh chunk usage -> expire -> evict over the high watermark ->
compact chunks whose garbage ratio passes the threshold -> delete chunks no
layout references (after a grace period).  Each destructive step is a
compare-and-swap in meta (see :mod:`kvfs.meta.gc`), so a GC killed at any
point leaves every committed key readable and its leftovers reclaimable by
the next pass, and several GCs may run at once without harm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from kvfs import rpc
from kvfs._batch import split_batches
from kvfs.address import format_addr, lookup_token, parse_addrs
from kvfs.cluster import ClusterLink, ServerEntry
from kvfs.config import GcConfig, TlsConfig
from kvfs.errors import KVFSError, NoSpace, Unavailable
from kvfs.gc.logs import server_warnings
from kvfs.gc.pace import Pacer
from kvfs.gc.repair import RepairReport, repair_step
from kvfs.gc.scrub import (
    VERIFY_BATCH_BYTES,
    VERIFY_BATCH_RANGES,
    ScrubReport,
    Verification,
    VerifyItem,
    plan_batches,
    scrub_slice,
    verify_all,
)
from kvfs.handshake import Role
from kvfs.protocol import Buffer, Scatter
from kvfs.rpc import R, Request
from kvfs.tls import client_context
from kvfs.writepath import write_tombstones

log = logging.getLogger("kvfs.gc")
warn = server_warnings(log)  # (the same trouble on every pass: kvfs.gc.logs)

COMPACT_BATCH_BYTES = 64 * 1024 * 1024
RELOCATE_BATCH_BYTES = 4 * 1024 * 1024  # a GC_RELOCATE's moves (and at most half meta's --max-header)
EMPTY_TRIES = 4  # chunks a pass tries to empty on a server with no room to copy (_stuck), one emptied
MOVE_OVERHEAD = 32  # a move's msgpack bytes besides its key (3 ids / offsets, framing)
DAEMON_LEASE_INTERVALS = 3  # a daemon's turn lasts this many intervals past its last pass start
MIN_DAEMON_LEASE_S = 10.0
RELEASED_LEASE_S = 0.001  # a stopping daemon renews its lease for this long: the next takes it

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class PassOptions:
    apply: bool = False
    expire: bool = True
    evict: bool = True
    compact: bool = True
    threshold: float = 0.3
    high: float = 0.9
    low: float = 0.8
    grace_s: float = 30.0
    rate_bytes: int | None = None
    expire_batch: int = 10_000
    repair: bool = True
    repair_rate_bytes: int | None = None
    # compact, most garbage first, only the chunks that bring each server under pressure to
    # its low watermark, those over the threshold too (MAKE_ROOM's pass: a writer waits for it)
    only_needed: bool = False
    # background scrub (with apply): the replicas of the keys after where the collector's
    # last pass stopped (GarbageCollector.scrub_cursor), about this many bytes a server; 0: none
    scrub_bytes: int = 0

    @classmethod
    def from_config(cls, config: GcConfig) -> PassOptions:
        """The daemon's pass (``kvfs gc daemon``, ``kvfs up``): every phase, applied, and
        its share of the background scrub."""
        return cls(apply=True, threshold=config.compact_threshold, high=config.high_watermark,
                   low=config.low_watermark, grace_s=config.grace_s, rate_bytes=config.rate_bytes,
                   expire_batch=config.expire_batch, repair_rate_bytes=config.repair_rate_bytes,
                   scrub_bytes=int((config.scrub_rate_bytes or 0) * config.interval_s))


@dataclass(kw_only=True)
class PassReport:
    apply: bool
    started: float = field(default_factory=time.time)
    duration_s: float = 0.0
    expired_keys: int = 0
    expired_bytes: int = 0
    evicted_keys: int = 0
    evicted_bytes: int = 0
    leased_skipped: int = 0
    # chunks whose keys were evicted whole: their server had no room to copy their live bytes
    chunks_emptied: int = 0
    tombstones_refused: int = 0  # evictions' tombstone writes no chunkserver took (then none is tried)
    chunks_compacted: int = 0
    bytes_copied: int = 0
    keys_relocated: int = 0
    relocations_lost: int = 0  # a concurrent overwrite/delete won the compare-and-swap
    chunks_deleted: int = 0
    bytes_reclaimed: int = 0
    compact_candidates: int = 0
    # candidates left to a later pass: past what brings their server to its low watermark,
    # those only its pressure made (under the garbage threshold; with only_needed, any)
    compact_deferred: int = 0
    delete_candidates: int = 0
    reclaimable_bytes: int = 0  # dry run: what compaction + deletion would free
    waiting_grace: int = 0
    repair: RepairReport | None = None
    scrub: ScrubReport | None = None  # the background scrub's share (PassOptions.scrub_bytes)

    def to_dict(self) -> dict[str, Any]:
        """Flat counters (GC_REPORT); the repair step's as ``repair_*``, the scrub's counts as
        ``scrub_*``."""
        d = asdict(self)
        rep = d.pop("repair")
        for k, v in (rep or {}).items():
            d[f"repair_{k}"] = v
        scrub = d.pop("scrub")
        for k, v in (scrub or {}).items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                d[f"scrub_{k}"] = v
        return d


@dataclass(kw_only=True)
class FsckReport:
    apply: bool
    cutoff_s: float
    orphan_chunks: list[list[int]] = field(default_factory=list)  # [server_id, chunk_id, bytes]
    garbage_chunks: list[list[int]] = field(default_factory=list)  # [server_id, chunk_id, garbage]
    missing_refs: list[rpc.BadReplica] = field(default_factory=list)
    corrupt_refs: list[rpc.BadReplica] = field(default_factory=list)
    ranges_checked: int = 0
    repaired: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("missing_refs", "corrupt_refs"):
            d[name] = [[k.decode(errors="backslashreplace"), *rest] for k, *rest in d[name]]
        return d

    @property
    def problems(self) -> int:
        return (len(self.orphan_chunks) + len(self.garbage_chunks) + len(self.missing_refs)
                + len(self.corrupt_refs))


class GarbageCollector:
    """``async with GarbageCollector(addr) as gc: await gc.run_pass(PassOptions(apply=True))``"""

    def __init__(self, addr: str | None = None, *, token: str | None = None,
                 progress: Progress | None = None, request_timeout_s: float = 300.0,
                 tls: TlsConfig | None = None) -> None:
        """``tls``: the TLS files to connect with (default: none, or $KVFS_TLS_*)."""
        self.addr = addr
        metas = parse_addrs(addr)  # several metas of one store: one in use, the next if it fails
        self.token = lookup_token(token, addr=format_addr(*metas[0]), role=Role.ADMIN)
        self.progress = progress
        self.request_timeout_s = request_timeout_s
        self._link = ClusterLink(metas, self.token, request_timeout_s=request_timeout_s,
                                 tls=client_context(tls), spread_meta=False)
        self._usage: dict[int, rpc.ChunkStatsReply] = {}
        # the chunkservers the last sync_usage reached (None: none asked yet): a pass seals,
        # compacts and deletes only on these, so a dead or unreachable server costs it one
        # call, not one per step (its chunks wait for a pass that reaches it)
        self._reached: set[int] | None = None
        self._write_id = 0  # the last tombstone write id (drop_shadowed)
        # the last key whose replicas the background scrub verified (None: from the first;
        # kvfs.gc.scrub.scrub_slice); each pass reports it to meta, which keeps it for the
        # next daemon (GC_CONTROL's answer)
        self.scrub_cursor: bytes | None = None

    async def __aenter__(self) -> GarbageCollector:
        await self.meta(rpc.Ping())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (a later call opens them again)."""
        await self._link.aclose()

    def close(self) -> None:
        self._link.close()

    def report_progress(self, phase: str, done: int, total: int) -> None:
        """Tell ``progress`` (if given) how far ``phase`` is; also for phases run outside
        this class (``kvfs.gc.repair``)."""
        if self.progress is not None:
            self.progress(phase, done, total)

    # connections -----------------------------------------------------------------
    async def meta(self, request: Request[R]) -> R:
        return await self._link.call_meta(request)

    async def chunkserver(self, sid: int, request: Request[R], payload: Sequence[Buffer] = ()) -> R:
        return (await self._link.call_server(sid, request, payload))[0]

    async def chunkserver_exchange(self, sid: int, request: Request[R], payload: Sequence[Buffer] = (),
                                   ) -> tuple[R, memoryview | Scatter]:
        """One RPC to chunkserver ``sid``: its typed answer and raw payload."""
        return await self._link.call_server(sid, request, payload)

    async def servers(self) -> list[ServerEntry]:
        """The chunkservers meta knows, read now (and meta's cluster id with them)."""
        return await self._link.servers(refresh=True)

    def free_bytes(self) -> dict[int, int]:
        """Free space per chunkserver, as of the last :meth:`sync_usage`."""
        return {sid: st.free for sid, st in self._usage.items()}

    async def sync_usage(self, *, mtimes: bool = False) -> dict[int, rpc.ChunkStatsReply]:
        """Fresh chunk tables from every live chunkserver, forwarded to meta as a heartbeat."""
        out: dict[int, rpc.ChunkStatsReply] = {}
        for server in await self.servers():
            sid, addr = server.server_id, server.addr
            if not server.alive:
                continue
            try:
                st = await self.chunkserver(sid, rpc.ChunkStats(mtimes=mtimes))
            except Unavailable as exc:
                warn.warning(sid, "chunkserver %d (%s) unavailable: %s", sid, addr, exc)
                continue
            out[sid] = self._usage[sid] = st
            await self.meta(rpc.Heartbeat.of(st, server_id=sid, addr=addr))
        self._reached = set(out)
        return out

    # admin ---------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        return rpc.to_dict(await self.meta(rpc.GcStatus()))

    async def set_paused(self, paused: bool | None) -> bool:
        return (await self.meta(rpc.GcControl(paused=paused))).paused

    # one pass --------------------------------------------------------------------
    async def run_pass(self, opts: PassOptions) -> PassReport:
        t0 = time.perf_counter()
        report = PassReport(apply=opts.apply)
        live = await self.sync_usage()
        if opts.expire:
            await self.expire(opts, report)
        if opts.evict:
            await self.evict(opts, report)
        if opts.repair:
            report.repair = await repair_step(self, apply=opts.apply, rate_bytes=opts.repair_rate_bytes)
        if opts.compact:
            await self.compact(opts, report)
        if opts.apply and opts.scrub_bytes:
            report.scrub = await scrub_slice(self, opts.scrub_bytes, set(live))
        report.duration_s = time.perf_counter() - t0
        if opts.apply:
            await self.meta(rpc.GcReport(run=report.to_dict(),
                                         scrub_cursor=self.scrub_cursor if report.scrub else None))
        return report

    async def expire(self, opts: PassOptions, report: PassReport) -> None:
        if not opts.apply:
            h = await self.meta(rpc.GcExpire(apply=False))
            report.expired_keys, report.expired_bytes = h.keys, h.bytes
            return
        total = (await self.meta(rpc.GcExpire(apply=False))).keys
        while True:
            h = await self.meta(rpc.GcExpire(apply=True, limit=opts.expire_batch))
            n, nbytes = h.keys, h.bytes
            if h.shadowed:
                t = await self.drop_shadowed(h.shadowed, evict=False)
                n, nbytes = n + t.keys, nbytes + t.bytes
            report.expired_keys += n
            report.expired_bytes += nbytes
            self.report_progress("expire", report.expired_keys, max(total, report.expired_keys))
            if not h.more or not n:
                break

    async def evict(self, opts: PassOptions, report: PassReport) -> None:
        # a dry run skipped the expire phase: pick as if it had run, as --apply would
        await self._evict(rpc.GcEvict(high=opts.high, low=opts.low, apply=opts.apply,
                                      after_expire=not opts.apply and opts.expire), report)

    async def _evict(self, req: rpc.GcEvict, report: PassReport) -> bool:
        """One eviction: GC_EVICT, and again while it leaves keys for tombstones; whether it
        took every key it chose (none leased, every tombstone written)."""
        h = await self.meta(req)
        if req.chunk is None:  # (a chunk's leased keys: the eviction before counted them)
            report.leased_skipped += h.leased
        whole = not h.leased
        n, nbytes = h.keys, h.bytes
        while h.shadowed:  # then the keys it left go with tombstones, and it chooses again
            t = await self.drop_shadowed(h.shadowed, evict=True)
            n, nbytes = n + t.keys, nbytes + t.bytes
            if not t.keys:  # none went (no server took the tombstones): once more, choosing
                # among the keys that go without one (none left: the writes fail as full)
                report.tombstones_refused += 1
                h = await self.meta(msgspec.structs.replace(req, older=False))
                n, nbytes, whole = n + h.keys, nbytes + h.bytes, False
                break
            h = await self.meta(msgspec.structs.replace(req, after=h.stopped_at))  # (on from there)
            n, nbytes, whole = n + h.keys, nbytes + h.bytes, whole and not h.leased
        report.evicted_keys += n
        report.evicted_bytes += nbytes
        if n:
            self.report_progress("evict", n, n)
        return whole

    async def drop_shadowed(self, shadowed: Sequence[rpc.Shadowed], *, evict: bool) -> rpc.Tombstoned:
        """Keys GC_EXPIRE or GC_EVICT left for a tombstone (an older record of each may outlive
        the current one): write their tombstones (:func:`kvfs.writepath.write_tombstones`, on
        as many servers as the keys have replicas), then GC_TOMBSTONE removes the keys keeping
        them, so a rebuild of meta never serves the older record.  No server took them: none
        is removed (the next pass tries again)."""
        keys = [s.key for s in shadowed]
        replicas = max((len(x.replicas) for s in shadowed for x in s.layout.extents), default=1)
        self._write_id = max(self._write_id + 1, time.time_ns())  # as a client's delete's
        try:
            where = await write_tombstones(self._link, keys, replicas, self._write_id)
        except KVFSError as exc:
            warn.warning(None, "cannot write the tombstones of %d keys to drop, kept for now: %s", len(keys), exc)
            return rpc.Tombstoned(keys=0, bytes=0)
        return await self.meta(rpc.GcTombstone(
            items=[rpc.TombstoneDrop(s.key, s.layout, w) for s, w in zip(shadowed, where, strict=True)],
            evict=evict))

    async def _plan(self, opts: PassOptions, threshold: float | None = None, *,
                    dry: bool = False) -> rpc.Plan:
        """Meta's compaction plan; ``dry``: as if this pass's expire and evict phases had run."""
        return await self.meta(rpc.GcPlan(
            threshold=opts.threshold if threshold is None else threshold, grace_s=opts.grace_s,
            high=opts.high, after_expire=dry and opts.expire,
            after_evict=rpc.Watermarks(opts.high, opts.low) if dry and opts.evict else None))

    def _on_reached(self, plan: rpc.Plan) -> rpc.Plan:
        """``plan`` less the chunks on servers the last :meth:`sync_usage` did not reach."""
        on = self._reached
        if on is None:
            return plan
        return msgspec.structs.replace(
            plan, seal=[c for c in plan.seal if c.server_id in on],
            compact=[c for c in plan.compact if c.server_id in on],
            delete=[d for d in plan.delete if d.server_id in on])

    def _need(self, opts: PassOptions) -> dict[int, int]:
        """Server id -> the bytes it needs freed (positive: it needs room): its used bytes
        over ``opts.low`` of its capacity, or what its writers wanted, at the last
        :meth:`sync_usage`; servers of unknown capacity left out."""
        return {sid: max(st.wanted, st.used - int(opts.low * st.capacity))
                for sid, st in self._usage.items() if st.capacity > 0}

    def _stuck(self, plan: rpc.Plan, opts: PassOptions) -> dict[int, list[int]]:
        """The chunks to empty (GC_EVICT's ``chunk``), by server: on each server that needs
        room and has too little to copy the live bytes of any chunk planned for compaction
        there (with the chunks planned for deletion deleted), those chunks, fewest live bytes
        first (:meth:`compact` empties the first it can: the others hold leased keys).
        Compaction copies a chunk's live bytes before it frees the chunk, into room only GC
        may fill (the GC reserve, 5 % of a small server's capacity, and what values left);
        eviction stops at the low watermark of live bytes, leaving the garbage spread over
        partly live chunks.  A 256 MiB server with 64 MiB chunks, 1 MiB puts: 36 MiB of
        garbage, no chunk with under 28 MiB live, 16 MiB of room, and every write failed as
        full for good (bench/RESULTS.md).  Only in a pass without a grace period (a writer's
        MAKE_ROOM, ``kvfs gc run --apply --grace 0``), which deletes the emptied chunk at
        once: a pass with one would empty another chunk each time until the first one's
        grace ended."""
        need = self._need(opts)
        freeing: dict[int, int] = defaultdict(int)  # (deleted before compaction copies)
        for d in plan.delete:
            freeing[d.server_id] += d.written
        by_server: dict[int, list[rpc.CompactCandidate]] = defaultdict(list)
        for c in plan.compact:
            by_server[c.server_id].append(c)
        out: dict[int, list[int]] = {}
        for sid, cs in by_server.items():
            cs.sort(key=lambda c: c.live)
            if need.get(sid, 0) > 0 and cs[0].live > (self._gc_room(sid) or 0) + freeing[sid]:
                out[sid] = [c.chunk_id for c in cs[:EMPTY_TRIES]]
        return out

    def _gc_room(self, sid: int) -> int | None:
        """The bytes compaction's copies may still fill on a server: its capacity less its
        used bytes (the GC reserve and what values left), at the last :meth:`sync_usage`;
        None where its capacity is unknown."""
        st = self._usage.get(sid)
        return None if st is None or st.capacity <= 0 else st.capacity - st.used

    def _enough(self, plan: rpc.Plan, opts: PassOptions) -> tuple[rpc.Plan, int]:
        """``plan`` with only as many of the chunks a server's pressure alone made candidates
        (their garbage under ``opts.threshold``) as bring its used bytes down to ``opts.low``
        of its capacity and free what its writers wanted, most garbage first, with what the
        chunks over the threshold and the deletions free counted first (``opts.only_needed``:
        the chunks over the threshold taken the same way); and how many it left for a later
        pass.  Under pressure meta plans every chunk with any garbage, and a pass copied
        them all: a writer's MAKE_ROOM pass on a full cluster copied 65-115 chunks, up to
        2-3 s, while the writer waited (bench/RESULTS.md)."""
        need = self._need(opts)
        for d in plan.delete:
            if d.server_id in need:
                need[d.server_id] -= d.written
        over: list[rpc.CompactCandidate] = []
        under: list[rpc.CompactCandidate] = []
        for c in plan.compact:
            if c.written - c.live > opts.threshold * c.written and not opts.only_needed:
                over.append(c)
            else:
                under.append(c)
        for c in over:
            if c.server_id in need:
                need[c.server_id] -= c.written - c.live
        taken = over
        for c in under:  # (most garbage first, as meta plans them)
            if need.get(c.server_id, 1) > 0:  # (a server of no known usage: as planned)
                taken.append(c)
                if c.server_id in need:
                    need[c.server_id] -= c.written - c.live
        if len(taken) == len(plan.compact):
            return plan, 0
        taken.sort(key=lambda c: c.live - c.written)
        return msgspec.structs.replace(plan, compact=taken), len(plan.compact) - len(taken)

    async def _would_seal(self, plan: rpc.Plan, opts: PassOptions) -> None:
        """Dry run: count the open chunks ``--apply`` would seal as what they then become
        (meta plans them as compact candidates if they hold live bytes, else as deletes)."""
        for sid, cid, written, live in plan.seal:
            try:
                h = await self.chunkserver(sid, rpc.ChunkSeal(chunk_id=cid, idle_s=opts.grace_s, apply=False))
            except Unavailable:
                continue  # --apply could not seal it either
            if h.sealed:
                if live > 0:
                    plan.compact.append(rpc.CompactCandidate(sid, cid, written, live))
                else:
                    plan.delete.append(rpc.DeleteCandidate(sid, cid, written))

    async def compact(self, opts: PassOptions, report: PassReport) -> None:
        # a dry run skipped the expire and evict phases: plan as if they had run, as --apply would
        plan = self._on_reached(await self._plan(opts, dry=not opts.apply))
        if not opts.apply and plan.seal:
            await self._would_seal(plan, opts)
        if opts.apply and plan.seal:
            sealed = 0
            for sid, cid, _written, _live in plan.seal:
                try:
                    h = await self.chunkserver(sid, rpc.ChunkSeal(chunk_id=cid, idle_s=opts.grace_s))
                    sealed += h.sealed
                except Unavailable as exc:
                    warn.warning(sid, "cannot seal chunk %016x on server %d: %s", cid, sid, exc)
            if sealed:
                await self.sync_usage()
                plan = self._on_reached(await self._plan(opts))
        plan, report.compact_deferred = self._enough(plan, opts)
        stuck = (self._stuck(plan, opts) if opts.apply and opts.evict and opts.grace_s <= 0
                 and not report.tombstones_refused else {})
        if stuck:  # no room to copy: a chunk's keys go instead, and the chunk with them
            for chunks in stuck.values():
                for cid in chunks:
                    if await self._evict(rpc.GcEvict(apply=True, chunk=cid), report):
                        report.chunks_emptied += 1
                        break
            plan = self._on_reached(await self._plan(opts))
            plan, report.compact_deferred = self._enough(plan, opts)
        report.compact_candidates = len(plan.compact)
        report.delete_candidates = len(plan.delete)
        report.waiting_grace = plan.waiting
        if not opts.apply:
            report.reclaimable_bytes = (sum(c.written - c.live for c in plan.compact)
                                        + sum(d.written for d in plan.delete))
            return
        # the chunks with nothing live first: their room takes compaction's copies
        deleted = report.chunks_deleted
        await self.delete_chunks([(d.server_id, d.chunk_id) for d in plan.delete], report)
        if report.chunks_deleted > deleted:
            await self.sync_usage()  # (the room they freed, which compact_chunks counts from)
        by_server: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for c in plan.compact:
            by_server[c.server_id].append((c.chunk_id, c.live))
        await self.compact_chunks(by_server, opts, report)
        plan = self._on_reached(await self._plan(opts))
        report.waiting_grace = plan.waiting
        await self.delete_chunks([(d.server_id, d.chunk_id) for d in plan.delete], report)

    async def compact_chunks(self, by_server: dict[int, list[tuple[int, int]]], opts: PassOptions,
                             report: PassReport) -> None:
        """Copy live records of each chunk (chunk id, live bytes; in the order given, most
        garbage first) into new chunks, then switch layouts (CAS).  On a server the chunks
        whose live bytes do not fit the room GC may fill there (its capacity less its used
        bytes, at the last :meth:`sync_usage`, less what this pass copied, plus what it
        deleted) wait while those that fit go first: a batch needs its live bytes free, and
        without a grace period each batch's sources are deleted before the next, so the
        room grows.  The chunk with the most garbage was tried first whatever its size: on a
        full 256 MiB server its 33 MiB copy was refused, and the server's other chunks,
        which fit, waited for a later pass that did the same, while every write failed as
        full (bench/RESULTS.md).  None fits any more, or a copy is refused: the server's
        chunks left wait for the next pass."""
        todo = sum(len(v) for v in by_server.values())
        pacer = Pacer(opts.rate_bytes)
        for sid, chunks in by_server.items():
            # under space pressure copy a little at a time: each batch needs its live bytes free
            usage = self._usage.get(sid)
            free = COMPACT_BATCH_BYTES if usage is None else usage.free
            cap = max(1, min(COMPACT_BATCH_BYTES, free // 2))
            room = self._gc_room(sid)
            left = list(chunks)
            while left:
                batch: list[int] = []
                size = 0
                for cid, live in left:
                    if room is not None and size + live > room:
                        continue  # (waits for the room the batches before free)
                    if batch and size + live > cap:
                        break
                    batch.append(cid)
                    size += live
                if not batch:
                    warn.warning(sid, "compaction on server %d stopped for this pass, %d chunks left for "
                                 "the next: the fewest live bytes of them, %d, do not fit the %d bytes GC "
                                 "may fill there", sid, len(left), min(live for _, live in left), room)
                    break
                taken = set(batch)
                left = [c for c in left if c[0] not in taken]
                copied, freed = report.bytes_copied, report.bytes_reclaimed
                try:
                    await self._compact_batch(sid, batch, report)
                    if opts.grace_s <= 0:  # no grace: free the space before the next batch
                        await self.delete_chunks([(sid, c) for c in batch], report)
                except NoSpace as exc:  # its GC reserve is spent until the sources' grace ends
                    warn.warning(sid, "compaction on server %d stopped for this pass, %d chunks left "
                                 "for the next: %s", sid, len(left) + len(batch), exc)
                    break
                except KVFSError as exc:
                    warn.warning(sid, "compaction of %d chunks on server %d failed: %s", len(batch), sid, exc)
                    continue
                finally:
                    if room is not None:
                        room += (report.bytes_reclaimed - freed) - (report.bytes_copied - copied)
                self.report_progress("compact", report.chunks_compacted, todo)
                await pacer.spent(report.bytes_copied - pacer.bytes)

    async def _compact_batch(self, sid: int, chunks: list[int], report: PassReport) -> None:
        refs = (await self.meta(rpc.GcChunkRefs(chunks=chunks))).refs
        sources: list[rpc.CompactSource] = []
        keys: list[list[bytes]] = []
        for cid in chunks:
            rs = sorted(refs.get(cid, []), key=lambda r: r.offset)
            sources.append(rpc.CompactSource(cid, [rpc.Span(r.offset, r.length) for r in rs]))
            keys.append([r.key for r in rs])
        res = await self.chunkserver(sid, rpc.ChunkCompact(sources=sources))
        new = res.chunk_id
        if new is None:
            return
        moves = []
        for (cid, wanted), ks, locs in zip(sources, keys, res.locations, strict=True):
            for k, span, loc in zip(ks, wanted, locs, strict=True):
                if loc is not None:
                    moves.append(rpc.Move(k, cid, span.offset, loc))
        # (each move compare-and-swaps its own key, so the moves may go in several requests,
        # each well under meta's request limit, as it told us: small values make many moves)
        told = (await self._link.meta_conn()).max_header if moves else 0
        limit = min(RELOCATE_BATCH_BYTES, told // 2) if told else RELOCATE_BATCH_BYTES
        for run in split_batches([len(m.key) + MOVE_OVERHEAD for m in moves], max_bytes=limit,
                                 max_items=rpc.MAX_ITEMS):
            rel = await self.meta(rpc.GcRelocate(server_id=sid, new_chunk=new, new_size=res.size,
                                                 moves=moves[run.start : run.stop]))
            report.keys_relocated += rel.moved
            report.relocations_lost += rel.skipped
        report.chunks_compacted += len(chunks)
        report.bytes_copied += res.size
        await self.meta(rpc.GcDeleted(server_id=sid, deleted={}, compacted=len(chunks), copied=res.size))

    async def delete_chunks(self, items: Iterable[tuple[int, int]], report: PassReport) -> None:
        """Retire chunks (server id, chunk id) no layout references (CAS in meta), then unlink
        their files."""
        by_server: dict[int, list[int]] = defaultdict(list)
        for sid, cid in items:
            by_server[sid].append(cid)
        total = sum(len(v) for v in by_server.values())
        for sid, cids in by_server.items():
            retired = (await self.meta(rpc.GcRetire(server_id=sid, chunks=cids))).retired
            if not retired:
                continue
            try:
                deleted = (await self.chunkserver(sid, rpc.ChunkDelete(
                    chunks=retired, cluster_id=self._link.cluster_id))).deleted
            except Unavailable as exc:
                warn.warning(sid, "cannot delete %d chunks on server %d now: %s", len(retired), sid, exc)
                continue
            await self.meta(rpc.GcDeleted(server_id=sid, deleted=deleted))
            report.chunks_deleted += len(deleted)
            report.bytes_reclaimed += sum(deleted.values())
            self.report_progress("delete", report.chunks_deleted, total)

    # verify ----------------------------------------------------------------------
    async def verify_ranges(self, sid: int, flat: Sequence[VerifyItem],
                            pacer: Pacer | None = None) -> Verification:
        """Check ranges (key, chunk id, offset, length, CRC-32C) of chunkserver ``sid``
        there (CHUNK_VERIFY, in batches; ``pacer``: within its byte rate)."""
        out = Verification()
        for run in split_batches([f[3] for f in flat], max_bytes=VERIFY_BATCH_BYTES,
                                 max_items=VERIFY_BATCH_RANGES):
            batch = flat[run.start : run.stop]
            h = await self.chunkserver(sid, rpc.ChunkVerify(
                ranges=[rpc.VerifyRange(c, off, ln, crc) for _, c, off, ln, crc in batch]))
            for idx in h.missing:
                k, c, off, _, _ = batch[idx]
                out.missing.append(rpc.BadReplica(k, sid, c, off))
            for idx in h.bad:
                k, c, off, _, _ = batch[idx]
                out.corrupt.append(rpc.BadReplica(k, sid, c, off))
            nbytes = sum(f[3] for f in batch)
            out.ranges += len(batch)
            out.bytes += nbytes
            if pacer is not None:
                await pacer.spent(nbytes)
        return out

    # fsck ------------------------------------------------------------------------
    async def fsck(self, *, cutoff_s: float = 3600.0, apply: bool = False,
                   verify: bool = True) -> FsckReport:
        """Orphan chunks, unreferenced bytes older than ``cutoff_s``, layouts pointing at missing
        or corrupt bytes.  With ``apply``: delete orphans, compact garbage, drop bad replicas."""
        rep = FsckReport(apply=apply, cutoff_s=cutoff_s)
        stats = await self.sync_usage(mtimes=True)
        now = time.time()
        old = {(sid, c) for sid, st in stats.items()
               for c, t in st.mtimes.items() if now - t >= cutoff_s}
        plan = await self.meta(rpc.GcPlan(threshold=0.0, grace_s=0.0, high=1.0))
        rep.orphan_chunks = [[d.server_id, d.chunk_id, d.written] for d in plan.delete
                             if (d.server_id, d.chunk_id) in old]
        rep.garbage_chunks = [[c.server_id, c.chunk_id, c.written - c.live] for c in plan.compact
                              if (c.server_id, c.chunk_id) in old]
        if verify:
            checked, failed = await verify_all(self, stats)
            if failed:  # (fsck answers for every live server or fails, as it did)
                raise failed[min(failed)]
            for v in checked.values():
                rep.missing_refs += v.missing
                rep.corrupt_refs += v.corrupt
                rep.ranges_checked += v.ranges
        if apply:
            pr = PassReport(apply=True)
            bad = rep.missing_refs + rep.corrupt_refs
            if bad:
                rep.repaired["replicas_dropped"] = rep.repaired["keys_deleted"] = 0
            for batch in plan_batches(bad):  # (GC_DROP_REPLICAS: a key's bad replicas in one)
                dropped = await self.meta(rpc.GcDropReplicas(items=batch))
                rep.repaired["replicas_dropped"] += dropped.dropped
                rep.repaired["keys_deleted"] += dropped.deleted_keys
            by_server: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for sid, cid, _ in rep.garbage_chunks:
                by_server[sid].append((cid, 0))
            await self.compact_chunks(by_server, PassOptions(apply=True), pr)
            await self.delete_chunks([(s, c) for s, c, _ in rep.orphan_chunks], pr)
            rep.repaired["chunks_compacted"] = pr.chunks_compacted
            rep.repaired["chunks_deleted"] = pr.chunks_deleted
            rep.repaired["bytes_reclaimed"] = pr.bytes_reclaimed
        return rep


async def run_daemon(addr: str | None, token: str | None, opts: PassOptions, interval_s: float,
                     stop: asyncio.Event, *, on_pass: Callable[[PassReport], None] | None = None,
                     tls: TlsConfig | None = None) -> None:
    """Run a pass every ``interval_s`` until ``stop`` is set; skips passes while GC is paused,
    and while another daemon holds the daemon lease (meta's store keeps it: one daemon runs
    passes per store, another takes over ``DAEMON_LEASE_INTERVALS`` intervals after it stops)."""
    gc = GarbageCollector(addr, token=token, tls=tls)
    holder = f"{socket.gethostname()[:40]}:{uuid.uuid4().hex[:16]}"
    lease_s = min(max(DAEMON_LEASE_INTERVALS * interval_s, MIN_DAEMON_LEASE_S), rpc.MAX_SECONDS)
    try:
        while not stop.is_set():
            try:
                ctl = await gc.meta(rpc.GcControl(holder=holder, lease_s=lease_s))
                if not ctl.granted:
                    log.debug("gc: another daemon holds the lease; not running a pass")
                elif not ctl.paused:
                    gc.scrub_cursor = ctl.scrub_cursor  # where the last daemon's scrub stopped
                    report = await gc.run_pass(opts)
                    if report.repair is not None and report.repair.extents_repaired:
                        log.info("gc repair: %d extents copied to live servers (%d bytes)",
                                 report.repair.extents_repaired, report.repair.bytes_copied)
                    if report.expired_keys or report.evicted_keys or report.chunks_deleted:
                        log.info("gc pass: expired %d, evicted %d, compacted %d chunks, reclaimed %d bytes",
                                 report.expired_keys, report.evicted_keys, report.chunks_compacted,
                                 report.bytes_reclaimed)
                    if on_pass is not None:
                        on_pass(report)
            except KVFSError as exc:
                log.warning("gc pass failed: %s", exc)
                gc.close()
            try:
                async with asyncio.timeout(interval_s):
                    await stop.wait()
            except TimeoutError:
                pass
        with contextlib.suppress(KVFSError, TimeoutError):  # hand the lease on at once
            async with asyncio.timeout(5):
                await gc.meta(rpc.GcControl(holder=holder, lease_s=RELEASED_LEASE_S))
    finally:
        gc.close()
