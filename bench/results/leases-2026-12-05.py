"""Meta's longest loop steps while an engine's lookups lease every key: N random 64-byte keys
committed through meta's COMMIT handler (RocksDB, meta's default; 1,024 a COMMIT), then
EXISTS of 128 keys each with a 60 s lease (as SGLang's ``batch_exists`` through the kvfs
plug-in asks), 4 in flight, over every key, while a task ticks the loop; then the index's
periodic flush, which forgets the leases that ended.  Prints the leasing lookups' rate, their
five longest loop steps with the leased-key count at each, and the flush's longest step
(bench/RESULTS.md).  Usage: python bench/results/leases-2026-12-05.py N"""
import asyncio
import gc
import hashlib
import sys
import tempfile
import time
from pathlib import Path

from kvfs import rpc
from kvfs.bench.meta_stall import long_steps
from kvfs.bench.metastore import NOW, LocalMeta, layout
from kvfs.meta.index import MetaIndex
from kvfs.packed import pack

PER, FLIGHT, CHUNK, ASK = 1024, 4, 16_384, 128


def k(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).hexdigest().encode()


async def main(n: int) -> None:
    keys = [k(i) for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta", "rocksdb")
        await m.open()
        ix = m.meta.index
        assert isinstance(ix, MetaIndex)
        for lo in range(0, n, PER):
            blob = pack(keys[lo:lo + PER], [layout(i, CHUNK) for i in range(lo, min(n, lo + PER))])
            await m.meta.rpc_commit(rpc.Commit(packed=blob), memoryview(b""))
        gc.collect()  # type: ignore[attr-defined]  # (mypy takes it for kvfs.gc)
        gc.freeze()  # type: ignore[attr-defined]  # (as `kvfs meta` does once started)
        todo = iter(range(0, n, ASK))

        async def asker() -> None:
            for lo in todo:
                answer = m.meta.rpc_exists(rpc.Exists(keys=keys[lo:lo + ASK], lease_s=60.0, holder="engine"),
                                           memoryview(b""))
                assert isinstance(answer, tuple) and isinstance(answer[0], rpc.Existing) and all(answer[0].exists)
                await asyncio.sleep(0)  # (another request's turn, as meta's loop gives it)

        async with long_steps(lambda: len(ix.leases)) as steps:
            t0 = time.perf_counter()
            await asyncio.gather(*(asker() for _ in range(FLIGHT)))
            took = time.perf_counter() - t0
        top = sorted(steps, reverse=True)[:5]
        print(f"leasing lookups of {n} keys: {took:.1f} s, {n / took / 1e3:.1f}k keys/s; longest steps: "
              + ", ".join(f"{s * 1e3:.1f} ms @{c}" for s, c in top), flush=True)
        ix.clock = lambda: NOW + 3600  # (every lease has ended: the flush forgets them all)
        async with long_steps(lambda: len(ix.leases)) as steps:
            t0 = time.perf_counter()
            await ix.flush()
            took = time.perf_counter() - t0
        print(f"flush forgetting {n} leases: {took:.2f} s; longest step "
              f"{max((s for s, _ in steps), default=0) * 1e3:.1f} ms; leases left {len(ix.leases)}", flush=True)
        await m.close()


asyncio.run(main(int(sys.argv[1])))
