"""How long meta's admin and stats RPCs keep its event loop from everything else, against
the number of keys.

``python -m kvfs.bench.meta_stall --keys 1000000`` fills a SQLite meta (its RPC handlers
in this process, as ``kvfs.bench.metastore --store sqlite`` does; ``--per-chunk`` keys a
chunk; ``--expired`` of them, a tenth by default, past their TTL and not swept yet),
tells it one chunkserver holds the keys' chunks in less space than they take (so
GC_EVICT has victims to pick), and runs each RPC below while a task ticks the loop. For
each: the call's wall time, the longest the ticker waited for the loop (the longest step
the RPC took while other clients waited), and how many times the ticker ran during the
call (0: one step).

- ``STATS`` (a data RPC: ``kvfs stat``, a mount's ``df``), ``GC_STATUS`` (``kvfs gc status``);
- ``GC_CHUNK_REFS`` of one chunk (compaction's question), and ``GC_LAYOUTS`` of 1,000 keys
  (a page of the scrub's and fsck's walk);
- ``GC_EXPIRE`` and ``GC_EVICT`` dry runs (``kvfs gc expire`` / ``evict`` without
  ``--apply``), and ``GC_PLAN`` as after both (``kvfs gc run`` without ``--apply``);
- then, the chunkserver made dead: ``GC_STATUS`` (its repair summary plans over every
  key of that server) and ``GC_REPAIR_PLAN`` (a GC pass's repair step).

Each figure is the worst of ``--tries`` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from kvfs import rpc
from kvfs.bench.metastore import NOW, PER_CHUNK, LocalMeta, fill, layout
from kvfs.meta.index import MetaIndex
from kvfs.server import reply_of


async def stalled(call: Callable[[], Awaitable[Any]]) -> tuple[float, float, int]:
    """(wall ms, longest loop step ms, ticks) of one ``call()``: a task that gives the loop
    back at once counts the times it ran while the call was in flight (0: the call held
    the loop from start to end) and the longest it waited."""
    done = False
    longest, ticks = 0.0, 0
    last = time.perf_counter()

    async def tick() -> None:
        nonlocal longest, ticks, last
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest, last, ticks = max(longest, now - last), now, ticks + 1

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # (the ticker's first step)
    longest, ticks = 0.0, 0
    t0 = last = time.perf_counter()
    await call()
    end = time.perf_counter()
    done, seen, longest = True, ticks, max(longest, end - last)
    await ticker
    return (end - t0) * 1e3, longest * 1e3, seen


@contextlib.asynccontextmanager
async def long_steps(count: Callable[[], int], over_s: float = 0.004
                     ) -> AsyncIterator[list[tuple[float, int]]]:
    """While the body runs, a task that gives the loop back at once records each loop step
    it waited over ``over_s`` for: (seconds, ``count()`` then), in the list yielded (the
    harnesses of meta's longest steps against its key count, bench/results)."""
    steps: list[tuple[float, int]] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            if now - last > over_s:
                steps.append((now - last, count()))
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # (the ticker's first step)
    try:
        yield steps
    finally:
        done = True
        await ticker


async def run(keys: int, tries: int, per_chunk: int = PER_CHUNK, expired: int | None = None) -> dict[str, Any]:
    """``expired`` (default a tenth) of the keys past their TTL, not swept yet."""
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta")
        await m.open()
        try:
            filled, _ = await fill(m, keys, 1000, "k", per_chunk=per_chunk)
            ix = m.meta.index
            assert isinstance(ix, MetaIndex)
            gone = [(k, ix.entries[k].stamped(NOW - 3600, NOW - 1))
                    for k in itertools.islice(ix.entries, keys // 10 if expired is None else expired)]
            for i in range(0, len(gone), 1000):  # put again an hour ago, with a TTL that ended
                await ix.commit(gone[i:i + 1000], NOW - 3600, NOW - 1)
            # as ``kvfs meta`` does once it has loaded its keys (kvfs.commands); mypy takes
            # ``gc`` for this repository's gc/ folder, kvfs.gc: the stdlib's here
            gc.collect()  # type: ignore[attr-defined]
            gc.freeze()  # type: ignore[attr-defined]
            svc, mgc = m.meta, m.meta.gc
            chunks = sorted({r.chunk_id for i in range(0, filled, per_chunk)
                             for e in layout(i, per_chunk).extents for r in e.replicas})
            held = filled * 200  # the chunks' bytes: more than the capacity's high watermark
            await svc.rpc_heartbeat(rpc.Heartbeat(server_id=1, addr="127.0.0.1:1", capacity=held,
                                                  free=0, used=held,
                                                  chunks={c: held // len(chunks) for c in chunks}),
                                    memoryview(b""))
            none = memoryview(b"")
            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "STATS": lambda: reply_of(svc.rpc_stats(rpc.Stats(), none)),
                "GC_STATUS": lambda: reply_of(mgc.rpc_gc_status(rpc.GcStatus(), none)),
                "GC_CHUNK_REFS chunk": lambda: reply_of(mgc.rpc_gc_chunk_refs(rpc.GcChunkRefs(chunks=chunks[:1]), none)),
                "GC_LAYOUTS page": lambda: reply_of(mgc.rpc_gc_layouts(rpc.GcLayouts(limit=1000), none)),
                "GC_EXPIRE dry run": lambda: reply_of(mgc.rpc_gc_expire(rpc.GcExpire(apply=False), none)),
                "GC_EVICT dry run": lambda: reply_of(mgc.rpc_gc_evict(rpc.GcEvict(high=0.5, low=0.4), none)),
                "GC_PLAN dry run": lambda: reply_of(mgc.rpc_gc_plan(rpc.GcPlan(
                    after_expire=True, after_evict=rpc.Watermarks(high=0.5, low=0.4)), none)),
                # then its one chunkserver dead (every key under-replicated): the repair summary
                # in GC_STATUS, and a repair plan
                "GC_STATUS, server dead": lambda: reply_of(mgc.rpc_gc_status(rpc.GcStatus(), none)),
                "GC_REPAIR_PLAN": lambda: reply_of(mgc.rpc_gc_repair_plan(rpc.GcRepairPlan(), none)),
            }

            def server_dead() -> None:  # (fault injection: silent since long before meta started)
                svc.index.started = svc.index.servers[1].last_heartbeat = -1e18

            out: dict[str, Any] = {}
            for name, call in calls.items():
                if name == "GC_STATUS, server dead":
                    server_dead()
                runs = [await stalled(call) for _ in range(tries)]
                out[name] = {"wall_ms": max(r[0] for r in runs), "longest_step_ms": max(r[1] for r in runs),
                             "ticks": min(r[2] for r in runs)}
        finally:
            gc.unfreeze()  # type: ignore[attr-defined]
            await m.close()
    return {"keys": filled, "expired": len(gone), "rpcs": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.meta_stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--expired", type=int, default=None,
                    help="keys of them past their TTL, not swept yet (default: a tenth)")
    ap.add_argument("--per-chunk", type=int, default=PER_CHUNK,
                    help="keys a chunk (GC_CHUNK_REFS of one chunk answers that many; 16384: a 64 MiB "
                         "chunk of 4 KiB values)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = asyncio.run(run(a.keys, a.tries, a.per_chunk, a.expired))
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{res['keys']} keys ({res['expired']} expired), {a.per_chunk} a chunk, SQLite meta in process; "
          f"worst of {a.tries} calls each")
    print(f"{'rpc':<22} {'wall ms':>9} {'longest step ms':>16} {'ticks':>7}")
    for name, r in res["rpcs"].items():
        print(f"{name:<22} {r['wall_ms']:>9.1f} {r['longest_step_ms']:>16.1f} {r['ticks']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
