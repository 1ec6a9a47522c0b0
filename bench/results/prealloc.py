"""16 MiB pwritev appends to a fresh file: plain, after posix_fallocate, after fallocate KEEP_SIZE.

python bench/results/prealloc.py [DIR]   (DIR: a directory on the disk to measure; default .)
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import time

APPEND = 16 << 20
N = 8


def run(directory: str, mode: str, buf: bytes) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        path = os.path.join(d, "f")
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
        try:
            t0 = time.perf_counter()
            if mode == "posix":
                os.posix_fallocate(fd, 0, N * APPEND)
            elif mode == "keep":
                libc.fallocate(fd, 1, ctypes.c_int64(0), ctypes.c_int64(N * APPEND))
            for i in range(N):
                os.pwritev(fd, [buf], i * APPEND)
            return N * APPEND / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)


def main() -> int:
    directory = sys.argv[1] if len(sys.argv) > 1 else "."
    buf = os.urandom(APPEND)
    res: dict[str, list[float]] = {"none": [], "posix": [], "keep": []}
    for _ in range(5):
        for mode in res:
            res[mode].append(run(directory, mode, buf))
    for mode, v in res.items():
        v.sort()
        print(f"{mode:6s} " + " ".join(f"{x:.2f}" for x in v) + f" GB/s   (median {v[2]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
