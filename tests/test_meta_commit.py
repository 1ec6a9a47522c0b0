"""Meta's group commit: COMMITs that arrive together share one SQLite transaction (one
sync), each is answered only after that transaction returned, a group is bounded, and one
COMMIT's failure is its own answer, never its neighbours'."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock

from kvfs.config import FsyncMode, MetaConfig
from kvfs.errors import StaleLayout
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.index import RECORD_OVERHEAD_BYTES, MetaIndex
from kvfs.meta.store import MetaStore

Rows = list[tuple[bytes, Layout]]


def rows(tag: str, n: int) -> Rows:
    lay = Layout(10, 7, 0.0, None, (Extent(10, 7, (Replica(1, 1 << 40, 0),)),))
    return [(f"{tag}{i}".encode(), lay) for i in range(n)]


class Spy:
    """Records each ``put_many`` transaction's keys and which commits were answered while it
    ran; ``fail_on`` makes a transaction holding that key raise (a fault, e.g. a disk error)."""

    def __init__(self, store: MetaStore, tasks: list[asyncio.Task[None]], fail_on: bytes | None = None):
        self.real = store.put_many
        self.tasks = tasks
        self.fail_on = fail_on
        self.calls: list[list[bytes]] = []
        self.answered_early = 0

    def __call__(self, batch: Iterable[tuple[bytes, bytes, float | None, float]],
                 older: Iterable[tuple[bytes, float | None]] = ()) -> None:
        batch = list(batch)
        keys = [r[0] for r in batch]
        self.calls.append(keys)
        self.answered_early += sum(t.done() for t in self.tasks)
        if self.fail_on in keys:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        self.real(batch, older)


@pytest.fixture
def make_index(tmp_path: Path, clock: FakeClock) -> Iterator[Any]:
    made: list[MetaIndex] = []

    def make(**cfg: Any) -> MetaIndex:
        store = MetaStore(tmp_path / "meta.sqlite3")
        ix = MetaIndex(MetaConfig(data=tmp_path, **cfg), store, clock)
        made.append(ix)
        return ix

    yield make
    for ix in made:
        ix.store.close()


def stored_keys(path: Path) -> set[bytes]:
    """What a fresh connection finds in the file: what is durable, not what is cached."""
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
    assert stored_keys(tmp_path / "meta.sqlite3") == every
    assert set(ix.entries) == every


async def test_a_group_is_bounded_by_keys_and_bytes_and_a_larger_commit_goes_alone(
        make_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ix = make_index(commit_group_max_keys=10)
    spy = Spy(ix.store, [])
    monkeypatch.setattr(ix.store, "put_many", spy)
    assert await commit_all(ix, [rows("a", 6), rows("b", 4), rows("c", 6), rows("d", 25)], spy) == [None] * 4
    assert [len(c) for c in spy.calls] == [10, 6, 25]

    ix2 = make_index(commit_group_max_bytes=100)  # a row here is 2 key bytes + a 20-byte layout
    spy2 = Spy(ix2.store, [])
    monkeypatch.setattr(ix2.store, "put_many", spy2)
    assert await commit_all(ix2, [rows("e", 3), rows("f", 3), rows("g", 3)], spy2) == [None] * 3
    assert [len(c) for c in spy2.calls] == [3, 3, 3]


async def test_fsync_always_writes_each_commit_alone(make_index: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ix = make_index(fsync=FsyncMode.ALWAYS)
    spy = Spy(ix.store, [])
    monkeypatch.setattr(ix.store, "put_many", spy)
    assert await commit_all(ix, [rows(t, 2) for t in "abc"], spy) == [None] * 3
    assert len(spy.calls) == 3 and spy.answered_early == 1 + 2  # each answered after its own


async def test_a_commit_refused_when_its_group_is_written_fails_alone(
        make_index: Any, tmp_path: Path) -> None:
    ix = make_index()

    def check(staged: Rows) -> None:  # e.g. its chunk was retired while it waited
        if staged[0][0].startswith(b"b"):
            raise StaleLayout("chunk retired")

    out = await commit_all(ix, [rows("a", 2), rows("b", 2), rows("c", 2)], check=check)
    assert out[0] is None and out[2] is None and isinstance(out[1], StaleLayout)
    assert stored_keys(tmp_path / "meta.sqlite3") == {b"a0", b"a1", b"c0", b"c1"}
    assert set(ix.entries) == {b"a0", b"a1", b"c0", b"c1"}


async def test_a_failed_shared_transaction_is_retried_one_commit_at_a_time(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ix = make_index()
    spy = Spy(ix.store, [], fail_on=b"b1")
    monkeypatch.setattr(ix.store, "put_many", spy)
    out = await commit_all(ix, [rows("a", 2), rows("b", 2), rows("c", 2)], spy)
    assert out[0] is None and out[2] is None
    assert isinstance(out[1], sqlite3.OperationalError)
    assert [len(c) for c in spy.calls] == [6, 2, 2, 2]
    assert stored_keys(tmp_path / "meta.sqlite3") == {b"a0", b"a1", b"c0", b"c1"}
    assert b"b0" not in ix.entries


async def test_the_same_key_twice_in_a_group_keeps_the_later_commit(make_index: Any, tmp_path: Path) -> None:
    ix = make_index()
    first = Layout(10, 1, 0.0, None, (Extent(10, 1, (Replica(1, 1 << 40, 0),)),))
    later = Layout(10, 2, 0.0, None, (Extent(10, 2, (Replica(1, 1 << 40, 64),)),))
    assert await commit_all(ix, [[(b"k", first)], [(b"k", later)]]) == [None, None]
    assert ix.entries[b"k"].layout == later
    assert ix.chunk_live[1 << 40] == 10 + RECORD_OVERHEAD_BYTES + 1  # only the later one is live
    reopened = MetaStore(tmp_path / "meta.sqlite3")
    try:
        assert [lay for k, lay, _ in reopened.load()] == [later]
    finally:
        reopened.close()


async def test_if_absent_sees_the_keys_of_earlier_commits_in_its_group(make_index: Any, tmp_path: Path) -> None:
    ix = make_index()
    first = rows("a", 2)
    tasks = [asyncio.ensure_future(ix.commit(first, 100.0, None)),
             asyncio.ensure_future(ix.commit([*rows("a", 3)[1:], *rows("b", 1)], 100.0, None, if_absent=True))]
    assert await asyncio.gather(*tasks) == [[], [0]]  # a1 was written by the first commit
    assert ix.commit_groups == 1
    assert stored_keys(tmp_path / "meta.sqlite3") == {b"a0", b"a1", b"a2", b"b0"}
    assert ix.entries[b"a1"].layout == first[1][1]
