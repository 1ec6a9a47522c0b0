"""Meta's lookup latency while other clients put, delete or run GC: what meta's syncs cost the readers.

``python -m kvfs.bench.lookup_during_puts [--during puts|delete|gc] [--seconds 5]
[--writers 1] [--iodepth 4] [--batch 128] [--bs 4096] [--prefill 100000] [--keys seq|hashed]
[--meta-arg=ARG ...]`` (from a tree
whose kvfs lacks this module: ``python PATH/bench/lookup_during_puts.py``) starts a
process cluster (``kvfs meta`` and 3 chunkservers, each its own process, default
``--fsync batch``), fills 1,000 keys, then runs two phases of ``--seconds`` each and
prints one JSON line:

- ``idle``: this process calls ``exists_many`` on one key at a time (a present key or a
  missing one, alternately), one call in flight, and records each call's latency;
- the ``--during`` phase (its figures under that name): the same, while ``--writers``
  other processes each load meta:

  - ``puts``: ``--iodepth`` coroutines of ``put_many`` of ``--batch`` fresh keys of
    ``--bs`` bytes (``--keys seq``: ``w<writer>-<seq>-<i>``, neighbours in meta's SQLite
    B-tree; ``hashed``: 32 random hex digits, as an engine's chunk hashes are, so each
    batch touches many B-tree pages and the WAL grows faster);
  - ``delete``: each writer first puts ``--prefill`` keys of ``--bs`` bytes (before the
    phase), then ``--iodepth`` coroutines ``delete_many`` them, ``--batch`` at a time
    (a writer that runs out of keys stops early: ``load_s`` says how long the load ran);
  - ``gc``: the churn of ``kvfs bench --gc`` (``kvfs.bench.gcbench.churn``: rate-limited
    overwrites and expiring puts, 16 MiB/s of 16 KiB values) with GC passes back to back
    (``grace_s=0``: expire, evict, compact, delete chunks, report), in that process,
    with the admin token.

  The writers' keys/s (put or deleted) is reported beside, and for ``gc`` the passes run.

Each EXISTS is one RPC to meta (no cache on the client), so its latency is meta's
queueing behind whatever its event loop is doing: a sync on the loop (a commit group's,
a DELETE's, a GC transaction's) holds every lookup that arrives meanwhile; a sync in
meta's sync thread holds none, only the transaction's write.
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


def _writer(addr: str, token: str, mode: str, seconds: float, iodepth: int, batch: int, bs: int,
            prefill: int, hashed: bool, wid: int, out: Any, go: Any) -> None:
    async def main() -> dict[str, Any]:
        done = 0
        value = os.urandom(bs)
        async with AsyncClient(addr, token=token) as kv:
            await kv.put_many([(f"w{wid}-warm".encode(), value)])
            doomed: list[bytes] = []
            if mode == "delete":
                doomed = [f"w{wid}-d{i}".encode() for i in range(prefill)]
                for lo in range(0, prefill, 1024):
                    await kv.put_many([(k, value) for k in doomed[lo:lo + 1024]])
            out.put("ready")
            await asyncio.to_thread(go.wait, 120)
            t0 = time.monotonic()
            end = t0 + seconds
            seq = 0
            extra: dict[str, Any] = {}

            async def put() -> None:
                nonlocal done, seq
                while time.monotonic() < end:
                    seq += 1
                    keys = ([os.urandom(16).hex().encode() for _ in range(batch)] if hashed
                            else [f"w{wid}-{seq}-{i}".encode() for i in range(batch)])
                    await kv.put_many([(k, value) for k in keys])
                    done += batch

            async def delete() -> None:
                nonlocal done, seq
                while time.monotonic() < end and seq < len(doomed):
                    keys = doomed[seq:seq + batch]
                    seq += batch
                    n = await kv.delete_many(keys)  # (not `done += await`: that adds to a stale read)
                    done += n

            if mode == "gc":
                from kvfs.bench.gcbench import ChurnOptions, churn

                stop = asyncio.Event()
                task = asyncio.ensure_future(churn(addr, token, ChurnOptions(), stop))
                await asyncio.sleep(seconds)
                stop.set()
                st = await task
                done = st.puts
                extra = {"gc_passes": st.passes, "expired_keys": st.totals["expired_keys"],
                         "chunks_compacted": st.totals["chunks_compacted"],
                         "chunks_deleted": st.totals["chunks_deleted"]}
            else:
                await asyncio.gather(*((put if mode == "puts" else delete)() for _ in range(iodepth)))
        return {"keys": done, "load_s": time.monotonic() - t0, **extra}

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
            "p99_us": round(q[98] * 1e6, 1), "p999_us": round(lat[int(0.999 * (len(lat) - 1))] * 1e6, 1),
            "mean_us": round(statistics.fmean(lat) * 1e6, 1),
            "max_us": round(lat[-1] * 1e6, 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ProcessCluster(Path(tmp) / "c", 3, listen="127.0.0.1:0", meta_args=tuple(args.meta_arg))
        await cluster.start()
        try:
            async with cluster.client() as kv:
                for lo in range(0, 1000, 100):
                    await kv.put_many([(f"fill-{i}".encode(), b"v" * 100) for i in range(lo, lo + 100)])
                idle = await probe(kv, args.seconds)
                ctx = multiprocessing.get_context("spawn")
                q, go = ctx.Queue(), ctx.Event()
                token = cluster.admin_token if args.during == "gc" else cluster.token  # (GC: the admin's)
                procs = [ctx.Process(target=_writer, args=(cluster.addr, token, args.during, args.seconds,
                                                           args.iodepth, args.batch, args.bs, args.prefill,
                                                           args.keys == "hashed", w, q, go))
                         for w in range(args.writers)]
                for p in procs:
                    p.start()
                for _ in procs:  # each connected and has put once (delete: its keys)
                    assert await asyncio.to_thread(q.get, True, 600) == "ready"
                go.set()
                busy = await probe(kv, args.seconds)
                loads = [await asyncio.to_thread(q.get, True, 120) for _ in procs]
                for p in procs:
                    await asyncio.to_thread(p.join, 60)
        finally:
            await cluster.stop()
    load_s = max(x["load_s"] for x in loads)
    out: dict[str, Any] = {"during": args.during, "idle": summary(idle), args.during: summary(busy),
                           "writer_keys_per_s": round(sum(x["keys"] for x in loads) / load_s),
                           "load_s": round(load_s, 2)}
    for k in ("gc_passes", "expired_keys", "chunks_compacted", "chunks_deleted"):
        if k in loads[0]:
            out[k] = sum(x[k] for x in loads)
    return {**out, "writers": args.writers, "iodepth": args.iodepth, "batch": args.batch, "bs": args.bs,
            "keys": args.keys, "meta_args": args.meta_arg}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--during", choices=("puts", "delete", "gc"), default="puts",
                    help="what the writer processes do while lookups are timed (default puts)")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each phase (default 5)")
    ap.add_argument("--writers", type=int, default=1, help="writer processes (default 1)")
    ap.add_argument("--iodepth", type=int, default=4,
                    help="put_many/delete_many calls in flight per writer (default 4)")
    ap.add_argument("--batch", type=int, default=128, help="keys per put_many/delete_many (default 128)")
    ap.add_argument("--bs", type=int, default=4096, help="value bytes (default 4096)")
    ap.add_argument("--prefill", type=int, default=100_000,
                    help="--during delete: keys each writer puts first, then deletes (default 100000)")
    ap.add_argument("--keys", choices=("seq", "hashed"), default="seq",
                    help="--during puts: the writers' keys, sequential names or random hex (default seq)")
    ap.add_argument("--meta-arg", action="append", default=[], metavar="ARG",
                    help="an argument for `kvfs meta` (repeat it; e.g. --meta-arg=--commit-group-max-keys=1024)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
