"""A put's values of one extent with one replica are cached as :class:`~kvfs.layoutcache.Single`
(their Layout built only when a read asks): the same layouts as meta's once built, the cache
still bounded by its entries, an entry built in place (same LRU position) unless a put
replaced it meanwhile, expiry honoured, and reads of them return the values written."""

from __future__ import annotations

import os

from kvfs.client import AsyncClient
from kvfs.layout import Extent, Layout, Replica
from kvfs.layoutcache import LayoutCache, Single, flatten
from tests.conftest import FakeClock, value_of


def _single(i: int, expires_at: float | None = None) -> Single:
    return Single(10 + i, 100 + i, 1, 2, i * 64, 5.0, expires_at, None)


def _cache(entries: int) -> LayoutCache:
    return LayoutCache(None, entries)  # type: ignore[arg-type]  # (no TOUCH is sent here)


def test_a_single_builds_the_layout_of_its_fields() -> None:
    s = Single(4096, 7, 3, (3 << 40) | 1, 8192, 5.0, 9.0, b"\x80")
    assert s.layout() == Layout(4096, 7, 5.0, 9.0, (Extent(4096, 7, (Replica(3, (3 << 40) | 1, 8192),)),),
                                b"\x80")


def test_singles_are_bounded_built_when_read_and_keep_their_place() -> None:
    cache = _cache(3)
    keys = [b"a", b"b", b"c"]
    singles = [_single(i) for i in range(3)]
    cache.put_many(keys, singles)
    got, missing = cache.get_many([b"b", b"x"], 0.0)
    assert got == [singles[1].layout(), None] and missing == [1]
    assert type(cache._layouts[b"b"]) is Layout  # built once, kept in the Single's place
    flat = cache.flat_many([b"c"], 0.0)
    assert flat == [flatten(singles[2].layout())] and type(cache._layouts[b"c"]) is Layout
    assert list(cache._layouts) == keys  # LRU order unchanged by the reads' builds
    cache.put_many([b"d"], [_single(3)])  # evicts the oldest, b"a" (never read)
    assert list(cache._layouts) == [b"b", b"c", b"d"] and len(cache) == 3
    cache.put_many([b"e", b"f"], [_single(4), _single(5)])
    assert list(cache._layouts) == [b"d", b"e", b"f"] and set(cache._flat) == set()
    cache.pop(b"e")
    cache.clear()
    assert len(cache) == 0 and cache.get_many([b"d"], 0.0) == ([None], [0])


def test_a_full_cache_evicts_the_least_recently_used_of_a_put_at_once() -> None:
    """A put into a full cache drops as many of the least recently used keys as it adds (a
    key put again is the most recent, not evicted), their flat forms with them; a put of
    more keys than the cache holds keeps its last ones."""
    cache = _cache(4)
    cache.put_many([b"a", b"b", b"c", b"d"], [_single(i) for i in range(4)])
    assert cache.flat_many([b"a", b"b", b"c"], 0.0) is not None  # read: flat forms made
    cache.put_many([b"a", b"e", b"f"], [_single(i) for i in range(4, 7)])
    assert list(cache._layouts) == [b"d", b"a", b"e", b"f"] and set(cache._flat) == set()
    assert cache.flat_many([b"d"], 0.0) is not None
    cache.put_many([b"g", b"d", b"h"], [_single(7), None, _single(8)])  # None: not written
    assert list(cache._layouts) == [b"e", b"f", b"g", b"h"] and cache._flat == {}
    cache.put_many([b"%d" % i for i in range(6)], [_single(i) for i in range(6)])
    assert list(cache._layouts) == [b"2", b"3", b"4", b"5"] and len(cache) == 4


def test_a_single_replaced_or_evicted_before_it_was_built_is_not_put_back() -> None:
    cache = _cache(10)
    old, new = _single(1), _single(2)
    cache.put_many([b"k"], [old])
    got: list[Layout | Single | None] = [old]  # what a read found before a put replaced it
    cache.put_many([b"k"], [new])
    assert cache.build([b"k"], got) is got == [old.layout()] and cache._layouts[b"k"] is new
    small = _cache(1)  # one evicted before it was built is not put back either (bounded)
    small.put_many([b"k"], [old])
    small.put_many([b"j"], [new])
    assert small.build([b"k"], [old]) == [old.layout()] and list(small._layouts) == [b"j"]


def test_an_expired_single_is_a_miss() -> None:
    cache = _cache(10)
    cache.put_many([b"t", b"u"], [_single(1, expires_at=50.0), _single(2)])
    assert cache.flat_many([b"t", b"u"], 60.0) is None  # the general way drops it
    got, missing = cache.get_many([b"t", b"u"], 60.0)
    assert got == [None, _single(2).layout()] and missing == []
    assert b"t" not in cache._layouts


async def test_reads_of_values_a_put_cached_unbuilt(kv: AsyncClient, clock: FakeClock) -> None:
    """Through the flat forms, the general path (a key not cached among them), after an
    overwrite and after expiry: the values written, and meta's layouts."""
    keys = [f"s/{i}".encode() for i in range(128)]
    assert await kv.put_many([(k, value_of(k.decode())) for k in keys]) == [True] * 128
    assert {type(kv.layout_cache._layouts[k]) for k in keys} == {Single}
    assert await kv.get_many(keys[:64]) == [value_of(k.decode()) for k in keys[:64]]
    assert await kv.get_many([*keys[60:], b"s/none"]) == [value_of(k.decode()) for k in keys[60:]] + [None]
    assert [kv.layout_cache._layouts[k] for k in keys] == await kv.lookup(keys, use_cache=False)
    new = os.urandom(3000)
    await kv.put_many([(keys[5], new)], ttl=10)
    assert type(kv.layout_cache._layouts[keys[5]]) is Single
    bufs = [bytearray(4096) for _ in keys[:8]]
    assert await kv.get_into(keys[:8], bufs) == [4096] * 5 + [3000] + [4096] * 2
    assert bytes(bufs[5][:3000]) == new
    clock.advance(11)
    assert await kv.get_many(keys[4:7]) == [value_of("s/4"), None, value_of("s/6")]
