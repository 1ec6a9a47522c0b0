"""A batch of (key, layout) as one packed blob: the form a COMMIT carries them in
(:class:`kvfs.rpc.Commit` ``packed``).

The nested form (one msgpack array per layout, :mod:`kvfs.layout`) costs meta about
2 us per key to unpack, check and stamp.  The packed form is columns of fixed-width
little-endian numbers, read with ``array.frombytes`` (one copy per column, no object per
number) and checked a column at a time in C: the common shape (one extent of one replica
per value, no metadata) on the columns' bytes (counts, and each bound on the numbers' top
bytes), anything else with ``min``/``max``/``sum`` over the numbers; only the keys (cut by
one ``struct`` format) and the :class:`~kvfs.layout.Layout` objects meta's index keeps
are built per key, already stamped with meta's commit time.  Layout::

    head      "<4sIIII"  magic b"KVP1", keys n, extents e, replicas r, metadata bytes m
    key_len   u16[n]
    size      u32[n]     the value's size
    crc       u32[n]     the value's CRC-32C
    extents   u32[n]     how many extents the value has (they follow in order)
    meta_len  u32[n]     bytes of the key's metadata; 0xFFFFFFFF: none
    ext_len   u32[e]
    ext_crc   u32[e]
    ext_reps  u8[e]      how many replicas the extent has (they follow in order)
    server    u32[r]
    chunk     u64[r]
    offset    u64[r]
    keys      the keys back to back (sum of key_len bytes)
    metas     the metadata back to back (m bytes)

Nothing may follow.  Every bound of the nested form holds here too (key and value sizes,
extents per value, replicas per extent, 63-bit chunk ids and offsets, extents adding up
to the value's size, each chunk id naming its replica's server); a blob breaking one
raises :class:`~kvfs.errors.InvalidArgument` naming what and, where it is one item's
fault, which item and key.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise, repeat
from operator import index
from typing import TypeVar, overload

from kvfs.errors import InvalidArgument
from kvfs.layout import (
    MAX_EXTENTS,
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    MAX_REPLICAS,
    MAX_VALUE_BYTES,
    Extent,
    Layout,
    Replica,
    misfiled_why,
    server_of_chunk,
)

MAGIC = b"KVP1"
LAZY_PAGE = 2048  # rows a LazyStaged builds at a time while iterated whole
HEAD = struct.Struct("<4sIIII")
NO_META = 0xFFFFFFFF
MAX_KEYS = 1 << 20  # keys in one blob: kvfs.rpc.MAX_ITEMS, the rows of any message
MAX_ROWS = 1 << 22  # extents or replicas in one blob (a blob is also bounded in bytes: the
# server's max_header_bytes)
U63_MAX = 2**63 - 1
T = TypeVar("T")

_SWAP = sys.byteorder != "little"
_BYTES_BELOW = {top: bytes(range(top)) for top in (0x04, 0x40, 0x80)}  # for _Reader.below
_SPLIT_KEYS = 4096  # keys of a blob cut by one struct format at most (compiled per blob, not cached)


def _code(width: int) -> str:
    """The array typecode of unsigned ints ``width`` bytes wide ('I' and 'L' vary by platform)."""
    return next(c for c in "BHILQ" if array(c).itemsize == width)


U8, U16, U32, U64 = _code(1), _code(2), _code(4), _code(8)


def _column(code: str, values: Sequence[int] | map[int] | repeat[int]) -> bytes:
    col = array(code, values)
    if _SWAP:
        col.byteswap()
    return col.tobytes()


# one number of each column width, little-endian (struct's standard sizes by width)
_ONE = {code: struct.Struct("<" + {1: "B", 2: "H", 4: "I", 8: "Q"}[array(code).itemsize])
        for code in (U8, U16, U32, U64)}


def _filled(code: str, value: int, n: int) -> bytes:
    """A column of ``n`` times ``value`` (one number packed, repeated in C)."""
    return _ONE[code].pack(value) * n


def _col(code: str, values: Sequence[int]) -> bytes:
    """:func:`_column` of ``values``, made by :func:`_filled` when they are all one number
    (checked in C: a put's key lengths, sizes, replica counts and server often are)."""
    n = len(values)
    return _filled(code, values[0], n) if n and values.count(values[0]) == n else _column(code, values)


def pack(keys: Sequence[bytes], layouts: Sequence[Layout]) -> bytes:
    """The packed blob of ``keys[i]``'s ``layouts[i]`` (``created``/``expires_at`` are left
    out: meta stamps them)."""
    if len(keys) != len(layouts):
        raise ValueError(f"{len(keys)} keys for {len(layouts)} layouts")
    elen: list[int] = []
    ecrc: list[int] = []
    ereps: list[int] = []
    server: list[int] = []
    chunk: list[int] = []
    offset: list[int] = []
    metas = [lay.meta for lay in layouts]
    exts = [lay.extents for lay in layouts]
    for ex in exts:
        for e in ex:
            reps = e.replicas
            elen.append(e.length)
            ecrc.append(e.crc)
            ereps.append(len(reps))
            for r in reps:
                server.append(r.server_id)
                chunk.append(r.chunk_id)
                offset.append(r.offset)
    meta_blob = b"".join(m for m in metas if m is not None)
    return b"".join((
        HEAD.pack(MAGIC, len(keys), len(elen), len(server), len(meta_blob)),
        _column(U16, map(len, keys)),
        _column(U32, [lay.size for lay in layouts]),
        _column(U32, [lay.crc for lay in layouts]),
        _column(U32, map(len, exts)),
        _column(U32, [NO_META if m is None else len(m) for m in metas]),
        _column(U32, elen), _column(U32, ecrc), _column(U8, ereps),
        _column(U32, server), _column(U64, chunk), _column(U64, offset),
        *keys, meta_blob,
    ))


def pack_single(keys: Sequence[bytes], sizes: Sequence[int], crcs: Sequence[int],
                nreps: Sequence[int], server: Sequence[int], chunk: Sequence[int],
                offset: Sequence[int], metas: Sequence[bytes | None] | None = None) -> bytes:
    """The blob :func:`pack` makes of values that are one extent each (the common case of a
    put: values up to a stripe), from columns, with no layout object: value ``i`` has size
    ``sizes[i]`` and CRC ``crcs[i]`` (its extent's too) and ``nreps[i]`` replicas, which
    follow in order in ``server``/``chunk``/``offset``."""
    n = len(keys)
    if not len(sizes) == len(crcs) == len(nreps) == n or (metas is not None and len(metas) != n):
        raise ValueError(f"{n} keys, {len(sizes)} sizes, {len(crcs)} CRCs, {len(nreps)} replica "
                         f"counts{'' if metas is None else f', {len(metas)} metadata'}")
    if not len(server) == len(chunk) == len(offset) == sum(nreps):
        raise ValueError(f"replica columns of {len(server)}, {len(chunk)}, {len(offset)} rows for "
                         f"{sum(nreps)} replicas")
    if metas is None:
        meta_blob, meta_len = b"", _filled(U32, NO_META, n)
    else:
        meta_blob = b"".join(m for m in metas if m is not None)
        meta_len = _column(U32, [NO_META if m is None else len(m) for m in metas])
    size_col, crc_col = _col(U32, sizes), _column(U32, crcs)
    return b"".join((
        HEAD.pack(MAGIC, n, n, len(server), len(meta_blob)),
        _col(U16, list(map(len, keys))), size_col, crc_col, _filled(U32, 1, n), meta_len,
        size_col, crc_col, _col(U8, nreps),
        _col(U32, server), _col(U64, chunk), _column(U64, offset),
        *keys, meta_blob,
    ))


# the columns of a blob in order: (which count of the head sizes it: keys 0, extents 1,
# replicas 2; bytes per row); the keys and the metadata follow
_COLUMNS = ((0, 2), (0, 4), (0, 4), (0, 4), (0, 4), (1, 4), (1, 4), (1, 1), (2, 4), (2, 8), (2, 8))


def join(blobs: Sequence[bytes]) -> bytes:
    """One blob of the items of ``blobs`` in order (each made by :func:`pack` or
    :func:`pack_single`): item ``i`` of the second follows the first's last.  Each column
    of each blob is cut out as it is and put beside the same column of the others (no
    number read).  A merged COMMIT's blob (:meth:`kvfs.writepath.WritePath.commit_packed`)."""
    if len(blobs) == 1:
        return blobs[0]
    heads = [HEAD.unpack_from(b) for b in blobs]
    if any(h[0] != MAGIC for h in heads):
        raise ValueError("a blob to join is not packed layouts")
    views = [memoryview(b) for b in blobs]
    at = [HEAD.size] * len(blobs)
    parts: list[bytes | memoryview] = [HEAD.pack(MAGIC, *(sum(h[c] for h in heads) for c in (1, 2, 3, 4)))]
    for count, width in _COLUMNS:
        for i, h in enumerate(heads):
            end = at[i] + h[1 + count] * width
            parts.append(views[i][at[i] : end])
            at[i] = end
    parts.extend(v[a : len(v) - h[4]] for v, a, h in zip(views, at, heads, strict=True))  # keys
    parts.extend(v[len(v) - h[4] :] for v, h in zip(views, heads, strict=True))  # metadata
    return b"".join(parts)


def _bad(what: str) -> InvalidArgument:
    return InvalidArgument(f"packed layouts (`$.packed`): {what}")


class _Reader:
    """Columns read in order from a blob, each checked to fit before it is copied."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.pos = HEAD.size
        self.raw: dict[str, bytes] = {}  # each column's little-endian bytes, by name

    def column(self, name: str, code: str, count: int) -> array[int]:
        col = array(code)
        end = self.pos + col.itemsize * count
        if end > len(self.blob):
            raise _bad(f"the {name} column ({count} x {col.itemsize} bytes at byte {self.pos}) runs "
                       f"past the end of the {len(self.blob)}-byte blob")
        raw = self.raw[name] = self.blob[self.pos:end]
        col.frombytes(raw)
        if _SWAP:
            col.byteswap()
        self.pos = end
        return col

    def below(self, name: str, width: int, top: int) -> bool:
        """Every number of column ``name`` (``width`` bytes each) has a top byte below
        ``top``: a bound checked on the bytes, in C, with no int object per number."""
        return not self.raw[name][width - 1::width].translate(None, _BYTES_BELOW[top])

    def chunks_name_servers(self) -> bool:
        """Every replica's chunk id names its server (:func:`~kvfs.layout.server_of_chunk`:
        the id's top 24 bits), settled on the columns' bytes in C: the chunk ids' bytes 5-7
        against the server ids' bytes 0-2, and the servers' top byte zero."""
        chunk, server = self.raw["chunk"], self.raw["server"]
        return (chunk[5::8] == server[0::4] and chunk[6::8] == server[1::4]
                and chunk[7::8] == server[2::4] and not server[3::4].strip(b"\0"))

    def section(self, name: str, nbytes: int) -> int:
        """The start of the next ``nbytes`` bytes (checked to fit)."""
        start, self.pos = self.pos, self.pos + nbytes
        if self.pos > len(self.blob):
            raise _bad(f"the {name} ({nbytes} bytes at byte {start}) run past the end of the "
                       f"{len(self.blob)}-byte blob")
        return start


def _item(i: int, key: bytes | None, what: str) -> InvalidArgument:
    named = "" if key is None else f" (key {key[:64]!r})"
    return _bad(f"item {i}{named}: {what}")


def _first(col: array[int], bad: object) -> int:
    """The index of the first entry of ``col`` for which ``bad(value)`` (for messages)."""
    assert callable(bad)
    return next(i for i, v in enumerate(col) if bad(v))


@dataclass(frozen=True, slots=True)
class _SingleColumns:
    """The columns of a batch of one extent of one replica per value, and meta's stamp."""

    size: array[int]
    crc: array[int]
    ext_crc: array[int]
    server: array[int]
    chunk: array[int]
    offset: array[int]
    created: float
    expires_at: float | None

    def rows(self, keys: list[bytes], i: int, j: int,
             meta_of: Sequence[bytes | None] | repeat[None]) -> list[tuple[bytes, Layout]]:
        """(key, layout) of items ``i`` to ``j`` (``keys`` and ``meta_of`` are theirs)."""
        created, expires_at = self.created, self.expires_at
        whole = i == 0 and j == len(self.size)
        cols = ((self.size, self.crc, self.ext_crc, self.server, self.chunk, self.offset) if whole
                else (c[i:j] for c in (self.size, self.crc, self.ext_crc, self.server, self.chunk, self.offset)))
        return [(k, Layout(s, c, created, expires_at, (Extent(s, ec, (Replica(sv, ch, of),)),), m))
                for k, s, c, ec, sv, ch, of, m in zip(keys, *cols, meta_of, strict=False)]


class LazyStaged(Sequence[tuple[bytes, Layout]]):
    """A checked batch's (key, layout) rows, built when asked, a slice at a time (a list):
    a COMMIT meta writes in parts (``--commit-group-max-keys``) builds each part in the step
    that queues it, so its first step is not the whole batch's keys and layouts (16,384 of
    them took 11-15 ms, bench/RESULTS.md).  Each ask builds anew: take a slice once."""

    __slots__ = ("_at", "_blob", "_cols", "_klen", "_metas", "_next")

    def __init__(self, blob: bytes, at: int, klen: array[int], cols: _SingleColumns,
                 metas: list[bytes | None] | None) -> None:
        self._blob, self._at, self._klen, self._cols, self._metas = blob, at, klen, cols, metas
        self._next = (0, at)  # (item, where its key starts) after the last slice built

    def __len__(self) -> int:
        return len(self._klen)

    @overload
    def __getitem__(self, i: int) -> tuple[bytes, Layout]: ...
    @overload
    def __getitem__(self, i: slice) -> list[tuple[bytes, Layout]]: ...

    def __getitem__(self, i: int | slice) -> tuple[bytes, Layout] | list[tuple[bytes, Layout]]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("LazyStaged slices go in steps of 1")
            return self._rows(start, max(start, stop))
        n, k = len(self), index(i)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"item {i} of {n}")
        return self._rows(k, k + 1)[0]

    def __iter__(self) -> Iterator[tuple[bytes, Layout]]:
        for i in range(0, len(self), LAZY_PAGE):
            yield from self._rows(i, min(len(self), i + LAZY_PAGE))

    def _rows(self, i: int, j: int) -> list[tuple[bytes, Layout]]:
        klen = self._klen
        item, at = self._next  # (slices in order, the common case: no sum of the keys before)
        if item != i:
            at = self._at + sum(klen[:i])
        part = klen[i:j]
        self._next = (j, at + sum(part))
        keys = _keys(self._blob, at, part) if j > i else []
        return self._cols.rows(keys, i, j, repeat(None) if self._metas is None else self._metas[i:j])


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A packed batch checked and turned into what meta's index takes."""

    staged: Sequence[tuple[bytes, Layout]]  # (key, layout stamped with meta's times); a list
    # unless built when asked (unpack's lazy_over: LazyStaged)
    servers: frozenset[int]  # every server id the layouts name
    chunks: array[int]  # every replica's chunk id (meta's retired-chunk check looks them up)
    max_meta: int  # bytes of the largest key metadata (0: none)


def unpack(blob: bytes, created: float, expires_at: float | None, *,
           lazy_over: int | None = None) -> Unpacked:
    """Check a packed blob and build its layouts, stamped ``created``/``expires_at``.
    ``lazy_over``: a batch of more keys than that, of one extent of one replica each, is
    checked whole but its keys and layouts are built a slice at a time, when asked
    (:class:`LazyStaged`); meta passes its part size (``--commit-group-max-keys``), so a
    lazy batch is always taken a part, a slice, at a time."""
    if len(blob) < HEAD.size:
        raise _bad(f"{len(blob)} bytes is shorter than its {HEAD.size}-byte head")
    magic, n, ne, nr, nmeta = HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise _bad(f"bad magic {magic!r} (expected {MAGIC!r})")
    if not 1 <= n <= MAX_KEYS:
        raise _bad(f"{n} keys (1 to {MAX_KEYS} allowed)")
    if ne > MAX_ROWS or nr > MAX_ROWS:
        raise _bad(f"{ne} extents and {nr} replicas (at most {MAX_ROWS} each)")
    rd = _Reader(blob)
    klen = rd.column("key_len", U16, n)
    size = rd.column("size", U32, n)
    crc = rd.column("crc", U32, n)
    next_ = rd.column("extents", U32, n)
    mlen = rd.column("meta_len", U32, n)
    elen = rd.column("ext_len", U32, ne)
    ecrc = rd.column("ext_crc", U32, ne)
    ereps = rd.column("ext_reps", U8, ne)
    server = rd.column("server", U32, nr)
    chunk = rd.column("chunk", U64, nr)
    offset = rd.column("offset", U64, nr)
    # counts and bounds, a column at a time: the common case (every key 1 to 1023 bytes, values
    # under 1 GiB of one extent of one replica, 63-bit ids, no metadata) settled on the
    # columns' bytes, in C; anything else checked number by number, naming the first bad one
    one_each = ne == nr == n and next_.count(1) == n and ereps.count(1) == n
    no_meta = rd.raw["meta_len"] == b"\xff" * (4 * n)
    if not (one_each and no_meta and nmeta == 0 and klen.count(0) == 0 and rd.below("key_len", 2, 0x04)
            and rd.below("size", 4, 0x40) and rd.below("ext_len", 4, 0x40)
            and rd.below("chunk", 8, 0x80) and rd.below("offset", 8, 0x80)):
        _check(klen, size, next_, ne, elen, ereps, nr, chunk, offset, mlen, nmeta)
    if not rd.chunks_name_servers():
        i = next(i for i, (sv, ch) in enumerate(zip(server, chunk, strict=True)) if server_of_chunk(ch) != sv)
        raise _bad(f"replica {i}: {misfiled_why(server[i], chunk[i])}")
    metas = [] if no_meta else [m for m in mlen if m != NO_META]
    kat = rd.section("keys", sum(klen))
    mat = rd.section("metadata", nmeta)
    if rd.pos != len(blob):
        raise _bad(f"{len(blob) - rd.pos} bytes follow the end of the packed layouts")
    if metas:
        mpos = list(accumulate((0 if m == NO_META else m for m in mlen), initial=mat))
        meta_of: Sequence[bytes | None] | repeat[None] = [
            None if m == NO_META else blob[a:b] for m, (a, b) in zip(mlen, pairwise(mpos), strict=True)]
    else:
        meta_of = repeat(None)
    servers = frozenset(server)
    max_meta = max(metas, default=0)
    if one_each and size == elen:
        # one extent of one replica per value, their sizes checked above: the common case
        cols = _SingleColumns(size, crc, ecrc, server, chunk, offset, created, expires_at)
        if lazy_over is not None and n > lazy_over:
            meta_list = None if isinstance(meta_of, repeat) else list(meta_of)
            return Unpacked(LazyStaged(blob, kat, klen, cols, meta_list), servers, chunk, max_meta)
        return Unpacked(cols.rows(_keys(blob, kat, klen), 0, n, meta_of), servers, chunk, max_meta)
    keys = _keys(blob, kat, klen)
    # any shape: each kind of object built by one comprehension, then grouped by the counts
    reps = [Replica(sv, ch, of) for sv, ch, of in zip(server, chunk, offset, strict=True)]
    extents = [Extent(ln, c, rs) for ln, c, rs in zip(elen, ecrc, _groups(reps, ereps), strict=True)]
    try:
        staged = [(k, Layout(s, c, created, expires_at, ex, m)) for k, s, c, ex, m
                  in zip(keys, size, crc, _groups(extents, next_), meta_of, strict=False)]
    except ValueError:  # extents not adding up to their value's size: name the first such item
        for i, (k, s, ex) in enumerate(zip(keys, size, _groups(extents, next_), strict=True)):
            total = sum(e.length for e in ex)
            if total != s:
                raise _item(i, k, f"layout extents add up to {total}, not {s}") from None
        raise
    return Unpacked(staged, servers, chunk, max_meta)


def _check(klen: array[int], size: array[int], next_: array[int], ne: int, elen: array[int],
           ereps: array[int], nr: int, chunk: array[int], offset: array[int], mlen: array[int],
           nmeta: int) -> None:
    """Every count and bound of a blob's columns, number by number (:func:`unpack`'s checks
    where its check on the columns' bytes did not settle them)."""
    if min(klen) < 1 or max(klen) > MAX_KEY_BYTES:
        i = _first(klen, lambda v: not 1 <= v <= MAX_KEY_BYTES)
        raise _item(i, None, f"key of {klen[i]} bytes (1 to {MAX_KEY_BYTES} allowed)")
    if max(size) > MAX_VALUE_BYTES:
        i = _first(size, lambda v: v > MAX_VALUE_BYTES)
        raise _item(i, None, f"value size {size[i]} is over the limit of {MAX_VALUE_BYTES}")
    if max(next_) > MAX_EXTENTS:
        i = _first(next_, lambda v: v > MAX_EXTENTS)
        raise _item(i, None, f"{next_[i]} extents (at most {MAX_EXTENTS})")
    if sum(next_) != ne:
        raise _bad(f"the values' extents add up to {sum(next_)}, the head says {ne}")
    if ne:
        if max(elen) > MAX_VALUE_BYTES:
            i = _first(elen, lambda v: v > MAX_VALUE_BYTES)
            raise _bad(f"extent {i}: length {elen[i]} is over the limit of {MAX_VALUE_BYTES}")
        if min(ereps) < 1 or max(ereps) > MAX_REPLICAS:
            i = _first(ereps, lambda v: not 1 <= v <= MAX_REPLICAS)
            raise _bad(f"extent {i}: {ereps[i]} replicas (1 to {MAX_REPLICAS} allowed)")
    if sum(ereps) != nr:
        raise _bad(f"the extents' replicas add up to {sum(ereps)}, the head says {nr}")
    if nr:
        for name, col in (("chunk id", chunk), ("offset", offset)):
            if max(col) > U63_MAX:
                i = _first(col, lambda v: v > U63_MAX)
                raise _bad(f"replica {i}: {name} {col[i]} is over 2**63-1")
    metas = [m for m in mlen if m != NO_META]
    if metas and max(metas) > MAX_META_BYTES:
        i = _first(mlen, lambda v: v != NO_META and v > MAX_META_BYTES)
        raise _item(i, None, f"metadata of {mlen[i]} bytes (at most {MAX_META_BYTES})")
    if sum(metas) != nmeta:
        raise _bad(f"the keys' metadata add up to {sum(metas)} bytes, the head says {nmeta}")


def _keys(blob: bytes, at: int, klen: array[int]) -> list[bytes]:
    """The keys, back to back from ``at`` (their lengths checked): cut in C by one struct
    format of ``n`` strings, up to :data:`_SPLIT_KEYS` keys (a slice each past that).  Keys
    of one length, the common case, cost a third of a slice each (bench/RESULTS.md)."""
    n = len(klen)
    if n > _SPLIT_KEYS:
        return [blob[a:b] for a, b in pairwise(accumulate(klen, initial=at))]
    k0 = klen[0]
    fmt = f"{k0}s" * n if klen.count(k0) == n else ("%ds" * n) % tuple(klen)
    return list(struct.Struct("<" + fmt).unpack_from(blob, at))


def _groups(items: list[T], counts: array[int]) -> list[tuple[T, ...]]:
    """``items`` cut into consecutive tuples of ``counts[i]`` items (they add up)."""
    n = len(counts)
    if counts.count(1) == n:
        return [(x,) for x in items]
    k = counts[0]
    if counts.count(k) == n and k:
        return [tuple(items[i:i + k]) for i in range(0, len(items), k)]
    return [tuple(items[a:b]) for a, b in pairwise(accumulate(counts, initial=0))]
