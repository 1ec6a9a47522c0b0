"""What one group fdatasync costs after appends like a chunkserver's: N MiB written as 4 MiB
pwrite pieces, then fdatasync, per file, with W writers (threads, one file each) at once.

Modes: ``keep`` appends into space reserved by fallocate(KEEP_SIZE) (a chunkserver's
default), ``plain`` appends to a file with no reservation, ``over`` rewrites blocks already
written and synced (what fio's time-based job does after its first pass). ``+sfr`` starts
each piece's writeback at once (sync_file_range SYNC_FILE_RANGE_WRITE), so the fdatasync
finds less to write. ``--gap-ms`` sleeps between pieces (a piece's time on the network).

python bench/results/fdatasync_modes.py [--dir DIR] [--mib 16] [--writers 3] [--gap-ms 0]
       [--rounds 8] [--reps 3] [--modes keep,plain,over,keep+sfr]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import threading
import time

PIECE = 4 << 20
FALLOC_FL_KEEP_SIZE = 1
SYNC_FILE_RANGE_WRITE = 2

libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def writer(path: str, mode: str, nbytes: int, rounds: int, gap_s: float, buf: bytes,
           out: list[float]) -> None:
    """Append (or rewrite) ``nbytes`` a round, fdatasync; the fdatasync times go to ``out``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        base_mode = mode.split("+")[0]
        if base_mode == "keep":
            if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, nbytes * rounds) != 0:
                raise OSError(ctypes.get_errno(), "fallocate")
        elif base_mode == "over":  # two rounds' worth laid out and synced, rewritten in turn
            for off in range(0, 2 * nbytes, PIECE):
                os.pwrite(fd, buf, off)
            os.fsync(fd)
        sfr = mode.endswith("+sfr")
        for r in range(rounds):
            base = (r % 2) * nbytes if base_mode == "over" else r * nbytes
            for off in range(base, base + nbytes, PIECE):
                os.pwrite(fd, buf, off)
                if sfr:
                    libc.sync_file_range(fd, off, PIECE, SYNC_FILE_RANGE_WRITE)
                if gap_s:
                    time.sleep(gap_s)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)


def run(directory: str, mode: str, ns: argparse.Namespace, buf: bytes) -> tuple[float, float]:
    """(median fdatasync ms, MB/s over all writers) for one pass of ``mode``."""
    nbytes = ns.mib << 20
    times: list[float] = []
    with tempfile.TemporaryDirectory(dir=directory) as d:
        threads = [threading.Thread(target=writer, args=(os.path.join(d, f"f{i}"), mode, nbytes,
                                                        ns.rounds, ns.gap_ms / 1e3, buf, times))
                   for i in range(ns.writers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    return statistics.median(times) * 1e3, ns.writers * ns.rounds * nbytes / wall / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--mib", type=int, default=16, help="MiB written between two fdatasyncs")
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="keep,plain,over,keep+sfr")
    ns = ap.parse_args()
    if ns.mib * (1 << 20) % PIECE:
        ap.error("--mib must be a multiple of 4")
    buf = os.urandom(PIECE)
    modes = ns.modes.split(",")
    res: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for rep in range(ns.reps):  # modes alternate; the order flips each pass
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            res[mode].append(run(ns.dir, mode, ns, buf))
    print(f"{ns.writers} writer(s), {ns.mib} MiB per fdatasync in 4 MiB pieces, gap {ns.gap_ms:g} ms, "
          f"{ns.rounds} rounds, {ns.reps} passes (median of each pass's fdatasyncs; MB/s of each pass)")
    for mode, v in res.items():
        ms = " / ".join(f"{x[0]:.1f}" for x in v)
        rate = " / ".join(f"{x[1]:.0f}" for x in v)
        print(f"{mode:9s} fdatasync ms {ms} (median {statistics.median(x[0] for x in v):.1f})   "
              f"MB/s {rate} (median {statistics.median(x[1] for x in v):.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
