"""Placement: which chunkservers hold which bytes of a batch of values.  Pure functions,
no I/O (tested without a cluster in tests/test_placement.py).

- Servers are drawn in a random order weighted by free space (Efraimidis-Spirakis).
- A value of at most one stripe is one unit.  The small values of one call go, in
  call order, to runs of up to ``group_bytes`` on one server (a prefix chain stays
  contiguous: one sequential read later); the next run goes to the next servers in
  the order, so a large batch is spread and written in parallel.
- A larger value is cut into ``stripe_bytes`` units placed round-robin, so one read
  of it uses every server.
- Each unit goes to ``replicas`` distinct servers (consecutive in the order).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, TypeVar


class Weighted(Protocol):
    @property
    def free(self) -> int: ...


S = TypeVar("S", bound=Weighted)


class Unit(NamedTuple):
    """``length`` bytes at ``start`` of a value, stored on ``servers`` (replicas)."""

    start: int
    length: int
    servers: tuple[int, ...]


def order_by_free(servers: Sequence[S], rand: Callable[[], float] = random.random) -> list[S]:
    """Servers in a random order, each drawn with a weight proportional to its free bytes."""
    return sorted(servers, key=lambda s: rand() ** (1.0 / max(s.free, 1)), reverse=True)


Placed = tuple[int, ...] | list[Unit]


def place(sizes: Sequence[int], order: Sequence[int], *, replicas: int, stripe_bytes: int,
          group_bytes: int) -> list[Placed]:
    """Where each value (by size) goes, on the server ids of ``order``: for a value of one
    unit (the whole value, at most one stripe) the tuple of its servers, shared by the
    values of its run (nothing is built per value: the write path's common case); for a
    larger value the list of its units; an empty value has no unit (``[]``).
    :func:`units` gives the units of either form."""
    n_srv = len(order)
    if not 1 <= replicas <= n_srv:
        raise ValueError(f"{replicas} replicas need as many servers; {n_srv} given")
    out: list[Placed] = []
    group, group_used = 0, 0
    small = tuple(order[j % n_srv] for j in range(replicas))
    if sizes and min(sizes) > 0 and max(sizes) <= stripe_bytes and sum(sizes) <= group_bytes:
        return [small] * len(sizes)  # every value one unit, all in the first run: no step per value
    rr = 0
    for n in sizes:
        if 0 < n <= stripe_bytes:  # the common case: one unit
            if group_used and group_used + n > group_bytes:
                group, group_used = group + 1, 0
                small = tuple(order[(group + j) % n_srv] for j in range(replicas))
            group_used += n
            out.append(small)
            continue
        units = []
        for ui, start in enumerate(range(0, n, stripe_bytes)):
            first = (rr + ui) % n_srv
            units.append(Unit(start, min(stripe_bytes, n - start),
                              tuple(order[(first + j) % n_srv] for j in range(replicas))))
        rr += len(units)
        out.append(units)
    return out


def units(size: int, placed: Placed) -> list[Unit]:
    """The units of a value of ``size`` bytes placed as ``placed`` (by :func:`place`)."""
    return [Unit(0, size, placed)] if isinstance(placed, tuple) else placed
