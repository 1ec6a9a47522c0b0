"""Rebuild meta's index from the chunks alone, and back meta's database up.

``kvfs meta rebuild --data DIR --from-chunkservers ADDR[,ADDR...]`` asks every
chunkserver for the records of all its chunks (``CHUNK_SCAN``: each record
carries its key, write id, extent index, the value's total size and CRC,
expiry, and whether its value passes its CRC) and writes a new database in
DIR:

- per key, the newest write id wins; a tombstone there means deleted (and meta
  keeps that tombstone, as it keeps a delete's: :mod:`kvfs.meta.tombstones`, with a
  horizon of every chunk scanned), and a newest write that is incomplete (an extent with no good copy anywhere: a put
  that never finished, or every copy corrupt) drops the key rather than
  bring back older bytes; a key kept that has records of older writes is marked so
  (meta's ``older`` table): the GC expires or evicts it only with a tombstone;
- each extent's replicas are its good copies, one per server (the newest chunk
  when compaction left two);
- expired values are skipped; live bytes per chunk follow from the layouts when
  meta loads them, and the cluster id is the chunkservers'.

``kvfs meta backup FILE`` copies a live database with SQLite's online backup
API (consistent while meta runs).
"""

from __future__ import annotations

import shutil
import sqlite3
import ssl
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.config import TlsConfig
from kvfs.errors import InvalidArgument, ServerError, WrongCluster
from kvfs.layout import Extent, Layout, Replica, encode_layout
from kvfs.meta.localstore import NEW_KIND, held_kind, open_local, store_path
from kvfs.meta.tombstones import Horizon, chunk_seq, encode_horizon, ghost_hash, tomb_layout
from kvfs.tls import client_context
from kvfs.transport import Connection


class FoundRecord(NamedTuple):
    """One record as a chunkserver's CHUNK_SCAN reports it."""

    key: bytes
    write_id: int
    extent: int  # the extent's index in its value
    total_size: int
    total_crc: int
    length: int
    crc: int
    expires_at: float | None
    tombstone: bool
    value_ok: bool
    server_id: int
    chunk_id: int
    offset: int  # of the value


@dataclass(kw_only=True)
class RebuildReport:
    records: int = 0
    keys: int = 0
    value_bytes: int = 0
    deleted: int = 0  # newest write is a tombstone
    expired: int = 0
    incomplete: int = 0  # newest write has an extent with no good copy: dropped
    bad_records: int = 0  # values failing their CRC (not used)
    servers: int = 0
    chunks: int = 0
    dropped_keys: list[bytes] = field(default_factory=list)


def pick_layouts(records: Iterable[FoundRecord], now: float, report: RebuildReport | None = None,
                 tombstones: dict[bytes, Layout] | None = None,
                 older: dict[bytes, float | None] | None = None) -> dict[bytes, Layout]:
    """The layout of every key the records describe (newest write wins); ``tombstones``
    gets each deleted key's newest tombstone (its copies, one per server), ``older`` each
    key kept that has records of older writes, with their latest expiry (None: one never
    expires), as meta's ``older`` table keeps them (the GC drops those with a tombstone)."""
    rep = report if report is not None else RebuildReport()
    by_key: dict[bytes, dict[int, list[FoundRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        rep.records += 1
        if not r.tombstone and not r.value_ok:
            rep.bad_records += 1
        by_key[r.key][r.write_id].append(r)
    out: dict[bytes, Layout] = {}
    for key, versions in by_key.items():
        newest = versions[max(versions)]
        if any(r.tombstone for r in newest):
            rep.deleted += 1
            if tombstones is not None:
                copies: dict[int, FoundRecord] = {}
                for r in newest:
                    if r.tombstone and (r.server_id not in copies or r.chunk_id > copies[r.server_id].chunk_id):
                        copies[r.server_id] = r  # compaction's copy is the newer chunk
                tombstones[key] = tomb_layout((Replica(r.server_id, r.chunk_id, r.offset)
                                               for _, r in sorted(copies.items())), now)
            continue
        layout = _assemble(newest)
        if layout is None:
            rep.incomplete += 1
            rep.dropped_keys.append(key)
            continue
        if layout.expired(now):
            rep.expired += 1
            continue
        out[key] = layout
        rep.keys += 1
        rep.value_bytes += layout.size
        if older is not None and len(versions) > 1:
            exps = [r.expires_at for wid, group in versions.items() if wid != max(versions)
                    for r in group if not r.tombstone]
            if exps:
                older[key] = None if None in exps else max(e for e in exps if e is not None)
    return out


def _assemble(group: list[FoundRecord]) -> Layout | None:
    first = group[0]
    if any(r.total_size < r.length or (r.total_size, r.total_crc) != (first.total_size, first.total_crc)
           for r in group if not r.tombstone):
        return None  # a record that does not know its whole value (a stream's unit), or disagreement
    by_index: dict[int, dict[int, FoundRecord]] = defaultdict(dict)  # index -> server -> record
    for r in group:
        if not r.value_ok:
            continue
        have = by_index[r.extent].get(r.server_id)
        if have is None or r.chunk_id > have.chunk_id:  # compaction's copy is the newer chunk
            by_index[r.extent][r.server_id] = r
    extents: list[Extent] = []
    total = 0
    while total < first.total_size or (first.total_size == 0 and not extents):
        reps = by_index.get(len(extents))
        if not reps:
            return None
        one = next(iter(reps.values()))
        if any((r.length, r.crc) != (one.length, one.crc) for r in reps.values()):
            return None  # copies of one extent that disagree: never guess
        extents.append(Extent(one.length, one.crc, tuple(
            Replica(r.server_id, r.chunk_id, r.offset) for _, r in sorted(reps.items()))))
        total += one.length
    if total != first.total_size:
        return None
    created = first.write_id / 1e9 if first.write_id > 10**15 else time.time()
    return Layout(first.total_size, first.total_crc, created, first.expires_at, tuple(extents))


async def scan_chunkservers(addrs: list[str], token: str, report: RebuildReport,
                            tls: ssl.SSLContext | None = None,
                            ) -> tuple[list[FoundRecord], list[list[Any]], str, Horizon]:
    """(records, servers as [id, addr, capacity, free], cluster id, horizon) from every
    chunkserver; the horizon is each server's highest chunk: every chunk scanned may hold
    an older record of a deleted key, so the tombstones kept outlive them all."""
    found: list[FoundRecord] = []
    servers: list[list[Any]] = []
    horizon: Horizon = {}
    cluster_ids: set[str] = set()
    for addr in addrs:
        host, port = parse_addr(addr)
        conn = await Connection.open(host, port, token, request_timeout_s=600.0, tls=tls)
        try:
            st = await conn.call(rpc.ChunkStats())
            if st.server_id is None:
                raise InvalidArgument(f"chunkserver {addr} never registered: it has no server id")
            sid = st.server_id
            if st.cluster_id:
                cluster_ids.add(st.cluster_id)
            servers.append([sid, f"{host}:{port}", st.capacity, st.free])
            horizon[sid] = max((chunk_seq(c) for c in [*st.chunks, *([st.open] if st.open is not None else [])]),
                               default=-1)
            for cid in st.chunks:
                scanned = await conn.call(rpc.ChunkScan(chunk_id=cid))
                report.chunks += 1
                for r in scanned.records:
                    found.append(FoundRecord(r.key, r.write_id, r.extent, r.total_size, r.total_crc,
                                             r.length, r.crc, r.expires_at, r.tombstone, r.value_ok,
                                             sid, cid, r.value_offset))
        finally:
            conn.close()
    report.servers = len(servers)
    if len(cluster_ids) > 1:
        raise WrongCluster(f"the chunkservers belong to different clusters: {sorted(cluster_ids)}")
    if not cluster_ids:
        raise InvalidArgument("no chunkserver reported a cluster id: nothing to rebuild from")
    return found, servers, cluster_ids.pop(), horizon


async def rebuild(data: Path, addrs: list[str], token: str, *, now: float | None = None,
                  tls: TlsConfig | None = None, kind: str = NEW_KIND) -> RebuildReport:
    """Write a new meta database in ``data`` from the chunkservers' records: a ``kind`` store
    (:mod:`kvfs.meta.localstore`)."""
    held = held_kind(data)
    if held is not None:
        raise InvalidArgument(f"{store_path(data, held)} exists; move it away first (a copy of a "
                              "live one: kvfs meta backup)")
    if not addrs:
        raise InvalidArgument("--from-chunkservers needs at least one HOST:PORT")
    report = RebuildReport()
    records, servers, cluster_id, horizon = await scan_chunkservers(addrs, token, report,
                                                           client_context(tls))
    now = time.time() if now is None else now
    tombs: dict[bytes, Layout] = {}
    older: dict[bytes, float | None] = {}
    layouts = pick_layouts(records, now, report, tombs, older)
    # the records of keys not kept (expired, incomplete) are dropped ones: a put again marks the key
    ghosts = {(r.chunk_id, ghost_hash(r.key), r.expires_at) for r in records
              if r.key not in layouts and r.key not in tombs}
    store = open_local(data, kind)
    try:
        store.cluster_id(create=cluster_id)
        store.put_many(((k, encode_layout(lay), lay.expires_at, now) for k, lay in layouts.items()),
                       older.items())
        store.put_tombstones((k, encode_layout(lay), encode_horizon(horizon)) for k, lay in tombs.items())
        store.put_ghosts(ghosts)
        for sid, addr, capacity, free in servers:
            store.put_server(sid, addr, capacity, free)
    finally:
        store.close()
    return report


class Backup(NamedTuple):
    source: Path  # the store copied
    size: str  # what the copy holds, for the operator ("1234 pages", "1000 keys")


BACKUP_TRIES = 3  # read-only opens of a RocksDB store, which meta's compaction may change meanwhile


def backup(data: Path, dest: Path) -> Backup:
    """Copy ``data``'s live meta store to ``dest`` while meta serves: SQLite with its online
    backup (into the new file ``dest``), RocksDB row by row from a read-only open beside
    meta's (into a new store in the directory ``dest``: meta's writes up to the open, as
    after a crash there; the open tried again should meta's compaction delete a file it
    was reading)."""
    kind = held_kind(data)
    if kind is None:
        raise InvalidArgument(
            f"no meta database in {data}: neither {store_path(data, 'sqlite').name} nor "
            f"{store_path(data, 'rocksdb').name} (a meta on Redis Cluster keeps its index in Redis: "
            "back that up with Redis's own persistence, or kvfs meta migrate it to a local store)")
    src_path = store_path(data, kind)
    if dest.exists():
        raise InvalidArgument(f"{dest} exists; give a new {'directory' if kind == 'rocksdb' else 'file'}")
    if kind == "rocksdb":
        return Backup(src_path, f"{_rocksdb_backup(src_path, dest)} keys")
    src = sqlite3.connect(src_path)
    dst = sqlite3.connect(dest)
    try:
        src.backup(dst)
        (pages,) = dst.execute("PRAGMA page_count").fetchone()
        return Backup(src_path, f"{pages} pages")
    finally:
        dst.close()
        src.close()


def _rocksdb_backup(src: Path, dest: Path) -> int:
    """:func:`backup` of a RocksDB store; returns the keys copied.  A try that fails leaves
    no ``dest``."""
    from kvfs.meta.rocks import RocksStore

    for attempt in range(BACKUP_TRIES):
        try:
            store = RocksStore(src, read_only=True)
            try:
                return store.copy_to(dest)
            finally:
                store.close()
        except Exception as exc:  # (rocksdict raises plain Exception)
            shutil.rmtree(dest, ignore_errors=True)
            if attempt == BACKUP_TRIES - 1:
                raise ServerError(f"no copy of {src} in {BACKUP_TRIES} tries: {exc}") from None
    raise AssertionError("unreachable")
