"""Meta store cost: bytes per key and per-key cost of commit, lookup and match_prefix
against batch size, for the Redis Cluster store (:mod:`kvfs.meta.redis_store`) and for
meta's own index over RocksDB (meta's default, ``--store rocksdb``) or SQLite.

``python -m kvfs.bench.metastore --store redis --keys 1000000`` starts a local 3-master
Redis Cluster (or uses ``--url redis-cluster://...``), reads ``used_memory`` of every
master, commits ``--keys`` keys the way the issue measured SQLite meta (38-byte keys,
layouts of 100-byte values with one replica, batches of 1,000), reads the memory again,
and then times each operation at each ``--batches`` size (``overwrite``: a commit of
keys already there).  It calls the store API in
this process: no meta RPC in front of it, and the Redis servers share the machine's
cores with the client.

``--store sqlite`` (or ``rocksdb``) does the same through meta's own RPC handlers
(``MetaService``, in this process, no socket; each COMMIT packed as the client sends it,
:mod:`kvfs.packed`): its memory is this process's RSS growth (the in-memory index), the
store's size on disk is reported beside it.

``--restart`` then starts a real ``kvfs meta`` process on the filled store (the SQLite
file, the RocksDB directory, or the Redis Cluster) and reports the seconds until it prints its ready line and
its RSS then, beside the same figures for a meta on an empty store (the baseline).
``--batches ''`` skips the per-op timings (the 10M runs), ``--fill-deadline-s`` stops
the fill early (the figures are then for the keys that fit), ``--progress`` prints a
line per million keys to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.redis_local import LocalRedisCluster
from kvfs.meta.redis_store import RedisMetaStore
from kvfs.packed import pack as pack_layouts
from kvfs.server import reply_of

NOW = 1_800_000_000.0


def key(i: int, tag: str = "k") -> bytes:
    return f"{tag}{i:037d}".encode()[:38]


PER_CHUNK = 500_000  # layouts per chunk: 160-byte records (the key's and the value's) in a chunk of 80 MB


def layout(i: int, per_chunk: int = PER_CHUNK) -> Layout:
    """Key ``i``'s layout: a 100-byte value on server 1, ``per_chunk`` of them a chunk."""
    chunk = (1 << 40) | (i // per_chunk)
    return Layout(100, 0xABCDEF, NOW, None, (Extent(100, 0x1234567, (Replica(1, chunk, (i % per_chunk) * 160),)),))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class LocalMeta:
    """Meta (its in-memory index over its local store: meta's ``--store``, default RocksDB)
    driven through its RPC handlers."""

    def __init__(self, data: Path, store: str | None = None) -> None:
        from kvfs import rpc
        from kvfs.config import MetaConfig
        from kvfs.meta.service import MetaService

        self.rpc = rpc
        self.data = data
        self.meta = MetaService(MetaConfig(data=data, store=store), clock=lambda: NOW)

    async def open(self) -> None:
        await self.meta.rpc_register(self.rpc.Register(server_id=1, addr="127.0.0.1:1"), memoryview(b""))

    async def commit(self, rows: list[tuple[bytes, Layout]], now: float) -> None:
        """The COMMIT a client sends (WritePath.commit): the layouts packed in columns."""
        packed = pack_layouts([k for k, _ in rows], [v for _, v in rows])
        await self.meta.rpc_commit(self.rpc.Commit(packed=packed), memoryview(b""))

    async def lookup(self, keys: list[bytes], now: float) -> Any:
        return await reply_of(self.meta.rpc_lookup(self.rpc.Lookup(keys=keys), memoryview(b"")))

    async def match_prefix(self, keys: list[bytes], now: float) -> Any:
        return await reply_of(self.meta.rpc_match_prefix(self.rpc.MatchPrefix(keys=keys), memoryview(b"")))

    async def delete(self, keys: list[bytes]) -> Any:
        return await self.meta.rpc_delete(self.rpc.Delete(keys=keys), memoryview(b""))

    async def flush_access(self) -> None:
        await self.meta.index.flush()

    async def close(self) -> None:
        await self.meta.close()


async def used_memory(store: RedisMetaStore) -> int:
    info = await store.r.info("memory", target_nodes=store.r.PRIMARIES)
    return sum(int(v["used_memory"]) for v in info.values())


async def fill(store: Any, n: int, batch: int, tag: str, deadline_s: float | None = None,
               progress: bool = False, per_chunk: int = PER_CHUNK) -> tuple[int, float]:
    """Commit ``n`` keys (fewer if ``deadline_s`` passes first), ``per_chunk`` a chunk;
    (keys, seconds)."""
    t0 = time.perf_counter()
    lo = 0
    while lo < n:
        if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
            break
        hi = min(n, lo + batch)
        await store.commit([(key(i, tag), layout(i, per_chunk)) for i in range(lo, hi)], NOW)
        if progress and hi // 1_000_000 != lo // 1_000_000:
            print(f"filled {hi} keys in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        lo = hi
    return lo, time.perf_counter() - t0


def start_meta(data: Path, url: str | None, namespace: str,
               timeout_s: float = 3600.0) -> tuple[float, int]:
    """Start ``kvfs meta`` on ``data`` (or on ``url``'s Redis Cluster; ``url`` "rocksdb" or
    "sqlite": that store in ``data``); the seconds until it prints its ready line, and its RSS
    then.  It is stopped before returning."""
    args = [sys.executable, "-m", "kvfs", "meta", "--data", str(data), "--listen", "127.0.0.1:0"]
    if url in ("rocksdb", "sqlite"):
        args += ["--store", url]
    elif url is not None:
        args += ["--store", url, "--store-namespace", namespace]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the ready line, or b"" if it exited
        ready_s = time.perf_counter() - t0
        if b"ready" not in line:
            raise RuntimeError(f"kvfs meta exited before it was ready (rc {proc.wait()})")
        rss = 0
        for row in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if row.startswith("VmRSS:"):
                rss = int(row.split()[1]) * 1024
        return ready_s, rss
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def timed(fn: Any, min_s: float, min_calls: int) -> tuple[float, int]:
    calls = 0
    t0 = time.perf_counter()
    while calls < min_calls or time.perf_counter() - t0 < min_s:
        await fn(calls)
        calls += 1
    return time.perf_counter() - t0, calls


async def run(kind: str, url: str | None, keys: int, batches: list[int], min_s: float,
              buckets: int, *, restart: bool = False, fill_deadline_s: float | None = None,
              progress: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        namespace = f"bench{os.getpid()}"
        rc = None
        store: Any
        local = kind in ("sqlite", "rocksdb")
        if local:
            store = LocalMeta(Path(tmp) / "meta", kind)
            memory: Any = rss_bytes
        else:
            if url is None:
                rc = LocalRedisCluster(Path(tmp)).start()
                url = rc.url
            store = RedisMetaStore(url, namespace=namespace, buckets=buckets)

            async def memory() -> int:
                return await used_memory(store)
        await store.open()
        closed = False
        try:
            async def mem() -> int:
                m = memory()
                return int(await m) if asyncio.iscoroutine(m) else int(m)

            mem0 = await mem()
            keys, fill_s = await fill(store, keys, 1000, "k", fill_deadline_s, progress)
            await store.flush_access()
            mem1 = await mem()
            out: dict[str, Any] = {
                "store": kind, "url": url, "buckets": getattr(store, "buckets", None), "keys": keys,
                "machine": f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f} after the fill",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "sqlite_file_bytes": (sum(f.stat().st_size for f in (Path(tmp) / "meta").glob("meta.sqlite3*"))
                                      if kind == "sqlite" else None),
                "rocksdb_bytes": (sum(f.stat().st_size for f in (Path(tmp) / "meta" / "meta.rocksdb").iterdir())
                                  if kind == "rocksdb" else None),
                "used_memory_before": mem0, "used_memory_after": mem1,
                "bytes_per_key": (mem1 - mem0) / keys if keys else None,
                "fill_keys_per_s": keys / fill_s if fill_s else None, "ops": []}
            for b in batches:
                fresh = 0

                async def commit(c: int, b: int = b) -> None:
                    nonlocal fresh
                    await store.commit([(key(fresh + j, "n"), layout(j)) for j in range(b)], NOW)
                    fresh += b

                async def lookup(c: int, b: int = b) -> None:
                    lo = (c * b) % max(1, keys - b)
                    await store.lookup([key(i) for i in range(lo, lo + b)], NOW)

                async def match(c: int, b: int = b) -> None:
                    lo = (c * b) % max(1, keys - b)
                    await store.match_prefix([key(i) for i in range(lo, lo + b)], NOW)

                async def overwrite(c: int, b: int = b) -> None:  # the filled keys, committed again
                    lo = (c * b) % max(1, keys - b)
                    await store.commit([(key(i), layout(i)) for i in range(lo, lo + b)], NOW)

                for name, fn in (("commit", commit), ("lookup", lookup), ("match_prefix", match),
                                 ("overwrite", overwrite)):
                    dt, calls = await timed(fn, min_s, 3)
                    out["ops"].append({"op": name, "batch": b, "calls": calls,
                                       "us_per_key": dt / (calls * b) * 1e6,
                                       "keys_per_s": calls * b / dt, "ms_per_call": dt / calls * 1e3})
                for lo in range(0, fresh, 1000):
                    await store.delete([key(i, "n") for i in range(lo, min(fresh, lo + 1000))])
            if restart:
                await store.close()
                closed = True
                del store
                importlib.import_module("gc").collect()  # (kvfs.gc shadows the name for mypy)
                where = kind if local else url
                empty_s, empty_rss = start_meta(Path(tmp) / "empty", where, namespace + "empty")
                ready_s, rss = start_meta(Path(tmp) / ("meta" if local else "redismeta"),
                                          where, namespace)
                out["restart"] = {"empty_ready_s": empty_s, "empty_rss": empty_rss,
                                  "ready_s": ready_s, "rss": rss,
                                  "rss_per_key": (rss - empty_rss) / keys if keys else None}
            return out
        finally:
            if not closed:
                await store.close()
            if rc is not None:
                rc.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.metastore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=("redis", "sqlite", "rocksdb"), default="redis")
    ap.add_argument("--url", help="redis-cluster://h:p,... (default: start a local 3-master cluster)")
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--batches", default="1,16,128,1024")
    ap.add_argument("--min-s", type=float, default=1.0, help="time each op at least this long")
    ap.add_argument("--buckets", type=int, default=256)
    ap.add_argument("--restart", action="store_true",
                    help="then time a kvfs meta process's start on the filled store")
    ap.add_argument("--fill-deadline-s", type=float, default=None,
                    help="stop filling after this long (the figures are for the keys that fit)")
    ap.add_argument("--progress", action="store_true", help="a line per million keys on stderr")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = asyncio.run(run(a.store, a.url, a.keys, [int(x) for x in a.batches.split(",") if x],
                          a.min_s, a.buckets, restart=a.restart, fill_deadline_s=a.fill_deadline_s,
                          progress=a.progress))
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    what = (f"{res['buckets']} buckets: Redis used_memory" if res["store"] == "redis" else
            f"SQLite file {res['sqlite_file_bytes']} B; meta RSS" if res["store"] == "sqlite" else
            f"RocksDB directory {res['rocksdb_bytes']} B; meta RSS")
    print(f"{res['store']}, {res['keys']} keys, {what} {res['used_memory_before']} -> "
          f"{res['used_memory_after']} = {res['bytes_per_key']:.0f} B/key; "
          f"fill {res['fill_keys_per_s']:.0f} keys/s (batches of 1000)")
    if "restart" in res:
        r = res["restart"]
        print(f"kvfs meta start: ready in {r['ready_s']:.1f} s, RSS {r['rss']} B "
              f"(empty store: {r['empty_ready_s']:.1f} s, {r['empty_rss']} B) = "
              f"{r['rss_per_key']:.0f} B/key")
    print(f"{'op':<13} {'batch':>6} {'us/key':>9} {'keys/s':>10} {'ms/call':>9}")
    for o in res["ops"]:
        print(f"{o['op']:<13} {o['batch']:>6} {o['us_per_key']:>9.1f} {o['keys_per_s']:>10.0f} "
              f"{o['ms_per_call']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
