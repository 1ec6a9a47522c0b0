"""The two stores meta keeps every key in memory over (kvfs.meta.localstore): SQLite and
RocksDB answer each call alike, and survive a reopen; a data directory holding one is
refused as the other."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvfs.config import MetaConfig
from kvfs.errors import InvalidArgument
from kvfs.launcher import LocalCluster
from kvfs.layout import Extent, Layout, Replica, encode_layout
from kvfs.meta.localstore import LocalStore, chosen_kind, open_local
from kvfs.meta.migrate import migrate
from kvfs.meta.rocks import RocksStore, expiry_key, expiry_of


def lay(chunk: int, created: float = 10.0, expires: float | None = None) -> Layout:
    return Layout(size=3, crc=0, created=created, expires_at=expires,
                  extents=(Extent(length=3, crc=0, replicas=(Replica(chunk >> 40, chunk, 0),)),))


@pytest.fixture(params=["sqlite", "rocksdb"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(tmp_path: Path, kind: str) -> Iterator[LocalStore]:
    s = open_local(tmp_path / "meta", kind)
    try:
        yield s
    finally:
        s.close()


def reopen(s: LocalStore, tmp_path: Path, kind: str) -> LocalStore:
    s.close()
    return open_local(tmp_path / "meta", kind)


def row(key: bytes, layout: Layout, access: float | None = None) -> tuple[bytes, bytes, float | None, float]:
    return key, encode_layout(layout), layout.expires_at, layout.created if access is None else access


def test_rows_load_list_and_page_in_key_order_after_a_reopen(store: LocalStore, tmp_path: Path, kind: str) -> None:
    rows = {b"b/2": lay(1 << 40 | 1), b"a/1": lay(1 << 40 | 2, 11.0, 500.0), b"b/1": lay(2 << 40 | 3, 12.0)}
    store.put_many([row(k, v) for k, v in rows.items()], [(b"a/1", None)])
    store.put_many([(bytearray(b"c"), bytearray(encode_layout(lay(5, 13.0))), -1.0, 99.0)])  # (the commit's form)
    store.touch_many([(50.0, b"b/2"), (1.0, b"a/1"), (60.0, b"nope")])
    s = reopen(store, tmp_path, kind)
    try:
        got = {k: (v, a) for k, v, a in s.load()}
        assert got == {b"a/1": (rows[b"a/1"], 11.0), b"b/1": (rows[b"b/1"], 12.0),
                       b"b/2": (rows[b"b/2"], 50.0), b"c": (lay(5, 13.0), 99.0)}
        assert [k for k, _ in s.list(b"b/", None, 10)] == [b"b/1", b"b/2"]
        assert [k for k, _ in s.list(b"b/", b"b/1", 10)] == [b"b/2"]
        assert [k for k, _ in s.list(b"", None, 2)] == [b"a/1", b"b/1"]
        assert s.list(b"", None, 0) == []
        page = s.rows_after(b"a/1", 2)
        assert [(k, e, a) for k, _, e, a in page] == [(b"b/1", None, 12.0), (b"b/2", None, 50.0)]
        assert [k for k, *_ in s.rows_after(None, 1)] == [b"a/1"]
        assert s.rows_after(b"c", 5) == []
        assert dict(s.load_older()) == {b"a/1": None}
    finally:
        s.close()


def test_expired_keys_oldest_first_an_overwrite_and_a_delete_leave_no_wrong_entry(store: LocalStore) -> None:
    store.put_many([row(b"k1", lay(1, expires=30.0)), row(b"k2", lay(2, expires=20.0)),
                    row(b"k3", lay(3, expires=40.0)), row(b"k4", lay(4))])
    store.put_many([row(b"k3", lay(3, expires=10.0))])  # its expiry now earlier
    store.put_many([row(b"k1", lay(1, expires=900.0))])  # now later
    store.delete_many([b"k2"])
    assert store.expired(35.0, 10) == [b"k3"]
    assert store.expired_after(35.0, 10, None) == [(10.0, b"k3")]
    assert store.count_expired(1000.0) == 2
    assert store.expired(1000.0, 1) == [b"k3"]
    assert store.expired_after(1000.0, 1, (10.0, b"k3")) == [(900.0, b"k1")]
    assert store.expired(5.0, 10) == []
    store.delete_many([b"k3", b"k1"])
    assert store.expired(1000.0, 10) == [] and store.count_expired(1000.0) == 0


def test_tombstones_ghosts_servers_dead_chunks_and_state_after_a_reopen(store: LocalStore, tmp_path: Path,
                                                                      kind: str) -> None:
    store.put_many([row(b"x", lay(1)), row(b"y", lay(2))], [(b"x", 5.0), (b"y", 6.0)])
    store.delete_many([b"x", b"y"], [(b"x", encode_layout(lay(7)), b"\x80")], [b"x"],
                      [(3, 99, None), (3, 99, 8.0), (4, 98, 9.0)])
    store.put_ghosts([(3, 99, 7.0), (5, 97, 1.0)])
    store.forget_ghosts([5])
    store.put_tombstones([(b"z", encode_layout(lay(8)), b"\x81")])
    store.forget_tombstones([b"z"])
    store.put_server(2, "127.0.0.1:1", 100, 50)
    store.put_server(1, "127.0.0.1:2", 10, 5)
    store.delete_server(2)
    store.add_dead([(70, 1, 3.0)])
    store.add_dead([(70, 1, 4.0), (71, 1, 4.5)])
    store.put_state("metrics", {"a": 1.5})
    cid = store.cluster_id(create="abc")
    s = reopen(store, tmp_path, kind)
    try:
        assert list(s.load()) == []
        assert [(k, lay_, h) for k, lay_, h in s.load_tombstones()] == [(b"x", lay(7), b"\x80")]
        assert dict(s.load_older()) == {b"y": 6.0}
        ghosts = sorted(s.load_ghosts(), key=lambda r: (r[0], r[1], r[2] is None, r[2] or 0))
        # (the same count per (chunk, hash), and the latest expiry, as Ghosts keeps)
        assert [(c, h) for c, h, _ in ghosts] == [(3, 99)] * 3 + [(4, 98)]
        assert max((u for c, _, u in ghosts if c == 4), key=lambda u: u or 0) == 9.0
        assert s.load_servers() == [(1, "127.0.0.1:2", 10, 5)]
        assert sorted(s.load_dead()) == [(70, 1, 3.0), (71, 1, 4.5)]
        assert s.get_state("metrics") == {"a": 1.5} and s.get_state("none") is None
        assert s.all_state() == {"metrics": {"a": 1.5}}
        assert cid == "abc" and s.cluster_id() == "abc" and s.cluster_id(create="other") == "abc"
    finally:
        s.close()


def test_unsynced_writes_are_durable_once_synced(store: LocalStore, tmp_path: Path, kind: str) -> None:
    with store.unsynced():
        store.put_many([row(b"k", lay(1))])
    store.sync_wal()
    s = reopen(store, tmp_path, kind)
    try:
        assert [k for k, _, _ in s.load()] == [b"k"]
    finally:
        s.close()


def test_a_data_directory_holding_one_store_is_refused_as_the_other(tmp_path: Path) -> None:
    open_local(tmp_path / "a", "sqlite").close()
    with pytest.raises(InvalidArgument, match=r"meta\.sqlite3 holds this meta's index in sqlite, not rocksdb.*"
                                              r"kvfs meta migrate --from sqlite:"):
        open_local(tmp_path / "a", "rocksdb")
    open_local(tmp_path / "b", "rocksdb").close()
    with pytest.raises(InvalidArgument, match=r"meta\.rocksdb holds this meta's index in rocksdb, not sqlite"):
        open_local(tmp_path / "b", "sqlite")
    with pytest.raises(InvalidArgument, match="unknown local store 'lmdb'"):
        open_local(tmp_path / "c", "lmdb")


def test_expiry_keys_sort_as_their_numbers() -> None:
    xs = [-5.0, -1.0, -0.5, 0.0, 1e-9, 0.5, 1.0, 1e9, 1.7e9, 1.7e9 + 0.001, 1e300]
    keys = [expiry_key(x) for x in xs]
    assert keys == sorted(keys)
    assert [expiry_of(k, 0) for k in keys] == xs


async def test_a_sqlite_index_moves_to_rocksdb_a_meta_there_serves_it_and_it_moves_back(tmp_path: Path) -> None:
    """kvfs meta migrate between the two local stores; then a meta --store rocksdb on the
    target, with the same chunkservers, reads every key back, and lists them in order."""
    root = tmp_path / "c"
    plain = {b"p/%03d" % i: b"v%d|" % i * (1 + i % 5) for i in range(60)}
    ttl = {b"t/%03d" % i: b"t%d" % i for i in range(10)}
    on_sqlite = MetaConfig(data=root / "meta", listen="127.0.0.1:0", store="sqlite")
    async with LocalCluster(root, 1, meta=on_sqlite) as c, c.client() as kv:
        await kv.put_many(list(plain.items()))
        await kv.put_many(list(ttl.items()), ttl=3600)
        await kv.put_many([(b"gone", b"1"), (b"twice", b"1")])
        await kv.put(b"twice", b"2")  # an older record
        await kv.delete_many([b"gone"])  # a tombstone kept
        layouts = await kv.lookup(list(ttl), use_cache=False)
        cid = c.meta.cluster_id if c.meta else ""
    src = open_local(root / "meta", "sqlite")
    rows = {k: (b, e, a) for k, b, e, a in src.rows_after(None, 1000)}
    kept = (list(src.load_tombstones()), dict(src.load_older()))
    assert [k for k, _, _ in kept[0]] == [b"gone"] and kept[1] == {b"twice": None}
    src.close()
    rep = await migrate(f"sqlite:{root / 'meta'}", f"rocksdb:{root / 'meta-rocks'}", batch=16)
    assert (rep.keys, rep.cluster_id, rep.servers, rep.kept) == (71, cid, 1, 2)
    dst = open_local(root / "meta-rocks", "rocksdb")
    try:  # the tombstones and older records as they were, not every key marked
        assert (list(dst.load_tombstones()), dict(dst.load_older())) == kept
    finally:
        dst.close()
    with pytest.raises(InvalidArgument, match="already holds the finished migration"):
        await migrate(f"sqlite:{root / 'meta'}", f"rocksdb:{root / 'meta-rocks'}")

    meta = MetaConfig(data=root / "meta-rocks", listen="127.0.0.1:0", store="rocksdb")
    async with LocalCluster(root, 1, meta=meta) as c2, c2.client() as kv:
        assert await kv.get_many(list(plain)) == list(plain.values())
        assert await kv.get_many(list(ttl)) == list(ttl.values())
        assert await kv.lookup(list(ttl), use_cache=False) == layouts
        assert [e.key for e in await kv.list(b"")] == sorted([*plain, *ttl, b"twice"])
        assert await kv.get_many([b"gone", b"twice"]) == [None, b"2"]

    rep = await migrate(f"rocksdb:{root / 'meta-rocks'}", f"sqlite:{tmp_path / 'back'}")
    assert (rep.keys, rep.kept) == (71, 2)
    back = open_local(tmp_path / "back", "sqlite")
    try:
        assert {k: (b, e) for k, b, e, _ in back.rows_after(None, 1000)} == {k: (b, e) for k, (b, e, _) in rows.items()}
        assert back.cluster_id() == cid
    finally:
        back.close()


def test_without_rocksdict_the_store_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfs.meta import rocks

    monkeypatch.setattr(rocks, "HAVE_ROCKSDICT", False)  # fault injection: installed with --no-deps
    with pytest.raises(ValueError, match=r"needs rocksdict, a dependency of kvfs missing here .*: pip "
                                         r"install rocksdict, or run meta with --store sqlite"):
        open_local(tmp_path / "m", "rocksdb")
    assert not (tmp_path / "m" / "meta.rocksdb").exists()


async def test_meta_with_no_store_opens_the_kind_its_directory_holds_and_a_new_one_gets_rocksdb(
        tmp_path: Path) -> None:
    """The default ``--store``: a directory made by a SQLite meta (an earlier kvfs's default)
    is served from its SQLite file, keys and all; a new directory gets RocksDB; a directory
    holding both is refused until ``--store`` picks one."""
    root = tmp_path / "c"
    cfg = MetaConfig(data=root / "meta", listen="127.0.0.1:0")
    async with LocalCluster(root, 1, meta=replace(cfg, store="sqlite")) as c, c.client() as kv:
        await kv.put(b"old", b"kept")
    async with LocalCluster(root, 1, meta=cfg) as c, c.client() as kv:
        assert c.meta is not None and c.meta.store_kind == "sqlite"
        assert await kv.get(b"old") == b"kept"
    assert not (root / "meta" / "meta.rocksdb").exists()
    assert chosen_kind(tmp_path / "new", None) == "rocksdb"
    RocksStore(root / "meta" / "meta.rocksdb").close()  # the other kind beside it (by hand)
    with pytest.raises(InvalidArgument, match=r"holds two meta stores, meta.sqlite3 and meta.rocksdb: "
                                              r"start meta with --store sqlite or --store rocksdb"):
        chosen_kind(root / "meta", None)
    async with LocalCluster(root, 1, meta=replace(cfg, store="sqlite")) as c, c.client() as kv:
        assert await kv.get(b"old") == b"kept"  # asked for: the other is left alone


def test_rocksdb_expiry_entries_left_by_an_overwrite_or_a_delete_go_in_the_gc_sweep(tmp_path: Path) -> None:
    """RocksDB's expiry index is not rewritten on an overwrite or a delete: each such entry is
    skipped by every read, and the GC's sweep (``expired``) deletes it once its time passed."""
    from kvfs.meta.rocks import EXP

    s = open_local(tmp_path / "m", "rocksdb")
    assert isinstance(s, RocksStore)
    try:
        def entries() -> int:
            return sum(1 for _ in s._prefixed(EXP))

        s.put_many([row(b"a", lay(1, expires=10.0)), row(b"b", lay(2, expires=11.0))])
        s.put_many([row(b"a", lay(1, expires=30.0))])
        s.delete_many([b"b"])
        assert entries() == 3
        assert s.expired_after(20.0, 10, None) == [] and s.count_expired(20.0) == 0 and entries() == 3
        assert s.expired(20.0, 10) == [] and entries() == 1  # the two passed stale ones went
        assert s.expired(40.0, 10) == [b"a"]
    finally:
        s.close()


async def test_a_rocksdb_meta_leaves_no_expiry_entry_for_the_rows_it_replaces_or_deletes(tmp_path: Path) -> None:
    """Meta names the expiries its writes replace, so overwrites at another TTL (or none)
    and deletes leave no stale entry in RocksDB's expiry index: one entry per key that
    expires.  (Before, each entry stayed until its time passed and the GC's sweep ran: here
    151 entries for 30 keys.)"""
    from kvfs.meta.rocks import EXP

    root = tmp_path / "c"
    meta = MetaConfig(data=root / "meta", listen="127.0.0.1:0", store="rocksdb")
    async with LocalCluster(root, 1, meta=meta) as c:
        assert c.meta is not None
        store = c.meta.index.store
        assert isinstance(store, RocksStore)
        keys = [b"k%02d" % i for i in range(50)]
        async with c.client() as kv:
            for ttl in (100.0, 200.0, 300.0):
                await kv.put_many([(k, b"x") for k in keys], ttl=ttl)
            await kv.put_many([(k, b"y") for k in keys[:10]])  # no expiry now
            await kv.delete_many(keys[10:20])
            await kv.put(keys[20], b"z", ttl=300.0)  # the same expiry or a later one: one entry
            expiring = [e.key for e in await kv.list(b"k") if e.expires_at is not None]
        assert expiring == keys[20:]
        assert sorted(k[8:] for k, _ in store._prefixed(EXP)) == keys[20:]


async def test_a_group_that_puts_a_key_twice_leaves_one_expiry_entry_for_it(tmp_path: Path) -> None:
    """Three COMMITs written as one group put a at 200, then 300, then 200 again, and b at
    200 (both were at 100): RocksDB's expiry index holds a's and b's last expiries only,
    the 200 of a's last row kept although an earlier row's was the same entry."""
    from kvfs.meta.index import MetaIndex
    from kvfs.meta.rocks import EXP

    store = open_local(tmp_path / "m", "rocksdb")
    ix = MetaIndex(MetaConfig(data=tmp_path / "m"), store, lambda: 10.0)
    try:
        def at(exp: float, *keys: bytes) -> list[tuple[bytes, Layout]]:
            return [(k, lay(1 << 40 | 1, expires=exp)) for k in keys]

        await ix.commit(at(100.0, b"a", b"b"), 10.0, 100.0)
        groups = ix.commit_groups
        await asyncio.gather(ix.commit(at(200.0, b"a", b"b"), 10.0, 200.0),
                             ix.commit(at(300.0, b"a"), 10.0, 300.0),
                             ix.commit(at(200.0, b"a"), 10.0, 200.0))
        assert ix.commit_groups == groups + 1  # one group
        assert sorted((expiry_of(k, 0), k[8:]) for k, _ in store._prefixed(EXP)) == [(200.0, b"a"), (200.0, b"b")]
        assert store.expired(250.0, 10) == [b"a", b"b"]
    finally:
        await ix.close()
