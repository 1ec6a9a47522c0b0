"""Placement as pure functions: no cluster, no I/O."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvfs.placement import Unit, order_by_free, place, units

MIB = 1 << 20


@dataclass
class S:
    server_id: int
    free: int


def test_small_values_stay_contiguous_in_runs_of_group_bytes() -> None:
    placed = place([MIB] * 5, [7, 8, 9], replicas=1, stripe_bytes=MIB, group_bytes=2 * MIB)
    assert placed == [(7,), (7,), (8,), (8,), (9,)]  # one unit each: its servers
    assert [units(MIB, p) for p in placed] == [[Unit(0, MIB, p)] for p in placed]


def test_runs_wrap_around_the_servers() -> None:
    assert place([10] * 4, [1, 2], replicas=1, stripe_bytes=MIB, group_bytes=10) == [(1,), (2,), (1,), (2,)]


def test_large_values_are_striped_round_robin_on_distinct_servers() -> None:
    (placed,) = place([5 * MIB + 3], [1, 2, 3], replicas=1, stripe_bytes=MIB, group_bytes=16 * MIB)
    us = units(5 * MIB + 3, placed)
    assert [u.start for u in us] == [0, MIB, 2 * MIB, 3 * MIB, 4 * MIB, 5 * MIB]
    assert [u.length for u in us] == [MIB] * 5 + [3]
    assert [u.servers for u in us] == [(1,), (2,), (3,), (1,), (2,), (3,)]
    (more,) = place([2 * MIB], [1, 2, 3], replicas=1, stripe_bytes=MIB, group_bytes=MIB)
    assert [u.servers for u in units(2 * MIB, more)] == [(1,), (2,)]  # each call starts at the first server


def test_replicas_are_distinct_servers() -> None:
    sizes = [100, 3 * MIB, 0, MIB]
    placed_all = place(sizes, [4, 5, 6], replicas=2, stripe_bytes=MIB, group_bytes=MIB)
    for n, placed in zip(sizes, placed_all, strict=True):
        for u in units(n, placed):
            assert len(set(u.servers)) == 2


def test_empty_value_has_no_unit() -> None:
    assert place([0], [1], replicas=1, stripe_bytes=MIB, group_bytes=MIB) == [[]]


def test_more_replicas_than_servers_is_refused() -> None:
    with pytest.raises(ValueError, match="3 replicas"):
        place([1], [1, 2], replicas=3, stripe_bytes=MIB, group_bytes=MIB)


def test_order_by_free_weights_by_free_space() -> None:
    rng = random.Random(5)
    servers = [S(1, 1), S(2, 1000)]
    first = [order_by_free(servers, rng.random)[0].server_id for _ in range(2000)]
    assert first.count(2) > 1900  # 1000:1 odds
    assert sorted(s.server_id for s in order_by_free(servers, rng.random)) == [1, 2]
    assert order_by_free([S(3, 0), S(4, 0)], rng.random)  # no free space: still ordered
