"""Which store a meta data directory holds its index in, when meta keeps every key in memory
(:class:`kvfs.meta.index.MetaIndex`): RocksDB (``meta.rocksdb/``, what a new directory gets)
or SQLite (``meta.sqlite3``, ``--store sqlite``; the default before RocksDB).  Both have the
same calls (:class:`kvfs.meta.store.MetaStore`, :class:`kvfs.meta.rocks.RocksStore`).  Meta
started with no ``--store`` opens the one its directory holds.  A directory holds one:
opened as the other, it is refused (an empty index would serve every key as a miss), naming
``kvfs meta migrate``."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from kvfs.config import LOCAL_STORES
from kvfs.datadir import create_private_file, private_dir
from kvfs.errors import InvalidArgument
from kvfs.meta.rocks import RocksStore
from kvfs.meta.store import MetaStore

SQLITE_NAME = "meta.sqlite3"
ROCKSDB_NAME = "meta.rocksdb"
KINDS = LOCAL_STORES
NEW_KIND = KINDS[0]  # what a directory that holds no store yet gets, unless asked otherwise
LocalStore = MetaStore | RocksStore


def held_kind(data: Path) -> str | None:
    """The kind of store ``data`` holds (None: neither yet)."""
    if (data / ROCKSDB_NAME).exists():
        return "rocksdb"
    if (data / SQLITE_NAME).exists():
        return "sqlite"
    return None


def chosen_kind(data: Path, asked: str | None) -> str:
    """The kind of store meta opens in ``data``: the one ``asked`` for (``--store``), else
    the one ``data`` holds, else :data:`NEW_KIND`.  A directory holding both is refused
    unless one is asked for: which one serves the keys is the operator's call."""
    if asked is not None:
        return asked
    if all(store_path(data, k).exists() for k in KINDS):
        raise InvalidArgument(
            f"{data} holds two meta stores, {SQLITE_NAME} and {ROCKSDB_NAME}: start meta with "
            "--store sqlite or --store rocksdb (kvfs up: --meta-store; the other is left alone), "
            "or move one away")
    return held_kind(data) or NEW_KIND


def store_path(data: Path, kind: str) -> Path:
    return data / (ROCKSDB_NAME if kind == "rocksdb" else SQLITE_NAME)


def drop_stores(data: Path) -> None:
    """Lose the index ``data`` holds, whichever kind (SQLite's file with its WAL and shared
    memory, RocksDB's directory): a meta whose database was lost, for the tests and the
    reliability bench."""
    for p in data.glob(SQLITE_NAME + "*"):
        p.unlink()
    shutil.rmtree(data / ROCKSDB_NAME, ignore_errors=True)


def store_bytes(data: Path, kind: str) -> int:
    """The bytes the ``kind`` store in ``data`` holds on disk: SQLite's file with its WAL and
    shared memory, or every file of the RocksDB directory (RocksDB's info log included)."""
    path = store_path(data, kind)
    files = (path.rglob("*") if kind == "rocksdb"
             else (path.with_name(path.name + s) for s in ("", "-wal", "-shm")))
    total = 0
    for f in files:
        with contextlib.suppress(OSError):  # (gone meanwhile: compacted, checkpointed)
            if f.is_file():
                total += f.stat().st_size
    return total


def open_local(data: Path, kind: str, *, synchronous: str = "FULL",
               memtable_bytes: int = 64 << 20) -> LocalStore:
    """The ``kind`` store in ``data`` (created if ``data`` holds none), refused if ``data``
    holds only the other kind (``memtable_bytes``: RocksDB's, ``--rocksdb-memtable``)."""
    if kind not in KINDS:
        raise InvalidArgument(f"unknown local store {kind!r}: expected one of {', '.join(KINDS)}")
    held = held_kind(data)
    if held is not None and not store_path(data, kind).exists():
        raise InvalidArgument(
            f"{store_path(data, held)} holds this meta's index in {held}, not {kind}: start meta "
            f"with --store {held} (or no --store), or move the index "
            f"with kvfs meta migrate --from {held}:{data} --to {kind}:NEW_DIR")
    private_dir(data)
    if kind == "rocksdb":
        return RocksStore(store_path(data, kind), synchronous=synchronous, write_buffer_bytes=memtable_bytes)
    create_private_file(data / SQLITE_NAME)  # SQLite's -wal/-shm copy its mode
    return MetaStore(data / SQLITE_NAME, synchronous=synchronous)
