"""Meta's full cycle-collector pass against the keys committed since start-up: a meta's
handlers in this process (its store STORE: rocksdb, the default, or sqlite), gc.freeze()
at start as ``kvfs meta`` does, N random 64-byte keys committed 4,096 a COMMIT (chunks of
16,384 keys), then two timed gc.collect() (the pause a full collection puts in meta's loop),
the tracked objects left, meta's VmRSS, and the fill's rate (bench/RESULTS.md).  With
TOMBS, that many of the keys are then deleted with a tombstone each (kept: no chunk table
came), 4,096 a DELETE, before the collections.
Usage: python bench/results/gc-walk-2026-12-05.py N [STORE [TOMBS]]"""
import asyncio
import gc
import hashlib
import sys
import tempfile
import time
from pathlib import Path

from kvfs import rpc
from kvfs.bench.metastore import NOW, LocalMeta
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.meta.index import MetaIndex
from kvfs.meta.tombstones import tomb_layout

PER = 16384


def k(i: int) -> bytes:
    return hashlib.sha256(b"k%d" % i).hexdigest().encode()


def lay(i: int) -> Layout:
    return Layout(100, 0xABCDEF, NOW, None,
                  (Extent(100, 0x1234567, (Replica(1, make_chunk_id(1, i // PER), (i % PER) * 160),)),))


def rss_mib() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


async def main(n: int, store: str, tombs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta", store)
        await m.open()
        # (mypy takes ``gc`` for this repository's gc/ folder, kvfs.gc: the stdlib's here)
        gc.collect()  # type: ignore[attr-defined]
        gc.freeze()  # type: ignore[attr-defined]  # (kvfs meta's started=gc.freeze)
        await m.meta.rpc_register(rpc.Register(server_id=1, addr="127.0.0.1:1"), memoryview(b""))
        t0 = time.perf_counter()
        for lo in range(0, n, 4096):
            await m.commit([(k(i), lay(i)) for i in range(lo, min(n, lo + 4096))], NOW)
        fill = time.perf_counter() - t0
        ix = m.meta.index
        assert isinstance(ix, MetaIndex)  # (a local store)
        for lo in range(0, tombs, 4096):
            hi = min(tombs, lo + 4096)
            await ix.delete([k(i) for i in range(lo, hi)],
                            [tomb_layout([Replica(1, make_chunk_id(1, 10_000 + i // PER), (i % PER) * 64)], NOW)
                             for i in range(lo, hi)])
        pauses = []
        for _ in range(2):
            t = time.perf_counter()
            gc.collect()  # type: ignore[attr-defined]
            pauses.append((time.perf_counter() - t) * 1000)
        print(f"{store} {n} keys, {len(ix.tombstones)} tombstones: filled at {n / fill / 1000:.1f}k keys/s; full collections "
              f"{pauses[0]:.2f} / {pauses[1]:.2f} ms; tracked objects {len(gc.get_objects())}; "  # type: ignore[attr-defined]
              f"VmRSS {rss_mib():.0f} MiB", flush=True)
        await m.close()


asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "rocksdb",
                 int(sys.argv[3]) if len(sys.argv) > 3 else 0))
