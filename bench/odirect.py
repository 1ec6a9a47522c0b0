# Usage: python bench/odirect.py [FILE]   (writes a 256 MiB file; needs root to drop its cache)
"""Buffered preadv vs O_DIRECT preadv on a chunk-sized file, as the chunkserver reads spans."""
import mmap
import os
import random
import sys
import tempfile
import time

path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "kvfs-odirect-chunk")
SIZE = 256 << 20
if not os.path.exists(path) or os.path.getsize(path) != SIZE:
    with open(path, "wb") as f:
        for _ in range(SIZE >> 20):
            f.write(os.urandom(1 << 20))
def drop_cache():
    fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def run(direct, span, n, cold):
    if cold: drop_cache()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    buf = mmap.mmap(-1, span)  # page-aligned, as O_DIRECT needs
    rng = random.Random(1)
    offs = [rng.randrange(0, SIZE // span) * span for _ in range(n)]
    t = time.perf_counter()
    for o in offs:
        os.preadv(fd, [buf], o)
    dt = time.perf_counter() - t
    os.close(fd)
    return n / dt, n * span / dt / 1e9
for span, n in [(4096, 20000), (64 << 10, 4000), (1 << 20, 256)]:
    for cold in (True, False):
        for direct in (False, True):
            if not cold and not direct:
                run(False, span, n, False)  # warm the cache first
            ops, gbs = run(direct, span, n, cold)
            print(f"span {span>>10:>5} KiB {'cold' if cold else 'warm'} {'O_DIRECT' if direct else 'buffered':9}: {ops:>9,.0f} reads/s {gbs:5.2f} GB/s")
