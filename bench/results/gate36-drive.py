"""4 threads of get_into (128 x 4 KiB) on one blocking kvfs.Client against a `kvfs up`
cluster at ADDR: keys/s and the client process's CPU us per key, per variant, alternating
(bench/RESULTS.md, 2026-12-03): default; gateN (at most N callers in the in-thread read
path at once, the others waiting on a semaphore); socks2 (``ClientConfig(server_sockets=2)``:
a third and fourth concurrent call go through the IO thread).

    python bench/results/gate36-drive.py ADDR default,gate2,socks2,gate3 [ROUNDS]
"""

import os
import random
import sys
import threading
import time

import kvfs
from kvfs.config import ClientConfig

THREADS, B, SZ, N, DUR = 4, 128, 4096, 8192, 3.0


def run(addr: str, keys: list[bytes], variant: str) -> tuple[float, float]:
    cfg = ClientConfig(server_sockets=2) if variant == "socks2" else None
    with kvfs.Client(addr, config=cfg) as kv:
        if variant.startswith("gate"):
            gate = threading.BoundedSemaphore(int(variant[4:]))
            read_here = kv._read_here

            def gated(*a: object, **k: object) -> bool:
                with gate:
                    return read_here(*a, **k)  # type: ignore[arg-type]

            kv._read_here = gated  # type: ignore[method-assign]
        bufs = [[bytearray(SZ) for _ in range(B)] for _ in range(THREADS)]
        for t in range(THREADS):  # warm: sockets open, layouts cached
            kv.get_into(keys[:B], bufs[t])
        counts = [0] * THREADS
        stop = time.monotonic() + DUR

        def worker(t: int) -> None:
            rnd, n = random.Random(t), 0
            while time.monotonic() < stop:
                got = kv.get_into(rnd.sample(keys, B), bufs[t])
                assert all(x == SZ for x in got), got[:4]
                n += B
            counts[t] = n

        c0, w0 = time.process_time(), time.monotonic()
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        c1, w1 = time.process_time(), time.monotonic()
    n = sum(counts)
    return n / (w1 - w0), (c1 - c0) / n * 1e6


def main() -> None:
    addr, variants = sys.argv[1], sys.argv[2].split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    keys = [b"gate-%06d" % i for i in range(N)]
    with kvfs.Client(addr) as kv:
        if not kv.exists(keys[-1]):
            for i in range(0, N, 512):
                kv.put_many([(k, os.urandom(SZ)) for k in keys[i:i + 512]])
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            rate, us = run(addr, keys, v)
            print(f"round {r} {v:8s} {rate / 1e3:7.1f}k keys/s  client {us:5.2f} us/key", flush=True)


if __name__ == "__main__":
    main()
