"""The kvfs client: async API first, a blocking :class:`Client` on top.

:class:`AsyncClient` is a thin front over the modules that do the work:

- :mod:`kvfs.cluster`: connections to meta and the chunkservers, the live server list;
- :mod:`kvfs.layoutcache`: immutable layouts cached, reads told to meta (LRU);
- :mod:`kvfs.placement` + :mod:`kvfs.writepath`: put_many -> one APPEND per
  chunkserver -> one COMMIT;
- :mod:`kvfs.readpath`: get_many -> one READV per chunkserver, replica failover,
  CRC-32C of every extent, bytes into the caller's buffers;
- :mod:`kvfs.stream`: values that never sit whole in memory (put_stream, open_read),
  over the write path, the read path and :meth:`AsyncClient.lookup`;
- :mod:`kvfs._batch`: concurrent single-key calls coalesced into batches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import is_
from typing import Any, NamedTuple, cast

import msgspec

from kvfs import rpc
from kvfs._batch import Batcher, split_batches
from kvfs._loop import gather_all
from kvfs.address import format_addr, format_addrs, lookup_token, parse_addrs
from kvfs.buffers import Source, Views, as_parts, as_parts_many, cut, fresh_value
from kvfs.cluster import ClusterLink, ServerEntry
from kvfs.config import ClientConfig, OnLost
from kvfs.errors import InvalidArgument, KVFSError, RemoteProtocolError, StaleLayout
from kvfs.layout import (
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    MAX_VALUE_BYTES,
    Extent,
    Key,
    Layout,
    norm_key,
    norm_keys,
)
from kvfs.layoutcache import FLAT_SIZE, Cached, Flat, FlatLayouts, LayoutCache
from kvfs.readpath import (
    RELOOKUPS,
    SCATTER_MIN_BYTES,
    WHOLE,
    Dest,
    ReadPath,
    bytes_gone,
    still_moving,
)
from kvfs.stream import Chunks, ValueReader, open_read, put_stream
from kvfs.tls import client_context
from kvfs.transport import Connection
from kvfs.writepath import WritePath

log = logging.getLogger("kvfs.client")

Value = Any  # bytes-like: bytes, bytearray, memoryview, numpy array, CPU torch tensor,
#               or a list of them: one value gathered from (or scattered into) several buffers

# get_into's per-key results besides a size (>= 0)
MISS = -1  # no such key (or it expired / was deleted while being read)
TOO_SMALL = -2  # the value is larger than the key's buffer(s): nothing was read for it
FAILED = -3  # its bytes could not be read (server down, corrupt) and on_lost="raise"

__all__ = ["FAILED", "MISS", "TOO_SMALL", "AsyncClient", "KeyInfo", "ServerEntry", "connect"]


# A request's bytes per key besides the key's own, at most (msgpack), for cutting batch calls
# under ClientConfig.call_max_bytes (AsyncClient.parts): a key's header in a meta query; a
# put's or delete's record head on a server (APPEND) and its packed columns (COMMIT), plus
# each replica of each extent or tombstone; and the rest of a request
_KEY_BYTES = 4
_RECORD_BYTES = 64
_REPLICA_BYTES = 24
_REQUEST_BYTES = 4096

# keys, buffers, their sizes, lease_s
_IntoCall = tuple[list[bytes], list[Views], list[int], float | None]


class _PutCall(NamedTuple):
    """One put_many call, checked, waiting in the put batcher."""

    keys: list[bytes]
    views: list[Source]
    sizes: list[int]  # each value's bytes
    metas: list[bytes | None] | None  # each key's encoded meta; None: none at all
    replicas: int  # options: calls with the same ones may share a put
    ttl: float | None
    if_absent: bool

    @property
    def options(self) -> tuple[int, float | None, bool]:
        return self.replicas, self.ttl, self.if_absent


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key: bytes
    size: int
    created: float
    expires_at: float | None
    extents: int


class AsyncClient:
    """``async with kvfs.connect(addr) as kv: ...``

    Public counters: ``rpc_counts`` (RPCs sent, by op name), ``meta_calls`` (meta calls
    answered, by meta ``HOST:PORT``: several metas share the calls), ``layout_cache`` (its
    ``clear()`` makes the next read ask meta), ``rx_pool_buffers`` and
    ``rx_buffers_reused`` (the read path's pooled receive buffers).  ``writer``
    (:class:`kvfs.writepath.WritePath`), ``reader`` (:class:`kvfs.readpath.ReadPath`)
    and :meth:`lookup` are what :mod:`kvfs.stream` builds on.

    The client follows the event loop that uses it (:meth:`kvfs.cluster.ClusterLink.bind_loop`).
    Its leases are :attr:`lease_holder`'s.
    """

    def __init__(self, addr: str | None = None, *, token: str | None = None,
                 config: ClientConfig | None = None) -> None:
        """``token``: the client token (default ``$KVFS_TOKEN`` or the file `kvfs up`
        wrote).  A client never runs GC: a write that finds the cluster full asks meta to
        make room (MAKE_ROOM) and retries (again while the passes free something)."""
        metas = parse_addrs(addr)  # several metas of one Redis-backed store: calls spread over them
        self.addr = format_addrs(metas)
        self.token = lookup_token(token, addr=format_addr(*metas[0]))
        self.config = cfg = config or ClientConfig()
        self.clock = time.time
        self._link = ClusterLink(metas, self.token, connect_timeout_s=cfg.connect_timeout_s,
                                 request_timeout_s=cfg.request_timeout_s,
                                 servers_refresh_s=cfg.servers_refresh_s,
                                 down_for_s=cfg.down_for_s,
                                 tls=client_context(cfg))  # None: plaintext
        self.rpc_counts = self._link.rpc_counts
        self.meta_calls = self._link.meta_calls
        self.layout_cache = LayoutCache(self._link, cfg.layout_cache_entries)
        self.writer = WritePath(self._link, cfg, lambda: self.clock())
        self.reader = ReadPath(self._link, max_rpc_bytes=cfg.max_read_rpc_bytes,
                               max_ranges=cfg.max_read_ranges,
                               relookup=lambda keys: self.lookup(keys, use_cache=False),
                               forget=self.layout_cache.pop, hedge_after_s=cfg.hedge_after_s,
                               pool_bytes=cfg.read_pool_bytes)
        self._link.on_rebind.append(self._new_batchers)
        self._new_batchers()
        self._holder = ("", 0)  # (random holder id, the process it was drawn in)

    @property
    def lease_holder(self) -> str:
        """Whose leases this client's lookups take and :meth:`release` ends:
        ``ClientConfig.lease_holder``, or by default a random id drawn once per client and
        process (a child of ``fork()`` draws its own)."""
        if self.config.lease_holder is not None:
            return self.config.lease_holder
        holder, pid = self._holder
        if pid != os.getpid():
            holder = secrets.token_hex(8)
            self._holder = (holder, os.getpid())
        return holder

    def _new_batchers(self) -> None:
        """Batchers belong to one event loop: made anew when the client moves to another."""
        cfg = self.config
        self._get_batcher: Batcher[bytes, bytes | None] = Batcher(
            self.get_many, max_items=cfg.batch_max_keys, max_bytes=cfg.batch_max_bytes,
            window_s=cfg.batch_window_s)
        self._exists_batcher: Batcher[bytes, bool] = Batcher(
            self.exists_many, max_items=cfg.batch_max_keys, max_bytes=cfg.batch_max_bytes,
            window_s=cfg.batch_window_s)
        # whole calls, each counted as its keys
        self._into_batcher: Batcher[_IntoCall, list[int]] = Batcher(
            self._get_into_calls, max_items=cfg.batch_max_keys, max_bytes=cfg.batch_max_bytes,
            window_s=cfg.batch_window_s, cancel_waits=True)  # a batch writes the callers' buffers
        self._put_batcher: Batcher[_PutCall, list[Cached | None] | KVFSError] = Batcher(
            self._put_calls, max_items=cfg.batch_max_keys, max_bytes=cfg.batch_max_bytes,
            window_s=cfg.batch_window_s, cancel_waits=True)  # a batch reads the callers' buffers
        # key -> the last put_many call writing it, still running: a later call of the same
        # key waits for it, so concurrent puts of one key commit in call order (one entry per
        # key being written, so bounded by the puts in flight)
        self._putting: dict[bytes, asyncio.Future[None]] = {}
        # the running calls some of whose keys a later call took over in _putting (their
        # entries there are not all theirs to drop)
        self._overtaken: set[asyncio.Future[None]] = set()

    def _coalesce(self, keys: int, nbytes: int) -> bool:
        """Whether a call of this many keys and bytes joins a batcher (with other calls of
        this loop tick) rather than going out alone: only smaller than one batch."""
        cfg = self.config
        if cfg.batch and keys < cfg.batch_max_keys and nbytes < cfg.batch_max_bytes:
            self._link.bind_loop()
            return True
        return False

    @property
    def rx_pool_buffers(self) -> int:
        return self.reader.rx_pool_buffers

    @property
    def rx_buffers_reused(self) -> int:
        return self.reader.rx_buffers_reused

    def connections(self) -> list[Connection]:
        """The open connections, meta's first (a debug hook: e.g. tests checking TLS)."""
        return self._link.connections()

    @property
    def get_batches(self) -> int:
        """Batches the ``get()`` batcher has sent."""
        return self._get_batcher.batches

    # lifecycle -------------------------------------------------------------
    async def __aenter__(self) -> AsyncClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        await self._link.meta_conn()

    async def close(self) -> None:
        await self.layout_cache.close(self.config.request_timeout_s)
        await self.reader.close(self.config.request_timeout_s)
        await self._link.aclose()

    async def servers(self, *, refresh: bool = False) -> list[ServerEntry]:
        """The chunkservers meta knows, refreshed every ``servers_refresh_s``."""
        return await self._link.servers(refresh=refresh)

    # layouts ---------------------------------------------------------------
    async def lookup(self, keys: Sequence[bytes], *, use_cache: bool = True,
                     lease_s: float | None = None) -> list[Layout | None]:
        """The layouts of normalised keys (None: a miss), from the cache where it holds them.
        ``lease_s``: every key is looked up in meta, which leases the ones it finds."""
        out, missing, request = self.lookup_request(keys, use_cache=use_cache, lease_s=lease_s)
        if request is not None:
            self.looked_up(keys, out, missing, (await self._link.call_meta(request)).layouts)
        return out

    def cached(self, keys: list[bytes], lease_s: float | None,
               ) -> tuple[Sequence[Layout | None], list[Flat]] | None:
        """Every key's cached layout (:class:`~kvfs.layoutcache.FlatLayouts`: each taken from
        its flat form only when asked) and its flat form (:meth:`LayoutCache.flat_many`: every
        key cached, one extent of one replica: no step per key), for a read that takes them
        from the cache (no ``lease_s``); None: :meth:`lookup` them.  (The blocking client's
        reads in its callers' threads take them too.)"""
        flat = None if lease_s is not None else self.layout_cache.flat_many(keys, self.clock())
        return None if flat is None else (FlatLayouts(flat), flat)

    # lookup() in two halves, the RPC between them: the blocking client sends it from its
    # callers' threads (kvfs.blocking)
    def lookup_request(self, keys: Sequence[bytes], *, use_cache: bool = True,
                       lease_s: float | None = None,
                       ) -> tuple[list[Layout | None], list[int], rpc.Lookup | None]:
        """The layouts the cache holds, the indexes of the keys to look up, and the LOOKUP
        for them (None: none to look up)."""
        if use_cache and lease_s is None:
            out, missing = self.layout_cache.get_many(keys, self.clock())
        else:
            _check_lease(lease_s)
            out, missing = [None] * len(keys), list(range(len(keys)))
        if not missing:
            return out, missing, None
        return out, missing, rpc.Lookup(keys=[keys[i] for i in missing], lease_s=lease_s,
                                        holder=self.lease_holder if lease_s else "")

    def looked_up(self, keys: Sequence[bytes], out: list[Layout | None], missing: list[int],
                  layouts: Sequence[Layout | None]) -> None:
        """The LOOKUP's answer into ``out`` and the cache."""
        if len(layouts) != len(missing):
            raise RemoteProtocolError(f"LOOKUP of {len(missing)} keys answered {len(layouts)} layouts")
        for i, lay in zip(missing, layouts, strict=True):
            out[i] = lay
        self.layout_cache.put_many([keys[i] for i in missing], layouts)

    async def lookup_dirs(self, keys: Sequence[bytes]) -> list[Layout | bool]:
        """Fresh layouts of normalised keys, and for each miss whether keys lie under
        ``key + b"/"`` (True: a directory of :mod:`kvfs.fs`, False: nothing), in one LOOKUP."""
        h = await self._link.call_meta(rpc.Lookup(keys=list(keys), dirs=True))
        if h.dirs is None or len(h.dirs) != len(keys):
            raise RemoteProtocolError("LOOKUP with dirs: meta did not say which misses are directories")
        return [lay if lay is not None else d for lay, d in zip(h.layouts, h.dirs, strict=True)]

    async def layout(self, key: Key) -> Layout | None:
        """Where a value lives (extents, replicas); None on a miss."""
        return (await self.lookup([norm_key(key)], use_cache=False))[0]

    def parts(self, keys: Sequence[bytes], per_key: int = _KEY_BYTES,
              extra: Sequence[int] | None = None) -> list[slice] | None:
        """The slices of ``keys`` a batch call is cut into, made one after another, each of at
        most ``call_max_keys`` keys and a request of at most ``call_max_bytes`` (or half the
        smallest ``--max-header`` a server of the cluster said it takes): a key counts its
        length, ``per_key`` and its ``extra``.  None: one call takes them all (the usual case,
        decided without a step per key).  Past a server's limit a request would be refused
        (:func:`kvfs.transport.check_size`), and too many keys make too large an answer."""
        cfg = self.config
        n = len(keys)
        most = self._link.max_header // 2
        budget = (min(cfg.call_max_bytes, most) if most else cfg.call_max_bytes) - _REQUEST_BYTES
        fixed = n * per_key + (0 if extra is None else sum(extra))
        if n <= cfg.call_max_keys and (n * MAX_KEY_BYTES + fixed <= budget
                                       or sum(map(len, keys)) + fixed <= budget):
            return None
        sizes = [len(k) + per_key for k in keys]
        if extra is not None:
            sizes = [a + b for a, b in zip(sizes, extra, strict=True)]
        runs = split_batches(sizes, max_bytes=budget, max_items=cfg.call_max_keys)
        return None if len(runs) == 1 else [slice(r.start, r.stop) for r in runs]

    # writes ------------------------------------------------------------------
    async def put(self, key: Key, value: Value, *, ttl: float | None = None,
                  replicas: int | None = None, if_absent: bool = False,
                  meta: Mapping[str, Any] | None = None) -> bool:
        """Store one value; False only with ``if_absent`` and the key already present."""
        return (await self.put_many([(key, value)], ttl=ttl, replicas=replicas,
                                    if_absent=if_absent, meta=None if meta is None else [meta]))[0]

    async def put_many(self, items: Mapping[Key, Value] | Iterable[tuple[Key, Value]], *,
                       ttl: float | None = None, replicas: int | None = None,
                       if_absent: bool = False,
                       meta: Sequence[Mapping[str, Any] | None] | None = None) -> list[bool]:
        """Store many values: one append per chunkserver, one commit to meta.  Returns,
        per item, whether this call stored it.

        ``meta``: one small dict (or None) per item, in item order, stored with the key
        and returned by :meth:`get_meta` (msgpack types: str keys; str, bytes, int, float,
        bool, None, lists and dicts of them; meta's ``--max-key-meta`` bounds its size).

        ``if_absent``: keys already present (unexpired and readable) keep their value and
        are not written (False); meta says which in one ``EXISTS`` before the appends, and
        the commit is conditional, so of two writers racing on a key one value stays and
        the other writer gets False, with no error.

        Calls of this client that write the same key commit in call order (a later one
        waits for an earlier one still running), so the last call's value stays.

        Values are read from the caller's buffers, not copied; once a cancellation of this
        call has returned they are not read again (queued: stored nothing; sent: its batch
        has ended, and may have stored them).

        A call of more than ``call_max_keys`` keys, or of more keys and layouts than a
        request of ``call_max_bytes`` holds, is made as several in item order
        (:meth:`parts`): each commits on its own."""
        # (no layout built: the cache keeps what the put had, built when a read asks)
        return [e is not None for e in (await self._put_many(items, ttl, replicas, if_absent, meta))[1]]

    async def put_layouts(self, items: Mapping[Key, Value] | Iterable[tuple[Key, Value]], *,
                          ttl: float | None = None, replicas: int | None = None,
                          if_absent: bool = False,
                          meta: Sequence[Mapping[str, Any] | None] | None = None,
                          ) -> list[Layout | None]:
        """:meth:`put_many`, returning per item the layout meta committed it with (what a
        LOOKUP of the key answers until it changes), None where ``if_absent`` kept the key's
        value.  A layout built here (a value the cache keeps unbuilt) is the cache's entry too,
        so a read of the key does not build it again."""
        return self.layout_cache.build(*await self._put_many(items, ttl, replicas, if_absent, meta))

    async def _put_many(self, items: Mapping[Key, Value] | Iterable[tuple[Key, Value]],
                        ttl: float | None, replicas: int | None, if_absent: bool,
                        meta: Sequence[Mapping[str, Any] | None] | None,
                        ) -> tuple[list[bytes], list[Cached | None]]:
        """:meth:`put_many`'s work: the normalised keys, and what the layout cache now holds of
        each key written (:class:`~kvfs.layoutcache.Single` or Layout), None where
        ``if_absent`` kept it."""
        # (a list, the common case, without the ABC's isinstance: a few us a call)
        pairs = list(items) if type(items) is list or not isinstance(items, Mapping) \
            else list(items.items())
        if not pairs:
            return [], []
        keys = norm_keys([k for k, _ in pairs])
        values = [v for _, v in pairs]
        try:  # each value's views and size, checked at once in the common cases
            views, sizes = as_parts_many(values, bare=True)
        except InvalidArgument:  # again, naming the key (not built for every good value)
            for k, v in zip(keys, values, strict=True):
                as_parts(v, what=f"value for key {k[:64]!r}")
            raise
        biggest = max(sizes)
        if biggest > MAX_VALUE_BYTES:
            i = next(i for i, n in enumerate(sizes) if n > MAX_VALUE_BYTES)
            raise InvalidArgument(f"value of {sizes[i]} bytes for key {keys[i][:64]!r} exceeds the "
                                  f"limit of {MAX_VALUE_BYTES}")
        r = self.config.replicas if replicas is None else replicas
        if r < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {r}")
        if ttl is not None and ttl <= 0:
            raise InvalidArgument(f"ttl must be positive seconds or None, got {ttl}")
        metas = None
        if meta is not None:
            if len(meta) != len(keys):
                raise InvalidArgument(f"{len(keys)} items but {len(meta)} meta entries")
            metas = [_encode_meta(k, m) for k, m in zip(keys, meta, strict=True)]
        stripe = self.config.stripe_bytes
        extra = None  # each value's extents past its first, and its metadata
        if metas is not None or biggest > stripe:
            extra = [_REPLICA_BYTES * r * (n // stripe) + (0 if m is None else len(m))
                     for n, m in zip(sizes, metas or repeat(None), strict=False)]
        parts = self.parts(keys, _RECORD_BYTES + _REPLICA_BYTES * r, extra)
        if parts is None:
            return keys, await self._put_call(_PutCall(keys, views, sizes, metas, r, ttl, if_absent))
        out: list[Cached | None] = []
        for part in parts:
            out += await self._put_call(_PutCall(keys[part], views[part], sizes[part],
                                                 None if metas is None else metas[part],
                                                 r, ttl, if_absent))
        return keys, out

    async def _put_call(self, call: _PutCall) -> list[Cached | None]:
        """One put_many call (or part of one: :meth:`parts`), checked: in call order after
        the calls still writing its keys, coalesced with others where it is small."""
        keys = call.keys
        total = sum(call.sizes)
        loop = asyncio.get_running_loop()
        putting = self._putting
        # the calls running with these keys (per key in C; per running call below): none,
        # the usual case, found without a set of futures built
        running = (set() if putting.keys().isdisjoint(keys)
                   else cast(set[asyncio.Future[None]], set(map(putting.get, keys)) - {None}))
        earlier = {f for f in running if f.get_loop() is loop}
        if running:  # their keys taken over here: they must not drop them when they end
            self._overtaken |= running
        mine: asyncio.Future[None] = loop.create_future()
        putting.update(dict.fromkeys(keys, mine))
        try:
            if earlier:  # the same key in a put still running: it commits first, then this one
                await asyncio.wait(earlier)
            if self._coalesce(len(keys), total):
                layouts = await self._put_batcher.submit(call, total, count=len(keys), eager=True)
                if isinstance(layouts, KVFSError):
                    raise layouts
            else:
                layouts = await self._put(call)
        finally:
            waited = [f for f in earlier if not f.done()]
            if waited:  # cancelled while an earlier put of its keys runs: they stay held until
                # it ends, so a later put of them waits for it too (commits in call order)
                asyncio.gather(*waited).add_done_callback(lambda _: self._putting_ended(keys, mine))
            else:
                self._putting_ended(keys, mine)
        return layouts

    def _putting_ended(self, keys: list[bytes], mine: asyncio.Future[None]) -> None:
        """A put_many call's keys let go: a later put of them waiting on ``mine`` goes on."""
        mine.set_result(None)
        putting = self._putting
        if mine in self._overtaken:  # the keys no later call took over (still ``mine``)
            self._overtaken.discard(mine)
            deque(map(putting.pop, compress(keys, map(is_, map(putting.get, keys), repeat(mine))),
                      repeat(None)), maxlen=0)
        else:  # every key still ``mine`` (the common case): dropped in C, one pass
            deque(map(putting.pop, keys, repeat(None)), maxlen=0)

    async def _put(self, call: _PutCall, tried: dict[bytes, Layout] | None = None,
                   ) -> list[Cached | None]:
        layouts = await self.writer.put(call.keys, call.views, replicas=call.replicas, ttl=call.ttl,
                                        if_absent=call.if_absent, metas=call.metas, tried=tried,
                                        sizes=call.sizes)
        self.layout_cache.put_many(call.keys, layouts)
        return layouts

    async def _put_calls(self, calls: list[_PutCall]) -> list[list[Cached | None] | KVFSError]:
        """Concurrent put_many calls as few writes as can be: consecutive calls with the same
        options and no key in common are one put (one APPEND per server, one COMMIT); the
        groups go one after another, in call order.  A group that fails is retried call by
        call, and each call gets its own layouts or error: no call fails its neighbours.  With
        ``if_absent`` the retries know what the failed put sent (``tried``): its COMMIT may
        have been applied, and a key it stored is then the retry's, written."""
        groups: list[list[_PutCall]] = []
        seen: set[bytes] = set()
        for c in calls:
            g = groups[-1] if groups else None
            if (g is None or c.options != g[0].options
                    or len(seen) + len(c.keys) != len(seen.union(c.keys))):
                groups.append([c])
                seen = set(c.keys)
            else:
                g.append(c)
                seen.update(c.keys)
        out: list[list[Cached | None] | KVFSError] = []
        for g in groups:
            tried: dict[bytes, Layout] | None = {} if g[0].if_absent and len(g) > 1 else None
            if len(g) > 1:
                metas = (None if all(c.metas is None for c in g) else
                         [m for c in g for m in (c.metas or [None] * len(c.keys))])
                joined = _PutCall([k for c in g for k in c.keys], [v for c in g for v in c.views],
                                  [n for c in g for n in c.sizes], metas, *g[0].options)
                try:
                    layouts = await self._put(joined, tried)
                except KVFSError:
                    pass  # each call alone, below
                else:
                    at = 0
                    for c in g:
                        out.append(layouts[at : at + len(c.keys)])
                        at += len(c.keys)
                    continue
            for c in g:
                try:
                    out.append(await self._put(c, tried))
                except KVFSError as exc:
                    out.append(exc)
        return out

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

    # reads -------------------------------------------------------------------
    async def get(self, key: Key) -> bytes | None:
        """One value, or None on a miss; concurrent calls are batched together."""
        k = norm_key(key)
        if self.config.batch:
            self._link.bind_loop()
            return await self._get_batcher.submit(k, self.layout_cache.size_of(k))
        return (await self.get_many([k]))[0]

    async def get_many(self, keys: Iterable[Key], *, lease_s: float | None = None,
                       skip: frozenset[int] | set[int] = frozenset()) -> list[bytes | None]:
        """Values in key order; None for a miss.  ``lease_s``: the keys found are kept
        from eviction that long, or until :meth:`release` (their lookup goes to meta).
        ``skip``: chunkservers not to ask (``ReadPath.read_into``; the blocking client's
        read again of a call one of them did not answer in time)."""
        ks = norm_keys(keys)
        if not ks:
            return []
        if (parts := self.parts(ks)) is not None:  # too many for one call: in parts
            return [v for part in parts for v in await self.get_many(ks[part], lease_s=lease_s, skip=skip)]
        out: list[bytes | None]
        failed: dict[int, KVFSError] = {}
        lost: dict[int, Layout] = {}
        cached = self.cached(ks, lease_s)
        layouts, flat = cached or (await self.lookup(ks, lease_s=lease_s), None)
        whole = many_dests(layouts, flat)
        if whole is not None:
            # one-extent values (all of them here): small ones become bytes copied out of the
            # receive buffer, large ones are received into their bytes (many_dests)
            out, dests1 = whole
            for i in await self.reader.read_into(ks, layouts, dests1, out, failed=failed, lost=lost,
                                                 skip=skip, flat=flat):
                out[i] = None
            if failed:
                await self._unreadable("get_many", ks, failed, lost)
                for i in failed:
                    out[i] = None
            return out
        # a striped value: every value received straight into the bytes handed back, a
        # striped one extent by extent
        out, dests = _fresh([-1 if lay is None else lay.size for lay in layouts])
        misses = await self.reader.read_into(ks, layouts, dests, out, failed=failed, lost=lost,
                                             skip=skip)
        if failed:
            await self._unreadable("get_many", ks, failed, lost)
            misses.update(failed)
        for i in misses:
            out[i] = None
        return out

    async def _unreadable(self, what: str, keys: list[bytes], failed: dict[int, KVFSError],
                          lost: dict[int, Layout], *, raises: bool = True) -> None:
        """Keys of one read that no replica could serve: logged, their cached layouts
        dropped, the ``lost`` ones (every replica answered without good bytes) reported to
        meta (REPORT_LOST: it drops each key that still has the layout read), and raised
        (the first one's error, naming its key) under ``on_lost="raise"`` when ``raises``."""
        for i in failed:
            self.layout_cache.pop(keys[i])
        if lost:
            try:
                await self._link.call_meta(rpc.ReportLost(
                    items=[rpc.LostItem(keys[i], lay) for i, lay in lost.items()]))
            except KVFSError as exc:  # best effort: the GC's scrub finds them too
                log.warning("%s: could not report %d lost keys to meta: %s", what, len(lost), exc)
        first = next(iter(failed.values()))
        log.warning("%s: %d of %d keys could not be read from any replica (%s); first: %s",
                    what, len(failed), len(keys),
                    "raised" if raises and self.config.on_lost is OnLost.RAISE else "a miss each",
                    first)
        if raises and self.config.on_lost is OnLost.RAISE:
            raise first

    async def get_ranges(self, requests: Sequence[tuple[Key, int | None, int | None]],
                         ) -> list[bytes | None]:
        """Byte ranges ``value[start:end]`` (Python slice rules) of many keys in one batch.

        Only the extents that overlap a range are read (each whole, so its CRC-32C is
        verified): a 4 KiB range of a 1 GiB value reads one stripe unit, not 1 GiB.  A key
        no replica can serve is a miss or raises (``on_lost``), and is reported lost with its
        whole layout when every replica answered without good bytes, as :meth:`get_many`'s.
        """
        keys = norm_keys(k for k, _, _ in requests)
        if not keys:
            return []
        if (parts := self.parts(keys)) is not None:
            return [v for part in parts for v in await self.get_ranges(requests[part])]
        layouts = await self.lookup(keys)
        subs: list[Layout | None] = [None] * len(keys)  # each key's extents in its range
        dests: list[Dest] = [None] * len(keys)
        cuts = [(bytearray(), 0, 0)] * len(keys)  # the bytes read, and the range's in them
        failed: dict[int, KVFSError] = {}
        bad: set[int] = set()  # keys whose last read found every replica without good bytes
        todo: range | set[int] = range(len(keys))
        rereads = 0
        while True:  # as ReadPath.read_into: a stale key is read again at meta's new layout
            for i in todo:
                lay, (_, start, end) = layouts[i], requests[i]
                if lay is not None:
                    subs[i], dests[i], cuts[i] = _ranged(lay, start, end)
            if rereads:  # only the keys read again: their last read's verdict is replaced
                bad.difference_update(todo)
                reading = [subs[i] if i in todo else None for i in range(len(keys))]
            else:
                reading = subs
            stale = await self.reader.fetch(keys, reading, dests, None, failed, bad)
            if not stale:
                break
            for i in stale:
                self.layout_cache.pop(keys[i])
            fresh = await self.lookup([keys[i] for i in stale], use_cache=False)
            todo = set()
            for i, lay in zip(stale, fresh, strict=True):
                if lay is None:  # a miss
                    subs[i] = None
                elif lay == layouts[i]:  # the layout read, still meta's: its bytes are gone
                    failed[i] = bytes_gone(keys[i])
                elif rereads == RELOOKUPS:
                    failed[i] = still_moving(keys[i], "ranged read")
                    bad.discard(i)  # a moving layout is no proof of loss
                else:
                    layouts[i] = lay
                    todo.add(i)
            if not todo:
                break
            rereads += 1
        if failed:  # the lost ones reported with the whole layout read, as the mount's reads do
            await self._unreadable("get_ranges", keys, failed,
                                   {i: lay for i in failed if i in bad and (lay := layouts[i]) is not None})
        return [None if sub is None or i in failed else bytes(buf[a:b])
                for i, (sub, (buf, a, b)) in enumerate(zip(subs, cuts, strict=True))]

    async def get_into(self, keys: Iterable[Key], buffers: Sequence[Any], *,
                       lease_s: float | None = None,
                       skip: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Read values into caller buffers; one result per key.  ``lease_s``: as for
        :meth:`get_many`.  Destinations are received in place (by vectored receives,
        many destinations a receive); those under 64 KiB on average that a value does not
        fill, or fills only in part of several buffers, are received together and copied
        once (cheaper than a receive each).

        A key's buffer may be a list of buffers: its value is scattered over them in order
        (e.g. ``[k_half, v_half]``).  Each result is the value's size (a hit: that many
        leading bytes of the buffer(s) were written; where the read found the value
        overwritten at a smaller size meanwhile, bytes past it may hold part of the old
        one), ``kvfs.MISS`` (-1),
        ``kvfs.TOO_SMALL`` (-2: the value is larger than the buffers; nothing read, except
        where the read found the value overwritten at a new size meanwhile: part of the old
        one may be in the buffers, as after a miss) or,
        for a key whose bytes no replica could serve, ``kvfs.MISS`` (``on_lost="miss"``, the
        default) or ``kvfs.FAILED`` (-3, ``on_lost="raise"``).  No key's outcome affects
        another's.  Concurrent calls smaller than a batch share one batch (one LOOKUP,
        one READV per server); each gets its own results.  ``skip``: as for
        :meth:`get_many` (such a call is not batched).
        """
        ks, views, rooms = into_call(keys, buffers, lease_s)
        if not ks:
            return []
        if (parts := self.parts(ks)) is not None:
            return [n for part in parts
                    for n in await self._get_into(ks[part], views[part], rooms[part], lease_s, skip)]
        total = sum(rooms)
        if not skip and self._coalesce(len(ks), total):
            return await self._into_batcher.submit((ks, views, rooms, lease_s), total,
                                                   count=len(ks), eager=True)
        return await self._get_into(ks, views, rooms, lease_s, skip)

    async def _get_into_calls(self, calls: list[_IntoCall]) -> list[list[int]]:
        """Concurrent get_into calls as one read per ``lease_s`` asked; each call's results
        cut out of it."""
        if len(calls) == 1:
            return [await self._get_into(*calls[0])]
        groups: dict[float | None, list[int]] = {}
        for i, (_, _, _, lease_s) in enumerate(calls):
            groups.setdefault(lease_s, []).append(i)

        async def read(lease_s: float | None, idx: list[int]) -> list[int]:
            return await self._get_into([k for i in idx for k in calls[i][0]],
                                        [v for i in idx for v in calls[i][1]],
                                        [n for i in idx for n in calls[i][2]], lease_s)

        out: list[list[int]] = [[] for _ in calls]
        reads = await gather_all(*(read(ls, idx) for ls, idx in groups.items()))
        for idx, results in zip(groups.values(), reads, strict=True):
            at = 0
            for i in idx:
                n = len(calls[i][0])
                out[i] = results[at : at + n]
                at += n
        return out

    async def _get_into(self, ks: list[bytes], views: list[Views], rooms: list[int],
                        lease_s: float | None, skip: frozenset[int] | set[int] = frozenset(),
                        ) -> list[int]:
        """``rooms``: each key's buffer size; ``skip``: as for :meth:`get_many`."""
        cached = self.cached(ks, lease_s)
        layouts, flat = cached or (await self.lookup(ks, lease_s=lease_s), None)
        result, dests = into_dests(layouts, views, rooms, flat)
        failed: dict[int, KVFSError] = {}
        lost: dict[int, Layout] = {}

        def resized(i: int, lay: Layout) -> Dest:
            """A value found overwritten at a new size during the read: its destination."""
            result[i], dest = into_dest(lay.size, views[i], rooms[i])
            return dest

        misses = await self.reader.read_into(ks, layouts, dests, failed=failed, lost=lost,
                                             skip=skip, flat=flat, resized=resized)
        for i in misses:
            result[i] = MISS
        if failed:
            await self._unreadable("get_into", ks, failed, lost, raises=False)
            code = FAILED if self.config.on_lost is OnLost.RAISE else MISS
            for i in failed:
                result[i] = code
        return result

    # meta-only queries ---------------------------------------------------------
    async def exists_many(self, keys: Iterable[Key], *, lease_s: float | None = None) -> list[bool]:
        """Which keys are present (unexpired and readable).  ``lease_s``: those are kept
        from eviction that long, or until :meth:`release`."""
        request = self.exists_request(keys, lease_s)
        if request is None:
            return []
        if (parts := self.parts(request.keys)) is not None:
            return [e for part in parts for e in await self.exists_many(request.keys[part], lease_s=lease_s)]
        return (await self._link.call_meta(request)).exists

    # the requests of the calls that are one meta RPC, checked (None: no keys, no RPC); the
    # blocking client sends them from its callers' threads (kvfs.blocking)
    def exists_request(self, keys: Iterable[Key], lease_s: float | None) -> rpc.Exists | None:
        ks = norm_keys(keys)
        if not ks:
            return None
        _check_lease(lease_s)
        return rpc.Exists(keys=ks, lease_s=lease_s, holder=self.lease_holder if lease_s else "")

    def match_prefix_request(self, keys: Iterable[Key], lease_s: float | None,
                             ) -> rpc.MatchPrefix | None:
        ks = norm_keys(keys)
        if not ks:
            return None
        _check_lease(lease_s)
        return rpc.MatchPrefix(keys=ks, lease_s=lease_s, holder=self.lease_holder if lease_s else "")

    def release_request(self, keys: Iterable[Key]) -> rpc.Release | None:
        ks = norm_keys(keys)
        return rpc.Release(keys=ks, holder=self.lease_holder) if ks else None

    @property
    def link(self) -> ClusterLink:
        """The cluster's connections (:mod:`kvfs.cluster`)."""
        return self._link

    async def get_meta(self, keys: Iterable[Key]) -> list[dict[str, Any] | None]:
        """Each key's metadata (``put(..., meta=)``): a dict, ``{}`` for a key stored
        without any, None for a miss.  From the layout cache where it holds the key (the
        metadata is part of the immutable layout), so after a read it costs no RPC."""
        ks = norm_keys(keys)
        if not ks:
            return []
        if (parts := self.parts(ks)) is not None:
            return [m for part in parts for m in await self.get_meta(ks[part])]
        return [None if lay is None else {} if lay.meta is None else _META_DECODE.decode(lay.meta)
                for lay in await self.lookup(ks)]

    async def release(self, keys: Iterable[Key]) -> int:
        """End this client's leases of keys (taken by ``lease_s`` on any lookup; its
        :attr:`lease_holder`'s) before they expire; returns how many keys it had one on.
        Other holders' leases stay: GC may evict a key again once no holder leases it."""
        request = self.release_request(keys)
        if request is None:
            return 0
        if (parts := self.parts(request.keys)) is not None:
            return sum([await self.release(request.keys[part]) for part in parts])
        return (await self._link.call_meta(request)).released

    async def exists(self, key: Key) -> bool:
        k = norm_key(key)
        if self.config.batch:
            self._link.bind_loop()
            return await self._exists_batcher.submit(k)
        return (await self.exists_many([k]))[0]

    async def match_prefix(self, keys: Iterable[Key], *, lease_s: float | None = None) -> int:
        """How many leading keys are present and unexpired (optionally leased)."""
        request = self.match_prefix_request(keys, lease_s)
        if request is None:
            return 0
        if (parts := self.parts(request.keys)) is not None:  # in parts, up to the first miss
            n = 0
            for part in parts:
                keys_of = request.keys[part]
                got = await self.match_prefix(keys_of, lease_s=lease_s)
                n += got
                if got < len(keys_of):
                    break
            return n
        return (await self._link.call_meta(request)).n

    async def delete_many(self, keys: Iterable[Key]) -> int:
        ks = norm_keys(keys)
        if not ks:
            return 0
        if (parts := self.parts(ks, _RECORD_BYTES + _REPLICA_BYTES * self.config.replicas)) is not None:
            return sum([await self.delete_many(ks[part]) for part in parts])
        for k in ks:
            self.layout_cache.pop(k)
        try:
            return await self._delete(ks)
        except StaleLayout:
            # meta refused the whole DELETE, before deleting any key: a tombstone landed in a
            # chunk the GC reclaimed meanwhile (a full cluster compacts fast: 1 of 4,230
            # deletes in the full-cluster soak of 2026-12-05). Written again, once
            self.writer.rewritten += 1
            return await self._delete(ks)

    async def _delete(self, ks: list[bytes]) -> int:
        # tombstones first: a delete meta made is always on the chunks (kvfs.meta.tombstones)
        h = await self._link.call_meta(rpc.Delete(keys=ks, tombstones=await self.writer.tombstones(ks)))
        return h.deleted

    async def delete(self, key: Key) -> bool:
        return await self.delete_many([key]) == 1

    async def list(self, prefix: Key = b"", *, limit: int | None = None,
                   page_size: int = 1000) -> list[KeyInfo]:
        """Keys starting with ``prefix`` in key order (paginated under the hood)."""
        p = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        out: list[KeyInfo] = []
        start_after: bytes | None = None
        while limit is None or len(out) < limit:
            h = await self._link.call_meta(rpc.ListKeys(prefix=p, start_after=start_after, limit=page_size))
            out.extend(KeyInfo(*e) for e in h.entries)
            if not h.more:
                break
            start_after = h.last
        return out if limit is None else out[:limit]

    async def stats(self) -> dict[str, Any]:
        return rpc.to_dict(await self._link.call_meta(rpc.Stats()))


_META_ENCODE = msgspec.msgpack.Encoder()
_META_DECODE = msgspec.msgpack.Decoder(dict[str, Any])


def _encode_meta(key: bytes, meta: Mapping[str, Any] | None) -> bytes | None:
    """A key's metadata as msgpack (None: none), checked; errors name the key."""
    if meta is None:
        return None
    if not isinstance(meta, Mapping) or not all(isinstance(k, str) for k in meta):
        raise InvalidArgument(f"meta for key {key[:64]!r} must be a dict with str keys, "
                              f"got {type(meta).__name__}")
    if not meta:
        return None
    try:
        blob = _META_ENCODE.encode(dict(meta))
    except (TypeError, msgspec.EncodeError) as exc:
        raise InvalidArgument(f"meta for key {key[:64]!r} is not msgpack (str, bytes, int, float, "
                              f"bool, None, lists and dicts of them): {exc}") from None
    if len(blob) > MAX_META_BYTES:
        raise InvalidArgument(f"meta for key {key[:64]!r} is {len(blob)} bytes encoded; the "
                              f"protocol's limit is {MAX_META_BYTES} (meta's --max-key-meta is lower)")
    return blob


def many_dests(layouts: Sequence[Layout | None], flat: list[Flat] | None = None,
               ) -> tuple[list[bytes | None], list[Dest]] | None:
    """get_many's results to fill and the read's destinations, when every value found is one
    extent; None when one is striped.  Small values are copied out of a pooled receive
    (``WHOLE``); when one is ``SCATTER_MIN_BYTES`` or more, every value is received straight
    into the ``bytes`` handed back (:func:`~kvfs.buffers.fresh_bytes`, already in the
    results: a READV's answer lands in place only when none of its values is ``WHOLE``).
    ``flat``: the layouts' flat forms (:meth:`AsyncClient.cached`: every key a hit of one
    extent)."""
    if flat is not None:
        sizes = list(map(FLAT_SIZE, flat))
        if max(sizes) < SCATTER_MIN_BYTES:  # small values: no step per key
            return [b""] * len(layouts), [WHOLE] * len(layouts)
    else:
        if any([lay is not None and len(lay.extents) > 1 for lay in layouts]):
            return None
        sizes = [-1 if lay is None else lay.size for lay in layouts]
        if max(sizes) < SCATTER_MIN_BYTES:
            return ([None if n < 0 else b"" for n in sizes],
                    [WHOLE if n > 0 else None for n in sizes])
    return _fresh(sizes)


def _ranged(lay: Layout, start: int | None, end: int | None,
            ) -> tuple[Layout, Dest, tuple[bytearray, int, int]]:
    """For get_ranges: the layout of ``lay``'s extents that overlap ``value[start:end]``, a
    destination for them, and (those bytes, the range's start and end in them)."""
    lo, hi, _ = slice(start, end).indices(lay.size)
    chosen: list[Extent] = []
    pos = first = 0
    for e in lay.extents if hi > lo else ():
        if pos < hi and pos + e.length > lo:
            if not chosen:
                first = pos
            chosen.append(e)
        pos += e.length
    buf = bytearray(sum(e.length for e in chosen))
    sub = Layout(len(buf), 0, lay.created, lay.expires_at, tuple(chosen))
    return sub, [memoryview(buf)], (buf, lo - first, max(lo, hi) - first)


def _fresh(sizes: list[int]) -> tuple[list[bytes | None], list[Dest]]:
    """Values of these sizes (-1: a miss) received straight into new bytes: the results to
    hand back and the read's destinations (views of them; None for a miss or an empty one)."""
    out: list[bytes | None] = []
    dests: list[Dest] = []
    for n in sizes:
        value, view = (None, None) if n < 0 else fresh_value(n)
        out.append(value)
        dests.append(view)
    return out, dests


def into_call(keys: Iterable[Key], buffers: Sequence[Any], lease_s: float | None,
              ) -> tuple[list[bytes], list[Views], list[int]]:
    """A get_into call checked: its keys, each key's buffer views (a flat buffer's one
    view as it is) and their sizes."""
    ks = norm_keys(keys)
    if len(buffers) != len(ks):
        raise InvalidArgument(f"{len(ks)} keys but {len(buffers)} buffers")
    if not ks:
        return [], [], []
    views, rooms = as_parts_many(buffers, writable=True, what="buffer", bare=True)
    _check_lease(lease_s)
    return ks, views, rooms


def into_dests(layouts: Sequence[Layout | None], views: list[Views], rooms: list[int],
               flat: list[Flat] | None = None) -> tuple[list[int], Sequence[Dest]]:
    """get_into's results (sizes, ``MISS``, ``TOO_SMALL``) and the read's destinations.
    ``flat``: as for :func:`many_dests` (the values' sizes taken from them)."""
    result = ([MISS if lay is None else lay.size for lay in layouts] if flat is None
              else list(map(FLAT_SIZE, flat)))
    if result == rooms:  # the common case, checked in C: every key a hit filling its buffer
        return result, views
    each: list[Dest] = []
    for i, (lay, v, room) in enumerate(zip(layouts, views, rooms, strict=True)):
        if lay is None:
            each.append(None)
        else:
            result[i], dest = into_dest(lay.size, v, room)
            each.append(dest)
    return result, each


def into_dest(size: int, views: Views, room: int) -> tuple[int, Dest]:
    """A value of ``size`` bytes read into a key's buffers ``views`` of ``room`` bytes: its
    result (``size``, or ``TOO_SMALL``) and destination (None: nothing to read)."""
    if size > room:
        return TOO_SMALL, None
    return size, views if size == room else cut(views, 0, size)


def _check_lease(lease_s: float | None) -> None:
    if lease_s is not None and not 0 <= lease_s <= rpc.MAX_SECONDS:
        raise InvalidArgument(f"lease_s must be seconds >= 0 (0 or None: no lease), got {lease_s}")


def connect(addr: str | None = None, *, token: str | None = None,
            config: ClientConfig | None = None) -> AsyncClient:
    """``async with kvfs.connect("kvfs://127.0.0.1:7070") as kv: ...``"""
    return AsyncClient(addr, token=token, config=config)
