"""Meta's lookup latency while other clients put: what a commit's sync costs the readers.

``python -m kvfs.bench.lookup_during_puts [--seconds 5] [--writers 1] [--iodepth 4]
[--batch 128] [--bs 4096]`` (from a tree whose kvfs lacks this module: ``python
PATH/bench/lookup_during_puts.py``) starts a process cluster (``kvfs meta`` and 3
chunkservers, each its own process, default ``--fsync batch``), fills 1,000 keys, then
runs two phases of ``--seconds`` each and prints one JSON line:

- ``idle``: this process calls ``exists_many`` on one key at a time (a present key or a
  missing one, alternately), one call in flight, and records each call's latency;
- ``puts``: the same, while ``--writers`` other processes each run ``--iodepth``
  coroutines of ``put_many`` of ``--batch`` fresh keys of ``--bs`` bytes (the writers'
  keys/s is reported beside).

Each EXISTS is one RPC to meta (no cache on the client), so its latency is meta's
queueing behind whatever its event loop is doing: with commits synced on the loop, a
commit group's WAL fsync; with the sync in a thread, only the group's write.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfs.client import AsyncClient
from kvfs.launcher import ProcessCluster


def _writer(addr: str, token: str, seconds: float, iodepth: int, batch: int, bs: int, wid: int,
            out: Any, go: Any) -> None:
    async def main() -> int:
        done = 0
        value = os.urandom(bs)
        async with AsyncClient(addr, token=token) as kv:
            await kv.put_many([(f"w{wid}-warm".encode(), value)])
            out.put("ready")
            await asyncio.to_thread(go.wait, 120)
            end = time.monotonic() + seconds
            seq = 0

            async def one() -> None:
                nonlocal done, seq
                while time.monotonic() < end:
                    seq += 1
                    keys = [f"w{wid}-{seq}-{i}".encode() for i in range(batch)]
                    await kv.put_many([(k, value) for k in keys])
                    done += batch

            await asyncio.gather(*(one() for _ in range(iodepth)))
        return done

    out.put(asyncio.run(main()))


async def probe(kv: AsyncClient, seconds: float) -> list[float]:
    lat: list[float] = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        key = f"fill-{i % 1000}".encode() if i % 2 == 0 else f"absent-{i}".encode()
        t = time.perf_counter()
        await kv.exists_many([key])
        lat.append(time.perf_counter() - t)
        i += 1
    return lat


def summary(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    q = statistics.quantiles(lat, n=100)
    return {"calls": len(lat), "p50_us": round(q[49] * 1e6, 1), "p90_us": round(q[89] * 1e6, 1),
            "p99_us": round(q[98] * 1e6, 1), "mean_us": round(statistics.fmean(lat) * 1e6, 1),
            "max_us": round(lat[-1] * 1e6, 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ProcessCluster(Path(tmp) / "c", 3, listen="127.0.0.1:0")
        await cluster.start()
        try:
            async with cluster.client() as kv:
                for lo in range(0, 1000, 100):
                    await kv.put_many([(f"fill-{i}".encode(), b"v" * 100) for i in range(lo, lo + 100)])
                idle = await probe(kv, args.seconds)
                ctx = multiprocessing.get_context("spawn")
                q, go = ctx.Queue(), ctx.Event()
                procs = [ctx.Process(target=_writer, args=(cluster.addr, cluster.token, args.seconds,
                                                           args.iodepth, args.batch, args.bs, w, q, go))
                         for w in range(args.writers)]
                for p in procs:
                    p.start()
                for _ in procs:  # each connected and has put once
                    assert await asyncio.to_thread(q.get, True, 120) == "ready"
                go.set()
                busy = await probe(kv, args.seconds)
                keys = 0
                for _ in procs:
                    keys += await asyncio.to_thread(q.get, True, 120)
                for p in procs:
                    await asyncio.to_thread(p.join, 60)
        finally:
            await cluster.stop()
    return {"idle": summary(idle), "puts": summary(busy), "writer_keys_per_s": round(keys / args.seconds),
            "writers": args.writers, "iodepth": args.iodepth, "batch": args.batch, "bs": args.bs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each phase (default 5)")
    ap.add_argument("--writers", type=int, default=1, help="writer processes (default 1)")
    ap.add_argument("--iodepth", type=int, default=4, help="put_many calls in flight per writer (default 4)")
    ap.add_argument("--batch", type=int, default=128, help="keys per put_many (default 128)")
    ap.add_argument("--bs", type=int, default=4096, help="value bytes (default 4096)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
