"""What GC_DELETED's drop of passed tombstones costs meta when nothing can have passed:
meta's handlers in the process (RocksDB), N keys committed and deleted, each keeping its
tombstone (their older chunk still on the server, so none passes), a chunk table heard,
then 20 drops in a row with the servers' chunk tables unchanged, as a pass's batches ask
after each delete, then 20 more each after the same chunk table heard again (a heartbeat)
(bench/RESULTS.md).  Prints the first drop's time and the others' medians.
Usage: python bench/results/drop-passed-2026-12-05.py N"""
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvfs import rpc
from kvfs.bench.metastore import NOW, LocalMeta, fill, key
from kvfs.layout import Replica
from kvfs.meta.index import MetaIndex
from kvfs.meta.tombstones import tomb_layout


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta")
        await m.open()
        ix = m.meta.index
        assert isinstance(ix, MetaIndex)
        await fill(m, n, 4096, "k", per_chunk=16384)
        for lo in range(0, n, 4096):
            ks = [key(i, "k") for i in range(lo, min(n, lo + 4096))]
            await ix.delete(ks, [tomb_layout([Replica(1, (1 << 40) | 1000, 64 * i)], NOW) for i in range(len(ks))])
        chunks = {(1 << 40) | c: 1 << 20 for c in range(n // 16384 + 1)}
        chunks[(1 << 40) | 1000] = 64 * n
        hb = rpc.Heartbeat(server_id=1, addr="127.0.0.1:1", capacity=1 << 40, free=1 << 39,
                           used=1 << 30, chunks=chunks)
        await m.meta.rpc_heartbeat(hb, memoryview(b""))
        took, again = [], []
        for _ in range(21):
            t = time.perf_counter()
            dropped = await ix.drop_passed()
            took.append(time.perf_counter() - t)
            assert dropped == 0
        for _ in range(20):  # the same chunk table heard again before each
            await m.meta.rpc_heartbeat(hb, memoryview(b""))
            t = time.perf_counter()
            dropped = await ix.drop_passed()
            again.append(time.perf_counter() - t)
            assert dropped == 0
        print(f"{len(ix.tombstones)} tombstones kept: first drop {took[0] * 1e3:.1f} ms, "
              f"the next 20 median {statistics.median(took[1:]) * 1e3:.3f} ms, "
              f"20 after a chunk table heard again median {statistics.median(again) * 1e3:.3f} ms", flush=True)
        await m.close()


asyncio.run(main(int(sys.argv[1])))
