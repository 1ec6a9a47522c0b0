"""Every local filesystem works (tmpfs refuses RWF_NOWAIT), and a full disk is always NoSpace."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvfs.chunkserver import store as store_mod
from kvfs.config import ClientConfig, MetaConfig
from kvfs.errors import NoSpace, ServerError
from kvfs.launcher import LocalCluster
from kvfs.meta import rocks
from kvfs.meta.rocks import RocksStore


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs) on this machine")
    d = Path(tempfile.mkdtemp(prefix="kvfs-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mnt`` for this test (needs root; skips with the reason
    otherwise)."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {size} tmpfs needs root")
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       capture_output=True, text=True, check=False)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs for the chunkservers."""
    yield from _tmpfs(tmp_path / "small", "64m")


@pytest.fixture
def meta_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs for meta's data directory."""
    yield from _tmpfs(tmp_path / "metafs", "8m")


async def test_a_data_dir_on_tmpfs_serves_reads(shm_dir: Path, tmp_path: Path) -> None:
    items = {f"shm/{i}".encode(): os.urandom(3000 + i) for i in range(50)}
    items[b"big"] = os.urandom(3 << 20)
    meta = MetaConfig(data=tmp_path / "meta", listen="127.0.0.1:0")
    async with LocalCluster(shm_dir, 2, meta=meta) as c, c.client() as kv:
        await kv.put_many(items)
        assert await kv.get_many(list(items)) == list(items.values())


async def test_a_filesystem_refusing_nowait_reads_falls_back(cluster: LocalCluster, kv: object,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What tmpfs does on the kernels that refuse RWF_NOWAIT, injected so every kernel tests it."""
    real = os.preadv
    refused = 0

    def preadv(fd: int, bufs: list[memoryview], offset: int, flags: int = 0) -> int:
        nonlocal refused
        if flags:
            refused += 1
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real(fd, bufs, offset)

    monkeypatch.setattr(store_mod.os, "preadv", preadv)
    for cs in cluster.chunkservers:  # reads with preadv, not from mappings of the chunks
        if cs is not None:
            monkeypatch.setattr(cs.store.maps, "max_maps", 0)
    items = {f"nw/{i}".encode(): os.urandom(5000) for i in range(20)}
    async with cluster.client() as client:
        await client.put_many(items)
        assert await client.get_many(list(items)) == list(items.values())
        assert await client.get_many(list(items)) == list(items.values())
    if store_mod._NOWAIT:
        assert refused >= 1
        # remembered: each store asked once, then reads in its thread pool
        assert refused <= sum(1 for cs in cluster.chunkservers if cs is not None)
        assert all(not cs.store.nowait for cs in cluster.chunkservers if cs and cs.store.spans_read)


async def test_full_disk_under_8_writers_is_always_nospace(small_fs: Path, tmp_path: Path) -> None:
    meta = MetaConfig(data=tmp_path / "meta", listen="127.0.0.1:0")
    value = os.urandom(1 << 20)
    stored: list[bytes] = []
    errors: list[BaseException] = []
    async with LocalCluster(small_fs, 1, meta=meta) as c, c.client(ClientConfig(evict_on_full=False)) as kv:

        async def writer(w: int) -> None:
            for i in range(24):  # 8 x 24 MiB: three times what fits
                key = f"w{w}/{i}".encode()
                try:
                    await kv.put(key, value)
                    stored.append(key)
                except Exception as exc:
                    errors.append(exc)

        await asyncio.gather(*(writer(w) for w in range(8)))
        assert errors, "the 64 MiB filesystem never filled up"
        assert all(isinstance(e, NoSpace) for e in errors), {repr(e)[:200] for e in errors}
        assert stored
        assert await kv.get_many(stored) == [value] * len(stored)


def test_a_rocksdb_store_that_found_its_disk_full_syncs_what_it_wrote_and_reopens_once_there_is_room(
        meta_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RocksDB keeps its writer's error after a full disk (every write and ``FlushWAL``
    fail, even with room).  The store syncs the batches written before by ``fdatasync``,
    refuses writes naming the disk while it is full, falls back to a read-only open when a
    reopen finds no room, and takes writes again once there is room, without a restart."""
    store = RocksStore(meta_fs / "meta.rocksdb", synchronous="NORMAL")
    (meta_fs / "filler").write_bytes(b"\0" * (7 << 20))
    written: list[bytes] = []
    with pytest.raises(OSError) as full, store.unsynced():
        for i in range(1000):
            batch = [b"k%d-%d" % (i, j) for j in range(256)]
            store.put_many((k, b"v" * 64, None, 0.0) for k in batch)
            written += batch
    assert full.value.errno == errno.ENOSPC and written
    assert "writes resume by themselves once its disk has room" in str(full.value)
    store.sync_wal()  # (RocksDB's own: "Writer has previous error")
    with pytest.raises(OSError, match="No space left on device"):  # still full: no reopen tried
        store.put_many([(b"after", b"v", None, 0.0)])
    monkeypatch.setattr(rocks, "NOSPACE_ROOM", -(64 << 20))  # a reopen tried: finds no room
    with pytest.raises(OSError, match="No space left on device"):
        store.put_many([(b"after", b"v", None, 0.0)])
    assert [r[0] for r in store.rows_after(None, len(written) + 1)] == sorted(written)  # read-only
    monkeypatch.setattr(rocks, "NOSPACE_ROOM", 1 << 20)
    monkeypatch.setattr(rocks, "NOSPACE_RETRY_S", 0.0)
    (meta_fs / "filler").unlink()
    store.put_many([(b"after", b"v", None, 0.0)])
    store.sync_wal()
    store.close()
    reopened = RocksStore(meta_fs / "meta.rocksdb")
    try:
        assert [r[0] for r in reopened.rows_after(None, len(written) + 2)] == sorted([*written, b"after"])
    finally:
        reopened.close()


def test_a_sync_that_meets_a_failed_append_learns_its_cause_before_it_answers(meta_fs: Path) -> None:
    """The sync thread's ``FlushWAL`` can fail ("Writer has previous error") before the
    loop has seen why its append failed.  The sync waits for the loop's word: a full disk,
    and it syncs the WAL files itself; any other failure, and it fails (meta then refuses
    changes until restarted)."""
    store = RocksStore(meta_fs / "meta.rocksdb", synchronous="NORMAL")
    (meta_fs / "filler").write_bytes(b"\0" * (7 << 20))
    with pytest.raises(OSError), store.unsynced():
        for i in range(1000):
            store.put_many((b"k%d-%d" % (i, j), b"v" * 64, None, 0.0) for j in range(256))
    opens = store._opens
    for full in (True, False):
        told = _Told()
        store._full, store._failed = -1, told  # (the loop has not said yet)
        outcome: list[BaseException | None] = []
        sync = threading.Thread(target=lambda out=outcome: out.append(_raised(store.sync_wal)))
        sync.start()
        assert told.waiting.wait(10)  # FlushWAL failed, and the sync waits for the loop's word
        assert not outcome
        if full:
            store._full = opens
        told.set()
        sync.join(10)
        assert not sync.is_alive() and len(outcome) == 1
        if full:
            assert outcome[0] is None
        else:
            assert outcome[0] is not None and "previous error" in str(outcome[0])
    store.close()


def test_any_other_io_error_of_a_rocksdb_writer_is_refused_until_a_restart_and_said(tmp_path: Path) -> None:
    """An IO error that is not a full disk (injected: RocksDB's writer failing with EIO) is
    kept by RocksDB until a reopen, and the store tries none: its refusal says a restart is
    needed, and so does ``refusing`` (STATS, ``kvfs stat``)."""
    store = RocksStore(tmp_path / "meta.rocksdb")
    real = store.db

    class Failing:  # (the fault: RocksDB's writer meets an EIO, then keeps its error)
        failed = False

        def write(self, *args: object) -> None:
            if self.failed:
                raise Exception("IO error: Writer has previous error.")
            self.failed = True
            raise Exception("IO error: Input/output error: While appending to file: 000004.log")

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    assert store.refusing == ""
    store.db = Failing()  # type: ignore[assignment]
    with pytest.raises(OSError, match=r"Input/output error.*refuses every write until meta is restarted"):
        store.put_many([(b"k", b"v", None, 0.0)])
    assert "Input/output error" in store.refusing and "until meta is restarted" in store.refusing
    with pytest.raises(OSError, match=r"Input/output error.*until meta is restarted"):  # the cause kept
        store.put_many([(b"k", b"v", None, 0.0)])
    assert "Input/output error" in store.refusing
    store.db = real
    store.close()


class _Told(threading.Event):
    """The store's event for its writer's failure, saying when a sync starts to wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def _raised(fn: Callable[[], object]) -> BaseException | None:
    try:
        fn()
    except Exception as exc:
        return exc
    return None


async def test_a_full_disk_under_a_rocksdb_meta_fails_changes_not_reads_and_writes_resume_once_there_is_room(
        meta_fs: Path, tmp_path: Path) -> None:
    """Meta's own disk full, on RocksDB (the default store): the put that does not fit fails
    naming the disk, reads go on, and once there is room meta takes puts again without a
    restart (RocksDB keeps its writer's error: the store reopens itself).  Restarted, it has
    every key it answered."""
    meta = MetaConfig(data=meta_fs / "meta", listen="127.0.0.1:0", store="rocksdb")
    (meta_fs / "filler").write_bytes(b"\0" * (7 << 20))  # (the disk fills after ~1 MiB of meta)
    answered: list[bytes] = []
    async with LocalCluster(tmp_path / "c", 1, meta=meta) as c, c.client() as kv:
        for i in range(1000):  # (~1 MiB of WAL is ~40 batches of 256 keys)
            batch = [b"k%d-%d" % (i, j) for j in range(256)]
            try:
                await kv.put_many({k: b"v%d" % i for k in batch})
            except ServerError as exc:
                assert "No space left on device" in str(exc)
                break
            answered += batch
        else:
            raise AssertionError("8 MiB never filled up")
        assert answered
        assert await kv.get_many([answered[0], answered[-1]]) == [b"v0", b"v%d" % (i - 1)]
        with pytest.raises(ServerError, match="writes resume by themselves once its disk has room"):
            await kv.put(b"after", b"x")
        st = await kv.stats()  # (kvfs stat prints it)
        assert "No space left on device" in st["refusing"] and st["store_free"] < 1 << 20
        (meta_fs / "filler").unlink()
        await kv.put(b"after", b"x")
        assert await kv.get(b"after") == b"x"
        st = await kv.stats()
        assert st["refusing"] == "" and st["store_free"] > 6 << 20
    async with LocalCluster(tmp_path / "c", 1, meta=meta) as c, c.client() as kv:
        assert c.meta is not None and {*answered, b"after"} <= set(c.meta.index.entries)
        assert await kv.get_many([answered[0], answered[-1], b"after"]) == [b"v0", b"v%d" % (i - 1), b"x"]
