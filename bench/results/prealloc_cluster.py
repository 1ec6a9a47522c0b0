"""Chunk preallocation in the cluster ``kvfs bench`` embeds: is it in effect, and what it buys.

python bench/results/prealloc_cluster.py [--rounds 3] [--bs 1m] [--batch 32] [--fsync never]

Starts the embedded cluster's kind (``ProcessCluster``: meta + 3 chunkservers as child
processes) once with the chunkservers' default (``--preallocate``) and once with
``--no-preallocate``, alternating, and runs the same ``kvfs bench --rw write`` against each
(``--addr``). After each run it prints the open chunk files' size and allocated bytes: a
preallocated chunk holds ``chunk_bytes`` (64 MiB) of blocks past what was written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvfs.launcher import ProcessCluster


def chunk_blocks(root: Path) -> tuple[int, int, int]:
    """(chunk files, bytes written, bytes allocated) under a cluster's data dir."""
    files = list(root.glob("cs*/chunks/*.chunk"))
    sts = [f.stat() for f in files]
    return len(files), sum(s.st_size for s in sts), sum(s.st_blocks * 512 for s in sts)


async def one(mode: str, ns: argparse.Namespace) -> tuple[float, str]:
    with tempfile.TemporaryDirectory(prefix="kvfs-prealloc-") as d:
        args = ("--fsync", ns.fsync) + (("--no-preallocate",) if mode == "off" else ())
        pc = ProcessCluster(Path(d), 3, listen="127.0.0.1:0", meta_args=("--fsync", ns.fsync),
                            chunkserver_args=args)
        await pc.start()
        try:
            proc = await asyncio.to_thread(subprocess.run, [
                sys.executable, "-m", "kvfs", "bench", "--addr", pc.addr, "--rw", "write",
                "--bs", ns.bs, "--batch", str(ns.batch), "--iodepth", "2", "--size", ns.size,
                "--runtime", str(ns.runtime), "--time-based", "--no-progress"],
                env={**os.environ, "KVFS_TOKEN": pc.token}, capture_output=True, text=True,
                timeout=300, check=True)
            n, size, alloc = chunk_blocks(Path(d))
        finally:
            await pc.stop()
    m = re.search(r" write: IOPS=\S+ BW=\S+ \(([\d.]+)MB/s\)", proc.stdout)
    if m is None:
        raise SystemExit(f"no write figure in:\n{proc.stdout}\n{proc.stderr}")
    return float(m.group(1)), f"{n} chunks, {size >> 20} MiB written, {alloc >> 20} MiB allocated"


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bs", default="1m")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", default="128m")
    p.add_argument("--runtime", type=float, default=4.0)
    p.add_argument("--fsync", default="never", choices=("always", "batch", "never"))
    ns = p.parse_args()
    got: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(ns.rounds):
        for mode in ("on", "off"):
            mbs, where = await one(mode, ns)
            got[mode].append(mbs)
            load = os.getloadavg()[0]
            print(f"round {r + 1} preallocate {mode:3s}: {mbs:.0f} MB/s ({where}; load {load:.1f})",
                  flush=True)
    for mode, v in got.items():
        print(f"preallocate {mode:3s}: median {statistics.median(v):.0f} MB/s of "
              + " / ".join(f"{x:.0f}" for x in v))


if __name__ == "__main__":
    asyncio.run(main())
