"""What the GC daemon's background scrub costs meta per pass, against the number of keys.

``python -m kvfs.bench.scrub_walk --keys 1000000`` fills a SQLite meta (its RPC handlers
in this process, as ``kvfs.bench.metastore --store sqlite`` does) and times, on it:

- ``GC_CHUNK_REFS`` of one chunk no key references: what the scrub asked per server per
  pass before 2026-12-04 (the in-memory index answers it with a walk of every key, in one
  event-loop step, so meta serves nothing else meanwhile);
- ``GC_LAYOUTS`` of one page of ``--page`` keys: what it asks now (a page of the keys in
  key order, from SQLite's primary key), one page per ``--page`` keys it checks.

Each figure is the best of ``--tries`` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvfs import rpc
from kvfs.bench.metastore import LocalMeta, fill
from kvfs.server import reply_of

UNREFERENCED_CHUNK = 12345  # metastore's layouts name chunks (1 << 40) | n


async def best_ms(call: Callable[[], Awaitable[Any]], tries: int) -> float:
    out = []
    for _ in range(tries):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return min(out) * 1e3


async def run(keys: int, page: int, tries: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta")
        await m.open()
        try:
            filled, _ = await fill(m, keys, 1000, "k")
            gc = m.meta.gc
            refs_ms = await best_ms(lambda: reply_of(gc.rpc_gc_chunk_refs(
                rpc.GcChunkRefs(chunks=[UNREFERENCED_CHUNK]), memoryview(b""))), tries)
            page_ms = await best_ms(lambda: reply_of(gc.rpc_gc_layouts(
                rpc.GcLayouts(start_after=None, limit=page), memoryview(b""))), tries)
        finally:
            await m.close()
    return {"keys": filled, "page": page, "gc_chunk_refs_ms": refs_ms, "gc_layouts_page_ms": page_ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.scrub_walk", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--page", type=int, default=1000)
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = asyncio.run(run(a.keys, a.page, a.tries))
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{res['keys']} keys: GC_CHUNK_REFS of one chunk {res['gc_chunk_refs_ms']:.1f} ms "
              f"(the scan the scrub made per server per pass before); GC_LAYOUTS of {res['page']} "
              f"keys {res['gc_layouts_page_ms']:.1f} ms (now, per page)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
