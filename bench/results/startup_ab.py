"""Start-up of `kvfs` commands, two trees A/B: `python bench/results/startup_ab.py BASE NEW ROUNDS`.

Each round runs every measure on BASE and on NEW (the order alternating per round), each tree
with its own venv (TREE/.venv), run in TREE (``-m kvfs`` imports the working folder's kvfs/); bytecode written (a warm-up run first, PYTHONDONTWRITEBYTECODE
unset). Prints, per measure and tree, the medians of wall time and of the CPU time (user + sys)
of the processes it started (robust to other load); `up` is `kvfs up --chunkservers 2` from
spawn to a client's STATS answered (a fresh interpreter of the tree's, polled with a deadline).
"""

from __future__ import annotations

import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
HELPS = {"--help": ["--help"], "chunkserver --help": ["chunkserver", "--help"],
         "meta --help": ["meta", "--help"], "gc --help": ["gc", "--help"],
         "mount --help": ["mount", "--help"], "bench --help": ["bench", "--help"]}
STATS = ("import asyncio\nfrom kvfs.client import AsyncClient\nasync def m():\n"
         " async with AsyncClient({addr!r}) as kv:\n  await kv.stats()\nasyncio.run(m())")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _timed(f: Callable[[], None]) -> tuple[float, float]:
    c, t = _cpu(), time.perf_counter()
    f()
    return time.perf_counter() - t, _cpu() - c


def _kvfs(tree: str, *args: str) -> list[str]:
    return [f"{tree}/.venv/bin/python", "-m", "kvfs", *args]


def _up(tree: str) -> None:
    data = tempfile.mkdtemp(prefix="startup-ab-")
    p = subprocess.Popen(_kvfs(tree, "up", "--data", data, "--chunkservers", "2", "--listen", "127.0.0.1:0"),
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV, cwd=tree)
    try:
        assert p.stdout is not None
        addr = p.stdout.readline().strip()
        deadline = time.monotonic() + 30
        while subprocess.run([f"{tree}/.venv/bin/python", "-c", STATS.format(addr=addr)], env=ENV,
                             cwd=tree, stderr=subprocess.DEVNULL).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvfs up of {tree} did not answer within 30 s")
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(30)


def _help(args: list[str]) -> Callable[[str], None]:
    def run(tree: str) -> None:
        subprocess.run(_kvfs(tree, *args), stdout=subprocess.DEVNULL, env=ENV, cwd=tree, check=True)
    return run


def main() -> None:
    trees, rounds = sys.argv[1:3], int(sys.argv[3])
    measures = {k: _help(a) for k, a in HELPS.items()}
    measures["up"] = _up
    for tree in trees:
        for k in HELPS:
            measures[k](tree)
    got: dict[tuple[str, str], list[tuple[float, float]]] = {(t, k): [] for t in trees for k in measures}
    print("load", " ".join(f"{x:.2f}" for x in os.getloadavg()), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "UTC")
    for r in range(rounds):
        for k, f in measures.items():
            for tree in (trees if r % 2 == 0 else trees[::-1]):
                got[(tree, k)].append(_timed(lambda: f(tree)))  # noqa: B023 (called at once)
    print("load", " ".join(f"{x:.2f}" for x in os.getloadavg()), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "UTC")
    for k in measures:
        cells = [f"wall {statistics.median(x[0] for x in got[(t, k)]) * 1000:5.0f} ms, "
                 f"CPU {statistics.median(x[1] for x in got[(t, k)]) * 1000:5.0f} ms" for t in trees]
        print(f"{k:20s} A: {cells[0]}   B: {cells[1]}")


if __name__ == "__main__":
    main()
