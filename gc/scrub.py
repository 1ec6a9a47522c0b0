"""``kvfs gc scrub``: read back every replica meta's layouts reference, on every live
chunkserver, within a byte-rate budget, and deal with each one found missing or corrupt.

1. :func:`verify_all` (fsck's check too) walks meta's keys once, in GC_LAYOUTS pages, and
   checks each referenced record's value on each live server against its CRC-32C
   (CHUNK_VERIFY, a batch per server as its ranges fill, at most ``VERIFY_HELD_RANGES``
   waiting in all).
2. ``GC_SCRUB_PLAN`` (:func:`kvfs.meta.repair.plan_scrub`) sorts the bad replicas against
   the layouts now: one with a good replica on a live server is repaired with the repair
   step's copy (:func:`kvfs.gc.repair.copy_extents`: read and re-check a good record,
   append it to a live server holding no other copy, ``GC_REPAIR`` compare-and-swap); a key
   with an extent whose every replica is bad has no good copy and is dropped
   (``GC_DROP_REPLICAS``, which matches the exact replicas verified, so a racing overwrite
   wins) and reported by name.
3. A dry run (no ``apply``) verifies and reports what ``apply`` would do, changing nothing.

:func:`check_reported` does steps 1 and 2 for the replicas readers reported failing their
CRC-32C (REPORT_BAD; meta runs it, as it runs MAKE_ROOM's pass): only those are verified.
:func:`scrub_slice` does them for the replicas of a slice of meta's keys, in each GC daemon
pass (``GcConfig.scrub_rate_bytes``): the background scrub, which walks every key in turn
(key order, GC_LAYOUTS pages), so each pass costs meta only the keys it checks.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import (
    AsyncGenerator,
    Collection,
    Mapping,
    Sequence,
)
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvfs import rpc
from kvfs._batch import split_batches
from kvfs.errors import KVFSError
from kvfs.gc.logs import server_warnings
from kvfs.gc.pace import Pacer
from kvfs.gc.repair import RepairReport, copy_extents

if TYPE_CHECKING:  # (the driver runs the background scrub, scrub_slice, and fsck's verify_all)
    from kvfs.gc.driver import GarbageCollector

log = logging.getLogger("kvfs.gc.scrub")
warn = server_warnings(log)  # (the same trouble on every pass: kvfs.gc.logs)

PLAN_BATCH_BYTES = 4 * 1024 * 1024  # a GC_SCRUB_PLAN's (or fsck's GC_DROP_REPLICAS') bad replicas
BAD_REPLICA_OVERHEAD = 32  # a bad replica's msgpack bytes besides its key
SCRUB_PAGE_KEYS = 1000  # keys per GC_LAYOUTS page of the background scrub's walk
SCRUB_MAX_KEYS = 100_000  # keys a slice takes at most (empty values, replicas on dead servers: no bytes)
VERIFY_BATCH_BYTES = 64 * 1024 * 1024
VERIFY_BATCH_RANGES = 65_536  # a CHUNK_VERIFY's ranges: its header well under the frame limit
VERIFY_HELD_RANGES = 4 * VERIFY_BATCH_RANGES  # ranges a whole scrub holds unchecked, all servers
VerifyItem = tuple[bytes, int, int, int, int]  # a range to check: key, chunk id, offset, length, CRC-32C


@dataclass(kw_only=True)
class Verification:
    """One chunkserver's ranges, read back (:meth:`GarbageCollector.verify_ranges`)."""

    missing: list[rpc.BadReplica] = field(default_factory=list)
    corrupt: list[rpc.BadReplica] = field(default_factory=list)
    ranges: int = 0
    bytes: int = 0

    def add(self, other: Verification) -> None:
        self.missing += other.missing
        self.corrupt += other.corrupt
        self.ranges += other.ranges
        self.bytes += other.bytes


@dataclass(kw_only=True)
class ScrubReport:
    apply: bool
    servers_verified: int = 0
    servers_skipped: list[int] = field(default_factory=list)  # not alive
    servers_failed: list[int] = field(default_factory=list)  # their check failed (logged)
    ranges_checked: int = 0
    bytes_verified: int = 0
    missing: int = 0  # replicas whose bytes are not on their server
    corrupt: int = 0  # replicas failing their CRC-32C
    repairable: int = 0  # bad replicas with a good copy on a live server
    repaired: int = 0  # ... switched to a fresh copy (apply)
    bytes_copied: int = 0
    repair_skipped: int = 0  # a racing write won, no room, or the good copy failed its re-check
    replicas_dropped: int = 0  # bad replicas forgotten (apply): no good copy on a live server
    keys_dropped: int = 0  # keys deleted for having no good copy (apply)
    lost_keys: list[bytes] = field(default_factory=list)  # keys with no good copy (would be) dropped
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lost_keys"] = [k.decode(errors="backslashreplace") for k in self.lost_keys]
        return d


async def scrub(gc: GarbageCollector, *, apply: bool, rate_bytes: int | None = None) -> ScrubReport:
    """Verify every referenced replica on every live server; with ``apply``, repair the bad
    ones from a good copy and drop the keys that have none."""
    t0 = time.monotonic()
    report = ScrubReport(apply=apply)
    pacer = Pacer(rate_bytes)
    stats = await gc.sync_usage()
    report.servers_skipped = sorted(s.server_id for s in await gc.servers() if s.server_id not in stats)
    bad = _counted(report, *await verify_all(gc, stats, pacer))
    await mend(gc, bad, report, pacer)
    report.seconds = time.monotonic() - t0
    return report


async def scrub_slice(gc: GarbageCollector, budget: int, servers: Collection[int]) -> ScrubReport:
    """The GC daemon's background scrub, one pass's share: meta's keys walked in key order
    (GC_LAYOUTS pages) from the one after ``gc.scrub_cursor`` (from the first again past
    the last), each key's replicas on ``servers`` (those the pass found alive) taken until
    one server's come to ``budget`` bytes (at least one key, at most
    ``SCRUB_MAX_KEYS``), then verified there and the bad ones mended as :func:`scrub` does
    with ``apply``; the cursor moves once they are.  The walk costs meta the keys it pages
    through, never a scan of every key."""
    t0 = time.monotonic()
    report = ScrubReport(apply=True)
    by_server: dict[int, list[VerifyItem]] = defaultdict(list)
    taken: dict[int, int] = defaultdict(int)  # bytes a server
    after, n = gc.scrub_cursor, 0
    if servers:
        async with aclosing(_keys_round(gc, after)) as keys:
            async for (key, lay), live in keys:
                if max(taken.values(), default=0) >= budget or n >= SCRUB_MAX_KEYS:
                    break
                for x in lay.extents if live else ():
                    for r in x.replicas:
                        if x.length and r.server_id in servers:
                            by_server[r.server_id].append((key, r.chunk_id, r.offset, x.length, x.crc))
                            taken[r.server_id] += x.length
                after, n = key, n + 1  # (an expired key counts: a slice's walk stays bounded)
    await _verify_and_mend(gc, report, by_server)
    gc.scrub_cursor = after
    report.seconds = time.monotonic() - t0
    return report


async def _keys_round(gc: GarbageCollector, began: bytes | None,
                      ) -> AsyncGenerator[tuple[rpc.KeyLayout, bool], None]:
    """Meta's stored keys with their layouts, in key order from the one after ``began``,
    past the last one to the first and on up to ``began`` (from the first to the last if
    ``began`` is None): each key at most once (pages fetched as the caller goes on), and
    whether it is live.  A key expired by meta's clock as it read its page is not: its
    replicas are not to be checked, since compaction copies no expired record."""
    after, came_round = began, False
    while True:
        page = await gc.meta(rpc.GcLayouts(start_after=after, limit=SCRUB_PAGE_KEYS))
        for row in page.rows:
            if came_round and began is not None and row.key >= began:
                return
            yield row, not row.layout.expired(page.time)
        if page.rows:  # (a page may come short while keys follow: Redis's list skips
            after = page.rows[-1].key  # keys deleted as it reads; the end is an empty page)
        elif came_round or began is None:
            return
        else:
            came_round, after = True, None


async def verify_all(gc: GarbageCollector, servers: Collection[int], pacer: Pacer | None = None,
                     ) -> tuple[dict[int, Verification], dict[int, KVFSError]]:
    """Every range meta's layouts reference on ``servers``, read back and checked against its
    CRC-32C there: one walk of meta's keys in key order (GC_LAYOUTS pages: meta answers a
    page a step, however many keys it holds), each server's ranges checked a batch at a
    time as they fill, in chunk order (CHUNK_VERIFY; ``pacer``: within its byte rate).  At
    most ``VERIFY_HELD_RANGES`` ranges wait in all, however many servers (past it the
    server with the most is checked early).  A server whose check fails is not asked again
    and its error is returned; the others go on, and the walk ends once none is left."""
    done = {sid: Verification() for sid in servers}
    failed: dict[int, KVFSError] = {}
    todo: dict[int, list[VerifyItem]] = {sid: [] for sid in servers}
    held = dict.fromkeys(servers, 0)
    if not todo:
        return {}, {}
    total = (await gc.meta(rpc.Stats())).keys if gc.progress is not None else 0
    walked = waiting = 0

    async def check(sid: int) -> None:
        nonlocal waiting
        batch = sorted(todo[sid], key=lambda f: (f[1], f[2]))
        todo[sid], held[sid], waiting = [], 0, waiting - len(batch)
        if (v := await _checked(gc, sid, batch, pacer, failed)) is None:
            del todo[sid]
        else:
            done[sid].add(v)

    async with aclosing(_keys_round(gc, None)) as keys:
        async for (key, lay), live in keys:
            for x in lay.extents if live else ():
                for r in x.replicas:
                    if x.length and r.server_id in todo:
                        todo[r.server_id].append((key, r.chunk_id, r.offset, x.length, x.crc))
                        held[r.server_id] += x.length
                        waiting += 1
            walked += 1
            for sid in [s for s, t in todo.items()
                        if len(t) >= VERIFY_BATCH_RANGES or held[s] >= VERIFY_BATCH_BYTES]:
                await check(sid)
            if waiting >= VERIFY_HELD_RANGES:
                await check(max(todo, key=lambda s: len(todo[s])))
            if not todo:  # (every server failed)
                break
            if walked % SCRUB_PAGE_KEYS == 0:
                gc.report_progress("verify", walked, max(total, walked))
    for sid in [s for s, t in todo.items() if t]:
        await check(sid)
    gc.report_progress("verify", walked, max(total, walked))
    return {sid: v for sid, v in done.items() if sid not in failed}, failed


async def _checked(gc: GarbageCollector, sid: int, ranges: Sequence[VerifyItem], pacer: Pacer | None,
                   failed: dict[int, KVFSError]) -> Verification | None:
    """``ranges`` checked on server ``sid``; None if that failed (logged, kept in ``failed``)."""
    try:
        return await gc.verify_ranges(sid, ranges, pacer)
    except KVFSError as exc:
        warn.warning(sid, "verifying server %d failed: %s", sid, exc)
        failed[sid] = exc
        return None


def _counted(report: ScrubReport, checked: Mapping[int, Verification],
             failed: Mapping[int, KVFSError]) -> list[rpc.BadReplica]:
    """Each server's verification counted in ``report``, and those that failed; the replicas
    found bad."""
    bad: list[rpc.BadReplica] = []
    report.servers_failed = sorted({*report.servers_failed, *failed})
    for v in checked.values():
        report.servers_verified += 1
        report.ranges_checked += v.ranges
        report.bytes_verified += v.bytes
        report.missing += len(v.missing)
        report.corrupt += len(v.corrupt)
        bad += v.missing + v.corrupt
    return bad


def plan_batches(bad: Sequence[rpc.BadReplica]) -> list[list[rpc.BadReplica]]:
    """``bad`` in requests of at most ``PLAN_BATCH_BYTES``, a key's replicas always in one
    (its plan must see them all: an extent bad on every replica has no good copy, and
    split, each half would take the other's bad replica for a good one)."""
    by_key: dict[bytes, list[rpc.BadReplica]] = defaultdict(list)
    for b in bad:
        by_key[b.key].append(b)
    groups = list(by_key.values())
    runs = split_batches([len(g) * (len(g[0].key) + BAD_REPLICA_OVERHEAD) for g in groups],
                         max_bytes=PLAN_BATCH_BYTES, max_items=rpc.MAX_ITEMS // 64)
    return [[b for g in groups[run.start : run.stop] for b in g] for run in runs]


async def mend(gc: GarbageCollector, bad: list[rpc.BadReplica], report: ScrubReport,
               pacer: Pacer) -> None:
    """Replicas found bad (missing or corrupt, by CHUNK_VERIFY), against the layouts now
    (GC_SCRUB_PLAN): with ``report.apply``, each repaired from a good copy, and a key with
    none dropped; counted in ``report`` either way."""
    for batch in plan_batches(bad):
        plan = await gc.meta(rpc.GcScrubPlan(bad=batch))
        report.repairable += len(plan.items)
        report.lost_keys += plan.lost
        if not report.apply:
            continue
        if plan.items:
            rep = RepairReport()
            done = await copy_extents(gc, plan.items, rep)
            report.repaired += done
            report.bytes_copied += rep.bytes_copied
            report.repair_skipped += len(plan.items) - done
            await pacer.spent(rep.bytes_copied)
        if plan.drop:
            dropped = await gc.meta(rpc.GcDropReplicas(items=plan.drop))
            report.replicas_dropped += dropped.dropped
            report.keys_dropped += dropped.deleted_keys
    for k in report.lost_keys:
        log.warning("key %r has no good copy%s", k, ": dropped" if report.apply else "")


async def check_reported(gc: GarbageCollector,
                         suspects: Mapping[rpc.BadReplica, rpc.VerifyRange]) -> ScrubReport:
    """Replicas readers reported failing their CRC-32C (REPORT_BAD; each with the range and
    CRC-32C its layout names): each checked on its own chunkserver, and those found bad
    there mended (:func:`mend`), as a scrub mends what it finds.  A server that cannot be
    asked is skipped (its replicas are the repair step's once it is declared dead)."""
    t0 = time.monotonic()
    report = ScrubReport(apply=True)
    by_server: dict[int, list[VerifyItem]] = defaultdict(list)
    for b, r in suspects.items():
        by_server[b.server_id].append((b.key, r.chunk_id, r.offset, r.length, r.crc))
    await _verify_and_mend(gc, report, by_server)
    report.seconds = time.monotonic() - t0
    return report


async def _verify_and_mend(gc: GarbageCollector, report: ScrubReport,
                           by_server: Mapping[int, Sequence[VerifyItem]]) -> None:
    """Ranges (key, chunk id, offset, length, CRC-32C) checked on each server, and the bad
    ones mended (:func:`mend`, unpaced: a slice or a report is small)."""
    checked: dict[int, Verification] = {}
    failed: dict[int, KVFSError] = {}
    for sid in sorted(by_server):
        if (v := await _checked(gc, sid, by_server[sid], None, failed)) is not None:
            checked[sid] = v
    await mend(gc, _counted(report, checked, failed), report, Pacer(None))
