"""Fill a RocksDB meta store with N keys (64-byte SHA-256 hex keys, 4 KiB values of one extent of
one replica each) through meta's COMMIT handler, in batches of 8,192; the store for
meta-start-2026-12-05.sh.  Usage: python bench/results/meta-fill-2026-12-05.py N DIR (DIR new)"""
import asyncio
import hashlib
import sys
import time
from pathlib import Path

from kvfs.bench.metastore import NOW, LocalMeta
from kvfs.layout import Extent, Layout, Replica, make_chunk_id

N, DIR = int(sys.argv[1]), Path(sys.argv[2])


def key(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).hexdigest().encode()


def layout(i: int) -> Layout:
    return Layout(4096, 0xABCDEF, NOW, None,
                  (Extent(4096, 0x1234567, (Replica(1, make_chunk_id(1, i // 16384), (i % 16384) * 4200),)),))


async def fill() -> None:
    m = LocalMeta(DIR, "rocksdb")
    await m.open()
    for lo in range(0, N, 8192):
        await m.commit([(key(i), layout(i)) for i in range(lo, min(N, lo + 8192))], NOW)
    await m.meta.index.close()


if DIR.exists() and any(DIR.iterdir()):
    sys.exit(f"{DIR} is not empty")
t0 = time.perf_counter()
asyncio.run(fill())
print(f"{N} keys in {time.perf_counter() - t0:.1f} s")
