"""What a commit costs on the Redis Cluster store, per key: wall time, the client's CPU and
the Redis masters' CPU, for new keys and for overwrites, at several batch sizes; and the
masters' memory per key.  For a before/after of a change to the store's Lua scripts: run
it with each tree's python, alternately, in one sitting, and compare medians.

``python -m kvfs.bench.commit_cost --keys 20000 --batches 1,16,128,1024 --min-s 2``
(from another tree whose kvfs lacks this module: ``python PATH/bench/commit_cost.py``).
It starts a local 3-master Redis Cluster (no replicas, no persistence), fills ``--keys``
keys (38-byte keys, layouts of two replicas on two servers, ``--keys-per-chunk`` keys per
chunk (1,000), batches of 1,000), reads ``used_memory`` before and after, and then per batch size commits fresh
keys, then overwrites them (each into another chunk), for at least ``--min-s`` each.
Redis CPU is the masters' ``used_cpu_user + used_cpu_sys`` (INFO cpu) over the timed
calls; the client's is this process's CPU time.  Everything shares the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.redis_local import LocalRedisCluster, _command
from kvfs.meta.redis_store import RedisMetaStore

NOW = 1_800_000_000.0


def key(i: int, tag: str) -> bytes:
    return f"{tag}{i:037d}".encode()[:38]


def layout(i: int, gen: int = 0, per_chunk: int = 1000) -> Layout:
    seq = 1 + gen * 1_000_000 + i // per_chunk
    off = (i % per_chunk) * 160
    return Layout(100, 0xABCDEF, NOW, None, (Extent(100, 0x1234567, (
        Replica(1, (1 << 40) | seq, off), Replica(2, (2 << 40) | seq, off))),))


def _info(rc: LocalRedisCluster, section: bytes) -> list[dict[str, str]]:
    out = []
    for n in rc.nodes:
        text = (_command(n.port, b"INFO", section) or b"").decode()
        out.append(dict(line.split(":", 1) for line in text.splitlines() if ":" in line))
    return out


def redis_cpu_s(rc: LocalRedisCluster) -> float:
    return sum(float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in _info(rc, b"cpu"))


def redis_memory(rc: LocalRedisCluster) -> int:
    return sum(int(i["used_memory"]) for i in _info(rc, b"memory"))


async def run(keys: int, batches: list[int], min_s: float, per_chunk: int) -> dict[str, Any]:
    import kvfs.meta.redis_store as rs

    with tempfile.TemporaryDirectory() as tmp, LocalRedisCluster(Path(tmp)) as rc:
        store = RedisMetaStore(rc.url, namespace="cc")
        await store.open()
        try:
            mem0 = redis_memory(rc)
            t0 = time.perf_counter()
            for lo in range(0, keys, 1000):
                await store.commit([(key(i, "k"), layout(i, 0, per_chunk))
                                    for i in range(lo, min(keys, lo + 1000))], NOW)
            fill_s = time.perf_counter() - t0
            await store.flush_access()
            mem1 = redis_memory(rc)
            out: dict[str, Any] = {
                "store_module": rs.__file__, "keys": keys, "keys_per_chunk": per_chunk, "batches": batches, "min_s": min_s,
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "load": os.getloadavg()[0], "fill_keys_per_s": keys / fill_s,
                "bytes_per_key": (mem1 - mem0) / keys, "ops": []}
            base = 0
            for b in batches:
                made = 0  # calls of fresh keys at this batch size: the overwrites cycle over them
                for op in ("new", "overwrite"):
                    calls = 0
                    w0, c0, r0 = time.perf_counter(), time.process_time(), redis_cpu_s(rc)
                    while calls < 3 or time.perf_counter() - w0 < min_s:
                        if op == "new":
                            lo, gen = base + calls * b, 0
                        else:  # each pass over them moves every key into other chunks
                            lo, gen = base + (calls % made) * b, 1 + calls // made
                        await store.commit([(key(i, "n"), layout(i, gen, per_chunk)) for i in range(lo, lo + b)],
                                           NOW)
                        calls += 1
                    wall, cpu, rcpu = (time.perf_counter() - w0, time.process_time() - c0,
                                       redis_cpu_s(rc) - r0)
                    n = calls * b
                    out["ops"].append({"op": op, "batch": b, "keys": n, "wall_us_per_key": wall / n * 1e6,
                                       "client_cpu_us_per_key": cpu / n * 1e6,
                                       "redis_cpu_us_per_key": rcpu / n * 1e6})
                    if op == "new":
                        made = calls
                base += made * b
            return out
        finally:
            await store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.commit_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--batches", default="1,16,128,1024")
    ap.add_argument("--min-s", type=float, default=2.0)
    ap.add_argument("--keys-per-chunk", type=int, default=1000,
                    help="keys whose replicas share a chunk (64 MiB chunks of 1 MiB values: 64)")
    a = ap.parse_args(argv)
    res = asyncio.run(run(a.keys, [int(x) for x in a.batches.split(",") if x], a.min_s, a.keys_per_chunk))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
