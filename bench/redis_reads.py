"""What ``kvfs stat``'s key counts, a compaction's chunk references and a repair plan's keys
cost on the Redis Cluster store against the store's size: the read each made before the
chunk index (one pass over every key, :meth:`RedisMetaStore.scan`) beside the reads they
make now (:meth:`~RedisMetaStore.key_stats`, :meth:`~RedisMetaStore.refs` of one chunk and
of one server), timed in the same run.

``python -m kvfs.bench.redis_reads --keys 10000,100000 --repeat 5`` starts a local
3-master Redis Cluster (no replicas), and for each size adds keys up to it (38-byte keys,
layouts of two replicas: every key on server 1, and on one of 8 other servers; 1,000 keys
per chunk; batches of 1,000), then times each read ``--repeat`` times (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.redis_local import LocalRedisCluster
from kvfs.meta.redis_store import RedisMetaStore

NOW = 1_800_000_000.0
PER_CHUNK = 1000
OTHERS = 8  # servers 2..9 hold the second replicas


def key(i: int) -> bytes:
    return f"k{i:037d}".encode()[:38]


def layout(i: int) -> Layout:
    seq, off = 1 + i // PER_CHUNK, (i % PER_CHUNK) * 160
    other = 2 + (i // PER_CHUNK) % OTHERS
    return Layout(100, 0xABCDEF, NOW, None, (Extent(100, 0x1234567, (
        Replica(1, (1 << 40) | seq, off), Replica(other, (other << 40) | seq, off))),))


async def median_s(fn: Callable[[], Awaitable[Any]], repeat: int) -> tuple[float, Any]:
    times, got = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), got


async def run(sizes: list[int], repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, LocalRedisCluster(Path(tmp)) as rc:
        store = RedisMetaStore(rc.url, namespace="reads")
        await store.open()
        out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "repeat": repeat, "rows": []}
        try:
            have = 0
            for n in sorted(sizes):
                for lo in range(have, n, 1000):
                    await store.commit([(key(i), layout(i)) for i in range(lo, min(n, lo + 1000))], NOW)
                have = n

                async def scan() -> int:
                    return sum([len(rows) async for rows in store.scan()])

                async def refs(chunks: tuple[int, ...] = (), servers: tuple[int, ...] = ()) -> int:
                    return sum([len(rows) async for rows in store.refs(chunks, servers)])

                row: dict[str, Any] = {"keys": n, "load": os.getloadavg()[0]}
                for name, fn in (("scan_every_key", scan),
                                 ("key_stats", lambda: store.key_stats(NOW)),
                                 ("refs_one_chunk", lambda: refs(((1 << 40) | 1,))),
                                 ("refs_one_server", lambda: refs(servers=(2,)))):
                    s, got = await median_s(fn, repeat)
                    row[name] = {"ms": s * 1e3, "result": got if isinstance(got, int) else list(got)}
                out["rows"].append(row)
        finally:
            await store.close()
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.redis_reads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="10000,100000", help="store sizes, ascending")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    print(json.dumps(asyncio.run(run([int(x) for x in a.keys.split(",") if x], a.repeat)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
