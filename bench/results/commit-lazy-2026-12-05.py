"""Meta's longest loop step on one 16,384-key COMMIT, its blob packed before the timed call
(meta's work alone: write-stall-2026-12-04.py packs in the step it times), on RocksDB (meta's
default) with N random 64-byte keys stored; 6 rounds (bench/RESULTS.md, "a large COMMIT's
layouts built a part at a time").  Usage: python bench/results/commit-lazy-2026-12-05.py 300000
[KEYS PER COMMIT: 16384] [--commit-group-max-keys: meta's default]"""
import asyncio
import hashlib
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvfs.bench.meta_stall import stalled
from kvfs.bench.metastore import NOW, LocalMeta
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.packed import pack

PER = int(sys.argv[2]) if len(sys.argv) > 2 else 16384


def k(i: int, tag: str = "k") -> bytes:
    return hashlib.sha256(f"{tag}{i}".encode()).hexdigest().encode()


def lay(i: int, chunk: int | None = None) -> Layout:
    c = make_chunk_id(1, i // PER if chunk is None else chunk)
    return Layout(100, 0xABCDEF, NOW, None, (Extent(100, 0x1234567, (Replica(1, c, (i % PER) * 160),)),))


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = LocalMeta(Path(tmp) / "meta", "rocksdb")
        if len(sys.argv) > 3:
            ix = m.meta.index
            ix.config = replace(ix.config, commit_group_max_keys=int(sys.argv[3]))
        await m.open()
        t0 = time.perf_counter()
        for lo in range(0, n, 4096):
            await m.commit([(k(i), lay(i)) for i in range(lo, min(n, lo + 4096))], NOW)
        print(f"rocksdb: {n} keys committed in {time.perf_counter() - t0:.1f} s", flush=True)
        for rnd in range(6):
            blob = pack([k(i, f"new{rnd}") for i in range(PER)], [lay(i, 6000 + rnd) for i in range(PER)])

            async def commit(blob: bytes = blob) -> Any:
                return await m.meta.rpc_commit(m.rpc.Commit(packed=blob), memoryview(b""))
            wall, longest, ticks = await stalled(commit)
            print(f"COMMIT {PER} (packed before, groups of {m.meta.index.config.commit_group_max_keys}): wall {wall:.0f} ms, longest step {longest:.1f} ms, "
                  f"ticks {ticks}", flush=True)


asyncio.run(main(int(sys.argv[1])))
