"""4 threads of blocking get_into / get_many of 128 random 4 KiB keys against a running
``kvfs up`` (bench/RESULTS.md, the flat-combining section of 2026-12-03 13:12).

    python combine38-drive.py ADDR put            # 8,192 keys of 4 KiB, once
    python combine38-drive.py ADDR into|many [S]  # S seconds (default 4)

``REGION=1``: get_into's buffers are slices of one bytearray; ``MOST=N``: the combining
patch's leaders (``combine38.patch``; ignored without it)."""

from __future__ import annotations

import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import kvfs

N = 8192


def main() -> None:
    addr, api = sys.argv[1], sys.argv[2]
    secs = float(sys.argv[3]) if len(sys.argv) > 3 else 4.0
    c = kvfs.Client(addr)
    combiner = getattr(c, "_into", None)
    if os.environ.get("MOST") and combiner is not None:
        combiner._most = int(os.environ["MOST"])
    keys = [f"k{i:06d}".encode() for i in range(N)]
    if api == "put":
        for i in range(0, N, 128):
            c.put_many([(k, os.urandom(4096)) for k in keys[i : i + 128]])
        print("put done")
        c.close()
        return
    stop = time.monotonic() + secs
    counts = [0] * 4

    def work(t: int) -> None:
        rnd = random.Random(t)
        if os.environ.get("REGION"):
            region = memoryview(bytearray(128 * 4096))
            bufs: list[bytearray | memoryview] = [region[i * 4096 : (i + 1) * 4096] for i in range(128)]
        else:
            bufs = [bytearray(4096) for _ in range(128)]
        while time.monotonic() < stop:
            ks = rnd.sample(keys, 128)
            n = len(c.get_into(ks, bufs)) if api == "into" else len(c.get_many(ks))
            counts[t] += n

    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    elapsed = time.monotonic() - t0
    cpu = sum(os.times()[:2])
    done = sum(counts)
    print(api, f"{done / elapsed / 1e3:.1f}k keys/s cpu {cpu / done * 1e6:.2f}us/key(all) "
          f"combined={getattr(combiner, 'combined', '-')} of {done // 128}")
    c.close()


if __name__ == "__main__":
    main()
