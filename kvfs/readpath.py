"""The read path: extents to READVs, replica failover, CRC-32C checks, into the caller's memory.

Every extent of the values asked for goes to one READV per chunkserver (the first
live replica; split past ``max_read_rpc_bytes``, a few in flight).  The answer is
received straight into each destination (:class:`kvfs.protocol.Scatter`), or, for
values returned as ``bytes`` and destinations averaging under ``SCATTER_MIN_BYTES``,
into a pooled buffer they are copied out of (after their CRC check); small
destinations each holding a whole value of one replica (:meth:`ReadPath._groups`) are
received in place too, by vectored receives, and checked there (when one received is not
good, read once more the pooled way, which checks before it copies).  A bad
CRC, a dead server or a ``StaleLayout`` (bytes gone from the named chunk) moves the
extent to its next replica; when every replica said its bytes are gone, the key gets
one fresh lookup and retry; a key deleted meanwhile is a miss.  A key no replica can
serve fails alone (``failed``: the client makes it a miss or raises, its
``on_lost``), and the read says which of those every replica answered for without good
bytes (``lost``: truly lost, not merely unreachable).  With ``hedge_after_s``, a server
that has not begun to answer by then is given up for the read when every extent it was
asked for has another replica: they go to their next replica, and its late answer lands
in a scratch buffer (:class:`_Watch`).  Wrong bytes are never returned.  Replicas that
failed their CRC-32C are reported to meta (REPORT_BAD, in a task the read does not wait
for): meta checks them on their servers and repairs the bad ones from a good copy.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Final, cast

import crc32c
import msgspec

from kvfs import rpc
from kvfs._batch import split_batches
from kvfs._loop import gather_all, retrieve
from kvfs.buffers import Views, cut, fresh_value
from kvfs.cluster import ClusterLink
from kvfs.errors import (
    ChecksumMismatch,
    KVFSError,
    ServerError,
    StaleLayout,
    Timeout,
    Unavailable,
    from_wire,
)
from kvfs.layout import Extent, Layout, Replica
from kvfs.layoutcache import FLAT_CRC, FLAT_RANGE, FLAT_SERVER, Flat
from kvfs.protocol import FrameHead, ReceivePool, Scatter

log = logging.getLogger("kvfs.readpath")

READV_IN_FLIGHT = 4  # READVs in flight to one server when a read is split
# a READV answer lands in place in the callers' buffers when its extents average at least
# this (below it, receiving each in its own buffer costs more than one receive and a copy)
SCATTER_MIN_BYTES = 64 * 1024
RANGE_LENGTH = itemgetter(2)  # of a READV range (chunk id, offset, length)
_CRC = crc32c.crc32c  # a Scatter's fold (_fold_for): a value's sum taken as its bytes land (hot)
_NONE = type(None)
# a key found moved (its layout stale: overwritten, or moved by the GC's compaction) is read
# again at meta's new layout at most this many times in one read; moved once more, it fails
RELOOKUPS = 3


def bytes_gone(key: bytes) -> StaleLayout:
    """A key's error when meta still names the layout whose bytes were just found gone."""
    return StaleLayout(f"key {key[:64]!r}: its bytes are gone from the chunkserver named by its "
                       "layout (lost or reclaimed)")


def still_moving(key: bytes, read: str = "read") -> StaleLayout:
    """A key's error when its layout went stale at each of its :data:`RELOOKUPS` re-reads."""
    return StaleLayout(f"key {key[:64]!r}: its layout changed {RELOOKUPS + 1} times during one "
                       f"{read}")


class _Dest(enum.Enum):
    WHOLE = "whole"


# A destination marker: "the extent is the whole value: hand it back as bytes".
WHOLE: Final = _Dest.WHOLE
# where an extent's (or a value's) bytes go: one view, views filled in order (a value may be
# scattered over several buffers), WHOLE, or None: not read
Dest = Views | _Dest | None
# what fetch_now sends its READVs through: (server id, its address, READV, deadline) each,
# what each answer is handed to, and the set that gets the id of a server that did not answer
# by its deadline; True once every one was answered and handed over
ReadVs = Callable[[list[tuple[int, str, rpc.ReadV, float]],
                   Callable[[int, rpc.ReadVReply, memoryview], None], set[int]], bool]


class _Job(msgspec.Struct, gc=False):
    """One extent to read into ``dest`` (one view, or several when the caller scatters a
    value over several buffers), or handed back as bytes when ``dest`` is ``WHOLE``.

    Not tracked by Python's cyclic GC (``gc=False``): a read makes one per key, and as
    tracked objects they set off the GC's collections (a pass over every young object)
    every few calls.  So nothing a job refers to may refer back to it: its ``error`` is
    never raised itself (:meth:`ReadPath.fetch` raises a copy; a raised one's traceback
    would hold the frames that hold the job, a cycle the GC could not see, never freed)."""

    slot: int
    extent: Extent
    dest: Views | _Dest
    rep: Replica | None = None  # the replica being read
    tried: tuple[int, ...] = ()  # servers that already failed this extent
    error: KVFSError | None = None
    stale: bool = False  # a replica's server said the bytes are not there (StaleLayout)
    unreachable: bool = False  # a replica's server could not be asked (or failed otherwise)


@dataclass(slots=True)
class _Group:
    """One server's share of :meth:`ReadPath.fetch`'s first round as columns
    (:meth:`ReadPath._groups`): per value its slot, its READV range and its CRC-32C."""

    slots: list[int]
    ranges: list[tuple[int, int, int]]
    crcs: list[int]
    # the ranges' lengths and their sum, set by _groups (_take reads them, not each range
    # again: by the time the answer comes, a range tuple is seldom still in the CPU's cache)
    sizes: list[int] = field(default_factory=list)
    total: int = 0


def _one_server(flat: Sequence[Flat]) -> dict[int, _Group] | None:
    """:meth:`ReadPath._groups`' columns, every value read, when the flat forms all name one
    server (e.g. the values of one put_many, read back together): built in C, no Python
    step per key; None when they name several (a sort by server and a cut per server cost
    as much as the loop over the keys)."""
    sid = FLAT_SERVER(flat[0])
    if FLAT_SERVER(flat[-1]) != sid:  # (most reads of keys of several servers stop here)
        return None
    n = len(flat)
    if list(map(FLAT_SERVER, flat)).count(sid) != n:
        return None
    return {sid: _Group(list(range(n)), list(map(FLAT_RANGE, flat)), list(map(FLAT_CRC, flat)))}


def _fold_for(payload_len: int, parts: int) -> Callable[[memoryview, int], int] | None:
    """A READV answer's fold (:class:`kvfs.protocol.Scatter`): the CRC-32C taken as the
    bytes land, for parts averaging ``SCATTER_MIN_BYTES`` or more; smaller ones (an answer
    the caches hold) are summed after it is in, one C call each, not a step of the
    decoder's Python loop each."""
    return _CRC if parts and payload_len >= SCATTER_MIN_BYTES * parts else None


def _folded(payload: Scatter) -> list[int] | None:
    """The CRC-32C of each value of an answer received in place, taken as its bytes
    landed (one per value: the parts of a key's several views joined), or None: the
    answer had no fold (summed by the caller now)."""
    if payload.fold is None:
        return None
    joins = payload.joins
    assert len(payload.done) == (len(payload.parts) if joins is None
                                 else 1 + joins[1:].count(False) if joins else 0)
    return payload.done


def _jobs(slots: list[int], layouts: Sequence[Layout | None], dests: Sequence[Dest]) -> list[_Job]:
    """The jobs of a :class:`_Group`'s values (one extent, one replica each, being read)."""
    jobs = []
    for slot in slots:
        e = cast(Layout, layouts[slot]).extents[0]
        jobs.append(_Job(slot, e, cast("Views | _Dest", dests[slot]), e.replicas[0]))
    return jobs


def _take(payload: memoryview, g: _Group, dests: Sequence[Dest],
          out: list[bytes | None] | None) -> bool:
    """A :class:`_Group`'s answer, every range received: each value's bytes checked against
    its CRC-32C and copied out (into ``out`` as bytes for ``WHOLE``, else into its view).
    False at the first bad one (what came before it is copied out already; the caller then
    checks them all again, one job each)."""
    pos = 0
    crc = crc32c.crc32c
    for slot, n, c in zip(g.slots, g.sizes, g.crcs, strict=True):
        end = pos + n
        got = payload[pos:end]
        pos = end
        if crc(got) != c:
            return False
        dest = dests[slot]
        if dest is WHOLE:
            out[slot] = bytes(got)  # type: ignore[index]  # (out is given with WHOLE dests)
        else:
            dest[:] = got  # type: ignore[index,assignment]  # (one flat view: _groups checked)
    return True


@dataclass(slots=True)
class _Watch:
    """One server's READVs of a round, for hedging: ``started`` once an answer's header
    arrived (its bytes are landing in the destinations); ``abandoned`` once the round
    gave up on it (its answer, if one comes, goes to a scratch buffer and is ignored)."""

    started: bool = False
    abandoned: bool = False


def _give_up(keys: list[bytes], sid: int, jobs: list[_Job], error: KVFSError) -> None:
    """Server ``sid`` failed to answer ``jobs`` (``error``): each goes to its next replica."""
    for job in jobs:
        job.tried += (sid,)
        job.unreachable = True
        job.error = type(error)(f"key {keys[job.slot][:64]!r}: chunkserver {sid} holding its "
                                f"bytes failed to answer ({error})")


def _settle(keys: list[bytes], sids: list[int], jobs_of: Callable[[int], list[_Job]],
            results: Sequence[list[_Job] | BaseException], pending: list[_Job]) -> None:
    """A round's READVs answered, per server (``results``, as ``gather(...,
    return_exceptions=True)`` gives them): the jobs to retry into ``pending``; a server that
    failed (``Unavailable``, ``ServerError``) gives up all its jobs (``jobs_of(sid)``) for
    their next replica; any other error raises."""
    for sid, res in zip(sids, results, strict=True):
        if isinstance(res, (Unavailable, ServerError)):
            js = jobs_of(sid)
            _give_up(keys, sid, js, res)
            pending.extend(js)
        elif isinstance(res, BaseException):
            raise res
        else:
            pending.extend(res)


def _can_hedge(jobs: list[_Job]) -> bool:
    """Every job has a replica left besides the one being asked."""
    return all(len(job.extent.replicas) > len(job.tried) + 1 for job in jobs)


def _by_flat(flat: Sequence[Flat], slots: Iterable[int]) -> dict[int, _Group]:
    """:meth:`ReadPath._groups`' columns of the values of ``slots`` (read, each with its
    flat form), key by key: of a flat form only its server, range and CRC are taken (not
    its layout and size: two objects less per key to reach in memory, seldom still in the
    CPU's cache)."""
    groups: dict[int, _Group] = {}
    get = groups.get
    for slot in slots:
        f = flat[slot]
        sid = f[0]
        g = get(sid)
        if g is None:
            g = groups[sid] = _Group([], [], [])
        g.slots.append(slot)
        g.ranges.append(f[1])
        g.crcs.append(f[2])
    return groups


def _by_server(layouts: Sequence[Layout | None], dests: Sequence[Dest]
               ) -> dict[int, _Group] | None:
    """:meth:`ReadPath._groups`' columns of the values read (a layout and a destination),
    key by key; None when one is not one extent with one replica."""
    groups: dict[int, _Group] = {}
    for slot, dest in enumerate(dests):
        lay = layouts[slot]
        if lay is None or dest is None:
            continue
        ext = lay.extents
        if len(ext) != 1 or len(ext[0].replicas) != 1:
            return None
        e = ext[0]
        rep = e.replicas[0]
        sid = rep.server_id
        g = groups.get(sid)
        if g is None:
            g = groups[sid] = _Group([], [], [])
        g.slots.append(slot)
        g.ranges.append((rep.chunk_id, rep.offset, e.length))
        g.crcs.append(e.crc)
    return groups


class ReadPath:
    """Reads extents for :class:`kvfs.client.AsyncClient`.  ``relookup(keys)`` fetches
    fresh layouts from meta, ``forget(key)`` drops a cached one."""

    def __init__(self, link: ClusterLink, *, max_rpc_bytes: int, max_ranges: int,
                 relookup: Callable[[list[bytes]], Awaitable[list[Layout | None]]],
                 forget: Callable[[bytes], None], hedge_after_s: float | None = None,
                 pool_bytes: int = 0) -> None:
        """``hedge_after_s``: a server that has not begun to answer a READV by then is
        given up for this read, and its extents are asked of their next replicas (None:
        wait up to the request timeout).  ``pool_bytes``: READV answers whose values are
        copied out are received into buffers kept for reuse, at most this many bytes of
        them between reads (0: a fresh buffer each)."""
        # (duplicates: pairs up by shape with Batcher.__init__: each keeps its own arguments)
        self._link = link
        self._hedge_after_s = hedge_after_s
        self.hedged = 0  # READVs given up on after hedge_after_s (public counter)
        self._max_rpc_bytes = max_rpc_bytes
        self._max_ranges = max_ranges
        self._relookup = relookup
        self._forget = forget
        # values returned as bytes (and small get_into destinations) are copied out of it
        self._rx_pool = ReceivePool(pool_bytes, min_bytes=0)
        self._suspects: list[rpc.BadReplica] = []  # replicas failing their CRC-32C, to report
        self._reporting: asyncio.Task[None] | None = None  # sending them (REPORT_BAD)

    @property
    def rx_pool_buffers(self) -> int:
        """Receive buffers kept for reuse now."""
        return self._rx_pool.buffers

    @property
    def rx_buffers_reused(self) -> int:
        """Answers received into a kept buffer (a public counter)."""
        return self._rx_pool.reused

    def _rx_give(self, rx: list[memoryview]) -> None:
        for view in rx:  # kept only if no view of its buffer is alive (ReceivePool.give)
            self._rx_pool.give(view)
        rx.clear()

    async def read_into(self, keys: list[bytes], layouts: Sequence[Layout | None],
                        dests: Sequence[Dest], out: list[bytes | None] | None = None,
                        *, failed: dict[int, KVFSError] | None = None,
                        lost: dict[int, Layout] | None = None,
                        skip: frozenset[int] | set[int] = frozenset(),
                        flat: Sequence[Flat] | None = None,
                        resized: Callable[[int, Layout], Dest] | None = None) -> set[int]:
        """Fill ``dests``; returns the slots that turned out to be misses (deleted or
        expired while being read).  A key found overwritten or moved meanwhile (its bytes
        gone, meta naming a new layout) is read again from its new layout, up to
        :data:`RELOOKUPS` times (then it fails: still moving); at a new size, into new
        ``bytes`` in ``out`` (get_many), or into ``resized(slot, new layout)``'s destination
        (get_into: None where its buffer is too small, which ``resized`` records), else it
        fails.  With ``failed`` given, a key whose bytes cannot be
        read is recorded there instead of failing the call; with ``lost`` given too, the
        failed keys whose every replica answered without good bytes (CRC mismatch, record
        gone: not merely an unreachable server) are recorded there with the layout read.
        ``skip``: servers not to ask (they just failed to answer this call in time: see
        :meth:`fetch_now`), taken as timed out: their extents go to another replica, or fail.
        ``flat``: each layout's :data:`~kvfs.layoutcache.Flat` when the caller has them (the
        layout cache's), for the first READVs (else made from ``layouts`` when they are all
        one extent of one replica)."""
        misses: set[int] = set()
        bad: set[int] = set()  # slots whose last read found every replica without good bytes
        stale = await self.fetch(keys, layouts, dests, out, failed, bad, skip, flat)
        last: dict[int, Layout] = {}  # a slot read again: the layout it was read at last
        last_dest: dict[int, Dest] = {}  # and into what
        rereads = 0
        while stale:  # each stale slot's verdict is meta's layout after the stale read
            for i in stale:
                self._forget(keys[i])
            fresh = await self._relookup([keys[i] for i in stale])
            retry_layouts: list[Layout | None] = [None] * len(keys)
            retry_dests: list[Dest] = [None] * len(keys)
            again: list[int] = []
            for i, lay in zip(stale, fresh, strict=True):
                old = last.get(i, layouts[i])
                if lay is None:
                    misses.add(i)
                    continue
                gone = old is None or lay == old  # the layout read, still meta's: bytes lost
                if not gone and rereads == RELOOKUPS:
                    err = still_moving(keys[i])
                    if failed is None:
                        raise err
                    failed[i] = err
                    bad.discard(i)  # a moving layout is no proof of loss
                    continue
                dest = last_dest.get(i, dests[i])
                new_size = old is not None and not gone and lay.size != old.size
                if new_size and out is None:  # get_into: the key's buffer at the new size
                    if resized is None:
                        gone = True
                    else:
                        dest = resized(i, lay)
                        if dest is None:  # too small for the new size: resized said so
                            continue
                if gone:
                    err = bytes_gone(keys[i])
                    if failed is None:
                        raise err
                    failed[i] = err
                    if lay != old:
                        bad.discard(i)  # overwritten meanwhile: not this layout's loss
                    continue
                if out is not None and (new_size or (dest is WHOLE and len(lay.extents) > 1)):
                    # get_many: bytes of the new size, or of its own for a value found striped
                    # (a WHOLE destination reads one extent)
                    out[i], dest = fresh_value(lay.size)
                retry_layouts[i], retry_dests[i] = lay, dest
                last[i], last_dest[i] = lay, dest
                again.append(i)
            if not again:
                break
            rereads += 1
            bad.difference_update(again)
            stale = await self.fetch(keys, retry_layouts, retry_dests, out, failed, bad, skip)
        if lost is not None and failed:
            for i in failed:
                lay = last.get(i, layouts[i])
                if lay is not None and i in bad:
                    lost[i] = lay
        return misses

    async def fetch(self, keys: list[bytes], layouts: Sequence[Layout | None],
                    dests: Sequence[Dest], out: list[bytes | None] | None,
                    failed_out: dict[int, KVFSError] | None = None,
                    bad_out: set[int] | None = None,
                    skip: frozenset[int] | set[int] = frozenset(),
                    flat: Sequence[Flat] | None = None) -> list[int]:
        """Read every extent into its destination; returns the slots whose layout was stale
        (an extent every replica of which answered that its bytes are not there).  A slot no
        replica could serve raises, or lands in ``failed_out`` when given.  ``bad_out``
        collects the stale or failed slots with an extent whose every replica answered
        without good bytes (no server unreachable).  ``skip``, ``flat``: as for
        :meth:`read_into`.
        A server the link marked down after a timeout (:meth:`kvfs.cluster.ClusterLink.
        timed_out`) is not asked either, while the mark holds (until it answers the link's
        probe): its extents go to another replica, or fail at once (a miss, not one more
        timeout)."""
        stale: set[int] = set()
        failed: dict[int, KVFSError] = {}
        alive = self._link.alive()
        hung = self._link.timed_out()
        bad: set[int] = set()
        groups = None if skip or hung else self._groups(layouts, dests, flat)
        if groups is not None:  # the common case: no job per key unless its read fails
            first = await self._first_round(groups, keys, layouts, dests, out)
            by_server: dict[int, list[_Job]] = defaultdict(list)
            self._assign(keys, first, alive, stale, failed, bad, by_server)
        else:
            by_server = self._first_jobs(keys, layouts, dests, alive, stale, failed, bad)
        while by_server:
            pending: list[_Job] = []
            for sid in (skip | hung) & by_server.keys():
                js = by_server.pop(sid)
                _give_up(keys, sid, js, Timeout(
                    "no answer within the timeout to this call's first READV; not asked again"
                    if sid in skip else "a call to it timed out; not asked until it answers a probe"))
                pending.extend(js)
            hedge = self._hedge_after_s
            results: list[list[_Job] | BaseException]
            if not by_server:
                results = []
            elif hedge is not None and any(_can_hedge(js) for js in by_server.values()):
                results = await self._hedged_round(by_server, keys, out, hedge)
            else:
                results = await asyncio.gather(
                    *(self._readv(sid, js, keys, out) for sid, js in by_server.items()),
                    return_exceptions=True)
            _settle(keys, list(by_server), by_server.__getitem__, results, pending)
            by_server = defaultdict(list)
            self._assign(keys, pending, alive, stale, failed, bad, by_server)
        for slot in stale:
            failed.pop(slot, None)  # another extent of it was stale: retried whole
        if bad_out is not None:
            bad_out.update(bad)
        if self._suspects:
            self._report_bad()
        if failed:
            if failed_out is None:
                raise copy.copy(next(iter(failed.values())))  # not a job's own (_Job)
            failed_out.update(failed)
        return sorted(stale)

    def _report_bad(self) -> None:
        """Tell meta of the replicas found failing their CRC-32C (REPORT_BAD: it checks them
        on their servers and repairs the bad ones from a good copy), in a task: a read that
        found a good copy does not wait for meta (which may be down).  Best effort: a scrub
        finds what a report that failed did not tell."""
        if self._reporting_here() is not None:
            return  # that task sends these too, once its report is answered

        async def send() -> None:
            while self._suspects:
                items = list(dict.fromkeys(self._suspects))  # a replica read twice: told once
                self._suspects = []
                try:
                    await self._link.call_meta(rpc.ReportBad(items=items))
                except Exception as exc:  # best effort (never an error left unretrieved)
                    log.warning("could not report %d replicas failing their CRC-32C to meta: %s",
                                len(items), exc)

        self._reporting = asyncio.get_running_loop().create_task(send())

    def _reporting_here(self) -> asyncio.Task[None] | None:
        """The REPORT_BAD task still running on this event loop, if any (one of another loop,
        where the client was used before, is none: as ``LayoutCache._sending``)."""
        task = self._reporting
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            return None
        return task

    async def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a REPORT_BAD being sent; past it, it is given up."""
        task = self._reporting_here()
        if task is not None:
            await asyncio.wait([task], timeout=timeout_s)
            task.cancel()

    def _first_jobs(self, keys: list[bytes], layouts: Sequence[Layout | None], dests: Sequence[Dest],
                    alive: dict[int, bool], stale: set[int], failed: dict[int, KVFSError],
                    bad: set[int]) -> dict[int, list[_Job]]:
        """Every extent to read as a job, by the server of its first replica to try."""
        # an extent with one replica goes to its server with no choice to make
        by_server: dict[int, list[_Job]] = defaultdict(list)
        choose: list[_Job] = []
        for slot, (lay, dest) in enumerate(zip(layouts, dests, strict=True)):
            if lay is None or dest is None:
                continue
            if dest is WHOLE or len(lay.extents) == 1:  # one extent: the dest is all of it
                e = lay.extents[0]
                reps = e.replicas
                if len(reps) == 1:
                    by_server[reps[0].server_id].append(_Job(slot, e, dest, reps[0]))
                else:
                    choose.append(_Job(slot, e, dest))
                continue
            pos = 0
            for e in lay.extents:
                choose.append(_Job(slot, e, cut(dest, pos, e.length)))
                pos += e.length
        self._assign(keys, choose, alive, stale, failed, bad, by_server)
        return by_server

    def _groups(self, layouts: Sequence[Layout | None], dests: Sequence[Dest],
                flat: Sequence[Flat] | None = None) -> dict[int, _Group] | None:
        """:meth:`fetch`'s first round as columns, by server, when every value asked for is
        one extent with one replica, to be copied out of a pooled receive (handed back as
        bytes, ``WHOLE``, or into one flat view: the same for every value), and each
        server's share is one READV of distinct ranges: None otherwise (the jobs of
        :meth:`_first_jobs` then).  ``flat``: the layouts' :data:`~kvfs.layoutcache.Flat`
        forms, when the caller has them (else made here)."""
        kinds = set(map(type, dests))
        every = _NONE not in kinds
        kinds.discard(_NONE)  # values not read (misses, too small)
        if len(kinds) != 1 or not kinds <= {_Dest, memoryview}:
            return None  # none read, mixed, or a value scattered over several views
        groups: dict[int, _Group] | None
        if flat is None:
            groups = _by_server(layouts, dests)
        elif every:
            groups = _one_server(flat) or _by_flat(flat, range(len(flat)))
        else:  # the cache's (every key a hit): no layout to take apart
            groups = _by_flat(flat, [i for i, dest in enumerate(dests) if dest is not None])
        if groups is None:
            return None  # a value of several extents or replicas
        whole = kinds == {_Dest}
        for g in groups.values():
            ranges = g.ranges
            g.sizes = list(map(RANGE_LENGTH, ranges))
            g.total = sum(g.sizes)
            if (len(ranges) > self._max_ranges or g.total > self._max_rpc_bytes
                    or len(set(ranges)) != len(ranges)
                    or (not whole and g.total >= SCATTER_MIN_BYTES * len(ranges))):
                return None  # split, or received in place: the jobs' way
        return groups or None

    async def _first_round(self, groups: dict[int, _Group], keys: list[bytes],
                           layouts: Sequence[Layout | None], dests: Sequence[Dest],
                           out: list[bytes | None] | None) -> list[_Job]:
        """One READV per server of ``groups`` (:meth:`_groups`), every value checked and
        copied out; returns the jobs to try again on their next replica (made only for
        the values of a READV that failed or was not all good)."""
        results: list[list[_Job] | BaseException]
        if len(groups) == 1:  # one READV (e.g. one key's): awaited here, no task made for it
            [(sid, g)] = groups.items()
            try:
                results = [await self._readv_group(sid, g, keys, layouts, dests, out)]
            except Exception as exc:  # as gather(return_exceptions=True) gives it: _settle's
                results = [exc]
        else:
            results = await asyncio.gather(
                *(self._readv_group(sid, g, keys, layouts, dests, out)
                  for sid, g in groups.items()), return_exceptions=True)
        pending: list[_Job] = []
        try:
            _settle(keys, list(groups), lambda sid: _jobs(groups[sid].slots, layouts, dests),
                    results, pending)
        finally:  # an error caught above holds this frame (its traceback): no cycle kept
            del results  # through it, so the caller's buffers are free once this returns
        return pending

    async def _readv_group(self, sid: int, g: _Group, keys: list[bytes],
                           layouts: Sequence[Layout | None], dests: Sequence[Dest],
                           out: list[bytes | None] | None, in_place: bool = True) -> list[_Job]:
        """One READV of a :class:`_Group`: values returned as bytes (``WHOLE``) are received
        into a pooled buffer and, when every range came back with good bytes, copied out
        here, with no job made; else the group's jobs are checked one by one
        (:meth:`_check`) and those to retry returned.  Values read into the caller's views
        are received straight into them (``in_place``: a vectored receive, no copy) and
        checked there (a range the server answered with an error, e.g. its chunk compacted
        away, goes on to its next replica or a fresh lookup); when one received is not good,
        the group is read once more the pooled way, which checks before it copies (a
        caller's views that overlap, or the same view given twice, cannot then pass for a
        corrupt replica)."""
        rx: list[memoryview] = []
        in_place = in_place and dests[g.slots[0]] is not WHOLE

        def scatter(head: FrameHead) -> Scatter:
            # the ranges answered (an errored one has no bytes), in order (a sink is given
            # only an answer whose header checked out: kvfs.transport)
            views = cast(Sequence[memoryview], dests)
            errs = rpc.message(head, rpc.ReadVReply).errors
            parts = ([views[s] for i, s in enumerate(g.slots) if i not in errs] if errs
                     else list(map(views.__getitem__, g.slots)))
            return Scatter(parts, _fold_for(head.payload_len, len(parts)))

        try:
            h, payload = await self._link.call_server(
                sid, rpc.ReadV(ranges=cast(list[rpc.Range], g.ranges)),
                sink=scatter if in_place else self._pooled(rx))
        except BaseException:
            self._rx_give(rx)
            raise
        retry: list[_Job] = []
        if isinstance(payload, Scatter):
            errs = h.errors
            # of the ranges answered, in order
            got = _folded(payload) or list(map(crc32c.crc32c, payload.parts))
            if not errs:
                if got == g.crcs:
                    return []
            elif got == [c for i, c in enumerate(g.crcs) if i not in errs]:
                # the rest good in place: the ranges in error (e.g. a chunk that compaction
                # deleted) go to their next replica or a fresh lookup, with no second READV
                self._check(sid, _jobs(g.slots, layouts, dests), keys, out, retry, h, payload,
                            g.ranges, self._suspects)
                return retry
            return await self._readv_group(sid, g, keys, layouts, dests, out, in_place=False)
        # (a small answer arrives whole, not through the sink: checked and copied out here)
        if (h.errors or not isinstance(payload, memoryview) or payload.nbytes != g.total
                or not _take(payload, g, dests, out)):
            self._check(sid, _jobs(g.slots, layouts, dests), keys, out, retry, h, payload,
                        g.ranges, self._suspects)
        payload = memoryview(b"")  # the receive buffer's last view here: the pool takes it
        self._rx_give(rx)
        return retry

    def _pooled(self, rx: list[memoryview], watch: _Watch | None = None,
                ) -> Callable[[FrameHead], memoryview]:
        """A READV answer's sink: a buffer of the receive pool (recorded in ``rx``, for
        :meth:`_rx_give`), or scratch once ``watch`` gave the server up."""

        def pooled(head: FrameHead) -> memoryview:
            # values handed back as bytes are copied out of a reused buffer: no fresh
            # pages to fault in for every answer
            if watch is not None:
                if watch.abandoned:  # the read went on without this server: bytes discarded
                    return memoryview(bytearray(head.payload_len))
                watch.started = True
            buf = self._rx_pool(head)
            rx.append(buf if isinstance(buf, memoryview) else memoryview(buf))
            return rx[0]

        return pooled

    def fetch_now(self, keys: list[bytes], layouts: Sequence[Layout | None], dests: Sequence[Dest],
                  out: list[bytes | None] | None, readvs: ReadVs, late: set[int],
                  flat: Sequence[Flat] | None = None) -> bool:
        """:meth:`fetch`'s common case, without the event loop (the blocking client's
        callers' threads): every extent read from the first live replica, one READV per
        server, all sent through ``readvs`` (:meth:`kvfs.blocking.ServerSockets.readvs`)
        before any answer is read, each answer checked (CRC-32C) and copied out as
        :meth:`fetch` does.  True: every extent read and checked.  False: the case is not
        the common one (a server down or unknown, a READV to split, extents large enough
        to be received in place, which the IO loop does) or anything failed (a socket, an
        answer, a range's error, a CRC): nothing is decided, some destinations may hold
        garbage, and the caller reads again with :meth:`read_into` (failover, fresh
        lookups, the ``failed``/``lost`` record).  Servers the link marks down are not picked
        here (another replica is; a value only they hold goes to the IO loop, which decides
        as :meth:`fetch` does).  A server that has not answered within the request timeout,
        or ``hedge_after_s`` when that is sooner and every extent asked of it has another
        replica, is given up here, its id added to ``late`` and marked down on the IO loop
        (as :meth:`kvfs.cluster.ClusterLink.call_server` marks one; after the request
        timeout, as timed out): the caller's read through the IO loop skips it
        (``read_into(skip=late)``), so a hung server costs a call one wait, not two, and
        later calls none while the mark holds.  ``flat``: as for :meth:`read_into`; values of
        one extent of one replica are read as :meth:`fetch`'s first round is, no job each."""
        addrs = self._link.server_addrs()
        now = time.monotonic()
        timeout = self._link.request_timeout_s
        reads: list[tuple[int, str, rpc.ReadV, float]] = []
        groups = self._groups(layouts, dests, flat)
        if groups is not None:
            for sid, g in groups.items():
                addr = addrs.get(sid)
                if addr is None:
                    return False
                reads.append((sid, addr, rpc.ReadV(ranges=cast(list[rpc.Range], g.ranges)),
                              now + timeout))  # (one replica: nothing to hedge to)
            good: list[bool] = []

            def take(sid: int, h: rpc.ReadVReply, payload: memoryview) -> None:
                g = groups[sid]
                good.append(not h.errors and payload.nbytes == g.total
                            and _take(payload, g, dests, out))

            return self._send_now(reads, take, readvs, late, set()) and all(good)
        alive = {sid: addr is not None for sid, addr in addrs.items()}
        stale: set[int] = set()
        failed: dict[int, KVFSError] = {}
        by_server = self._first_jobs(keys, layouts, dests, alive, stale, failed, set())
        if stale or failed:
            return False
        hedged: set[int] = set()  # servers whose deadline is hedge_after_s
        batches: dict[int, tuple[list[_Job], list[tuple[int, int, int]]]] = {}
        for sid, jobs in by_server.items():
            addr = addrs.get(sid)
            if addr is None:
                return False
            ranges = [(job.rep.chunk_id, job.rep.offset, job.extent.length)  # type: ignore[union-attr]
                      for job in jobs]
            total = sum([r[2] for r in ranges])
            if (len(ranges) > self._max_ranges or total > self._max_rpc_bytes
                    or len(set(ranges)) != len(ranges) or self._in_place(jobs, total)):
                return False
            wait = timeout
            if self._hedge_after_s is not None and self._hedge_after_s < timeout and _can_hedge(jobs):
                wait = self._hedge_after_s
                hedged.add(sid)
            reads.append((sid, addr, rpc.ReadV(ranges=cast(list[rpc.Range], ranges)), now + wait))
            batches[sid] = (jobs, ranges)
        retry: list[_Job] = []

        def settle(sid: int, h: rpc.ReadVReply, payload: memoryview) -> None:
            jobs, ranges = batches[sid]
            errors = h.errors
            want = sum([r[2] for i, r in enumerate(ranges) if i not in errors])
            if payload.nbytes != want:  # a server that miscounts: not one to trust here
                retry.append(jobs[0])
                return
            self._check(sid, jobs, keys, out, retry, h, payload, ranges)

        return self._send_now(reads, settle, readvs, late, hedged) and not retry

    def _send_now(self, reads: list[tuple[int, str, rpc.ReadV, float]],
                  settle: Callable[[int, rpc.ReadVReply, memoryview], None], readvs: ReadVs,
                  late: set[int], hedged: set[int]) -> bool:
        """:meth:`fetch_now`'s READVs sent and each answer handed to ``settle``; False when
        one was not answered in time: those servers (``late``) are marked down on the IO
        loop, before the caller's read there (as timed out unless in ``hedged``)."""
        if readvs(reads, settle, late):
            return True
        for sid in late:
            self._link.mark_down_soon(sid, timed_out=sid not in hedged)
        return False

    async def _hedged_round(self, by_server: dict[int, list[_Job]], keys: list[bytes],
                            out: list[bytes | None] | None,
                            hedge: float) -> list[list[_Job] | BaseException]:
        """One round of READVs (as ``gather(..., return_exceptions=True)`` answers); a
        server that has not begun to answer within ``hedge`` seconds, whose extents all have
        another replica, is answered ``Timeout`` at once: its extents go to their next
        replica and its READV is left to finish (or time out) with its bytes discarded."""
        watches = [_Watch() for _ in by_server]
        tasks = [asyncio.ensure_future(self._readv(sid, js, keys, out, w))
                 for (sid, js), w in zip(by_server.items(), watches, strict=True)]
        try:
            await asyncio.wait(tasks, timeout=hedge)
            results: list[asyncio.Future[list[_Job]] | BaseException] = []
            waiting = []
            for js, w, t in zip(by_server.values(), watches, tasks, strict=True):
                if not t.done() and not w.started and _can_hedge(js):
                    w.abandoned = True
                    t.add_done_callback(retrieve)  # abandoned: its outcome is not wanted
                    self.hedged += 1
                    results.append(Timeout(f"no answer within hedge_after_s={hedge:g}; asked "
                                           "the next replica"))
                else:
                    results.append(t)
                    waiting.append(t)
            if waiting:
                await asyncio.wait(waiting)
        except BaseException:
            for w, t in zip(watches, tasks, strict=True):
                if not w.abandoned:
                    t.cancel()
            raise
        return [r.exception() or r.result() if isinstance(r, asyncio.Future) else r
                for r in results]

    @staticmethod
    def _assign(keys: list[bytes], jobs: list[_Job], alive: dict[int, bool], stale: set[int],
                failed: dict[int, KVFSError], bad: set[int],
                by_server: dict[int, list[_Job]]) -> None:
        """Each job to the server of its next replica to try (a live one first).  A job with
        none left makes its slot stale (a replica said its bytes are gone: a fresh layout
        may name others) or fails it; ``bad`` collects those whose every replica answered."""
        for job in jobs:
            if job.slot in stale or job.slot in failed:
                continue
            reps = job.extent.replicas
            if len(reps) == 1 and not job.tried:  # no choice to make
                rep: Replica | None = reps[0]
            else:
                choices = [r for r in reps if r.server_id not in job.tried]
                rep = next((r for r in choices if alive.get(r.server_id, True)),
                           choices[0] if choices else None)
            if rep is None:  # every replica tried
                if job.stale:
                    stale.add(job.slot)
                else:
                    failed[job.slot] = job.error or Unavailable(
                        f"key {keys[job.slot][:64]!r}: no replica left to read")
                if not job.unreachable:
                    bad.add(job.slot)
                continue
            job.rep = rep
            by_server[rep.server_id].append(job)

    async def _readv(self, sid: int, jobs: list[_Job], keys: list[bytes],
                     out: list[bytes | None] | None, watch: _Watch | None = None) -> list[_Job]:
        """Read ``jobs`` from one server: one READV, or several (at most
        ``max_read_rpc_bytes`` each, a few in flight) for large reads, so the server's
        reads, the transfer and the client's checks overlap.  Returns the jobs to retry on
        their next replica."""
        retry: list[_Job] = []
        ranges = [(job.rep.chunk_id, job.rep.offset, job.extent.length)  # type: ignore[union-attr]
                  for job in jobs]
        if (len(ranges) <= self._max_ranges and len(set(ranges)) == len(ranges)
                and sum([r[2] for r in ranges]) <= self._max_rpc_bytes):
            batches = [jobs]  # the common case, checked in C: one READV
        else:  # a server refuses overlapping ranges: the same extent asked twice (the same
            # key twice in one call) goes in another READV
            batches = [jobs[r.start : r.stop] for r in split_batches(
                [r[2] for r in ranges], max_bytes=self._max_rpc_bytes, max_items=self._max_ranges,
                keys=[r[:2] for r in ranges])]
        if len(batches) == 1:
            await self._readv_batch(sid, batches[0], keys, out, retry, watch, ranges)
            return retry
        gate = asyncio.Semaphore(READV_IN_FLIGHT)

        async def one(batch: list[_Job]) -> None:
            async with gate:
                await self._readv_batch(sid, batch, keys, out, retry, watch)

        await gather_all(*(one(b) for b in batches))  # none left landing once this returns
        return retry

    async def _readv_batch(self, sid: int, batch: list[_Job], keys: list[bytes],
                           out: list[bytes | None] | None, retry: list[_Job],
                           watch: _Watch | None = None,
                           ranges: list[tuple[int, int, int]] | None = None) -> None:
        """One READV of ``batch`` (``ranges``: its ranges, when the caller made them)."""
        if ranges is None:
            ranges = [(job.rep.chunk_id, job.rep.offset, job.extent.length)  # type: ignore[union-attr]
                      for job in batch]
        rx: list[memoryview] = []  # a pooled receive buffer, if one was taken

        def scatter(head: FrameHead) -> Scatter | memoryview:
            # the answer lands straight in each destination (e.g. the caller's buffers); a
            # sink is given only an answer whose header checked out (kvfs.transport)
            if watch is not None:
                if watch.abandoned:  # the read went on without this server: bytes discarded
                    return memoryview(bytearray(head.payload_len))
                watch.started = True
            errs = rpc.message(head, rpc.ReadVReply).errors
            parts: list[memoryview] = []
            joins: list[bool] = []  # a key's views after its first: one value, folded on
            for i, job in enumerate(batch):
                if i not in errs:
                    dest = cast(Views, job.dest)  # no dest is WHOLE here
                    if type(dest) is memoryview:
                        parts.append(dest)
                        joins.append(False)
                    else:
                        parts.extend(dest or [memoryview(b"")])  # (one value each, even empty)
                        joins.append(False)
                        joins.extend(repeat(True, len(dest) - 1))
            return Scatter(parts, _fold_for(head.payload_len, len(parts)), joins)

        # large destinations receive in place; small ones (e.g. 4 KiB values) share one
        # receive into a pooled buffer and are copied out, as values returned as bytes are
        sink = (scatter if self._in_place(batch, sum([r[2] for r in ranges]))
                else self._pooled(rx, watch))
        try:
            # plain (chunk, offset, length) tuples: msgpack arrays, as rpc.Range encodes
            h, payload = await self._link.call_server(
                sid, rpc.ReadV(ranges=cast(list[rpc.Range], ranges)), sink=sink)
        except BaseException:
            self._rx_give(rx)
            raise
        if watch is not None and watch.abandoned:
            payload = memoryview(b"")
            self._rx_give(rx)
            return
        self._check(sid, batch, keys, out, retry, h, payload, ranges, self._suspects)
        # drop every view of the receive buffer (the answer's payload is one of its own),
        # or the pool will not take it back
        payload = memoryview(b"")
        self._rx_give(rx)

    @staticmethod
    def _in_place(batch: list[_Job], total: int) -> bool:
        """Whether a READV's answer lands straight in its destinations (they average at
        least ``SCATTER_MIN_BYTES`` and none is handed back as bytes)."""
        return (total >= SCATTER_MIN_BYTES * len(batch)
                and all([job.dest is not WHOLE for job in batch]))

    @staticmethod
    def _check(sid: int, batch: list[_Job], keys: list[bytes], out: list[bytes | None] | None,
               retry: list[_Job], h: rpc.ReadVReply, payload: memoryview | Scatter,
               ranges: list[tuple[int, int, int]],
               suspects: list[rpc.BadReplica] | None = None) -> None:
        """One READV's answer: each range's error or CRC-32C mismatch puts its job in
        ``retry`` (for its next replica), a mismatch's replica in ``suspects`` too (for
        meta: REPORT_BAD, at most ``rpc.MAX_REPORT_BAD`` held); good bytes received apart from
        their destination are copied there (or handed back as bytes in ``out``)."""
        errors = h.errors
        in_place = isinstance(payload, Scatter)
        view = payload if isinstance(payload, memoryview) else memoryview(b"")
        sums = _folded(payload) if isinstance(payload, Scatter) else None
        pos = 0  # in view (received apart) or in sums (folded in place: a sum per value)
        crc = crc32c.crc32c
        for idx, job in enumerate(batch):
            if errors:
                err = errors.get(idx)
                if err is not None:
                    exc = from_wire({"code": err.code, "message": err.message})
                    job.tried += (sid,)
                    if isinstance(exc, StaleLayout):  # the next replica may have it
                        job.stale = True
                        job.error = StaleLayout(f"key {keys[job.slot][:64]!r}: its bytes are gone "
                                                f"from chunkserver {sid} ({exc})")
                    else:
                        job.unreachable = True
                        job.error = exc
                    retry.append(job)
                    continue
            n = job.extent.length
            dest = job.dest
            if in_place:
                assert dest is not WHOLE  # scatter is chosen only when no dest is WHOLE
                if sums is not None:  # taken as the bytes landed
                    c = sums[pos]
                    pos += 1
                else:
                    c = 0
                    for p in [dest] if type(dest) is memoryview else dest:
                        c = crc(p, c)
            else:
                got = view[pos : pos + n]
                pos += n
                c = crc(got)
            if c != job.extent.crc:
                job.tried += (sid,)
                job.error = ChecksumMismatch(
                    f"key {keys[job.slot][:64]!r}: bytes from chunkserver {sid} (chunk "
                    f"{ranges[idx][0]:016x} offset {ranges[idx][1]}) fail their CRC-32C")
                retry.append(job)
                if suspects is not None and len(suspects) < rpc.MAX_REPORT_BAD:
                    suspects.append(rpc.BadReplica(keys[job.slot], sid, *ranges[idx][:2]))
                continue
            if dest is WHOLE:
                assert out is not None
                out[job.slot] = bytes(got)
            elif not in_place:  # checked in the receive buffer, copied to the caller's
                if type(dest) is memoryview:
                    dest[:] = got
                    continue
                if len(dest) == 1:
                    dest[0][:] = got
                    continue
                at = 0
                for p in dest:
                    p[:] = got[at : at + p.nbytes]
                    at += p.nbytes
