"""Meta's RPC handlers for clients and chunkservers, over an index.

The index is :class:`MetaIndex` (every key in memory over SQLite, the default) or, with
``--store redis-cluster://...``, :class:`SharedIndex` (no key in this process; several
metas serve one store).  The GC's handlers live in the :class:`MetaGc` component,
handed the same index (both are a :class:`kvfs.meta.storeapi.GcIndex`); one
:class:`RpcServer` dispatches to both.  The index's invariants are in
:mod:`kvfs.meta.index`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvfs import rpc
from kvfs.address import parse_addr, service_tokens
from kvfs.config import MetaConfig
from kvfs.datadir import DirLock, private_dir, raise_nofile_limit
from kvfs.errors import InvalidArgument, Unavailable, WrongCluster
from kvfs.handshake import Role
from kvfs.layout import Layout, misfiled, misfiled_why
from kvfs.meta.gc import MetaGc, tombstone_layouts
from kvfs.meta.index import MetaIndex, ServerInfo
from kvfs.meta.localstore import KINDS, chosen_kind, open_local, store_bytes
from kvfs.meta.storeapi import Lease
from kvfs.packed import unpack as unpack_layouts
from kvfs.rpc import Service
from kvfs.server import Reply, RpcServer

if TYPE_CHECKING:
    from kvfs.meta.shared_index import SharedIndex

log = logging.getLogger("kvfs.meta")

T = TypeVar("T")


async def _answer(make: Callable[[T], rpc.Response], call: Callable[[], Awaitable[T]]) -> Reply:
    """The answer ``make`` makes of what ``call()`` gives, once it does (called in the
    request's task: one cancelled before its first step never starts the call)."""
    return make(await call()), ()


class MetaService:
    def __init__(self, config: MetaConfig, *, clock: Callable[[], float] = time.time,
                 tokens: Mapping[Role, str] | None = None) -> None:
        self.config = config
        self.clock = clock
        private_dir(config.data)
        self.lock = DirLock(config.data, "meta").acquire()
        raise_nofile_limit()
        self.tokens = dict(tokens) if tokens else service_tokens(config.data, create=True)
        self.index: MetaIndex | SharedIndex
        self.local: MetaIndex | None = None  # the index, where it is in this process's memory
        if config.store is None or config.store in KINDS:
            self.store_kind = chosen_kind(config.data, config.store)
            self.store = open_local(config.data, self.store_kind,
                                    synchronous="NORMAL" if config.fsync == "never" else "FULL",
                                    memtable_bytes=config.rocksdb_memtable_bytes)
            self.cluster_id = self.store.cluster_id()
            self.index = MetaIndex(config, self.store, clock)
            self.index.load()
            self.local = self.index
        else:  # opened by start(): the store is async; redis is an optional extra
            self.store_kind = "redis-cluster"
            from kvfs.meta.redis_store import RedisMetaStore
            from kvfs.meta.shared_index import SharedIndex

            store = RedisMetaStore(config.store, namespace=config.store_namespace,
                                   timeout_s=config.store_timeout_s)
            self.index = SharedIndex(config, store, clock)
            self.cluster_id = ""
        self.gc = MetaGc(self.index)
        self.rpc = RpcServer([self, self.gc], Service.META, self.tokens, config)
        self._bg: list[asyncio.Task[None]] = []
        self._closing = False  # (the background loops end at their next look: _every)

    # lifecycle ---------------------------------------------------------------
    async def start(self) -> str:
        host, port = parse_addr(self.config.listen, what="listen address")
        loop = asyncio.get_running_loop()
        if not isinstance(self.index, MetaIndex):
            await self.index.open()
            self.cluster_id = await self.index.store.cluster_id()
            self._bg.append(loop.create_task(self._every(self.config.registry_refresh_s, self._refresh)))
        await self.gc.refresh()
        host, port = await self.rpc.start(host, port)
        self._bg.append(loop.create_task(self._every(self.config.access_flush_interval_s,
                                                     self.index.flush)))
        addr = f"kvfs://{host}:{port}"
        self.gc.home = (addr, self.tokens[Role.ADMIN])
        return addr

    async def close(self) -> None:
        self._closing = True
        for t in self._bg:
            t.cancel()
        for t in self._bg:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.gc.close()
        await self.rpc.close()
        await self.index.close()
        self.lock.release()

    async def _every(self, period_s: float, step: Callable[[], Awaitable[None]]) -> None:
        """``step()`` every ``period_s`` until :meth:`close`, which cancels it.  A step may
        swallow that cancellation (a Redis call did once, seen as ``Unavailable``, which the
        loop suppresses: a teardown hung for good): the loop then ends at its next look at
        ``_closing``, where it would sleep and step again for ever, and close() with it."""
        while not self._closing:
            await asyncio.sleep(period_s)
            if self._closing:
                return
            with contextlib.suppress(Unavailable):
                await step()

    async def _refresh(self) -> None:
        await self.index.refresh()
        await self.gc.refresh()  # decommissions started through another meta

    # client RPCs -------------------------------------------------------------
    async def rpc_ping(self, req: rpc.Ping, payload: memoryview) -> Reply:
        return rpc.Pong(service="meta"), ()

    def _holder(self, holder: str) -> str:
        """A request's lease holder, refused past ``max_lease_holder_chars``."""
        limit = self.config.max_lease_holder_chars
        if len(holder) > limit:
            raise InvalidArgument(f"lease holder {holder[:64]!r} is {len(holder)} characters, longer "
                                  f"than this meta's limit of {limit} (--max-lease-holder-chars)")
        return holder

    def _lease(self, now: float, lease_s: float | None, holder: str) -> Lease | None:
        """The lease a lookup asked for: ``lease_s`` seconds from ``now``, ``holder``'s (None:
        none asked)."""
        holder = self._holder(holder)
        return Lease(holder, now + lease_s, self.config.max_lease_holders) if lease_s else None

    # The key queries (LOOKUP, EXISTS, MATCH_PREFIX, RELEASE, TOUCH): answered
    # at once by the index in this process's memory, so the server writes the answer in
    # the step that read the request, with no task per request (a LOOKUP with dirs whose
    # misses must be looked for under ``key/`` excepted); a shared store's index answers
    # them through an awaitable.
    def rpc_lookup(self, req: rpc.Lookup, payload: memoryview) -> Reply | Awaitable[Reply]:
        now = self.clock()
        lease = self._lease(now, req.lease_s, req.holder)
        if self.local is None:
            return self._lookup(req, now, lease)
        layouts = self.local.lookup_now(req.keys, now, lease)
        if not req.dirs:
            return rpc.Layouts(layouts=layouts), ()
        if None not in layouts:  # (a mount's LOOKUP of files) no miss: no directory to look for
            return rpc.Layouts(layouts=layouts, dirs=[False] * len(layouts)), ()
        return self._dirs(req.keys, layouts, now)

    async def _lookup(self, req: rpc.Lookup, now: float, lease: Lease | None) -> Reply:
        layouts = await self.index.lookup(req.keys, now, lease)
        if not req.dirs:
            return rpc.Layouts(layouts=layouts), ()
        return await self._dirs(req.keys, layouts, now)

    async def _dirs(self, keys: Sequence[bytes], layouts: list[Layout | None], now: float) -> Reply:
        """``layouts`` with, for each miss, whether it is a directory (keys under ``key/``)."""
        dirs = [lay is None and await self._has_under(k + b"/", now)
                for k, lay in zip(keys, layouts, strict=True)]
        return rpc.Layouts(layouts=layouts, dirs=dirs), ()

    async def _has_under(self, prefix: bytes, now: float) -> bool:
        """Whether an unexpired key starts with ``prefix``."""
        after = None
        while True:
            rows = await self.index.list_keys(prefix, after, 64)
            if any(not lay.expired(now) for _, lay in rows):
                return True
            if len(rows) < 64:
                return False
            after = rows[-1][0]

    def rpc_release(self, req: rpc.Release, payload: memoryview) -> Reply | Awaitable[Reply]:
        holder = self._holder(req.holder)
        if self.local is not None:
            return rpc.Released(released=self.local.release_now(req.keys, holder)), ()
        return _answer(lambda n: rpc.Released(released=n), lambda: self.index.release(req.keys, holder))

    def rpc_touch(self, req: rpc.Touch, payload: memoryview) -> Reply | Awaitable[Reply]:
        if self.local is not None:
            self.local.touch_now(req.keys, self.clock())
            return rpc.Empty(), ()
        return _answer(lambda _: rpc.Empty(), lambda: self.index.touch(req.keys, self.clock()))

    async def rpc_report_lost(self, req: rpc.ReportLost, payload: memoryview) -> Reply:
        n = await self.index.drop_lost([(it.key, it.layout) for it in req.items])
        if n:
            await self.index.add_counts({"keys_lost": n})  # (kvfs gc status: metrics)
            log.warning("dropped %d keys a reader found lost (every replica corrupt or gone), "
                        "e.g. %r", n, req.items[0].key[:64])
        return rpc.LostDropped(dropped=n), ()

    def rpc_exists(self, req: rpc.Exists, payload: memoryview) -> Reply | Awaitable[Reply]:
        now = self.clock()
        lease = self._lease(now, req.lease_s, req.holder)
        if self.local is not None:
            return rpc.Existing(exists=self.local.exists_now(req.keys, now, lease)), ()
        return _answer(lambda e: rpc.Existing(exists=e), lambda: self.index.exists(req.keys, now, lease))

    def rpc_match_prefix(self, req: rpc.MatchPrefix, payload: memoryview) -> Reply | Awaitable[Reply]:
        now = self.clock()
        lease = self._lease(now, req.lease_s, req.holder)
        if self.local is not None:
            return rpc.Matched(n=self.local.match_prefix_now(req.keys, now, lease)), ()
        return _answer(lambda n: rpc.Matched(n=n), lambda: self.index.match_prefix(req.keys, now, lease))

    async def rpc_commit(self, req: rpc.Commit, payload: memoryview) -> Reply:
        ix = self.index
        ttl = self.config.default_ttl_s if req.ttl_s is None else req.ttl_s
        now = self.clock()
        expires_at = None if ttl is None else now + float(ttl)
        staged: Sequence[tuple[bytes, Layout]]
        if req.packed is not None:  # checked and built a column at a time (kvfs.packed)
            # a COMMIT the local index writes in parts: each part's layouts built as it is queued
            lazy = None if self.local is None else self.local.config.commit_group_max_keys
            batch = unpack_layouts(req.packed, now, expires_at, lazy_over=lazy)
            staged, named, max_meta = batch.staged, batch.servers, batch.max_meta
            chunks: Collection[int] | None = batch.chunks
        else:
            chunks = None  # (the index walks the layouts for its retired-chunk check)
            named = frozenset(r.server_id for _, wire in req.items for e in wire.extents
                              for r in e.replicas)
            for key, wire in req.items:
                if (r := misfiled(wire)) is not None:
                    raise InvalidArgument(f"layout for {key[:64]!r}: {misfiled_why(r.server_id, r.chunk_id)}")
            max_meta = max((len(w.meta) for _, w in req.items if w.meta is not None), default=0)
            staged = [(key, wire.stamped(now, expires_at)) for key, wire in req.items]
        if not named <= ix.servers.keys():
            await ix.refresh()  # registered with another meta sharing the store?
        limit = self.config.max_key_meta_bytes
        if max_meta > limit:
            key, lay = next((k, lay) for k, lay in staged if lay.meta is not None and len(lay.meta) > limit)
            assert lay.meta is not None
            raise InvalidArgument(f"metadata of {len(lay.meta)} bytes for key {key[:64]!r} is "
                                  f"larger than this meta's limit of {limit} (--max-key-meta)")

        def check(staged: Sequence[tuple[bytes, Layout]]) -> None:
            if not named <= self.index.servers.keys():  # (the common case costs one set test)
                self._check_commit(staged)

        present = await ix.commit(staged, now, expires_at, check, if_absent=req.if_absent, chunks=chunks)
        return rpc.Committed(created=now, expires_at=expires_at, present=present), ()

    def _check_commit(self, staged: Sequence[tuple[bytes, Layout]]) -> None:
        """Every layout names registered chunkservers (run by the index in the step that
        writes the commit, where it also refuses a retired chunk: StaleLayout)."""
        servers = self.index.servers
        for key, lay in staged:
            for e in lay.extents:
                for r in e.replicas:
                    if r.server_id not in servers:
                        raise InvalidArgument(f"layout for {key[:64]!r} names unknown chunkserver {r.server_id}")

    async def rpc_delete(self, req: rpc.Delete, payload: memoryview) -> Reply:
        """Tombstones (where the client wrote them) are checked like a commit's layouts;
        meta keeps those of the keys it removes (:mod:`kvfs.meta.tombstones`)."""
        keys, where = req.keys, req.tombstones
        tombs: list[Layout] = []
        if where:
            if len(where) != len(keys):
                raise InvalidArgument(f"DELETE names {len(where)} tombstones for {len(keys)} keys: "
                                      "give one per key, or none")
            tombs = await tombstone_layouts(self.index, keys, where, self.clock())
        return rpc.Deleted(deleted=await self.index.delete(keys, tombs)), ()

    async def rpc_list(self, req: rpc.ListKeys, payload: memoryview) -> Reply:
        rows = await self.index.list_keys(req.prefix, req.start_after, req.limit)
        now = self.clock()
        entries = [rpc.KeyEntry(k, lay.size, lay.created, lay.expires_at, len(lay.extents))
                   for k, lay in rows if not lay.expired(now)]
        last = rows[-1][0] if rows else None
        return rpc.Listing(entries=entries, more=len(rows) == req.limit, last=last), ()

    async def rpc_stats(self, req: rpc.Stats, payload: memoryview) -> Reply:
        ix = self.index
        now = self.clock()
        live_keys, stored, nbytes = await ix.key_stats(now)
        server_live = await ix.server_live()
        servers = []
        for s in sorted(ix.servers.values(), key=lambda s: s.server_id):
            written = sum(s.chunks.values())
            live = server_live.get(s.server_id, 0)
            servers.append(rpc.ServerStats(
                server_id=s.server_id, addr=s.addr, alive=ix.alive(s), dead=ix.dead(s),
                draining=s.server_id in self._draining(),
                capacity=s.capacity, free=s.free, used=s.used, shared_by=s.shared_by,
                chunks=len(s.chunks), written=written, live=live,
                garbage=max(0, written - live)))
        return rpc.StatsReply(
            keys=live_keys,
            keys_stored=stored,
            bytes=nbytes,
            servers=servers,
            time=now,
            gc=await self.gc.summary(),
            leases_overflowed=ix.leases_overflowed,
            store=self.store_kind,
            store_bytes=0 if self.local is None else store_bytes(self.config.data, self.store_kind),
            store_free=0 if self.local is None else shutil.disk_usage(self.config.data).free,
            refusing="" if self.local is None else self.local.refusing,
        ), ()

    # chunkserver RPCs ----------------------------------------------------------
    async def rpc_register(self, req: rpc.Register, payload: memoryview) -> Reply:
        ix = self.index
        addr = req.addr
        parse_addr(addr)
        await ix.refresh()  # ids other metas sharing the store gave out
        if req.server_id is not None:
            sid = req.server_id
        else:  # never give out a decommissioned server's id again
            sid = await ix.new_server_id(addr, self.gc.decommissioned)
        self._check_not_decommissioned(sid)
        self._check_cluster(sid, addr, req.cluster_id, req.nchunks)
        old = ix.servers.get(sid)
        if old is not None and old.addr != addr and ix.alive(old) and old.key != req.key:
            raise InvalidArgument(
                f"chunkserver {sid} is alive at {old.addr}; a server at {addr} with another data "
                "dir cannot take its id (stop the other one, or wait for it to time out)")
        s = old or ServerInfo(sid, addr)
        s.key = req.key
        s.addr = addr
        s.reported_capacity = req.capacity
        s.reported_free = req.free
        s.disk = req.disk
        s.last_heartbeat = time.monotonic()
        ix.servers[sid] = s
        ix.share_disks()
        await ix.save_server(s, registered=True)
        log.info("chunkserver %d registered at %s", sid, addr)
        return rpc.Registered(server_id=sid, cluster_id=self.cluster_id), ()

    def _check_cluster(self, sid: int, addr: str, cluster_id: str | None, nchunks: int) -> None:
        """A chunkserver of another cluster, or one holding chunks this meta never saw, is
        refused: this meta (fresh, or restored from elsewhere) must never GC its chunks."""
        if cluster_id is None:
            if nchunks and sid not in self.index.servers:
                raise WrongCluster(
                    f"chunkserver {sid} at {addr} holds {nchunks} chunks but no cluster id, and this "
                    f"meta (cluster {self.cluster_id}) has never seen it; if meta's database was "
                    "lost, rebuild it: kvfs meta rebuild --from-chunkservers")
        elif cluster_id != self.cluster_id:
            raise WrongCluster(
                f"chunkserver {sid} at {addr} belongs to cluster {cluster_id}, this meta "
                f"is cluster {self.cluster_id}; if meta's database was lost or replaced, rebuild it: "
                "kvfs meta rebuild --from-chunkservers")

    async def rpc_heartbeat(self, req: rpc.Heartbeat, payload: memoryview) -> Reply:
        ix = self.index
        s = ix.servers.get(req.server_id)
        if s is None:
            self._check_not_decommissioned(req.server_id)
            raise InvalidArgument(f"unknown chunkserver {req.server_id}: register first")
        s.reported_capacity, s.reported_free, s.used = req.capacity, req.free, req.used
        s.chunks, s.open_chunk, s.wanted = dict(req.chunks), req.open, req.wanted
        s.disk = req.disk
        s.last_heartbeat = time.monotonic()
        ix.share_disks()
        await ix.save_server(s, registered=False)
        return rpc.Empty(), ()

    def _draining(self) -> set[int]:
        return self.gc.draining

    def _check_not_decommissioned(self, sid: int) -> None:
        if sid in self.gc.decommissioned:
            raise InvalidArgument(f"chunkserver {sid} was decommissioned; stop it (its chunks are "
                                  "garbage), or start it on an empty data dir to join as a new server")

    async def rpc_servers(self, req: rpc.Servers, payload: memoryview) -> Reply:
        """A draining server is listed not alive: writers place nothing new on it (readers
        still fall back to it)."""
        ix = self.index
        draining = self._draining()
        return rpc.ServerList(servers=[rpc.ServerRow(s.server_id, s.addr, s.capacity, s.free,
                                                     ix.alive(s) and s.server_id not in draining)
                                       for s in ix.servers.values()], cluster_id=self.cluster_id), ()
