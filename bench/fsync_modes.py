"""What each durability setting costs: `kvfs bench` writes against a 3-chunkserver cluster
(child processes) started with ``--fsync always|batch|never`` on meta and chunkservers.

Usage: python -m kvfs.bench.fsync_modes [--runtime 3] [--bs 4k,64k] [--iodepth 8] [--batch N] [--dir DIR]
Prints one line per mode and size (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from kvfs.launcher import ProcessCluster

MODES = ("always", "batch", "never")


async def run_mode(mode: str, root: Path, ns: argparse.Namespace) -> list[dict[str, float | str]]:
    pc = ProcessCluster(root / mode, 3, listen="127.0.0.1:0", meta_args=("--fsync", mode),
                        chunkserver_args=("--fsync", mode))
    await pc.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvfs", "bench", "--addr", pc.addr,
            "--rw", "write", "--bs", ns.bs, "--iodepth", str(ns.iodepth), *(["--batch", str(ns.batch)] if ns.batch else []),
            "--runtime", str(ns.runtime),
            "--time_based", "--output-format", "json", stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "KVFS_TOKEN": pc.token})  # never a token on argv
        out, _ = await proc.communicate()
        if proc.returncode:
            raise SystemExit(f"kvfs bench failed under --fsync {mode} (exit {proc.returncode})")
    finally:
        await pc.stop()
    rows = []
    for job in json.loads(out)["jobs"]:
        w = job["write"]
        pct = w["clat_ns"]["percentile"]
        rows.append({"mode": mode, "job": job["jobname"], "iops": w["iops"], "bw_MiBps": w["bw_bytes"] / 2**20,
                     "p50_us": pct.get("50.000000", 0) / 1e3, "p99_us": pct.get("99.000000", 0) / 1e3})
    return rows


async def main_async(ns: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=ns.dir) as d:
        for mode in MODES:
            for r in await run_mode(mode, Path(d), ns):
                print(f"{r['mode']:6} {r['job']:28} {r['iops']:10.0f} keys/s {r['bw_MiBps']:9.1f} MiB/s "
                      f"p50 {r['p50_us']:9.0f} us  p99 {r['p99_us']:9.0f} us", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfs.bench.fsync_modes", description=__doc__)
    p.add_argument("--runtime", type=float, default=3.0, help="seconds per job")
    p.add_argument("--bs", default="4k,64k", help="value sizes")
    p.add_argument("--iodepth", type=int, default=8, help="puts in flight")
    p.add_argument("--batch", type=int, default=None, help="keys per put_many (default: kvfs bench's)")
    p.add_argument("--dir", type=Path, default=None, help="where the clusters live (default: $TMPDIR)")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
