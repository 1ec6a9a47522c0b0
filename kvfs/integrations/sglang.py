"""SGLang HiCache storage on kvfs, loaded through SGLang's ``dynamic`` backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvfs",
        "module_path": "kvfs.integrations.sglang", "class_name": "KvfsHiCacheStorage",
        "interface_v1": 1, "addr": "kvfs://10.0.0.1:7070", "lease_s": 30}'

One kvfs key per page: ``namespace/page_hash`` (see :func:`kvfs.prefix.chain_keys` with
``style="sglang"``).  With ``interface_v1`` the pages move without copies in every host
layout: a page's value is gathered from (and scattered back into) its regions of the host
pool -- K then V for ``page_first``/``page_first_direct``, K and V of each layer for
``layer_first``.  ``batch_exists`` is one ``match_prefix`` that leases the hit pages,
made in SGLang's thread; a
write is one ``put_many(..., if_absent=True)``: the pages already stored are skipped.  A dead or slow cluster makes every call a miss or a
failure within the configured timeout, never an exception into the engine.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvfs.buffers import Parts
from kvfs.client import TOO_SMALL
from kvfs.config import EngineConfig, from_mapping
from kvfs.integrations._common import SOFT_ERRORS, TensorBytes, log, open_client, wait
from kvfs.prefix import namespaced

# keys of extra_config that belong to SGLang's dynamic loader, not to kvfs
_LOADER_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


def default_namespace(cfg: HiCacheStorageConfig) -> str:
    """``sglang/<model>/tp<rank>of<size>`` (MLA pages are the same on every TP rank)."""
    model = (cfg.model_name or "model").replace("/", "-")
    if cfg.is_mla_model:
        return f"sglang/{model}/mla/pp{cfg.pp_rank}of{cfg.pp_size}"
    return f"sglang/{model}/tp{cfg.tp_rank}of{cfg.tp_size}/pp{cfg.pp_rank}of{cfg.pp_size}"


class KvfsHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = from_mapping(EngineConfig, extra, ignore=_LOADER_KEYS)
        self.namespace = self.config.namespace or default_namespace(storage_config)
        self.storage_config = storage_config
        self.client = open_client(self.config)
        self.mem_pool_host: Any = None
        self._host: TensorBytes | None = None
        self._regions: _Regions | None = None
        # each host page's regions as views, made on the page's first use and kept: one slot
        # per page of the (fixed) host pool, so at most one Parts per host page
        self._views: list[Parts | None] = []

    # keys and buffers --------------------------------------------------------
    def _key(self, page_hash: str) -> bytes:
        return namespaced(self.namespace, page_hash)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._host = TensorBytes(mem_pool_host.kv_buffer)
        self._regions = _Regions.of(mem_pool_host, self._host.base)
        self._views = [None] * (int(mem_pool_host.size) // int(mem_pool_host.page_size))

    def _page_parts(self, n_pages: int, host_indices: torch.Tensor) -> list[Parts]:
        """Each page's regions of the host pool, in the order SGLang's zero-copy backends use
        (``get_page_buffer_meta``): views, never copies, checked once for the whole call.
        A page's views are made the first time it is used and kept (the host pool does not
        move once registered), so a call on pages used before makes no view at all."""
        assert self._host is not None, "register_mem_pool_host() was not called"
        if self._regions is not None:
            page = int(self.mem_pool_host.page_size)
            starts = host_indices[::page].tolist()
            views = self._views
            if (starts and min(starts) >= 0 and max(starts) < len(views) * page
                    and not any(map(page.__rmod__, starts))):  # whole pages of the pool
                out = list(map(views.__getitem__, map(page.__rfloordiv__, starts)))
                if None in out:
                    new = [i for i, v in enumerate(out) if v is None]
                    offs, sizes = self._regions.offsets([starts[i] for i in new])
                    for i, v in zip(new, self._host.parts(offs, sizes, len(sizes) // len(new),
                                                          base=0), strict=True):
                        out[i] = views[starts[i] // page] = v
                return cast(list[Parts], out)  # every slot filled
            offs, sizes = self._regions.offsets(starts)
            return self._host.parts(offs, sizes, len(sizes) // n_pages, base=0)
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return self._host.parts(ptrs, sizes, len(ptrs) // n_pages)

    def _page_bytes(self) -> int:
        pool = self.mem_pool_host
        return int(pool.get_size_per_token()) * int(pool.page_size)

    # zero-copy (v1) interface ---------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        parts = self._page_parts(len(keys), host_indices)
        want = self._page_bytes()
        try:
            sizes = wait(self.client.submit_get_into([self._key(k) for k in keys], parts),
                         self.config)
        except SOFT_ERRORS as exc:
            log.warning("kvfs HiCache get of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        if TOO_SMALL in sizes:
            log.warning("kvfs HiCache: a stored page is larger than the host page (%d bytes)", want)
        return [n == want for n in sizes]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        parts = self._page_parts(len(keys), host_indices)
        return self._put([self._key(k) for k in keys], parts)

    def _put(self, keys: list[bytes], values: list[Any]) -> list[bool]:
        """Store the pages not stored yet (write-once: a page with this hash holds these
        bytes already): one ``put_many(..., if_absent=True)``, whose EXISTS tells which, so
        a present page's bytes are never sent; two engines racing on a page store it once."""
        try:
            wait(self.client.submit_put_many(list(zip(keys, values, strict=True)),
                                             ttl=self.config.ttl_s, if_absent=True), self.config)
        except SOFT_ERRORS as exc:
            log.warning("kvfs HiCache set of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [True] * len(keys)

    # lookups ---------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages are stored: one ``match_prefix``, leasing them for
        ``lease_s`` so eviction leaves them until SGLang has read them.  SGLang waits for
        the answer, so it is asked in SGLang's thread (the blocking call, on the client's
        own meta sockets: no hop to kvfs's IO thread and back)."""
        if not keys:
            return 0
        try:
            return self.client.match_prefix([self._key(k) for k in keys],
                                            lease_s=self.config.lease_s)
        except SOFT_ERRORS as exc:
            log.warning("kvfs HiCache lookup of %d pages failed: %s", len(keys), exc)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # generic (copying) interface, used without interface_v1 ----------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        if not keys:
            return []
        if target_locations is None:
            raise ValueError("kvfs HiCache batch_get needs target_locations (flat page tensors)")
        try:
            sizes = wait(self.client.submit_get_into([self._key(k) for k in keys],
                                                     list(target_locations)), self.config)
        except SOFT_ERRORS as exc:
            log.warning("kvfs HiCache get of %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        return [t if n == t.numel() * t.element_size() else None
                for t, n in zip(target_locations, sizes, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        vals = [v if v.is_contiguous() else v.contiguous() for v in values]
        return all(self._put([self._key(k) for k in keys], vals))

    # housekeeping ----------------------------------------------------------------
    def clear(self) -> None:
        try:
            infos = self.client.list(self.namespace + "/")
            self.client.delete_many([i.key for i in infos])
        except SOFT_ERRORS as exc:
            log.warning("kvfs HiCache clear failed: %s", exc)

    def close(self) -> None:
        self.client.close()

    def get_stats(self) -> None:
        return None


class _Regions:
    """Where the regions of a page are in the host buffer, as lines in the page's first
    token index ``t``: region ``j`` is ``sizes[j]`` bytes at ``at[j] + t * step[j]`` (true of
    every host layout: pointer arithmetic on one buffer).  Read off SGLang's own
    ``get_page_buffer_meta`` for the first two pages and checked against it on the last
    one, so a layout where it does not hold keeps calling SGLang's function; where it
    holds, a call's regions cost a few array operations instead of SGLang's Python loop
    over pages and layers."""

    def __init__(self, at: np.ndarray, step: np.ndarray, sizes: list[int]) -> None:
        self.at, self.step, self.sizes = at, step, sizes

    @classmethod
    def of(cls, pool: Any, base: int) -> _Regions | None:
        page, size = int(pool.page_size), int(pool.size)
        if size < 3 * page:
            return None

        def meta(t: int) -> tuple[np.ndarray, list[int]]:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(t, t + page))
            return np.asarray(ptrs, dtype=np.int64) - base, [int(n) for n in sizes]

        at, sizes = meta(0)
        second, _ = meta(page)
        last = (size // page - 1) * page
        end, end_sizes = meta(last)
        if ((second - at) % page).any():
            return None
        step = (second - at) // page
        if end_sizes != sizes or not np.array_equal(at + last * step, end):
            return None
        return cls(at, step, sizes)

    def offsets(self, starts: list[int]) -> tuple[list[int], list[int]]:
        """The byte offsets and sizes of the regions of the pages starting at ``starts``,
        page by page."""
        offs = np.asarray(starts, dtype=np.int64)[:, None] * self.step + self.at
        return offs.ravel().tolist(), self.sizes * len(starts)
