"""LMCache remote storage on kvfs: a ``RemoteConnector`` loaded as a remote storage plug-in::

    remote_storage_plugins: [kvfs]
    extra_config:
      remote_storage_plugin.kvfs.module_path: kvfs.integrations.lmcache
      remote_storage_plugin.kvfs.class_name: KvfsConnector
      kvfs_addr: kvfs://10.0.0.1:7070

(not ``remote_url: plugin://kvfs`` as well: LMCache would build a second backend and write
every chunk twice).  Settings are flat ``kvfs_*`` keys of ``extra_config`` (LMCache does not
tell a plug-in its name): ``kvfs_addr``, ``kvfs_token``, ``kvfs_namespace`` (default
``lmcache``), ``kvfs_timeout_s``, ``kvfs_lease_s``, ``kvfs_ttl_s``, ``kvfs_key_memo``.

One value per chunk: LMCache's chunk header and the payload, gathered on put and scattered
on get, never copied.  Gets, puts and lookups are batched (one ``get_into`` / ``put_many`` /
``match_prefix`` per call).  Gets run on LMCache's own event loop (an ``AsyncClient`` there:
no hop to another thread and back on the way to the engine); puts and the async lookup go
through a blocking client's IO thread, and the synchronous lookups (``contains``, batched or
not) are made in LMCache's calling thread, on that client's own meta sockets.  The two clients are one lease holder (one random
``ClientConfig.lease_holder`` drawn per connector), so kvfs counts the engine once.  kvfs reads (puts) and writes (gets) LMCache's CPU buffers, so
the connector holds a reference on each memory object until kvfs is done with it, and
LMCache's buffer pool -- which LMCache frees before it closes the remote backends -- is
freed only once no kvfs call uses it: its ``close`` first lets LMCache's loop start the puts
queued on it, then waits for every kvfs call in flight (bounded; past the bound the pool is
left allocated, never freed under a running call).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import threading
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvfs.client import TOO_SMALL, AsyncClient
from kvfs.config import EngineConfig, from_mapping
from kvfs.integrations._common import SOFT_ERRORS, client_config, log, wait
from kvfs.prefix import namespaced
from kvfs.sync import Client

T = TypeVar("T")


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class KvfsConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any = None, **_: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = (config.extra_config if config is not None else None) or {}
        self.config = from_mapping(EngineConfig, extra, prefix="kvfs_")
        self.namespace = self.config.namespace or "lmcache"
        self._prefix = namespaced(self.namespace, "")  # what comes before each chunk's name
        # _keys's template, the key fields it is for (held: their ids stay theirs) and the
        # keys made from it by chunk hash (a new dict with each new template text)
        self._last_template: tuple[Any, Any, Any, Any, bytes | None, dict[int, bytes]] = (
            None, None, None, None, None, {})
        self._memo_lock = threading.Lock()  # held to add to a memo: its size stays bounded
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        # two clients, one lease holder: kvfs sees one engine (a release by either would
        # end the other's leases, and the pair takes one of --max-lease-holders' places)
        ccfg = replace(client_config(self.config), lease_holder=secrets.token_hex(8))
        self.client = Client(self.config.addr, token=self.config.token, config=ccfg)
        # gets, on LMCache's loop (it connects there on first use)
        self.aclient = AsyncClient(self.config.addr, token=self.config.token, config=ccfg)
        self._tasks: set[asyncio.Future[Any]] = set()  # its calls in flight
        self._full_header = b""  # the header of a full chunk of this engine's format
        # kvfs calls that read or write LMCache's CPU buffer pool, until they are done
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        # LMCache closes (frees) its CPU buffer pool before the remote backends: make the
        # pool wait until kvfs is done with it
        alloc = local_cpu_backend.memory_allocator
        free_pool = alloc.close

        def close_after_io() -> Any:
            if not self._drain():
                log.error("kvfs LMCache: kvfs calls still use the CPU buffer pool at close; "
                          "the pool is left allocated rather than freed under them")
                return None
            return free_pool()

        alloc.close = close_after_io

    def _key(self, key: CacheEngineKey) -> bytes:
        """The kvfs key of one chunk: ``namespace/`` + LMCache's ``key.to_string()``."""
        return self._prefix + key.to_string().encode()

    def _keys(self, keys: list[CacheEngineKey], keep: bool = True) -> list[bytes]:
        """:meth:`_key` of each key, byte for byte, without ``to_string`` per key (about
        1.8 us a key here, most of a 64-key lookup's cost beyond the kvfs call): a plain
        ``CacheEngineKey`` without tags is ``model@world_size@worker_id@<hash hex>@dtype``,
        so its key is a template filled with the chunk hash, made once per run of keys with
        the same other fields (the same objects: the same text) and kept for the next call.
        Keys made from a template are kept by chunk hash with it (at most ``key_memo``, the
        dict cleared when full, a new one for a template of other text): an engine asks for
        the same leading chunks of a shared prefix over and over.  Any other key
        (a subclass, tags, a hash that is not an ``int``) goes through ``to_string``.

        ``keep=False`` (the lookups): a call whose first chunk's key is not in the memo is
        made from the last template alone (:meth:`_fill`), neither looked up in the memo
        nor added to it: a first lookup of chunks is the engine's critical path, and the
        memo's miss and keeping cost about as much as filling the template (its get or put
        then keeps the keys)."""
        if not keep or not self.config.key_memo:
            filled = self._fill(keys)
            if filled is not None:
                return filled
        model, size, worker, dtype, tmpl, memo = self._last_template
        limit = self.config.key_memo
        out: list[bytes] = []
        append = out.append
        made_h: list[int] = []  # the chunk hashes and keys made here, for the memo
        made_k: list[bytes] = []
        for k in keys:
            h = k.chunk_hash
            if type(k) is not CacheEngineKey or type(h) is not int or k.tags is not None:
                append(self._key(k))
                continue
            if (k.model_name is not model or k.dtype is not dtype or k.worker_id is not worker
                    or k.world_size is not size):
                model, size, worker, dtype = k.model_name, k.world_size, k.worker_id, k.dtype
                made = self._template(k)
                if made != tmpl:
                    if made_h and limit:  # the keys made from the template before
                        self._remember(memo, made_h, made_k, limit)
                        made_h, made_k = [], []
                    tmpl, memo = made, {}
                self._last_template = (model, size, worker, dtype, tmpl, memo)
            if tmpl is None:
                append(self._key(k))
                continue
            key = memo.get(h)
            if key is None:
                key = tmpl % h
                made_h.append(h)
                made_k.append(key)
            append(key)
        if made_h and limit:
            self._remember(memo, made_h, made_k, limit)
        return out

    def _fill(self, keys: list[CacheEngineKey]) -> list[bytes] | None:
        """The keys of a call whose keys are all plain ``CacheEngineKey`` of the last
        template's fields, ``int`` chunk hashes and no tags, the first one's not in the
        memo: the template filled with each hash, one ``%`` per key and no other work per
        key; None for any other call (:meth:`_keys` makes it)."""
        model, size, worker, dtype, tmpl, memo = self._last_template
        if tmpl is None or not keys or (memo and keys[0].chunk_hash in memo):
            return None
        out: list[bytes] = []
        append = out.append
        for k in keys:
            h = k.chunk_hash
            if (type(k) is not CacheEngineKey or type(h) is not int or k.tags is not None
                    or k.model_name is not model or k.dtype is not dtype
                    or k.worker_id is not worker or k.world_size is not size):
                return None
            append(tmpl % h)
        return out

    def _remember(self, memo: dict[int, bytes], hashes: list[int], keys: list[bytes],
                  limit: int) -> None:
        """Add ``hashes`` -> ``keys`` to ``memo`` (all of one template), clearing it first
        if they would take it past ``limit``: one lock per call, not per key, and the size
        never over ``limit``, whichever threads add."""
        with self._memo_lock:
            if len(memo) + len(hashes) > limit:
                memo.clear()
            memo.update(zip(hashes[:limit], keys[:limit], strict=True))

    def _template(self, key: CacheEngineKey) -> bytes | None:
        """``%``-template of :meth:`_key` for keys that differ from ``key`` only in their
        ``int`` chunk hash (``%x``, as ``to_string`` writes it); None where ``to_string``
        is not ``head + hash hex + tail`` (a format this code does not know)."""
        text, head = key.to_string(), f"{key.model_name}@{key.world_size}@{key.worker_id}@"
        digest = f"{key.chunk_hash:x}"
        if not text.startswith(head + digest):
            return None
        tmpl = ((self._prefix + head.encode()).replace(b"%", b"%%") + b"%x"
                + text[len(head) + len(digest) :].encode().replace(b"%", b"%%"))
        return tmpl if tmpl % key.chunk_hash == self._key(key) else None

    def _header(self, obj: MemoryObj) -> bytes:
        return bytes(RemoteMetadata(obj.get_size(), obj.get_shapes(), obj.get_dtypes(),
                                    obj.get_memory_format()).serialize())

    def _flush_loop(self, deadline: float) -> None:
        """Let LMCache's loop run what was queued on it before now: a put that LMCache
        scheduled but that has not started yet registers its kvfs call on its first step."""
        if not self.loop.is_running() or _on_loop(self.loop):
            return
        fut = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop)
        try:
            fut.result(max(0.0, deadline - time.monotonic()))
        except (TimeoutError, concurrent.futures.CancelledError):
            fut.cancel()

    def _drain(self) -> bool:
        """Wait until no kvfs call uses LMCache's memory (bounded); False if some still do."""
        deadline = time.monotonic() + 3 * self.config.timeout_s
        while True:
            self._flush_loop(deadline)
            with self._lock:
                pending = list(self._inflight)
            if not pending:
                return True
            _done, late = concurrent.futures.wait(
                pending, timeout=max(0.0, deadline - time.monotonic()))
            if late:
                log.warning("kvfs LMCache: %d calls still running at close", len(late))
                return False

    async def _io(self, fut: concurrent.futures.Future[T], objs: list[MemoryObj]) -> T:
        """Await a kvfs call that reads or writes the memory objects ``objs``.  Until kvfs
        itself is done with them (a caller that gives up does not cancel it) each holds one
        more reference, so LMCache cannot hand its memory to another chunk, and the call counts
        as in flight, so the pool's close waits for it."""
        for obj in objs:
            obj.ref_count_up()
        with self._lock:
            self._inflight.add(fut)

        def done(_: concurrent.futures.Future[T]) -> None:
            with self._lock:
                self._inflight.discard(fut)
            for obj in objs:
                obj.ref_count_down()

        fut.add_done_callback(done)
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)),
                                      3 * self.config.timeout_s)

    async def _io_here(self, coro: Coroutine[Any, Any, T], objs: list[MemoryObj]) -> T:
        """:meth:`_io` for a call of :attr:`aclient`, run on this (LMCache's) loop: the
        call is a task that a caller giving up does not cancel, holding the objects'
        references until it ends, and counted in flight (a future of ``_inflight``, which a
        pool close on another thread waits for; :meth:`close` awaits the task)."""
        for obj in objs:
            obj.ref_count_up()
        marker: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._inflight.add(marker)
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(_: asyncio.Future[T]) -> None:
            self._tasks.discard(task)
            with self._lock:
                self._inflight.discard(marker)
            for obj in objs:
                obj.ref_count_down()
            marker.set_result(None)

        task.add_done_callback(done)
        return await asyncio.wait_for(asyncio.shield(task), 3 * self.config.timeout_s)

    # puts --------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        if not keys:
            return
        items = []
        for key, obj in zip(self._keys(keys), memory_objs, strict=True):
            payload = obj.byte_array
            parts = [self._header(obj), payload] if self.save_chunk_meta else [payload]
            items.append((key, parts))
        try:
            # chunk keys name their content: one already stored (by any engine) is not sent again
            await self._io(self.client.submit_put_many(items, ttl=self.config.ttl_s, if_absent=True),
                           memory_objs)
        except SOFT_ERRORS as exc:
            log.warning("kvfs LMCache put of %d chunks failed: %s", len(keys), exc)

    # gets ----------------------------------------------------------------------------
    def _allocate(self, n: int) -> list[Any]:
        """Up to ``n`` full-chunk memory objects from LMCache's CPU pool: one batched
        allocation where the pool has the room (about half the CPU of one call per object
        here), else one at a time, evicting as LMCache does; fewer when the pool is full."""
        backend = self.local_cpu_backend
        if n > 1:
            objs = backend.batched_allocate(self.meta_shapes, self.meta_dtypes, n, self.meta_fmt,
                                            eviction=False)  # its eviction assumes layer keys
            if objs is not None:
                return list(objs)
        out = []
        for _ in range(n):
            obj = backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:
                break  # LMCache's buffer is full: the rest are misses
            out.append(obj)
        return out

    async def _get_objs(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One ``get_into`` for all keys, straight into newly allocated memory objects."""
        objs = self._allocate(len(keys))
        if objs and not self._full_header:
            self._full_header = self._header(objs[0])  # allocated full-size
        headers = [bytearray(self.remote_metadata_bytes) for _ in objs]
        bufs = [[h, o.byte_array] if self.save_chunk_meta else [o.byte_array]
                for h, o in zip(headers, objs, strict=True)]
        try:
            sizes = await self._io_here(
                self.aclient.get_into(self._keys(keys[: len(objs)]), bufs), objs)
        except SOFT_ERRORS as exc:
            log.warning("kvfs LMCache get of %d chunks failed: %s", len(keys), exc)
            sizes = [-1] * len(objs)
        out: list[MemoryObj | None] = []
        larger: list[int] = []
        for i, (obj, header, n) in enumerate(zip(objs, headers, sizes, strict=True)):
            got = self._finish(obj, header, n)
            if got is None:
                obj.ref_count_down()
                if n == TOO_SMALL and self.save_chunk_meta:
                    larger.append(i)
            out.append(got)
        if larger:  # chunks larger than this engine's full chunk: allocate what each header says
            await self._get_larger([keys[i] for i in larger], larger, out)
        return out + [None] * (len(keys) - len(objs))

    async def _get_larger(self, keys: list[CacheEngineKey], slots: list[int],
                          out: list[MemoryObj | None]) -> None:
        try:
            heads = await asyncio.wait_for(asyncio.wrap_future(self.client.submit_get_ranges(
                [(k, 0, self.remote_metadata_bytes) for k in self._keys(keys)])),
                3 * self.config.timeout_s)
        except SOFT_ERRORS as exc:
            log.warning("kvfs LMCache get of %d chunks failed: %s", len(keys), exc)
            return
        for key, slot, head in zip(keys, slots, heads, strict=True):
            if head is None:
                continue
            meta = RemoteMetadata.deserialize(head)
            obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
            if obj is None:
                continue
            header = bytearray(self.remote_metadata_bytes)
            try:
                n = (await self._io(self.client.submit_get_into(
                    [self._key(key)], [[header, obj.byte_array]]), [obj]))[0]
            except SOFT_ERRORS:
                n = -1
            if n == len(header) + obj.get_size() and RemoteMetadata.deserialize(header) == meta:
                out[slot] = obj
            else:
                obj.ref_count_down()

    def _finish(self, obj: Any, header: bytearray, n: int) -> Any:
        if n < 0:
            return None
        if self.save_chunk_meta:
            n -= len(header)
            if header == self._full_header and n == obj.get_size():
                return obj  # a full chunk of this engine's format: as allocated
            meta = RemoteMetadata.deserialize(header)
            if meta.length != n or list(meta.dtypes) != list(self.meta_dtypes):
                log.warning("kvfs LMCache: a stored chunk does not match this engine's format")
                return None
        if n <= 0:
            return None
        try:
            return self.reshape_partial_chunk(obj, n)
        except ValueError as exc:
            log.warning("kvfs LMCache: %s", exc)
            return None

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self._get_objs([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._get_objs(list(keys))

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading run of hits; the rest are released."""
        objs = await self._get_objs(list(keys))
        out: list[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                for rest in objs[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(obj)
        return out

    # lookups ---------------------------------------------------------------------------
    def _match(self, keys: list[CacheEngineKey], lease: bool) -> int:
        """The synchronous lookups: LMCache waits for the answer, so it is asked in
        LMCache's thread (the blocking call, on the client's own meta sockets: no hop to
        kvfs's IO thread and back)."""
        if not keys:
            return 0
        try:
            return self.client.match_prefix(self._keys(keys, keep=False),
                                            lease_s=self.config.lease_s if lease else None)
        except SOFT_ERRORS as exc:
            log.warning("kvfs LMCache lookup of %d chunks failed: %s", len(keys), exc)
            return 0

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.batched_async_contains("", [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._match([key], False) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._match(list(keys), True)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        if not keys:
            return 0
        try:
            fut = self.client.submit_match_prefix(
                self._keys(keys, keep=False), lease_s=self.config.lease_s if pin else None)
            n: int = await asyncio.wait_for(asyncio.wrap_future(fut), 3 * self.config.timeout_s)
            return n
        except SOFT_ERRORS as exc:
            log.warning("kvfs LMCache lookup of %d chunks failed: %s", len(keys), exc)
            return 0

    # housekeeping --------------------------------------------------------------------
    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return bool(wait(self.client.submit_delete_many([self._key(key)]), self.config))
        except SOFT_ERRORS:
            return False

    async def list(self) -> list[str]:
        infos = self.client.list(self.namespace + "/")
        return [i.key[len(self.namespace) + 1 :].decode() for i in infos]

    async def close(self) -> None:
        if self._tasks:  # the gets on this loop (the pool's close waits for the rest)
            await asyncio.wait(list(self._tasks), timeout=3 * self.config.timeout_s)
        self._drain()
        await self.aclient.close()
        self.client.close()
