"""Meta's group commit: COMMITs that arrive together share one SQLite transaction (one
sync), each is answered only after that transaction returned, a group is bounded, and one
COMMIT's failure is its own answer, never its neighbours'.

The sync runs in a thread (``MetaStore.sync_wal``), off meta's event loop: lookups are
answered while it runs, a COMMIT only after it returned, a failed one fails its COMMITs
and every later one, a close waits for it; and an answered COMMIT survives SIGKILL.
Every other change (a DELETE, each of GC's changes, a registration, the access-time
flush) is synced the same way (``kvfs.meta.walsync.WalSync``): lookups are answered while
its sync runs, it is answered after it, and after every change written before it."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock
from poll import until_alive

from kvfs import packed
from kvfs.client import AsyncClient
from kvfs.config import FsyncMode, MetaConfig
from kvfs.errors import ServerError, StaleLayout
from kvfs.launcher import LocalCluster, ProcessCluster
from kvfs.layout import Extent, Layout, Replica, make_chunk_id
from kvfs.meta import rocks, tombstones
from kvfs.meta.index import RECORD_OVERHEAD_BYTES, MetaIndex, ServerInfo
from kvfs.meta.localstore import LocalStore, open_local
from kvfs.meta.rocks import RocksStore
from kvfs.meta.store import MetaStore
from kvfs.packed import pack as pack_layouts
from kvfs.packed import unpack as unpack_layouts

Rows = list[tuple[bytes, Layout]]


def rows(tag: str, n: int) -> Rows:
    lay = Layout(10, 7, 0.0, None, (Extent(10, 7, (Replica(1, 1 << 40, 0),)),))
    return [(f"{tag}{i}".encode(), lay) for i in range(n)]


class Spy:
    """Records each ``put_many`` transaction's keys and which commits were answered while it
    ran; ``fail_on`` makes a transaction holding that key raise (a fault, e.g. a disk error)."""

    def __init__(self, store: LocalStore, tasks: list[asyncio.Task[None]], fail_on: bytes | None = None):
        self.real = store.put_many
        self.tasks = tasks
        self.fail_on = fail_on
        self.calls: list[list[bytes]] = []
        self.answered_early = 0

    def __call__(self, batch: Iterable[tuple[bytes, bytes, float | None, float]],
                 older: Iterable[tuple[bytes, float | None]] = (),
                 replaced: Iterable[tuple[bytes, float]] = ()) -> None:
        batch = list(batch)
        keys = [r[0] for r in batch]
        self.calls.append(keys)
        self.answered_early += sum(t.done() for t in self.tasks)
        if self.fail_on in keys:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        self.real(batch, older, replaced)


async def _indexes(tmp_path: Path, clock: FakeClock, kind: str) -> AsyncIterator[Any]:
    made: list[MetaIndex] = []

    def make(**cfg: Any) -> MetaIndex:
        ix = MetaIndex(MetaConfig(data=tmp_path, **cfg), open_local(tmp_path, kind), clock)
        made.append(ix)
        return ix

    yield make
    for ix in made:
        await ix.close()  # (again, for a test that closed it: a no-op) ends its sync thread


@pytest.fixture(params=["rocksdb", pytest.param("sqlite", marks=pytest.mark.meta_sqlite)])
async def make_index(tmp_path: Path, clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """``make_index(**MetaConfig fields)``: a :class:`MetaIndex` over each local store, RocksDB
    (the default) and SQLite (marker ``meta_sqlite``)."""
    async for make in _indexes(tmp_path, clock, request.param):
        yield make


@pytest.fixture
async def make_sqlite_index(tmp_path: Path, clock: FakeClock) -> AsyncIterator[Any]:
    """The same over SQLite only, for what only SQLite has (its PRAGMAs, its WAL file)."""
    async for make in _indexes(tmp_path, clock, "sqlite"):
        yield make


def stored_keys(ix: MetaIndex) -> set[bytes]:
    """What a second open of the store finds (SQLite: a fresh connection; RocksDB: a
    read-only open, which replays the WAL): what was written, not what is cached."""
    path = ix.store.path
    if isinstance(ix.store, RocksStore):
        other = RocksStore(path, read_only=True)
        try:
            return {k for k, _, _, _ in other.rows_after(None, 1 << 30)}
        finally:
            other.close()
    db = sqlite3.connect(path)
    try:
        return {bytes(k) for (k,) in db.execute("SELECT key FROM kv")}
    finally:
        db.close()


async def commit_all(ix: MetaIndex, batches: list[Rows], spy: Spy | None = None,
                     check: Any = None) -> list[BaseException | None]:
    tasks = [asyncio.ensure_future(ix.commit(b, 100.0, None, check)) for b in batches]
    if spy is not None:
        spy.tasks[:] = tasks
    out = await asyncio.gather(*tasks, return_exceptions=True)
    return [o if isinstance(o, BaseException) else None for o in out]


async def test_concurrent_commits_share_one_transaction_answered_after_it(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ix = make_index()
    spy = Spy(ix.store, [])
    monkeypatch.setattr(ix.store, "put_many", spy)
    batches = [rows(t, 5) for t in "abcd"]
    assert await commit_all(ix, batches, spy) == [None] * 4
    assert len(spy.calls) == 1 and ix.commit_groups == 1
    assert spy.calls[0] == [k for b in batches for k, _ in b]  # arrival order
    assert spy.answered_early == 0
    every = {k for b in batches for k, _ in b}
    assert stored_keys(ix) == every
    assert set(ix.entries) == every


async def test_a_group_is_bounded_by_keys_and_bytes_and_a_larger_commit_goes_in_parts(
        make_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ix = make_index(commit_group_max_keys=10)
    spy = Spy(ix.store, [])
    monkeypatch.setattr(ix.store, "put_many", spy)
    assert await commit_all(ix, [rows("a", 6), rows("b", 4), rows("c", 6), rows("d", 25)], spy) == [None] * 4
    assert [len(c) for c in spy.calls] == [10, 6, 10, 10, 5]  # d: parts of the bound, in order
    assert spy.calls[2:] == [[k for k, _ in rows("d", 25)[i:i + 10]] for i in (0, 10, 20)]
    assert stored_keys(ix) == set(ix.entries) == {k for t, n in zip("abcd", (6, 4, 6, 25), strict=True) for k, _ in rows(t, n)}
    await ix.close()  # (RocksDB: one open of a store at a time)

    ix2 = make_index(commit_group_max_bytes=100)  # a row here is 2 key bytes + a 20-byte layout
    spy2 = Spy(ix2.store, [])
    monkeypatch.setattr(ix2.store, "put_many", spy2)
    assert await commit_all(ix2, [rows("e", 3), rows("f", 3), rows("g", 3)], spy2) == [None] * 3
    assert [len(c) for c in spy2.calls] == [3, 3, 3]


async def test_a_commit_in_parts_leaves_the_loop_free_between_them_and_numbers_present_keys_as_sent(
        make_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A COMMIT past ``commit_group_max_keys`` is written a part per group, each synced and
    the loop free between them (another COMMIT arriving meanwhile is written between two
    parts); with ``if_absent`` the indexes of its present keys are those of the whole."""
    ix = make_index(commit_group_max_keys=10)
    assert await ix.commit(rows("d", 30)[12:14] + rows("d", 30)[25:26], 100.0, None) == []
    spy = Spy(ix.store, [])
    monkeypatch.setattr(ix.store, "put_many", spy)
    big = asyncio.ensure_future(ix.commit(rows("d", 30), 100.0, None, if_absent=True))
    for _ in range(100):  # (loop steps until its first part is written: then a COMMIT waits)
        if spy.calls:
            break
        await asyncio.sleep(0)
    assert len(spy.calls) == 1
    small = await ix.commit(rows("x", 2), 100.0, None)
    assert await big == [12, 13, 25] and small == []
    assert [c[0][:1] for c in spy.calls] == [b"d", b"x", b"d", b"d"]  # x between two parts
    assert [len(c) for c in spy.calls] == [10, 2, 8, 9]
    assert ix.commit_syncs >= 4


async def test_a_packed_commit_in_parts_builds_each_parts_layouts_as_it_is_queued(
        make_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed COMMIT past the group bound, unpacked lazily (as meta's COMMIT handler does for
    its local index): each part's keys and layouts are built after the part before was
    written, not all in the first step; what is stored is the whole batch."""
    ix = make_index(commit_group_max_keys=10)
    events: list[tuple[Any, ...]] = []
    spy = Spy(ix.store, [])

    def put_many(batch: Iterable[Any], *rest: Any) -> None:
        spy(batch, *rest)
        events.append(("written", len(spy.calls[-1])))

    built = packed._SingleColumns.rows

    def rows_of(self: Any, keys: list[bytes], i: int, j: int, meta_of: Any) -> Any:
        events.append(("built", i, j))
        return built(self, keys, i, j, meta_of)

    monkeypatch.setattr(ix.store, "put_many", put_many)
    monkeypatch.setattr(packed._SingleColumns, "rows", rows_of)
    want = [(k, Layout(10, 7, 0.0, None, (Extent(10, 7, (Replica(1, (1 << 40) + i, i),)),)))
            for i, (k, _) in enumerate(rows("d", 25))]
    staged = unpack_layouts(pack_layouts([k for k, _ in want], [lay for _, lay in want]), 100.0, None,
                            lazy_over=10).staged
    assert events == []  # checked, nothing built
    assert await ix.commit(staged, 100.0, None, chunks=[]) == []
    assert events == [("built", 0, 10), ("written", 10), ("built", 10, 20), ("written", 10),
                      ("built", 20, 25), ("written", 5)]
    assert {k: ix.entries[k] for k, _ in want} == {k: lay.stamped(100.0, None) for k, lay in want}


async def test_a_part_refused_fails_its_commit_and_the_parts_after_it_are_not_written(
        make_index: Any) -> None:
    ix = make_index(commit_group_max_keys=10)

    def check(staged: Rows) -> None:  # e.g. a chunk of the second part retired meanwhile
        if staged[0][0] == b"d10":
            raise StaleLayout("chunk retired")

    with pytest.raises(StaleLayout, match="chunk retired"):
        await ix.commit(rows("d", 25), 100.0, None, check)
    first = {k for k, _ in rows("d", 10)}
    assert stored_keys(ix) == set(ix.entries) == first  # (a crash may keep a prefix too)
    assert await ix.commit(rows("e", 1), 100.0, None) == []  # the queue goes on
    assert set(ix.entries) == first | {b"e0"}


async def test_fsync_always_writes_each_commit_alone(make_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ix = make_index(fsync=FsyncMode.ALWAYS)
    spy = Spy(ix.store, [])
    monkeypatch.setattr(ix.store, "put_many", spy)
    assert await commit_all(ix, [rows(t, 2) for t in "abc"], spy) == [None] * 3
    assert len(spy.calls) == 3 and spy.answered_early == 1 + 2  # each answered after its own
    assert ix.commit_syncs == 3


async def test_a_commit_refused_when_its_group_is_written_fails_alone(
        make_index: Any, tmp_path: Path) -> None:
    ix = make_index()

    def check(staged: Rows) -> None:  # e.g. its chunk was retired while it waited
        if staged[0][0].startswith(b"b"):
            raise StaleLayout("chunk retired")

    out = await commit_all(ix, [rows("a", 2), rows("b", 2), rows("c", 2)], check=check)
    assert out[0] is None and out[2] is None and isinstance(out[1], StaleLayout)
    assert stored_keys(ix) == {b"a0", b"a1", b"c0", b"c1"}
    assert set(ix.entries) == {b"a0", b"a1", b"c0", b"c1"}


@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_packed_commit_naming_a_retired_chunk_in_any_replica_is_refused(
        make_index: Any, tmp_path: Path, replicas: int) -> None:
    """A packed COMMIT's retired-chunk check looks up its chunk column (``kvfs.packed``), not
    each layout: a retired chunk named by the last replica of one key in the middle of the
    batch refuses that COMMIT (StaleLayout naming that key, nothing of it written), and the
    COMMITs beside it in the group are written; none retired: written."""
    ix = make_index()
    gone = make_chunk_id(replicas, 3)  # on the last replica's server
    assert await ix.retire(replicas, [gone], 100.0) == [gone]  # nothing names it: retired

    def packed(tag: str, bad: int | None) -> tuple[Rows, Collection[int]]:
        keys = [f"{tag}{i}".encode() for i in range(5)]
        reps = [tuple(Replica(1 + r, gone if i == bad and r == replicas - 1 else make_chunk_id(1 + r, 7), 10 * i)
                      for r in range(replicas)) for i in range(5)]
        lays = [Layout(10, 7, 0.0, None, (Extent(10, 7, rs),)) for rs in reps]
        batch = unpack_layouts(pack_layouts(keys, lays), 100.0, None)
        return batch.staged, batch.chunks

    batches = [packed("a", None), packed("b", 2), packed("c", None)]
    out = await asyncio.gather(*(ix.commit(b, 100.0, None, chunks=c) for b, c in batches),
                               return_exceptions=True)
    assert out[0] == [] and out[2] == []
    assert isinstance(out[1], StaleLayout) and "b'b2'" in str(out[1]) and str(gone) in str(out[1])
    keys = {f"{t}{i}".encode() for t in "ac" for i in range(5)}
    assert stored_keys(ix) == keys and set(ix.entries) == keys


async def test_a_failed_shared_transaction_is_retried_one_commit_at_a_time(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ix = make_index()
    spy = Spy(ix.store, [], fail_on=b"b1")
    monkeypatch.setattr(ix.store, "put_many", spy)
    out = await commit_all(ix, [rows("a", 2), rows("b", 2), rows("c", 2)], spy)
    assert out[0] is None and out[2] is None
    assert isinstance(out[1], sqlite3.OperationalError)
    assert [len(c) for c in spy.calls] == [6, 2, 2, 2]
    assert stored_keys(ix) == {b"a0", b"a1", b"c0", b"c1"}
    assert b"b0" not in ix.entries


async def test_the_same_key_twice_in_a_group_keeps_the_later_commit(make_index: Any, tmp_path: Path) -> None:
    ix = make_index()
    first = Layout(10, 1, 0.0, None, (Extent(10, 1, (Replica(1, 1 << 40, 0),)),))
    later = Layout(10, 2, 0.0, None, (Extent(10, 2, (Replica(1, 1 << 40, 64),)),))
    assert await commit_all(ix, [[(b"k", first)], [(b"k", later)]]) == [None, None]
    assert ix.entries[b"k"] == later
    assert ix.chunk_live[1 << 40] == 10 + RECORD_OVERHEAD_BYTES + 1  # only the later one is live
    # a second open of the store (RocksDB: read-only, beside the index's)
    reopened = (RocksStore(ix.store.path, read_only=True) if isinstance(ix.store, RocksStore)
                else MetaStore(ix.store.path))
    try:
        assert [lay for k, lay, _ in reopened.load()] == [later]
    finally:
        reopened.close()


async def test_a_commits_rows_store_its_expiry_and_none_for_keys_without_one(
        make_sqlite_index: Any, tmp_path: Path) -> None:
    """The commit path binds no expiry as NO_EXPIRY, written as NULL (kvfs.meta.store.PUT_KV):
    the GC's expiry query never finds a key without one; in one group with a key that has
    one, each row keeps its own."""
    ix = make_sqlite_index()
    lasting, expiring = rows("l", 2), rows("e", 2)
    done = await asyncio.gather(ix.commit(lasting, 100.0, None), ix.commit(expiring, 100.0, 160.0))
    assert done == [[], []] and ix.commit_groups == 1
    db = sqlite3.connect(tmp_path / "meta.sqlite3")
    try:
        stored = {bytes(k): (typ, e, a) for k, typ, e, a in
                  db.execute("SELECT key, typeof(key), expires_at, last_access FROM kv")}
    finally:
        db.close()
    assert stored == {b"l0": ("blob", None, 100.0), b"l1": ("blob", None, 100.0),
                      b"e0": ("blob", 160.0, 100.0), b"e1": ("blob", 160.0, 100.0)}
    assert ix.store.expired(1e12, 10) == [b"e0", b"e1"] and ix.store.count_expired(1e12) == 2


async def test_a_keys_last_access_is_its_commit_until_read_and_survives_restart_and_relocation(
        make_index: Any) -> None:
    """The index keeps a key's layout alone (no object per key around it): its last access
    (LRU order) is its layout's ``created``, the commit time, until a lookup or touch; a
    commit resets it, a restart reads it back, and a GC relocation (a new layout, maybe
    made at another time) keeps it."""
    def lay(created: float, offset: int = 0) -> Layout:
        return Layout(10, 7, created, None, (Extent(10, 7, (Replica(1, 1 << 40, offset),)),))

    ix = make_index()
    await ix.commit([(b"a", lay(100.0)), (b"b", lay(100.0)), (b"c", lay(100.0))], 100.0, None)
    await ix.lookup([b"b"], 150.0)
    await ix.touch([b"c"], 160.0)
    await ix.commit([(b"c", lay(200.0))], 200.0, None)  # a commit after the read: its time
    assert [ix.last_access(k) for k in (b"a", b"b", b"c")] == [100.0, 150.0, 200.0]
    assert [k for rows in [r async for r in ix.lru_order()] for k, *_ in rows] == [b"a", b"b", b"c"]
    await ix.flush()
    await ix.close()
    ix = make_index()
    ix.load()
    assert [ix.last_access(k) for k in (b"a", b"b", b"c")] == [100.0, 150.0, 200.0]
    assert dict(ix.accessed.items()) == {b"b": 150.0}  # the others' are their layouts' created
    moved = {k: lay(999.0, 64) for k in (b"a", b"b")}
    assert await ix.switch([(k, ix.entries[k], new) for k, new in moved.items()]) == [True, True]
    assert [ix.entries[k] for k in moved] == list(moved.values())
    assert [ix.last_access(k) for k in (b"a", b"b", b"c")] == [100.0, 150.0, 200.0]


async def test_a_ghost_row_is_read_before_it_is_counted_on_only_where_meta_may_hold_one(
        make_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key dropped without a tombstone leaves a ghost row (chunk, key hash, expiry) per
    chunk of its records, counted onto the row already there.  RocksDB reads that row first
    only where meta's Ghosts hold a record in the hash's slot: with none, there is no row to
    read (a read per dropped key was 5.5 % of meta's samples while a full cluster evicted
    small values, bench/RESULTS.md).  The counts after a restart are those of every row read:
    a second record of one (chunk, hash) (a relocated copy), and another key of a held slot,
    count on."""
    monkeypatch.setattr(tombstones, "GHOST_SLOTS", 16)  # (slots shared: some keys collide)
    ix = make_index()
    read: list[bytes] = []
    if isinstance(ix.store, RocksStore):
        real = ix.store._get
        monkeypatch.setattr(ix.store, "_get", lambda keys: read.extend(
            k for k in keys if k.startswith(rocks.GHOSTS)) or real(keys))
    keys = [f"g{i}".encode() for i in range(12)]
    by_slot: dict[int, list[bytes]] = {}
    for k in keys:
        by_slot.setdefault(tombstones.ghost_hash(k) % 16, []).append(k)
    first = [ks[0] for ks in by_slot.values()]  # one key a slot
    rest = [k for ks in by_slot.values() for k in ks[1:]]  # each in a slot one of those holds
    assert rest  # (12 keys, 16 slots: some share one)
    lay = Layout(10, 7, 100.0, None, (Extent(10, 7, (Replica(1, CHUNK, 0),)),))
    await ix.commit([(k, lay) for k in keys], 100.0, None)
    assert len(await ix.evict([(k, ix.entries[k]) for k in first], 100.0)) == len(first)
    assert read == []  # no record held in their slots: written without a read
    assert len(await ix.evict([(k, ix.entries[k]) for k in rest], 100.0)) == len(rest)
    await ix.ghost_copies([(first[0], CHUNK)])  # a copy of a dropped record: its row again
    if isinstance(ix.store, RocksStore):
        assert len(read) == len(rest) + 1  # each of those slots held one: read
    held = sorted((c, h) for c, h, _ in ix.store.load_ghosts())
    expect = sorted([(CHUNK, tombstones.ghost_hash(k)) for k in first + rest + first[:1]])
    assert held == expect
    await ix.close()
    ix = make_index()
    ix.load()
    assert sorted((c, h) for c, h, _ in ix.store.load_ghosts()) == expect
    assert ix.ghosts.records == len(expect)


async def test_if_absent_sees_the_keys_of_earlier_commits_in_its_group(make_index: Any, tmp_path: Path) -> None:
    ix = make_index()
    first = rows("a", 2)
    tasks = [asyncio.ensure_future(ix.commit(first, 100.0, None)),
             asyncio.ensure_future(ix.commit([*rows("a", 3)[1:], *rows("b", 1)], 100.0, None, if_absent=True))]
    assert await asyncio.gather(*tasks) == [[], [0]]  # a1 was written by the first commit
    assert ix.commit_groups == 1
    assert stored_keys(ix) == {b"a0", b"a1", b"a2", b"b0"}
    assert ix.entries[b"a1"] == first[1][1]


class HeldSync:
    """Fault injection for ``MetaStore.sync_wal``: each call waits for :attr:`go`, then syncs
    for real, or raises ``fail``."""

    def __init__(self, store: LocalStore, fail: OSError | None = None) -> None:
        self.real = store.sync_wal
        self.fail = fail
        self.entered = threading.Event()
        self.go = threading.Event()
        self.calls = 0
        self.threads: set[str] = set()

    def __call__(self) -> None:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        self.entered.set()
        if not self.go.wait(60):
            raise TimeoutError("the held sync was never released")
        if self.fail is not None:
            raise self.fail
        self.real()

    async def started(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 60), "no WAL sync started"


@pytest.fixture
def hold() -> Iterator[Callable[..., HeldSync]]:
    """Makes :class:`HeldSync` s and releases them all at teardown (a test that failed while
    one held: the index's or cluster's close, torn down after this, would wait for it)."""
    made: list[HeldSync] = []

    def make(store: LocalStore, fail: OSError | None = None) -> HeldSync:
        made.append(HeldSync(store, fail))
        return made[-1]

    yield make
    for h in made:
        h.go.set()
        h.entered.set()  # (a test that failed before any sync started: its started() returns)


def lay(n: int) -> Layout:
    return Layout(10, n, 0.0, None, (Extent(10, n, (Replica(1, 1 << 40, 0),)),))


async def test_lookups_are_answered_while_a_commit_sync_runs_and_the_commit_waits_for_it(
        make_index: Any, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    ix = make_index()
    held = hold(ix.store)
    monkeypatch.setattr(ix.store, "sync_wal", held)
    first = asyncio.ensure_future(ix.commit(rows("a", 3), 100.0, None))
    await held.started()
    assert held.threads and threading.current_thread().name not in held.threads  # off the loop
    # the loop is free: the written keys are visible to every lookup RPC while the sync runs
    assert [x is not None for x in await ix.lookup([b"a0", b"a2", b"zz"], 100.0)] == [True, True, False]
    assert await ix.exists([b"a1"], 100.0) == [True]
    assert await ix.match_prefix([b"a0", b"a1", b"a2"], 100.0, None) == 3
    assert (await ix.key_stats(100.0))[0] == 3
    later = asyncio.ensure_future(ix.commit(rows("b", 2), 100.0, None))
    await asyncio.sleep(0)  # (one step: its handler queued it)
    assert not first.done() and not later.done()  # neither is answered before a sync covering it
    assert b"b0" not in ix.entries and ix.commit_groups == 1  # no group is written during a sync
    held.go.set()
    assert await first == [] and await later == []
    assert ix.commit_groups == 2 and ix.commit_syncs == 2 and held.calls == 2
    assert {b"b0", b"b1"} <= set(ix.entries)


async def test_a_group_is_written_without_a_sync_and_answered_after_the_wal_is_synced(
        make_sqlite_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ix = make_sqlite_index()
    events: list[str] = []
    real_put, real_fdatasync = ix.store.put_many, os.fdatasync

    def put_many(*args: Any) -> None:
        real_put(*args)
        (level,) = ix.store.db.execute("PRAGMA synchronous").fetchone()  # its transaction's (kept)
        events.append(f"put synchronous={level}")

    def fdatasync(fd: int) -> None:
        events.append(f"fdatasync {os.readlink(f'/proc/self/fd/{fd}')}")
        real_fdatasync(fd)

    monkeypatch.setattr(ix.store, "put_many", put_many)
    monkeypatch.setattr(os, "fdatasync", fdatasync)

    async def commit() -> None:
        await ix.commit(rows("a", 2), 100.0, None)
        events.append("answered")

    await commit()
    wal = tmp_path / "meta.sqlite3-wal"
    assert events == ["put synchronous=1", f"fdatasync {wal}", "answered"]  # NORMAL: no sync of its own
    ix.store.put_state("x", 1)  # a write of the store's own, outside unsynced(): FULL again
    assert ix.store.db.execute("PRAGMA synchronous").fetchone()[0] == 2
    real_delete = ix.store.delete_many

    def delete_many(*args: Any, **kwargs: Any) -> None:
        real_delete(*args, **kwargs)
        events.append(f"delete synchronous={ix.store.db.execute('PRAGMA synchronous').fetchone()[0]}")

    monkeypatch.setattr(ix.store, "delete_many", delete_many)
    assert await ix.delete([b"a0"]) == 1
    events.append("answered")
    # a delete, like every other change, is written unsynced and answered after the WAL's sync
    assert events[-3:] == ["delete synchronous=1", f"fdatasync {wal}", "answered"]


async def test_unsynced_writes_in_a_row_switch_the_level_once_and_other_writes_run_at_full(
        make_sqlite_index: Any) -> None:
    """The connection keeps the level of its last write: commit groups in a row run no
    ``PRAGMA synchronous`` between them; a write outside ``unsynced()`` switches back to
    FULL (its transaction synced at its commit) before it runs."""
    ix = make_sqlite_index()
    traced: list[str] = []
    ix.store.db.set_trace_callback(traced.append)
    for i in range(3):
        await ix.commit(rows(f"g{i}-", 2), 100.0, None)
    switches = [q for q in traced if q.startswith("PRAGMA synchronous=")]
    assert switches == ["PRAGMA synchronous=NORMAL"]  # once, before the first group
    assert sum(q.startswith("INSERT OR REPLACE INTO kv") for q in traced) == 6
    traced.clear()
    ix.store.put_state("x", 1)
    assert [q for q in traced if q.startswith("PRAGMA synchronous=")] == ["PRAGMA synchronous=FULL"]
    assert traced.index("PRAGMA synchronous=FULL") < next(
        i for i, q in enumerate(traced) if q.startswith("INSERT OR REPLACE INTO gc_state"))
    assert ix.store.db.execute("PRAGMA synchronous").fetchone()[0] == 2
    ix.store.db.set_trace_callback(None)


async def test_an_if_absent_commit_that_wrote_nothing_is_answered_at_once(
        make_index: Any, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    ix = make_index()
    await ix.commit(rows("a", 2), 100.0, None)  # answered: synced
    held = hold(ix.store)
    monkeypatch.setattr(ix.store, "sync_wal", held)
    assert await ix.commit(rows("a", 2), 100.0, None, if_absent=True) == [0, 1]  # every key present
    assert held.calls == 0  # nothing written, and every earlier group is durable: no sync to wait for


async def test_a_failed_sync_fails_its_commits_and_meta_refuses_commits_after_it(
        make_index: Any, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    ix = make_index()
    held = hold(ix.store, fail=OSError(errno.EIO, "Input/output error (injected)"))
    monkeypatch.setattr(ix.store, "sync_wal", held)
    assert ix.refusing == ""
    covered = asyncio.ensure_future(ix.commit(rows("a", 2), 100.0, None))
    await held.started()
    queued = asyncio.ensure_future(ix.commit(rows("b", 2), 100.0, None))  # waits for the sync
    await asyncio.sleep(0)
    held.go.set()
    for task in (covered, queued):
        with pytest.raises(ServerError, match=r"fdatasync of .*meta\.(sqlite3-wal|rocksdb)\) failed: .*Input/output"):
            await task
    with pytest.raises(ServerError, match="refuses every commit, delete and GC change until it is restarted"):
        await ix.commit(rows("c", 1), 100.0, None)
    assert held.calls == 1 and b"b0" not in ix.entries and b"c0" not in ix.entries
    assert "Input/output error (injected)" in ix.refusing  # (STATS: kvfs stat prints it)


async def test_close_waits_for_the_sync_in_flight_and_writes_the_queued_commits(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    ix = make_index()
    held = hold(ix.store)
    monkeypatch.setattr(ix.store, "sync_wal", held)
    first = asyncio.ensure_future(ix.commit(rows("a", 2), 100.0, None))
    await held.started()
    queued = asyncio.ensure_future(ix.commit(rows("b", 2), 100.0, None))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(ix.close())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not closing.done() and not first.done()  # waits for the sync, does not drop it
    held.go.set()
    await closing
    assert await first == [] and await queued == []  # the queued one was written and synced too
    assert held.calls == 2
    assert stored_keys(ix) == {b"a0", b"a1", b"b0", b"b1"}
    assert not [t for t in threading.enumerate() if t.name.startswith("kvfs-meta-sync")]  # no thread left


async def test_fsync_never_answers_without_a_sync(make_index: Any, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    ix = make_index(fsync=FsyncMode.NEVER)
    held = hold(ix.store)
    monkeypatch.setattr(ix.store, "sync_wal", held)
    assert await commit_all(ix, [rows("a", 2), rows("b", 2)]) == [None, None]
    assert held.calls == 0 and ix.commit_syncs == 0


# every other change: synced in the same thread, answered after it --------------------------
CHUNK = 1 << 40  # the chunk rows() and lay() name
EMPTY_CHUNK = CHUNK + 5  # a chunk no layout names: retirable


async def _flush(ix: MetaIndex) -> None:
    await ix.touch([b"a1"], 120.0)
    await ix.flush()


CHANGES: dict[str, Callable[[MetaIndex], Awaitable[Any]]] = {
    "delete": lambda ix: ix.delete([b"a0"]),
    "gc expire": lambda ix: ix.expire(200.0, 100),
    "gc evict": lambda ix: ix.evict([(b"a0", ix.entries[b"a0"])], 100.0),
    "gc switch": lambda ix: ix.switch([(b"a0", ix.entries[b"a0"], lay(8))]),
    "gc retire": lambda ix: ix.retire(1, [EMPTY_CHUNK], 100.0),
    "gc ghosts": lambda ix: ix.ghost_copies([(b"gone", CHUNK)]),
    "gc report": lambda ix: ix.add_counts({"passes": 1}, {"last_pass_duration_s": 0.5}),
    "gc state": lambda ix: ix.put_state("paused", True),
    "registration": lambda ix: ix.save_server(ServerInfo(7, "127.0.0.1:7"), registered=True),
    "access flush": _flush,
}


@pytest.mark.parametrize("change", list(CHANGES))
async def test_lookups_are_answered_while_a_change_is_synced_and_the_change_waits_for_it(
        make_index: Any, monkeypatch: pytest.MonkeyPatch, hold: Any, change: str) -> None:
    ix = make_index()
    await ix.commit(rows("a", 3), 100.0, None)
    expiring = Layout(10, 7, 100.0, 150.0, (Extent(10, 7, (Replica(1, CHUNK, 0),)),))
    await ix.commit([(b"e0", expiring)], 100.0, 150.0)  # expired at 200
    held = hold(ix.store)
    monkeypatch.setattr(ix.store, "sync_wal", held)
    task = asyncio.ensure_future(CHANGES[change](ix))
    started = asyncio.ensure_future(held.started())
    await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
    assert not task.done(), f"{change} was answered without waiting for a WAL sync in the sync thread"
    await started
    assert threading.current_thread().name not in held.threads  # off the loop
    # the loop is free: lookups are answered while the change's sync runs
    assert await ix.exists([b"a2", b"zz"], 100.0) == [True, False]
    assert (await ix.lookup([b"a1"], 100.0))[0] is not None
    await asyncio.sleep(0)
    assert not task.done()  # not answered before a sync covering it returned
    held.go.set()
    await task
    assert held.calls == 1


async def test_a_deleted_key_is_a_miss_at_once_and_its_delete_is_answered_once_on_disk(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    ix = make_index()
    await ix.commit(rows("a", 3), 100.0, None)
    held = hold(ix.store)
    monkeypatch.setattr(ix.store, "sync_wal", held)
    deleting = asyncio.ensure_future(ix.delete([b"a0", b"a1"]))
    await held.started()
    assert await ix.exists([b"a0", b"a1", b"a2"], 100.0) == [False, False, True]
    later = [asyncio.ensure_future(ix.delete([b"a2"])), asyncio.ensure_future(ix.commit(rows("b", 1), 100.0, None))]
    await asyncio.sleep(0)
    assert not deleting.done() and not any(t.done() for t in later)
    held.go.set()
    assert await deleting == 2 and await asyncio.gather(*later) == [1, []]
    assert held.calls == 2  # the changes written while the first sync ran shared the next one
    assert stored_keys(ix) == {b"b0"}


async def test_a_change_is_answered_only_once_every_change_before_it_is_durable(
        make_index: Any, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    """A retirement repeated while the first one's sync runs writes nothing, and still
    waits for it: the GC driver unlinks the chunk once it is answered."""
    ix = make_index()
    held = hold(ix.store)
    monkeypatch.setattr(ix.store, "sync_wal", held)
    first = asyncio.ensure_future(ix.retire(1, [EMPTY_CHUNK], 100.0))
    await held.started()
    again = asyncio.ensure_future(ix.retire(1, [EMPTY_CHUNK], 100.0))
    nothing = asyncio.ensure_future(ix.delete([b"absent"]))  # wrote nothing either
    for _ in range(3):
        await asyncio.sleep(0)
    assert not again.done() and not nothing.done()
    held.go.set()
    assert await first == [EMPTY_CHUNK] and await again == [EMPTY_CHUNK] and await nothing == 0
    assert held.calls == 1
    assert await ix.delete([b"absent"]) == 0 and held.calls == 1  # nothing owed: no sync


async def test_a_failed_delete_sync_fails_it_and_meta_refuses_every_change_after_it(
        make_index: Any, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    ix = make_index()
    await ix.commit(rows("a", 3), 100.0, None)
    held = hold(ix.store, fail=OSError(errno.EIO, "Input/output error (injected)"))
    held.go.set()
    monkeypatch.setattr(ix.store, "sync_wal", held)
    with pytest.raises(ServerError, match=r"fdatasync of .*meta\.(sqlite3-wal|rocksdb)\) failed: .*Input/output"):
        await ix.delete([b"a0"])
    refused = "refuses every commit, delete and GC change until it is restarted"
    with pytest.raises(ServerError, match=refused):
        await ix.delete([b"a1"])
    with pytest.raises(ServerError, match=refused):
        await ix.commit(rows("c", 1), 100.0, None)
    with pytest.raises(ServerError, match=refused):
        await ix.retire(1, [EMPTY_CHUNK], 100.0)
    await ix.flush()  # the background flush does not fail: nothing it writes could be durable
    assert held.calls == 1 and b"a1" in ix.entries and EMPTY_CHUNK not in ix.retired


async def test_fsync_never_answers_a_delete_at_once_and_still_syncs_gc_changes(
        make_index: Any, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    ix = make_index(fsync=FsyncMode.NEVER)
    await ix.commit(rows("a", 3), 100.0, None)
    held = hold(ix.store)
    held.go.set()
    monkeypatch.setattr(ix.store, "sync_wal", held)
    assert await ix.delete([b"a0"]) == 1 and held.calls == 0
    assert await ix.retire(1, [EMPTY_CHUNK], 100.0) == [EMPTY_CHUNK] and held.calls == 1
    assert await ix.evict([(b"a1", ix.entries[b"a1"])], 100.0) and held.calls == 2


# through the RPCs: a cluster in this process (real sockets, real SQLite), and meta SIGKILLed --
async def test_a_lookup_rpc_is_answered_while_a_put_waits_for_its_sync(
        cluster: LocalCluster, kv: AsyncClient, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    assert cluster.meta is not None
    held = hold(cluster.meta.store)
    monkeypatch.setattr(cluster.meta.store, "sync_wal", held)
    put = asyncio.create_task(kv.put_many([(b"a", b"x" * 1000), (b"b", b"y" * 1000)]))
    await held.started()
    async with cluster.client() as other:
        assert await other.exists_many([b"a", b"b", b"c"]) == [True, True, False]
        assert await other.get_many([b"a", b"c"]) == [b"x" * 1000, None]  # LOOKUP, then the bytes
        assert not put.done()  # the put is not answered before its commit is on disk
        held.go.set()
        await put
        assert await other.get(b"b") == b"y" * 1000


async def test_meta_builds_a_large_packed_commits_layouts_a_part_at_a_time(
        cluster: LocalCluster, kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put of more keys than a group holds: meta's COMMIT handler unpacks it lazily, and
    its parts' layouts are built one part at a time (here 25 keys, parts of 10)."""
    assert cluster.meta is not None and cluster.meta.local is not None
    ix = cluster.meta.local
    monkeypatch.setattr(ix, "config", replace(ix.config, commit_group_max_keys=10))
    built: list[tuple[int, int]] = []
    rows_of = packed._SingleColumns.rows
    monkeypatch.setattr(packed._SingleColumns, "rows",
                        lambda self, keys, i, j, m: built.append((i, j)) or rows_of(self, keys, i, j, m))
    items = [(b"p%02d" % i, b"v%d" % i * 50) for i in range(25)]
    assert await kv.put_many(items) == [True] * 25
    assert built == [(0, 10), (10, 20), (20, 25)]
    async with cluster.client() as other:
        assert await other.get_many([k for k, _ in items]) == [v for _, v in items]


async def test_a_put_whose_commit_sync_failed_fails(
        cluster: LocalCluster, kv: AsyncClient, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    assert cluster.meta is not None
    held = hold(cluster.meta.store, fail=OSError(errno.EIO, "Input/output error (injected)"))
    held.go.set()
    monkeypatch.setattr(cluster.meta.store, "sync_wal", held)
    with pytest.raises(ServerError, match=r"fdatasync of .* failed"):
        await kv.put(b"a", b"x" * 100)
    with pytest.raises(ServerError, match="until it is restarted"):
        await kv.put(b"b", b"x" * 100)


async def test_a_lookup_rpc_is_answered_while_a_delete_waits_for_its_sync(
        cluster: LocalCluster, kv: AsyncClient, monkeypatch: pytest.MonkeyPatch, hold: Any) -> None:
    assert cluster.meta is not None
    await kv.put_many([(b"a", b"x" * 1000), (b"b", b"y" * 1000)])
    held = hold(cluster.meta.store)
    monkeypatch.setattr(cluster.meta.store, "sync_wal", held)
    deleting = asyncio.create_task(kv.delete_many([b"a"]))
    started = asyncio.ensure_future(held.started())
    await asyncio.wait([deleting, started], return_when=asyncio.FIRST_COMPLETED)
    assert not deleting.done(), "the DELETE was answered without waiting for a WAL sync in the sync thread"
    await started
    async with cluster.client() as other:
        assert await other.exists_many([b"a", b"b"]) == [False, True]
        assert await other.get_many([b"a", b"b"]) == [None, b"y" * 1000]
        assert not deleting.done()  # the delete is not answered before it is on disk
        held.go.set()
        assert await deleting == 1


@pytest.mark.subprocess
async def test_every_answered_put_survives_sigkill_of_meta(meta_backend: str, proc_cluster: ProcessCluster) -> None:
    """Meta is SIGKILLed right after a put is answered (a second put's COMMIT may be in
    flight): after the restart every answered key reads back, on each meta backend."""
    answered: dict[bytes, bytes] = {}
    for round_ in range(2):
        async with proc_cluster.client() as kv:
            await until_alive(kv, 3)  # (after a restart: the chunkservers registered again)
            for i in range(3):
                batch = {f"r{round_}i{i}x{j}".encode(): os.urandom(256) for j in range(64)}
                await kv.put_many(batch)
                answered.update(batch)
            assert proc_cluster.meta is not None
            proc_cluster.meta.kill()  # SIGKILL, at once after the answer
            await proc_cluster.meta.stop()
            await proc_cluster.start_meta(proc_cluster.addr.removeprefix("kvfs://"))
        async with proc_cluster.client() as fresh:
            keys = list(answered)
            assert await fresh.get_many(keys) == [answered[k] for k in keys]
    held = {p.name for p in (proc_cluster.data / "meta").glob("meta.*")}
    assert ("meta.rocksdb" in held) == (meta_backend == "rocksdb")


async def test_close_ends_a_background_loop_whose_step_swallowed_the_cancellation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background step (the access-time flush here; the Redis store's registry read hung
    a teardown so in a final check, its cancellation seen as ``Unavailable``, which the
    loop suppresses) may swallow the cancellation: close() still ends, the loop ending at
    its next look instead of sleeping and stepping for ever."""
    from kvfs.errors import Unavailable
    from kvfs.meta.service import MetaService

    svc = MetaService(MetaConfig(data=tmp_path / "meta", listen="127.0.0.1:0", access_flush_interval_s=0.01))
    stepping = asyncio.Event()
    swallowed = 0

    async def flush() -> None:
        nonlocal swallowed
        stepping.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # (as a Redis call whose timeout expired meanwhile,
            if swallowed:  # once)
                raise
            swallowed += 1
            raise Unavailable("redis: no answer within 5 s") from None

    monkeypatch.setattr(svc.index, "flush", flush)
    await svc.start()
    async with asyncio.timeout(30):
        await stepping.wait()
    closing = asyncio.ensure_future(svc.close())
    try:
        done, _ = await asyncio.wait([closing], timeout=10)
        assert closing in done, "close() did not end: a background loop went on after its cancellation"
    finally:  # (a loop left running ended here: a failure, not a hang)
        for t in svc._bg:
            t.cancel()
        await asyncio.wait([closing], timeout=10)
    assert swallowed == 1 and all(t.done() for t in svc._bg)
