"""The chunkserver process: RPC handlers, registration and heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvfs import rpc
from kvfs.address import lookup_token, parse_addr
from kvfs.chunkserver.store import ChunkStore
from kvfs.cluster import ClusterLink
from kvfs.config import ChunkServerConfig
from kvfs.errors import KVFSError
from kvfs.protocol import Buffer, Limits
from kvfs.rpc import Service
from kvfs.server import Reply, RpcServer

log = logging.getLogger("kvfs.chunkserver")


class ChunkServer:
    def __init__(self, config: ChunkServerConfig) -> None:
        self.config = config
        config.data.mkdir(parents=True, exist_ok=True)
        self.token = lookup_token(config.token, data_dir=config.data)
        self.store = ChunkStore(config.data, chunk_bytes=config.chunk_bytes, io_threads=config.io_threads,
                                fsync=config.fsync, capacity_bytes=config.capacity_bytes,
                                merge_gap_bytes=config.merge_gap_bytes)
        self.rpc = RpcServer(self, Service.CHUNKSERVER, self.token, Limits())
        self.addr = ""
        # registration and heartbeats
        self._meta = ClusterLink(*parse_addr(config.meta, what="meta address"), self.token)
        self._hb: asyncio.Task[None] | None = None
        self.readv_calls = 0
        self.append_calls = 0

    @property
    def server_id(self) -> int | None:
        return self.store.server_id

    async def start(self) -> str:
        """Listen, register with meta; returns once clients can be sent here."""
        host, port = parse_addr(self.config.listen, what="listen address")
        host, port = await self.rpc.start(host, port)
        self.addr = self.config.advertise or f"{host}:{port}"
        await self._register()
        self._hb = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        return self.addr

    async def close(self) -> None:
        if self._hb is not None:
            self._hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb
        self._meta.close()
        await self.rpc.close()
        self.store.close()

    async def _register(self) -> None:
        capacity, free, _ = self.store.usage()
        r = await self._meta.call_meta(rpc.Register(server_id=self.store.server_id, addr=self.addr,
                                                    capacity=capacity, free=free))
        if r.server_id != self.store.server_id:
            self.store.server_id = r.server_id
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
        return rpc.Appended(locations=[rpc.Location(c, o) for c, o in locs]), ()

    async def rpc_readv(self, req: rpc.ReadV, payload: memoryview) -> Reply:
        self.readv_calls += 1
        views, errors = await self.store.readv(req.ranges)
        parts: list[Buffer] = [v for v in views if v is not None and v.nbytes]
        return rpc.ReadVReply(errors={i: rpc.WireError(e.code, e.message) for i, e in errors.items()}), parts

    async def rpc_chunk_stats(self, req: rpc.ChunkStats, payload: memoryview) -> Reply:
        return self.chunk_stats(mtimes=req.mtimes), ()

    async def rpc_chunk_compact(self, req: rpc.ChunkCompact, payload: memoryview) -> Reply:
        new, size, locations = await self.store.compact(req.sources)
        if new is not None:
            log.info("compacted %d chunks into %016x (%d bytes)", len(req.sources), new, size)
        return rpc.Compacted(chunk_id=new, size=size, locations=locations), ()

    async def rpc_chunk_delete(self, req: rpc.ChunkDelete, payload: memoryview) -> Reply:
        deleted = self.store.delete_chunks(req.chunks)
        if deleted:
            log.info("deleted %d chunks (%d bytes)", len(deleted), sum(deleted.values()))
        return rpc.ChunksDeleted(deleted=deleted), ()

    async def rpc_chunk_seal(self, req: rpc.ChunkSeal, payload: memoryview) -> Reply:
        return rpc.Sealed(sealed=await self.store.seal(req.chunk_id, req.idle_s, apply=req.apply)), ()

    async def rpc_chunk_verify(self, req: rpc.ChunkVerify, payload: memoryview) -> Reply:
        missing, bad = await self.store.verify(req.ranges)
        return rpc.Verified(missing=missing, bad=bad), ()
