"""GC: eviction over the high watermark (LRU, leases), NoSpace when nothing is evictable."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import FakeClock
from conftest import clocked_client as client
from poll import until

from kvfs import rpc
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, ClientConfig
from kvfs.errors import NoSpace
from kvfs.gc import driver
from kvfs.gc.cli import format_status
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster
from kvfs.meta.index import RECORD_OVERHEAD_BYTES, disk_bytes

pytestmark = pytest.mark.usefixtures("meta_backend")  # each test over SQLite and Redis

CAP = 1024 * 1024
VALUE = 8 * 1024
GC = PassOptions(apply=True, grace_s=0, high=0.9, low=0.8)
DEEP = PassOptions(apply=True, grace_s=0, high=0.5, low=0.4)  # a full server is over it


def make(tmp_path: Path, clock: FakeClock, n: int, capacity: int, gc_reserve: int | None = None
         ) -> LocalCluster:
    root = tmp_path / "evict"
    return LocalCluster(root, n, clock=clock, chunkserver=ChunkServerConfig(
        data=root, heartbeat_interval_s=0.2, chunk_bytes=64 * 1024, capacity_bytes=capacity,
        gc_reserve_bytes=gc_reserve))


@pytest.fixture
async def full(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    c = make(tmp_path, clock, 3, CAP)
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


async def read_fresh(c: LocalCluster, clock: FakeClock, keys: list[str]) -> list[bytes | None]:
    """Read through a new client: no cached layouts, so meta sees the access."""
    async with client(c, clock) as r:
        return await r.get_many(keys)


async def test_eviction_keeps_cluster_under_watermark_lru_first(full: LocalCluster, clock: FakeClock) -> None:
    hot = [f"hot{i}" for i in range(20)]
    written: dict[str, int] = {}  # key -> round written
    server: dict[str, int] = {}
    async with client(full, clock) as kv, GarbageCollector(full.addr, token=full.admin_token) as gc:
        await kv.put_many([(k, k.encode().ljust(VALUE, b".")) for k in hot])
        for rnd in range(90):  # 90 rounds x 8 x 8 KiB = 5.6 MiB into 3 MiB of capacity
            clock.advance(10)
            keys = [f"cold{rnd:02d}-{i}" for i in range(8)]
            await kv.put_many([(k, k.encode().ljust(VALUE, b".")) for k in keys])
            for k in keys:
                lay = await kv.layout(k)
                assert lay is not None
                written[k], server[k] = rnd, lay.extents[0].replicas[0].server_id
            assert await read_fresh(full, clock, hot) == [k.encode().ljust(VALUE, b".") for k in hot]
            await gc.run_pass(GC)
            st = await gc.status()
            for s in st["servers"]:
                assert s["used"] <= 0.9 * s["capacity"], s
        assert st["metrics"]["keys_evicted"] > 0
    present = dict(zip(written, await read_fresh(full, clock, list(written)), strict=True))
    assert await read_fresh(full, clock, hot) == [k.encode().ljust(VALUE, b".") for k in hot]
    # least recently read first: on each server, every evicted key is older than every survivor
    evicted_any = False
    for sid in set(server.values()):
        mine = [k for k in written if server[k] == sid]
        gone = [written[k] for k in mine if present[k] is None]
        kept = [written[k] for k in mine if present[k] is not None]
        if gone and kept:
            evicted_any = True
            assert max(gone) <= min(kept), (sid, sorted(gone), sorted(kept))
    assert evicted_any


async def test_lease_holds_eviction_off_until_it_ends(tmp_path: Path, clock: FakeClock) -> None:
    async with (make(tmp_path, clock, 1, 512 * 1024) as c, client(c, clock) as kv,
                GarbageCollector(c.addr, token=c.admin_token) as gc):
        leased = [f"l{i}" for i in range(10)]
        await kv.put_many([(k, b"L" * VALUE) for k in leased])
        assert await kv.match_prefix(leased, lease_s=30) == 10
        clock.advance(1)
        for i in range(5):  # 6 x 80 KiB: past the 90 % watermark of 512 KiB
            await kv.put_many([(f"o{i}-{j}", b"O" * VALUE) for j in range(10)])
        clock.advance(1)
        r = await gc.run_pass(GC)
        assert r.evicted_keys > 0 and r.leased_skipped == 10
        assert await kv.exists_many(leased) == [True] * 10  # EXISTS does not count as a read
        clock.advance(30)  # the lease ends; the leased keys are the least recently used
        evicted = 0
        for i in range(5, 8):
            await kv.put_many([(f"o{i}-{j}", b"O" * VALUE) for j in range(10)])
            r = await gc.run_pass(GC)
            assert r.leased_skipped == 0
            evicted += r.evicted_keys
        assert evicted > 0
        assert await read_fresh(c, clock, leased) == [None] * 10


async def test_full_cluster_nothing_evictable_raises_nospace(tmp_path: Path, clock: FakeClock) -> None:
    async with (make(tmp_path, clock, 1, 256 * 1024) as c, client(c, clock) as kv,
                GarbageCollector(c.addr, token=c.admin_token) as gc):
        keys: list[str] = []
        with pytest.raises(NoSpace) as info:
            for i in range(100):
                batch = [f"n{i}-{j}" for j in range(4)]
                await kv.put_many([(k, b"N" * VALUE) for k in batch])
                keys += batch
                assert await kv.match_prefix(batch, lease_s=60) == 4
                r = await gc.run_pass(GC)
                assert r.evicted_keys == 0
        assert "is full" in str(info.value)
        assert keys
        clock.advance(61)  # leases over: evictable again, and writes fit after a pass
        r = await gc.run_pass(GC)
        assert r.evicted_keys > 0
        await kv.put_many([("after", b"A" * VALUE)])
        assert await kv.get("after") == b"A" * VALUE


@pytest.mark.parametrize("reserve", [None, 96 * 1024])
async def test_write_to_full_cluster_evicts_instead_of_failing(tmp_path: Path, clock: FakeClock,
                                                               reserve: int | None) -> None:
    """No GC daemon: a server refuses a write for lack of space, the writer asks meta to make
    room (MAKE_ROOM: meta runs one GC pass) and retries once.  Also with a GC reserve larger
    than the room between the low watermark and the capacity (``--gc-reserve``, 37.5 % here):
    eviction counted the room a write wanted against the capacity, not against what values may
    fill (the capacity less the reserve), so a server refused every write while its live
    bytes were under 80 % of its capacity, and no pass evicted anything: every write failed as
    full, for good."""
    c = make(tmp_path, clock, 1, 256 * 1024, reserve)
    await c.start()
    try:
        async with client(c, clock) as kv:
            for i in range(100):  # 100 x 4 x 8 KiB = 3.2 MiB through 256 KiB of capacity
                clock.advance(1)
                await kv.put_many([(f"w{i}-{j}", bytes([i]) * VALUE) for j in range(4)])
            assert await read_fresh(c, clock, ["w99-0", "w99-3"]) == [bytes([99]) * VALUE] * 2
            assert await read_fresh(c, clock, ["w0-0"]) == [None]  # the oldest were evicted
            cs = c.chunkservers[0]
            assert cs is not None
            capacity, _, used = cs.store.usage()
            assert used <= capacity
    finally:
        await c.stop()



@pytest.mark.parametrize("full", [True, False])
async def test_a_make_room_that_arrives_while_a_pass_runs_has_that_pass_if_it_made_room(
        tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, full: bool) -> None:
    """A second MAKE_ROOM, sent while the first one's pass runs (held at its start, then let
    go): on a ``full`` server that pass evicts, and the second request is answered with its
    answer, no pass of its own (it waited for a whole pass more before).  On a server with
    nothing to evict, that pass makes no room, and the second request runs the next pass.
    Either way ``kvfs gc status`` counts both requests, their wait, the passes run for them,
    and, with nothing to evict, both answered that no room was made."""
    async with make(tmp_path, clock, 1, 256 * 1024) as c:
        assert c.meta is not None
        meta_gc = c.meta.gc
        if full:
            kv = c.client(ClientConfig(evict_on_full=False))
            kv.clock = clock
            async with kv:
                await fill(kv, clock)
        entered, gate = asyncio.Event(), asyncio.Event()
        run_pass = driver.GarbageCollector.run_pass

        async def held(self: GarbageCollector, opts: PassOptions) -> Any:
            entered.set()
            await gate.wait()
            return await run_pass(self, opts)

        monkeypatch.setattr(driver.GarbageCollector, "run_pass", held)
        first = asyncio.create_task(meta_gc.rpc_make_room(rpc.MakeRoom(), memoryview(b"")))
        await entered.wait()  # the first request's pass runs
        second = asyncio.create_task(meta_gc.rpc_make_room(rpc.MakeRoom(), memoryview(b"")))
        await until(lambda: bool(meta_gc._room_lock._waiters), "the second request waits")  # type: ignore[attr-defined]
        gate.set()
        (a, _), (b, _) = await asyncio.gather(first, second)
        st, _ = await meta_gc.rpc_gc_status(rpc.GcStatus(), memoryview(b""))
    m = st.metrics
    assert (m["room_requests"], m["room_passes"], m["room_refused"]) == ((2, 1, 0) if full else (2, 2, 2)), m
    assert m["room_wait_s"] > 0, m
    line = next(x for x in format_status(rpc.to_dict(st)).splitlines() if x.startswith("writers on a full"))
    assert (f"asked for room 2 times, waited {m['room_wait_s']:.2f}s in all" in line
            and f"{m['room_passes']} passes ran for them; {m['room_refused']} told none was made" in line), line
    assert a.freed is full and b.freed is full
    if full:
        assert a.evicted_keys > 0 and b == a and meta_gc._room_started == 1
    else:
        assert meta_gc._room_started == 2


class CountedSet(set[Any]):
    """A server's set of open connections that keeps those added (accepted) to it."""

    def __init__(self, items: set[Any]) -> None:
        super().__init__(items)
        self.added: list[Any] = []

    def add(self, item: Any) -> None:
        self.added.append(item)
        super().add(item)


async def test_meta_s_make_room_passes_share_their_connections(tmp_path: Path, clock: FakeClock) -> None:
    """Meta runs its MAKE_ROOM passes with one collector, kept from pass to pass: the
    passes open no connection to the chunkserver or to meta each (they did, and closed it
    after: some 4 ms of meta's CPU a pass, bench/RESULTS.md).  Once the server dropped the
    collector's connection, the next pass opens one again, and once meta closes, it is
    closed."""
    c = make(tmp_path, clock, 1, 256 * 1024)
    await c.start()
    try:
        assert c.meta is not None
        cs = c.chunkservers[0]
        assert cs is not None
        meta_gc = c.meta.gc
        async with client(c, clock) as kv:
            await kv.put("first", b"F")
            for server in (cs.rpc, c.meta.rpc):
                server.connections = CountedSet(server.connections)

            async def fill(n: int) -> None:
                for i in range(n):  # n x 4 x 8 KiB through 256 KiB of capacity
                    clock.advance(1)
                    await kv.put_many([(f"w{i}-{j}", bytes([i % 256]) * VALUE) for j in range(4)])

            await fill(60)
            assert meta_gc._room_started >= 3, meta_gc._room_started
            # the collector's one connection to each (the writer's were open already)
            assert len(cs.rpc.connections.added) == 1, (cs.rpc.connections.added, meta_gc._room_started)
            assert len(c.meta.rpc.connections.added) == 1, c.meta.rpc.connections.added
            passes = meta_gc._room_started
            (collector,) = cs.rpc.connections.added
            collector.transport.close()  # the server drops the collector's connection
            await fill(60)
            assert meta_gc._room_started > passes
            assert len(cs.rpc.connections.added) == 2, cs.rpc.connections.added  # one new one
            assert meta_gc._room_gc is not None
        await meta_gc.close()
        assert meta_gc._room_gc is None
        await until(lambda: len(cs.rpc.connections) == 0, "the collector's connection closed")
    finally:
        await c.stop()


async def test_evict_takes_exactly_what_the_server_over_its_watermark_needs(
        tmp_path: Path, clock: FakeClock) -> None:
    """GC_EVICT's choices, exact, on two servers "a" and "b": only keys of a server over its
    high watermark, least recently used first, and only until it fits under the low one (a
    byte short is one key); a server at its watermark exactly is not over it; ``server_id``
    limits eviction to that server; an expired key is a victim like any other unless the
    dry run is ``after_expire`` (then it is gone already, and the keys after it are still
    chosen from).  Then applied: just the chosen key is gone."""
    async with make(tmp_path, clock, 2, CAP) as c, GarbageCollector(c.addr, token=c.admin_token) as gc:
        kv = client(c, clock)
        async with kv:
            keys = [f"k{i:02d}" for i in range(24)]
            lays = {}
            for k in keys:  # one per tick: the LRU order is the order written (a lookup is an access)
                clock.advance(1)
                await kv.put(k, k.encode().ljust(VALUE, b"."))
                lays[k] = await kv.layout(k)
            where = {k: lay.extents[0].replicas[0].server_id for k, lay in lays.items() if lay is not None}
            assert len(where) == len(keys)
            b = where[keys[0]]  # holds the least recently used key
            (a,) = {cs.server_id for cs in c.chunkservers if cs is not None} - {b}
            ttl, ttl_key = None, ""  # a key with a TTL on "a"; read after it, keys[1:] become more recent
            for i in range(20):
                clock.advance(1)
                await kv.put(f"t{i}", b"T" * 3000, ttl=30)
                lay = await kv.layout(f"t{i}")
                assert lay is not None
                if lay.extents[0].replicas[0].server_id == a:
                    ttl, ttl_key = lay, f"t{i}"
                    break
            assert ttl is not None, "no put of 20 went to the second server"
            for k in keys[1:]:
                clock.advance(1)
                assert await read_fresh(c, clock, [k]) == [k.encode().ljust(VALUE, b".")]
            clock.advance(1)  # the most recent: enough small keys that the LRU order is read in two batches
            await kv.put_many([(f"z{i:04d}", b"z") for i in range(1000)])
            clock.advance(60)  # every t key expired; GC_EXPIRE has not run
            first_a = next(k for k in keys if where[k] == a)
            await gc.sync_usage()
            st = {s["server_id"]: s for s in (await gc.status())["servers"]}
            live, used = {sid: st[sid]["live"] for sid in st}, {sid: st[sid]["used"] for sid in st}
            assert st[a]["capacity"] == CAP and 0 < live[a] <= used[a]

            def evict(sid: int, have: int, short: int, *, apply: bool = False,
                      after_expire: bool = False) -> rpc.GcEvict:
                low = (have - short) / CAP  # exact: CAP is a power of two
                return rpc.GcEvict(high=low, low=low, server_id=sid, apply=apply, after_expire=after_expire)

            # "a": its least recently used key is the expired one
            r = await gc.meta(evict(a, live[a], 1))
            assert (r.keys, r.bytes, r.leased) == (1, disk_bytes(ttl), 0)
            assert r.servers == {a: rpc.EvictTarget(live[a], live[a] - 1)} and r.short == {}
            # as after the expire phase: that key is gone, the next one goes
            have = live[a] - (RECORD_OVERHEAD_BYTES + len(ttl_key) + 3000)  # a live record: header, key, value
            r = await gc.meta(evict(a, have, 1, after_expire=True))
            assert (r.keys, r.bytes) == (1, disk_bytes(lays[first_a]))
            assert r.servers == {a: rpc.EvictTarget(have, have - 1)}
            # "b": its own least recently used key, the oldest of all
            r = await gc.meta(evict(b, live[b], 1))
            assert (r.keys, r.bytes) == (1, disk_bytes(lays[keys[0]]))
            assert r.servers == {b: rpc.EvictTarget(live[b], live[b] - 1)}
            # at the high watermark exactly is not over it: nothing to do anywhere
            top = max(used.values())
            r = await gc.meta(rpc.GcEvict(high=top / CAP, low=top / CAP))
            assert (r.keys, r.servers) == (0, {})
            r = await gc.meta(evict(a, live[a], 1, apply=True))
            assert (r.keys, r.bytes) == (1, disk_bytes(ttl))
            metrics = (await gc.status())["metrics"]
            assert (metrics["keys_evicted"], metrics["bytes_evicted"]) == (1, disk_bytes(ttl))  # dry runs count none
        got = await read_fresh(c, clock, keys)  # every key without a TTL is still there
        assert got == [k.encode().ljust(VALUE, b".") for k in keys]


@pytest.mark.parametrize("hot", [False, True])
async def test_eviction_empties_the_chunk_its_victims_left_partly_live(
        tmp_path: Path, clock: FakeClock, hot: bool) -> None:
    """Keys written in order fill chunks in order.  GC_EVICT short of the first chunk and two
    keys of the second takes the rest of the second too, as they come next in the LRU order,
    so a pass deletes both chunks and copies nothing (before, it left the second chunk partly
    live, for compaction to copy).  With one key of the second chunk read since (``hot``: the most
    recently used), that chunk cannot be emptied: the eviction takes just what was short."""
    async with make(tmp_path, clock, 1, CAP) as c, GarbageCollector(c.addr, token=c.admin_token) as gc:
        kv = client(c, clock)
        async with kv:
            keys = [f"k{i:02d}" for i in range(40)]
            chunk = {}
            for k in keys:  # one per tick: the LRU order is the order written
                clock.advance(1)
                await kv.put(k, k.encode().ljust(VALUE, b"."))
                lay = await kv.layout(k)
                assert lay is not None
                chunk[k] = lay.extents[0].replicas[0].chunk_id
            first, second = sorted(set(chunk.values()))[:2]
            in_first = [k for k in keys if chunk[k] == first]
            in_second = [k for k in keys if chunk[k] == second]
            assert len(in_first) >= 4 and len(in_second) >= 4, (in_first, in_second)
            if hot:
                clock.advance(1)
                assert await read_fresh(c, clock, in_second[-1:]) == [in_second[-1].encode().ljust(VALUE, b".")]
            clock.advance(1)
            await gc.sync_usage()
            (st,) = (await gc.status())["servers"]
            taken = len(in_first) + 2  # what is short: the first chunk and two of the second
            low = (st["live"] - (taken - 1) * VALUE - 1) / CAP  # exact: CAP is a power of two
            r = await gc.meta(rpc.GcEvict(high=low, low=low))
            gone = in_first + in_second[:2] if hot else in_first + in_second
            assert r.keys == len(gone), (r, len(in_first), len(in_second))
            r = await gc.run_pass(PassOptions(apply=True, grace_s=0, high=low, low=low))
            assert r.evicted_keys == len(gone)
            if hot:
                assert r.chunks_compacted >= 1 and r.bytes_copied > 0, r  # the rest of the second
            else:
                assert r.chunks_compacted == 0 and r.bytes_copied == 0, r
                assert r.chunks_deleted >= 2, r
        assert await read_fresh(c, clock, keys) == [None if k in gone else k.encode().ljust(VALUE, b".")
                                                    for k in keys]


async def test_evicting_a_striped_value_counts_all_its_extents_on_the_server(
        tmp_path: Path, clock: FakeClock) -> None:
    """A value striped into three extents on one server frees all three: GC_EVICT short of two
    extents' bytes takes that one value, not the next key too (larger than what was short, it
    is not taken to empty the chunk either: :class:`kvfs.meta.gc._Finishing`)."""
    async with make(tmp_path, clock, 1, CAP) as c, GarbageCollector(c.addr, token=c.admin_token) as gc:
        kv = c.client(ClientConfig(stripe_bytes=VALUE))
        kv.clock = clock
        async with kv:
            await kv.put("striped", b"S" * (3 * VALUE))
            striped = await kv.layout("striped")
            assert striped is not None and len(striped.extents) == 3
            clock.advance(1)  # "next" is the more recently used (a lookup counts as a use)
            await kv.put("next", b"N" * (3 * VALUE))
            (sid,) = {r.server_id for x in striped.extents for r in x.replicas}
            await gc.sync_usage()
            (st,) = (await gc.status())["servers"]
            low = (st["live"] - 2 * VALUE) / CAP  # exact: CAP is a power of two
            r = await gc.meta(rpc.GcEvict(high=low, low=low, server_id=sid, apply=True))
            assert (r.keys, r.bytes) == (1, 3 * VALUE)
        assert await read_fresh(c, clock, ["striped", "next"]) == [None, b"N" * (3 * VALUE)]


async def test_a_server_of_unknown_capacity_is_not_evicted_from_for_a_writers_wanted_bytes(
        tmp_path: Path, clock: FakeClock) -> None:
    """A server whose capacity meta does not know (0: on Redis, one another meta registered,
    before its first heartbeat here) is never over a watermark, even with a writer's refused
    bytes reported: nothing of it is evicted.  The same wanted bytes with its capacity known
    do evict (so the check, not a lack of need, kept the keys)."""
    root = tmp_path / "evict"
    quiet = ChunkServerConfig(data=root, heartbeat_interval_s=3600, chunk_bytes=64 * 1024, capacity_bytes=CAP)
    async with (LocalCluster(root, 1, clock=clock, chunkserver=quiet) as c, client(c, clock) as kv,
                GarbageCollector(c.addr, token=c.admin_token) as gc):
        keys = [f"u{i}" for i in range(8)]
        await kv.put_many([(k, k.encode().ljust(VALUE, b".")) for k in keys])
        ((sid, stats),) = (await gc.sync_usage()).items()
        (server,) = await gc.servers()
        beat = rpc.Heartbeat.of(stats, server_id=sid, addr=server.addr)
        await gc.meta(msgspec.structs.replace(beat, capacity=0, free=0, wanted=2 * VALUE))
        r = await gc.meta(rpc.GcEvict(high=0.9, low=0.8, apply=True))
        assert (r.keys, r.servers, r.short) == (0, {}, {})
        assert await read_fresh(c, clock, keys) == [k.encode().ljust(VALUE, b".") for k in keys]
        await gc.meta(msgspec.structs.replace(beat, wanted=CAP))  # capacity known: room is made
        r = await gc.meta(rpc.GcEvict(high=0.9, low=0.8, apply=True))
        assert r.keys == len(keys) and sid in r.servers
        assert await read_fresh(c, clock, keys) == [None] * len(keys)


async def refuse_tombstones(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fault injection: no chunkserver takes the GC's tombstone writes; returns the tries
    (keys per try) as they come."""
    tries: list[int] = []

    async def refused(link: object, keys: list[bytes], replicas: int, write_id: int) -> list[object]:
        tries.append(len(keys))
        raise NoSpace("injected: no chunkserver takes the tombstone write")

    monkeypatch.setattr(driver, "write_tombstones", refused)
    return tries


async def test_eviction_goes_on_past_overwritten_keys_when_no_tombstone_can_be_written(
        tmp_path: Path, clock: FakeClock, meta_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full cluster whose least recently used keys were all overwritten (their older records
    on disk: each may go only with a tombstone) and whose chunkservers take no tombstone write:
    eviction passes over those keys to the least recently used ones that go without one, so
    writes keep fitting (each through MAKE_ROOM); the overwritten keys all stay, with their
    last values (none dropped without its tombstone)."""
    tries = await refuse_tombstones(monkeypatch)
    async with make(tmp_path, clock, 1, 256 * 1024) as c, client(c, clock) as kv:
        over = [f"o{i}" for i in range(8)]  # more than a write's room
        for value in (b"1", b"2"):  # the first records become older records
            for half in (over[:4], over[4:]):
                clock.advance(1)
                await kv.put_many([(k, value * VALUE) for k in half])
        for r in range(50):  # 50 x 4 x 8 KiB = 1.6 MiB through 256 KiB
            clock.advance(1)
            await kv.put_many([(f"f{r}-{i}", bytes([r]) * VALUE) for i in range(4)])
        assert await read_fresh(c, clock, ["f49-0", "f49-3"]) == [bytes([49]) * VALUE] * 2
        assert await read_fresh(c, clock, ["f0-0", "f0-3"]) == [None, None]  # evicted, LRU first
        if meta_backend != "redis":  # (SQLite, RocksDB: older records kept)
            assert tries and max(tries) <= len(over)  # chosen first: tombstones tried
            assert await read_fresh(c, clock, over) == [b"2" * VALUE] * len(over)
        else:  # the Redis store keeps no older records: the overwritten keys went first
            assert not tries
            assert await read_fresh(c, clock, over) == [None] * len(over)


async def test_when_every_key_needs_a_tombstone_and_none_can_be_written_writes_fail_as_full(
        tmp_path: Path, clock: FakeClock, meta_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full cluster whose keys were all overwritten (each may go only with a tombstone) and
    whose chunkservers take no tombstone write: a write fails as full (NoSpace, saying so)
    after the one pass it asked for (MAKE_ROOM) tried the tombstones once; a pass then ends
    having evicted nothing, again after one try (no loop); no key was dropped without its
    tombstone.  Once tombstones are taken again, a pass drops the least recently used keys
    with theirs and the write fits."""
    if meta_backend == "redis":
        pytest.skip("the Redis store keeps no older records: no key needs a tombstone")
    tries = await refuse_tombstones(monkeypatch)
    async with (make(tmp_path, clock, 1, 256 * 1024) as c, client(c, clock) as kv,
                GarbageCollector(c.addr, token=c.admin_token) as gc):
        keys: list[str] = []
        for r in range(7):  # 7 x 4 x 8 KiB live, each key over a small first record
            batch = [f"o{r}-{i}" for i in range(4)]
            for value in (b"1" * 100, b"2" * VALUE):
                clock.advance(1)
                await kv.put_many([(k, value) for k in batch])
            keys += batch
        assert c.meta is not None
        index = c.meta.index
        assert all(k.encode() in index.older for k in keys)  # type: ignore[union-attr]
        assert not tries  # no write was refused yet
        clock.advance(1)
        with pytest.raises(NoSpace, match="is full"):
            await kv.put_many([(f"n{i}", b"3" * VALUE) for i in range(4)])
        assert len(tries) == 1  # its pass tried the tombstones once
        r = await gc.run_pass(DEEP)
        assert r.evicted_keys == 0 and len(tries) == 2
        assert all(k.encode() in index.entries for k in keys)  # type: ignore[union-attr]
        monkeypatch.undo()  # chunkservers take tombstones again
        clock.advance(1)
        r = await gc.run_pass(DEEP)
        assert r.evicted_keys > 0
        await kv.put_many([(f"n{i}", b"3" * VALUE) for i in range(4)])
        assert await read_fresh(c, clock, [f"n{i}" for i in range(4)]) == [b"3" * VALUE] * 4
        dropped = [k for k in keys if k.encode() not in index.entries]  # type: ignore[union-attr]
        kept = [k for k in keys if k not in dropped]

        def written(k: str) -> int:  # the round that wrote it
            return int(k[1:].split("-")[0])

        assert dropped and max(map(written, dropped)) <= min(map(written, kept))  # LRU first
        assert all(k.encode() in index.tombstones for k in dropped)  # type: ignore[union-attr]
        assert await read_fresh(c, clock, dropped + kept) == [None] * len(dropped) + [b"2" * VALUE] * len(kept)


@pytest.mark.parametrize("leased", [False, True])
async def test_an_eviction_whose_victims_all_need_tombstones_walks_each_key_about_once(
        tmp_path: Path, clock: FakeClock, meta_backend: str, monkeypatch: pytest.MonkeyPatch,
        leased: bool) -> None:
    """Every key overwritten (each goes only with a tombstone), and an eviction that needs
    many times the keys one GC_EVICT answer leaves for tombstones (``MAX_SHADOWED``, made 3
    here): each call stops choosing once it has a call's worth, and the next goes on from
    where it stopped (``stopped_at``, ``after``), so the LRU walks of the whole eviction hand
    out each key about once, the ``leased`` keys passed over too (every other one).  Before,
    each call chose every victim still needed and answered with the first few: the walks
    handed out the keys some (victims / MAX_SHADOWED) / 2 times over (274 keys for 34
    victims here); and each call walked again from the start of the order, past the leased
    keys the calls before had passed over (120 keys for 20 victims and 20 leased keys).  The
    least recently used keys went, and no leased key; each with its tombstone, which is still
    kept where no chunk was compacted (with leased keys left in them, the pass compacts the
    chunks, and the tombstones pass)."""
    if meta_backend == "redis":
        pytest.skip("the Redis store keeps no older records: no key needs a tombstone")
    from kvfs.meta import gc as meta_gc

    monkeypatch.setattr(meta_gc, "MAX_SHADOWED", 3)
    async with (make(tmp_path, clock, 1, CAP) as c, client(c, clock) as kv,
                GarbageCollector(c.addr, token=c.admin_token) as gc):
        keys = [f"k{i:02d}" for i in range(40)]
        held = keys[1::2] if leased else []
        for value in (b"1", b"2"):  # the first records become older records
            if held and value == b"2":  # (leased before the second round: the LRU order stays the order written)
                assert await kv.exists_many(held, lease_s=600) == [True] * len(held)
            for k in keys:  # one per tick: the LRU order is the order written
                clock.advance(1)
                await kv.put(k, value * VALUE)
        assert c.meta is not None
        index = c.meta.index
        walked: list[int] = []
        lru_order = index.lru_order

        async def counted(batch: int = 1000, after: Any = None) -> AsyncIterator[list[tuple[bytes, Any, float]]]:
            async for rows in lru_order(2, after):  # (batches of 2: the walk can stop early)
                walked.append(len(rows))
                yield rows

        monkeypatch.setattr(index, "lru_order", counted)
        clock.advance(1)
        await gc.sync_usage()
        r = await gc.run_pass(PassOptions(apply=True, grace_s=0, high=0.05, low=0.05))
    free = [k for k in keys if k not in held]
    assert r.evicted_keys >= len(free) - 6, r  # all but what fits under 5 % of CAP, each with a tombstone
    # (before: 274 for 34 victims; with the leases and no `after`, 120 for 20)
    assert sum(walked) <= 2 * (r.evicted_keys + len(held)), (sum(walked), r.evicted_keys)
    gone = [k for k in keys if k.encode() not in index.entries]  # type: ignore[union-attr]
    assert gone == free[:len(gone)] and len(gone) == r.evicted_keys  # least recently used first
    if not leased:  # (with leased keys left, compaction deletes the chunks: their tombstones pass)
        assert all(k.encode() in index.tombstones for k in gone)  # type: ignore[union-attr]


async def fill(kv: AsyncClient, clock: FakeClock) -> list[str]:
    """Keys put one per tick (the LRU order is the order written) until the servers refuse
    one (NoSpace, no MAKE_ROOM: ``kv`` has ``evict_on_full`` off): the keys stored."""
    keys: list[str] = []
    with pytest.raises(NoSpace):
        for i in range(64):
            clock.advance(1)
            await kv.put(f"f{i:02d}", bytes([i]) * VALUE)
            keys.append(f"f{i:02d}")
    clock.advance(1)
    return keys


@contextlib.asynccontextmanager
async def filled(tmp_path: Path, clock: FakeClock, gc_reserve: int
                 ) -> AsyncIterator[tuple[LocalCluster, GarbageCollector, AsyncClient, list[str]]]:
    """One 256 KiB server of 64 KiB chunks with that GC reserve, filled (:func:`fill`) by a
    client that never asks meta for room (the passes the test runs make it); the cluster, a
    collector, that client and the keys stored."""
    async with (make(tmp_path, clock, 1, 256 * 1024, gc_reserve=gc_reserve) as c,
                GarbageCollector(c.addr, token=c.admin_token) as gc):
        kv = c.client(ClientConfig(evict_on_full=False))
        kv.clock = clock
        async with kv:
            yield c, gc, kv, await fill(kv, clock)


async def test_a_full_server_whose_chunks_are_all_partly_live_is_compacted_into_its_reserve(
        tmp_path: Path, clock: FakeClock) -> None:
    """Client values fill a server only up to its GC reserve.  Every other key read (so
    eviction takes the others, from every chunk), a pass over the high watermark evicts
    and must then compact those chunks: copying their live halves takes room the values
    left free, and the room the pass frees takes new values again."""
    async with filled(tmp_path, clock, 64 * 1024) as (c, gc, kv, keys):  # a chunk
        kept = keys[1::2]
        assert await read_fresh(c, clock, kept) == [bytes([int(k[1:])]) * VALUE for k in kept]
        cs = c.chunkservers[0]
        assert cs is not None
        _, _, used = cs.store.usage()
        r = await gc.run_pass(DEEP)
        assert r.evicted_keys > 0 and r.chunks_compacted > 0, r
        _, _, after = cs.store.usage()
        assert after < used, (after, used)  # the evicted halves' room is back
        clock.advance(1)
        await kv.put("after", b"A" * VALUE)
        assert await read_fresh(c, clock, ["after"]) == [b"A" * VALUE]


async def test_the_watermarks_of_a_server_whose_gc_reserve_stops_values_under_them_are_of_its_room(
        tmp_path: Path, clock: FakeClock) -> None:
    """A GC reserve larger than the room above the high watermark (96 KiB of 256 KiB here)
    stops values at 62.5 % of the capacity, under the high watermark (90 %): the daemon's
    passes never evicted ahead, so each write waited for a pass that made room for itself
    alone, and many writers at once failed as full (bench/RESULTS.md).  Such a server's
    watermarks are now of the room values have: a pass evicts it to 80 % of that room."""
    room = (256 - 96) * 1024
    async with filled(tmp_path, clock, 96 * 1024) as (c, gc, kv, _):
        await gc.sync_usage()
        (target,) = (await gc.meta(rpc.GcEvict())).servers.values()  # (a dry run)
        assert target.target <= int(0.8 * room) < target.live, target  # (0.8 x the capacity before)
        r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
        assert r.evicted_keys > 0, r
        st = await gc.status()
        assert st["servers"][0]["live"] <= target.target, (st["servers"][0], target)
        clock.advance(1)
        await kv.put("after", b"A" * VALUE)  # (kv never asks meta for room)
        assert await read_fresh(c, clock, ["after"]) == [b"A" * VALUE]


@pytest.mark.parametrize("by", ["pass", "writer", "leased"])
async def test_a_full_server_with_no_room_to_copy_any_chunk_empties_one_and_takes_writes_again(
        tmp_path: Path, clock: FakeClock, by: str) -> None:
    """A GC reserve smaller than the live bytes eviction leaves in any chunk: compaction
    could copy none of them, so the room eviction made stayed garbage, and every write failed
    as full for good (a 256 MiB server of 64 MiB chunks, bench/RESULTS.md).  Now the pass
    evicts the rest of the chunk with the fewest live bytes, deletes it, and writes fit
    again: through a pass (``pass``), or a writer's MAKE_ROOM (``writer``); with a key of
    that chunk leased (``leased``), none of its keys goes, and another chunk is emptied.
    The keys of the emptied chunk read as misses; every other key reads its own bytes."""
    async with filled(tmp_path, clock, 8 * 1024) as (c, gc, kv, keys):
        chunk: dict[str, int] = {k: (await kv.layout(k)).extents[0].replicas[0].chunk_id for k in keys}
        firsts = [k for i, k in enumerate(keys) if i == 0 or chunk[k] != chunk[keys[i - 1]]]
        assert len(firsts) >= 4, chunk  # (7 values a chunk)
        # the first key of each chunk is the least recently used: eviction takes those (and
        # the last, open chunk's other key, emptying it), which leaves four chunks mostly live
        read = [k for k in keys if k not in firsts]
        clock.advance(1)  # (after the layouts' lookups)
        assert await read_fresh(c, clock, read) == [bytes([int(k[1:])]) * VALUE for k in read]
        if by == "leased":  # the first chunk's last key
            assert await kv.match_prefix([[k for k in keys if chunk[k] == chunk[keys[0]]][-1]], lease_s=600) == 1
        cs = c.chunkservers[0]
        assert cs is not None
        _, _, used = cs.store.usage()
        if by == "writer":
            async with client(c, clock) as w:  # (MAKE_ROOM on a full write, the default)
                await w.put("after", b"A" * VALUE)
        else:
            r = await gc.run_pass(GC)
            assert r.chunks_emptied == 1 and r.leased_skipped == 0, r
            await kv.put("after", b"A" * VALUE)
        _, _, now = cs.store.usage()
        assert now < used, (now, used)
        got = dict(zip([*keys, "after"], await read_fresh(c, clock, [*keys, "after"]), strict=True))
        assert got.pop("after") == b"A" * VALUE
        assert all(v == bytes([int(k[1:])]) * VALUE for k, v in got.items() if v is not None)
        # the chunks emptied, of the first four (the last, open one: its eviction's)
        emptied = {chunk[f] for f in firsts[:4]} - {chunk[k] for k, v in got.items() if v is not None}
        if by == "leased":  # the first chunk's last key leased: another chunk went instead
            assert len(emptied) == 1 and chunk[keys[0]] not in emptied, emptied
        else:
            assert emptied == {chunk[keys[0]]}
        # the others keep all but their first keys
        kept = [k for k in keys if chunk[k] in {chunk[f] for f in firsts[:4]} - emptied and k not in firsts]
        assert [got[k] for k in kept] == [bytes([int(k[1:])]) * VALUE for k in kept]


async def test_compaction_on_a_server_stops_for_the_pass_once_its_reserve_is_spent(
        tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    """With a grace period the chunks compacted stay until it ends, so their copies fill the
    GC reserve: once no copy fits, the server's other chunks wait for the next pass (one
    warning), rather than each failing in turn."""
    async with filled(tmp_path, clock, 36 * 1024) as (_, gc, kv, keys):
        # every chunk keeps half its keys: leased, so eviction cannot empty a chunk instead
        assert await kv.match_prefix(keys[1::2], lease_s=600) == len(keys[1::2])
        with caplog.at_level(logging.WARNING, logger="kvfs.gc"):
            r = await gc.run_pass(dataclasses.replace(DEEP, grace_s=60))
        # ~33 KiB copied per chunk, 36 KiB of reserve (and what the values left): some fit
        assert 0 < r.chunks_compacted < r.compact_candidates, r
        (stopped,) = [m.getMessage() for m in caplog.records]
        assert stopped.startswith("compaction on server 1 stopped for this pass, ")
        # (the room left, counted as the pass copies: the next copy is not tried)
        assert "chunks left for the next: the fewest live bytes of them, " in stopped, stopped
        assert "do not fit the " in stopped and " bytes GC may fill there" in stopped, stopped


@pytest.mark.parametrize(("first_gone", "second_gone", "last_gone", "compacted"), [
    (4, 0, 3, 2),  # the first chunk and the open one (sealed by the pass) to compact
    (3, 7, 0, 1),  # the first chunk to compact, the second to delete
])
async def test_compaction_copies_first_the_chunks_that_fit_and_then_those_their_room_lets_fit(
        tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture,
        first_gone: int, second_gone: int, last_gone: int, compacted: int) -> None:
    """A full server, and a chunk to compact with more live bytes than the room GC may fill
    there.  Tried first (the most garbage), it was refused, and the server's compaction
    stopped for the pass: nothing freed, pass after pass (a 256 MiB server, bench/RESULTS.md).
    Now what makes room goes first: a chunk whose live bytes fit, copied and deleted (no
    grace period), or a chunk with nothing live, deleted; then the first is copied."""
    async with (make(tmp_path, clock, 1, 160 * 1024, gc_reserve=8 * 1024) as c,
                GarbageCollector(c.addr, token=c.admin_token) as gc):
        kv = c.client(ClientConfig(evict_on_full=False))
        kv.clock = clock
        async with kv:
            keys = await fill(kv, clock)
            chunks: dict[int, list[str]] = {}
            for k in keys:
                chunks.setdefault((await kv.layout(k)).extents[0].replicas[0].chunk_id, []).append(k)
            first, second, last = chunks.values()
            assert (len(first), len(second), len(last)) == (7, 7, 4), chunks
            gone = first[:first_gone] + second[:second_gone] + last[:last_gone]
            await kv.delete_many(gone)
            cs = c.chunkservers[0]
            assert cs is not None
            _, _, used = cs.store.usage()
            with caplog.at_level(logging.WARNING, logger="kvfs.gc"):
                r = await gc.run_pass(PassOptions(apply=True, grace_s=0, evict=False))
            assert r.chunks_compacted == compacted and r.chunks_deleted == 2, r
            assert not caplog.records, [m.getMessage() for m in caplog.records]
            _, _, now = cs.store.usage()
            assert now < used - 40 * 1024, (now, used)
            left = [k for k in keys if k not in gone]
            assert await read_fresh(c, clock, left) == [bytes([int(k[1:])]) * VALUE for k in left]


@pytest.mark.parametrize(("made", "fulls", "asks", "fits"), [
    (1, 2, 2, True),  # each pass made room, which others took first: asked again, then fits
    (0, 2, 1, False),  # after a pass that made none, the retry is the last
    (1, 3, 2, False),  # three tries in all: NoSpace, never an AssertionError
])
async def test_a_full_write_asks_meta_for_room_again_while_its_passes_make_some(
        tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch,
        made: int, fulls: int, asks: int, fits: bool) -> None:
    """The first ``fulls`` appends find the servers full (fault injection); MAKE_ROOM answers
    that its pass evicted ``made`` keys."""
    async with make(tmp_path, clock, 1, CAP) as c:
        kv = c.client()
        async with kv:
            w = kv.writer
            append, call_meta = w._append, w._link.call_meta
            left, asked = [fulls], []

            async def full_first(*a: Any, **k: Any) -> Any:
                if left[0]:
                    left[0] -= 1
                    raise NoSpace("chunkserver 1 is full (injected)")
                return await append(*a, **k)

            async def room(req: Any, *a: Any, **k: Any) -> Any:
                if isinstance(req, rpc.MakeRoom):
                    asked.append(req)
                    return rpc.RoomMade(expired_keys=0, evicted_keys=made, bytes_reclaimed=0)
                return await call_meta(req, *a, **k)

            monkeypatch.setattr(w, "_append", full_first)
            monkeypatch.setattr(w._link, "call_meta", room)
            if fits:
                await kv.put("k", b"v")
                assert await kv.get("k") == b"v"
            else:
                with pytest.raises(NoSpace, match="injected"):
                    await kv.put("k", b"v")
            assert len(asked) == asks
