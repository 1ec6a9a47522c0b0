"""An in-memory key order for meta (LIST by key range) if its store stopped keeping one:
sortedcontainers.SortedList of N 64-byte keys: build, add, remove, a LIST page, memory
(bench/RESULTS.md, 2026-12-04).  Usage: python sorted-index-2026-12-04.py N"""
import hashlib
import itertools
import random
import sys
import time
import tracemalloc

from sortedcontainers import SortedList

N = int(sys.argv[1])
keys = [hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(N)]
tracemalloc.start()
t = time.perf_counter()
sl = SortedList(keys)
build = time.perf_counter() - t
cur, _ = tracemalloc.get_traced_memory()
tracemalloc.stop()
new = [hashlib.sha256(b"n%d" % i).hexdigest().encode() for i in range(100000)]
t = time.perf_counter()
for k in new:
    sl.add(k)
add = (time.perf_counter() - t) / len(new) * 1e6
t = time.perf_counter()
for k in new:
    sl.remove(k)
rem = (time.perf_counter() - t) / len(new) * 1e6
starts = random.sample(keys, 1000)
t = time.perf_counter()
for start in starts:
    page = list(itertools.islice(sl.irange(start, inclusive=(False, True)), 1000))
lst = (time.perf_counter() - t) / len(starts) * 1e3
print(f"N={N}: build {build:.2f} s, {cur / N:.0f} B a key (the index only: the keys themselves "
      f"are meta's already), add {add:.2f} us, remove {rem:.2f} us, a LIST page of 1000 after a "
      f"key {lst:.2f} ms")
# new keys merged into the order 1,024 at a time
sl2 = SortedList(keys)
t = time.perf_counter()
for at in range(0, len(new), 1024):
    sl2.update(new[at : at + 1024])
bulk = (time.perf_counter() - t) / len(new) * 1e6
print(f"N={N}: the same keys merged 1,024 at a time (SortedList.update): {bulk:.2f} us a key")
