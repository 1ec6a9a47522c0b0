"""Meta throughput with 1, 2, 3... ``kvfs meta --store redis-cluster`` processes over one
Redis Cluster: ``python -m kvfs.bench.metas --metas 1,2,3``.

Starts a local 3-master cluster, commits ``--keys`` layouts into it directly, then for
each meta count starts that many ``kvfs meta`` processes and ``--clients`` client
processes (spread round-robin over the metas), each calling ``exists_many`` in batches
of ``--batch`` for ``--seconds``, and reports the keys checked per second in total.
Everything (Redis, metas, clients) shares this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvfs.address import TOKEN_ENV
from kvfs.bench.metastore import fill, key
from kvfs.client import AsyncClient
from kvfs.handshake import Role
from kvfs.launcher import ServiceProcess
from kvfs.meta.redis_local import LocalRedisCluster
from kvfs.meta.redis_store import RedisMetaStore


async def _drive(addr: str, token: str, keys: int, batch: int, seconds: float, seed: int) -> int:
    kv = AsyncClient(addr, token=token)
    try:
        n, i = 0, seed * 7919
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            lo = (i * batch) % max(1, keys - batch)
            await kv.exists_many([key(j) for j in range(lo, lo + batch)])
            n += batch
            i += 1
        return n
    finally:
        await kv.close()


def _client(args: tuple[str, str, int, int, float, int]) -> int:
    return asyncio.run(_drive(*args))


async def run(metas: list[int], keys: int, clients: int, batch: int, seconds: float) -> list[tuple[int, float]]:
    out = []
    tokens = {r: secrets.token_hex(16) for r in (Role.CLIENT, Role.ADMIN, Role.SERVER)}
    env = {**os.environ, **{TOKEN_ENV[r]: t for r, t in tokens.items()}}
    with tempfile.TemporaryDirectory() as tmp, LocalRedisCluster(Path(tmp) / "redis") as rc:
        store = RedisMetaStore(rc.url, namespace="metas")
        await store.open()
        try:
            await store.put_server(1, "127.0.0.1:1", 1 << 40, 1 << 40)
            await fill(store, keys, 1000, "k")
        finally:
            await store.close()
        for n in metas:
            procs = [ServiceProcess(f"meta {i}", [
                sys.executable, "-m", "kvfs", "meta", "--data", str(Path(tmp) / f"m{n}.{i}"),
                "--listen", "127.0.0.1:0", "--store", rc.url, "--store-namespace", "metas"], env)
                for i in range(n)]
            try:
                addrs = [(await p.start()).split()[-1] for p in procs]
                loop = asyncio.get_running_loop()
                with ProcessPoolExecutor(clients) as ex:
                    t0 = time.monotonic()
                    done = await asyncio.gather(*(loop.run_in_executor(
                        ex, _client, (addrs[c % n], tokens[Role.CLIENT], keys, batch, seconds, c))
                        for c in range(clients)))
                    dt = time.monotonic() - t0
                out.append((n, sum(done) / dt))
            finally:
                for p in procs:
                    await p.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.metas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--metas", default="1,2,3")
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--clients", type=int, default=3, help="client processes")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args(argv)
    res = asyncio.run(run([int(x) for x in a.metas.split(",")], a.keys, a.clients, a.batch, a.seconds))
    print(f"exists_many, batches of {a.batch}, {a.clients} client processes, {a.keys} keys, "
          f"{os.cpu_count()} cores")
    base = res[0][1]
    for n, rate in res:
        print(f"{n} meta{'s' if n > 1 else ' '}  {rate:>10.0f} keys/s  {rate / base:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
