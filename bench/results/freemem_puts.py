"""Consecutive large-put jobs on one cluster, each with the guest's free memory before and after it:
what a kvfs put job costs the chunkservers while it draws on memory the guest left free a long
while (on this VM's free page reporting, pages the host may have taken back) against pages
freed lately or reclaimed from the page cache.

Starts ``kvfs up --no-gc`` (``--fsync``; ``--gc-interval``: with its GC daemon) in a temporary directory, then runs ``--jobs`` jobs of
``--seconds`` each: ``put_many`` of 32 values of 1 MiB over 128 keys, two calls in flight (the
comparison's ``write 1m b32 qd2`` cell).  ``--client both`` alternates the async client and the
blocking ``kvfs.Client`` (called from two threads, as ``kvfs bench --client sync`` does) job by
job.  Per job: keys/s, the client's (this process's) and the three chunkservers' CPU per GB
(``/proc``), MemFree before -> after, and ``/proc/vmstat``'s reclaim counters where they moved.
No GC runs, so every job's bytes stay in the page cache: a run of N jobs draws on about
N x 2-3 GB of free memory, then reclaims.

python bench/results/freemem_puts.py [--fsync never|batch] [--jobs 10] [--seconds 3] [--client async|sync|both]
    [--gc-interval 1s]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvfs import AsyncClient, Client
from kvfs._loop import run
from kvfs.bench.cpu import mem_free_mib

BS, BATCH, DEPTH, NKEYS = 1 << 20, 32, 2, 128
RECLAIM = ("pgscan_kswapd", "pgscan_direct", "allocstall_movable", "allocstall_normal", "compact_stall")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, v = line.split()
        if k in RECLAIM:
            out[k] = int(v)
    return out


def batch_at(keys: list[bytes], value: bytes, i: int) -> list[tuple[bytes, bytes]]:
    return [(keys[(i + j) % NKEYS], value) for j in range(BATCH)]


async def async_job(aio: AsyncClient, keys: list[bytes], value: bytes, seconds: float) -> int:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await aio.put_many(batch_at(keys, value, i))
            done += BATCH
            i += BATCH * DEPTH

    await asyncio.gather(*(worker(q * BATCH) for q in range(DEPTH)))
    return done


def sync_job(kv: Client, keys: list[bytes], value: bytes, seconds: float) -> int:
    done = [0] * DEPTH
    stop = time.perf_counter() + seconds

    def worker(q: int) -> None:
        i = q * BATCH
        while time.perf_counter() < stop:
            kv.put_many(batch_at(keys, value, i))
            done[q] += BATCH
            i += BATCH * DEPTH

    threads = [threading.Thread(target=worker, args=(q,)) for q in range(DEPTH)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)


async def jobs(addr: str, cs_pids: list[int], ns: argparse.Namespace) -> None:
    value = os.urandom(BS)
    clients = ["async", "sync"] if ns.client == "both" else [ns.client]
    keys = {c: [f"{c}/{i}".encode() for i in range(NKEYS)] for c in clients}
    aio = AsyncClient(addr)
    await aio.open()
    kv = await asyncio.to_thread(Client, addr) if "sync" in clients else None
    try:
        for j in range(ns.jobs):
            which = clients[j % len(clients)]
            v0, c0, p0, f0 = vmstat(), sum(map(cpu_s, cs_pids)), time.process_time(), mem_free_mib()
            t0 = time.perf_counter()
            if kv is not None and which == "sync":
                n = await asyncio.to_thread(sync_job, kv, keys[which], value, ns.seconds)
            else:
                n = await async_job(aio, keys[which], value, ns.seconds)
            dt = time.perf_counter() - t0
            v1, c1, p1, f1 = vmstat(), sum(map(cpu_s, cs_pids)), time.process_time(), mem_free_mib()
            gb = n * BS / 1e9
            moved = " ".join(f"{k}={v1[k] - v0[k]}" for k in RECLAIM if v1.get(k, 0) != v0.get(k, 0))
            print(f"{j:2} {which:5} {n / dt:6.0f} keys/s  client {(p1 - p0) / gb:.3f}  "
                  f"chunkservers {(c1 - c0) / gb:.3f} s/GB  MemFree {f0} -> {f1} MiB  {moved}",
                  flush=True)
    finally:
        if kv is not None:
            await asyncio.to_thread(kv.close)
        await aio.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsync", choices=("never", "batch"), default="never")
    p.add_argument("--jobs", type=int, default=10)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--client", choices=("async", "sync", "both"), default="async")
    p.add_argument("--dir", default=None, help="where the cluster's data goes (default: a temp dir)")
    p.add_argument("--gc-interval", default=None, metavar="DURATION",
                   help="run the cluster's GC daemon this often, e.g. 1s (default: no GC)")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory(dir=ns.dir) as tmp:
        log = Path(tmp, "up.log")
        with log.open("w") as out:
            gc = ["--no-gc"] if ns.gc_interval is None else ["--gc-interval", ns.gc_interval]
            up = subprocess.Popen([sys.executable, "-m", "kvfs", "up", "--fsync", ns.fsync, *gc,
                                   "--data", str(Path(tmp, "data")), "--listen", "127.0.0.1:0"],
                                  stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "chunkserver 2" not in log.read_text():
                if up.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"kvfs up did not start: {log.read_text()[-2000:]}")
                time.sleep(0.1)
            text = log.read_text()
            addr = re.findall(r"^kvfs://\S+", text, re.M)[0]
            cs_pids = [int(x) for x in re.findall(r"chunkserver \d+ (\d+)", text)]
            run(jobs(addr, cs_pids, ns))
        finally:
            up.terminate()
            up.wait(30)


if __name__ == "__main__":
    main()
