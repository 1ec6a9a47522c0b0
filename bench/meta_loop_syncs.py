"""The disk syncs meta's event loop makes while COMMITs cross WAL checkpoints.

``python -m kvfs.bench.meta_loop_syncs [--keys 20000] [--batch 128] [--committers 4]
[--seconds 10] [--dir DIR]`` (from a tree whose kvfs lacks this module: ``python
PATH/bench/meta_loop_syncs.py``) runs meta's index in a child process (``MetaIndex`` over a
real ``MetaStore`` in ``DIR``, ``--fsync batch``, the main thread its event loop) under
``strace -f --seccomp-bpf -e trace=fdatasync,fsync -T``: ``--committers`` coroutines each
COMMIT ``--batch`` keys drawn at random from ``--keys`` random 16-byte keys (each group
dirties many B-tree pages, so the WAL is checkpointed often) for ``--seconds``, while a
probe sleeps 1 ms at a time and records how late it woke (the loop's lag).  Prints one
JSON line: per thread kind (``loop``, ``other``: the sync thread) the syncs made during
the load phase, their total and longest time; the checkpoints run; the lag percentiles;
keys/s.  Needs strace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


async def load(d: Path, keys: int, batch: int, committers: int, seconds: float) -> dict[str, Any]:
    from kvfs.config import MetaConfig
    from kvfs.layout import Extent, Layout, Replica
    from kvfs.meta.index import MetaIndex
    from kvfs.meta.store import MetaStore

    ix = MetaIndex(MetaConfig(data=d), MetaStore(d / "meta.sqlite3"), time.time)
    lay = Layout(10, 7, 0.0, None, (Extent(10, 7, (Replica(1, 1 << 40, 0),)),))
    rnd = random.Random(1)
    space = [rnd.randbytes(16) for _ in range(keys)]
    t0 = time.time()
    stop = time.monotonic() + seconds
    commits = 0
    lags: list[float] = []

    async def committer() -> None:
        nonlocal commits
        while time.monotonic() < stop:
            await ix.commit([(k, lay) for k in rnd.sample(space, batch)], time.time(), None)
            commits += 1

    async def probe() -> None:
        while time.monotonic() < stop:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    await asyncio.gather(probe(), *(committer() for _ in range(committers)))
    t1 = time.time()
    checkpoints = ix._wal.checkpoints
    await ix.close()
    lags.sort()

    def pct(p: float) -> float:
        return round(lags[int(p * (len(lags) - 1))] * 1e3, 2)

    return {"pid": os.getpid(), "t0": t0, "t1": t1, "checkpoints": checkpoints,
            "keys_per_s": round(commits * batch / seconds),
            "lag_ms": {"p50": pct(0.5), "p99": pct(0.99), "p999": pct(0.999), "max": pct(1.0)}}


def count(trace: str, out: dict[str, Any]) -> dict[str, Any]:
    syncs: dict[str, list[float]] = {"loop": [], "other": []}
    for m in re.finditer(r"^(\d+) +([\d.]+) (?:fdatasync|fsync)\(.*<([\d.]+)>$", trace, re.M):
        if out["t0"] <= float(m[2]) <= out["t1"]:
            syncs["loop" if int(m[1]) == out["pid"] else "other"].append(float(m[3]))
    return {k: {"n": len(v), "total_ms": round(sum(v) * 1e3, 1), "max_ms": round(max(v, default=0) * 1e3, 2)}
            for k, v in syncs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=20_000, help="key space (default 20000)")
    ap.add_argument("--batch", type=int, default=128, help="keys per COMMIT (default 128)")
    ap.add_argument("--committers", type=int, default=4, help="COMMITs in flight (default 4)")
    ap.add_argument("--seconds", type=float, default=10.0, help="load phase (default 10)")
    ap.add_argument("--dir", type=Path, default=None, help="where the database goes (default: a temp dir)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(dir=args.dir))
    if args.child:
        print(json.dumps(asyncio.run(load(d, args.keys, args.batch, args.committers, args.seconds))))
        return
    trace = d / "strace"
    child = [sys.executable, os.path.abspath(__file__), "--child", "--dir", str(d), "--keys", str(args.keys),
             "--batch", str(args.batch), "--committers", str(args.committers), "--seconds", str(args.seconds)]
    run = subprocess.run(["strace", "-f", "--seccomp-bpf", "-qq", "-ttt", "-T", "-o", str(trace),
                          "-e", "trace=fdatasync,fsync", *child], capture_output=True, text=True, check=True)
    out = json.loads(run.stdout.splitlines()[-1])
    out["syncs"] = count(trace.read_text(), out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
