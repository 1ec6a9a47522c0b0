"""Eviction's LRU order, kept from one walk to the next.

Meta's index (:class:`kvfs.meta.index.MetaIndex`) keeps each key's last use (its commit, or
its last read), not an order.  Eviction walks the keys least recently used first, and each
walk sorted every key: a GC_EVICT that needed 1,000 victims cost 0.9-1.4 s of meta's time at
1M keys (bench/RESULTS.md), and a full cluster runs one every pass.

:class:`LruOrder` keeps the order the last sort made (:class:`Sorted`), each key with the last
use it had then, merged from the sort's pages only as far as walks have needed.  A walk goes
on from it: an entry whose key is gone, or whose last use changed (read, or put anew, since),
is passed over, as the key is no longer where the sort put it.  The keys used since the sort
(and the new ones) used it later than every key the sort saw, so they come after all the
entries left: once a walk has gone through them all, the keys it has not yielded are sorted
again, once a walk.  The entries at the front that no walk needs any more (gone or used
since) are stepped over for good.  An order costs some 32 bytes a key while it lasts (its
pages and what was merged of them: a pointer and a float each), and holds the keys it names
until the next sort; none of it is a container the cycle collector walks key by key.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

# every key's last use and the key, a page of them at a time, each page sorted
Pages = Callable[[], Awaitable[list[tuple["array[float]", tuple[bytes, ...]]]]]


class Sorted:
    """One sort's order: its pages, merged as walks need them, what was merged so far kept
    in blocks of at most a page (``blocks``, starting at ``starts``; ``times``): tuples of
    bytes, which the cycle collector stops walking once it has looked at them (a list of
    every key would be walked by each full collection, 9.6 ms at 1M keys)."""

    __slots__ = ("at", "blocks", "merged", "starts", "times")

    def __init__(self, pages: list[tuple[array[float], tuple[bytes, ...]]]) -> None:
        self.blocks: list[tuple[bytes, ...]] = []
        self.starts: list[int] = []
        self.times: array[float] = array("d")
        self.merged: Iterator[tuple[float, bytes]] | None = heapq.merge(*(zip(t, k, strict=True) for t, k in pages))
        self.at = 0  # the entries before this are gone or used since: no walk looks at them

    def more(self, n: int) -> bool:
        """Merge up to ``n`` entries more; False once there are none."""
        if self.merged is None:
            return False
        got = list(itertools.islice(self.merged, n))
        if len(got) < n:
            self.merged = None
        if got:
            self.starts.append(len(self.times))
            self.blocks.append(tuple([k for _, k in got]))
            self.times.extend([t for t, _ in got])
        return bool(got)

    def entries(self, i: int, n: int) -> Iterator[tuple[int, bytes, float]]:
        """(index, key, last use then) from entry ``i`` on, merging ``n`` more at a time as
        needed (another walk may merge some meanwhile: they are taken in turn)."""
        blocks, starts, times = self.blocks, self.starts, self.times
        b = max(0, bisect.bisect_right(starts, i) - 1)
        while True:
            while b < len(blocks):
                block, start = blocks[b], starts[b]
                for j in range(max(0, i - start), len(block)):
                    yield start + j, block[j], times[start + j]
                i = start + len(block)
                b += 1
            if not self.more(n):
                return


class LruOrder:
    """The keys least recently used first as of the last sort; :meth:`walk` goes on from it."""

    __slots__ = ("order", "sorts")

    def __init__(self) -> None:
        self.order = Sorted([])
        self.sorts = 0  # sorts made (tests)

    async def walk(self, last_use: Callable[[bytes], float | None], pages: Pages, batch: int,
                   page: int, after: tuple[float, bytes] | None = None,
                   ) -> AsyncIterator[list[tuple[bytes, float]]]:
        """The keys with their last use, least recently used first, ``batch`` at a time;
        ``last_use(key)``: the key's last use now (None: gone); ``pages()``: every key with its
        last use, in pages each sorted; ``after``: only the keys after that (last use, key),
        where an earlier walk stopped.  The loop is given back every ``page`` entries looked
        at."""
        seen: set[bytes] = set()
        for again in (False, True):
            if again:
                self.order = Sorted(await pages())
                self.sorts += 1
            o = self.order
            # every entry so far gone or used since: stepped over for good (not known of the
            # entries before ``after``, which this walk does not look at)
            front = after is None
            start = o.at if after is None else bisect.bisect_left(o.times, after[0], lo=o.at)
            out: list[tuple[bytes, float]] = []
            looked = 0
            for i, k, t in o.entries(start, page):
                looked += 1
                if after is not None and (t, k) <= after:
                    pass  # (before where the walk is to start: merged after the bisect, or a tie)
                elif last_use(k) == t:
                    front = False
                    if k not in seen:  # (else the walk's first part yielded it)
                        out.append((k, t))
                        if not again:
                            seen.add(k)
                elif front:
                    o.at = max(o.at, i + 1)
                if len(out) >= batch:  # a batch a step
                    yield out
                    out = []
                    looked = 0
                    await asyncio.sleep(0)
                elif looked >= page:  # (entries passed over: the loop given back too)
                    looked = 0
                    await asyncio.sleep(0)
            if out:
                yield out
