"""Meta's persistent store on RocksDB (``--store rocksdb``): the SQLite store's calls
(:class:`kvfs.meta.store.MetaStore`, which :class:`kvfs.meta.index.MetaIndex` keeps every
key in memory over), each transaction one atomic write batch.

Why: SQLite's ``kv`` table is ordered by key, and keys are hashes, so each committed row
dirties a random page; the WAL and its checkpoints then write a page per row (meta's CPU
per committed key 21-30 us at 300k keys, bench/RESULTS.md).  An LSM tree appends its
writes and sorts them in the background, and keeps key order (``LIST``, migrate's pages).

Durability is SQLite's: a batch is written to RocksDB's WAL in order; inside
:meth:`unsynced` without a sync, made durable by :meth:`sync_wal` (``FlushWAL(sync)``,
run in meta's sync thread with the GIL released), which covers every batch written
before it; outside, a write is synced before it returns (``synchronous=FULL``) or not
(``NORMAL``).  A crash loses a suffix of the batches, never one in the middle
(RocksDB's point-in-time WAL recovery).

A full disk costs the writes that do not fit, as on SQLite.  RocksDB keeps its writer's
error (every later write fails, even once there is room, and ``FlushWAL`` too), so the
store reopens itself: at the first write once the disk has room for its WAL to be flushed,
at most every :data:`NOSPACE_RETRY_S` (a reopen that fails leaves a read-only open, so
reads go on).  Until then a sync covers the batches written before the failed append by
``fdatasync`` of the WAL files (the append that failed left them whole; its own batch is
cut off, and RocksDB's recovery drops it).  Any other IO error stays, a failed sync among
them (after one, a later sync proves nothing): writes are refused until meta is restarted.

Layout of the keys (one keyspace, a byte of prefix each; integers big-endian, so byte
order is numeric order):

- ``k`` key: the key's row, ``expires_at`` and ``last_access`` (doubles, -1: none) then
  the layout blob;
- ``x`` expiry key: the expiry index (an expiry as a big-endian double: positive doubles
  sort as their bytes).  A write deletes the entries of the rows it replaces or deletes
  as its caller names them (``replaced``: meta's index knows each key's expiry; the
  store reads no row for it).  One left behind (by a store written before these were
  named) is stale: skipped by every read, and deleted by :meth:`expired`, GC's sweep,
  once its time has passed;
- ``t`` key: a kept tombstone (layout, horizon); ``o`` key: a key's older records'
  latest expiry; ``g`` chunk hash: dropped records (count, latest expiry); ``s`` server:
  the registry; ``d`` chunk: a retired chunk; ``n`` name: GC state; ``c``: the cluster id.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import importlib.util
import logging
import math
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import msgpack

from kvfs.datadir import private_dir, sync_file
from kvfs.layout import Layout, decode_layout
from kvfs.meta.store import NO_EXPIRY, prefix_upper_bound

HAVE_ROCKSDICT = importlib.util.find_spec("rocksdict") is not None  # (missing: --no-deps installs)
if HAVE_ROCKSDICT:
    from rocksdict import (
        AccessType,
        BlockBasedOptions,
        Cache,
        Options,
        Rdict,
        ReadOptions,
        WriteBatch,
        WriteOptions,
    )

ROW = struct.Struct(">dd")  # a key's row: expires_at (NO_EXPIRY: none), last_access; the layout follows
U64 = struct.Struct(">Q")  # chunk and server ids; an expiry's bits (expiry_key)
GHOST = struct.Struct(">QI")  # (chunk, key hash)
KEY, EXP, TOMB, OLDER, GHOSTS, SERVER, DEAD, STATE, CLUSTER = (
    b"k", b"x", b"t", b"o", b"g", b"s", b"d", b"n", b"c")
KEY_END = b"l"  # (past every key row)
BLOCK_CACHE_BYTES = 8 << 20  # RocksDB's cache of blocks read from its sorted files
INFO_LOG_BYTES, INFO_LOGS_KEPT = 8 << 20, 4  # its info log rolled at this size, so many kept
COPY_BATCH = 10_000  # rows a batch of copy_to
NOSPACE_RETRY_S = 1.0  # after a full disk: the store reopened at most this often (at a write)
NOSPACE_ROOM = 1 << 20  # ... and only with this much room free beyond its WAL's bytes
FAILED_WRITE_WAIT_S = 5.0  # a sync told "previous error" waits this long to learn the cause
log = logging.getLogger("kvfs.meta")
MISSING = ("meta's RocksDB store needs rocksdict, a dependency of kvfs missing here (installed "
           "with --no-deps?): pip install rocksdict, or run meta with --store sqlite")


def expiry_key(e: float) -> bytes:
    """An expiry's 8 bytes, in the order of the numbers (IEEE 754: a positive double's sign
    bit set, a negative one's bits all flipped)."""
    (b,) = U64.unpack(struct.pack(">d", e))
    return U64.pack(b ^ 0xFFFF_FFFF_FFFF_FFFF if b >> 63 else b | 1 << 63)


def expiry_of(k: bytes, at: int) -> float:
    (b,) = U64.unpack_from(k, at)
    (e,) = struct.unpack(">d", U64.pack(b & ~(1 << 63) if b >> 63 else b ^ 0xFFFF_FFFF_FFFF_FFFF))
    return float(e)


def _none(v: float) -> float | None:
    return None if v == NO_EXPIRY else v


class RocksStore:
    """The SQLite store's calls over a RocksDB directory (``synchronous`` as there: FULL
    syncs each write outside :meth:`unsynced`, NORMAL none).  Bounded memory: one memtable
    of ``write_buffer_bytes`` being filled and at most one being flushed, and RocksDB's
    block cache (:data:`BLOCK_CACHE_BYTES`); on disk, beside the data, RocksDB's info log
    (:data:`INFO_LOGS_KEPT` files of at most :data:`INFO_LOG_BYTES`)."""

    expiry_index_by_hand = True  # the caller names the expiries its writes replace (``replaced``)

    def __init__(self, path: Path, *, synchronous: str = "FULL", write_buffer_bytes: int = 64 << 20,
                 read_only: bool = False) -> None:
        """``read_only``: opened beside the process that writes it (meta's, live), as it was
        at the open; RocksDB's info log of this open goes to a directory of its own, not
        beside that process's."""
        if not HAVE_ROCKSDICT:
            raise ValueError(MISSING)
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = path
        self.synchronous = synchronous
        self._unsynced = 0
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_write_buffer_size(write_buffer_bytes)
        opts.set_max_write_buffer_number(2)
        opts.set_max_log_file_size(INFO_LOG_BYTES)  # RocksDB's own info log (LOG, LOG.old.*)
        opts.set_keep_log_file_num(INFO_LOGS_KEPT)
        self._cache = Cache(BLOCK_CACHE_BYTES)  # (outlives the db: closed first)
        table = BlockBasedOptions()
        table.set_block_cache(self._cache)
        opts.set_block_based_table_factory(table)
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        self._opts = opts
        # the open in use (``_opens``: how many so far; the one whose writer found the disk
        # full, ``_full``, writes no more; ``_failed``: set when its writer fails), and the
        # lock that a reopen and a sync take (the sync thread's handle)
        self._lock = threading.Lock()
        self._opens, self._full, self._failed = 0, -1, threading.Event()
        self._full_error = ""
        self._reopen_at = 0.0
        self._stuck = ""  # any other IO error of its writer: until meta is restarted
        if read_only:
            self._log_dir = tempfile.TemporaryDirectory(prefix="kvfs-rocksdb-log-")
            opts.set_db_log_dir(self._log_dir.name)
            opts.set_max_open_files(-1)  # every file opened now: one meta deletes stays readable
            self.db = self._open(read_only=True)
        else:
            private_dir(path)  # (its files take the process's umask: ``kvfs meta`` sets 077)
            self.db = self._open()
        self._closed = False
        self._nosync = WriteOptions()
        self._sync = WriteOptions()
        self._sync.sync = True

    def _open(self, *, read_only: bool = False) -> Rdict:
        db = Rdict(str(self.path), self._opts,
                   access_type=AccessType.read_only() if read_only else AccessType.read_write())
        self._opens += 1
        self._failed = threading.Event()
        return db

    def _close_db(self) -> None:
        if not hasattr(self, "db"):  # (a reopen failed, and its read-only fallback too)
            return
        try:
            self.db.close()
        except Exception as exc:  # (rocksdict raises plain Exception)
            # a store whose WAL writer failed (a full disk) fails its close too ("Writer
            # has previous error"): what the WAL holds is what a reopen finds
            log.warning("closing %s: %r", self.path, exc)
        del self.db  # (the last reference: RocksDB's handle, and its LOCK, go with it)

    def close(self) -> None:
        if not self._closed:  # (twice: nothing, as SQLite's)
            self._closed = True
            with self._lock:
                self._close_db()
            if self._log_dir is not None:
                self._log_dir.cleanup()

    def copy_to(self, dest: Path) -> int:
        """Every row of the store as this open sees it, into a new store at ``dest``, batches
        of :data:`COPY_BATCH` rows, each synced; returns the keys copied.  (RocksDB's own
        checkpoint leaves out the rows a read-only open holds in memory, replayed from meta's
        WAL: every row since meta's last memtable flush.)"""
        copy = RocksStore(dest)
        keys = 0
        try:
            wb = WriteBatch(raw_mode=True)
            for k, v in self._scan(b"", None):
                wb.put(k, v)
                keys += k[:1] == KEY
                if len(wb) == COPY_BATCH:
                    copy._write(wb)
                    wb = WriteBatch(raw_mode=True)
            copy._write(wb)
        finally:
            copy.close()
        return keys

    # writing ------------------------------------------------------------------------
    @contextlib.contextmanager
    def unsynced(self) -> Iterator[None]:
        """Batches written inside are not synced: durable once a later :meth:`sync_wal`
        returns (it covers every batch written before it)."""
        self._unsynced += 1
        try:
            yield
        finally:
            self._unsynced -= 1

    def _write(self, wb: WriteBatch, *, sync: bool = True) -> None:
        """Write ``wb`` (synced unless inside :meth:`unsynced`, at ``synchronous=NORMAL``, or
        not ``sync``); raises :class:`OSError` on an IO error (``ENOSPC``: the disk is full)."""
        if self._stuck:  # (RocksDB would say only "Writer has previous error")
            raise OSError(self._stuck)
        if self._full == self._opens:
            self._reopen_with_room()
        try:
            self.db.write(wb, self._sync if sync and not self._unsynced and self.synchronous == "FULL"
                          else self._nosync)
        except Exception as exc:  # (rocksdict raises plain Exception)
            if "IO error" not in str(exc):
                raise
            failed = self._failed
            if "No space left on device: While appending" in str(exc):  # (not a failed sync)
                self._full, self._full_error = self._opens, str(exc)
                failed.set()
                raise self._nospace() from exc
            failed.set()
            self._stuck = (f"{exc} (meta's RocksDB store, {self.path}: after an IO error RocksDB "
                           "refuses every write until meta is restarted)")
            raise OSError(self._stuck) from exc

    @property
    def refusing(self) -> str:
        """Why writes are refused now ("": they are not): an IO error of the writer, until
        meta is restarted; the disk found full, until a write finds room (``kvfs stat``)."""
        return self._stuck or (str(self._nospace()) if self._full == self._opens else "")

    def _nospace(self) -> OSError:
        return OSError(errno.ENOSPC, f"{self._full_error} (meta's RocksDB store, {self.path}: "
                       "writes resume by themselves once its disk has room)")

    def _reopen_with_room(self) -> None:
        """The open's writer found the disk full, and RocksDB refuses its writes for good:
        reopen the store (its WAL replayed and flushed) once the disk has room for that, at
        most every :data:`NOSPACE_RETRY_S`; raises ``ENOSPC`` while it cannot."""
        now = time.monotonic()
        if now < self._reopen_at or shutil.disk_usage(self.path).free < self._wal_bytes() + NOSPACE_ROOM:
            raise self._nospace()
        self._reopen_at = now + NOSPACE_RETRY_S
        with self._lock:
            self._close_db()
            try:
                self.db = self._open()
            except Exception as exc:  # (no room after all: reads go on from a read-only open)
                self._full_error = str(exc)
                self.db = self._open(read_only=True)
                self._full = self._opens
                raise self._nospace() from exc
        log.warning("meta's RocksDB store %s takes writes again: its disk has room", self.path)

    def _wal_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.glob("*.log"))

    @property
    def wal_path(self) -> Path:
        return self.path

    def sync_wal(self) -> None:
        """Every batch written before this call is durable when it returns (meta's sync
        thread: rocksdict releases the GIL for it).  After the open's writer found the disk
        full, ``fdatasync`` of its WAL files does it: RocksDB's ``FlushWAL`` refuses."""
        error: Exception | None = None
        with self._lock:
            opens, failed = self._opens, self._failed
            if self._full != opens:
                try:
                    self.db.flush_wal(True)
                    return
                except Exception as exc:  # (rocksdict raises plain Exception)
                    if "previous error" not in str(exc):
                        raise
                    error = exc
        if error is not None:  # a write failed before this sync: was the disk full?
            failed.wait(FAILED_WRITE_WAIT_S)
            if self._full != opens:
                raise error
        with self._lock:
            for wal in self.path.glob("*.log"):  # (one a reopen flushed and deleted: synced)
                sync_file(wal)

    def checkpoint_off_loop(self) -> None:
        """RocksDB flushes and compacts in threads of its own: nothing for meta's sync thread."""
        return None

    # reading ------------------------------------------------------------------------
    def _scan(self, lo: bytes, hi: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) from ``lo`` up to ``hi`` (excluded), in key order: rocksdict's own
        iterator of pairs, stepped in Rust (a meta's start-up at 1M and 10M keys 5-7 % faster than
        through a Python generator of ``valid``/``key``/``value``/``next``, bench/RESULTS.md).
        A generator, so ``ro`` lives as long as the walk: the pairs' iterator reads its upper
        bound from it (returned bare, with ``ro`` dropped, a restarted meta's walk once ended
        early and lost a key: ``test_gc_expiry.py::test_expired_key_never_comes_back_after_meta_restart``)."""
        ro = ReadOptions()
        if hi is not None:
            ro.set_iterate_upper_bound(hi)
        yield from cast(Iterator[tuple[bytes, bytes]], self.db.items(from_key=lo, read_opt=ro))

    def _get(self, keys: builtins.list[bytes]) -> builtins.list[bytes | None]:
        """The values of ``keys`` (None: none), in one multi-get."""
        if not keys:
            return []
        got: builtins.list[bytes | None] = self.db.get(keys)  # type: ignore[arg-type,assignment]
        return got

    def _prefixed(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        n = len(prefix)
        for k, v in self._scan(prefix, prefix_upper_bound(prefix)):
            yield k[n:], v

    def cluster_id(self, *, create: str | None = None) -> str:
        """This cluster's id, made once (``create`` gives it; default a fresh random one)."""
        cid = self.stored_cluster_id()
        if cid is not None:
            return cid
        cid = create or uuid.uuid4().hex
        wb = WriteBatch(raw_mode=True)
        wb.put(CLUSTER, cid.encode())
        self._write(wb)
        return cid

    def stored_cluster_id(self) -> str | None:
        cid = self.db.get(CLUSTER)
        return None if cid is None else bytes(cid).decode()

    def count(self) -> int:
        """Keys stored (a walk of them)."""
        return sum(1 for _ in self._scan(KEY, KEY_END))

    def load(self) -> Iterator[tuple[bytes, Layout, float]]:
        unpack = ROW.unpack_from
        for k, v in self._scan(KEY, KEY_END):  # (per key: a meta's start-up is this loop)
            yield k[1:], decode_layout(v[16:]), unpack(v)[1]

    def rows_after(self, after: bytes | None, limit: int) -> builtins.list[tuple[bytes, bytes, float | None, float]]:
        """(key, layout blob, expires_at, last_access) of up to ``limit`` keys after ``after``,
        in key order."""
        out = []
        for k, v in self._scan(KEY if after is None else KEY + after + b"\x00", KEY_END):
            exp, acc = ROW.unpack_from(v)
            out.append((k[1:], v[16:], _none(exp), acc))
            if len(out) == limit:
                break
        return out

    def list(self, prefix: bytes, start_after: bytes | None, limit: int) -> builtins.list[tuple[bytes, Layout]]:
        lo = max(prefix, start_after + b"\x00") if start_after is not None else prefix
        hi = prefix_upper_bound(KEY + prefix)
        out: builtins.list[tuple[bytes, Layout]] = []
        if limit <= 0:
            return out
        for k, v in self._scan(KEY + lo, hi):
            out.append((k[1:], decode_layout(v[16:])))
            if len(out) == limit:
                break
        return out

    # keys ----------------------------------------------------------------------------
    def put_many(self, rows: Iterable[tuple[bytes | bytearray, bytes | bytearray, float | None, float]],
                 older: Iterable[tuple[bytes, float | None]] = (),
                 replaced: Iterable[tuple[bytes, float]] = ()) -> None:
        """Write layout rows (key, layout blob, expires_at, last_access) and, in the same
        batch, the keys among them that have older records (key, until).  ``replaced``:
        (key, expiry) of expiry entries these rows leave stale (the rows they replace, and a
        key's earlier rows here; never a key's last row's): deleted, after the rows."""
        wb = WriteBatch(raw_mode=True)
        put, pack, epack = wb.put, ROW.pack, expiry_key
        for key, blob, exp, acc in rows:
            e = NO_EXPIRY if exp is None else exp
            put(KEY + key, pack(e, acc) + blob)
            if e != NO_EXPIRY:
                put(EXP + epack(e) + key, b"")
        for k, e in replaced:
            wb.delete(EXP + epack(e) + k)
        for key, until in older:
            put(OLDER + key, msgpack.packb(until))
        self._write(wb)

    def delete_many(self, keys: Iterable[bytes],
                    tombstones: Iterable[tuple[bytes, bytes, bytes]] = (),
                    older: Iterable[bytes] = (),
                    ghosts: Iterable[tuple[int, int, float | None]] = (),
                    replaced: Iterable[tuple[bytes, float]] = (),
                    ghost_absent: Callable[[int], bool] | None = None) -> None:
        """Delete keys and, in the same batch, store their kept tombstones (key, layout,
        horizon), forget the ``older`` of those that had one, and add the ghosts (chunk,
        key hash, expiry) of those dropped without a tombstone (``ghost_absent``: as for
        :meth:`put_ghosts`).  ``replaced``: (key, expiry) of those that had one, whose expiry
        entries are deleted."""
        wb = WriteBatch(raw_mode=True)
        for k, e in replaced:
            wb.delete(EXP + expiry_key(e) + k)
        for k in keys:
            wb.delete(KEY + k)
        for k, blob, horizon in tombstones:
            wb.put(TOMB + k, msgpack.packb((blob, horizon)))
        for k in older:
            wb.delete(OLDER + k)
        self._add_ghosts(wb, ghosts, ghost_absent)
        self._write(wb)

    def touch_many(self, rows: Iterable[tuple[float, bytes]]) -> None:
        """Raise keys' last access (to a time older than a put since, it stays the put's)."""
        rows = builtins.list(rows)
        wb = WriteBatch(raw_mode=True)
        for (t, k), v in zip(rows, self._get([KEY + k for _, k in rows]), strict=True):
            if v is None:
                continue
            exp, acc = ROW.unpack_from(v)
            if t > acc:
                wb.put(KEY + k, ROW.pack(exp, t) + v[16:])
        self._write(wb)

    # the expiry index ----------------------------------------------------------------
    def _expiries(self, now: float, after: tuple[float, bytes] | None,
                  ) -> Iterator[tuple[float, bytes, bool]]:
        """(expiry, key, still so) of the index's entries up to ``now``, in that order, after
        ``after``; an entry is not still so when its key is gone or expires at another time."""
        lo = EXP if after is None else EXP + expiry_key(after[0]) + after[1] + b"\x00"
        hi = EXP + expiry_key(math.nextafter(now, math.inf))
        batch: builtins.list[tuple[float, bytes]] = []
        for k, _ in self._scan(lo, hi):
            batch.append((expiry_of(k, 1), k[9:]))
            if len(batch) == 256:
                yield from self._checked(batch)
                batch = []
        yield from self._checked(batch)

    def _checked(self, batch: builtins.list[tuple[float, bytes]]) -> Iterator[tuple[float, bytes, bool]]:
        if not batch:
            return
        rows = self._get([KEY + k for _, k in batch])
        for (e, k), v in zip(batch, rows, strict=True):
            yield e, k, v is not None and ROW.unpack_from(v)[0] == e

    def expired(self, now: float, limit: int) -> builtins.list[bytes]:
        """Up to ``limit`` keys whose expiry has passed, oldest first; the stale entries met
        on the way are deleted (unsynced: one lost is met again)."""
        out: builtins.list[bytes] = []
        stale = WriteBatch(raw_mode=True)
        if limit > 0:
            for e, k, ok in self._expiries(now, None):
                if ok:
                    out.append(k)
                    if len(out) == limit:
                        break
                else:
                    stale.delete(EXP + expiry_key(e) + k)
        if stale.len():
            self._write(stale, sync=False)
        return out

    def expired_after(self, now: float, limit: int,
                      after: tuple[float, bytes] | None) -> builtins.list[tuple[float, bytes]]:
        """(expiry, key) of up to ``limit`` keys whose expiry has passed, in that order, after
        ``after`` (the last of the previous page)."""
        out: builtins.list[tuple[float, bytes]] = []
        if limit <= 0:
            return out
        for e, k, ok in self._expiries(now, after):
            if ok:
                out.append((e, k))
                if len(out) == limit:
                    break
        return out

    def count_expired(self, now: float) -> int:
        return sum(ok for _, _, ok in self._expiries(now, None))

    # older records, tombstones, ghosts (kvfs.meta.tombstones) ----------------------------
    def load_older(self) -> Iterator[tuple[bytes, float | None]]:
        for k, v in self._prefixed(OLDER):
            yield k, msgpack.unpackb(v)

    def forget_older(self, keys: Iterable[bytes]) -> None:
        wb = WriteBatch(raw_mode=True)
        for k in keys:
            wb.delete(OLDER + k)
        self._write(wb)

    def load_tombstones(self) -> Iterator[tuple[bytes, Layout, bytes]]:
        for k, v in self._prefixed(TOMB):
            blob, horizon = msgpack.unpackb(v)
            yield k, decode_layout(blob), bytes(horizon)

    def put_tombstones(self, rows: Iterable[tuple[bytes, bytes, bytes]]) -> None:
        wb = WriteBatch(raw_mode=True)
        for k, blob, horizon in rows:
            wb.put(TOMB + k, msgpack.packb((blob, horizon)))
        self._write(wb)

    def forget_tombstones(self, keys: Iterable[bytes]) -> None:
        wb = WriteBatch(raw_mode=True)
        for k in keys:
            wb.delete(TOMB + k)
        self._write(wb)

    def _add_ghosts(self, wb: WriteBatch, rows: Iterable[tuple[int, int, float | None]],
                    absent: Callable[[int], bool] | None = None) -> None:
        """Count each (chunk, hash) row onto its entry (count, latest expiry: what
        :class:`kvfs.meta.tombstones.Ghosts` keeps of them), read first unless ``absent``
        says of its hash that the store holds none."""
        add: dict[bytes, tuple[int, float | None]] = {}
        held: builtins.list[bytes] = []  # (the entries that may be there: read)
        for c, h, until in rows:
            k = GHOSTS + GHOST.pack(c, h)
            got = add.get(k)
            if got is None:
                got = (0, -math.inf)
                if absent is None or not absent(h):
                    held.append(k)
            n, u = got
            add[k] = (n + 1, None if until is None or u is None else max(until, u))
        for k, v in zip(held, self._get(held), strict=True):
            if v is not None:
                n, u = add[k]
                n0, u0 = msgpack.unpackb(v)
                add[k] = (n + n0, None if u is None or u0 is None else max(u, u0))
        for k, (n, u) in add.items():
            wb.put(k, msgpack.packb((n, u)))

    def put_ghosts(self, rows: Iterable[tuple[int, int, float | None]],
                   absent: Callable[[int], bool] | None = None) -> None:
        """Add ghost rows (chunk, key hash, expiry).  ``absent(hash)``: True where the store
        is known to hold no row of that hash (meta's :meth:`kvfs.meta.tombstones.Ghosts.absent`),
        so the row is written without reading the one it adds to: that read was 5.5 % of
        meta's samples while a full cluster evicted small values (bench/RESULTS.md)."""
        wb = WriteBatch(raw_mode=True)
        self._add_ghosts(wb, rows, absent)
        self._write(wb)

    def load_ghosts(self) -> Iterator[tuple[int, int, float | None]]:
        for k, v in self._prefixed(GHOSTS):
            c, h = GHOST.unpack(k)
            n, until = msgpack.unpackb(v)
            for _ in range(n):
                yield c, h, until

    def forget_ghosts(self, chunks: Iterable[int]) -> None:
        """The ghosts in chunks that were deleted."""
        wb = WriteBatch(raw_mode=True)
        for c in chunks:
            wb.delete_range(GHOSTS + U64.pack(c), GHOSTS + U64.pack(c + 1))
        self._write(wb)

    # registry and state --------------------------------------------------------------
    def load_servers(self) -> builtins.list[tuple[int, str, int, int]]:
        return [(U64.unpack(k)[0], *msgpack.unpackb(v)) for k, v in self._prefixed(SERVER)]

    def put_server(self, server_id: int, addr: str, capacity: int, free: int) -> None:
        wb = WriteBatch(raw_mode=True)
        wb.put(SERVER + U64.pack(server_id), msgpack.packb((addr, capacity, free)))
        self._write(wb)

    def delete_server(self, server_id: int) -> None:
        wb = WriteBatch(raw_mode=True)
        wb.delete(SERVER + U64.pack(server_id))
        self._write(wb)

    def load_dead(self) -> builtins.list[tuple[int, int, float]]:
        return [(U64.unpack(k)[0], *msgpack.unpackb(v)) for k, v in self._prefixed(DEAD)]

    def add_dead(self, rows: Iterable[tuple[int, int, float]]) -> None:
        """Retired chunks (chunk, server, when); one retired before keeps its time."""
        rows = builtins.list(rows)
        keys = [DEAD + U64.pack(c) for c, _, _ in rows]
        wb = WriteBatch(raw_mode=True)
        for k, (_, sid, at), v in zip(keys, rows, self._get(keys), strict=True):
            if v is None:
                wb.put(k, msgpack.packb((sid, at)))
        self._write(wb)

    def get_state(self, name: str) -> Any:
        v = self.db.get(STATE + name.encode())
        return None if v is None else msgpack.unpackb(v, raw=False)

    def all_state(self) -> dict[str, Any]:
        return {k.decode(): msgpack.unpackb(v, raw=False) for k, v in self._prefixed(STATE)}

    def put_state(self, name: str, value: Any) -> None:
        wb = WriteBatch(raw_mode=True)
        wb.put(STATE + name.encode(), msgpack.packb(value, use_bin_type=True))
        self._write(wb)
