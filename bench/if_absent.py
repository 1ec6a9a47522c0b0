"""What ``put_many(..., if_absent=True)`` costs and saves: ``python -m kvfs.bench.if_absent``.

Starts meta and 3 chunkservers as child processes (as ``kvfs up``), then, per round,
alternating the two modes:

- a batch of ``--pages`` new pages of ``--bs`` bytes, put plain and put ``if_absent``
  (every key absent: the price of the extra EXISTS);
- the same batch put again, plain and ``if_absent`` (every key present: issue 12's
  re-put, which plain writes again as garbage).

Per case: the median wall-clock milliseconds per call over ``--rounds`` rounds, and the
bytes the chunkservers' chunk files grew by per call (their own byte counts, from
``CHUNK_STATS``; records include their header and key).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from kvfs import rpc
from kvfs.client import AsyncClient
from kvfs.gc.driver import GarbageCollector
from kvfs.launcher import ProcessCluster
from kvfs.units import parse_size

CASES = ("new, plain", "new, if_absent", "present, plain", "present, if_absent")


async def written(gc: GarbageCollector, kv: AsyncClient) -> int:
    """Bytes in every chunkserver's chunk files (their own count)."""
    total = 0
    for s in await kv.servers(refresh=True):
        h = await gc.chunkserver(s.server_id, rpc.ChunkStats())
        total += sum(h.chunks.values())
    return total


async def run(pages: int, bs: int, rounds: int) -> dict[str, tuple[float, float]]:
    times: dict[str, list[float]] = {c: [] for c in CASES}
    grew: dict[str, list[int]] = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        c = ProcessCluster(Path(tmp), 3, listen="127.0.0.1:0")
        await c.start()
        try:
            async with (AsyncClient(c.addr, token=c.token) as kv,
                        GarbageCollector(c.addr, token=c.admin_token) as gc):
                values = [os.urandom(bs) for _ in range(pages)]
                await kv.put_many([(f"warm/{i}", v) for i, v in enumerate(values)])
                for r in range(rounds):
                    # alternate which mode goes first
                    for if_absent in ((False, True) if r % 2 == 0 else (True, False)):
                        items = [(f"r{r}/{int(if_absent)}/{i}", v) for i, v in enumerate(values)]
                        for present in (False, True):
                            case = CASES[2 * present + if_absent]
                            before = await written(gc, kv)
                            t = time.perf_counter()
                            await kv.put_many(items, if_absent=if_absent)
                            times[case].append(time.perf_counter() - t)
                            grew[case].append(await written(gc, kv) - before)
        finally:
            await c.stop()
    return {c: (statistics.median(times[c]) * 1e3, statistics.median(grew[c])) for c in CASES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--bs", type=parse_size, default=128 * 1024)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    load = os.getloadavg()
    res = asyncio.run(run(a.pages, a.bs, a.rounds))
    print(f"{a.pages} pages of {a.bs} bytes per call, median of {a.rounds} rounds; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| case | ms per call | bytes appended per call |\n|---|---|---|")
    for case, (ms, nb) in res.items():
        print(f"| {case} | {ms:.1f} | {nb:,.0f} |")


if __name__ == "__main__":
    main()
