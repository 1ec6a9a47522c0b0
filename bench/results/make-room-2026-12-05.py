"""What a MAKE_ROOM pass costs (meta runs one GC pass for a writer that found the cluster
full): a process cluster (``kvfs meta`` and 3 chunkservers, as ``kvfs up`` runs them, no GC
daemon), 1,000 keys put, then N MAKE_ROOM calls one after another (nothing to expire or
evict: each pass syncs the chunk tables, plans, and reports).  Prints one JSON line: the
calls' wall time each (median, p90, max), meta's and the chunkservers' CPU per call
(``/proc/PID/stat``), and the TCP connections the cluster's ports accepted meanwhile
(``/proc/net/tcp``: sockets in TIME_WAIT, each a connection closed since).
Usage: python bench/results/make-room-2026-12-05.py [N]"""
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvfs import rpc
from kvfs.bench.cpu import cpu_seconds
from kvfs.launcher import ProcessCluster


def time_wait() -> int:
    """Sockets in TIME_WAIT on this machine (state 06 in /proc/net/tcp)."""
    return sum(1 for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
               if line.split()[3] == "06")


def cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(p) or 0.0 for p in pids)


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        c = ProcessCluster(Path(tmp) / "c", 3, listen="127.0.0.1:0", gc=False)
        await c.start()
        try:
            async with c.client() as kv:
                for lo in range(0, 1000, 100):
                    await kv.put_many([(f"k{i}".encode(), b"v" * 4096) for i in range(lo, lo + 100)])
                call = kv.writer._link.call_meta
                for _ in range(5):
                    await call(rpc.MakeRoom())
                assert c.meta is not None and c.meta.proc is not None
                meta = [c.meta.proc.pid]
                servers = [cs.proc.pid for cs in c.chunkservers if cs.proc is not None]
                m0, s0, tw0 = cpu(meta), cpu(servers), time_wait()
                lat = []
                for _ in range(n):
                    t = time.perf_counter()
                    await call(rpc.MakeRoom())
                    lat.append(time.perf_counter() - t)
                m1, s1, tw1 = cpu(meta), cpu(servers), time_wait()
        finally:
            await c.stop()
    lat.sort()
    print(json.dumps({"calls": n, "median_ms": round(statistics.median(lat) * 1e3, 2),
                      "p90_ms": round(lat[int(0.9 * (n - 1))] * 1e3, 2), "max_ms": round(lat[-1] * 1e3, 2),
                      "meta_cpu_ms_per_call": round((m1 - m0) / n * 1e3, 2),
                      "chunkservers_cpu_ms_per_call": round((s1 - s0) / n * 1e3, 2),
                      "time_wait_added": tw1 - tw0}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
