"""Meta's longest loop step on one large write RPC (16,384 keys): GC_REPAIR's switches, DELETE
with tombstones, COMMIT, while N random 64-byte keys are stored: a meta's handlers in this
process (its store STORE: sqlite, the default, or rocksdb), timed by kvfs.bench.meta_stall's
ticker, 3 rounds (bench/RESULTS.md).
Usage: python bench/results/write-stall-2026-12-04.py 300000 [STORE]"""
import asyncio
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfs import rpc
from kvfs.bench.meta_stall import stalled
from kvfs.bench.metastore import NOW, LocalMeta
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.server import reply_of

PER = 16384


def k(i: int, tag: str = "k") -> bytes:
    return hashlib.sha256(f"{tag}{i}".encode()).hexdigest().encode()


def lay(i: int, sid: int = 1, chunk: int | None = None) -> Layout:
    c = make_chunk_id(sid, i // PER if chunk is None else chunk)
    return Layout(100, 0xABCDEF, NOW, None, (Extent(100, 0x1234567, (Replica(sid, c, (i % PER) * 160),)),))


async def main(n: int, store: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta", None if store == "sqlite" else store)
        await m.open()
        svc = m.meta
        await svc.rpc_register(rpc.Register(server_id=2, addr="127.0.0.1:2"), memoryview(b""))
        t0 = time.perf_counter()
        for lo in range(0, n, 4096):
            await m.commit([(k(i), lay(i)) for i in range(lo, min(n, lo + 4096))], NOW)
        print(f"{store}: {n} keys committed in {time.perf_counter() - t0:.1f} s", flush=True)
        for rnd in range(3):
            base = rnd * PER
            items = [rpc.ReplicaSwitch(k(i), 0, Replica(1, make_chunk_id(1, i // PER), (i % PER) * 160),
                                       Replica(2, make_chunk_id(2, rnd), (i % PER) * 160))
                     for i in range(base, base + PER)]

            async def repair(items: list[rpc.ReplicaSwitch] = items) -> Any:
                return await reply_of(svc.gc.rpc_gc_repair(rpc.GcRepair(items=items), memoryview(b"")))
            wall, longest, ticks = await stalled(repair)
            print(f"GC_REPAIR {PER}: wall {wall:.0f} ms, longest step {longest:.0f} ms, ticks {ticks}", flush=True)
            dkeys = [k(i) for i in range(n - (rnd + 1) * PER, n - rnd * PER)]
            tombs = [[Replica(1, make_chunk_id(1, 5000 + rnd), j * 64)] for j in range(PER)]

            async def delete(dkeys: list[bytes] = dkeys, tombs: list[list[Replica]] = tombs) -> Any:
                return await reply_of(svc.rpc_delete(rpc.Delete(keys=dkeys, tombstones=tombs),
                                                     memoryview(b"")))
            wall, longest, ticks = await stalled(delete)
            print(f"DELETE {PER}: wall {wall:.0f} ms, longest step {longest:.0f} ms, ticks {ticks}", flush=True)
            rows = [(k(i, f"new{rnd}"), lay(i, 1, 6000 + rnd)) for i in range(PER)]

            async def commit(rows: list[tuple[bytes, Layout]] = rows) -> Any:
                return await m.commit(rows, NOW)
            wall, longest, ticks = await stalled(commit)
            print(f"COMMIT {PER}: wall {wall:.0f} ms, longest step {longest:.0f} ms, ticks {ticks}", flush=True)
        await m.close()


asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "sqlite"))
