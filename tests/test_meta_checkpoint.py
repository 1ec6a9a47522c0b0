"""Meta's WAL checkpoints run in its sync thread, on a second SQLite connection
(``kvfs.meta.store.Checkpointer``), so lookups are answered while one runs; a change is
answered after it; the loop's own connection checkpoints only past the bound
(``LOOP_CHECKPOINT_FRAMES``), so the WAL stays bounded when the thread's checkpoints fail;
``--fsync never`` keeps SQLite's auto-checkpoint on the loop; close leaves no WAL."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock

import kvfs.meta.store as store_mod
from kvfs.config import FsyncMode, MetaConfig
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.index import MetaIndex
from kvfs.meta.store import Checkpointer, MetaStore


def rows(tag: str, n: int) -> list[tuple[bytes, Layout]]:
    lay = Layout(10, 7, 0.0, None, (Extent(10, 7, (Replica(1, 1 << 40, 0),)),))
    return [(f"{tag}{i}".encode(), lay) for i in range(n)]


@pytest.fixture
async def make_index(tmp_path: Path, clock: FakeClock) -> AsyncIterator[Any]:
    made: list[MetaIndex] = []

    def make(**cfg: Any) -> MetaIndex:
        ix = MetaIndex(MetaConfig(data=tmp_path, **cfg), MetaStore(tmp_path / "meta.sqlite3"), clock)
        made.append(ix)
        return ix

    yield make
    for ix in made:
        await ix.close()


def autocheckpoint(ix: MetaIndex) -> int:
    return int(ix.store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0])


async def test_lookups_are_answered_while_a_checkpoint_runs_in_the_sync_thread(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "CHECKPOINT_FRAMES", 1)  # every sync's WAL is due
    ix = make_index()
    assert autocheckpoint(ix) == store_mod.LOOP_CHECKPOINT_FRAMES  # the loop's: only past the bound
    entered, go = threading.Event(), threading.Event()
    threads: set[str] = set()
    real = Checkpointer.run_if_due

    def held(self: Checkpointer) -> None:  # fault injection: the checkpoint held in the thread
        threads.add(threading.current_thread().name)
        entered.set()
        if not go.wait(60):
            raise TimeoutError("the held checkpoint was never released")
        real(self)

    monkeypatch.setattr(Checkpointer, "run_if_due", held)
    try:
        first = asyncio.ensure_future(ix.commit(rows("a", 3), 100.0, None))
        assert await asyncio.to_thread(entered.wait, 60), "no checkpoint started"
        assert threads and threading.current_thread().name not in threads  # off the loop
        # the loop is free while the checkpoint runs
        assert [x is not None for x in await ix.lookup([b"a0", b"a2", b"zz"], 100.0)] == [True, True, False]
        assert await ix.exists([b"a1"], 100.0) == [True]
        await asyncio.sleep(0)
        assert not first.done()  # its answer waits for the checkpoint (after its sync)
    finally:
        go.set()
    assert await first == []
    assert ix._wal.checkpoints == 1
    # the thread's checkpoint copied the whole WAL, on its own connection
    assert Checkpointer(tmp_path / "meta.sqlite3").frames_waiting() == 0
    assert await ix.commit(rows("b", 2), 100.0, None) == []
    await ix.close()  # the sync thread's connection closed, then the loop's: WAL checkpointed, gone
    assert not (tmp_path / "meta.sqlite3-wal").exists()
    db = sqlite3.connect(tmp_path / "meta.sqlite3")
    assert db.execute("SELECT count(*) FROM kv").fetchone()[0] == 5
    db.close()


async def test_the_wal_stays_bounded_when_the_threads_checkpoints_fail(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "CHECKPOINT_FRAMES", 1)
    monkeypatch.setattr(store_mod, "LOOP_CHECKPOINT_FRAMES", 8)
    ix = make_index()
    assert autocheckpoint(ix) == 8

    def broken(self: Checkpointer) -> None:
        raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(Checkpointer, "run_if_due", broken)
    ckpt = Checkpointer(tmp_path / "meta.sqlite3")
    seen = []
    for i in range(40):
        assert await ix.commit(rows(f"k{i}-", 20), 100.0, None) == []  # answered: nothing lost
        seen.append(ckpt.frames_waiting())
    assert max(seen) < 8 + 20  # the loop's connection checkpointed past its bound
    assert min(seen[10:]) < max(seen)  # (and did: it fell back)
    assert ix._wal.checkpoints == 0 and len(ix.entries) == 800


async def test_fsync_never_keeps_sqlites_checkpoint_on_the_loop(make_index: Any) -> None:
    ix = make_index(fsync=FsyncMode.NEVER)
    assert autocheckpoint(ix) == 1000 and ix._wal.checkpoints == 0
