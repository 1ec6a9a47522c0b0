"""The write path: placement -> one APPEND per chunkserver -> one COMMIT to meta.

Values are placed by :func:`kvfs.placement.place`; each server gets all its records
in one APPEND (split past ``max_rpc_bytes``), the payload being the callers'
memoryviews, never re-packed.  The COMMIT of every layout in one transaction is the
linearisation point.  A server refusing for lack of space (``NoSpace``) makes the
writer ask meta to make room (``MAKE_ROOM``: meta runs one GC pass) and retry once;
the client itself never runs GC.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable

import crc32c

from kvfs import rpc
from kvfs._batch import byte_batches
from kvfs.cluster import ClusterLink
from kvfs.config import ClientConfig
from kvfs.errors import NoSpace, Unavailable
from kvfs.layout import Extent, Layout, Replica
from kvfs.placement import order_by_free, place

log = logging.getLogger("kvfs.client")


class WritePath:
    """Writes values for :class:`kvfs.client.AsyncClient`; ``clock()`` gives the
    expiry hint stored in each record."""

    def __init__(self, link: ClusterLink, config: ClientConfig, clock: Callable[[], float]) -> None:
        self._link = link
        self.config = config
        self._clock = clock

    async def put(self, keys: list[bytes], views: list[memoryview], *, replicas: int,
                  ttl: float | None) -> list[Layout]:
        """Store the values; returns their committed layouts (stamped by meta)."""
        layouts: list[Layout] | None = None
        asked = False
        for attempt in range(3):
            live = [s for s in await self._link.servers(refresh=attempt > 0) if s.alive]
            if len(live) < replicas:
                raise Unavailable(f"{replicas} replicas need {replicas} live chunkservers; "
                                  f"{len(live)} are live")
            order = [s.server_id for s in order_by_free(live)]
            try:
                layouts = await self._append(keys, views, order, replicas, ttl)
                break
            except Unavailable:
                if attempt == 2:
                    raise
            except NoSpace:
                if asked or not self.config.evict_on_full:
                    raise
                log.info("cluster full: asking meta to make room before retrying the write")
                await self._link.call_meta(rpc.MakeRoom())
                asked = True
        assert layouts is not None
        h = await self._link.call_meta(rpc.Commit(
            items=[rpc.CommitItem(k, lay) for k, lay in zip(keys, layouts, strict=True)], ttl_s=ttl))
        return [lay.stamped(h.created, h.expires_at) for lay in layouts]

    async def _append(self, keys: list[bytes], views: list[memoryview], order: list[int],
                      r: int, ttl: float | None) -> list[Layout]:
        """Append every value (one APPEND per server); returns the layouts to commit."""
        expires_hint = None if ttl is None else self._clock() + ttl
        crc = crc32c.crc32c
        # per server: records and payload parts, in call order
        records: dict[int, list[rpc.RecordHead]] = defaultdict(list)
        parts: dict[int, list[memoryview]] = defaultdict(list)
        # per value and unit: (length, crc, [(server, index into records[server]), ...])
        plans: list[list[tuple[int, int, list[tuple[int, int]]]]] = []
        crcs: list[int] = []
        placed = place([v.nbytes for v in views], order, replicas=r,
                       stripe_bytes=self.config.stripe_bytes, group_bytes=self.config.put_group_bytes)
        for key, v, units in zip(keys, views, placed, strict=True):
            plan = []
            whole = 0
            for unit in units:
                u = v if len(units) == 1 else v[unit.start : unit.start + unit.length]
                c = crc(u)
                whole = c if len(units) == 1 else crc(u, whole)
                head = rpc.RecordHead(key, unit.length, c, expires_hint)
                where = []
                for sid in unit.servers:
                    recs = records[sid]
                    where.append((sid, len(recs)))
                    recs.append(head)
                    parts[sid].append(u)
                plan.append((unit.length, c, where))
            plans.append(plan)
            crcs.append(whole)
        locs: dict[int, list[rpc.Location]] = {}

        async def send(sid: int) -> None:
            out: list[rpc.Location] = []
            recs, ps = records[sid], parts[sid]
            for run in byte_batches([p.nbytes for p in ps], self.config.max_rpc_bytes):
                h, _ = await self._link.call_server(sid, rpc.Append(records=recs[run.start : run.stop]),
                                                    ps[run.start : run.stop])
                out.extend(h.locations)
            locs[sid] = out

        results = await asyncio.gather(*(send(sid) for sid in records), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return [Layout(v.nbytes, whole, 0.0, None, tuple(
                    Extent(length, c, tuple(Replica(sid, *locs[sid][idx]) for sid, idx in where))
                    for length, c, where in plan))
                for v, plan, whole in zip(views, plans, crcs, strict=True)]
