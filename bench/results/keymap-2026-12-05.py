"""Meta's longest loop steps while its index grows: N random 64-byte keys committed through
meta's COMMIT handler (RocksDB, meta's default; the blobs packed before the timed fill) in
COMMITs of 1,024 keys (one group each, meta's --commit-group-max-keys), 4 in flight, 16,384 keys a chunk, while a
task ticks the loop; then LOOKUPs of 128 keys over them.  Prints the fill's rate, its five
longest loop steps with the key count at each, and the lookups' rate (bench/RESULTS.md,
"meta's keys split over 256 dicts").  Usage: python bench/results/keymap-2026-12-05.py N"""
import asyncio
import gc
import hashlib
import sys
import tempfile
import time
from pathlib import Path

from kvfs.bench.meta_stall import long_steps
from kvfs.bench.metastore import NOW, LocalMeta
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.meta.index import MetaIndex
from kvfs.packed import pack

PER, FLIGHT, CHUNK = 1024, 4, 16_384  # (a chunk: 64 MiB of 4 KiB values)


def k(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).hexdigest().encode()


def lay(i: int) -> Layout:
    return Layout(100, 0xABCDEF, NOW, None,
                  (Extent(100, 0x1234567, (Replica(1, make_chunk_id(1, i // CHUNK), (i % CHUNK) * 160),)),))


async def main(n: int) -> None:
    keys = [k(i) for i in range(n)]
    blobs = [pack(keys[lo:lo + PER], [lay(i) for i in range(lo, min(n, lo + PER))]) for lo in range(0, n, PER)]
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta", "rocksdb")
        await m.open()
        gc.freeze()  # type: ignore[attr-defined]  # (as `kvfs meta` does once started: the cycle collector skips what is there)
        ix = m.meta.index
        assert isinstance(ix, MetaIndex)
        todo = iter(blobs)

        async def writer() -> None:
            for blob in todo:
                await m.meta.rpc_commit(m.rpc.Commit(packed=blob), memoryview(b""))

        async with long_steps(lambda: len(ix.entries)) as steps:
            t0 = time.perf_counter()
            await asyncio.gather(*(writer() for _ in range(FLIGHT)))
            fill = time.perf_counter() - t0
        top = sorted(steps, reverse=True)[:5]
        print(f"fill {n} keys: {fill:.1f} s, {n / fill / 1e3:.1f}k keys/s; longest steps: "
              + ", ".join(f"{s * 1e3:.1f} ms @{c}" for s, c in top), flush=True)
        t0, looked = time.perf_counter(), 0
        for lo in range(0, min(n, 400_000), 128):
            await m.lookup(keys[lo:lo + 128], NOW)
            looked += len(keys[lo:lo + 128])
        el = time.perf_counter() - t0
        print(f"lookup x128: {looked / el / 1e3:.1f}k keys/s ({el / looked * 1e6:.2f} us a key)", flush=True)
        await m.close()


asyncio.run(main(int(sys.argv[1])))
