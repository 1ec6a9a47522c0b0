"""Meta's WAL checkpoints run in its sync thread, on a second SQLite connection
(``kvfs.meta.store.Checkpointer``), so lookups are answered while one runs; a change is
answered after it; the loop's own connection checkpoints only past the bound
(``LOOP_CHECKPOINT_FRAMES``), so the WAL stays bounded when the thread's checkpoints fail;
after a checkpoint that copied the whole WAL the thread restarts it too, so no write on
the loop rewinds the WAL and syncs its new header; ``--fsync never`` keeps SQLite's
auto-checkpoint on the loop; close leaves no WAL."""

from __future__ import annotations

import asyncio
import re
import shutil
import sqlite3
import subprocess
import sys
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
    # the thread's checkpoint copied the whole WAL, on its own connection, and restarted
    # it: one frame waits, its restart's
    assert ix.store.frames_waiting() == 1
    assert await ix.commit(rows("b", 2), 100.0, None) == []
    await ix.close()  # the sync thread's connection closed, then the loop's: WAL checkpointed, gone
    assert not (tmp_path / "meta.sqlite3-wal").exists()
    db = sqlite3.connect(tmp_path / "meta.sqlite3")
    assert db.execute("SELECT count(*) FROM kv").fetchone()[0] == 5
    db.close()


def wal_generation(wal: Path) -> bytes:
    """The WAL header's checkpoint sequence and salts (https://www.sqlite.org/walformat.html:
    bytes 12-23): each restart of the WAL writes new ones."""
    with open(wal, "rb") as f:
        return f.read(24)[12:]


async def test_the_wal_is_restarted_in_the_sync_thread_never_by_a_write_on_the_loop(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SQLite syncs the WAL's new header in the transaction that restarts the WAL (the first
    # written after a checkpoint that copied all of it); on the loop that sync held lookups
    monkeypatch.setattr(store_mod, "CHECKPOINT_FRAMES", 1)  # every sync's WAL is due
    ix = make_index()
    wal = tmp_path / "meta.sqlite3-wal"
    real = ix.store.put_many
    across: list[tuple[bytes, bytes]] = []

    def put_many(*args: Any) -> None:  # observed: the WAL's generation around the loop's write
        before = wal_generation(wal)
        real(*args)
        across.append((before, wal_generation(wal)))

    monkeypatch.setattr(ix.store, "put_many", put_many)
    generations = {wal_generation(wal)}
    for i in range(20):
        assert await ix.commit(rows(f"k{i}-", 20), 100.0, None) == []
        generations.add(wal_generation(wal))
    assert len(across) == 20
    assert [b for b, a in across if b != a] == []  # no group's write restarted the WAL
    assert ix._wal.checkpoints == 20 and len(generations) >= 20  # the sync thread did, each time
    # the files as a kill -9 leaves them (no -shm): every answered key is recovered
    crash = tmp_path / "crash"
    crash.mkdir()
    for name in ("meta.sqlite3", "meta.sqlite3-wal"):
        shutil.copy(tmp_path / name, crash / name)
    db = sqlite3.connect(crash / "meta.sqlite3")
    assert db.execute("SELECT count(*) FROM kv").fetchone()[0] == 400
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()


# meta's index in a process of its own, every sync's WAL due (a checkpoint and a restart each
# time): its event loop (the main thread) commits 30 groups between two getppid() markers
LOOP_SCRIPT = """
import asyncio, os, sys, time
from pathlib import Path
import kvfs.meta.store as store_mod
from kvfs.config import MetaConfig
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.index import MetaIndex
from kvfs.meta.store import MetaStore
store_mod.CHECKPOINT_FRAMES = 1

async def main():
    d = Path(sys.argv[1])
    ix = MetaIndex(MetaConfig(data=d), MetaStore(d / "meta.sqlite3"), time.time)
    lay = Layout(10, 7, 0.0, None, (Extent(10, 7, (Replica(1, 1 << 40, 0),)),))
    await ix.commit([(b"warm", lay)], 100.0, None)
    os.getppid()
    for i in range(30):
        assert await ix.commit([(f"k{i}-{j}".encode(), lay) for j in range(20)], 100.0, None) == []
    os.getppid()
    print(os.getpid(), ix._wal.checkpoints)
    await ix.close()

asyncio.run(main())
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
def test_meta_loop_thread_makes_no_sync_syscall_across_wal_checkpoints(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    run = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=fdatasync,fsync,getppid",
                          sys.executable, "-c", LOOP_SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    pid, checkpoints = map(int, run.stdout.split())
    assert checkpoints >= 30
    calls = [(int(m[1]), m[2]) for m in re.finditer(r"^(\d+) +(\w+)\(", trace.read_text(), re.M)]
    marks = [i for i, (tid, name) in enumerate(calls) if tid == pid and name == "getppid"]
    assert len(marks) == 2
    between = calls[marks[0] + 1:marks[1]]
    assert [c for c in between if c[0] == pid] == []  # not one fsync/fdatasync on the loop
    assert sum(1 for tid, _ in between if tid != pid) >= 30  # (the sync thread's, seen)


def test_the_restart_is_left_to_the_writer_holding_the_lock(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "CHECKPOINT_FRAMES", 1)
    store = MetaStore(tmp_path / "meta.sqlite3")
    store.put_state("x", 1)
    ckpt = Checkpointer(store)
    wal = tmp_path / "meta.sqlite3-wal"
    before = wal_generation(wal)
    store.db.execute("BEGIN IMMEDIATE")  # a write on the loop in progress: the lock is taken
    ckpt.run_if_due()  # the checkpoint copies the WAL; the restart is not waited for
    assert (ckpt.checkpoints, ckpt.restarts, wal_generation(wal)) == (1, 0, before)
    store.db.execute("INSERT INTO gc_state VALUES ('y', x'00')")
    store.db.execute("COMMIT")  # (it read the WAL from before the checkpoint: appended)
    ckpt.run_if_due()  # the next checkpoint's restart
    assert (ckpt.checkpoints, ckpt.restarts) == (2, 1) and wal_generation(wal) != before
    assert store.get_state("x") == 1 and store.db.execute("SELECT count(*) FROM gc_state").fetchone()[0] == 2
    ckpt.close()
    store.close()


async def test_the_wal_stays_bounded_when_the_threads_checkpoints_fail(
        make_index: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "CHECKPOINT_FRAMES", 1)
    monkeypatch.setattr(store_mod, "LOOP_CHECKPOINT_FRAMES", 8)
    ix = make_index()
    assert autocheckpoint(ix) == 8

    def broken(self: Checkpointer) -> None:
        raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(Checkpointer, "run_if_due", broken)
    seen = []
    for i in range(40):
        assert await ix.commit(rows(f"k{i}-", 20), 100.0, None) == []  # answered: nothing lost
        seen.append(ix.store.frames_waiting())
    assert max(seen) < 8 + 20  # the loop's connection checkpointed past its bound
    assert min(seen[10:]) < max(seen)  # (and did: it fell back)
    assert ix._wal.checkpoints == 0 and len(ix.entries) == 800


async def test_fsync_never_keeps_sqlites_checkpoint_on_the_loop(make_index: Any) -> None:
    ix = make_index(fsync=FsyncMode.NEVER)
    assert autocheckpoint(ix) == 1000 and ix._wal.checkpoints == 0


DMS_PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:  # SQLite's unix VFS: byte 128 of the -shm file (UNIX_SHM_DMS), read-locked by each connection
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 128)
except OSError:
    print("held")
else:
    print("free")
"""


def test_reading_the_wal_index_keeps_sqlites_locks_on_it(tmp_path: Path) -> None:
    """``frames_waiting`` reads the ``-shm`` file through a descriptor kept open until the
    connection closes.  It opened and closed one each time: the close dropped SQLite's POSIX
    locks on the file, so another process's connection (``kvfs meta backup``'s) took the
    wal-index for the only one, truncated it under meta's mapping, and meta died of SIGBUS
    (1 backup test in about 8)."""
    store = MetaStore(tmp_path / "meta.sqlite3")
    try:
        store.put_state("x", 1)
        assert store.frames_waiting() >= 1
        assert store.frames_waiting() >= 1
        out = subprocess.run([sys.executable, "-c", DMS_PROBE, f"{tmp_path / 'meta.sqlite3'}-shm"],
                             capture_output=True, text=True, check=True, timeout=60)
        assert out.stdout.strip() == "held"  # another connection sees this one: no reset
    finally:
        store.close()
