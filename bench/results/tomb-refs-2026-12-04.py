"""GC_CHUNK_REFS of one chunk while meta keeps N tombstones: its wall time and longest loop step.

Usage (bench/RESULTS.md): <venv>/bin/python bench/results/tomb-refs-2026-12-04.py 400000

A SQLite meta's handlers in this process (kvfs.bench.metastore), N keys 16,384 a chunk,
every key deleted with its tombstone kept (server 1 sent no chunk table since: none
passes), the tombstones 16,384 a chunk from chunk 100,000 on.  Then GC_CHUNK_REFS, three
times each, of chunk 0 (its keys deleted, no tombstone in it) and of chunk 100,000 (16,384
tombstones), then GC_DELETED's drop of the tombstones once every one has passed, timed by
kvfs.bench.meta_stall's ticker.
"""

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfs import rpc
from kvfs.bench.meta_stall import stalled
from kvfs.bench.metastore import NOW, LocalMeta, fill, key
from kvfs.layout import Replica, make_chunk_id
from kvfs.meta.index import MetaIndex
from kvfs.meta.tombstones import tomb_layout
from kvfs.server import reply_of

PER_CHUNK = 16384


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta")
        await m.open()
        try:
            await fill(m, n, 1000, "k", per_chunk=PER_CHUNK)
            svc, ix = m.meta, m.meta.index
            assert isinstance(ix, MetaIndex)
            await svc.rpc_register(rpc.Register(server_id=1, addr="127.0.0.1:1"), memoryview(b""))
            t0 = time.perf_counter()
            for lo in range(0, n, 2000):
                keys = [key(i, "k") for i in range(lo, min(n, lo + 2000))]
                tombs = [tomb_layout([Replica(1, make_chunk_id(1, 100000 + i // PER_CHUNK), i % PER_CHUNK * 64)], NOW)
                         for i in range(lo, lo + len(keys))]
                await ix.delete(keys, tombs)
            print(f"tombstones kept: {len(ix.tombstones)} (deleted in {time.perf_counter() - t0:.1f} s)")
            for c in (make_chunk_id(1, 0), make_chunk_id(1, 100000)):
                req = rpc.GcChunkRefs(chunks=[c])

                async def call(req: rpc.GcChunkRefs = req) -> Any:
                    return await reply_of(svc.gc.rpc_gc_chunk_refs(req, memoryview(b"")))

                for _ in range(3):
                    wall, longest, ticks = await stalled(call)
                    print(f"GC_CHUNK_REFS chunk {c:#x}: wall {wall:.1f} ms, longest step {longest:.1f} ms, "
                          f"ticks {ticks}")
            # then server 1 sends a chunk table holding none of those chunks: every tombstone
            # has passed, and GC_DELETED's drop (drop_passed) forgets them all
            await svc.rpc_heartbeat(rpc.Heartbeat(server_id=1, addr="127.0.0.1:1", capacity=1 << 40,
                                                  free=1 << 40, used=0, chunks={}), memoryview(b""))
            dropped = 0

            async def drop() -> None:
                nonlocal dropped
                dropped = await ix.drop_passed()

            wall, longest, ticks = await stalled(drop)
            print(f"drop_passed: {dropped} dropped, wall {wall:.1f} ms, longest step {longest:.1f} ms, ticks {ticks}")
        finally:
            await m.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
