"""Cold reads through a mount, round by round, and the memory they take (bench/RESULTS.md,
2026-12-03): ``kvfs up`` (no GC) and one ``kvfs mount``; each round puts N new values of SIZE
bytes through the API under ``rN/``, then 8 threads read them through the mount (which never
saw them) with ``readinto`` into buffers made once, bytes checked; prints the mount's CPU and
run-queue wait per file, MemFree and the part of it in small blocks after each round.  Every round's files stay (their
page-cache pages too), so MemFree falls round by round.

    python bench/results/memstate35-coldprobe.py
    env: ROUNDS (6), N (256), SIZE (2 MiB), MARGS (more `kvfs mount` arguments, e.g.
    --direct-first-open), PERF=1 (perf record of the mount over each round's reads, to
    /tmp/coldprobe-rN.perf), RECLAIM=1 (each round's files deleted through the mount after it)
"""

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import kvfs
from kvfs.bench.cpu import free_text
from kvfs.bench.mount_pages import _cpu_wait_s, _mount, _read_pages, kvfs_up

ROUNDS = int(os.environ.get("ROUNDS", "6"))
N = int(os.environ.get("N", "256"))
SIZE = int(os.environ.get("SIZE", str(2 << 20)))
THREADS = 8


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="coldprobe-"))
    mnt = root / "mnt"
    mnt.mkdir()
    ups: list[subprocess.Popen[bytes]] = []
    mounts: list[subprocess.Popen[bytes]] = []
    try:
        addr = kvfs_up(root, ups)
        _mount(mnt, addr, os.environ.get("MARGS", "").split(), mounts)
        pid = mounts[0].pid
        rng = np.random.default_rng(1)
        pages = [rng.integers(0, 255, SIZE, dtype=np.uint8) for _ in range(N)]
        bufs = [np.empty(SIZE, dtype=np.uint8) for _ in range(THREADS)]

        async def put(tag: str) -> None:
            async with kvfs.connect(addr) as c:
                for s in range(0, N, 32):
                    await c.put_many([(f"{tag}/{i:08d}.bin".encode(), pages[i])
                                      for i in range(s, min(N, s + 32))])

        for r in range(ROUNDS):
            tag = f"r{r}"
            asyncio.run(put(tag))
            names = [mnt / tag / f"{i:08d}.bin" for i in range(N)]

            def read(t: int, names: list[Path] = names) -> int:
                return _read_pages(names, pages, range(t, N, THREADS), bufs[t])

            perf = None
            if os.environ.get("PERF"):
                perf = subprocess.Popen(["perf", "record", "-F", "1999", "-g", "-o",
                                         f"/tmp/coldprobe-r{r}.perf", "-p", str(pid)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.3)  # (perf attached before the reads begin)
            c0, w0 = _cpu_wait_s(pid)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(THREADS) as ex:
                bad = sum(ex.map(read, range(THREADS)))
            t = time.perf_counter() - t0
            c1, w1 = _cpu_wait_s(pid)
            if perf is not None:
                perf.send_signal(2)
                perf.wait()
            if os.environ.get("RECLAIM"):
                shutil.rmtree(mnt / tag, ignore_errors=True)
            print(f"round {r}: {N / t:,.0f} files/s, mount CPU/file {(c1 - c0) / N * 1e6:,.0f} us, "
                  f"wait {(w1 - w0) / N * 1e6:,.0f} us, bad {bad}, MemFree {free_text()}", flush=True)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        for m in mounts:
            m.wait(30)
        for p in ups:
            p.terminate()
            p.wait(30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
