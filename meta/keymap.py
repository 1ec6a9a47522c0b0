"""A dict of every key split over many small dicts, so that growing it never stops meta.

A CPython dict grows by copying every entry into a table twice as large (or more), in the
one insert that crosses two thirds of its slots; with inserts and deletes it does the same
once it has used its slots, even at a steady size.  Meta's index held every key in one dict,
and that insert held meta's event loop for as long as the copy took: 66 ms as 3M keys went
in passed 1.4M, 136-139 ms at 2.8M, doubling with the keys (bench/RESULTS.md, "Meta's keys
split over 256 dicts").

A :class:`KeyMap` keeps its keys in :data:`SHARDS` dicts, a key in the one its hash
picks, so no insert copies more than one shard's entries: a 256th of the keys.

The index's per-key loops (a COMMIT's keys, a LOOKUP's) pick the shard themselves,
``shards[hash(key) & mask]``, rather than call a method per key, which costs more than the
dict call it wraps; its walks of every key list them a shard a loop step
(:func:`kvfs.meta.index.listed`).  Every other use goes through the dict-like methods here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Generic, TypeVar, overload

V = TypeVar("V")
D = TypeVar("D")

SHARDS = 256  # (a power of two: a key's shard is its hash's low bits)

_MISSING = object()


class KeyMap(Generic[V]):
    """``bytes -> V``, as a dict, over :data:`SHARDS` dicts.  Iteration goes a shard at a
    time: not in insertion order, and, as a dict's, not while the map changes."""

    __slots__ = ("mask", "shards")

    def __init__(self, items: Iterable[tuple[bytes, V]] = ()) -> None:
        self.shards: list[dict[bytes, V]] = [{} for _ in range(SHARDS)]
        self.mask = SHARDS - 1
        for k, v in items:
            self[k] = v

    def __getitem__(self, key: bytes) -> V:
        return self.shards[hash(key) & self.mask][key]

    def __setitem__(self, key: bytes, value: V) -> None:
        self.shards[hash(key) & self.mask][key] = value

    def __delitem__(self, key: bytes) -> None:
        del self.shards[hash(key) & self.mask][key]

    def __contains__(self, key: object) -> bool:
        return key in self.shards[hash(key) & self.mask]

    @overload
    def get(self, key: bytes) -> V | None: ...
    @overload
    def get(self, key: bytes, default: D) -> V | D: ...
    def get(self, key: bytes, default: object = None) -> object:
        return self.shards[hash(key) & self.mask].get(key, default)

    @overload
    def pop(self, key: bytes) -> V: ...
    @overload
    def pop(self, key: bytes, default: D) -> V | D: ...
    def pop(self, key: bytes, default: object = _MISSING) -> object:
        shard = self.shards[hash(key) & self.mask]
        return shard.pop(key) if default is _MISSING else shard.pop(key, default)

    def setdefault(self, key: bytes, default: V) -> V:
        return self.shards[hash(key) & self.mask].setdefault(key, default)

    def update(self, other: Mapping[bytes, V] | KeyMap[V]) -> None:
        for k, v in other.items():
            self[k] = v

    def __len__(self) -> int:
        return sum(map(len, self.shards))

    def __bool__(self) -> bool:
        return any(self.shards)

    def __iter__(self) -> Iterator[bytes]:
        return itertools.chain.from_iterable(self.shards)

    def values(self) -> Iterator[V]:
        return itertools.chain.from_iterable(s.values() for s in self.shards)

    def items(self) -> Iterator[tuple[bytes, V]]:
        return itertools.chain.from_iterable(s.items() for s in self.shards)

    def clear(self) -> None:
        for s in self.shards:
            s.clear()
