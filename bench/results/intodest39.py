"""get_into's ``into_dests`` where buffers are larger than their values (its per-key loop):
us per 128-key call, best of 7 x 2,000 (bench/RESULTS.md, 2026-12-03 16:10 UTC)."""

import timeit

import kvfs.client as c
from kvfs.layout import Extent, Layout, Replica

KEYS = 128
lays = [Layout(4096, 0, 0.0, None, (Extent(4096, 0, (Replica(1, 1, i * 4096),)),))
        for i in range(KEYS)]
bufs = [bytearray(8192) for _ in range(KEYS)]
ks, views, rooms = c.into_call([b"k%d" % i for i in range(KEYS)], bufs, None)
N = 2000
t = min(timeit.repeat(lambda: c.into_dests(lays, views, rooms), number=N, repeat=7))
print(f"into_dests {KEYS} keys, rooms > sizes: {t / N * 1e6:.1f} us/call")
