"""A/B of meta's CPU per RPC (bench/RESULTS.md, 2026-12-03): two `kvfs up --chunkservers 1
--no-gc`, one per checkout A and B (each with its own .venv); alternating rounds of N
exists_many / match_prefix RPCs of K keys from 4 coroutines (async) or 4 threads (blocking),
meta's CPU from /proc/PID/stat per RPC.

    A=CHECKOUT B=CHECKOUT ROUNDS=8 N=20000 K=1 python bench/results/metanow-drv.py
"""

import asyncio
import os
import re
import statistics as st
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import kvfs
from kvfs.bench.cpu import cpu_seconds

TREES = {"A": os.environ.get("A", "/work/main"), "B": os.environ.get("B", "/work/wt/metanow")}
ROUNDS = int(os.environ.get("ROUNDS", "8"))
N = int(os.environ.get("N", "4000"))
K = int(os.environ.get("K", "1"))


def cpu(pid: int) -> float:
    s = cpu_seconds(pid)
    assert s is not None, f"no CPU reading for meta (pid {pid})"
    return s


def up(tree: str, root: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    log = root / f"{tree}.log"
    with log.open("wb") as out:
        p = subprocess.Popen([f"{TREES[tree]}/.venv/bin/python", "-m", "kvfs", "up", "--data",
                              str(root / tree), "--listen", "127.0.0.1:0", "--no-gc",
                              "--chunkservers", "1"], stdout=out, stderr=subprocess.STDOUT)
    found: list[str] = []
    for _ in range(600):
        found = re.findall(r"^kvfs://\S+", log.read_text(errors="replace"), re.M)
        if found:
            break
        time.sleep(0.1)
    pattern = f"{TREES[tree]}/.venv/bin/python3? -m kvfs meta --data {root / tree}"
    meta = int(subprocess.check_output(["pgrep", "-f", pattern]).split()[0])
    return p, found[0], meta


async def arun(addr: str, api: str, keys: list[str]) -> None:
    async with kvfs.connect(addr) as kv:
        await kv.exists_many(keys)

        async def worker(n: int) -> None:
            for _ in range(n):
                if api == "exists":
                    await kv.exists_many(keys)
                else:
                    await kv.match_prefix(keys)

        await asyncio.gather(*(worker(N // 4) for _ in range(4)))


def srun(addr: str, api: str, keys: list[str]) -> None:
    with kvfs.Client(addr) as kv:
        kv.exists_many(keys)

        def worker() -> None:
            for _ in range(N // 4):
                if api == "exists":
                    kv.exists_many(keys)
                else:
                    kv.match_prefix(keys)

        ts = [threading.Thread(target=worker) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="metanow-"))
    procs = {}
    try:
        for t in TREES:
            procs[t] = up(t, root)
        keys = [f"k{i:06d}" for i in range(K)]
        res: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
        for r in range(ROUNDS):
            for t in (("A", "B") if r % 2 == 0 else ("B", "A")):
                _, addr, meta = procs[t]
                for cl in ("async", "sync"):
                    for api in ("exists", "match"):
                        c0, t0 = cpu(meta), time.perf_counter()
                        if cl == "async":
                            asyncio.run(arun(addr, api, keys))
                        else:
                            srun(addr, api, keys)
                        dt, c1 = time.perf_counter() - t0, cpu(meta)
                        res.setdefault((cl, api, t), []).append(((c1 - c0) / N * 1e6, N / dt))
            print(f"round {r} done {time.strftime('%H:%M:%S')} {os.getloadavg()[0]:.1f}", flush=True)
        print(f"K={K} N={N} rounds={ROUNDS}: meta us/RPC (median, all rounds) | RPC/s median")
        for cl in ("async", "sync"):
            for api in ("exists", "match"):
                a, b = res[(cl, api, "A")], res[(cl, api, "B")]
                ratios = [y[0] / x[0] for x, y in zip(a, b, strict=True)]
                print(f"{cl:5} {api:6} A {st.median(x[0] for x in a):6.1f} B {st.median(x[0] for x in b):6.1f}"
                      f"  B/A {st.median(ratios):.2f} (B<A {sum(q < 1 for q in ratios)}/{len(ratios)})"
                      f" | RPC/s A {st.median(x[1] for x in a):7.0f} B {st.median(x[1] for x in b):7.0f}"
                      f"   A {[round(x[0], 1) for x in a]} B {[round(x[0], 1) for x in b]}")
    finally:
        for p, _, _ in procs.values():
            p.terminate()
            p.wait(30)


if __name__ == "__main__":
    main()
