"""Values that never sit whole in memory: a put fed by an iterator of buffers, a read by ranges.

It uses the client's public parts: ``client.writer`` (:class:`kvfs.writepath.WritePath`:
``append``, ``commit``), ``client.reader`` (:class:`kvfs.readpath.ReadPath`: ``fetch``)
and ``client.lookup``.

``put_stream`` cuts what arrives into stripe units and appends each as soon as it is full
(up to ``ClientConfig.stream_window_units`` units in flight), then commits one layout at the
end: the commit is still the linearisation point, so a stream that fails half way leaves
only garbage for the GC, never a partial value.  ``ValueReader`` pins the layout it opened
and reads ranges of it; ``chunks()`` walks the whole value with the same bounded window.

``StreamPut`` is the same put fed by pushes (the FUSE mount's writes), and ``read_units``
reads the stripe units of many values in one batch (the mount's reads).

Memory: about ``stream_window_units`` times ``stripe_bytes`` per stream, whatever the value's size.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvfs.buffers import as_view
from kvfs.crc import crc32c_combine
from kvfs.errors import InvalidArgument, KVFSError, StaleLayout
from kvfs.layout import MAX_VALUE_BYTES, Extent, Key, Layout, norm_key

if TYPE_CHECKING:
    from kvfs.client import AsyncClient

Chunks = AsyncIterable[Any] | Iterable[Any]  # of bytes-like objects


async def _aiter(chunks: Chunks) -> AsyncIterator[Any]:
    if isinstance(chunks, AsyncIterable):
        async for c in chunks:
            yield c
    else:
        for c in chunks:
            yield c


async def put_stream(client: AsyncClient, key: Key, chunks: Chunks, *, size: int | None = None,
                     ttl: float | None = None, replicas: int | None = None) -> int:
    """Store the concatenation of ``chunks`` under ``key``; returns its size.

    ``size``, when given, is checked before the commit (a short or long stream commits
    nothing).  Each full stripe unit is appended while the next ones arrive."""
    k = norm_key(key)
    r = client.config.replicas if replicas is None else replicas
    if r < 1:
        raise InvalidArgument(f"replicas must be >= 1, got {r}")
    if ttl is not None and ttl <= 0:
        raise InvalidArgument(f"ttl must be positive seconds or None, got {ttl}")
    if size is not None and not 0 <= size <= MAX_VALUE_BYTES:
        raise InvalidArgument(f"size {size} is outside 0..{MAX_VALUE_BYTES}")
    stripe = client.config.stripe_bytes
    window = asyncio.Semaphore(max(1, client.config.stream_window_units))
    extents: list[Extent | None] = []
    tasks: set[asyncio.Task[None]] = set()
    failed: list[BaseException] = []
    whole = total = 0  # whole: the value's CRC-32C, combined from its units' at the end

    async def write(i: int, unit: memoryview) -> None:
        try:
            (lay,) = await client.writer.append([k], [[unit]], replicas=r, ttl=ttl, first=start + i)
            (extents[i],) = lay.extents
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            window.release()

    async def submit(unit: memoryview) -> None:
        await window.acquire()  # at most `window` units held
        if failed:
            window.release()
            raise failed[0]
        extents.append(None)
        t = asyncio.get_running_loop().create_task(write(len(extents) - 1, unit))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    start = random.randrange(1 << 16)  # units go round-robin over the servers from here
    buf, fill = bytearray(stripe), 0
    try:
        async for piece in _aiter(chunks):
            view = as_view(piece)
            total += view.nbytes
            if total > MAX_VALUE_BYTES or (size is not None and total > size):
                limit = MAX_VALUE_BYTES if size is None or size > MAX_VALUE_BYTES else size
                raise InvalidArgument(f"stream for key {k[:64]!r} is longer than {limit} bytes")
            while view.nbytes:
                take = min(stripe - fill, view.nbytes)
                buf[fill:fill + take] = view[:take]
                fill += take
                view = view[take:]
                if fill == stripe:
                    await submit(memoryview(buf))
                    buf, fill = bytearray(stripe), 0
        if fill:
            await submit(memoryview(buf)[:fill])
        if tasks:
            await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if size is not None and total != size:
        raise InvalidArgument(f"stream for key {k[:64]!r} ended after {total} of {size} bytes")
    done = tuple(e for e in extents if e is not None)
    assert len(done) == len(extents)
    for i, e in enumerate(done):  # the whole CRC from the units' (each byte summed once)
        whole = crc32c_combine(whole, e.crc, e.length) if i else e.crc
    (lay,) = await client.writer.commit([k], [Layout(total, whole, 0.0, None, done)], ttl)
    if lay is not None:  # always (no if_absent)
        client.layout_cache.put(k, lay)
    return total


class ValueReader:
    """One committed value, read by ranges from the layout it was opened with.

    A layout the GC relocates is followed (same size and CRC-32C); a value replaced or
    deleted while being read raises :class:`StaleLayout`, never mixes two values."""

    def __init__(self, client: AsyncClient, key: bytes, layout: Layout) -> None:
        self.client = client
        self.key = key
        self.layout = layout

    @property
    def size(self) -> int:
        return self.layout.size

    def unit_at(self, pos: int) -> tuple[int, Extent | None]:
        """The value offset and extent of the stripe unit holding byte ``pos``;
        ``(size, None)`` at or past the end."""
        start = 0
        for e in self.layout.extents:
            if pos < start + e.length:
                return start, e
            start += e.length
        return self.size, None

    def _extents(self, lo: int, hi: int) -> tuple[int, tuple[Extent, ...]]:
        """The extents covering ``[lo, hi)`` and the value offset of the first."""
        chosen: list[Extent] = []
        pos = first = 0
        for e in self.layout.extents:
            if pos >= hi:
                break
            if pos + e.length > lo:
                if not chosen:
                    first = pos
                chosen.append(e)
            pos += e.length
        return first, tuple(chosen)

    async def read(self, start: int = 0, end: int | None = None) -> bytes:
        """``value[start:end]`` (slice rules); reads only the stripe units it overlaps."""
        lo, hi, _ = slice(start, end).indices(self.size)
        if hi <= lo:
            return b""
        for _ in range(2):
            first, chosen = self._extents(lo, hi)
            n = sum(e.length for e in chosen)
            buf = bytearray(n)
            sub = Layout(n, 0, self.layout.created, self.layout.expires_at, chosen)
            if not await self.client.reader.fetch([self.key], [sub], [[memoryview(buf)]], None):
                return bytes(memoryview(buf)[lo - first:hi - first])
            await self._follow()
        raise StaleLayout(f"key {self.key[:64]!r}: its bytes moved twice during one read; retry")

    async def _follow(self) -> None:
        (fresh,) = await self.client.lookup([self.key], use_cache=False)
        old = self.layout
        if fresh is None or fresh.size != old.size or fresh.crc != old.crc:
            raise StaleLayout(f"key {self.key[:64]!r} was replaced or deleted while being read")
        self.layout = fresh

    async def chunks(self) -> AsyncIterator[bytes]:
        """The whole value in order, one stripe unit at a time, the next few read ahead."""
        window = max(1, self.client.config.stream_window_units)
        spans: list[tuple[int, int]] = []
        pos = 0
        for e in self.layout.extents:
            spans.append((pos, pos + e.length))
            pos += e.length
        ahead: list[asyncio.Task[bytes]] = []
        loop = asyncio.get_running_loop()
        try:
            for i in range(len(spans)):
                while len(ahead) < window and i + len(ahead) < len(spans):
                    ahead.append(loop.create_task(self.read(*spans[i + len(ahead)])))
                yield await ahead.pop(0)
        finally:
            for t in ahead:
                t.cancel()
            await asyncio.gather(*ahead, return_exceptions=True)


async def open_read(client: AsyncClient, key: Key) -> ValueReader | None:
    """A reader of ``key``'s current value, or None on a miss."""
    k = norm_key(key)
    (lay,) = await client.lookup([k])
    return None if lay is None else ValueReader(client, k, lay)


class StreamPut:
    """:func:`put_stream` fed by pushes: ``await feed(piece)`` returns once the piece is
    queued (it waits while the stream's window is full), ``finish()`` commits and returns
    the size, ``abort()`` (or ``cancel()``) commits nothing.  An error of the stream comes
    out of the next ``feed``/``finish``."""

    def __init__(self, client: AsyncClient, key: Key, *, ttl: float | None = None,
                 replicas: int | None = None) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
        self._task = asyncio.get_running_loop().create_task(
            put_stream(client, key, self._pieces(), ttl=ttl, replicas=replicas))

    async def _pieces(self) -> AsyncIterator[Any]:
        while (piece := await self._queue.get()) is not None:
            yield piece

    def _raise(self) -> None:
        if self._task.cancelled():
            raise KVFSError("the stream was aborted")
        self._task.result()  # its error, if it failed
        raise KVFSError("the stream has already been committed")

    async def _push(self, item: Any) -> None:
        if self._task.done():
            self._raise()
        put = asyncio.ensure_future(self._queue.put(item))
        try:
            await asyncio.wait({put, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not put.done():
                put.cancel()
        if not put.done() or put.cancelled():
            self._raise()

    async def feed(self, piece: Any) -> None:
        """Queue ``piece`` (a bytes-like object the caller no longer changes)."""
        await self._push(piece)

    async def finish(self) -> int:
        """Commit what was fed; returns the value's size."""
        await self._push(None)
        return await self._task

    def cancel(self) -> None:
        self._task.cancel()

    async def abort(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def read_units(client: AsyncClient, wants: Sequence[tuple[ValueReader | bytes, int]],
                     alloc: Callable[[int], bytearray | memoryview] = bytearray,
                     ) -> list[tuple[ValueReader, int, bytes | bytearray | memoryview] | None]:
    """For each ``(reader or key, offset)``: the stripe unit holding that offset, as
    ``(reader, unit start, bytes)`` (``b""`` at or past the end), or None for a key that is
    missing.  Keys are looked up in one call, to readers pinned to their layouts; every unit
    is then read in one fetch, into a buffer from ``alloc`` (given its size).  A unit no
    replica can serve follows the client's
    ``on_lost``: None, as a miss (``miss``), or its error (``raise``); either way it is
    logged and, when every replica answered without good bytes, reported to meta."""
    keys = [w for w, _ in wants if not isinstance(w, ValueReader)]
    found = iter(await client.lookup(keys) if keys else [])
    readers: list[ValueReader | None] = []
    for w, _ in wants:
        if isinstance(w, ValueReader):
            readers.append(w)
        else:
            lay = next(found)
            readers.append(None if lay is None else ValueReader(client, w, lay))
    slots: list[int] = []
    subs: list[Layout | None] = []
    bufs: list[bytearray | memoryview] = []
    starts: list[int] = []
    for i, (r, (_, pos)) in enumerate(zip(readers, wants, strict=True)):
        start, e = (0, None) if r is None else r.unit_at(pos)
        starts.append(start)
        if r is not None and e is not None:
            slots.append(i)
            subs.append(Layout(e.length, 0, r.layout.created, r.layout.expires_at, (e,)))
            bufs.append(alloc(e.length))
    got: dict[int, bytes | bytearray | memoryview] = {}
    lost: set[int] = set()
    if slots:
        ours = [readers[i] for i in slots]
        unit_keys = [r.key for r in ours if r is not None]
        failed: dict[int, KVFSError] = {}
        bad: set[int] = set()
        stale = set(await client.reader.fetch(unit_keys, subs, [[memoryview(b)] for b in bufs],
                                              None, failed, bad))
        if failed:  # raises under on_lost="raise"
            await client._unreadable("mount read", unit_keys, failed, {
                j: r.layout for j, r in enumerate(ours) if j in failed and j in bad and r is not None})
            lost = {slots[j] for j in failed}
        for j, i in enumerate(slots):
            if j in failed:
                continue
            if j in stale:  # relocated by the GC: followed, or StaleLayout if replaced
                r = readers[i]
                assert r is not None
                await r._follow()
                got[i] = await r.read(starts[i], starts[i] + len(bufs[j]))
            else:
                got[i] = bufs[j]  # not copied: nobody writes it again
    out: list[tuple[ValueReader, int, bytes | bytearray | memoryview] | None] = []
    for i, r in enumerate(readers):
        out.append(None if r is None or i in lost else (r, starts[i], got.get(i, b"")))
    return out
