"""A lost meta costs nothing the chunks can rebuild: records carry what a rebuild needs."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import crc32c
import msgspec
import pytest
from poll import until_alive
from test_meta_walks import derived_tomb_chunks

from kvfs import rpc
from kvfs.chunkserver.records import scan_records
from kvfs.config import ChunkServerConfig, ClientConfig
from kvfs.errors import KVFSError, ServerError
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster, ProcessCluster
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.meta.index import MetaIndex, disk_bytes
from kvfs.meta.localstore import drop_stores, held_kind
from kvfs.meta.rebuild import FoundRecord, RebuildReport, backup, pick_layouts, rebuild
from kvfs.meta.rocks import RocksStore
from kvfs.meta.tombstones import (
    Tomb,
    decode_horizon,
    encode_horizon,
    floors,
    horizon_now,
    passed,
    raise_horizon,
    tomb_layout,
)  # (duplicates: meta/index.py imports the same names; an import list, nothing to share)

NOW = 1_800_000_000.0


def _rec(key: bytes, wid: int, extent: int = 0, *, total: int = 10, length: int = 10, sid: int = 1,
         chunk: int = 1, off: int = 0, ok: bool = True, tomb: bool = False,
         exp: float | None = None) -> FoundRecord:
    return FoundRecord(key, wid, extent, total, 99, length, 7, exp, tomb, ok, sid, chunk, off)


def test_newest_write_wins_and_tombstones_delete() -> None:
    rep = RebuildReport()
    got = pick_layouts([
        _rec(b"a", 1, off=0), _rec(b"a", 2, off=100),                   # overwritten
        _rec(b"d", 1), _rec(b"d", 2, tomb=True, length=0, total=0),     # deleted
        _rec(b"d2", 3), _rec(b"d2", 2, tomb=True, length=0, total=0),   # re-put after a delete
        _rec(b"x", 1, exp=NOW - 1),                                     # expired
    ], NOW, rep)
    assert set(got) == {b"a", b"d2"}
    assert got[b"a"].extents[0].replicas == (Replica(1, 1, 100),)
    assert (rep.deleted, rep.expired, rep.keys) == (1, 1, 2)


def test_striped_values_need_every_extent_and_take_every_good_copy() -> None:
    recs = [_rec(b"s", 5, 0, total=25, length=10, sid=1, chunk=1, off=0),
            _rec(b"s", 5, 0, total=25, length=10, sid=2, chunk=2, off=0),
            _rec(b"s", 5, 1, total=25, length=10, sid=2, chunk=2, off=50, ok=False),
            _rec(b"s", 5, 1, total=25, length=10, sid=3, chunk=3, off=0),
            _rec(b"s", 5, 2, total=25, length=5, sid=1, chunk=1, off=40),
            _rec(b"s", 5, 2, total=25, length=5, sid=1, chunk=9, off=0)]  # compaction's copy
    lay = pick_layouts(recs, NOW)[b"s"]
    assert (lay.size, lay.crc) == (25, 99)
    assert lay.extents == (Extent(10, 7, (Replica(1, 1, 0), Replica(2, 2, 0))),
                           Extent(10, 7, (Replica(3, 3, 0),)),
                           Extent(5, 7, (Replica(1, 9, 0),)))
    # the newest write lost an extent (every copy bad): the key is dropped, never an older value
    rep = RebuildReport()
    lost = [r._replace(value_ok=False) if r.extent == 1 else r for r in recs]
    older = _rec(b"s", 4, total=10, length=10, sid=1, chunk=1, off=500)
    assert pick_layouts([older, *lost], NOW, rep) == {}
    assert rep.incomplete == 1 and rep.dropped_keys == [b"s"]


def test_records_that_do_not_know_their_value_are_never_assembled() -> None:
    rep = RebuildReport()
    # a streamed value: each unit its own write, total size unknown (0)
    units = [_rec(b"st", 10 + i, total=0, length=10, off=10 * i) for i in range(3)]
    assert pick_layouts(units, NOW, rep) == {} and rep.incomplete == 1
    clash = [_rec(b"c", 1, sid=1), _rec(b"c", 1, sid=2)._replace(crc=8)]
    assert pick_layouts(clash, NOW) == {}


async def _wait_registered(cluster: LocalCluster, *, with_chunks: bool = True) -> None:
    meta = cluster.meta
    assert meta is not None
    deadline = time.monotonic() + 60
    while len([s for s in meta.index.servers.values()
               if meta.index.alive(s) and (s.chunks or not with_chunks)]) < cluster.n:
        assert time.monotonic() < deadline, "the chunkservers never registered with the rebuilt meta"
        await asyncio.sleep(0.05)


async def test_delete_the_meta_db_rebuild_and_read_every_key_back(tmp_path: Path, local_meta: str) -> None:
    store = local_meta
    async with LocalCluster(tmp_path / "c", 3) as cluster:
        items = {f"p/{i}".encode(): os.urandom(1000 + 37 * i) for i in range(200)}
        items[b"striped"] = os.urandom(3 * (1 << 20) + 12345)
        async with cluster.client() as kv:
            await kv.put_many(items)
            await kv.put(b"twice", b"old" * 1000)
            await kv.put(b"twice", b"new" * 1000)  # newest wins
            await kv.put_many({b"r2": os.urandom(70_000), b"r2big": os.urandom(2_500_000)}, replicas=2)
            await kv.delete_many([b"p/0", b"p/1"])
            await kv.put(b"ttl", b"short", ttl=3600)
            await kv.put(b"tagged", b"with meta", meta={"dtype": "f16"})  # records do not carry it
            expect = {**items, b"twice": b"new" * 1000, b"r2": await kv.get(b"r2"),
                      b"r2big": await kv.get(b"r2big"), b"ttl": b"short", b"tagged": b"with meta"}
            del expect[b"p/0"], expect[b"p/1"]
            before = {k: await kv.layout(k) for k in expect}
        meta = cluster.meta
        assert meta is not None
        cluster_id, live_before = meta.cluster_id, dict(meta.index.chunk_live)
        addrs = [cs.addr for cs in cluster.chunkservers if cs is not None]
        await cluster.stop_meta()
        drop_stores(tmp_path / "c" / "meta")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvfs", "meta", "rebuild", "--data", str(tmp_path / "c" / "meta"),
            "--from-chunkservers", ",".join(addrs), "--store", store,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "KVFS_ADMIN_TOKEN": cluster.admin_token})
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert f"{len(expect)} keys" in out.decode() and "skipped 2 deleted" in out.decode()
        assert " 0 incomplete" in out.decode()
        made = tmp_path / "c" / "meta" / ("meta.rocksdb" if store == "rocksdb" else "meta.sqlite3")
        assert f"rebuilt {made} from" in out.decode()
        await cluster.start_meta()
        assert cluster.meta is not None and cluster.meta.cluster_id == cluster_id
        await _wait_registered(cluster)
        assert dict(cluster.meta.index.chunk_live) == live_before  # live bytes per chunk, as before
        async with cluster.client(ClientConfig(layout_cache_entries=0)) as kv:
            assert await kv.get_many(list(expect)) == list(expect.values())
            assert await kv.get_many([b"p/0", b"p/1"]) == [None, None]
            assert await kv.get_meta([b"tagged"]) == [{}]  # a rebuild loses keys' metadata (README)
            for k, lay in before.items():
                got = await kv.layout(k)
                assert got is not None and lay is not None
                assert (got.size, got.crc) == (lay.size, lay.crc)
                assert [(x.length, x.crc, sorted(x.replicas)) for x in got.extents] == \
                    [(x.length, x.crc, sorted(x.replicas)) for x in lay.extents]


async def test_records_carry_write_id_size_and_index(cluster: LocalCluster) -> None:
    async with cluster.client() as kv:
        value = os.urandom(2 * (1 << 20) + 10)
        await kv.put(b"big", value)
        lay = await kv.layout(b"big")
    assert lay is not None and len(lay.extents) == 3
    seen = []
    for i, x in enumerate(lay.extents):
        rep = x.replicas[0]
        cs = next(c for c in cluster.chunkservers if c and c.server_id == rep.server_id)
        recs = {r.value_offset: r for r in scan_records(cs.store.chunk_path(rep.chunk_id).read_bytes())}
        r = recs[rep.offset]
        assert (r.key, r.index, r.total_size, r.total_crc) == (b"big", i, len(value), lay.crc)
        seen.append(r.write_id)
    assert len(set(seen)) == 1 and seen[0] > 10**18


def test_backup_while_meta_runs(tcluster: object, tmp_path: Path) -> None:
    """``kvfs meta backup`` of the threaded cluster's meta, whichever store it runs: a copy
    that opens and names the cluster; a DEST that exists is refused."""
    data = tcluster.cluster.meta_config.data  # type: ignore[attr-defined]
    kind = held_kind(data)
    dest = tmp_path / "backup"
    assert backup(data, dest).size.endswith(" keys" if kind == "rocksdb" else " pages")
    out = subprocess.run([sys.executable, "-m", "kvfs", "meta", "backup", str(dest), "--data", str(data)],
                         capture_output=True, text=True, check=False)
    new = "directory" if kind == "rocksdb" else "file"
    assert out.returncode == 1 and f"{dest} exists; give a new {new}" in out.stderr
    if kind == "rocksdb":
        shutil.rmtree(dest)
    else:
        dest.unlink()
    out = subprocess.run([sys.executable, "-m", "kvfs", "meta", "backup", str(dest), "--data", str(data)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    if kind == "rocksdb":
        copy = RocksStore(dest, read_only=True)
        try:
            assert copy.stored_cluster_id() == tcluster.cluster.meta.cluster_id  # type: ignore[attr-defined]
        finally:
            copy.close()
        return
    import sqlite3

    db = sqlite3.connect(dest)
    try:
        assert db.execute("SELECT count(*) FROM cluster").fetchone() == (1,)
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        db.close()


@pytest.mark.subprocess
async def test_a_backup_taken_while_puts_go_on_restores_every_key_answered_before_it(
        local_meta: str, proc_cluster: ProcessCluster, tmp_path: Path) -> None:
    """``kvfs meta backup`` of a live meta (SQLite: its online backup; RocksDB: its rows
    copied from a read-only open beside meta's) while a writer keeps putting.  Meta restored from
    it (stopped, its store replaced by the copy) reads back every key answered before the
    backup began, and each of the writer's later keys right or as a miss."""
    data = proc_cluster.data / "meta"
    dest = tmp_path / "backup"
    answered: dict[bytes, bytes] = {}
    async with proc_cluster.client() as kv:
        await until_alive(kv, 3)
        for i in range(4):
            batch = {f"b{i}x{j}".encode(): os.urandom(512) for j in range(64)}
            await kv.put_many(batch)
            answered.update(batch)
        before = set(answered)
        stop = asyncio.Event()
        during = 0

        async def writer() -> None:
            nonlocal during
            while not stop.is_set():
                batch = {f"w{during}x{j}".encode(): os.urandom(512) for j in range(16)}
                await kv.put_many(batch)
                answered.update(batch)
                during += 1

        writing = asyncio.create_task(writer())
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvfs", "meta", "backup", str(dest), "--data", str(data),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            async with asyncio.timeout(120):
                out, err = await proc.communicate()
        finally:
            stop.set()
            await writing
    assert proc.returncode == 0, err.decode()
    name = "meta.rocksdb" if local_meta == "rocksdb" else "meta.sqlite3"
    unit = "keys" if local_meta == "rocksdb" else "pages"
    m = re.fullmatch(rf"backed up {re.escape(str(data / name))} to {re.escape(str(dest))} \((\d+) {unit}\)\n",
                     out.decode())
    assert m is not None, out
    if local_meta == "rocksdb":
        assert len(before) <= int(m[1]) <= len(answered)
    assert during > 0  # the writer put while the backup ran
    assert proc_cluster.meta is not None
    await proc_cluster.meta.stop()
    for p in data.glob(name + "*"):  # (SQLite's -wal and -shm too)
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    dest.rename(data / name)
    await proc_cluster.start_meta(proc_cluster.addr.removeprefix("kvfs://"))
    async with proc_cluster.client() as fresh:
        await until_alive(fresh, 3)
        keys = list(answered)
        got = dict(zip(keys, await fresh.get_many(keys), strict=True))
    assert all(got[k] == answered[k] for k in before)
    assert all(got[k] in (None, answered[k]) for k in keys)


def test_a_backup_of_a_directory_holding_no_meta_store_says_what_it_looked_for(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"^no meta database in {re.escape(str(tmp_path))}: neither "
                                         r"meta\.sqlite3 nor meta\.rocksdb \(a meta on Redis Cluster .*kvfs meta "
                                         r"migrate it to a local store\)$"):
        backup(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_rocksdb_backup_that_cannot_be_written_fails_naming_why_and_leaves_nothing(tmp_path: Path) -> None:
    RocksStore(tmp_path / "meta.rocksdb").close()
    (tmp_path / "file").write_bytes(b"")
    dest = tmp_path / "file" / "backup"  # under a file: no directory can be made there
    with pytest.raises(ServerError, match=rf"^no copy of {re.escape(str(tmp_path / 'meta.rocksdb'))} in 3 tries: "):
        backup(tmp_path, dest)
    assert not dest.exists()


def test_rebuild_refuses_to_overwrite(tmp_path: Path) -> None:
    (tmp_path / "meta.sqlite3").write_bytes(b"")
    with pytest.raises(ValueError, match="exists"):
        asyncio.run(rebuild(tmp_path, ["127.0.0.1:1"], "t"))
    (tmp_path / "r" / "meta.rocksdb").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"meta\.rocksdb exists"):
        asyncio.run(rebuild(tmp_path / "r", ["127.0.0.1:1"], "t", kind="sqlite"))


async def test_a_deleted_key_stays_deleted_after_gc_reclaims_its_tombstones_chunk_and_meta_is_rebuilt(
        tmp_path: Path, local_meta: str) -> None:
    """A delete's tombstone lands in a chunk that the GC reclaims (otherwise all garbage) while
    older records of the key live on in an older chunk too live to compact: the GC copies the
    tombstones forward (meta keeps them), so a rebuild of meta from the chunks does not bring
    the key back, neither with its last bytes nor with an earlier value's (``twice``: its first
    value in the old chunk, its second beside the tombstones)."""
    root = tmp_path / "c"
    async with LocalCluster(root, 1, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, chunk_bytes=256 * 1024)) as cluster:
        keep = {f"keep/{i}".encode(): os.urandom(4000) for i in range(40)}
        junk = [f"junk/{i}".encode() for i in range(5)]
        async with cluster.client() as kv, GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            await kv.put_many({b"victim": b"old bytes" * 100, b"twice": b"first value" * 100})
            await kv.put_many(keep)
            lay = await kv.layout(b"victim")
            assert lay is not None
            (old,) = {r.chunk_id for x in lay.extents for r in x.replicas}
            sid = lay.extents[0].replicas[0].server_id
            assert (await gc.chunkserver(sid, rpc.ChunkSeal(chunk_id=old))).sealed
            await kv.put_many({**{k: os.urandom(2000) for k in junk}, b"twice": b"second value" * 100})
            newer = await kv.layout(b"twice")
            assert newer is not None
            tomb_chunk = newer.extents[0].replicas[0].chunk_id
            assert tomb_chunk != old
            await kv.delete_many([b"victim", b"twice", *junk])
            assert (await gc.chunkserver(sid, rpc.ChunkSeal(chunk_id=tomb_chunk))).sealed
            report = await gc.run_pass(PassOptions(apply=True, grace_s=0))
            assert report.chunks_deleted >= 1
        cs = cluster.chunkservers[0]
        assert cs is not None
        # the scene: the tombstones' chunk is gone, the deleted keys' first records are not
        assert not cs.store.chunk_path(tomb_chunk).exists()
        assert {b"victim", b"twice"} <= {r.key for r in scan_records(cs.store.chunk_path(old).read_bytes())}
        await cluster.stop_meta()
        drop_stores(root / "meta")
        await rebuild(root / "meta", [cs.addr], cluster.admin_token, kind=local_meta)
        await cluster.start_meta()
        await _wait_registered(cluster)
        async with cluster.client(ClientConfig(layout_cache_entries=0)) as kv:
            assert await kv.get_many(list(keep)) == list(keep.values())
            assert await kv.get_many([b"victim", b"twice", junk[0]]) == [None, None, None]


def _disk_view(cluster: LocalCluster) -> dict[bytes, Layout]:
    """What a rebuild of meta would make of the chunk files now (kvfs.meta.rebuild's rule)."""
    found = []
    for cs in cluster.chunkservers:
        assert cs is not None and cs.server_id is not None
        for cid in list(cs.store.sizes):
            for r in scan_records(cs.store.chunk_path(cid).read_bytes()):
                found.append(FoundRecord(r.key, r.write_id, r.index, r.total_size, r.total_crc, r.length,
                                         r.crc, r.expires_at, r.tombstone, r.value_ok, cs.server_id, cid,
                                         r.value_offset))
    return pick_layouts(found, time.time())


def _records_of(cluster: LocalCluster, keys: set[bytes]) -> int:
    n = 0
    for cs in cluster.chunkservers:
        assert cs is not None
        for cid in list(cs.store.sizes):
            n += sum(r.key in keys for r in scan_records(cs.store.chunk_path(cid).read_bytes()))
    return n


async def test_overwrite_delete_and_compact_everything_over_several_passes_never_resurrects(
        tmp_path: Path, local_meta: str) -> None:
    """Keys written, overwritten, deleted (one put again), then GC passes until every chunk
    that held them is compacted or deleted: after every pass the chunks' newest record of each
    key is its current state (what a rebuild would serve: never a deleted key, never an older
    value); the tombstones outlive the old chunks, then go (bounded), and with them every
    record of the deleted keys; a final rebuild of meta agrees."""
    root = tmp_path / "c"
    async with LocalCluster(root, 2, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, chunk_bytes=256 * 1024)) as cluster:
        meta = cluster.meta
        assert meta is not None
        gc_index = meta.index
        assert isinstance(gc_index, MetaIndex)
        churn = [f"churn/{i}".encode() for i in range(12)]
        anchors = {f"anchor/{i}".encode(): os.urandom(4000) for i in range(50)}
        expect: dict[bytes, bytes] = dict(anchors)

        def check() -> None:
            view = _disk_view(cluster)
            assert {k for k in churn if k not in expect}.isdisjoint(view), "a deleted key would come back"
            assert gc_index.tomb_chunks == derived_tomb_chunks(gc_index)  # (compaction's refs read it)
            for k, v in expect.items():
                assert k in view and (view[k].size, view[k].crc) == (len(v), crc32c.crc32c(v)), k

        async with cluster.client() as kv, GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            async def seal_all() -> None:
                for cs in cluster.chunkservers:
                    assert cs is not None and cs.server_id is not None
                    if cs.store.open_chunk is not None:
                        await gc.chunkserver(cs.server_id, rpc.ChunkSeal(chunk_id=cs.store.open_chunk))

            await kv.put_many({**anchors, **{k: b"v1" * 500 for k in churn}})
            await seal_all()  # the anchors' chunks keep the first values, too live to compact
            await kv.put_many({k: b"v2" * 600 for k in churn})
            await seal_all()
            assert await kv.delete_many(churn) == len(churn)
            await kv.put(churn[0], b"v3" * 700)  # put again: its tombstone is forgotten
            expect[churn[0]] = b"v3" * 700
            assert set(gc_index.tombstones) == set(churn[1:])
            await seal_all()
            check()
            for _ in range(3):  # the default threshold: the tombstones' chunks go, the anchors' stay
                await gc.run_pass(PassOptions(apply=True, grace_s=0))
                check()
            assert set(gc_index.tombstones) == set(churn[1:])  # older records outlive them
            assert _records_of(cluster, {k for k in churn[1:]}) > len(churn)
            # the anchors overwritten: every old chunk is garbage now, compacted or deleted
            anchors = {k: os.urandom(3000) for k in anchors}
            await kv.put_many(anchors)
            expect.update(anchors)
            await seal_all()
            for _ in range(6):
                await gc.run_pass(PassOptions(apply=True, grace_s=0, threshold=0.0))
                check()
                if not gc_index.tombstones and not _records_of(cluster, set(churn[1:])):
                    break
            assert not gc_index.tombstones, "the tombstones outlived every older record"
            assert _records_of(cluster, set(churn[1:])) == 0
            assert (await gc.status())["metrics"]["tombstones_dropped"] == len(churn) - 1
            assert await kv.get_many(list(expect)) == list(expect.values())
        await cluster.stop_meta()
        drop_stores(root / "meta")
        await rebuild(root / "meta", [cs.addr for cs in cluster.chunkservers if cs is not None],
                      cluster.admin_token, kind=local_meta)
        await cluster.start_meta()
        await _wait_registered(cluster, with_chunks=False)  # a server may have no chunk left
        async with cluster.client(ClientConfig(layout_cache_entries=0)) as kv:
            assert await kv.get_many(list(expect)) == list(expect.values())
            assert await kv.get_many(churn[1:]) == [None] * (len(churn) - 1)


async def test_a_delete_whose_tombstones_no_chunkserver_takes_fails_and_deletes_nothing(
        tmp_path: Path) -> None:
    root = tmp_path / "c"
    async with LocalCluster(root, 1) as cluster:
        async with cluster.client() as kv:
            await kv.put(b"k", b"value")
            await cluster.stop_chunkserver(0)  # meta still lists it: the APPEND is refused
            with pytest.raises(KVFSError):
                await kv.delete(b"k")
            meta = cluster.meta
            assert meta is not None and isinstance(meta.index, MetaIndex)
            assert b"k" in meta.index.entries and not meta.index.tombstones
            await cluster.start_chunkserver(0)
            await _wait_registered(cluster)
        async with cluster.client() as kv:
            assert await kv.get(b"k") == b"value"
            assert await kv.delete(b"k") is True
            assert await kv.get(b"k") is None


def test_a_tombstone_goes_once_no_chunk_at_or_below_its_horizon_is_left() -> None:
    @dataclass
    class S:
        chunks: dict[int, int]
        open_chunk: int | None = None
        last_heartbeat: float = 10.0

    def c(sid: int, seq: int) -> int:
        return make_chunk_id(sid, seq)

    servers = {1: S({c(1, 3): 1, c(1, 5): 1}, c(1, 6)), 2: S({c(2, 2): 1}), 3: S({}, last_heartbeat=-1e18)}
    h = horizon_now(servers, {2: 4}, started=0.0)
    assert h == {1: 6, 2: 4, 3: None}  # seq_high (a committed layout) counts; 3: not heard from
    t = Tomb(tomb_layout([Replica(1, c(1, 6), 100)], 0.0), h, since=5.0)
    servers = {1: S({c(1, 7): 1}, c(1, 8), 11.0), 2: S({c(2, 5): 1}, None, 11.0),
               3: S({c(3, 9): 1}, None, 11.0)}
    assert not passed(t, floors(servers))  # server 3's horizon is fixed at its highest chunk: 9
    assert t.horizon[3] == 9
    servers[3] = S({c(3, 10): 1}, None, 12.0)
    assert passed(t, floors(servers))
    servers[2] = S({c(2, 4): 1, c(2, 5): 1}, None, 12.0)
    assert not passed(t, floors(servers))
    assert passed(t, floors(servers), compacting=c(2, 4))  # its older records go with it
    servers[2] = S({c(2, 5): 1}, None, 5.0)
    assert not passed(t, floors(servers))  # no chunk table since the delete
    servers[2] = S({c(2, 5): 1}, None, 12.0)
    servers[4] = S({c(4, 1): 1}, None, 12.0)  # registered after the delete: all newer
    assert passed(t, floors(servers))
    assert raise_horizon(t, c(4, 1)) and not passed(t, floors(servers))  # a racing copy there
    assert not raise_horizon(t, c(1, 2))
    assert decode_horizon(encode_horizon(t.horizon)) == t.horizon


async def _lose_meta_and_rebuild(cluster: LocalCluster, now: float, kind: str) -> None:
    """Stop meta, delete its database, rebuild it (a ``kind`` store) from the chunkservers,
    start it again."""
    await cluster.stop_meta()
    drop_stores(cluster.root / "meta")
    await rebuild(cluster.root / "meta", [cs.addr for cs in cluster.chunkservers if cs is not None],
                  cluster.admin_token, now=now, kind=kind)
    await cluster.start_meta()
    await _wait_registered(cluster)


@pytest.mark.parametrize("how", ["expired", "evicted", "put_after_delete", "meta_restarted", "meta_rebuilt",
                                 "put_after_eviction", "put_after_eviction_meta_restarted"])
async def test_a_key_the_gc_drops_never_comes_back_with_an_older_value(tmp_path: Path, how: str,
                                                                       local_meta: str) -> None:
    """``k`` is put (v1, in a chunk kept by live neighbours), overwritten (v2, in a chunk of
    its own; ``put_after_delete``: deleted first, then put again; ``put_after_eviction``:
    evicted first, no tombstone needed then, and put again while v1's record is there), then
    dropped by the GC (its TTL passed, or evicted as the least recently used key;
    ``meta_restarted`` and ``meta_rebuilt``: expired after meta restarted, or was rebuilt,
    since the overwrite; ``..._meta_restarted``: meta restarted after the eviction).
    The GC reclaims v2's chunk while v1's stays; meta's database is lost and rebuilt: ``k``
    is a miss (or v2), never v1."""
    from conftest import FakeClock

    clock = FakeClock()
    root = tmp_path / "c"
    cap = 4 << 20
    async with LocalCluster(root, 1, clock=clock, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2, chunk_bytes=256 * 1024, capacity_bytes=cap)) as cluster:
        keep = {f"keep/{i}".encode(): os.urandom(4000) for i in range(40)}
        v1, v2 = b"first value" * 100, b"second value" * 100
        cs = cluster.chunkservers[0]
        assert cs is not None and cs.server_id is not None
        sid = cs.server_id
        kv = cluster.client()
        kv.clock = clock
        async with kv, GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            async def evict_k() -> None:  # every other key read since: k is the least recently used
                clock.advance(10)
                async with cluster.client() as reader:
                    reader.clock = clock
                    assert await reader.get_many(list(keep)) == list(keep.values())
                await gc.sync_usage()
                (st,) = (await gc.status())["servers"]
                low = (st["live"] - 1) / cap  # a byte short: one key, the least recently used
                r = await gc.run_pass(PassOptions(apply=True, high=low, low=low, expire=False, compact=False))
                assert (r.evicted_keys, r.expired_keys) == (1, 0)

            await kv.put_many({b"k": v1, **keep})
            first = await kv.layout(b"k")
            assert first is not None
            old = first.extents[0].replicas[0].chunk_id
            assert (await gc.chunkserver(sid, rpc.ChunkSeal(chunk_id=old))).sealed
            if how == "put_after_delete":
                assert await kv.delete(b"k") is True
            elif how.startswith("put_after_eviction"):
                await evict_k()
                assert cluster.meta is not None and not cluster.meta.index.tombstones  # (none needed)
                if how.endswith("meta_restarted"):
                    await cluster.stop_meta()
                    await cluster.start_meta()
                    await _wait_registered(cluster)
            clock.advance(10)
            await kv.put(b"k", v2, ttl=None if how == "evicted" else 60)
            second = await kv.layout(b"k")
            assert second is not None
            newer = second.extents[0].replicas[0].chunk_id
            assert newer != old
            assert (await gc.chunkserver(sid, rpc.ChunkSeal(chunk_id=newer))).sealed
            if how == "meta_restarted":
                await cluster.stop_meta()
                await cluster.start_meta()
                await _wait_registered(cluster)
            elif how == "meta_rebuilt":
                await _lose_meta_and_rebuild(cluster, clock.now, local_meta)
            if how == "evicted":
                await evict_k()
            else:
                clock.advance(10)
                clock.advance(61)
                r = await gc.run_pass(PassOptions(apply=True, grace_s=0, evict=False))
                assert (r.evicted_keys, r.expired_keys) == (0, 1)
            meta = cluster.meta
            assert meta is not None and isinstance(meta.index, MetaIndex)
            assert b"k" in meta.index.tombstones and b"k" not in meta.index.older  # dropped with one
            await gc.run_pass(PassOptions(apply=True, grace_s=0, expire=False, evict=False))
            async with cluster.client(ClientConfig(layout_cache_entries=0)) as reader:
                reader.clock = clock
                assert await reader.get(b"k") is None
        # the scene: v2's chunk is gone, v1's record is still there
        assert not cs.store.chunk_path(newer).exists()
        assert b"k" in {r.key for r in scan_records(cs.store.chunk_path(old).read_bytes())}
        await _lose_meta_and_rebuild(cluster, clock.now, local_meta)
        kv = cluster.client(ClientConfig(layout_cache_entries=0))
        kv.clock = clock
        async with kv:
            assert await kv.get_many(list(keep)) == list(keep.values())
            assert await kv.get(b"k") in (None, v2), "an older value came back"


async def test_the_gc_writes_a_tombstone_only_for_keys_whose_older_records_outlive_them(
        tmp_path: Path, local_meta: str) -> None:
    """Expired together: a key never overwritten, one overwritten (its first value without a
    TTL), one overwritten whose first value expired too, one put again after a delete.  Only
    the second and the fourth get a tombstone (the others have no older record a rebuild
    could serve; meta remembers their dropped records until the GC deletes their chunks).
    GC_TOMBSTONE is a compare-and-swap and checks what it is given."""
    from conftest import FakeClock

    clock = FakeClock()
    root = tmp_path / "c"
    async with LocalCluster(root, 2, clock=clock) as cluster:
        meta = cluster.meta
        assert meta is not None and isinstance(meta.index, MetaIndex)
        kv = cluster.client()
        kv.clock = clock
        async with kv, GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            await kv.put_many({b"over": b"o1" * 100, b"readd": b"r1" * 100})
            await kv.put(b"both", b"b1" * 100, ttl=30)
            assert await kv.delete(b"readd") is True
            await kv.put_many({b"fresh": b"f" * 100, b"over": b"o2" * 100, b"both": b"b2" * 100,
                               b"readd": b"r2" * 100}, ttl=60)
            assert dict(meta.index.older.items()) == {b"over": None, b"both": clock.now + 30, b"readd": None}
            await kv.put(b"stays", b"s1" * 100)
            await kv.put(b"stays", b"s2" * 100)  # overwritten, not expired: kept, marked
            clock.advance(61)
            r = await gc.run_pass(PassOptions(apply=True, evict=False, compact=False, repair=False))
            assert r.expired_keys == 4
            assert set(meta.index.tombstones) == {b"over", b"readd"}
            assert dict(meta.index.older.items()) == {b"stays": None}
            assert meta.index.ghosts.records == 2  # fresh's and both's dropped records, one chunk each
            lay = await kv.layout(b"stays")
            assert lay is not None
            first = lay.extents[0].replicas[0]
            tomb = [Replica(first.server_id, first.chunk_id, 0)]  # (a chunk id names its server)
            for items, match in (
                    ([rpc.TombstoneDrop(b"stays", lay, tomb)] * 2, "names a key twice"),
                    ([rpc.TombstoneDrop(b"stays", lay, [Replica(99, 1, 0)])], "unknown chunkserver 99"),
                    ([rpc.TombstoneDrop(b"stays", lay, tomb * 2)], "names one chunkserver twice")):
                with pytest.raises(KVFSError, match=match):
                    await gc.meta(rpc.GcTombstone(items=items, evict=True))
            # not expired: not removed by an expiry's drop; evicted: removed, its tombstone kept
            assert (await gc.meta(rpc.GcTombstone(items=[rpc.TombstoneDrop(b"stays", lay, tomb)]))).keys == 0
            older = msgspec.structs.replace(lay, crc=lay.crc ^ 1)  # a layout it no longer has
            got = await gc.meta(rpc.GcTombstone(items=[rpc.TombstoneDrop(b"stays", older, tomb)], evict=True))
            assert got.keys == 0 and await kv.get(b"stays") == b"s2" * 100
            got = await gc.meta(rpc.GcTombstone(items=[rpc.TombstoneDrop(b"stays", lay, tomb)], evict=True))
            assert (got.keys, got.bytes) == (1, disk_bytes(lay))
            assert b"stays" in meta.index.tombstones and not meta.index.older
            assert (await gc.status())["metrics"]["keys_evicted"] == 1
            for _ in range(3):  # every chunk compacted or deleted: the dropped records are gone
                await gc.run_pass(PassOptions(apply=True, grace_s=0, threshold=0.0))
            assert meta.index.ghosts.records == 0 and not meta.index.ghosts.by_chunk


async def test_a_compaction_copy_of_a_key_dropped_meanwhile_counts_as_a_dropped_record(
        tmp_path: Path, local_meta: str) -> None:
    """A compaction copies ``k``; before its GC_RELOCATE lands, ``k`` expires and the GC drops
    it (no older record: no tombstone).  The copy is a record of ``k`` in the new chunk that
    no layout names: meta remembers it (a ghost) as it does the dropped original, so ``k``
    put again is marked as having an older record (its drop will leave a tombstone).

    The copy's chunk holds no live byte: a pass without a grace period deletes it (and its
    ghost with it) as soon as meta knows the chunk, which a heartbeat may or may not have told
    it before the pass's last plan.  So the pass keeps a grace period the fake clock never
    passes, and meta is told of the chunk (a heartbeat) before the relocate, the order that
    used to race: the copy's chunk is there, known, and kept."""
    from conftest import FakeClock, hold

    from kvfs.rpc import Op

    clock = FakeClock()
    root = tmp_path / "c"
    async with LocalCluster(root, 1, clock=clock, chunkserver=ChunkServerConfig(
            data=root, heartbeat_interval_s=0.2)) as cluster:
        meta = cluster.meta
        assert meta is not None and isinstance(meta.index, MetaIndex)
        kv = cluster.client()
        kv.clock = clock
        async with kv, GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            await kv.put(b"k", b"v" * 1000, ttl=60)
            await kv.put_many({f"junk/{i}".encode(): b"j" * 4000 for i in range(8)}, ttl=30)
            lay = await kv.layout(b"k")
            assert lay is not None
            old = lay.extents[0].replicas[0].chunk_id
            sid = lay.extents[0].replicas[0].server_id
            assert (await gc.chunkserver(sid, rpc.ChunkSeal(chunk_id=old))).sealed
            clock.advance(31)  # the junk expired: k's chunk is mostly garbage
            await gc.run_pass(PassOptions(apply=True, evict=False, compact=False, repair=False))
            relocate = hold(cluster, Op.GC_RELOCATE)
            compacting = asyncio.create_task(gc.run_pass(PassOptions(
                apply=True, grace_s=3600, expire=False, evict=False, repair=False, threshold=0.0)))
            await relocate.reached(compacting)  # k copied into a new chunk, not switched yet
            clock.advance(30)
            assert (await gc.meta(rpc.GcExpire(apply=True))).keys == 1  # k dropped, no tombstone
            await gc.sync_usage()  # a heartbeat: meta knows the copy's chunk (no live byte in it)
            relocate.release()
            await compacting
            new = {c for c in meta.index.ghosts.by_chunk if c != old}
            assert len(new) == 1, meta.index.ghosts.by_chunk  # the copy's chunk
            assert b"k" not in meta.index.tombstones
            await kv.put(b"k", b"w" * 1000)
            assert dict(meta.index.older.items()) == {b"k": None}  # its copy's expiry is not known: never
