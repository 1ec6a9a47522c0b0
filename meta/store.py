"""Meta's persistent store: SQLite in WAL mode, one transaction per batch."""

from __future__ import annotations

import builtins
import contextlib
import os
import sqlite3
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from kvfs.datadir import sync_file
from kvfs.layout import Layout, decode_layout

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (
    key BLOB PRIMARY KEY,
    layout BLOB NOT NULL,
    expires_at REAL,
    last_access REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_expiry ON kv(expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS servers (
    server_id INTEGER PRIMARY KEY,
    addr TEXT NOT NULL,
    capacity INTEGER NOT NULL DEFAULT 0,
    free INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS dead_chunks (
    chunk_id INTEGER PRIMARY KEY,
    server_id INTEGER NOT NULL,
    retired_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS cluster (
    id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tombstones (
    key BLOB PRIMARY KEY,
    layout BLOB NOT NULL,
    horizon BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gc_state (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS ghosts (
    chunk INTEGER NOT NULL,
    h INTEGER NOT NULL,
    until REAL
);
CREATE INDEX IF NOT EXISTS ghosts_chunk ON ghosts(chunk);
"""
# ghosts: a record of a key the GC dropped without a tombstone, in a chunk still there
# (kvfs.meta.tombstones.Ghosts: the key's hash, the record's expiry)
PUT_GHOST = "INSERT INTO ghosts(chunk, h, until) VALUES (?,?,?)"
# keys with an older record that may outlive their current one (kvfs.meta.tombstones, "older
# records"): ``until`` is the latest expiry among those records (NULL: one never expires)
OLDER_SCHEMA = "CREATE TABLE older (key BLOB PRIMARY KEY, until REAL) WITHOUT ROWID"
# a layout row: (key, layout blob, expires_at, last_access); sqlite3 binds a bytearray or a
# float as it is, but a bytes or None value only after an adapter lookup that raises and drops
# an AttributeError per value (about 1 us of CPU per row of three, bench/RESULTS.md), so the
# commit path's rows carry bytearrays and NO_EXPIRY for none (plain rows are taken too)
NO_EXPIRY = -1.0
PUT_KV = ("INSERT OR REPLACE INTO kv(key, layout, expires_at, last_access) "
          f"VALUES (?1, ?2, nullif(?3, {NO_EXPIRY}), ?4)")
PUT_TOMBSTONE = "INSERT OR REPLACE INTO tombstones(key, layout, horizon) VALUES (?,?,?)"
PUT_OLDER = "INSERT OR REPLACE INTO older(key, until) VALUES (?,?)"


# checkpoints off the loop (kvfs.meta.walsync): the sync thread checkpoints once this many
# WAL frames wait (SQLite's default ``wal_autocheckpoint``); the loop's connection checkpoints
# itself only past LOOP_CHECKPOINT_FRAMES, the bound on the WAL if the thread falls behind
CHECKPOINT_FRAMES = 1000
LOOP_CHECKPOINT_FRAMES = 4 * CHECKPOINT_FRAMES


def prefix_upper_bound(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return None


class MetaStore:
    """``synchronous``: FULL makes each transaction durable before it returns (WAL synced);
    NORMAL may lose the last transactions to a power loss.  Meta's index writes its
    changes :meth:`unsynced` and syncs the WAL in a thread (:meth:`sync_wal`,
    :mod:`kvfs.meta.walsync`); GC's changes in every mode, so no chunk is unlinked on the
    strength of a relocation or retirement that is not on disk yet."""

    refusing = ""  # why writes are refused now: never (SQLite takes them again once a full disk has room)
    expiry_index_by_hand = False  # an SQL index keeps the rows' expiries in order

    def __init__(self, path: Path, *, synchronous: str = "FULL") -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = path
        self._wal = f"{path}-wal"  # (a str: sync_wal opens it after every change)
        self.synchronous = synchronous
        self._level = synchronous  # the connection's PRAGMA synchronous now (see _tx)
        self._unsynced = 0  # unsynced() blocks open
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={synchronous}")
        self.db.executescript(SCHEMA)
        if self.db.execute("SELECT 1 FROM sqlite_master WHERE name = 'older'").fetchone() is None:
            with self._tx():  # a database older than the table: every key may have older records
                self.db.execute(OLDER_SCHEMA)
                self.db.execute("INSERT INTO older(key, until) SELECT key, NULL FROM kv")
        # The -shm file, opened once (SQLite made it above) and closed only after the
        # connection: SQLite's locks on it are POSIX record locks, which the close of *any*
        # descriptor of the file in this process drops.  A close while the connection is
        # open let another process's connection (kvfs meta backup's) take the wal-index for
        # its own, truncate it and map it anew: meta died of SIGBUS (bench/RESULTS.md).
        self._shm_fd = os.open(f"{path}-shm", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        self.db.close()
        if self._shm_fd >= 0:
            os.close(self._shm_fd)  # (after the connection: see __init__)
            self._shm_fd = -1

    def frames_waiting(self) -> int:
        """WAL frames not yet copied into the database: ``mxFrame - nBackfill`` from the
        wal-index header in the ``-shm`` file (https://www.sqlite.org/walformat.html:
        offsets 16 and 96, native byte order), read without a lock through the descriptor
        kept open: a trigger, not a count anything relies on.  Safe from any thread."""
        head = os.pread(self._shm_fd, 100, 0)
        if len(head) < 100:
            return 0
        mx = int.from_bytes(head[16:20], sys.byteorder)
        backfilled = int.from_bytes(head[96:100], sys.byteorder)
        return max(0, mx - backfilled)

    def cluster_id(self, *, create: str | None = None) -> str:
        """This cluster's id, made once when the database is created (``create`` gives it,
        e.g. a rebuild adopting the chunkservers' id; default: a fresh random one)."""
        cid = self.stored_cluster_id()
        if cid is not None:
            return cid
        cid = create or uuid.uuid4().hex
        with self._tx():
            self.db.execute("INSERT INTO cluster VALUES (?)", (cid,))
        return cid

    def stored_cluster_id(self) -> str | None:
        row = self.db.execute("SELECT id FROM cluster").fetchone()
        return None if row is None else str(row[0])

    def count(self) -> int:
        """Keys stored."""
        (n,) = self.db.execute("SELECT count(*) FROM kv").fetchone()
        return int(n)

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        """A write transaction (``BEGIN`` inside ``with self.db``: committed, or rolled back) at
        this store's level, or at NORMAL inside :meth:`unsynced`.  The connection keeps the
        level of its last write transaction, and the PRAGMA runs only when it must change: a
        run of unsynced writes (meta's commit groups with ``--fsync batch``) runs none (a
        PRAGMA is prepared anew each time it runs: switching there and back cost meta 60-95 us
        of CPU per group, bench/RESULTS.md).  Every write of this class goes through here."""
        level = "NORMAL" if self._unsynced else self.synchronous
        if level != self._level:
            self.db.execute(f"PRAGMA synchronous={level}")
            self._level = level
        with self.db:
            self.db.execute("BEGIN")
            yield

    @contextlib.contextmanager
    def unsynced(self) -> Iterator[None]:
        """Transactions inside are written to the WAL without syncing it
        (synchronous=NORMAL): durable only once a later :meth:`sync_wal` (or a FULL
        transaction, or a checkpoint) has synced the WAL, which covers them and every
        transaction before them (the WAL is written in order)."""
        self._unsynced += 1
        try:
            yield
        finally:
            self._unsynced -= 1

    @property
    def wal_path(self) -> Path:
        return Path(self._wal)

    def sync_wal(self) -> None:
        """``fdatasync`` the WAL file: every transaction written before this call is durable
        when it returns (meta calls it in its sync thread, off the event loop: kvfs.meta.walsync).

        The file is opened by path on each call, never kept open: the WAL file SQLite
        writes is the one at that path (it is replaced only when its last connection
        closes).  A transaction written before the call whose frames are no longer in it
        was moved into the database by a completed checkpoint, which synced the WAL
        before copying and the database after (synchronous=NORMAL still syncs
        checkpoints), and only then let the next transaction reuse the WAL from its
        start (the new WAL header synced too): durable already.  No file: the same (a
        checkpoint-and-delete at a close).  SQLite takes no lock on the WAL file (its
        locks are on the database and ``-shm`` files), so this descriptor's close
        drops none of them."""
        sync_file(self._wal)

    def checkpoint_off_loop(self) -> Checkpointer:
        """Raise this connection's auto-checkpoint to :data:`LOOP_CHECKPOINT_FRAMES` (the
        bound) and return the :class:`Checkpointer` the sync thread runs the checkpoints
        with, at :data:`CHECKPOINT_FRAMES`."""
        self.db.execute(f"PRAGMA wal_autocheckpoint={LOOP_CHECKPOINT_FRAMES}")
        return Checkpointer(self)

    def load(self) -> Iterator[tuple[bytes, Layout, float]]:
        for key, blob, last_access in self.db.execute("SELECT key, layout, last_access FROM kv"):
            yield bytes(key), decode_layout(blob), last_access

    def rows_after(self, after: bytes | None, limit: int) -> builtins.list[tuple[bytes, bytes, float | None, float]]:
        """(key, layout blob, expires_at, last_access) of up to ``limit`` keys after ``after``,
        in key order (``kvfs meta migrate`` pages through the table with it)."""
        cols = "SELECT key, layout, expires_at, last_access FROM kv"
        q = (self.db.execute(f"{cols} ORDER BY key LIMIT ?", (limit,)) if after is None else
             self.db.execute(f"{cols} WHERE key > ? ORDER BY key LIMIT ?", (after, limit)))
        return [(bytes(k), bytes(b), e, a) for k, b, e, a in q]

    def put_many(self, rows: Iterable[tuple[bytes | bytearray, bytes | bytearray, float | None, float]],
                 older: Iterable[tuple[bytes, float | None]] = (),
                 replaced: Iterable[tuple[bytes, float]] = ()) -> None:
        """Write layout rows (:data:`PUT_KV`) and, in the same transaction, the keys among
        them that have older records (key, until: the ``older`` table).  ``replaced``: for a
        store whose expiry index is kept by hand (:attr:`expiry_index_by_hand`), here an
        SQL index on the rows: unused."""
        with self._tx():
            self.db.executemany(PUT_KV, rows)
            self.db.executemany(PUT_OLDER, older)

    def delete_many(self, keys: Iterable[bytes],
                    tombstones: Iterable[tuple[bytes, bytes, bytes]] = (),
                    older: Iterable[bytes] = (),
                    ghosts: Iterable[tuple[int, int, float | None]] = (),
                    replaced: Iterable[tuple[bytes, float]] = (),
                    ghost_absent: Callable[[int], bool] | None = None) -> None:
        """Delete keys and, in the same transaction, store the tombstones kept for them
        (key, layout, horizon: :mod:`kvfs.meta.tombstones`), forget the ``older`` rows of
        those that had one, and store the ghosts of those dropped without a tombstone
        (chunk, key hash, expiry).  ``replaced``: as for :meth:`put_many`.  ``ghost_absent``:
        unused (an upsert counts each ghost row on without a read)."""
        with self._tx():
            self.db.executemany("DELETE FROM kv WHERE key = ?", ((k,) for k in keys))
            self.db.executemany(PUT_TOMBSTONE, tombstones)
            self.db.executemany("DELETE FROM older WHERE key = ?", ((k,) for k in older))
            self.db.executemany(PUT_GHOST, ghosts)

    def put_ghosts(self, rows: Iterable[tuple[int, int, float | None]],
                   absent: Callable[[int], bool] | None = None) -> None:
        """``absent``: unused, as :meth:`delete_many`'s ``ghost_absent``."""
        with self._tx():
            self.db.executemany(PUT_GHOST, rows)

    def load_ghosts(self) -> Iterator[tuple[int, int, float | None]]:
        yield from self.db.execute("SELECT chunk, h, until FROM ghosts")

    def forget_ghosts(self, chunks: Iterable[int]) -> None:
        """The ghosts in chunks that were deleted."""
        with self._tx():
            self.db.executemany("DELETE FROM ghosts WHERE chunk = ?", ((c,) for c in chunks))

    def load_older(self) -> Iterator[tuple[bytes, float | None]]:
        for key, until in self.db.execute("SELECT key, until FROM older"):
            yield bytes(key), until

    def forget_older(self, keys: Iterable[bytes]) -> None:
        with self._tx():
            self.db.executemany("DELETE FROM older WHERE key = ?", ((k,) for k in keys))

    # tombstones (kvfs.meta.tombstones) ---------------------------------------------
    def load_tombstones(self) -> Iterator[tuple[bytes, Layout, bytes]]:
        for key, blob, horizon in self.db.execute("SELECT key, layout, horizon FROM tombstones"):
            yield bytes(key), decode_layout(blob), bytes(horizon)

    def put_tombstones(self, rows: Iterable[tuple[bytes, bytes, bytes]]) -> None:
        """(key, layout, horizon) rows: moved by compaction, or a horizon raised."""
        with self._tx():
            self.db.executemany(PUT_TOMBSTONE, rows)

    def forget_tombstones(self, keys: Iterable[bytes]) -> None:
        with self._tx():
            self.db.executemany("DELETE FROM tombstones WHERE key = ?", ((k,) for k in keys))

    def touch_many(self, rows: Iterable[tuple[float, bytes]]) -> None:
        """Raise keys' last access (to a time older than a put since, it stays the put's)."""
        with self._tx():
            self.db.executemany("UPDATE kv SET last_access = max(last_access, ?) WHERE key = ?", rows)

    def list(self, prefix: bytes, start_after: bytes | None, limit: int) -> list[tuple[bytes, Layout]]:
        lo = max(prefix, start_after + b"\x00") if start_after is not None else prefix
        hi = prefix_upper_bound(prefix)
        if hi is None:
            q = self.db.execute("SELECT key, layout FROM kv WHERE key >= ? ORDER BY key LIMIT ?", (lo, limit))
        else:
            q = self.db.execute("SELECT key, layout FROM kv WHERE key >= ? AND key < ? ORDER BY key LIMIT ?",
                                (lo, hi, limit))
        return [(bytes(k), decode_layout(b)) for k, b in q]

    def load_servers(self) -> builtins.list[tuple[int, str, int, int]]:
        return list(self.db.execute("SELECT server_id, addr, capacity, free FROM servers"))

    def put_server(self, server_id: int, addr: str, capacity: int, free: int) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO servers VALUES (?,?,?,?)", (server_id, addr, capacity, free))

    def delete_server(self, server_id: int) -> None:
        with self._tx():
            self.db.execute("DELETE FROM servers WHERE server_id = ?", (server_id,))

    # garbage collection ------------------------------------------------------
    def expired(self, now: float, limit: int) -> builtins.list[bytes]:
        """Up to ``limit`` keys whose expiry has passed, oldest first (the ``kv_expiry`` index)."""
        return [k for _, k in self.expired_after(now, limit, None)]

    def expired_after(self, now: float, limit: int,
                      after: tuple[float, bytes] | None) -> builtins.list[tuple[float, bytes]]:
        """(expiry, key) of up to ``limit`` keys whose expiry has passed, in that order,
        after ``after`` (the last of the previous page): the ``kv_expiry`` index holds each
        row's key too, so a page is one seek, O(the page)."""
        cols = "SELECT expires_at, key FROM kv WHERE expires_at IS NOT NULL AND expires_at <= ?1"
        q = (self.db.execute(f"{cols} ORDER BY expires_at, key LIMIT ?2", (now, limit)) if after is None else
             self.db.execute(f"{cols} AND (expires_at, key) > (?3, ?4) "  # (a row value: one seek)
                             "ORDER BY expires_at, key LIMIT ?2", (now, limit, *after)))
        return [(e, bytes(k)) for e, k in q]

    def count_expired(self, now: float) -> int:
        (n,) = self.db.execute("SELECT count(*) FROM kv WHERE expires_at IS NOT NULL AND expires_at <= ?",
                               (now,)).fetchone()
        return int(n)

    def load_dead(self) -> builtins.list[tuple[int, int, float]]:
        return list(self.db.execute("SELECT chunk_id, server_id, retired_at FROM dead_chunks"))

    def add_dead(self, rows: Iterable[tuple[int, int, float]]) -> None:
        with self._tx():
            self.db.executemany("INSERT OR IGNORE INTO dead_chunks VALUES (?,?,?)", rows)

    def get_state(self, name: str) -> Any:
        row = self.db.execute("SELECT value FROM gc_state WHERE name = ?", (name,)).fetchone()
        return None if row is None else msgpack.unpackb(row[0], raw=False)

    def all_state(self) -> dict[str, Any]:
        return {n: msgpack.unpackb(v, raw=False) for n, v in self.db.execute("SELECT name, value FROM gc_state")}

    def put_state(self, name: str, value: Any) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO gc_state VALUES (?,?)",
                            (name, msgpack.packb(value, use_bin_type=True)))


class Checkpointer:
    """A PASSIVE checkpoint of the WAL on a second SQLite connection, opened and used by
    one thread only (meta's sync thread: :mod:`kvfs.meta.walsync`), so the loop's
    connection does not run it: :meth:`run_if_due` once :data:`CHECKPOINT_FRAMES` frames
    wait; and after a checkpoint that copied the whole WAL, its restart (:meth:`_restart`).

    Durability is as with the loop's own auto-checkpoint: a checkpoint copies only
    committed frames, syncs the WAL before copying and the database after (at NORMAL as at
    FULL), and the WAL is reused from its start only after a checkpoint that copied all of
    it, its new header synced before any frame after it is written (see
    :meth:`MetaStore.sync_wal`).  No change is answered on the strength of a checkpoint:
    answers wait for :meth:`MetaStore.sync_wal`."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store  # (its frames_waiting: read through its -shm descriptor)
        self.path = store.path
        self.db: sqlite3.Connection | None = None
        self.checkpoints = 0  # checkpoints run (complete or not)
        self.restarts = 0  # restart transactions written here (each restarts the WAL unless the loop wrote first)

    def run_if_due(self) -> None:
        if self.store.frames_waiting() < CHECKPOINT_FRAMES:
            return
        if self.db is None:
            # timeout 0: never waits for the loop's writer lock (_restart skips instead);
            # NORMAL: a checkpoint's syncs as at FULL, and a transaction's commit unsynced
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=0)
            self.db.execute("PRAGMA synchronous=NORMAL")
        _, log, copied = self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.checkpoints += 1
        if log > 0 and copied == log:
            self._restart()

    def _restart(self) -> None:
        """Restart the WAL here, after a checkpoint copied all of it: the first transaction
        written after such a checkpoint rewinds the WAL to its start, writes a new header
        and, at ``synchronous=NORMAL`` or FULL, ``fdatasync``s it before writing its frames
        (https://www.sqlite.org/pragma.html#pragma_synchronous: "the WAL file header is
        synchronized when a WAL file begins to be reused after a checkpoint"; unsynced, a
        power loss could keep the old header and some new frames and replay a prefix of
        the old WAL over the newer database).  Left to the loop's next write, that sync ran
        on the event loop, holding every lookup (bench/RESULTS.md); so this connection
        writes that first transaction: page 1 rewritten as it is (``user_version`` set to
        its value), one frame, synced with the WAL's next :meth:`MetaStore.sync_wal`.

        The writer lock is tried once: held by the loop (writing a change meanwhile, which
        restarts the WAL itself, as SQLite does), nothing is written.  A change the loop
        writes while this transaction holds the lock waits in SQLite's busy handler for it
        (GC's changes, DELETEs, the access-time flush, not a COMMIT's group: none is
        written before this sync's answer)."""
        assert self.db is not None
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode == sqlite3.SQLITE_BUSY:  # the loop is writing
                return
            raise
        try:
            (version,) = self.db.execute("PRAGMA user_version").fetchone()
            self.db.execute(f"PRAGMA user_version={int(version)}")
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.restarts += 1

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None
