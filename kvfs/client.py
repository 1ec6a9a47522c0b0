"""The kvfs client: async API first, a blocking :class:`Client` on top.

:class:`AsyncClient` is a thin front over the modules that do the work:

- :mod:`kvfs.cluster`: connections to meta and the chunkservers, the live server list;
- :mod:`kvfs.layoutcache`: immutable layouts cached, reads told to meta (LRU);
- :mod:`kvfs.placement` + :mod:`kvfs.writepath`: put_many -> one APPEND per
  chunkserver -> one COMMIT;
- :mod:`kvfs.readpath`: get_many -> one READV per chunkserver, replica failover,
  CRC-32C of every extent, bytes into the caller's buffers;
- :mod:`kvfs._batch`: concurrent single-key calls coalesced into batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfs import rpc
from kvfs._batch import Batcher
from kvfs.address import format_addr, lookup_token, parse_addr
from kvfs.buffers import as_view
from kvfs.cluster import ClusterLink, ServerEntry
from kvfs.config import ClientConfig
from kvfs.errors import InvalidArgument, StaleLayout
from kvfs.layout import MAX_VALUE_BYTES, Extent, Key, Layout, norm_key, norm_keys
from kvfs.layoutcache import LayoutCache
from kvfs.readpath import WHOLE, ReadPath
from kvfs.writepath import WritePath

Value = Any  # bytes-like: bytes, bytearray, memoryview, numpy array, CPU torch tensor

__all__ = ["AsyncClient", "KeyInfo", "ServerEntry", "connect"]


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key: bytes
    size: int
    created: float
    expires_at: float | None
    extents: int


class AsyncClient:
    """``async with kvfs.connect(addr) as kv: ...``

    Public counters: ``rpc_counts`` (RPCs sent, by op name), ``layout_cache`` (its
    ``clear()`` makes the next read ask meta), ``rx_pool_buffers`` and
    ``rx_buffers_reused`` (the read path's pooled receive buffers).
    """

    def __init__(self, addr: str | None = None, *, token: str | None = None,
                 config: ClientConfig | None = None) -> None:
        host, port = parse_addr(addr)
        self.addr = format_addr(host, port)
        self.token = lookup_token(token, addr=self.addr)
        self.config = cfg = config or ClientConfig()
        self.clock = time.time
        self._link = ClusterLink(host, port, self.token, connect_timeout_s=cfg.connect_timeout_s,
                                 request_timeout_s=cfg.request_timeout_s,
                                 servers_refresh_s=cfg.servers_refresh_s)
        self.rpc_counts = self._link.rpc_counts
        self.layout_cache = LayoutCache(self._link, cfg.layout_cache_entries)
        self._writer = WritePath(self._link, cfg, lambda: self.clock())
        self._reader = ReadPath(self._link, max_rpc_bytes=cfg.max_read_rpc_bytes,
                                relookup=lambda keys: self._lookup(keys, use_cache=False),
                                forget=self.layout_cache.pop)
        self._get_batcher: Batcher[bytes, bytes | None] = Batcher(
            self.get_many, max_items=cfg.batch_max_keys, max_bytes=cfg.batch_max_bytes,
            window_s=cfg.batch_window_s)
        self._exists_batcher: Batcher[bytes, bool] = Batcher(
            self.exists_many, max_items=cfg.batch_max_keys, max_bytes=cfg.batch_max_bytes,
            window_s=cfg.batch_window_s)

    @property
    def rx_pool_buffers(self) -> int:
        return self._reader.rx_pool_buffers

    @property
    def rx_buffers_reused(self) -> int:
        return self._reader.rx_buffers_reused

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
        self._link.close()

    async def servers(self, *, refresh: bool = False) -> list[ServerEntry]:
        """The chunkservers meta knows, refreshed every ``servers_refresh_s``."""
        return await self._link.servers(refresh=refresh)

    # layouts ---------------------------------------------------------------
    async def _lookup(self, keys: Sequence[bytes], *, use_cache: bool = True) -> list[Layout | None]:
        if use_cache:
            out, missing = self.layout_cache.get_many(keys, self.clock())
        else:
            out, missing = [None] * len(keys), list(range(len(keys)))
        if missing:
            h = await self._link.call_meta(rpc.Lookup(keys=[keys[i] for i in missing]))
            for i, lay in zip(missing, h.layouts, strict=True):
                if lay is not None:
                    out[i] = lay
                    self.layout_cache.put(keys[i], lay)
        return out

    async def layout(self, key: Key) -> Layout | None:
        """Where a value lives (extents, replicas); None on a miss."""
        return (await self._lookup([norm_key(key)], use_cache=False))[0]

    # writes ------------------------------------------------------------------
    async def put(self, key: Key, value: Value, *, ttl: float | None = None,
                  replicas: int | None = None) -> None:
        await self.put_many([(key, value)], ttl=ttl, replicas=replicas)

    async def put_many(self, items: Mapping[Key, Value] | Iterable[tuple[Key, Value]], *,
                       ttl: float | None = None, replicas: int | None = None) -> None:
        """Store many values: one append per chunkserver, one commit to meta."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        if not pairs:
            raise InvalidArgument("empty key list")
        keys = [norm_key(k) for k, _ in pairs]
        views = [as_view(v) for _, v in pairs]
        for k, v in zip(keys, views, strict=True):
            if v.nbytes > MAX_VALUE_BYTES:
                raise InvalidArgument(f"value of {v.nbytes} bytes for key {k[:64]!r} exceeds the "
                                      f"limit of {MAX_VALUE_BYTES}")
        r = self.config.replicas if replicas is None else replicas
        if r < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {r}")
        if ttl is not None and ttl <= 0:
            raise InvalidArgument(f"ttl must be positive seconds or None, got {ttl}")
        layouts = await self._writer.put(keys, views, replicas=r, ttl=ttl)
        for k, lay in zip(keys, layouts, strict=True):
            self.layout_cache.put(k, lay)

    # reads -------------------------------------------------------------------
    async def get(self, key: Key) -> bytes | None:
        """One value, or None on a miss; concurrent calls are batched together."""
        k = norm_key(key)
        if self.config.batch:
            return await self._get_batcher.submit(k, self.layout_cache.size_of(k))
        return (await self.get_many([k]))[0]

    async def get_many(self, keys: Iterable[Key]) -> list[bytes | None]:
        """Values in key order; None for a miss."""
        ks = norm_keys(keys)
        layouts = await self._lookup(ks)
        # one-extent values become bytes straight from the receive buffer (one copy);
        # striped ones are assembled in a bytearray first
        bufs: list[bytearray | None] = [
            None if lay is None or len(lay.extents) < 2 else bytearray(lay.size) for lay in layouts]
        out: list[bytes | None] = [None if lay is None else b"" for lay in layouts]
        dests = [memoryview(b) if b is not None else (WHOLE if lay is not None and lay.size else None)
                 for b, lay in zip(bufs, layouts, strict=True)]
        misses = await self._reader.read_into(ks, layouts, dests, out)
        return [None if i in misses else bytes(b) if b is not None else o
                for i, (b, o) in enumerate(zip(bufs, out, strict=True))]

    async def get_ranges(self, requests: Sequence[tuple[Key, int | None, int | None]],
                         ) -> list[bytes | None]:
        """Byte ranges ``value[start:end]`` (Python slice rules) of many keys in one batch.

        Only the extents that overlap a range are read (each whole, so its CRC-32C is
        verified): a 4 KiB range of a 1 GiB value reads one stripe unit, not 1 GiB.
        """
        keys = norm_keys(k for k, _, _ in requests)
        for attempt in (0, 1):
            layouts = await self._lookup(keys, use_cache=attempt == 0)
            subs: list[Layout | None] = []
            dests: list[memoryview | None] = []
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
                dests.append(memoryview(buf))
                cuts.append((buf, lo - first, max(lo, hi) - first))
            stale = await self._reader.fetch(keys, subs, dests, None)
            if not stale:
                return [None if sub is None else bytes(buf[a:b])
                        for sub, (buf, a, b) in zip(subs, cuts, strict=True)]
            for i in stale:
                self.layout_cache.pop(keys[i])
        raise StaleLayout("layouts changed twice during one ranged read; retry")

    async def get_into(self, keys: Iterable[Key], buffers: Sequence[Any]) -> list[int]:
        """Read values into caller buffers; returns each size, -1 for a miss."""
        ks = norm_keys(keys)
        if len(buffers) != len(ks):
            raise InvalidArgument(f"{len(ks)} keys but {len(buffers)} buffers")
        views = [as_view(b, writable=True, what=f"buffer {i}") for i, b in enumerate(buffers)]
        layouts = await self._lookup(ks)
        dests: list[memoryview | None] = []
        for k, lay, v in zip(ks, layouts, views, strict=True):
            if lay is not None and lay.size > v.nbytes:
                raise InvalidArgument(f"buffer of {v.nbytes} bytes is too small for {k[:64]!r} "
                                      f"({lay.size} bytes)")
            dests.append(None if lay is None else v[: lay.size])
        misses = await self._reader.read_into(ks, layouts, dests)
        return [-1 if lay is None or i in misses else lay.size for i, lay in enumerate(layouts)]

    # meta-only queries ---------------------------------------------------------
    async def exists_many(self, keys: Iterable[Key]) -> list[bool]:
        return (await self._link.call_meta(rpc.Exists(keys=norm_keys(keys)))).exists

    async def exists(self, key: Key) -> bool:
        k = norm_key(key)
        if self.config.batch:
            return await self._exists_batcher.submit(k)
        return (await self.exists_many([k]))[0]

    async def match_prefix(self, keys: Iterable[Key], *, lease_s: float | None = None) -> int:
        """How many leading keys are present and unexpired (optionally leased)."""
        return (await self._link.call_meta(rpc.MatchPrefix(keys=norm_keys(keys), lease_s=lease_s))).n

    async def delete_many(self, keys: Iterable[Key]) -> int:
        ks = norm_keys(keys)
        for k in ks:
            self.layout_cache.pop(k)
        return (await self._link.call_meta(rpc.Delete(keys=ks))).deleted

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


def connect(addr: str | None = None, *, token: str | None = None,
            config: ClientConfig | None = None) -> AsyncClient:
    """``async with kvfs.connect("kvfs://127.0.0.1:7070") as kv: ...``"""
    return AsyncClient(addr, token=token, config=config)
