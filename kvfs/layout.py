"""Keys and layouts: where a value's bytes live.

A layout is immutable: overwriting a key commits a new one.  On the wire and
in meta's store a layout is a plain list (msgpack-friendly, no per-field
names)::

    [size, crc32c, created, expires_at | None, [extent, ...]]
    extent = [length, crc32c, [[server_id, chunk_id, offset], ...replicas]]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from kvfs.errors import InvalidArgument

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 30  # 1 GiB

Key = bytes | str


def norm_key(key: Key) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    elif not isinstance(key, bytes):
        if isinstance(key, (bytearray, memoryview)):
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
    """Every key checked; an empty list stays empty (batch calls answer it without an RPC)."""
    return [norm_key(k) for k in keys]


class Replica(NamedTuple):
    server_id: int
    chunk_id: int
    offset: int


class Extent(NamedTuple):
    length: int
    crc: int
    replicas: tuple[Replica, ...]


class Layout(NamedTuple):
    """Immutable; tuples are much cheaper to build than frozen dataclasses (meta builds
    one per committed key)."""

    size: int
    crc: int
    created: float
    expires_at: float | None
    extents: tuple[Extent, ...]

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def to_wire(self) -> list[Any]:
        return [self.size, self.crc, self.created, self.expires_at,
                [[e.length, e.crc, [[r.server_id, r.chunk_id, r.offset] for r in e.replicas]]
                 for e in self.extents]]

    @classmethod
    def from_wire(cls, w: list[Any], *, stamp: tuple[float, float | None] | None = None) -> Layout:
        """Parse and check a wire layout; ``stamp`` = (created, expires_at) overrides its own."""
        try:
            size, crc, wcreated, wexpires, exts = w
            extents = []
            total = 0
            for length, ecrc, reps in exts:
                if not reps:
                    raise InvalidArgument("layout has an extent with no replica")
                rs = tuple([Replica(int(s), int(c), int(o)) for s, c, o in reps])
                if length < 0 or not 0 <= ecrc < 2**32 or any(min(r) < 0 or max(r) >= 2**63 for r in rs):
                    raise InvalidArgument("layout has a negative or out-of-range field")
                extents.append(Extent(int(length), int(ecrc), rs))
                total += length
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed layout: {exc}") from None
        if total != size:
            raise InvalidArgument(f"layout extents add up to {total}, not {size}")
        if not 0 <= size < 2**63 or not 0 <= crc < 2**32:
            raise InvalidArgument("layout size or checksum out of range")
        if stamp is None:
            stamp = (float(wcreated), None if wexpires is None else float(wexpires))
        return cls(int(size), int(crc), stamp[0], stamp[1], tuple(extents))

    def chunk_bytes(self) -> Iterable[tuple[int, int]]:
        """(chunk_id, bytes) for every replica of every extent."""
        for e in self.extents:
            for r in e.replicas:
                yield r.chunk_id, e.length


def server_of_chunk(chunk_id: int) -> int:
    """Chunk ids embed the server id that owns them (never reused)."""
    return chunk_id >> 40


def make_chunk_id(server_id: int, seq: int) -> int:
    return (server_id << 40) | seq
