"""The storage-side faults of issue 10, injected into an in-process cluster, with what each cost:
values lost, wrong bytes, the longest a reader waited, and the time until service was restored.

Usage: python -m kvfs.bench.reliability [--keys 2000] [--dir DIR]   (figures: RELIABILITY.md)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from kvfs.config import ClientConfig
from kvfs.errors import KVFSError
from kvfs.gc import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster
from kvfs.meta.rebuild import rebuild


async def _check(cluster: LocalCluster, expect: dict[bytes, bytes]) -> tuple[int, int, float]:
    """(values lost, wrong values, longest single read) reading every key one by one."""
    lost = wrong = 0
    longest = 0.0
    async with cluster.client(ClientConfig(layout_cache_entries=0)) as kv:
        for k, v in expect.items():
            t0 = time.perf_counter()
            try:
                got = await kv.get(k)
            except KVFSError:
                got = None
            longest = max(longest, time.perf_counter() - t0)
            if got is None:
                lost += 1
            elif got != v:
                wrong += 1
    return lost, wrong, longest


def _row(name: str, lost: int, wrong: int, stall_s: float, restore_s: float, note: str = "") -> None:
    print(f"| {name} | {lost} | {wrong} | {stall_s * 1e3:.0f} ms | {restore_s:.2f} s | {note} |", flush=True)


async def flipped_bit(root: Path, n: int) -> None:
    async with LocalCluster(root, 3) as c:
        items = {f"f/{i}".encode(): os.urandom(20_000) for i in range(n)}
        async with c.client() as kv:
            await kv.put_many(list(items.items()))
            lay = await kv.layout(b"f/0")
        assert lay is not None
        rep = lay.extents[0].replicas[0]
        idx = next(i for i, s in enumerate(c.chunkservers) if s and s.server_id == rep.server_id)
        cs = c.chunkservers[idx]
        assert cs is not None
        path = cs.store.chunk_path(rep.chunk_id)
        await c.stop_chunkserver(idx)
        with open(path, "r+b") as f:
            f.seek(rep.offset + 100)
            b = f.read(1)
            f.seek(rep.offset + 100)
            f.write(bytes([b[0] ^ 1]))
        t0 = time.perf_counter()
        await c.start_chunkserver(idx)
        restore = time.perf_counter() - t0
        lost, wrong, stall = await _check(c, items)
        _row(f"a flipped bit in the first record of a chunk ({n} keys of 20 KB, replicas=1), "
             "chunkserver restarted", lost, wrong, stall, restore, "the hit record only (ChecksumMismatch)")


async def lost_meta(root: Path, n: int) -> None:
    async with LocalCluster(root, 3) as c:
        items = {f"m/{i}".encode(): os.urandom(1000 + i % 5000) for i in range(n)}
        items[b"striped"] = os.urandom(5 << 20)
        async with c.client() as kv:
            await kv.put_many(list(items.items()))
        files = {p: p.stat().st_size for p in root.glob("cs*/chunks/*.chunk")}
        await c.stop_meta()
        for p in (root / "meta").glob("meta.sqlite3*"):
            p.unlink()
        await c.start_meta()  # fresh: another cluster id, refused by the chunkservers
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            for _ in range(3):
                await gc.run_pass(PassOptions(apply=True, grace_s=0.0))
        kept = sum(1 for p in files if p.exists())
        _row(f"meta.sqlite3 deleted, fresh meta, 3 GC passes (grace 0) ({n} keys)", 0, 0, 0.0, 0.0,
             f"chunk files kept: {kept} of {len(files)} (was: all deleted)")
        await c.stop_meta()
        for p in (root / "meta").glob("meta.sqlite3*"):
            p.unlink()
        t0 = time.perf_counter()
        await rebuild(root / "meta", [s.addr for s in c.chunkservers if s], c.admin_token)
        await c.start_meta()
        meta = c.meta
        assert meta is not None
        while len([s for s in meta.index.servers.values() if meta.index.alive(s)]) < c.n:
            await asyncio.sleep(0.02)
        restore = time.perf_counter() - t0
        lost, wrong, stall = await _check(c, items)
        _row(f"... then kvfs meta rebuild --from-chunkservers and meta restarted ({n} keys)", lost, wrong,
             stall, restore, "time: rebuild + restart + all chunkservers registered")


async def main_async(ns: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=ns.dir) as d:
        print("| fault | values lost | wrong bytes | longest read | time to restore | notes |")
        print("|---|---|---|---|---|---|")
        await flipped_bit(Path(d) / "bit", ns.keys)
        await lost_meta(Path(d) / "meta", ns.keys)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfs.bench.reliability", description=__doc__)
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--dir", type=Path, default=None)
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
