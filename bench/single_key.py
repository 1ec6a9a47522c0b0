"""Cost of one-key calls, and of many concurrent small calls: ``python -m kvfs.bench.single_key``.

Starts meta and 3 chunkservers as child processes (as ``kvfs up``), then times, one
call after another (``--calls`` each), with a 4 KiB value (``--bs``):

- async ``put`` of one key, ``get`` of one key (layout cached), ``get_into`` of one key;
- the same through the blocking ``kvfs.Client`` from one thread;
- ``--tasks`` concurrent one-key ``get_into`` and ``put_many`` calls (asyncio tasks),
  whose RPC counts show the coalescing.

Per call: wall-clock microseconds and the client process's CPU microseconds
(``time.process_time``), median of ``--rounds`` rounds.  Runs against whatever
``kvfs`` the interpreter imports, so two trees are compared by running it with each
tree's Python in one sitting.
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

import kvfs
from kvfs.client import AsyncClient
from kvfs.launcher import ProcessCluster


def _round(fn: Callable[[int], Any], n: int) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn(n)
    return (time.perf_counter() - w) / n * 1e6, (time.process_time() - c) / n * 1e6


async def _around(fn: Callable[[int], Awaitable[Any]], n: int) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    await fn(n)
    return (time.perf_counter() - w) / n * 1e6, (time.process_time() - c) / n * 1e6


def _median(rounds: list[tuple[float, float]]) -> dict[str, float]:
    return {"wall_us": round(statistics.median(r[0] for r in rounds), 1),
            "cpu_us": round(statistics.median(r[1] for r in rounds), 1)}


async def _async_part(kv: AsyncClient, ns: argparse.Namespace, value: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    buf = bytearray(len(value))

    async def put(n: int) -> None:
        for i in range(n):
            await kv.put(b"a%d" % i, value)

    async def get(n: int) -> None:
        for i in range(n):
            await kv.get(b"a%d" % i)

    async def get_into(n: int) -> None:
        for i in range(n):
            await kv.get_into([b"a%d" % i], [buf])

    for name, fn in (("async put", put), ("async get", get), ("async get_into", get_into)):
        out[name] = _median([await _around(fn, ns.calls) for _ in range(ns.rounds)])

    bufs = [bytearray(len(value)) for _ in range(ns.tasks)]

    async def many_get_into(n: int) -> None:
        for r in range(n // ns.tasks):
            await asyncio.gather(*(kv.get_into([b"a%d" % ((r + t) % ns.calls)], [bufs[t]])
                                   for t in range(ns.tasks)))

    async def many_put(n: int) -> None:
        for r in range(n // ns.tasks):
            await asyncio.gather(*(kv.put_many([(b"c%d-%d" % (r, t), value)])
                                   for t in range(ns.tasks)))

    for name, fn, op in ((f"{ns.tasks} tasks get_into", many_get_into, "READV"),
                         (f"{ns.tasks} tasks put_many", many_put, "COMMIT")):
        before = dict(kv.rpc_counts)
        row: dict[str, Any] = _median([await _around(fn, ns.calls) for _ in range(ns.rounds)])
        calls = ns.calls // ns.tasks * ns.tasks * ns.rounds
        rpcs = {k: v - before.get(k, 0) for k, v in kv.rpc_counts.items() if v - before.get(k, 0)}
        row.update(calls=calls, rpcs=rpcs, rpcs_per_call=round(rpcs.get(op, 0) / calls, 3))
        out[name] = row
    return out


def _sync_part(addr: str, token: str, ns: argparse.Namespace, value: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    buf = bytearray(len(value))
    with kvfs.Client(addr, token=token) as kv:
        def put(n: int) -> None:
            for i in range(n):
                kv.put(b"s%d" % i, value)

        def get(n: int) -> None:
            for i in range(n):
                kv.get(b"s%d" % i)

        def get_into(n: int) -> None:
            for i in range(n):
                kv.get_into([b"s%d" % i], [buf])

        for name, fn in (("sync put", put), ("sync get", get), ("sync get_into", get_into)):
            out[name] = _median([_round(fn, ns.calls) for _ in range(ns.rounds)])
    return out


async def _main(ns: argparse.Namespace) -> dict[str, Any]:
    value = os.urandom(ns.bs)
    with tempfile.TemporaryDirectory() as d:
        pc = ProcessCluster(Path(d), 3, listen="127.0.0.1:0")
        addr = await pc.start()
        try:
            async with AsyncClient(addr, token=pc.token) as kv:
                out = await _async_part(kv, ns, value)
            # the blocking client runs its own IO thread: this loop only waits
            out.update(await asyncio.get_running_loop().run_in_executor(
                None, _sync_part, addr, pc.token, ns, value))
        finally:
            await pc.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfs.bench.single_key", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=500, help="calls per round (default 500)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported (default 5)")
    p.add_argument("--tasks", type=int, default=32, help="concurrent tasks in the batched rows (default 32)")
    p.add_argument("--bs", type=int, default=4096, help="value bytes (default 4096)")
    p.add_argument("--json-out", help="also write the results as JSON here")
    ns = p.parse_args(argv)
    from kvfs._loop import run
    out = run(_main(ns))
    out["load"] = os.getloadavg()[0]
    out["kvfs"] = str(Path(kvfs.__file__).parent)
    for name, row in out.items():
        print(f"{name:24s} {row}")
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
