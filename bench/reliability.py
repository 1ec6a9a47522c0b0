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

from kvfs import rpc
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig, GcConfig
from kvfs.errors import KVFSError
from kvfs.gc import GarbageCollector, PassOptions
from kvfs.gc.repair import repair_step
from kvfs.gc.scrub import scrub
from kvfs.launcher import LocalCluster
from kvfs.layout import Layout, Replica
from kvfs.meta.localstore import drop_stores
from kvfs.meta.rebuild import rebuild

MEND_DEADLINE_S = 120.0  # bad replicas not mended by then: the run fails


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
        drop_stores(root / "meta")
        await c.start_meta()  # fresh: another cluster id, refused by the chunkservers
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            for _ in range(3):
                await gc.run_pass(PassOptions(apply=True, grace_s=0.0))
        kept = sum(1 for p in files if p.exists())
        _row(f"meta's database deleted, fresh meta, 3 GC passes (grace 0) ({n} keys)", 0, 0, 0.0, 0.0,
             f"chunk files kept: {kept} of {len(files)} (was: all deleted)")
        await c.stop_meta()
        drop_stores(root / "meta")
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


def flip_byte(cluster: LocalCluster, rep: Replica, at: int, mask: int = 1) -> None:
    """Fault injection: XOR byte ``at`` of a replica's value with ``mask`` in its chunk file,
    the server running (also used by tests/test_scrub.py)."""
    cs = next(s for s in cluster.chunkservers if s is not None and s.server_id == rep.server_id)
    with open(cs.store.chunk_path(rep.chunk_id), "r+b") as f:
        f.seek(rep.offset + at)
        b = f.read(1)
        f.seek(rep.offset + at)
        f.write(bytes([b[0] ^ mask]))


async def scrubbed(root: Path, mib: int) -> None:
    """``kvfs gc scrub`` over ``mib`` 1 MiB values (replicas=2, 2 servers): 4 with one replica
    flipped, 1 with both; unlimited vs ``--rate 32MiB/s`` (dry runs), then ``--apply``."""
    async with LocalCluster(root, 2) as c:
        items = {f"s/{i}".encode(): os.urandom(1 << 20) for i in range(mib)}
        async with c.client(ClientConfig(replicas=2)) as kv:
            for i in range(0, mib, 8):
                await kv.put_many([(k, items[k]) for k in list(items)[i:i + 8]])
            lays = [await kv.layout(f"s/{i}") for i in range(5)]
        for lay in lays:
            assert lay is not None
            flip_byte(c, lay.extents[0].replicas[0], 12345)
        assert lays[4] is not None
        flip_byte(c, lays[4].extents[0].replicas[1], 777)
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            for rate in (None, 32 << 20):
                r = await scrub(gc, apply=False, rate_bytes=rate)
                print(f"scrub dry run, --rate {'unlimited' if rate is None else '32MiB/s'}: "
                      f"{r.bytes_verified >> 20} MiB in {r.ranges_checked} replicas, {r.corrupt} corrupt, "
                      f"{r.seconds:.2f} s = {r.bytes_verified / r.seconds / 2**20:.0f} MiB/s", flush=True)
            t0 = time.perf_counter()
            r = await scrub(gc, apply=True)
            restore = time.perf_counter() - t0
        del items[b"s/4"]
        lost, wrong, stall = await _check(c, items)
        _row(f"scrub --apply: {mib} values of 1 MiB (replicas=2), a byte flipped in one replica of 4 "
             "and in both of 1", lost, wrong, stall, restore,
             f"repaired {r.repaired}, dropped {r.lost_keys}; the other {mib - 1} read back")


async def until_mended(kv: AsyncClient, key: bytes | str, rep: Replica, deadline_s: float,
                       poll_s: float = 0.05) -> Layout | None:
    """``key``'s layout once it no longer names replica ``rep`` (a bad replica mended: read
    repair, a scrub), polled; None if the key is gone or ``deadline_s`` passes first."""
    end = time.monotonic() + deadline_s
    while True:
        lay = await kv.layout(key)
        if lay is None:
            return None
        if all(rep not in e.replicas for e in lay.extents):
            return lay
        if time.monotonic() >= end:
            return None
        await asyncio.sleep(poll_s)


async def _mended(c: LocalCluster, bad: dict[bytes, Replica], since: float) -> float:
    """Seconds from ``since`` (``time.perf_counter``) until no key's layout names its
    replica in ``bad`` (polled)."""
    async with c.client() as kv:
        for k, rep in bad.items():
            if await until_mended(kv, k, rep, MEND_DEADLINE_S - (time.perf_counter() - since)) is None:
                raise RuntimeError(f"bad replicas not mended within {MEND_DEADLINE_S}s")
    return time.perf_counter() - since


async def _flipped(c: LocalCluster, n: int, prefix: str) -> tuple[dict[bytes, bytes], dict[bytes, Replica]]:
    """``n`` values of 20 KB (replicas=2), and a byte flipped in the first replica of 4 of them."""
    items = {f"{prefix}/{i}".encode(): os.urandom(20_000) for i in range(n)}
    bad: dict[bytes, Replica] = {}
    async with c.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many(list(items.items()))
        for k in list(items)[:: n // 4][:4]:
            lay = await kv.layout(k)
            assert lay is not None
            bad[k] = lay.extents[0].replicas[0]
            flip_byte(c, bad[k], 99)
    return items, bad


async def read_repaired(root: Path, n: int) -> None:
    """Read repair: one get_many of every key finds the 4 bad replicas (the values come from
    the good ones); meta checks and mends them (REPORT_BAD).  Restore: from the read's start
    until meta's layouts name a good copy instead of each."""
    async with LocalCluster(root, 3) as c:
        items, bad = await _flipped(c, n, "r")
        async with c.client(ClientConfig(replicas=2)) as kv:
            t0 = time.perf_counter()
            got = await kv.get_many(list(items))
            stall = time.perf_counter() - t0
        wrong = sum(g is not None and g != v for g, v in zip(got, items.values(), strict=True))
        restore = await _mended(c, bad, t0)
        lost, wrong2, _ = await _check(c, items)
        _row(f"a flipped byte in one replica of 4 of {n} keys (20 KB, replicas=2), all read once "
             "(one get_many)", lost, wrong + wrong2, stall, restore,
             "read repair: the readers told meta, which checked and mended them")


async def background_scrubbed(root: Path, n: int) -> None:
    """The GC daemon's background scrub (--scrub-rate at its default, --interval 2s): the same 4
    bad replicas, nobody reading.  Restore: from the flips until all 4 are mended."""
    async with LocalCluster(root, 3, gc=GcConfig(interval_s=2.0)) as c:
        items, bad = await _flipped(c, n, "b")
        t0 = time.perf_counter()
        restore = await _mended(c, bad, t0)
        lost, wrong, stall = await _check(c, items)
        _row(f"a flipped byte in one replica of 4 of {n} keys (20 KB, replicas=2), nobody reading, the "
             "GC daemon running (--interval 2s, --scrub-rate 8MiB/s)", lost, wrong, stall, restore,
             "the background scrub found and mended them")


async def decommissioned(root: Path, n: int) -> None:
    """``kvfs gc decommission`` of one of 3 chunkservers holding ``n`` replicas=2 values and
    ``n // 10`` replicas=1 values: drained with repair steps, forgotten, then stopped."""
    async with LocalCluster(root, 3) as c:
        items = {f"d/{i}".encode(): os.urandom(20_000) for i in range(n)}
        ones = {f"one/{i}".encode(): os.urandom(20_000) for i in range(n // 10)}
        async with c.client(ClientConfig(replicas=2)) as kv:
            await kv.put_many(list(items.items()))
        async with c.client(ClientConfig(replicas=1)) as kv:
            await kv.put_many(list(ones.items()))
            lay = await kv.layout(next(iter(ones)))
        assert lay is not None
        victim = lay.extents[0].replicas[0].server_id
        async with GarbageCollector(c.addr, token=c.admin_token) as gc:
            t0 = time.perf_counter()
            st = await gc.meta(rpc.GcDecommission(server_id=victim))
            left = st.bytes_left
            while not st.forgotten:
                await gc.sync_usage()
                rep = await repair_step(gc, apply=True)
                st = await gc.meta(rpc.GcDecommission(server_id=victim, start=False))
                assert rep.extents_repaired or st.forgotten, "the drain is stuck"
            drained = time.perf_counter() - t0
        await c.stop_chunkserver(next(i for i, s in enumerate(c.chunkservers)
                                      if s is not None and s.server_id == victim))
        lost, wrong, stall = await _check(c, {**items, **ones})
        _row(f"kvfs gc decommission of 1 of 3 chunkservers ({n} values replicas=2 + {n // 10} "
             f"replicas=1, 20 KB each), drained, forgotten, then stopped", lost, wrong, stall, drained,
             f"{left / 2**20:.1f} MiB copied away; time: decommission to forgotten")


async def main_async(ns: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=ns.dir) as d:
        print("| fault | values lost | wrong bytes | longest read | time to restore | notes |")
        print("|---|---|---|---|---|---|")
        await flipped_bit(Path(d) / "bit", ns.keys)
        await lost_meta(Path(d) / "meta", ns.keys)
        await scrubbed(Path(d) / "scrub", ns.scrub_mib)
        await read_repaired(Path(d) / "read-repair", ns.keys)
        await background_scrubbed(Path(d) / "background-scrub", ns.keys)
        await decommissioned(Path(d) / "decommission", ns.keys)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfs.bench.reliability", description=__doc__)
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--scrub-mib", type=int, default=64, help="values of 1 MiB the scrub checks")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
