"""Keys and layouts: where a value's bytes live.

A layout is immutable: overwriting a key commits a new one.  On the wire and
in meta's store a layout is a msgpack array (no per-field names)::

    [size, crc32c, created, expires_at | None, [extent, ...], meta?]
    extent = [length, crc32c, [[server_id, chunk_id, offset], ...replicas]]

``meta`` is the key's small metadata (``put(..., meta={...})``, msgpack bytes), absent
when there is none.

:class:`Layout` declares that shape once; :func:`encode_layout` and
:func:`decode_layout` are its only codec.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, cast

import msgspec

from kvfs.errors import InvalidArgument

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 30  # 1 GiB
MAX_META_BYTES = 64 * 1024  # a key's metadata on the wire; meta's --max-key-meta (1 KiB) is lower

Key = bytes | str


def norm_key(key: Key) -> bytes:
    if type(key) is not bytes:  # bytes, the common case, passes with one check
        if isinstance(key, str):
            key = key.encode()
        elif isinstance(key, (bytes, bytearray, memoryview)):  # a bytes subclass too
            key = bytes(key)
        else:
            raise InvalidArgument(f"key must be bytes or str, got {type(key).__name__}")
    if not key:
        raise InvalidArgument("empty key")
    if len(key) > MAX_KEY_BYTES:
        raise InvalidArgument(f"key of {len(key)} bytes is longer than the limit of {MAX_KEY_BYTES} "
                              f"(key starts {key[:32]!r})")
    return key


def norm_keys(keys: Iterable[Key]) -> list[bytes]:
    """Every key checked; an empty list stays empty (batch calls answer it without an RPC).
    The common case, every key ``bytes`` of an allowed length, is checked in C (no Python
    step per key): a pass for the types, one for the lengths (a set of them, usually of one
    length: 128 keys 72 -> 53 ns each against min and max over the keys); the list
    returned is always a new one."""
    ks = list(keys)
    if ks and set(map(type, ks)) == _BYTES:
        lengths = set(map(len, ks))
        if min(lengths) and max(lengths) <= MAX_KEY_BYTES:
            return cast(list[bytes], ks)
    return [norm_key(k) for k in ks]


_BYTES = {bytes}


U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Crc32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
MAX_REPLICAS = 16
MAX_EXTENTS = MAX_VALUE_BYTES // 4096 + 1  # one per stripe unit; units are at least 4 KiB


class Replica(msgspec.Struct, frozen=True, array_like=True, gc=False, order=True):
    server_id: U63
    chunk_id: U63
    offset: U63


class Extent(msgspec.Struct, frozen=True, array_like=True, gc=False):
    length: U63
    crc: Crc32
    replicas: Annotated[tuple[Replica, ...], msgspec.Meta(min_length=1, max_length=MAX_REPLICAS)]


class Layout(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Immutable.  This class is the only layout codec: on the wire and in meta's store a
    layout is its msgpack array form ``[size, crc, created, expires_at, extents, meta?]`` with
    ``extent = [length, crc, [[server_id, chunk_id, offset], ...]]``, encoded and decoded
    (and checked, field by field) by msgspec from these declarations."""

    size: Annotated[int, msgspec.Meta(ge=0, le=MAX_VALUE_BYTES)]
    crc: Crc32
    created: Annotated[float, msgspec.Meta(ge=0.0)]
    expires_at: Annotated[float, msgspec.Meta(ge=0.0)] | None
    extents: Annotated[tuple[Extent, ...], msgspec.Meta(max_length=MAX_EXTENTS)]
    meta: Annotated[bytes, msgspec.Meta(max_length=MAX_META_BYTES)] | None = None

    def __post_init__(self) -> None:
        ext = self.extents  # one extent is the common case (values up to stripe_bytes)
        total = ext[0].length if len(ext) == 1 else sum(e.length for e in ext)
        if total != self.size:
            raise ValueError(f"layout extents add up to {total}, not {self.size}")

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def stamped(self, created: float, expires_at: float | None) -> Layout:
        """The same layout with meta's commit time and expiry."""
        return msgspec.structs.replace(self, created=created, expires_at=expires_at)

    def chunk_bytes(self) -> Iterable[tuple[int, int]]:
        """(chunk_id, bytes) for every replica of every extent."""
        for e in self.extents:
            for r in e.replicas:
                yield r.chunk_id, e.length


def server_of_chunk(chunk_id: int) -> int:
    """Chunk ids embed the server id that owns them (never reused)."""
    return chunk_id >> 40


def misfiled(layout: Layout) -> Replica | None:
    """The first replica of ``layout`` whose chunk id does not name its server, if any
    (meta refuses such a layout: its index finds a server's keys by their chunks' ids)."""
    for e in layout.extents:
        for r in e.replicas:
            if server_of_chunk(r.chunk_id) != r.server_id:
                return r
    return None


def misfiled_why(server_id: int, chunk_id: int) -> str:
    """Why a replica (``server_id``, ``chunk_id``) :func:`misfiled` is refused."""
    return (f"chunk id {chunk_id:#x} is chunkserver {server_of_chunk(chunk_id)}'s, not chunkserver "
            f"{server_id}'s (a chunk id names its server: its top 24 bits)")


def make_chunk_id(server_id: int, seq: int) -> int:
    return (server_id << 40) | seq


_ENCODE = msgspec.msgpack.Encoder()
_DECODE = msgspec.msgpack.Decoder(Layout)


def encode_layout(layout: Layout) -> bytes:
    """A layout without metadata is stored as the 5-element array it always was (msgspec
    writes a trailing nil): the bytes of stored layouts, which compare-and-swaps on the
    Redis store compare, do not change."""
    b = _ENCODE.encode(layout)
    if layout.meta is None:
        assert b[0] == 0x96 and b[-1] == 0xC0  # fixarray of 6, ending in nil
        return b"\x95" + b[1:-1]
    return b


def encode_layout_buffer(layout: Layout) -> bytearray:
    """:func:`encode_layout`'s bytes in a bytearray, made with one copy: what meta's SQLite
    rows bind (``sqlite3`` binds a bytearray as it is, a bytes value only after an adapter
    lookup: :data:`kvfs.meta.store.PUT_KV`)."""
    b = bytearray(_ENCODE.encode(layout))
    if layout.meta is None:  # (encode_layout's 5-element form, edited in place)
        assert b[0] == 0x96 and b[-1] == 0xC0
        b[0] = 0x95
        del b[-1]
    return b


def decode_layout(blob: bytes) -> Layout:
    """A stored layout, checked field by field (``InvalidArgument`` names the bad field)."""
    try:
        return _DECODE.decode(blob)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"bad layout: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"undecodable layout: {exc}") from None
