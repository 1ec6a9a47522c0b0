"""A control without kvfs (bench/RESULTS.md, 2026-12-03): the first touch of fresh anonymous
memory, 1 GiB a round (a copy into each MiB of a new mapping), every round kept so that MemFree
falls; prints each round's CPU per GiB and MemFree after it (and the part of it in small blocks,
:func:`kvfs.bench.cpu.small_free_mib`).  With HOLD_S, it then keeps the
memory that long (at most 600 s) before it exits, so that another job runs without it (SIGTERM
ends the hold at once).

    python bench/results/memstate35-touch.py [ROUNDS] [HOLD_S]   (default 8 GiB, no hold)
"""

import mmap
import signal
import sys
import time

from kvfs.bench.cpu import mem_free_mib, small_free_mib

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
        small = small_free_mib()
        print(f"round {r}: {c:.3f} s CPU per GiB, {t:.3f} s wall, MemFree after {mem_free_mib()} MiB, "
              f"of it in small blocks {'-' if small is None else small} MiB", flush=True)
    hold_s = min(float(sys.argv[2]), 600.0) if len(sys.argv) > 2 else 0.0
    if hold_s > 0:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print(f"holding {len(kept)} GiB for at most {hold_s:.0f} s", flush=True)
        time.sleep(hold_s)  # (a hold for another job to run meanwhile, not a wait for a condition)


if __name__ == "__main__":
    main()
