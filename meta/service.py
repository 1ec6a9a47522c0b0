"""Meta's RPC handlers over an in-memory index backed by :class:`MetaStore`.

Invariants:
- a key is visible only after its COMMIT transaction is durable in SQLite;
  the in-memory index is updated in the same event-loop step, so the two never
  disagree for a reader;
- ``chunk_live`` is derived from the layouts (rebuilt at start), never stored;
- an expired key is a miss for every RPC, before GC removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvfs import rpc
from kvfs.address import parse_addr, service_tokens
from kvfs.config import MetaConfig
from kvfs.datadir import DirLock, create_private_file, private_dir, raise_nofile_limit
from kvfs.errors import InvalidArgument, StaleLayout, WrongCluster
from kvfs.handshake import Role
from kvfs.layout import Layout, encode_layout
from kvfs.meta.gc import RECORD_OVERHEAD_BYTES, MetaGc
from kvfs.meta.repair import readable
from kvfs.meta.store import MetaStore
from kvfs.rpc import Service
from kvfs.server import Reply, RpcServer

log = logging.getLogger("kvfs.meta")


@dataclass(slots=True)
class Entry:
    layout: Layout
    last_access: float


@dataclass(slots=True)
class ServerInfo:
    server_id: int
    addr: str
    capacity: int = 0
    free: int = 0
    used: int = 0
    last_heartbeat: float = -1e18  # monotonic
    chunks: dict[int, int] = field(default_factory=dict)  # chunk_id -> bytes written
    open_chunk: int | None = None  # the chunk appends go to (never compacted or deleted)
    wanted: int = 0  # bytes of the last append refused for lack of space (evict to fit it)
    key: str = ""  # the chunkserver's data-dir key: only it may move its id to a new address
    disk: str | None = None  # the filesystem it stores on (host:st_dev); None: own --capacity
    reported_capacity: int = 0  # as the server reported them; capacity/free are its share
    reported_free: int = 0
    shared_by: int = 1  # servers on its disk (each gets 1/shared_by of its space)


class MetaService(MetaGc):
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
        self.entries: dict[bytes, Entry] = {}
        self.chunk_live: dict[int, int] = {}
        self.servers: dict[int, ServerInfo] = {}
        self.leases: dict[bytes, float] = {}
        self._dirty_access: dict[bytes, float] = {}
        self.rpc = RpcServer(self, Service.META, self.tokens, config)
        self._bg: list[asyncio.Task[None]] = []
        self.started = time.monotonic()  # servers known before a restart get dead_after_s from here
        self._load()
        self._init_gc()

    # lifecycle ---------------------------------------------------------------
    def _load(self) -> None:
        for key, layout, last_access in self.store.load():
            self.entries[key] = Entry(layout, last_access)
            self._add_live(layout, +1, key)
        for sid, addr, capacity, free in self.store.load_servers():
            self.servers[sid] = ServerInfo(sid, addr, capacity, free, reported_capacity=capacity,
                                           reported_free=free)
        log.info("meta loaded %d keys, %d chunkservers", len(self.entries), len(self.servers))

    async def start(self) -> str:
        host, port = parse_addr(self.config.listen, what="listen address")
        host, port = await self.rpc.start(host, port)
        self._bg.append(asyncio.get_running_loop().create_task(self._flush_loop()))
        return f"kvfs://{host}:{port}"

    async def close(self) -> None:
        for t in self._bg:
            t.cancel()
        for t in self._bg:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.rpc.close()
        self.flush_access()
        self.store.close()
        self.lock.release()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.access_flush_interval_s)
            self.flush_access()

    def flush_access(self) -> None:
        if self._dirty_access:
            rows = [(t, k) for k, t in self._dirty_access.items()]
            self._dirty_access.clear()
            self.store.touch_many(rows)

    # helpers -------------------------------------------------------------------
    def _add_live(self, layout: Layout, sign: int, key: bytes,
                  live: dict[int, int] | None = None) -> None:
        """Live bytes per chunk (into ``live``, default ``chunk_live``): each replica's value
        plus its record header and key, so a chunk of only live records has zero garbage."""
        live = self.chunk_live if live is None else live
        overhead = RECORD_OVERHEAD_BYTES + len(key)
        for cid, n in layout.chunk_bytes():
            live[cid] = live.get(cid, 0) + sign * (n + overhead)

    def _get(self, key: bytes, now: float) -> Entry | None:
        e = self.entries.get(key)
        if e is None or e.layout.expired(now):
            return None
        return e

    def alive(self, s: ServerInfo) -> bool:
        return time.monotonic() - s.last_heartbeat < self.config.heartbeat_timeout_s

    def dead(self, s: ServerInfo) -> bool:
        """Silent for ``dead_after_s`` (since meta started, for a server not seen since)."""
        after = max(self.config.dead_after_s, self.config.heartbeat_timeout_s)
        return time.monotonic() - max(s.last_heartbeat, self.started) >= after

    def gone_servers(self) -> set[int]:
        """Servers whose replicas count as lost: dead ones."""
        return {sid for sid, s in self.servers.items() if self.dead(s)}

    # client RPCs -------------------------------------------------------------
    async def rpc_ping(self, req: rpc.Ping, payload: memoryview) -> Reply:
        return rpc.Pong(service="meta"), ()

    async def rpc_lookup(self, req: rpc.Lookup, payload: memoryview) -> Reply:
        now = self.clock()
        out: list[Layout | None] = []
        dirty = self._dirty_access
        for k in req.keys:
            e = self._get(k, now)
            if e is None:
                out.append(None)
            else:
                out.append(e.layout)
                e.last_access = now
                dirty[k] = now
        return rpc.Layouts(layouts=out), ()

    def _readable(self, k: bytes, now: float, gone: set[int]) -> bool:
        e = self._get(k, now)
        return e is not None and readable(e.layout, gone)

    async def rpc_exists(self, req: rpc.Exists, payload: memoryview) -> Reply:
        now = self.clock()
        gone = self.gone_servers()
        return rpc.Existing(exists=[self._readable(k, now, gone) for k in req.keys]), ()

    async def rpc_match_prefix(self, req: rpc.MatchPrefix, payload: memoryview) -> Reply:
        now = self.clock()
        gone = self.gone_servers()
        n = 0
        for k in req.keys:
            if not self._readable(k, now, gone):
                break
            n += 1
        if req.lease_s:
            until = now + req.lease_s
            for k in req.keys[:n]:
                self.leases[k] = max(self.leases.get(k, 0.0), until)
        return rpc.Matched(n=n), ()

    async def rpc_commit(self, req: rpc.Commit, payload: memoryview) -> Reply:
        ttl = self.config.default_ttl_s if req.ttl_s is None else req.ttl_s
        now = self.clock()
        expires_at = None if ttl is None else now + float(ttl)
        staged: list[tuple[bytes, Layout]] = []
        servers = self.servers
        for key, wire in req.items:
            lay = wire.stamped(now, expires_at)
            for e in lay.extents:
                for r in e.replicas:
                    if r.server_id not in servers:
                        raise InvalidArgument(f"layout for {key[:64]!r} names unknown chunkserver {r.server_id}")
            if not self.check_not_dead(lay):
                raise StaleLayout(f"layout for {key[:64]!r} names a chunk garbage collection already "
                                  "reclaimed (the put took longer than the GC grace period); retry the put")
            staged.append((key, lay))
        self.store.put_many((k, encode_layout(lay), expires_at, now) for k, lay in staged)
        for key, lay in staged:
            old = self.entries.get(key)
            if old is not None:
                self._add_live(old.layout, -1, key)
            self.entries[key] = Entry(lay, now)
            self._add_live(lay, +1, key)
            self._dirty_access.pop(key, None)
        return rpc.Committed(created=now, expires_at=expires_at), ()

    async def rpc_delete(self, req: rpc.Delete, payload: memoryview) -> Reply:
        gone = [k for k in req.keys if k in self.entries]
        if gone:
            self.store.delete_many(gone)
        for k in gone:
            self._add_live(self.entries.pop(k).layout, -1, k)
            self._dirty_access.pop(k, None)
            self.leases.pop(k, None)
        return rpc.Deleted(deleted=len(gone)), ()

    async def rpc_list(self, req: rpc.ListKeys, payload: memoryview) -> Reply:
        rows = self.store.list(req.prefix, req.start_after, req.limit)
        now = self.clock()
        entries = [rpc.KeyEntry(k, lay.size, lay.created, lay.expires_at, len(lay.extents))
                   for k, lay in rows if not lay.expired(now)]
        last = rows[-1][0] if rows else None
        return rpc.Listing(entries=entries, more=len(rows) == req.limit, last=last), ()

    async def rpc_stats(self, req: rpc.Stats, payload: memoryview) -> Reply:
        now = self.clock()
        live_keys = sum(1 for e in self.entries.values() if not e.layout.expired(now))
        servers = []
        for s in sorted(self.servers.values(), key=lambda s: s.server_id):
            written = sum(s.chunks.values())
            live = sum(self.chunk_live.get(c, 0) for c in s.chunks)
            servers.append(rpc.ServerStats(
                server_id=s.server_id, addr=s.addr, alive=self.alive(s), dead=self.dead(s),
                capacity=s.capacity, free=s.free, used=s.used, shared_by=s.shared_by,
                chunks=len(s.chunks), written=written, live=live,
                garbage=max(0, written - live)))
        return rpc.StatsReply(
            keys=live_keys,
            keys_stored=len(self.entries),
            bytes=sum(e.layout.size for e in self.entries.values() if not e.layout.expired(now)),
            servers=servers,
            time=now,
            gc=self.gc_summary(),
        ), ()

    # chunkserver RPCs ----------------------------------------------------------
    async def rpc_register(self, req: rpc.Register, payload: memoryview) -> Reply:
        addr = req.addr
        parse_addr(addr)
        sid = max(self.servers, default=0) + 1 if req.server_id is None else req.server_id
        self._check_cluster(sid, addr, req.cluster_id, req.nchunks)
        old = self.servers.get(sid)
        if old is not None and old.addr != addr and self.alive(old) and old.key != req.key:
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
        self.servers[sid] = s
        self._share_disks()
        self.store.put_server(sid, addr, s.reported_capacity, s.reported_free)
        log.info("chunkserver %d registered at %s", sid, addr)
        return rpc.Registered(server_id=sid, cluster_id=self.cluster_id), ()

    def _check_cluster(self, sid: int, addr: str, cluster_id: str | None, nchunks: int) -> None:
        """A chunkserver of another cluster, or one holding chunks this meta never saw, is
        refused: this meta (fresh, or restored from elsewhere) must never GC its chunks."""
        if cluster_id is None:
            if nchunks and sid not in self.servers:
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
        s = self.servers.get(req.server_id)
        if s is None:
            raise InvalidArgument(f"unknown chunkserver {req.server_id}: register first")
        s.reported_capacity, s.reported_free, s.used = req.capacity, req.free, req.used
        s.chunks, s.open_chunk, s.wanted = dict(req.chunks), req.open, req.wanted
        s.disk = req.disk
        s.last_heartbeat = time.monotonic()
        self._share_disks()
        return rpc.Empty(), ()

    def _share_disks(self) -> None:
        """Chunkservers on one filesystem share its space: each of the n gets 1/n of the
        capacity and free space they report, so every total (``kvfs stat``, ``kvfs gc
        status``, the mount's ``df``) counts the disk once and fill ratios are the disk's."""
        on_disk: dict[str, int] = {}
        for s in self.servers.values():
            if s.disk is not None:
                on_disk[s.disk] = on_disk.get(s.disk, 0) + 1
        for s in self.servers.values():
            n = on_disk.get(s.disk, 1) if s.disk is not None else 1
            s.shared_by = n
            s.capacity, s.free = s.reported_capacity // n, s.reported_free // n

    async def rpc_servers(self, req: rpc.Servers, payload: memoryview) -> Reply:
        return rpc.ServerList(servers=[rpc.ServerRow(s.server_id, s.addr, s.capacity, s.free, self.alive(s))
                                       for s in self.servers.values()], cluster_id=self.cluster_id), ()
