"""A control without kvfs (bench/RESULTS.md, 2026-12-03): the first touch of fresh anonymous
memory, 1 GiB a round (a copy into each MiB of a new mapping), every round kept so that MemFree
falls; prints each round's CPU per GiB and MemFree after it.

    python bench/results/memstate35-touch.py [ROUNDS]   (default 8: 8 GiB, freed at exit)
"""

import mmap
import sys
import time

from kvfs.bench.cpu import mem_free_mib

MIB, GIB = 1 << 20, 1 << 30


def main() -> None:
    kept = []
    src = bytes(MIB)
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
        m = mmap.mmap(-1, GIB)
        c0, t0 = time.process_time(), time.perf_counter()
        for off in range(0, GIB, MIB):
            m[off:off + MIB] = src  # a copy into pages touched for the first time
        c, t = time.process_time() - c0, time.perf_counter() - t0
        kept.append(m)
        print(f"round {r}: {c:.3f} s CPU per GiB, {t:.3f} s wall, MemFree after {mem_free_mib()} MiB",
              flush=True)


if __name__ == "__main__":
    main()
