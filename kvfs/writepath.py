"""The write path: placement -> one APPEND per chunkserver -> one COMMIT to meta.

Values are placed by :func:`kvfs.placement.place`; each server gets all its records
in one APPEND (split past ``max_rpc_bytes``), the payload being the callers'
memoryviews, never re-packed.  The COMMIT of every layout in one transaction is the
linearisation point.  A server refusing for lack of space (``NoSpace``) makes the
writer ask meta to make room (``MAKE_ROOM``: meta runs one GC pass) and retry, again while
each pass made some (other writers may take it first), within the write's 3 tries;
the client itself never runs GC.  A server that cannot be reached mid-write (or answers
an APPEND against the protocol, e.g. not one location per record) is left
out for the rest of the call and the values are placed again on the live others
(a degraded write; the link also marks it down, :meth:`kvfs.cluster.ClusterLink.mark_down`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, compress, repeat
from operator import getitem, is_not, itemgetter
from typing import Any, NamedTuple, cast

import crc32c

from kvfs import rpc
from kvfs._batch import split_batches
from kvfs.buffers import Source, cut, nbytes
from kvfs.cluster import ClusterLink
from kvfs.config import ClientConfig
from kvfs.crc import crc32c_combine
from kvfs.errors import KVFSError, NoSpace, StaleLayout, Unavailable
from kvfs.layout import Extent, Layout, Replica
from kvfs.layoutcache import Cached, Single
from kvfs.packed import MAX_KEYS as MAX_PACKED_KEYS
from kvfs.packed import join as join_packed
from kvfs.packed import pack as pack_layouts
from kvfs.packed import pack_single
from kvfs.placement import Placed, order_by_free, place
from kvfs.protocol import Buffer

log = logging.getLogger("kvfs.client")


# a chunkserver that failed a write this way is left out of the call's retries: not reached,
# or an answer that breaks the protocol (:class:`rpc.BadAppendAnswer`)
_SERVER_FAILED = (Unavailable, rpc.BadAppendAnswer)
_LENGTH = itemgetter(1)  # a record head's length (RecordHead's field 1, or its plain tuple's)


def _units(placed: Sequence[object]) -> bool:
    """Every value placed as one unit (a tuple of servers): checked in C (the one tuple
    :func:`~kvfs.placement.place` shares, by identity, when every value went there)."""
    first = placed[0] if placed else None
    return ((type(first) is tuple and placed.count(first) == len(placed))
            or set(map(type, placed)) == {tuple})


def _flat_units(placed: list[Placed], views: Sequence[Source]) -> bool:
    """Every value placed as one unit and given as one flat buffer (not a list of views):
    checked in C."""
    return _units(placed) and not any(issubclass(t, list) for t in set(map(type, views)))


def _listed(v: Source) -> list[memoryview] | tuple[Buffer]:
    """A value's buffers as a sequence (its views, or its one flat buffer alone)."""
    return v if isinstance(v, list) else (v,)


class WritePath:
    """Writes values for :class:`kvfs.client.AsyncClient` (and :mod:`kvfs.stream`);
    ``clock()`` gives the expiry hint stored in each record."""

    def __init__(self, link: ClusterLink, config: ClientConfig, clock: Callable[[], float]) -> None:
        self._link = link
        self.config = config
        self._clock = clock
        self._write_id = 0  # last write id handed out (see next_write_id)
        # group commit (commit_packed): the loop whose COMMIT of this writer is in flight
        # (None: none is), and the COMMITs that came meanwhile, each waiting on its future
        self._committing: asyncio.AbstractEventLoop | None = None
        self._commit_queue: list[_Queued] = []
        self._flushes: set[asyncio.Task[None]] = set()  # (held: a task only weakly referenced may go)
        # puts (and deletes' tombstones) written again after meta refused their COMMIT for a
        # chunk the GC reclaimed meanwhile (public counter)
        self.rewritten = 0

    async def put(self, keys: list[bytes], views: Sequence[Source], *, replicas: int,
                  ttl: float | None, if_absent: bool = False,
                  metas: list[bytes | None] | None = None,
                  tried: dict[bytes, Layout] | None = None,
                  sizes: list[int] | None = None) -> list[Cached | None]:
        """Store the values; returns their committed layouts (stamped by meta), a value of one
        extent with one replica as a :class:`~kvfs.layoutcache.Single` (its layout built when
        asked: :meth:`~kvfs.layoutcache.LayoutCache.build`).
        ``metas``: each key's metadata (encoded), committed in its layout.  ``sizes``: each
        value's bytes, when the caller has them already (else counted here).

        ``if_absent``: one ``EXISTS`` to meta first, and only the absent keys' values are
        appended; their ``COMMIT`` is conditional too, so a writer that raced past the check
        keeps the value that committed first.  None for a key not written (present).  A key
        the COMMIT finds present is looked up (:meth:`_ours`): it may hold this very value,
        committed by an earlier try of the same COMMIT whose answer was lost.

        ``tried`` (with ``if_absent``): the layouts a failed put of these values may have
        committed (a put retried after its COMMIT failed without an answer), and where this
        one records what it sends: a key the ``EXISTS`` finds present holding one of them
        is this put's, written (:meth:`_ours`), and is not written again.

        A COMMIT that meta refuses with ``StaleLayout`` (a chunk the values went to was
        reclaimed by the GC meanwhile: a pass that makes room on a full cluster waits no grace
        period) is retried once, values appended again: a key an applied part of the refused
        COMMIT stored is this put's (``tried``)."""
        if if_absent and tried is None:
            tried = {}
        try:
            return await self._put(keys, views, replicas, ttl, if_absent, metas, tried, sizes)
        except StaleLayout as exc:
            log.info("a put's COMMIT named a chunk the GC reclaimed meanwhile (%s): writing its "
                     "%d values again", exc, len(keys))
            self.rewritten += 1
        return await self._put(keys, views, replicas, ttl, if_absent, metas, tried, sizes)

    async def _put(self, keys: list[bytes], views: Sequence[Source], replicas: int,
                   ttl: float | None, if_absent: bool, metas: list[bytes | None] | None,
                   tried: dict[bytes, Layout] | None, sizes: list[int] | None) -> list[Cached | None]:
        """One try of :meth:`put`."""
        out: list[Cached | None] = [None] * len(keys)
        todo: list[int] | range = range(len(keys))
        if if_absent:
            present = (await self._link.call_meta(rpc.Exists(keys=keys))).exists
            todo = [i for i, p in enumerate(present) if not p]
            ours = [i for i, p in enumerate(present) if p and keys[i] in tried] if tried else []
            if ours:  # present: maybe by the failed put's COMMIT
                earlier: list[Layout | None] = [tried[keys[i]] for i in ours] if tried else []
                await self._ours([keys[i] for i in ours], earlier, list(range(len(ours))))
                for i, found in zip(ours, earlier, strict=True):
                    out[i] = found
            if not todo:
                return out
            keys, views = [keys[i] for i in todo], [views[i] for i in todo]
            sizes = None if sizes is None else [sizes[i] for i in todo]
        mine = None if metas is None else [metas[i] for i in todo]
        done = await self._write(keys, views, replicas=replicas, ttl=ttl, sizes=sizes)
        try:
            written = await self._commit(keys, done, mine, ttl, if_absent)
        except KVFSError:
            if tried is not None:  # its COMMIT may have been applied: for the retry
                tried.update(zip(keys, done.layouts(0.0, None, mine), strict=True))
            raise
        if type(todo) is range:  # every key (not if_absent): no step per key
            return written
        for i, entry in zip(todo, written, strict=True):
            out[i] = entry
        return out

    async def _commit(self, keys: list[bytes], done: _Written, metas: list[bytes | None] | None,
                      ttl: float | None, if_absent: bool) -> list[Cached | None]:
        """:meth:`put`'s COMMIT of the values ``done`` appended."""
        written: list[Layout | None]
        if done.single:  # one extent per value: packed from columns, no layout built here
            h = await self.commit_packed(done.packed(keys, metas), len(keys), ttl, if_absent)
            if not h.present:
                return done.entries(h.created, h.expires_at, metas)
            written = cast(list[Layout | None], done.layouts(h.created, h.expires_at, metas))
            await self._ours(keys, written, h.present)
        else:
            tried = done.layouts(0.0, None, metas)
            written = await self.commit(keys, tried, ttl, if_absent=if_absent)
            if None in written:
                found = [i for i, lay in enumerate(written) if lay is None]
                written = [w if w is not None else t for w, t in zip(written, tried, strict=True)]
                await self._ours(keys, written, found)
        return cast(list[Cached | None], written)

    async def append(self, keys: list[bytes], views: Sequence[Source], *, replicas: int,
                     ttl: float | None, first: int | None = None) -> list[Layout]:
        """Write the values' bytes (not yet visible): placement, MAKE_ROOM when the
        cluster is full (again while its passes make room), and degraded writes: a server
        that cannot be reached is left out and the values are placed again on the live
        others (up to 3 tries).  Returns their layouts, to commit.
        ``first``: start at the live server of that index (mod their count, in id order)
        instead of a random draw, so the units of a stream go round-robin over the
        servers as stripes do (and, not knowing the whole value, its records say so)."""
        done = await self._write(keys, views, replicas=replicas, ttl=ttl, first=first)
        return done.layouts(0.0, None)

    async def _write(self, keys: list[bytes], views: Sequence[Source], *, replicas: int,
                     ttl: float | None, first: int | None = None,
                     sizes: list[int] | None = None) -> _Written:
        """:meth:`append`'s work; where the values went, for their layouts or packed columns."""
        if sizes is None:
            sizes = [nbytes(v) for v in views]
        asked = False
        failed: set[int] = set()  # servers this call could not reach: left out of its retries
        for attempt in range(3):
            known = await self._link.servers(refresh=attempt > 0)
            live = [s for s in known if s.usable and s.server_id not in failed]
            if len(live) < replicas:  # servers only marked down by this link, rather than none
                live += [s for s in known if s.alive and s.down and s.server_id not in failed]
            if len(live) < replicas:
                left_out = f" ({len(failed)} left out after failing this call)" if failed else ""
                raise Unavailable(f"{replicas} replicas need {replicas} live chunkservers; "
                                  f"{len(live)} are live{left_out}")
            if first is None:
                order = [s.server_id for s in order_by_free(live)]
            else:
                ids = sorted(s.server_id for s in live)
                k = first % len(ids)
                order = ids[k:] + ids[:k]
            try:
                return await self._append(keys, views, sizes, order, replicas, ttl,
                                          stream_unit=first is not None, failed=failed)
            except _SERVER_FAILED as exc:
                if attempt == 2:
                    raise
                log.info("a write failed on chunkservers %s (unreachable or a bad answer: %s): placing it again on the "
                         "others", sorted(failed), exc)
            except NoSpace:
                if asked or not self.config.evict_on_full or attempt == 2:
                    raise
                log.info("cluster full: asking meta to make room before retrying the write")
                made = await self._link.call_meta(rpc.MakeRoom())
                # a pass that freed room lets the write ask again should other writers take
                # that room first; one that freed none is the last
                asked = not made.freed
        raise AssertionError("unreachable")

    async def commit(self, keys: list[bytes], layouts: list[Layout], ttl: float | None, *,
                     if_absent: bool = False) -> list[Layout | None]:
        """Make written values visible: one COMMIT to meta (the linearisation point);
        returns the layouts as meta stamped them, None where ``if_absent`` found the key
        present (its appended bytes are garbage)."""
        h = await self.commit_packed(pack_layouts(keys, layouts), len(keys), ttl, if_absent)
        out: list[Layout | None] = [lay.stamped(h.created, h.expires_at) for lay in layouts]
        for i in h.present:
            out[i] = None
        return out

    async def commit_packed(self, packed: bytes, count: int, ttl: float | None,
                            if_absent: bool) -> rpc.Committed:
        """One COMMIT of ``count`` keys' packed layouts: with ``commit_group_bytes`` 0 (the
        default) sent at once; else committed as a group: sent at once
        when none of this writer's is in flight (a lone put waits for nothing more); else
        queued, and when the one in flight returns, the queue goes as one COMMIT
        (:meth:`_flush`; bench/RESULTS.md, "client group commit"): meta's cost per COMMIT (its
        WAL sync) is shared.  Returns meta's answer for these keys alone (``present``
        numbered in ``packed``), once they are committed; a merged COMMIT that fails
        fails each put it carried (one meta refused is sent again alone, so a put's bad
        item fails that put only)."""
        loop = asyncio.get_running_loop()
        limit = self.config.commit_group_bytes
        if self._committing is loop and len(packed) <= limit:
            fut: asyncio.Future[rpc.Committed] = loop.create_future()
            self._commit_queue.append(_Queued(packed, count, ttl, if_absent, fut))
            return await fut
        lead = self._committing is None and limit > 0
        if lead:
            self._committing = loop
        try:
            return await self._link.call_meta(rpc.Commit(packed=packed, ttl_s=ttl, if_absent=if_absent))
        finally:
            if lead:
                self._next_group()

    def _next_group(self) -> None:
        """The COMMIT in flight has returned: the queued ones of its options, up to
        ``commit_group_bytes`` (and a blob's keys), go as one (a task); the rest wait for it."""
        queue = [q for q in self._commit_queue if not q.future.done()]  # (a cancelled put's: dropped)
        if not queue:
            self._committing, self._commit_queue = None, []
            return
        first = queue[0]
        group: list[_Queued] = []
        rest: list[_Queued] = []
        size = keys = 0
        for q in queue:
            if (q.ttl == first.ttl and q.if_absent == first.if_absent
                    and size + len(q.packed) <= self.config.commit_group_bytes
                    and keys + q.keys <= MAX_PACKED_KEYS):
                group.append(q)
                size += len(q.packed)
                keys += q.keys
            else:
                rest.append(q)
        self._commit_queue = rest
        task = asyncio.ensure_future(self._flush(group))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self, group: list[_Queued]) -> None:
        """One COMMIT of the queued puts ``group`` (same ``ttl``/``if_absent``); each gets
        meta's answer for its own keys, or the error.  A merged COMMIT meta refused
        (answered with an error: nothing of it applied) is sent again put by put; one
        not answered (``Unavailable``: it may have been applied) fails them all, as it
        would each alone (their callers see what a failed COMMIT means for them)."""
        first = group[0]
        try:
            try:
                h = await self._link.call_meta(rpc.Commit(
                    packed=join_packed([q.packed for q in group]), ttl_s=first.ttl,
                    if_absent=first.if_absent))
            except KVFSError as exc:
                if len(group) == 1 or isinstance(exc, Unavailable):
                    raise
                for q in group:  # put by put: a put's bad item fails that put only
                    try:
                        answer = await self._link.call_meta(rpc.Commit(
                            packed=q.packed, ttl_s=q.ttl, if_absent=q.if_absent))
                    except KVFSError as one:
                        _settle(q.future, one)
                    else:
                        _settle(q.future, answer)
                return
            present = sorted(h.present)
            at = 0
            for q in group:
                end = at + q.keys
                mine = [i - at for i in present[bisect_left(present, at) : bisect_left(present, end)]]
                _settle(q.future, h if len(group) == 1 else rpc.Committed(
                    created=h.created, expires_at=h.expires_at, present=mine))
                at = end
        except Exception as exc:
            for q in group:  # never left waiting
                _settle(q.future, exc)
        except BaseException as exc:  # cancelled (its loop closing): the queue fails too, sent no more
            for q in [*group, *self._commit_queue]:
                _settle(q.future, Unavailable(f"a COMMIT was stopped ({exc!r})"))
            self._commit_queue = []
            raise
        finally:
            self._next_group()

    async def _ours(self, keys: list[bytes], written: list[Layout | None], present: list[int],
                    ) -> None:
        """Of the keys an ``if_absent`` COMMIT found present (``written[i]``: the layout this
        put tried), those holding this very value keep meta's layout; the others become None.
        A COMMIT is sent again when its connection was lost before the answer
        (:meth:`ClusterLink.call_meta`): meta applied the first try, so the second finds its
        keys present.  A value's extents name where its bytes were appended (chunk and
        offset), so meta's layout having this put's extents means this put committed it."""
        h = await self._link.call_meta(rpc.Lookup(keys=[keys[i] for i in present]))
        for i, now in zip(present, h.layouts, strict=True):
            tried = written[i]
            written[i] = now if now is not None and tried is not None \
                and now.extents == tried.extents else None

    def next_write_id(self) -> int:
        """Write ids order the writes of a key for a rebuild of meta: nanoseconds, increasing."""
        self._write_id = max(self._write_id + 1, time.time_ns())
        return self._write_id

    async def tombstones(self, keys: list[bytes]) -> list[list[Replica]]:
        """Record deletes in chunks before meta forgets the keys (:func:`write_tombstones`,
        on ``replicas`` servers); returns where each key's went, for DELETE."""
        return await write_tombstones(self._link, keys, self.config.replicas, self.next_write_id())

    async def _append(self, keys: list[bytes], views: Sequence[Source], sizes: list[int],
                      order: list[int], r: int, ttl: float | None, *, stream_unit: bool,
                      failed: set[int]) -> _Written:
        """Append every value (one APPEND per server); returns where each went.
        Servers that could not be reached (``Unavailable``) or answered against the protocol
        (:class:`rpc.BadAppendAnswer`: not one location per record) are added to ``failed``."""
        expires_hint = None if ttl is None else self._clock() + ttl
        wid = self.next_write_id()  # records carry it: a rebuild of meta keeps the newest write
        crc = crc32c.crc32c
        # per server: records and each record's buffers, in call order
        records: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
        parts: dict[int, list[Source]] = defaultdict(list)
        listed: set[int] = set()  # the servers given a value as a list of views (else flat ones)
        # per value: a value of one unit, its servers (place's tuple, shared by the values of a
        # run), with the index of its record in each server's APPEND in ``slots``, flat; a
        # larger (or empty) value, per unit (length, crc, [(server, index), ...]).  No
        # container per value of one unit: fewer objects for Python's cyclic GC to follow
        # while the call waits (bench/RESULTS.md, "GC-tracked objects on the put path")
        plans: Plans = []
        slots: list[int] = []
        crcs: list[int] = []
        placed = place(sizes, order, replicas=r, stripe_bytes=self.config.stripe_bytes,
                       group_bytes=self.config.put_group_bytes)
        last: tuple[int, ...] | None = None  # the run of values placed on the same servers
        into: list[tuple[list[tuple[Any, ...]], list[Source]]] = []  # its servers' lists
        columns = len(placed) == len(views) and _flat_units(placed, views)
        if columns:
            # the common case (every value one unit, in one flat buffer): the same records,
            # slots, plans and CRCs made a column at a time, by C loops, per run of values
            crcs = list(map(crc, cast("list[Buffer]", views)))
            total = repeat(0) if stream_unit else sizes
            heads_all = list(zip(keys, sizes, crcs, repeat(expires_hint), repeat(wid), total, crcs,
                                 repeat(0), repeat(False), strict=False))
            count = len(placed)
            # where each run of values placed on the same servers starts: one run (every value
            # on the same servers, the usual case; equal tuples of runs on one server's
            # cluster count as one run, which files the same records) found by one count in C
            starts = ([0] if placed.count(placed[0]) == count
                      else [0, *compress(range(1, count), map(is_not, placed[1:], placed))])
            for a, b in zip(starts, [*starts[1:], count], strict=True):
                at = []
                for sid in cast("tuple[int, ...]", placed[a]):
                    recs = records[sid]
                    at.append(range(len(recs), len(recs) + b - a))
                    recs.extend(heads_all[a:b])
                    parts[sid].extend(views[a:b])
                slots.extend(at[0] if len(at) == 1 else chain.from_iterable(zip(*at, strict=True)))
            plans = cast("Plans", placed)
        for key, v, n, servers in () if columns else zip(keys, views, sizes, placed, strict=True):
            if isinstance(servers, tuple):  # one unit, the whole value (the common case): one CRC
                if not isinstance(v, list):  # bytes or one flat view
                    c = crc(v, 0)
                else:
                    listed.update(servers)
                    c = 0
                    for p in v:
                        c = crc(p, c)
                # a stream's unit does not know its whole value (total size 0): a rebuild drops it.
                # A plain tuple of RecordHead's fields, in its order: the same msgpack array,
                # without the NamedTuple's Python constructor (about 1 us a key)
                head: tuple[Any, ...] = (key, n, c, expires_hint, wid, 0 if stream_unit else n, c, 0, False)
                if servers is not last:  # (place shares one tuple per run: looked up per run)
                    last, into = servers, [(records[sid], parts[sid]) for sid in servers]
                for recs, ps in into:
                    slots.append(len(recs))
                    recs.append(head)
                    ps.append(v)
                plans.append(servers)
                crcs.append(c)
                continue
            plan = []
            whole = 0
            heads: list[tuple[int, int]] = []  # (server, index) of this value's records
            listed.update(sid for unit in servers for sid in unit.servers)
            for ui, unit in enumerate(servers):
                u = cut(v, unit.start, unit.length)
                c = 0
                for p in u:
                    c = crc(p, c)
                # the whole value's CRC from its units' (each byte is summed once, not twice)
                whole = crc32c_combine(whole, c, unit.length) if ui else c
                head = rpc.RecordHead(key, unit.length, c, expires_hint, wid, 0 if stream_unit else n,
                                      0, ui)  # total_crc: set below, once every unit is summed
                where = []
                for sid in unit.servers:
                    recs = records[sid]
                    where.append((sid, len(recs)))
                    recs.append(head)
                    parts[sid].append(u)
                heads.extend(where)
                plan.append((unit.length, c, where))
            for sid, idx in heads:
                records[sid][idx] = rpc.RecordHead(*records[sid][idx])._replace(total_crc=whole)
            plans.append(plan)
            crcs.append(whole)
        locs: dict[int, list[rpc.Location]] = {}

        async def send_run(sid: int, run: range) -> list[rpc.Location]:
            recs, ps = records[sid], parts[sid]
            # gathered, never copied
            payload: list[Buffer] = (list(chain.from_iterable(map(_listed, ps[run.start : run.stop])))
                                     if sid in listed else cast(list[Buffer], ps[run.start : run.stop]))
            heads = cast(list[rpc.RecordHead], recs[run.start : run.stop])  # (tuples: same bytes)
            h, _ = await self._link.call_server(sid, rpc.Append(records=heads), payload)
            return h.one_per_record(len(heads), sid)

        async def send(sid: int) -> None:
            # APPENDs of at most max_rpc_bytes, all in flight at once: the server writes one
            # while it receives the next (bench/RESULTS.md, "large puts in APPENDs of 4 MiB")
            runs = split_batches(list(map(_LENGTH, records[sid])), max_bytes=self.config.max_rpc_bytes)
            if len(runs) == 1:
                locs[sid] = await send_run(sid, runs[0])
                return
            got = await asyncio.gather(*(send_run(sid, run) for run in runs), return_exceptions=True)
            for res in got:  # every APPEND of this server has ended: none is left running
                if isinstance(res, BaseException):
                    raise res
            locs[sid] = [loc for res in got for loc in cast(list[rpc.Location], res)]

        if len(records) == 1:  # one server (a small put's common case): no task to gather
            (sid,) = records
            try:
                await send(sid)
            except _SERVER_FAILED:
                failed.add(sid)
                raise
            return _Written(sizes, crcs, plans, slots, locs)
        results = await asyncio.gather(*(send(sid) for sid in records), return_exceptions=True)
        failed.update(sid for sid, res in zip(records, results, strict=True)
                      if isinstance(res, _SERVER_FAILED))
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return _Written(sizes, crcs, plans, slots, locs)


class _Queued(NamedTuple):
    """A put's COMMIT waiting for the one in flight (:meth:`WritePath.commit_packed`)."""

    packed: bytes
    keys: int  # how many
    ttl: float | None
    if_absent: bool
    future: asyncio.Future[rpc.Committed]


def _settle(fut: asyncio.Future[rpc.Committed], result: rpc.Committed | BaseException) -> None:
    """A queued COMMIT's answer or error, unless its put has gone (cancelled)."""
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


# values of one extent each (_Written._columns): per value its replica count; per replica, in
# value order, its server, chunk and offset
_Columns = tuple[list[int], list[int], Sequence[int], Sequence[int]]

# where each value went: per value of one unit, the tuple of its servers (the index of its
# record in each one's APPEND in _Written.slots); per larger value, per unit (length, crc,
# [(server, index of its record in that server's APPEND), ...])
Plans = list[tuple[int, ...] | list[tuple[int, int, list[tuple[int, int]]]]]


class _Written:
    """The values of one write, appended (not yet visible): their sizes, CRCs, where each unit
    went and the chunkservers' locations, made into layouts or, for values of one extent,
    into the COMMIT's packed columns directly (no layout object to build and then stamp)."""

    __slots__ = ("_cols", "crcs", "locs", "plans", "single", "sizes", "slots")

    def __init__(self, sizes: list[int], crcs: list[int], plans: Plans, slots: list[int],
                 locs: dict[int, list[rpc.Location]]) -> None:
        self.sizes, self.crcs, self.plans, self.slots, self.locs = sizes, crcs, plans, slots, locs
        self.single = not plans or _units(plans)  # every value one extent
        self._cols: _Columns | None = None

    def _replicas(self) -> Iterator[tuple[Replica, ...]]:
        """The replicas of each value of one unit (in value order; larger values skipped)."""
        locs, slots = self.locs, self.slots
        pos = 0
        for servers in self.plans:
            if not isinstance(servers, tuple):
                continue
            if len(servers) == 1:
                sid = servers[0]
                chunk, offset = locs[sid][slots[pos]]
                pos += 1
                yield (Replica(sid, chunk, offset),)
            else:
                yield tuple([Replica(sid, *locs[sid][slots[pos + j]]) for j, sid in enumerate(servers)])
                pos += len(servers)

    def _columns(self) -> _Columns:
        """Values of one extent each: per value its replica count; per replica, in value
        order, its server, chunk and offset.  Built by C loops (``map``, ``zip``), no Python
        step per value: the 4 KiB put's common case (bench/RESULTS.md, "the async client's
        put path")."""
        if self._cols is None:  # (made once: the COMMIT's columns and the layouts both use them)
            plans = cast(list[tuple[int, ...]], self.plans)
            only = self._one_server()
            if only is not None:  # its answer as it is: the records were the values, in order
                n = len(plans)
                nreps, server, where = [1] * n, [only] * n, self.locs[only]
            else:
                server = list(chain.from_iterable(plans))  # aligned with slots (one per replica)
                where = list(map(getitem, map(self.locs.__getitem__, server), self.slots))
                nreps = list(map(len, plans))
            chunk, offset = zip(*where, strict=True) if where else ((), ())
            self._cols = nreps, server, chunk, offset
        return self._cols

    def _one_server(self) -> int | None:
        """The server, when one server took every value, one replica each, and answered one
        location per value (a small put's common case: its records are the values in call
        order, so its answer is the values' locations as they are); else None."""
        plans = self.plans
        first = plans[0] if plans else None
        if (len(self.locs) != 1 or type(first) is not tuple or len(first) != 1
                or plans.count(first) != len(plans)):  # (the one tuple place shares: by identity, in C)
            return None
        sid = first[0]
        where = self.locs.get(sid)
        return sid if where is not None and len(where) == len(plans) else None

    def packed(self, keys: list[bytes], metas: list[bytes | None] | None) -> bytes:
        """The COMMIT's packed layouts (:func:`kvfs.packed.pack_single`), values of one extent."""
        return pack_single(keys, self.sizes, self.crcs, *self._columns(), metas)

    def entries(self, created: float, expires_at: float | None,
                metas: list[bytes | None] | None = None) -> list[Cached | None]:
        """What the layout cache keeps of the values (:meth:`layouts` stamped so): when each
        is one extent with one replica, a :class:`~kvfs.layoutcache.Single` each, made by
        ``map`` in C from the columns the COMMIT was packed from (its Layout is built only
        when a read asks); else their layouts."""
        if self.single:
            nreps, server, chunk, offset = self._columns()
            if len(server) == len(nreps):  # one replica each
                return list(map(Single, self.sizes, self.crcs, server, chunk, offset, repeat(created),
                                repeat(expires_at), repeat(None) if metas is None else metas))
        return cast(list[Cached | None], self.layouts(created, expires_at, metas))

    def layouts(self, created: float, expires_at: float | None,
                metas: list[bytes | None] | None = None) -> list[Layout]:
        """The values' layouts, stamped ``created``/``expires_at``, with ``metas[i]``."""
        meta_of: Iterable[bytes | None] = repeat(None) if metas is None else metas
        if self.single:
            nreps, server, chunk, offset = self._columns()
            if len(server) == len(nreps):  # one replica each: every object made by map, in C
                reps: Iterable[tuple[Replica, ...]] = zip(map(Replica, server, chunk, offset))
            else:
                reps = self._replicas()
            sizes, crcs = self.sizes, self.crcs
            return list(map(Layout, sizes, crcs, repeat(created), repeat(expires_at),
                            zip(map(Extent, sizes, crcs, reps)), meta_of))
        out: list[Layout] = []
        locs, small = self.locs, self._replicas()
        for n, plan, whole, m in zip(self.sizes, self.plans, self.crcs, meta_of, strict=False):
            if isinstance(plan, tuple):
                out.append(Layout(n, whole, created, expires_at, (Extent(n, whole, next(small)),), m))
                continue
            out.append(Layout(n, whole, created, expires_at, tuple(
                Extent(length, c, tuple(Replica(sid, *locs[sid][idx]) for sid, idx in where))
                for length, c, where in plan), m))
        return out


async def write_tombstones(link: ClusterLink, keys: list[bytes], replicas: int, write_id: int,
                           ) -> list[list[Replica]]:
    """Tombstone records of ``keys`` (one APPEND of empty records per server, on ``replicas``
    servers or as many as are live, chosen by free space), so a rebuild of meta from the
    chunks keeps them deleted; returns where each key's went (meta keeps them:
    :mod:`kvfs.meta.tombstones`).  Raises when no server took them: the caller then removes
    nothing.  A client's delete writes them (:meth:`WritePath.tombstones`), and the GC before
    it drops a key with an older record (:meth:`kvfs.gc.driver.GarbageCollector.expire`)."""
    live = [s for s in await link.servers() if s.usable]
    if not live:
        raise Unavailable(f"no live chunkserver to record the tombstones of {len(keys)} deleted "
                          "keys on: nothing was deleted")
    targets = [s.server_id for s in order_by_free(live)[: max(1, replicas)]]
    recs = [rpc.RecordHead(k, 0, 0, None, write_id, 0, 0, 0, True) for k in keys]
    results = await asyncio.gather(*(link.call_server(sid, rpc.Append(records=recs)) for sid in targets),
                                   return_exceptions=True)
    out: list[list[Replica]] = [[] for _ in keys]
    errors: list[BaseException] = []
    for sid, res in zip(targets, results, strict=True):
        if isinstance(res, BaseException):
            errors.append(res)
            continue
        try:
            locations = res[0].one_per_record(len(keys), sid, "tombstones")
        except rpc.BadAppendAnswer as bad:  # that server's tombstones unknown: as if refused
            errors.append(bad)
            continue
        for where, loc in zip(out, locations, strict=True):
            where.append(Replica(sid, *loc))
    for exc in errors:
        if not isinstance(exc, KVFSError) or not out[0]:
            raise exc
        log.warning("a delete's tombstones reached %d of %d chunkservers: %s", len(out[0]),
                    len(targets), exc)
    return out
