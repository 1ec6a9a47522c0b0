"""Re-replication, meta's side: which extents lost a copy, and the compare-and-swap that
puts a new copy in the place of a lost one.

A replica is *lost* when its server is gone: declared dead (no heartbeat for
``dead_after_s``) or being decommissioned (draining: still read, as the copy's source), or when ``kvfs gc scrub`` found its bytes
missing or failing their CRC (:func:`plan_scrub`).  An extent with a lost replica is
under-replicated; it is *repairable* while one of its replicas is on a server that is
alive (heartbeat within ``heartbeat_timeout_s``), which the GC's repair step reads and
copies to a live server holding no copy of it (:mod:`kvfs.gc.repair`).

Invariant (:func:`replace_replica`): a repair switches a replica only if the key's
current layout still holds the lost replica at the same (server, chunk, offset), so an
overwrite, a delete or a compaction racing the copy wins, and the copy becomes garbage
that compaction reclaims.  Pure functions: tested alone, called by :mod:`kvfs.meta.gc`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from kvfs.layout import Extent, Layout, Replica
from kvfs.rpc import MAX_REPAIR_PLAN_ITEMS, BadReplica, RepairItem, RepairState


@dataclass(slots=True)
class RepairSummary:
    """What is under-replicated now (``kvfs gc status``, ``kvfs stat``)."""

    under_replicated_extents: int = 0
    under_replicated_bytes: int = 0
    unrepairable_extents: int = 0  # every replica on a gone or silent server: lost unless one returns
    unrepairable_keys: list[bytes] = field(default_factory=list)  # the first few, for the report

    def state(self) -> RepairState:
        return RepairState(under_replicated_extents=self.under_replicated_extents,
                           under_replicated_bytes=self.under_replicated_bytes,
                           unrepairable_extents=self.unrepairable_extents)


def plan_repairs(entries: Iterable[tuple[bytes, Layout]], gone: set[int], alive: set[int],
                 *, limit_bytes: int, now: float, summary: RepairSummary | None = None,
                 first: bool = True, limit_items: int = MAX_REPAIR_PLAN_ITEMS) -> list[RepairItem]:
    """Extents of unexpired keys with a replica on a ``gone`` server and one on an
    ``alive`` server, up to ``limit_bytes`` and ``limit_items`` of them (at least one,
    unless not ``first``: the keys of one plan coming a page at a time, a later page's plan
    only what is left of the limits); ``summary`` counts every under-replicated extent.
    Nothing to scan when no server is gone."""
    items: list[RepairItem] = []
    if not gone:
        return items
    planned = 0
    for key, lay in entries:
        if lay.expired(now):
            continue
        for i, e in enumerate(lay.extents):
            lost = next((r for r in e.replicas if r.server_id in gone), None)
            if lost is None:
                continue
            # a draining server is gone yet alive: its replicas are read (last) to copy them away
            sources = tuple(sorted((r for r in e.replicas if r.server_id in alive),
                                   key=lambda r: r.server_id in gone))
            if summary is not None:
                summary.under_replicated_extents += 1
                summary.under_replicated_bytes += e.length
                if not sources:
                    summary.unrepairable_extents += 1
                    if len(summary.unrepairable_keys) < 20:
                        summary.unrepairable_keys.append(key)
            if not sources or ((items or not first) and (
                    planned + e.length > limit_bytes or len(items) >= limit_items)):
                continue
            items.append(RepairItem(key, i, e.length, e.crc, lay.expires_at, list(sources), lost,
                                    [r.server_id for r in e.replicas]))
            planned += e.length
    return items


@dataclass(slots=True)
class ScrubPlan:
    """What to do about the replicas a scrub found bad (:func:`plan_scrub`)."""

    items: list[RepairItem] = field(default_factory=list)  # copy a good replica over a bad one
    drop: list[BadReplica] = field(default_factory=list)  # forget these (GC_DROP_REPLICAS)
    lost: list[bytes] = field(default_factory=list)  # keys with an extent whose every copy is bad


def plan_scrub(bad: Iterable[BadReplica], layouts: dict[bytes, Layout], alive: set[int]) -> ScrubPlan:
    """For each key's replicas the scrub found missing or corrupt (``bad``), against its
    layout now (``layouts``; a key not there was deleted or overwritten since: nothing to do):

    - an extent with a replica not found bad on an ``alive`` server: each bad replica becomes
      a :class:`RepairItem` read from those, written to any live server but the ones holding
      the extent's other replicas (so with 2 servers, the bad replica's own server);
    - an extent whose every replica was found bad: the key has no good copy; its bad
      replicas are dropped, which deletes it (a miss, never wrong bytes), and it is ``lost``;
    - otherwise (its other copies are on silent servers): the bad replicas are dropped.
    A bad replica that the layout no longer holds is left alone (a racing write won)."""
    plan = ScrubPlan()
    by_key: dict[bytes, set[tuple[int, int, int]]] = {}
    for key, sid, cid, off in bad:
        by_key.setdefault(key, set()).add((sid, cid, off))
    for key, which in by_key.items():
        lay = layouts.get(key)
        if lay is None:
            continue
        items: list[RepairItem] = []
        drop: list[BadReplica] = []
        every: list[BadReplica] = []
        doomed = False
        for i, e in enumerate(lay.extents):
            hit = [r for r in e.replicas if (r.server_id, r.chunk_id, r.offset) in which]
            if not hit:
                continue
            bads = [BadReplica(key, r.server_id, r.chunk_id, r.offset) for r in hit]
            every.extend(bads)
            good = [r for r in e.replicas if r not in hit]
            sources = [r for r in good if r.server_id in alive]
            if sources:
                items.extend(RepairItem(key, i, e.length, e.crc, lay.expires_at, sources, r,
                                        [o.server_id for o in e.replicas if o != r]) for r in hit)
            elif good:
                drop.extend(bads)
            else:
                doomed = True
        if doomed:
            plan.lost.append(key)
            plan.drop.extend(every)
        else:
            plan.items.extend(items)
            plan.drop.extend(drop)
    return plan


def replace_replica(layout: Layout, index: int, lost: Replica, new: Replica) -> Layout | None:
    """``layout`` with replica ``lost`` of extent ``index`` replaced by ``new``; None when the
    layout no longer holds ``lost`` there (overwritten, compacted, already repaired) or when
    ``new``'s server already holds another replica of that extent (a scrub may put the copy
    on the server of the corrupt replica it replaces)."""
    if not 0 <= index < len(layout.extents):
        return None
    e = layout.extents[index]
    if lost not in e.replicas or any(r.server_id == new.server_id and r != lost for r in e.replicas):
        return None
    reps = tuple(new if r == lost else r for r in e.replicas)
    extents = (*layout.extents[:index], Extent(e.length, e.crc, reps), *layout.extents[index + 1:])
    return msgspec.structs.replace(layout, extents=extents)


def readable(layout: Layout, gone: set[int]) -> bool:
    """Every extent has a replica on a server that is not gone (exists, match_prefix)."""
    return not gone or all(any(r.server_id not in gone for r in e.replicas)
                           for e in layout.extents)
