"""The kvfs client: async API first, a blocking :class:`Client` on top.

put_many: plan extents (stripe large values, r replicas on distinct servers)
-> one APPEND per chunkserver carrying all its records -> one COMMIT to meta.
get_many: layouts from the cache or one LOOKUP -> one READV per chunkserver
-> CRC-32C of every extent verified -> bytes into the caller's buffers.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import random
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import crc32c

from kvfs import rpc
from kvfs._batch import Batcher
from kvfs.address import format_addr, lookup_token, parse_addr
from kvfs.buffers import as_parts, cut, nbytes
from kvfs.config import ClientConfig
from kvfs.errors import (
    AuthError,
    ChecksumMismatch,
    InvalidArgument,
    KVFSError,
    LocalProtocolError,
    NoSpace,
    StaleLayout,
    Unavailable,
    from_wire,
)
from kvfs.handshake import Role
from kvfs.layout import MAX_VALUE_BYTES, Extent, Key, Layout, Replica, norm_key, norm_keys
from kvfs.protocol import Buffer, FrameHead, Scatter
from kvfs.rpc import OP_OF, R, Request
from kvfs.stream import Chunks, ValueReader, open_read, put_stream
from kvfs.tls import client_context
from kvfs.transport import Connection, Sink

log = logging.getLogger("kvfs.client")
TOUCH_INTERVAL_S = 5.0
RX_POOL_BUFFERS = 8  # receive buffers kept for reuse (values returned as bytes are copied out)
READV_IN_FLIGHT = 4  # READVs in flight to one server when a read is split

Value = Any  # bytes-like: bytes, bytearray, memoryview, numpy array, CPU torch tensor,
#               or a list of them: one value gathered from (or scattered into) several buffers

# get_into's per-key results besides a size (>= 0)
MISS = -1  # no such key (or it expired / was deleted while being read)
TOO_SMALL = -2  # the value is larger than the key's buffer(s): nothing was read for it
FAILED = -3  # its bytes could not be read (server down, corrupt): neighbours are unaffected

class _Dest(enum.Enum):
    WHOLE = "whole"


# A destination marker: "the extent is the whole value: hand it back as bytes".
_WHOLE: Final = _Dest.WHOLE
# where an extent's (or a value's) bytes go: views filled in order (a value may be scattered
# over several buffers), _WHOLE, or None: not read
Dest = list[memoryview] | _Dest | None


@dataclass(slots=True)
class ServerEntry:
    server_id: int
    addr: str
    capacity: int
    free: int
    alive: bool


@dataclass(slots=True)
class _Job:
    """One extent to read into ``dest`` (one view, or several when the caller scatters a
    value over several buffers), or handed back as bytes when ``dest`` is ``_WHOLE``."""

    slot: int
    extent: Extent
    dest: list[memoryview] | _Dest
    rep: Replica | None = None  # the replica being read
    tried: tuple[int, ...] = ()  # servers that already failed this extent
    error: KVFSError | None = None


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key: bytes
    size: int
    created: float
    expires_at: float | None
    extents: int


class AsyncClient:
    """``async with kvfs.connect(addr) as kv: ...``"""

    def __init__(self, addr: str | None = None, *, token: str | None = None,
                 config: ClientConfig | None = None, admin_token: str | None = None) -> None:
        """``token``: the client token (default ``$KVFS_TOKEN`` or the file `kvfs up`
        wrote); ``admin_token``: only for the GC pass a write runs when it finds the
        cluster full (``evict_on_full``; default ``$KVFS_ADMIN_TOKEN`` or its file)."""
        self._host, self._port = parse_addr(addr)
        self.addr = format_addr(self._host, self._port)
        self.token = lookup_token(token, addr=self.addr)
        self.admin_token = admin_token
        self.config = config or ClientConfig()
        self._tls = client_context(self.config)  # None: plaintext
        self._servers: dict[int, ServerEntry] = {}
        self._servers_at = -1e18
        self._layouts: OrderedDict[bytes, Layout] = OrderedDict()
        self._write_id = 0  # last write id handed out (see _next_write_id)
        self.clock = time.time
        self.rpc_counts: dict[str, int] = defaultdict(int)
        self._rx_pool: list[bytearray] = []
        self._touched: set[bytes] = set()  # keys read via the layout cache, not yet told to meta
        self._touch_at = time.monotonic()
        self._touch_task: asyncio.Task[None] | None = None
        self._pid = os.getpid()
        self._orphans: list[object] = []  # a parent's connections, kept (never closed) after fork()
        self._bind(None)

    def _bind(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Fresh per-loop state: connections, locks and batchers belong to one event loop."""
        self._loop = loop
        self._meta: Connection | None = None
        self._meta_lock = asyncio.Lock()
        self._conns: dict[int, Connection] = {}
        self._conn_locks: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._touch_task = None
        cfg = self.config
        self._get_batcher: Batcher[bytes, bytes | None] = Batcher(
            self.get_many, max_items=cfg.batch_max_keys, max_bytes=cfg.batch_max_bytes,
            window_s=cfg.batch_window_s)
        self._exists_batcher: Batcher[bytes, bool] = Batcher(
            self.exists_many, max_items=cfg.batch_max_keys, max_bytes=cfg.batch_max_bytes,
            window_s=cfg.batch_window_s)

    def _known_size(self, key: bytes) -> int:
        lay = self._layouts.get(key)
        return 0 if lay is None else lay.size

    # lifecycle -------------------------------------------------------------
    async def __aenter__(self) -> AsyncClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        await self._meta_conn()

    async def close(self) -> None:
        if self._touched and self._meta is not None and not self._meta.is_closed:
            self._flush_touches()
        if self._touch_task is not None:
            await asyncio.wait([self._touch_task], timeout=self.config.request_timeout_s)
        for c in [self._meta, *self._conns.values()]:
            if c is not None:
                c.close()
        self._meta = None
        self._conns.clear()

    # connections -------------------------------------------------------------
    def _check_loop(self) -> None:
        """The client follows the loop that uses it: it binds to the first one, moves to
        another once nothing is open, and refuses at once (instead of hanging until a
        timeout) while connections of another live loop are open.  In a child after
        ``fork()`` the parent's connections are dropped, never touched, and it reconnects."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        pid = os.getpid()
        if pid != self._pid:
            self._orphans.append((self._meta, self._conns))
            self._pid = pid
        elif self._loop is not None and (
                (self._meta is not None and not self._meta.is_closed)
                or any(not c.is_closed for c in self._conns.values())) and not self._loop.is_closed():
            raise LocalProtocolError(
                f"this AsyncClient has connections open on another event loop ({self._loop!r}) "
                f"and was called from {loop!r}; close() it first, make one client per loop, "
                "or use the blocking kvfs.Client (thread-safe, submit_* futures)")
        self._bind(loop)

    async def _meta_conn(self) -> Connection:
        self._check_loop()
        if self._meta is not None and not self._meta.is_closed:
            return self._meta
        async with self._meta_lock:
            if self._meta is None or self._meta.is_closed:
                self._meta = await Connection.open(
                    self._host, self._port, self.token,
                    connect_timeout_s=self.config.connect_timeout_s,
                    request_timeout_s=self.config.request_timeout_s, tls=self._tls)
        return self._meta

    async def _meta_call(self, request: Request[R]) -> R:
        self.rpc_counts[OP_OF[type(request)].name] += 1
        for attempt in (0, 1):
            conn = await self._meta_conn()
            try:
                return await conn.call(request)
            except Unavailable:
                if attempt or not conn.is_closed:
                    raise
        raise AssertionError("unreachable")

    async def _server_conn(self, sid: int) -> Connection:
        self._check_loop()
        conn = self._conns.get(sid)
        if conn is not None and not conn.is_closed:
            return conn
        async with self._conn_locks[sid]:
            conn = self._conns.get(sid)
            if conn is None or conn.is_closed:
                conn = await self._open_server(sid)
                self._conns[sid] = conn
        return conn

    async def _open_server(self, sid: int) -> Connection:
        # a second try after re-reading the server list: a restarted server may have moved
        for attempt in (0, 1):
            entry = self._servers.get(sid)
            if entry is None or attempt:
                await self.servers(refresh=True)
                if attempt and entry is not None and self._servers.get(sid) == entry:
                    break
                entry = self._servers.get(sid)
            if entry is None:
                raise Unavailable(f"chunkserver {sid} is not known to meta")
            host, port = parse_addr(entry.addr, what="chunkserver address")
            try:
                return await Connection.open(
                    host, port, self.token, connect_timeout_s=self.config.connect_timeout_s,
                    request_timeout_s=self.config.request_timeout_s, tls=self._tls)
            except Unavailable as exc:
                entry.alive = False
                error = Unavailable(f"chunkserver {sid} at {entry.addr}: {exc}")
        raise error

    async def _server_call(self, sid: int, request: Request[R], payload: Sequence[Buffer] = (),
                           sink: Sink | None = None) -> tuple[R, memoryview | Scatter]:
        self.rpc_counts[OP_OF[type(request)].name] += 1
        conn = await self._server_conn(sid)
        try:
            answer, body = await conn.exchange(request, payload, sink=sink)
        except Unavailable as exc:
            if sid in self._servers:
                self._servers[sid].alive = False
            raise Unavailable(f"chunkserver {sid} ({conn.name}): {exc}") from None
        return answer, body if isinstance(body, Scatter) else memoryview(body)

    def _rx_take(self, n: int) -> bytearray:
        pool = self._rx_pool
        for i, buf in enumerate(pool):
            if len(buf) >= n:
                return pool.pop(i)
        return bytearray(max(n, 1 << 20))

    def _rx_give(self, bufs: list[bytearray]) -> None:
        for buf in bufs:
            if len(self._rx_pool) < RX_POOL_BUFFERS:
                self._rx_pool.append(buf)
        bufs.clear()

    async def servers(self, *, refresh: bool = False) -> list[ServerEntry]:
        """The chunkservers meta knows, refreshed every ``servers_refresh_s``."""
        now = time.monotonic()
        if refresh or now - self._servers_at > self.config.servers_refresh_s:
            h = await self._meta_call(rpc.Servers())
            fresh = {s.server_id: ServerEntry(s.server_id, s.addr, s.capacity, s.free, s.alive)
                     for s in h.servers}
            for sid, conn in list(self._conns.items()):
                if sid not in fresh or fresh[sid].addr != self._servers.get(sid, fresh[sid]).addr:
                    conn.close()
                    del self._conns[sid]
            self._servers, self._servers_at = fresh, now
        return list(self._servers.values())

    # layouts ---------------------------------------------------------------
    def _cache(self, key: bytes, layout: Layout) -> None:
        cache = self._layouts
        cache[key] = layout
        cache.move_to_end(key)
        while len(cache) > self.config.layout_cache_entries:
            cache.popitem(last=False)

    async def _lookup(self, keys: Sequence[bytes], *, use_cache: bool = True) -> list[Layout | None]:
        now = self.clock()
        out: list[Layout | None] = [None] * len(keys)
        missing: list[int] = []
        cache = self._layouts
        for i, k in enumerate(keys):
            lay = cache.get(k) if use_cache else None
            if lay is None:
                missing.append(i)
            elif lay.expired(now):
                del cache[k]
            else:
                out[i] = lay
                self._touched.add(k)
        if self._touched and (len(self._touched) >= 4096
                              or time.monotonic() - self._touch_at > TOUCH_INTERVAL_S):
            self._flush_touches()
        if missing:
            h = await self._meta_call(rpc.Lookup(keys=[keys[i] for i in missing]))
            for i, lay in zip(missing, h.layouts, strict=True):
                if lay is not None:
                    out[i] = lay
                    self._cache(keys[i], lay)
        return out

    def _flush_touches(self) -> None:
        """Tell meta, in one batch, which keys were read from cached layouts (LRU eviction)."""
        if self._touch_task is not None and not self._touch_task.done():
            return
        keys, self._touched = list(self._touched), set()
        self._touch_at = time.monotonic()

        async def send() -> None:
            try:
                await self._meta_call(rpc.Touch(keys=keys))
            except KVFSError as exc:  # best effort: access times are advisory
                log.debug("touch of %d keys failed: %s", len(keys), exc)

        self._touch_task = asyncio.get_running_loop().create_task(send())

    async def layout(self, key: Key) -> Layout | None:
        """Where a value lives (extents, replicas); None on a miss."""
        return (await self._lookup([norm_key(key)], use_cache=False))[0]

    # writes ------------------------------------------------------------------
    def _order(self, live: list[ServerEntry]) -> list[ServerEntry]:
        """Servers in a random order weighted by free space (Efraimidis-Spirakis)."""
        return sorted(live, key=lambda s: random.random() ** (1.0 / max(s.free, 1)), reverse=True)

    async def put(self, key: Key, value: Value, *, ttl: float | None = None,
                  replicas: int | None = None) -> None:
        await self.put_many([(key, value)], ttl=ttl, replicas=replicas)

    async def put_many(self, items: Mapping[Key, Value] | Iterable[tuple[Key, Value]], *,
                       ttl: float | None = None, replicas: int | None = None) -> None:
        """Store many values: one append per chunkserver, one commit to meta."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        if not pairs:
            return
        keys = [norm_key(k) for k, _ in pairs]
        views = [as_parts(v, what=f"value for key {k[:64]!r}") for k, (_, v) in zip(keys, pairs, strict=True)]
        for k, v in zip(keys, views, strict=True):
            if nbytes(v) > MAX_VALUE_BYTES:
                raise InvalidArgument(f"value of {nbytes(v)} bytes for key {k[:64]!r} exceeds the "
                                      f"limit of {MAX_VALUE_BYTES}")
        r = self.config.replicas if replicas is None else replicas
        if r < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {r}")
        if ttl is not None and ttl <= 0:
            raise InvalidArgument(f"ttl must be positive seconds or None, got {ttl}")
        await self._commit(keys, await self._append(keys, views, r, ttl), ttl)

    async def _append(self, keys: list[bytes], views: list[list[memoryview]], r: int,
                      ttl: float | None, *, first: int | None = None) -> list[Layout]:
        """Write the values' bytes (not yet visible): placement, retries on a dead server, one
        GC pass when the cluster is full.  Returns their layouts, to commit.  ``first``: start
        at the live server of that index (mod their count, in id order) instead of a random
        draw, so the units of a stream go round-robin over the servers as stripes do."""
        collected = False
        for attempt in range(3):
            live = [s for s in await self.servers(refresh=attempt > 0) if s.alive]
            if len(live) < r:
                raise Unavailable(f"{r} replicas need {r} live chunkservers; {len(live)} are live")
            try:
                if first is None:
                    order = self._order(live)
                else:
                    live.sort(key=lambda e: e.server_id)
                    k = first % len(live)
                    order = live[k:] + live[:k]
                return await self._write(keys, views, order, r, ttl, stream_unit=first is not None)
            except Unavailable:
                if attempt == 2:
                    raise
            except NoSpace:
                if collected or not self.config.evict_on_full:
                    raise
                await self._make_room()
                collected = True
        raise AssertionError("unreachable")

    async def _commit(self, keys: list[bytes], layouts: list[Layout], ttl: float | None) -> None:
        """Make written values visible: one COMMIT to meta (the linearisation point)."""
        h = await self._meta_call(rpc.Commit(
            items=[rpc.CommitItem(k, lay) for k, lay in zip(keys, layouts, strict=True)], ttl_s=ttl))
        for k, lay in zip(keys, layouts, strict=True):
            self._cache(k, lay.stamped(h.created, h.expires_at))

    # streaming (kvfs/stream.py) ----------------------------------------------------
    async def put_stream(self, key: Key, chunks: Chunks, *, size: int | None = None,
                         ttl: float | None = None, replicas: int | None = None) -> int:
        """Store the concatenation of ``chunks`` (an async or plain iterable of bytes-like
        objects) under ``key``, holding only a few stripe units in memory; committed at the
        end, so readers see all of it or nothing.  Returns the size."""
        return await put_stream(self, key, chunks, size=size, ttl=ttl, replicas=replicas)

    async def open_read(self, key: Key) -> ValueReader | None:
        """A reader of ``key``'s value by ranges (``await r.read(start, end)``, ``async for
        part in r.chunks()``), or None on a miss."""
        return await open_read(self, key)

    async def _make_room(self) -> None:
        """A write found the cluster full: run one GC pass (expire, evict LRU down to the
        low watermark and to fit the refused write, compact, delete) and let the caller retry."""
        from kvfs.gc.driver import GarbageCollector, PassOptions

        try:
            admin = lookup_token(self.admin_token, addr=self.addr, role=Role.ADMIN)
        except AuthError:
            raise NoSpace("the cluster is full, and this client has no admin token to run a GC "
                          "pass (KVFS_ADMIN_TOKEN); the GC daemon makes room") from None
        log.info("cluster full: running a GC pass before retrying the write")
        async with GarbageCollector(self.addr, token=admin, tls=self.config) as gc:
            await gc.run_pass(PassOptions(apply=True, grace_s=0.0))
        await self.servers(refresh=True)

    async def _write(self, keys: list[bytes], views: list[list[memoryview]], order: list[ServerEntry],
                     r: int, ttl: float | None, *, stream_unit: bool = False) -> list[Layout]:
        """Append every value (one APPEND per server); returns the layouts to commit."""
        stripe = self.config.stripe_bytes
        expires_hint = None if ttl is None else self.clock() + ttl
        wid = self._next_write_id()  # records carry it: a rebuild of meta keeps the newest write
        n_srv = len(order)
        crc = crc32c.crc32c
        # per server: records and payload parts, in call order
        records: dict[int, list[rpc.RecordHead]] = defaultdict(list)
        parts: dict[int, list[list[memoryview]]] = defaultdict(list)  # per record: its buffers
        # per value and unit: (length, crc, [(sid, index into records[sid]), ...])
        plans: list[list[tuple[int, int, list[tuple[int, int]]]]] = []
        crcs: list[int] = []
        # Values <= one stripe go, in call order, to runs of up to ``put_group_bytes`` on one
        # server (a prefix chain stays contiguous: one sequential read later); successive runs
        # of a large call go to the next servers, so a big batch is spread and written in parallel.
        group_limit = self.config.put_group_bytes
        group, group_bytes = 0, 0
        small = [order[j % n_srv].server_id for j in range(r)]
        rr = 0
        for key, v in zip(keys, views, strict=True):
            n = nbytes(v)
            if 0 < n <= stripe:  # the common case: one extent
                if group_bytes and group_bytes + n > group_limit:
                    group, group_bytes = group + 1, 0
                    small = [order[(group + j) % n_srv].server_id for j in range(r)]
                group_bytes += n
                c = 0
                for p in v:
                    c = crc(p, c)
                where = []
                for sid in small:
                    recs = records[sid]
                    where.append((sid, len(recs)))
                    # a stream's unit does not know its whole value (total size 0): a rebuild drops it
                    recs.append(rpc.RecordHead(key, n, c, expires_hint, wid, 0 if stream_unit else n, c, 0))
                    parts[sid].append(v)
                plans.append([(n, c, where)])
                crcs.append(c)
                continue
            units = [cut(v, i, stripe) for i in range(0, n, stripe)]
            plan = []
            whole = 0
            unit_recs: list[tuple[int, int]] = []  # (server, index into its records)
            for ui, u in enumerate(units):
                c = 0
                for p in u:
                    c = crc(p, c)
                    whole = crc(p, whole)
                un = nbytes(u)
                start = (rr + ui) % n_srv
                where = []
                for j in range(r):
                    sid = order[(start + j) % n_srv].server_id
                    where.append((sid, len(records[sid])))
                    unit_recs.append((sid, len(records[sid])))
                    records[sid].append(rpc.RecordHead(key, un, c, expires_hint, wid, n, 0, ui))
                    parts[sid].append(u)
                plan.append((un, c, where))
            for sid, idx in unit_recs:  # the whole value's CRC, known once every unit is summed
                records[sid][idx] = records[sid][idx]._replace(total_crc=whole)
            rr += len(units)
            plans.append(plan)
            crcs.append(whole)
        locs: dict[int, list[rpc.Location]] = {}

        async def send(sid: int) -> None:
            out: list[rpc.Location] = []
            recs, ps = records[sid], parts[sid]
            i = 0
            while i < len(recs):
                j, total = i, 0
                while j < len(recs) and (j == i or total + recs[j][1] <= self.config.max_rpc_bytes):
                    total += recs[j][1]
                    j += 1
                payload = [p for rec in ps[i:j] for p in rec]  # gathered, never copied
                h, _ = await self._server_call(sid, rpc.Append(records=recs[i:j]), payload)
                out.extend(h.locations)
                i = j
            locs[sid] = out

        results = await asyncio.gather(*(send(sid) for sid in records), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return [Layout(nbytes(v), whole, 0.0, None, tuple(
                    Extent(length, c, tuple(Replica(sid, *locs[sid][idx]) for sid, idx in where))
                    for length, c, where in plan))
                for v, plan, whole in zip(views, plans, crcs, strict=True)]

    # reads -------------------------------------------------------------------
    async def get(self, key: Key) -> bytes | None:
        """One value, or None on a miss; concurrent calls are batched together."""
        k = norm_key(key)
        if self.config.batch:
            self._check_loop()
            return await self._get_batcher.submit(k, self._known_size(k))
        return (await self.get_many([k]))[0]

    async def get_many(self, keys: Iterable[Key]) -> list[bytes | None]:
        """Values in key order; None for a miss."""
        ks = norm_keys(keys)
        if not ks:
            return []
        layouts = await self._lookup(ks)
        # one-extent values become bytes straight from the receive buffer (one copy);
        # striped ones are assembled in a bytearray first
        bufs: list[bytearray | None] = [
            None if lay is None or len(lay.extents) < 2 else bytearray(lay.size) for lay in layouts]
        out: list[bytes | None] = [None if lay is None else b"" for lay in layouts]
        dests = [[memoryview(b)] if b is not None else (_WHOLE if lay is not None and lay.size else None)
                 for b, lay in zip(bufs, layouts, strict=True)]
        misses = await self._read_into(ks, layouts, dests, out)
        return [None if i in misses else bytes(b) if b is not None else o
                for i, (b, o) in enumerate(zip(bufs, out, strict=True))]

    async def get_ranges(self, requests: Sequence[tuple[Key, int | None, int | None]],
                         ) -> list[bytes | None]:
        """Byte ranges ``value[start:end]`` (Python slice rules) of many keys in one batch.

        Only the extents that overlap a range are read (each whole, so its CRC-32C is
        verified): a 4 KiB range of a 1 GiB value reads one stripe unit, not 1 GiB.
        """
        keys = norm_keys(k for k, _, _ in requests)
        if not keys:
            return []
        for attempt in (0, 1):
            layouts = await self._lookup(keys, use_cache=attempt == 0)
            subs: list[Layout | None] = []
            dests: list[list[memoryview] | None] = []
            cuts: list[tuple[bytearray, int, int]] = []
            for (_, start, end), lay in zip(requests, layouts, strict=True):
                if lay is None:
                    subs.append(None)
                    dests.append(None)
                    cuts.append((bytearray(), 0, 0))
                    continue
                lo, hi, _ = slice(start, end).indices(lay.size)
                chosen: list[Extent] = []
                pos = first = 0
                for e in lay.extents if hi > lo else ():
                    if pos < hi and pos + e.length > lo:
                        if not chosen:
                            first = pos
                        chosen.append(e)
                    pos += e.length
                size = sum(e.length for e in chosen)
                buf = bytearray(size)
                subs.append(Layout(size, 0, lay.created, lay.expires_at, tuple(chosen)))
                dests.append([memoryview(buf)])
                cuts.append((buf, lo - first, max(lo, hi) - first))
            stale = await self._fetch(keys, subs, dests, None, None)
            if not stale:
                return [None if sub is None else bytes(buf[a:b])
                        for sub, (buf, a, b) in zip(subs, cuts, strict=True)]
            for i in stale:
                self._layouts.pop(keys[i], None)
        raise StaleLayout("layouts changed twice during one ranged read; retry")

    async def get_into(self, keys: Iterable[Key], buffers: Sequence[Any]) -> list[int]:
        """Read values into caller buffers, without copies; one result per key.

        A key's buffer may be a list of buffers: its value is scattered over them in order
        (e.g. ``[k_half, v_half]``).  Each result is the value's size (a hit: that many
        leading bytes of the buffer(s) were written), ``kvfs.MISS`` (-1),
        ``kvfs.TOO_SMALL`` (-2: the value is larger than the buffers; nothing read) or
        ``kvfs.FAILED`` (-3: its bytes could not be read from any replica).  No key's
        outcome affects another's.
        """
        ks = norm_keys(keys)
        if len(buffers) != len(ks):
            raise InvalidArgument(f"{len(ks)} keys but {len(buffers)} buffers")
        if not ks:
            return []
        views = [as_parts(b, writable=True, what=f"buffer {i}") for i, b in enumerate(buffers)]
        layouts = await self._lookup(ks)
        dests: list[list[memoryview] | None] = []
        result = [MISS] * len(ks)
        for i, (lay, v) in enumerate(zip(layouts, views, strict=True)):
            if lay is None:
                dests.append(None)
            elif lay.size > nbytes(v):
                result[i] = TOO_SMALL
                dests.append(None)
            else:
                result[i] = lay.size
                dests.append(cut(v, 0, lay.size))
        failed: dict[int, KVFSError] = {}
        misses = await self._read_into(ks, layouts, dests, failed=failed)
        for i in misses:
            result[i] = MISS
        for i, exc in failed.items():
            log.warning("get_into: %s", exc)
            result[i] = FAILED
        return result

    async def _read_into(self, keys: list[bytes], layouts: list[Layout | None],
                         dests: Sequence[Dest], out: list[bytes | None] | None = None,
                         *, failed: dict[int, KVFSError] | None = None) -> set[int]:
        """Fill ``dests``; returns the slots that turned out to be misses (deleted or
        expired while being read).  With ``failed`` given, a key whose bytes cannot be
        read is recorded there instead of failing the call."""
        misses: set[int] = set()
        stale = await self._fetch(keys, layouts, dests, out, failed)
        if stale:
            for i in stale:
                self._layouts.pop(keys[i], None)
            fresh = await self._lookup([keys[i] for i in stale], use_cache=False)
            retry_layouts: list[Layout | None] = [None] * len(keys)
            retry_dests: list[Dest] = [None] * len(keys)
            for i, lay in zip(stale, fresh, strict=True):
                old = layouts[i]
                if lay is None:
                    misses.add(i)
                    continue
                if old is None or lay.size != old.size or lay == old:
                    raise StaleLayout(f"key {keys[i][:64]!r}: its bytes are gone from the chunkserver "
                                      "named by its layout (lost or reclaimed)")
                retry_layouts[i], retry_dests[i] = lay, dests[i]
            if await self._fetch(keys, retry_layouts, retry_dests, out, failed):
                raise StaleLayout("layouts changed twice during one read; retry")
        return misses

    async def _fetch(self, keys: list[bytes], layouts: list[Layout | None],
                     dests: Sequence[Dest], out: list[bytes | None] | None,
                     failed_out: dict[int, KVFSError] | None) -> list[int]:
        """Read every extent into its destination; returns the slots whose layout was stale.
        A slot no replica could serve raises, or lands in ``failed_out`` when given."""
        jobs: list[_Job] = []
        for slot, (lay, dest) in enumerate(zip(layouts, dests, strict=True)):
            if lay is None or dest is None:
                continue
            if dest is _WHOLE:
                jobs.append(_Job(slot, lay.extents[0], _WHOLE))
                continue
            pos = 0
            for e in lay.extents:
                jobs.append(_Job(slot, e, cut(dest, pos, e.length)))
                pos += e.length
        stale: set[int] = set()
        failed: dict[int, KVFSError] = {}
        alive = {s.server_id: s.alive for s in self._servers.values()}
        pending = jobs
        while pending:
            by_server: dict[int, list[_Job]] = defaultdict(list)
            for job in pending:
                if job.slot in stale or job.slot in failed:
                    continue
                reps = job.extent.replicas
                if len(reps) == 1 and not job.tried:  # the common case, no choice to make
                    rep: Replica | None = reps[0]
                else:
                    choices = [r for r in reps if r.server_id not in job.tried]
                    rep = next((r for r in choices if alive.get(r.server_id, True)),
                               choices[0] if choices else None)
                if rep is None:
                    failed[job.slot] = job.error or Unavailable("no replica left")
                    continue
                job.rep = rep
                by_server[rep.server_id].append(job)
            if not by_server:
                break
            results = await asyncio.gather(
                *(self._readv(sid, js, keys, out) for sid, js in by_server.items()),
                return_exceptions=True)
            pending = []
            for (sid, js), res in zip(by_server.items(), results, strict=True):
                if isinstance(res, Unavailable):
                    for job in js:
                        job.tried += (sid,)
                        job.error = Unavailable(
                            f"key {keys[job.slot][:64]!r}: chunkserver {sid} holding its bytes is "
                            f"unavailable ({res})")
                    pending.extend(js)
                elif isinstance(res, BaseException):
                    raise res
                else:
                    st, retry = res
                    stale.update(st)
                    pending.extend(retry)
        if failed:
            if failed_out is None:
                raise next(iter(failed.values()))
            failed_out.update(failed)
        return sorted(stale)

    async def _readv(self, sid: int, jobs: list[_Job], keys: list[bytes],
                     out: list[bytes | None] | None) -> tuple[list[int], list[_Job]]:
        """Read ``jobs`` from one server: one READV, or several (at most
        ``max_read_rpc_bytes`` each, a few in flight) for large reads, so the server's
        reads, the transfer and the client's checks overlap."""
        stale: list[int] = []
        retry: list[_Job] = []
        limit, max_ranges = self.config.max_read_rpc_bytes, self.config.max_read_ranges
        batches: list[list[_Job]] = []
        batch: list[_Job] = []
        seen: set[tuple[int, int]] = set()  # a server refuses overlapping ranges: the same
        total = 0  # extent asked twice (the same key twice in one call) goes in another READV
        for job in jobs:
            where = (job.rep.chunk_id, job.rep.offset)  # type: ignore[union-attr]
            if batch and (total + job.extent.length > limit or len(batch) >= max_ranges
                          or where in seen):
                batches.append(batch)
                batch, total = [], 0
                seen.clear()
            batch.append(job)
            seen.add(where)
            total += job.extent.length
        if batch:
            batches.append(batch)
        if len(batches) == 1:
            await self._readv_batch(sid, batches[0], keys, out, stale, retry)
            return stale, retry
        gate = asyncio.Semaphore(READV_IN_FLIGHT)

        async def one(batch: list[_Job]) -> None:
            async with gate:
                await self._readv_batch(sid, batch, keys, out, stale, retry)

        await asyncio.gather(*(one(b) for b in batches))
        return stale, retry

    async def _readv_batch(self, sid: int, batch: list[_Job], keys: list[bytes],
                           out: list[bytes | None] | None, stale: list[int],
                           retry: list[_Job]) -> None:
        ranges = [rpc.Range(job.rep.chunk_id, job.rep.offset, job.extent.length)  # type: ignore[union-attr]
                  for job in batch]
        rx: list[bytearray] = []  # a pooled receive buffer, if one was taken

        def scatter(head: FrameHead) -> Scatter:
            # the answer lands straight in each destination (e.g. the caller's buffers); this
            # peeks at the header before it is checked: exchange() checks it once received
            errs = head.header.get("errors") or {}
            return Scatter([p for i, job in enumerate(batch) if i not in errs
                            for p in cast(list[memoryview], job.dest)])  # no dest is _WHOLE here

        def pooled(head: FrameHead) -> memoryview:
            # values handed back as bytes are copied out of a reused buffer: no fresh
            # pages to fault in for every answer
            rx.append(self._rx_take(head.payload_len))
            return memoryview(rx[0])[: head.payload_len]

        sink = scatter if all(job.dest is not _WHOLE for job in batch) else pooled
        try:
            h, payload = await self._server_call(sid, rpc.ReadV(ranges=ranges), sink=sink)
        except BaseException:
            self._rx_give(rx)
            raise
        errors = h.errors
        in_place = isinstance(payload, Scatter)
        view = payload if isinstance(payload, memoryview) else memoryview(b"")
        pos = 0
        crc = crc32c.crc32c
        for idx, job in enumerate(batch):
            if errors:
                err = errors.get(idx)
                if err is not None:
                    exc = from_wire({"code": err.code, "message": err.message})
                    if isinstance(exc, StaleLayout):
                        stale.append(job.slot)
                    else:
                        job.tried += (sid,)
                        job.error = exc
                        retry.append(job)
                    continue
            n = job.extent.length
            dest = job.dest
            if in_place:
                assert dest is not _WHOLE  # scatter is chosen only when no dest is _WHOLE
                c = 0
                for p in dest:
                    c = crc(p, c)
            else:
                got = view[pos : pos + n]
                pos += n
                c = crc(got)
            if c != job.extent.crc:
                job.tried += (sid,)
                job.error = ChecksumMismatch(
                    f"key {keys[job.slot][:64]!r}: bytes from chunkserver {sid} (chunk "
                    f"{ranges[idx].chunk_id:016x} offset {ranges[idx].offset}) fail their CRC-32C")
                retry.append(job)
                continue
            if dest is _WHOLE:
                assert out is not None
                out[job.slot] = bytes(got)
            elif not in_place:
                at = 0
                for p in dest:
                    p[:] = got[at : at + p.nbytes]
                    at += p.nbytes
        got = view = memoryview(b"")  # drop views of the receive buffer before reusing it
        self._rx_give(rx)

    # meta-only queries ---------------------------------------------------------
    async def exists_many(self, keys: Iterable[Key]) -> list[bool]:
        ks = norm_keys(keys)
        if not ks:
            return []
        return (await self._meta_call(rpc.Exists(keys=ks))).exists

    async def exists(self, key: Key) -> bool:
        k = norm_key(key)
        if self.config.batch:
            self._check_loop()
            return await self._exists_batcher.submit(k)
        return (await self.exists_many([k]))[0]

    async def match_prefix(self, keys: Iterable[Key], *, lease_s: float | None = None) -> int:
        """How many leading keys are present and unexpired (optionally leased)."""
        ks = norm_keys(keys)
        if not ks:
            return 0
        return (await self._meta_call(rpc.MatchPrefix(keys=ks, lease_s=lease_s))).n

    async def delete_many(self, keys: Iterable[Key]) -> int:
        ks = norm_keys(keys)
        if not ks:
            return 0
        for k in ks:
            self._layouts.pop(k, None)
        h = await self._meta_call(rpc.Delete(keys=ks))
        await self._tombstones(ks)
        return h.deleted

    def _next_write_id(self) -> int:
        """Write ids order the writes of a key for a rebuild of meta: nanoseconds, increasing."""
        self._write_id = max(self._write_id + 1, time.time_ns())
        return self._write_id

    async def _tombstones(self, keys: list[bytes]) -> None:
        """Record the deletes in a chunk (one APPEND of empty records) so a rebuild of meta
        from the chunks does not bring the keys back.  Best effort: meta's delete stands."""
        wid = self._next_write_id()
        try:
            live = [s for s in await self.servers() if s.alive]
            if not live:
                return
            sid = self._order(live)[0].server_id
            await self._server_call(sid, rpc.Append(records=[
                rpc.RecordHead(k, 0, 0, None, wid, 0, 0, 0, True) for k in keys]), [])
        except KVFSError as exc:
            log.warning("deleted %d keys, but could not record their tombstones: %s", len(keys), exc)

    async def delete(self, key: Key) -> bool:
        return await self.delete_many([key]) == 1

    async def list(self, prefix: Key = b"", *, limit: int | None = None,
                   page_size: int = 1000) -> list[KeyInfo]:
        """Keys starting with ``prefix`` in key order (paginated under the hood)."""
        p = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        out: list[KeyInfo] = []
        start_after: bytes | None = None
        while limit is None or len(out) < limit:
            h = await self._meta_call(rpc.ListKeys(prefix=p, start_after=start_after, limit=page_size))
            out.extend(KeyInfo(*e) for e in h.entries)
            if not h.more:
                break
            start_after = h.last
        return out if limit is None else out[:limit]

    async def stats(self) -> dict[str, Any]:
        return rpc.to_dict(await self._meta_call(rpc.Stats()))


def connect(addr: str | None = None, *, token: str | None = None,
            config: ClientConfig | None = None) -> AsyncClient:
    """``async with kvfs.connect("kvfs://127.0.0.1:7070") as kv: ...``"""
    return AsyncClient(addr, token=token, config=config)
