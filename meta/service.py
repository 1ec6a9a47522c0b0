"""Meta's RPC handlers for clients and chunkservers, over :class:`MetaIndex`.

The GC's handlers live in the :class:`MetaGc` component, handed the same index;
one :class:`RpcServer` dispatches to both.  The index's invariants are in
:mod:`kvfs.meta.index`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from kvfs import rpc
from kvfs.address import parse_addr, service_tokens
from kvfs.config import MetaConfig
from kvfs.datadir import DirLock, create_private_file, private_dir, raise_nofile_limit
from kvfs.errors import InvalidArgument, StaleLayout, WrongCluster
from kvfs.handshake import Role
from kvfs.layout import Layout, encode_layout
from kvfs.meta.gc import MetaGc
from kvfs.meta.index import Entry, MetaIndex, ServerInfo
from kvfs.meta.store import MetaStore
from kvfs.rpc import Service
from kvfs.server import Reply, RpcServer

log = logging.getLogger("kvfs.meta")


class MetaService:
    def __init__(self, config: MetaConfig, *, clock: Callable[[], float] = time.time,
                 tokens: Mapping[Role, str] | None = None) -> None:
        self.config = config
        self.clock = clock
        private_dir(config.data)
        self.lock = DirLock(config.data, "meta").acquire()
        raise_nofile_limit()
        create_private_file(config.data / "meta.sqlite3")  # SQLite's -wal/-shm copy its mode
        self.tokens = dict(tokens) if tokens else service_tokens(config.data, create=True)
        self.store = MetaStore(config.data / "meta.sqlite3",
                               synchronous="NORMAL" if config.fsync == "never" else "FULL")
        self.cluster_id = self.store.cluster_id()
        self.index = MetaIndex(config, self.store, clock)
        self.index.load()
        self.gc = MetaGc(self.index)
        self.rpc = RpcServer([self, self.gc], Service.META, self.tokens, config)
        self._bg: list[asyncio.Task[None]] = []

    # lifecycle ---------------------------------------------------------------
    async def start(self) -> str:
        host, port = parse_addr(self.config.listen, what="listen address")
        host, port = await self.rpc.start(host, port)
        self._bg.append(asyncio.get_running_loop().create_task(self._flush_loop()))
        addr = f"kvfs://{host}:{port}"
        self.gc.home = (addr, self.tokens[Role.ADMIN])
        return addr

    async def close(self) -> None:
        for t in self._bg:
            t.cancel()
        for t in self._bg:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.rpc.close()
        self.index.flush_access()
        self.store.close()
        self.lock.release()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.access_flush_interval_s)
            self.index.flush_access()

    # client RPCs -------------------------------------------------------------
    async def rpc_ping(self, req: rpc.Ping, payload: memoryview) -> Reply:
        return rpc.Pong(service="meta"), ()

    async def rpc_lookup(self, req: rpc.Lookup, payload: memoryview) -> Reply:
        ix = self.index
        now = self.clock()
        out: list[Layout | None] = []
        dirty = ix.dirty_access
        for k in req.keys:
            e = ix.get(k, now)
            if e is None:
                out.append(None)
            else:
                out.append(e.layout)
                e.last_access = now
                dirty[k] = now
        return rpc.Layouts(layouts=out), ()

    async def rpc_exists(self, req: rpc.Exists, payload: memoryview) -> Reply:
        ix = self.index
        now = self.clock()
        gone = ix.gone_servers()
        return rpc.Existing(exists=[ix.readable(k, now, gone) for k in req.keys]), ()

    async def rpc_match_prefix(self, req: rpc.MatchPrefix, payload: memoryview) -> Reply:
        ix = self.index
        now = self.clock()
        gone = ix.gone_servers()
        n = 0
        for k in req.keys:
            if not ix.readable(k, now, gone):
                break
            n += 1
        if req.lease_s:
            until = now + req.lease_s
            for k in req.keys[:n]:
                ix.leases[k] = max(ix.leases.get(k, 0.0), until)
        return rpc.Matched(n=n), ()

    async def rpc_commit(self, req: rpc.Commit, payload: memoryview) -> Reply:
        ix = self.index
        ttl = self.config.default_ttl_s if req.ttl_s is None else req.ttl_s
        now = self.clock()
        expires_at = None if ttl is None else now + float(ttl)
        staged: list[tuple[bytes, Layout]] = []
        servers = ix.servers
        for key, wire in req.items:
            lay = wire.stamped(now, expires_at)
            for e in lay.extents:
                for r in e.replicas:
                    if r.server_id not in servers:
                        raise InvalidArgument(f"layout for {key[:64]!r} names unknown chunkserver {r.server_id}")
            if not self.gc.check_not_dead(lay):
                raise StaleLayout(f"layout for {key[:64]!r} names a chunk garbage collection already "
                                  "reclaimed (the put took longer than the GC grace period); retry the put")
            staged.append((key, lay))
        self.store.put_many((k, encode_layout(lay), expires_at, now) for k, lay in staged)
        for key, lay in staged:
            old = ix.entries.get(key)
            if old is not None:
                ix.add_live(old.layout, -1, key)
            ix.entries[key] = Entry(lay, now)
            ix.add_live(lay, +1, key)
            ix.dirty_access.pop(key, None)
        return rpc.Committed(created=now, expires_at=expires_at), ()

    async def rpc_delete(self, req: rpc.Delete, payload: memoryview) -> Reply:
        ix = self.index
        gone = [k for k in req.keys if k in ix.entries]
        if gone:
            self.store.delete_many(gone)
        for k in gone:
            ix.add_live(ix.entries.pop(k).layout, -1, k)
            ix.dirty_access.pop(k, None)
            ix.leases.pop(k, None)
        return rpc.Deleted(deleted=len(gone)), ()

    async def rpc_list(self, req: rpc.ListKeys, payload: memoryview) -> Reply:
        rows = self.store.list(req.prefix, req.start_after, req.limit)
        now = self.clock()
        entries = [rpc.KeyEntry(k, lay.size, lay.created, lay.expires_at, len(lay.extents))
                   for k, lay in rows if not lay.expired(now)]
        last = rows[-1][0] if rows else None
        return rpc.Listing(entries=entries, more=len(rows) == req.limit, last=last), ()

    async def rpc_stats(self, req: rpc.Stats, payload: memoryview) -> Reply:
        ix = self.index
        now = self.clock()
        live_keys = sum(1 for e in ix.entries.values() if not e.layout.expired(now))
        servers = []
        for s in sorted(ix.servers.values(), key=lambda s: s.server_id):
            written = sum(s.chunks.values())
            live = sum(ix.chunk_live.get(c, 0) for c in s.chunks)
            servers.append(rpc.ServerStats(
                server_id=s.server_id, addr=s.addr, alive=ix.alive(s), dead=ix.dead(s),
                capacity=s.capacity, free=s.free, used=s.used, shared_by=s.shared_by,
                chunks=len(s.chunks), written=written, live=live,
                garbage=max(0, written - live)))
        return rpc.StatsReply(
            keys=live_keys,
            keys_stored=len(ix.entries),
            bytes=sum(e.layout.size for e in ix.entries.values() if not e.layout.expired(now)),
            servers=servers,
            time=now,
            gc=self.gc.summary(),
        ), ()

    # chunkserver RPCs ----------------------------------------------------------
    async def rpc_register(self, req: rpc.Register, payload: memoryview) -> Reply:
        ix = self.index
        addr = req.addr
        parse_addr(addr)
        sid = max(ix.servers, default=0) + 1 if req.server_id is None else req.server_id
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
        self.store.put_server(sid, addr, s.reported_capacity, s.reported_free)
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
            raise InvalidArgument(f"unknown chunkserver {req.server_id}: register first")
        s.reported_capacity, s.reported_free, s.used = req.capacity, req.free, req.used
        s.chunks, s.open_chunk, s.wanted = dict(req.chunks), req.open, req.wanted
        s.disk = req.disk
        s.last_heartbeat = time.monotonic()
        ix.share_disks()
        return rpc.Empty(), ()

    async def rpc_servers(self, req: rpc.Servers, payload: memoryview) -> Reply:
        ix = self.index
        return rpc.ServerList(servers=[rpc.ServerRow(s.server_id, s.addr, s.capacity, s.free, ix.alive(s))
                                       for s in ix.servers.values()], cluster_id=self.cluster_id), ()
