"""Every key of meta's index listed in one step, for one dict and for a KeyMap, and a KeyMap
a shard at a time (meta.index.listed's way, the longest shard timed): 1M random 64-byte keys,
3 tries (bench/RESULTS.md, "meta's keys split over 256 dicts").
Usage: python bench/results/keymap-list-2026-12-05.py"""
import hashlib
import time

from kvfs.meta.keymap import KeyMap

N = 1_000_000
keys = [hashlib.sha256(b"%d" % i).hexdigest().encode() for i in range(N)]
d = dict.fromkeys(keys, 1)
km = KeyMap((k, 1) for k in keys)
for _ in range(3):
    t0 = time.perf_counter()
    list(d)
    t1 = time.perf_counter()
    list(km)
    t2 = time.perf_counter()
    out: list[bytes] = []
    longest = 0.0
    for shard in km.shards:
        t = time.perf_counter()
        out.extend(shard)
        longest = max(longest, time.perf_counter() - t)
    t3 = time.perf_counter()
    print(f"list(dict) {1e3 * (t1 - t0):.1f} ms, list(KeyMap) {1e3 * (t2 - t1):.1f} ms, "
          f"a shard at a time {1e3 * (t3 - t2):.1f} ms in all, the longest shard {1e3 * longest:.2f} ms")
