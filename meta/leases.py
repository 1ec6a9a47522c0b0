"""The leases meta's in-memory index holds: per key, each holder's lease end (storeapi.Lease).

An engine leases every key it looks up for eviction's sake (SGLang's ``batch_exists``
through the kvfs plug-in asks for one), so the keys leased in the last lease period can be
as many as the keys.  They were a dict of key to a dict of holder to end.  A dict that
holds dicts is tracked by Python's cycle collector, and every full collection walked every
leased key: 51-63 ms at 3M leased keys (170-300 ms as 256 dicts), every ~93k keys leased
in one harness, in meta's loop (bench/RESULTS.md, "Meta's leases").

So a key with one holder, by far the common case, costs no container: its latest end is a
float in :attr:`Leases.ends` and its holder a str in :attr:`Leases.owners`, and a dict of
keys to those is never tracked.  Only a key with several holders has a dict of them, in
:attr:`Leases.shared`; :attr:`Leases.ends` keeps the latest of them.  Both per-key maps
are :class:`~kvfs.meta.keymap.KeyMap`\\ s, so none stops meta as it grows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvfs.meta.keymap import KeyMap
from kvfs.meta.storeapi import OVERFLOW_HOLDER, Lease


class Leases:
    """key -> holder -> lease end, kept as described above.  A holder's lease on a key is
    only ever lengthened; past ``max_holders`` unexpired others on a key, a new holder's
    lease is the overflow holder's (storeapi.Lease)."""

    __slots__ = ("ends", "owners", "shared")

    def __init__(self) -> None:
        self.ends: KeyMap[float] = KeyMap()  # every leased key -> the latest end of its leases
        self.owners: KeyMap[str] = KeyMap()  # a key with one holder -> that holder
        self.shared: dict[bytes, dict[str, float]] = {}  # a key with several -> holder -> end

    def lease(self, keys: Iterable[bytes], now: float, lease: Lease) -> int:
        """Keep ``keys`` from eviction by ``lease``; returns how many of them got the
        overflow holder's instead."""
        holder, until, cap = lease
        ends, owners, mask = self.ends.shards, self.owners.shards, self.ends.mask
        overflowed = 0
        for k in keys:
            i = hash(k) & mask
            end = ends[i].get(k)
            if end is None:  # its first holder (max_holders is at least 1)
                ends[i][k] = until
                owners[i][k] = holder
            elif owners[i].get(k) == holder:  # its one holder's again
                if end < until:
                    ends[i][k] = until
            else:
                overflowed += self._share(k, i, now, holder, until, cap)
        return overflowed

    def _share(self, k: bytes, i: int, now: float, holder: str, until: float, cap: int) -> int:
        """A lease on a key that has another holder already."""
        held = self.shared.get(k)
        if held is None:  # its one holder becomes one of several
            one = self.owners.shards[i].pop(k)
            held = self.shared[k] = {one: self.ends.shards[i][k]}
        h, overflowed = holder, 0
        if h not in held and len(held) - (OVERFLOW_HOLDER in held) >= cap:
            for other, end in list(held.items()):
                if end <= now:
                    del held[other]
            if len(held) - (OVERFLOW_HOLDER in held) >= cap:
                h, overflowed = OVERFLOW_HOLDER, 1
        if held.get(h, 0.0) < until:
            held[h] = until
        self.ends.shards[i][k] = max(held.values())
        return overflowed

    def end(self, key: bytes) -> float:
        """The latest end of the key's leases, any holder's (0: none)."""
        return self.ends.shards[hash(key) & self.ends.mask].get(key, 0.0)

    def holders(self, key: bytes) -> dict[str, float]:
        """The key's leases: holder -> end."""
        i = hash(key) & self.ends.mask
        one = self.owners.shards[i].get(key)
        if one is not None:
            return {one: self.ends.shards[i][key]}
        return dict(self.shared.get(key, {}))

    def release(self, keys: Sequence[bytes], holder: str) -> int:
        """End ``holder``'s leases of ``keys``; returns how many it had one on."""
        n = 0
        ends, owners, mask, shared = self.ends.shards, self.owners.shards, self.ends.mask, self.shared
        for k in keys:
            i = hash(k) & mask
            if owners[i].get(k) == holder:
                del owners[i][k]
                del ends[i][k]
                n += 1
            elif (held := shared.get(k)) is not None and held.pop(holder, None) is not None:
                n += 1
                if held:
                    ends[i][k] = max(held.values())
                else:
                    del shared[k]
                    del ends[i][k]
        return n

    def forget(self, key: bytes) -> None:
        """The key's leases, gone with it (a delete, an eviction)."""
        i = hash(key) & self.ends.mask
        if self.ends.shards[i].pop(key, None) is not None:
            self.owners.shards[i].pop(key, None)
            self.shared.pop(key, None)

    def forget_ended(self, keys: Iterable[bytes], now: float) -> None:
        """Of ``keys``, forget those whose every lease ended by ``now``."""
        ends, mask = self.ends.shards, self.ends.mask
        for k in keys:
            end = ends[hash(k) & mask].get(k)
            if end is not None and end <= now:
                self.forget(k)

    def __len__(self) -> int:
        return len(self.ends)

    def __bool__(self) -> bool:
        return bool(self.ends)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.ends)
