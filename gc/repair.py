"""The GC's repair step: extents that lost a replica (its server dead) are copied from a
live replica to a live server holding no copy, within a byte-rate budget.

Per batch (``GC_REPAIR_PLAN``, :mod:`kvfs.meta.repair`): one ``READV`` per source
server reads each extent's whole record (header, key, value), so the copy keeps the
write id, the value's size and CRC and the extent index a meta rebuild needs; the value's
CRC is checked before anything is written; one ``APPEND`` per target server writes the
copies; one ``GC_REPAIR`` switches each lost replica to its copy, compare-and-swap (a
racing overwrite or delete wins, the copy becomes garbage compaction reclaims).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvfs import rpc
from kvfs.chunkserver.records import RECORD, ScannedRecord, parse_record
from kvfs.errors import KVFSError
from kvfs.gc.logs import server_warnings
from kvfs.gc.pace import Pacer
from kvfs.layout import Replica
from kvfs.protocol import Scatter
from kvfs.rpc import RepairItem

if TYPE_CHECKING:
    from kvfs.gc.driver import GarbageCollector

log = logging.getLogger("kvfs.gc.repair")
warn = server_warnings(log)  # (the same trouble on every pass: kvfs.gc.logs)

REPAIR_BATCH_BYTES = 16 * 1024 * 1024  # per plan: one READV per source server at most this much
MAX_ROUNDS = 10_000  # batches per step; a round that repairs nothing ends the step


@dataclass(kw_only=True)
class RepairReport:
    under_replicated_extents: int = 0  # when the step began
    under_replicated_bytes: int = 0
    unrepairable_extents: int = 0  # every replica on a dead or silent server
    extents_repaired: int = 0
    bytes_copied: int = 0
    skipped: int = 0  # a racing write won, or no live server could take a copy
    bad_sources: int = 0  # a source read failed or its record did not check out
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _record_range(item: RepairItem, src: Replica) -> rpc.Range:
    """The whole record whose value ``src`` points at."""
    head = RECORD.size + len(item.key)
    return rpc.Range(src.chunk_id, src.offset - head, head + item.length)


def _checks_out(rec: ScannedRecord | None, item: RepairItem) -> bool:
    return (rec is not None and rec.value_ok and not rec.tombstone and rec.key == item.key
            and rec.length == item.length and rec.crc == item.crc)


async def _read(gc: GarbageCollector, items: list[RepairItem],
                report: RepairReport) -> dict[int, tuple[ScannedRecord, memoryview]]:
    """Each item's record, read from its first source that answers and checks out."""
    got: dict[int, tuple[ScannedRecord, memoryview]] = {}
    tried: dict[int, int] = defaultdict(int)  # item -> sources tried
    while True:
        by_src: dict[int, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            if i not in got and tried[i] < len(item.sources):
                by_src[item.sources[tried[i]].server_id].append(i)
        if not by_src:
            return got
        for sid, idx in by_src.items():
            ranges = [_record_range(items[i], items[i].sources[tried[i]]) for i in idx]
            for i in idx:
                tried[i] += 1
            try:
                answer, body = await gc.chunkserver_exchange(sid, rpc.ReadV(ranges=ranges))
            except KVFSError as exc:
                warn.warning(sid, "repair: reading %d records from server %d failed: %s", len(idx), sid, exc)
                report.bad_sources += len(idx)
                continue
            errors = set(answer.errors)
            assert not isinstance(body, Scatter)
            payload = memoryview(body)
            pos = 0
            for n, (i, (_, _, length)) in enumerate(zip(idx, ranges, strict=True)):
                if n in errors:
                    report.bad_sources += 1
                    continue
                data = payload[pos:pos + length]
                pos += length
                rec = parse_record(bytes(data))
                if _checks_out(rec, items[i]):
                    assert rec is not None
                    got[i] = (rec, data[rec.value_offset:rec.end])
                else:
                    report.bad_sources += 1


def _targets(items: list[RepairItem], free: dict[int, int]) -> dict[int, int]:
    """item -> a live server holding no copy of it, the one with the most room left."""
    room = dict(free)
    out: dict[int, int] = {}
    for i, item in enumerate(items):
        choices = [s for s in room if s not in item.holders]
        if not choices:
            continue
        best = max(choices, key=lambda s: room[s])
        out[i] = best
        room[best] -= item.length
    return out


async def copy_extents(gc: GarbageCollector, items: list[RepairItem], report: RepairReport) -> int:
    """Copy each item's record from a source that checks out to a live server outside its
    ``holders``, then switch its ``lost`` replica to the copy (GC_REPAIR, compare-and-swap).
    The repair step's copy and the scrub's; ``gc.free_bytes()`` must be fresh.  Returns the
    extents switched; the bytes copied are added to ``report``."""
    live = {s.server_id for s in await gc.servers() if s.alive}
    known = gc.free_bytes()
    free = {sid: known.get(sid, 0) for sid in live}
    got = await _read(gc, items, report)
    targets = _targets(items, free)
    by_target: dict[int, list[int]] = defaultdict(list)
    for i in got:
        if i in targets:
            by_target[targets[i]].append(i)
        else:
            report.skipped += 1
    switches: list[rpc.ReplicaSwitch] = []
    for sid, idx in by_target.items():
        records = []
        for i in idx:
            rec, _ = got[i]
            records.append(rpc.RecordHead(rec.key, rec.length, rec.crc, rec.expires_at,
                                          rec.write_id, rec.total_size, rec.total_crc, rec.index))
        try:
            appended = await gc.chunkserver(sid, rpc.Append(records=records),
                                            [got[i][1] for i in idx])
            locations = appended.one_per_record(len(records), sid, "copies")
        except KVFSError as exc:
            warn.warning(sid, "repair: writing %d copies to server %d failed: %s", len(idx), sid, exc)
            report.skipped += len(idx)
            continue
        for i, (cid, off) in zip(idx, locations, strict=True):
            switches.append(rpc.ReplicaSwitch(items[i].key, items[i].extent, items[i].lost,
                                              Replica(sid, cid, off)))
        report.bytes_copied += sum(items[i].length for i in idx)
    if not switches:
        return 0
    r = await gc.meta(rpc.GcRepair(items=switches))
    report.skipped += r.skipped
    report.extents_repaired += r.repaired
    return r.repaired


async def repair_step(gc: GarbageCollector, *, apply: bool, rate_bytes: int | None = None,
                      batch_bytes: int = REPAIR_BATCH_BYTES) -> RepairReport:
    """Copy every repairable extent (``apply``), or only count them (dry run)."""
    t0 = time.monotonic()
    report = RepairReport()
    pacer = Pacer(rate_bytes)
    for rnd in range(MAX_ROUNDS):
        plan = await gc.meta(rpc.GcRepairPlan(limit_bytes=batch_bytes, totals=rnd == 0))
        if rnd == 0:
            report.under_replicated_extents = plan.under_replicated_extents
            report.under_replicated_bytes = plan.under_replicated_bytes
            report.unrepairable_extents = plan.unrepairable_extents
        if not apply or not plan.items:
            break
        copied = report.bytes_copied
        done = await copy_extents(gc, plan.items, report)
        gc.report_progress("repair", report.extents_repaired, max(report.under_replicated_extents, 1))
        if not done:
            break  # nothing more can be repaired now (no source, no room): the next pass retries
        await pacer.spent(report.bytes_copied - copied)
    report.seconds = time.monotonic() - t0
    return report
