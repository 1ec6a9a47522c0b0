"""Buffered preadv vs O_DIRECT preadv on a chunk-sized file, read the way the
chunkserver reads spans (random aligned spans into a page-aligned buffer).

Usage: python -m kvfs.bench.odirect [FILE]   (writes a 256 MiB file; see bench/RESULTS.md)
"""

from __future__ import annotations

import mmap
import os
import random
import sys
import tempfile
import time

SIZE = 256 << 20


def make_file(path: str) -> None:
    if os.path.exists(path) and os.path.getsize(path) == SIZE:
        return
    with open(path, "wb") as f:
        for _ in range(SIZE >> 20):
            f.write(os.urandom(1 << 20))


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(path: str, direct: bool, span: int, n: int) -> tuple[float, float]:
    """(reads/s, GB/s) of ``n`` random ``span``-sized aligned reads."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    buf = mmap.mmap(-1, span)  # page-aligned, as O_DIRECT needs
    rng = random.Random(1)
    offsets = [rng.randrange(0, SIZE // span) * span for _ in range(n)]
    try:
        t = time.perf_counter()
        for off in offsets:
            os.preadv(fd, [buf], off)
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
        buf.close()
    return n / dt, n * span / dt / 1e9


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = args[0] if args else os.path.join(tempfile.gettempdir(), "kvfs-odirect-chunk")
    make_file(path)
    for span, n in ((4096, 20000), (64 << 10, 4000), (1 << 20, 256)):
        for cold in (True, False):
            for direct in (False, True):
                if cold:
                    drop_cache(path)
                elif not direct:
                    run(path, False, span, n)  # fill the page cache first
                ops, gbs = run(path, direct, span, n)
                print(f"span {span >> 10:>5} KiB {'cold' if cold else 'warm'} "
                      f"{'O_DIRECT' if direct else 'buffered':9}: {ops:>9,.0f} reads/s {gbs:5.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
