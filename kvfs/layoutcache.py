"""The client's cache of immutable layouts, and access tracking for LRU eviction.

Layouts never change once committed, so a cached one stays right until it expires
(dropped by ``expires_at``) or its bytes move (the chunkserver answers
``StaleLayout`` and the reader forgets it).  Keys read through the cache are told to
meta in one TOUCH now and then (every ``TOUCH_INTERVAL_S`` or 4096 keys), so
eviction sees them as recently used.

A put's value of one extent with one replica (the common case) is cached as a
:class:`Single`, one small object of what the put already had (made in C, no Layout, Extent
and Replica built and later freed per key): its :class:`Layout` is built the first time a
read asks for it (:meth:`LayoutCache.get_many`, :meth:`LayoutCache.flat_many`), or the put's
caller does (``AsyncClient.put_layouts``: :meth:`LayoutCache.build`), and kept in its place.

A layout of one extent with one replica (the common case) is also kept flat, made the
first time a read asks for it (:meth:`LayoutCache.flat_many`): what a read needs of it in
one tuple (:data:`Flat`), so a read of many such keys finds them with no Python step per
key and touches one small object per key, not the five a layout is made of.

The blocking client reads it from its callers' threads too (:mod:`kvfs.blocking`): its
changes are made under a lock, and a TOUCH due in such a thread is sent by the IO loop
(a key read while a TOUCH is being made may miss it: access times are advisory).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import islice, repeat
from operator import index, itemgetter
from typing import cast

import msgspec

from kvfs import rpc
from kvfs.cluster import ClusterLink
from kvfs.errors import KVFSError
from kvfs.layout import Extent, Layout, Replica

log = logging.getLogger("kvfs.client")
TOUCH_INTERVAL_S = 5.0
TOUCH_BATCH_KEYS = 4096

# A layout of one extent with one replica, as a read takes it: (server id, its READV range
# (chunk id, offset, length), CRC-32C, expires_at (inf: never), size, the layout)
Flat = tuple[int, tuple[int, int, int], int, float, int, Layout]
FLAT_SERVER = itemgetter(0)
FLAT_RANGE = itemgetter(1)
FLAT_CRC = itemgetter(2)
FLAT_EXPIRES = itemgetter(3)
FLAT_SIZE = itemgetter(4)
FLAT_LAYOUT = itemgetter(5)


class FlatLayouts(Sequence[Layout]):
    """The layouts of a read's :data:`Flat` forms, each taken from its flat form when asked,
    not listed up front: a read that goes well the common way (values copied out of one
    READV per server into buffers of their sizes) touches no key's :class:`Layout` (one
    object less per key to reach in memory seldom still in the CPU's cache); failover,
    values read in place and buffers of other sizes still take them, key by key."""

    __slots__ = ("_flat",)

    def __init__(self, flat: Sequence[Flat]) -> None:
        self._flat = flat

    def __len__(self) -> int:
        return len(self._flat)

    def __getitem__(self, i: int) -> Layout:  # type: ignore[override]  # (no slices asked)
        return self._flat[index(i)][5]  # a slice is a TypeError, not a wrong object

    def __iter__(self) -> Iterator[Layout]:
        return map(FLAT_LAYOUT, self._flat)


class Single(msgspec.Struct, frozen=True, gc=False):
    """A written value of one extent with one replica as the cache keeps it until a read asks
    for its :class:`Layout` (:meth:`layout`): a put makes one per key by ``map`` in C from
    the columns it has (bench/RESULTS.md, "layouts built only when a read asks").  Not
    tracked by Python's cyclic GC, as a Layout is not."""

    size: int
    crc: int
    server: int
    chunk: int
    offset: int
    created: float
    expires_at: float | None
    meta: bytes | None

    def layout(self) -> Layout:
        return Layout(self.size, self.crc, self.created, self.expires_at,
                      (Extent(self.size, self.crc, (Replica(self.server, self.chunk, self.offset),)),),
                      self.meta)


Cached = Layout | Single  # what the cache holds per key


def flatten(lay: Layout) -> Flat | None:
    """``lay`` as a :data:`Flat` when it is one extent of one replica holding the whole
    value (not empty); None otherwise."""
    ext = lay.extents
    if len(ext) != 1 or len(ext[0].replicas) != 1 or not lay.size or ext[0].length != lay.size:
        return None
    e = ext[0]
    rep = e.replicas[0]
    return (rep.server_id, (rep.chunk_id, rep.offset, e.length), e.crc,
            math.inf if lay.expires_at is None else lay.expires_at, lay.size, lay)


class LayoutCache:
    """An LRU of at most ``entries`` layouts.  :meth:`clear` is the documented hook for
    tests and tools that want the next read to ask meta."""

    def __init__(self, link: ClusterLink, entries: int) -> None:
        self._link = link
        self.entries = entries
        self._layouts: OrderedDict[bytes, Cached] = OrderedDict()
        # the flat form of cached layouts a read asked for (flat_many): keys of _layouts only
        self._flat: dict[bytes, Flat] = {}
        self._flat_expires = False  # whether one was ever of a layout that expires
        self._touched: set[bytes] = set()  # keys read via the cache, not yet told to meta
        self._touch_at = time.monotonic()
        self._touch_task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()  # changes from the IO loop and the blocking callers

    def __len__(self) -> int:
        return len(self._layouts)

    def size_of(self, key: bytes) -> int:
        lay = self._layouts.get(key)
        return 0 if lay is None else lay.size

    def put(self, key: bytes, layout: Layout) -> None:
        self.put_many([key], [layout])

    def put_many(self, keys: Sequence[bytes], layouts: Sequence[Cached | None]) -> None:
        """Cache the layouts of a write (None: a key it did not write; a :class:`Single`: its
        layout built when a read asks), the most recently used last."""
        cache = self._layouts
        move = cache.move_to_end
        flat = self._flat
        with self._lock:
            if None not in layouts:  # the common case, every key written: no Python step per key
                cache.update(zip(keys, cast(Sequence[Cached], layouts), strict=True))
                deque(map(move, keys), maxlen=0)
                if flat:  # a key's flat form is of the layout it replaces
                    deque(map(flat.pop, keys, repeat(None)), maxlen=0)
            else:
                for key, layout in zip(keys, layouts, strict=True):
                    if layout is not None:
                        cache[key] = layout
                        move(key)
                        flat.pop(key, None)
            excess = len(cache) - self.entries
            if excess > 0:  # the least recently used go, in C (a full cache: every put evicts)
                old = list(islice(cache, excess))
                deque(map(cache.pop, old), maxlen=0)
                if flat:
                    deque(map(flat.pop, old, repeat(None)), maxlen=0)

    def pop(self, key: bytes) -> None:
        with self._lock:
            self._layouts.pop(key, None)
            self._flat.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._layouts.clear()
            self._flat.clear()

    def get_many(self, keys: Sequence[bytes], now: float) -> tuple[list[Layout | None], list[int]]:
        """Cached layouts (marked read) and the indexes of the keys to look up.  A cached
        layout that expired is a miss (None), not looked up: expiry is final."""
        cache = self._layouts
        got: list[Cached | None] = list(map(cache.get, keys))
        if Single in set(map(type, got)):  # (checked in C) written by a put, not yet read
            self.build(keys, got)
        out = cast(list[Layout | None], got)
        # one pass in C for the common case (all cached, none expired); the rest per key
        odd = [i for i, lay in enumerate(out)
               if lay is None or (lay.expires_at is not None and lay.expires_at <= now)]
        missing: list[int] = []
        if odd:
            for i in odd:
                if out[i] is None:
                    missing.append(i)
                else:
                    self.pop(keys[i])
                    out[i] = None
            self._touched.update([k for k, lay in zip(keys, out, strict=True) if lay is not None])
        else:
            self._touched.update(keys)
        self._flush_due()
        return out, missing

    def build(self, keys: Sequence[bytes], got: list[Cached | None]) -> list[Layout | None]:
        """``got`` (``keys``' cache entries, as a read found them or a put cached them) with
        each :class:`Single` built into its Layout in place, and returned; the built Layout is
        kept in the Single's place in the cache (the same LRU position) unless a put replaced
        it meanwhile, or it was dropped (evicted, expired, cleared: not put back)."""
        cache = self._layouts
        with self._lock:
            for i, e in enumerate(got):
                if isinstance(e, Single):
                    got[i] = lay = e.layout()
                    if cache.get(keys[i]) is e:
                        cache[keys[i]] = lay
        return cast(list[Layout | None], got)

    def flat_many(self, keys: Sequence[bytes], now: float) -> list[Flat] | None:
        """The flat forms of the cached layouts of ``keys`` (marked read, as :meth:`get_many`
        marks them) when every key has one, unexpired; None otherwise (none marked: the
        caller takes :meth:`get_many`'s way).  A cached layout's flat form is made the first
        time it is asked for here."""
        if not keys:
            return None
        flat = self._flat
        recs = list(map(flat.get, keys))
        if None in recs and not self._flatten(keys, recs):
            return None
        full = cast(list[Flat], recs)
        if self._flat_expires and min(map(FLAT_EXPIRES, full)) <= now:
            return None  # get_many drops the expired ones
        self._touched.update(keys)
        self._flush_due()
        return full

    def _flatten(self, keys: Sequence[bytes], recs: list[Flat | None]) -> bool:
        """Fill the Nones of ``recs`` with the flat forms of those keys' cached layouts
        (kept for the next read); False at the first key with none (not cached, or not one
        extent of one replica)."""
        cache, flat = self._layouts, self._flat
        with self._lock:  # a put replacing a layout meanwhile drops its flat form after this
            for i, rec in enumerate(recs):
                if rec is None:
                    lay = cache.get(keys[i])
                    if isinstance(lay, Single):  # written by a put, not yet read: built now
                        lay = cache[keys[i]] = lay.layout()
                    rec = None if lay is None else flatten(lay)
                    if rec is None:
                        return False
                    flat[keys[i]] = recs[i] = rec
                    if rec[3] != math.inf:
                        self._flat_expires = True
        return True

    def _flush_due(self) -> None:
        if self._touched and (len(self._touched) >= TOUCH_BATCH_KEYS
                              or time.monotonic() - self._touch_at > TOUCH_INTERVAL_S):
            self.flush_touches()

    def flush_touches(self) -> None:
        """Tell meta, in one batch, which keys were read from cached layouts (LRU eviction).
        Called in another thread than the link's loop's, it asks that loop to."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or loop is not self._link.loop:  # e.g. a blocking client's caller
            self._link.call_soon_threadsafe(self.flush_touches)
            return
        if not self._touched or self._sending() is not None:
            return
        keys, self._touched = list(self._touched), set()
        self._touch_at = time.monotonic()

        async def send() -> None:
            try:
                await self._link.call_meta(rpc.Touch(keys=keys))
            except KVFSError as exc:  # best effort: access times are advisory
                log.debug("touch of %d keys failed: %s", len(keys), exc)

        self._touch_task = loop.create_task(send())

    def _sending(self) -> asyncio.Task[None] | None:
        """The TOUCH still being sent on this event loop, if any.  One of another loop (the
        client was closed there and now follows this one, ``kvfs/cluster.py``) is none: a
        future's callbacks run on its own loop, so while that loop is not running, waiting here
        for its task, even a finished one, would take the whole timeout, and a task left
        pending there would hold every later TOUCH back for ever."""
        task = self._touch_task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            return None
        return task

    async def close(self, timeout_s: float) -> None:
        """Send what is pending (if meta is still connected) and wait for it."""
        if self._link.meta_open:
            self.flush_touches()
        task = self._sending()
        if task is not None:
            await asyncio.wait([task], timeout=timeout_s)
