"""The chunkserver process: RPC handlers, registration and heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Mapping, Sequence

from kvfs import rpc
from kvfs.address import parse_addr, parse_addrs, service_tokens
from kvfs.chunkserver.store import ChunkStore, check_ranges
from kvfs.cluster import ClusterLink
from kvfs.config import ChunkServerConfig
from kvfs.datadir import DirLock, private_dir, raise_nofile_limit
from kvfs.errors import KVFSError, WrongCluster
from kvfs.handshake import Role
from kvfs.protocol import Buffer
from kvfs.rpc import Op, Service
from kvfs.server import Reply, RpcServer
from kvfs.tls import client_context

log = logging.getLogger("kvfs.chunkserver")


def _readv_reply(errors: Mapping[int, KVFSError]) -> rpc.ReadVReply:
    return rpc.ReadVReply(errors={i: rpc.WireError(e.code, e.message) for i, e in errors.items()})


class ChunkServer:
    def __init__(self, config: ChunkServerConfig, *,
                 tokens: Mapping[Role, str] | None = None) -> None:
        self.config = config
        private_dir(config.data)
        self.lock = DirLock(config.data, "chunkserver").acquire()  # before any file is touched
        try:
            self.tokens = dict(tokens) if tokens else service_tokens(config.data)
            open_files = min(config.max_open_chunks, raise_nofile_limit() // 2)
            mapped = min(config.max_mapped_chunks, open_files // 2)  # each holds an fd too
            self.store = ChunkStore(config.data, chunk_bytes=config.chunk_bytes,
                                    io_threads=config.io_threads, fsync=config.fsync,
                                    fsync_window_s=config.fsync_window_s,
                                    writeback_start_bytes=config.writeback_start_bytes,
                                    inline_write_bytes=config.inline_write_bytes,
                                    capacity_bytes=config.capacity_bytes,
                                    gc_reserve_bytes=config.gc_reserve_bytes,
                                    merge_gap_bytes=config.merge_gap_bytes,
                                    max_open_files=open_files - mapped,
                                    max_mapped_files=mapped,
                                    preallocate=config.preallocate,
                                    close_timeout_s=config.close_timeout_s)
            self.rpc = RpcServer(self, Service.CHUNKSERVER, self.tokens, config)
            # to meta: this server's certificate as its client certificate, verified by its CA
            self._meta_tls = client_context(config, env=False, who="chunkserver (to meta)")
        except BaseException:
            if hasattr(self, "store"):
                self.store.close_now()
            self.lock.release()
            raise
        self.addr = ""
        # registration and heartbeats
        # several metas of one Redis-backed store: one in use, the next if it fails
        self._meta = ClusterLink(parse_addrs(config.meta, what="meta address"), self.tokens[Role.SERVER],
                                 tls=self._meta_tls, spread_meta=False)
        self._hb: asyncio.Task[None] | None = None
        self.readv_calls = 0
        self.append_calls = 0

    @property
    def meta_link(self) -> ClusterLink:
        """Its link to meta (registration and heartbeats)."""
        return self._meta

    @property
    def server_id(self) -> int | None:
        return self.store.server_id

    async def start(self) -> str:
        """Listen, register with meta; returns once clients can be sent here."""
        host, port = parse_addr(self.config.listen, what="listen address")
        host, port = await self.rpc.start(host, port)
        self.addr = self.config.advertise or f"{host}:{port}"
        try:
            await self._register()
        except BaseException:  # refused (another cluster, a lost key) or meta unreachable
            await self.close()  # a listener left open here hangs the loop's close (uvloop)
            raise
        self._hb = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        return self.addr

    async def close(self) -> None:
        if self._hb is not None:
            self._hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb
        self._meta.close()
        await self.rpc.close()
        if await self.store.close():
            self.lock.release()
        else:  # a write still running could land on the records of a server reopening it
            log.error("chunkserver %s: data directory %s stays locked until this process "
                      "exits (disk IO abandoned at close)", self.server_id, self.config.data)

    async def _register(self) -> None:
        capacity, free, _ = self.store.usage()
        if not self.store.key:
            self.store.save_state()  # creates the key that proves this data dir to meta
        r = await self._meta.call_meta(rpc.Register(
            server_id=self.store.server_id, addr=self.addr, capacity=capacity, free=free,
            key=self.store.key, cluster_id=self.store.cluster_id, nchunks=len(self.store.sizes),
            disk=self.store.disk_id))
        if self.store.cluster_id not in (None, r.cluster_id):
            raise WrongCluster(f"meta answered for cluster {r.cluster_id}; this chunkserver "
                               f"belongs to cluster {self.store.cluster_id}")
        if r.server_id != self.store.server_id or r.cluster_id != self.store.cluster_id:
            self.store.server_id, self.store.cluster_id = r.server_id, r.cluster_id
            self.store.save_state()
        await self._heartbeat()

    async def _heartbeat(self) -> None:
        assert self.server_id is not None
        await self._meta.call_meta(rpc.Heartbeat.of(self.chunk_stats(), server_id=self.server_id,
                                                    addr=self.addr))

    def chunk_stats(self, *, mtimes: bool = False) -> rpc.ChunkStatsReply:
        capacity, free, used = self.store.usage()
        return rpc.ChunkStatsReply(
            chunks=dict(self.store.sizes), capacity=capacity, free=free, used=used,
            spans_read=self.store.spans_read, readv_calls=self.readv_calls,
            append_calls=self.append_calls, open=self.store.open_chunk,
            wanted=self.store.wanted_bytes, server_id=self.server_id, addr=self.addr,
            cluster_id=self.store.cluster_id, disk=self.store.disk_id,
            mtimes=self.store.mtimes() if mtimes else {})

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                if self._meta.meta_open:
                    await self._heartbeat()
                else:  # meta restarted (or never answered): register again
                    await self._register()
            except KVFSError as exc:
                log.warning("heartbeat to meta failed: %s", exc)
                self._meta.close()

    # RPCs ------------------------------------------------------------------
    async def rpc_ping(self, req: rpc.Ping, payload: memoryview) -> Reply:
        return rpc.Pong(service="chunkserver", server_id=self.server_id), ()

    async def rpc_append(self, req: rpc.Append, payload: memoryview) -> Reply:
        self.append_calls += 1
        locs = await self.store.append(req.records, payload)
        return rpc.Appended(locations=locs), ()

    def reply_cost(self, op: int, req: object) -> int:
        """Reply bytes a request will produce, charged to its connection before it runs;
        a READV past ``max_ranges``/``max_read_rpc_bytes`` or with overlapping ranges is
        refused here, before it is read."""
        if op == Op.READV:
            assert isinstance(req, rpc.ReadV)
            cfg = self.config
            return check_ranges(req.ranges, cfg.max_ranges, cfg.max_read_rpc_bytes)[1]
        return 0

    def rpc_readv(self, req: rpc.ReadV, payload: memoryview) -> Reply | Awaitable[Reply]:
        """``req.ranges`` were checked once, by :meth:`reply_cost` (the server runs it on
        every request before dispatching it).  An answer from the page cache is returned
        as it is (the server writes it at once, no task: every small cached READV); one to
        read comes as a coroutine."""
        self.readv_calls += 1
        if self.rpc.tls is None:  # plain TCP: sendfile can send the page cache's bytes
            files, errors = self.store.readv_files(req.ranges, self.config.sendfile_min_bytes)
            if files is not None:  # sent from the page cache into the socket (server.py)
                return _readv_reply(errors), files
            views = None if errors else self.store.readv_mapped(req.ranges)
            if views is not None:  # the page cache's bytes, written with the header at once
                return rpc.ReadVReply(), views
        return self._readv_read(req.ranges)

    async def _readv_read(self, ranges: Sequence[tuple[int, int, int]]) -> Reply:
        payload, _, errors = await self.store.readv_into(ranges)
        parts: list[Buffer] = [payload] if payload.nbytes else []
        return _readv_reply(errors), parts

    async def rpc_chunk_stats(self, req: rpc.ChunkStats, payload: memoryview) -> Reply:
        return self.chunk_stats(mtimes=req.mtimes), ()

    async def rpc_chunk_compact(self, req: rpc.ChunkCompact, payload: memoryview) -> Reply:
        new, size, locations = await self.store.compact(req.sources)
        if new is not None:
            log.info("compacted %d chunks into %016x (%d bytes)", len(req.sources), new, size)
        return rpc.Compacted(chunk_id=new, size=size, locations=locations), ()

    async def rpc_chunk_delete(self, req: rpc.ChunkDelete, payload: memoryview) -> Reply:
        if self.store.cluster_id is None or req.cluster_id != self.store.cluster_id:
            raise WrongCluster(f"chunk deletion for cluster {req.cluster_id} refused: "
                               f"this chunkserver belongs to cluster {self.store.cluster_id}")
        deleted = await self.store.delete_chunks(req.chunks)
        if deleted:
            log.info("deleted %d chunks (%d bytes)", len(deleted), sum(deleted.values()))
        return rpc.ChunksDeleted(deleted=deleted), ()

    async def rpc_chunk_scan(self, req: rpc.ChunkScan, payload: memoryview) -> Reply:
        recs = await self.store.scan(req.chunk_id)
        return rpc.Scanned(records=[
            rpc.ScanRecord(r.key, r.write_id, r.index, r.total_size, r.total_crc, r.length, r.crc,
                           r.expires_at, r.tombstone, r.value_ok, r.value_offset) for r in recs]), ()

    async def rpc_chunk_seal(self, req: rpc.ChunkSeal, payload: memoryview) -> Reply:
        return rpc.Sealed(sealed=await self.store.seal(req.chunk_id, req.idle_s, apply=req.apply)), ()

    async def rpc_chunk_verify(self, req: rpc.ChunkVerify, payload: memoryview) -> Reply:
        missing, bad = await self.store.verify(req.ranges)
        return rpc.Verified(missing=missing, bad=bad), ()
