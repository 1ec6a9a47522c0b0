"""Meta's index in a shared store (``kvfs meta --store redis-cluster://...``): the meta
process keeps no keys, so several can serve one store at once.

Every key RPC is one call to the store (:mod:`kvfs.meta.redis_store`: one round trip per
involved Redis master).  The chunkserver registry is written through as well: a
registration stores the server's address, every heartbeat its reported space and the
wall-clock time it arrived.  Each meta reads them again every ``registry_refresh_s``
(and at once when a commit names a server it does not know), so a meta that no
chunkserver reports to still knows which servers are alive: a heartbeat counts from when
any meta received it, so the meta hosts' clocks must agree to well within
``heartbeat_timeout_s``.

Garbage collection is the same :class:`kvfs.meta.gc.MetaGc` as over SQLite, working on
this index's GC calls (:class:`kvfs.meta.storeapi.GcIndex`): each destructive one is a
compare-and-swap in one Lua script per master, so the GCs of several metas never undo
each other's work nor a writer's.  Their daemons take turns by a lease key in the store
(``claim``).  A chunkserver's chunk table lives in the memory of the metas it (or a GC
pass's usage sync) reports to.  Nothing reads every key: ``kvfs stat`` reads the store's
counters, a compaction's chunk references, a repair plan and a drain its chunk and server
indexes, and ``kvfs gc status`` and the dry runs its expiry index.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Iterable, Sequence
from typing import Any

from kvfs.config import MetaConfig
from kvfs.errors import Unavailable
from kvfs.layout import Layout
from kvfs.meta.index import CommitCheck, ServerInfo, ServerRegistry
from kvfs.meta.redis_store import RedisMetaStore
from kvfs.meta.repair import readable
from kvfs.meta.storeapi import Lease

log = logging.getLogger("kvfs.meta")

MAX_ID_CLAIMS = 100  # a register racing this many others for the next id gives up
LEASES_IGNORED = 1e18  # an eviction "now" past every lease


class SharedIndex(ServerRegistry):
    def __init__(self, config: MetaConfig, store: RedisMetaStore, clock: Callable[[], float]) -> None:
        super().__init__(config, clock)
        self.store = store
        self._stored: set[int] = set()  # server ids in the store at the last refresh

    async def open(self) -> None:
        await self.store.open()
        await self.refresh()
        log.info("meta on %s: %d keys, %d chunkservers", self.config.store,
                 await self.store.count(), len(self.servers))

    async def close(self) -> None:
        await self.store.close()  # writes the buffered access times first

    async def flush(self) -> None:
        await self.store.flush_access()

    @property
    def leases_overflowed(self) -> int:
        """Leases this meta gave the overflow holder since it started (STATS)."""
        return self.store.leases_overflowed

    # registry ------------------------------------------------------------------------
    async def save_server(self, s: ServerInfo, *, registered: bool) -> None:
        await self.store.put_server(s.server_id, s.addr, s.reported_capacity, s.reported_free, s.key)
        await self.store.put_seen(s.server_id, time.time())

    async def new_server_id(self, addr: str, taken: Iterable[int] = ()) -> int:
        """The next free id (past ``taken`` too), claimed in the store, so two metas
        registering new servers at once never give out the same one."""
        taken = set(taken)
        for _ in range(MAX_ID_CLAIMS):
            sid = max((*self.servers, *taken), default=0) + 1
            if await self.store.claim_server(sid, addr):
                return sid
            await self.refresh()  # another meta took it
        raise Unavailable(f"no free chunkserver id after {MAX_ID_CLAIMS} tries (registrations racing)")

    async def refresh(self) -> None:
        rows, seen = await self.store.registry()
        wall, mono = time.time(), time.monotonic()
        stored = {r[0] for r in rows}
        for sid in self._stored - stored:  # forgotten (decommissioned) through another meta
            self.servers.pop(sid, None)
        self._stored = stored
        for sid, addr, capacity, free, key in rows:
            s = self.servers.get(sid)
            if s is None:
                s = self.servers[sid] = ServerInfo(sid, addr)
            s.addr, s.reported_capacity, s.reported_free = addr, capacity, free
            s.key = s.key or key  # a restarted meta: which data dir owns the id
            t = seen.get(sid)
            if t is not None:
                s.last_heartbeat = max(s.last_heartbeat, mono - max(0.0, wall - t))
        self.share_disks()

    # keys ----------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[bytes], now: float,
                     lease: Lease | None = None) -> list[Layout | None]:
        return await self.store.lookup(keys, now, lease)

    async def release(self, keys: Sequence[bytes], holder: str) -> int:
        return await self.store.release(keys, holder)

    async def touch(self, keys: Sequence[bytes], now: float) -> None:
        await self.store.touch(keys, now)

    async def exists(self, keys: Sequence[bytes], now: float,
                     lease: Lease | None = None) -> list[bool]:
        gone = self.gone_servers()
        if not gone:
            return await self.store.exists(keys, now, lease)
        out = [lay is not None and readable(lay, gone) for lay in await self.store.peek(keys, now)]
        if lease is not None:
            await self.store.lease([k for k, ok in zip(keys, out, strict=True) if ok], now, lease)
        return out

    async def match_prefix(self, keys: Sequence[bytes], now: float, lease: Lease | None) -> int:
        gone = self.gone_servers()
        if not gone:
            return await self.store.match_prefix(keys, now, lease)
        n = 0
        for lay in await self.store.peek(keys, now):
            if lay is None or not readable(lay, gone):
                break
            n += 1
        if lease is not None and n:
            n = await self.store.match_prefix(keys[:n], now, lease)
        return n

    async def commit(self, staged: Sequence[tuple[bytes, Layout]], now: float,
                     expires_at: float | None, check: CommitCheck | None = None, *,
                     if_absent: bool = False, chunks: Collection[int] | None = None) -> list[int]:
        """As :meth:`kvfs.meta.index.MetaIndex.commit` (the store refuses a retired chunk
        itself: StaleLayout; ``chunks`` goes unused).  With ``if_absent`` and dead servers, a
        key whose stored value is unreadable (an extent with every replica on them) counts as
        absent: it is overwritten without the condition (a commit racing that overwrite may
        lose its value, each writer told it wrote)."""
        if check is not None:
            check(staged)
        gone = self.gone_servers() if if_absent else set()
        if not gone:
            return await self.store.commit(staged, now, if_absent=if_absent)
        cur = await self.store.peek([k for k, _ in staged], now)
        dead = {k for (k, _), lay in zip(staged, cur, strict=True)
                if lay is not None and not readable(lay, gone)}
        over = [i for i, (k, _) in enumerate(staged) if k in dead]
        rest = [i for i, (k, _) in enumerate(staged) if k not in dead]
        await self.store.commit([staged[i] for i in over], now)
        present = await self.store.commit([staged[i] for i in rest], now, if_absent=True)
        return [rest[j] for j in present]

    async def delete(self, keys: Sequence[bytes], tombstones: Sequence[Layout] = ()) -> int:
        """``tombstones`` are not kept (:mod:`kvfs.meta.tombstones` is SQLite's; README, "No
        tombstones on Redis"): GC may reclaim a tombstone's chunk before an older record of
        the key.  What tombstones protect is a rebuild from chunk records; a Redis store
        recovers by its own persistence and replicas, and a tombstone's drop rule needs
        every chunkserver's chunk table, which lives in each meta's memory."""
        return len(await self.store.delete(keys))

    async def drop_lost(self, rows: Sequence[tuple[bytes, Layout]]) -> int:
        """Remove each key that still has the given layout (the store's compare-and-delete;
        a lease does not keep a lost value)."""
        return len(await self.store.evict(rows, LEASES_IGNORED))

    async def list_keys(self, prefix: bytes, start_after: bytes | None,
                        limit: int) -> list[tuple[bytes, Layout]]:
        return await self.store.list(prefix, start_after, limit)

    async def live_bytes(self, chunks: Sequence[int] | None = None) -> dict[int, int]:
        return await self.store.chunk_live(chunks)

    async def server_live(self) -> dict[int, int]:
        """From the store's per-bucket counters of each server's live bytes (every chunk of
        the server that layouts name, whether or not this meta has its chunk table)."""
        return await self.store.server_live(self.servers)

    async def peek(self, keys: Sequence[bytes], now: float) -> list[Layout | None]:
        return await self.store.peek(keys, now)

    # GC's operations (storeapi.GcIndex) ------------------------------------------------
    async def refs(self, chunks: Collection[int] = (), servers: Collection[int] = (),
                   ) -> AsyncGenerator[list[tuple[bytes, Layout]], None]:
        async with contextlib.aclosing(self.store.refs(chunks, servers)) as walk:  # (closed early too)
            async for rows in walk:
                yield rows

    async def expired_rows(self, now: float) -> AsyncIterator[list[tuple[bytes, Layout]]]:
        async for rows in self.store.expired_rows(now):
            yield rows

    async def lru_order(self, batch: int = 1000, after: tuple[float, bytes] | None = None,
                        ) -> AsyncIterator[list[tuple[bytes, Layout, float]]]:
        """Least recently used first, by the access times in the store: this meta's buffered
        ones are written first; another meta's reach it within its ``access_flush_interval_s``
        (until then a key it served counts as read when it last flushed)."""
        await self.store.flush_access()
        while True:
            page = await self.store.lru(batch, after)
            if not page:
                return
            after = (page[-1][1], page[-1][0])
            keys = [k for k, _ in page]
            yield [(k, lay, t) for (k, t), lay in zip(page, await self.store.get(keys), strict=True)
                   if lay is not None]
            if len(page) < batch:
                return

    async def layouts(self, keys: Sequence[bytes]) -> list[Layout | None]:
        return await self.store.get(keys)

    async def leased(self, keys: Sequence[bytes], now: float) -> set[bytes]:
        return {k for k, until in (await self.store.leases(keys)).items() if until > now}

    async def expire(self, now: float, limit: int) -> tuple[list[tuple[bytes, Layout]], bool,
                                                            list[tuple[bytes, Layout]]]:
        keys = await self.store.expired(now, limit)
        return await self.store.remove_expired(keys, now), len(keys) == limit, []

    async def chunks_deleted(self, chunks: Collection[int]) -> None:
        """Nothing to forget: no older records are tracked here (see :meth:`shadowed`)."""

    async def ghost_copies(self, copies: Iterable[tuple[bytes, int]]) -> None:
        """Nothing to track (see :meth:`shadowed`)."""

    async def shadowed(self, keys: Iterable[bytes], now: float) -> set[bytes]:
        """None: the Redis store keeps no tombstones (see :meth:`delete`), so it tracks no
        older records either; the GC drops every key without one."""
        return set()

    async def drop_tombstoned(self, rows: Sequence[tuple[bytes, Layout, Layout]], now: float, *,
                              evict: bool) -> list[tuple[bytes, Layout]]:
        """As :meth:`evict` (``evict``) or an expiry of the keys still expired; the tombstones
        are not kept (see :meth:`delete`)."""
        if evict:
            return await self.evict([(k, lay) for k, lay, _ in rows], now)
        return await self.store.remove_expired([k for k, _, _ in rows], now)

    async def evict(self, victims: Sequence[tuple[bytes, Layout]], now: float) -> list[tuple[bytes, Layout]]:
        # an expired key's lease keeps nothing: evict it as if unleased
        expired = [(k, lay) for k, lay in victims if lay.expired(now)]
        rest = [(k, lay) for k, lay in victims if not lay.expired(now)]
        out = await self.store.evict(expired, LEASES_IGNORED) if expired else []
        return out + (await self.store.evict(rest, now) if rest else [])

    async def switch(self, rows: Sequence[tuple[bytes, Layout, Layout]]) -> list[bool]:
        return await self.store.switch(rows) if rows else []

    async def retire(self, server_id: int, chunks: Sequence[int], now: float) -> list[int]:
        return await self.store.retire(server_id, chunks, now)

    async def retired_among(self, chunks: Iterable[int]) -> set[int]:
        return await self.store.retired_among(chunks)

    async def retired_count(self) -> int:
        return await self.store.retired_count()

    async def delete_server(self, server_id: int) -> None:
        self.servers.pop(server_id, None)
        await self.store.delete_server(server_id)

    # tombstones: the Redis store keeps none (a rebuild from chunk records is SQLite's)
    async def tombstone_refs(self, chunks: Collection[int]) -> tuple[list[tuple[int, bytes, int]], int]:
        return [], 0

    async def tombstoned(self, keys: Iterable[bytes]) -> set[bytes]:
        return set()

    async def relocate_tombstones(self, sid: int, new_chunk: int,
                                  by_key: dict[bytes, dict[tuple[int, int], int]]) -> tuple[set[bytes], int]:
        return set(), 0

    async def raise_horizons(self, copies: Iterable[tuple[bytes, int]]) -> None:
        pass

    async def drop_passed(self) -> int:
        return 0

    async def get_state(self, name: str) -> Any:
        return await self.store.get_state(name)

    async def put_state(self, name: str, value: Any) -> None:
        await self.store.put_state(name, value)

    async def add_counts(self, inc: dict[str, float], put: dict[str, float] | None = None) -> None:
        await self.store.add_counts(inc, put)

    async def counts(self) -> dict[str, float]:
        return await self.store.counts()

    async def claim(self, name: str, holder: str, ttl_s: float) -> bool:
        return await self.store.claim(name, holder, ttl_s)

    async def key_stats(self, now: float) -> tuple[int, int, int]:
        return await self.store.key_stats(now)
