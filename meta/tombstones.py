"""Tombstones meta keeps, so a deleted key stays deleted in a rebuild of meta.

``kvfs meta rebuild`` takes each key's newest record on the chunkservers
(:mod:`kvfs.meta.rebuild`).  That is right only while, for every key, the newest
record is its current state (its live value or a tombstone) or no record of it is
left.  A delete's tombstone is the one record that says "absent"; were the GC to drop
it (compacting it away, or deleting its chunk) while an older record of the key lived
on in another chunk, a rebuild would bring the key back, with stale bytes where it had
been overwritten.  So:

- a client's delete writes its tombstones first (one APPEND per server, on
  ``replicas`` servers), then DELETE names them; a delete whose tombstones no server
  took fails and changes nothing;
- meta tracks the tombstone of each key it removed (:class:`Tomb`, in the index and
  its store): its bytes count as live, so compaction copies it forward (GC_CHUNK_REFS
  names it, GC_RELOCATE moves it) and its chunk is never deleted under it; a put of
  the key forgets it (the new record is newer);
- its *horizon*: per chunkserver, the highest chunk sequence number meta knew of at
  the delete (heartbeats' chunk tables, every layout it committed, the tombstone's own
  chunks).  Chunk ids only grow per server (:func:`kvfs.layout.make_chunk_id`), so
  every chunk that may hold an older record of the key is at or below it, except a
  copy a compaction or repair made while the delete happened: GC_RELOCATE and
  GC_REPAIR raise the horizon to their new chunk when they find the key deleted.
  A server meta has not heard from since it started gets its horizon at its first
  chunk table (until then the tombstone is kept);
- dropped (:func:`passed`) once every registered chunkserver sent a chunk table after
  the delete and holds no chunk at or below its horizon: each was deleted, or
  compacted (which copies only live records: the key's older ones are gone with it).
  Checked when the GC compacts the tombstone's chunk (GC_CHUNK_REFS: that chunk
  excused, as its older records of the key go with it; the tombstone is then not
  copied) and when it reports deleted chunks (GC_DELETED).  A chunkserver that stays
  down keeps the tombstones written since it went quiet.

Older records: a key the GC expires or evicts leaves a tombstone too when an older
record of it may outlive its current one, else a rebuild could serve that older value
once the GC reclaimed the current record's chunk.  Meta (:class:`kvfs.meta.index.MetaIndex`)
keeps those keys in its ``older`` set (in memory and SQLite, with the latest expiry among
the older records: once all expired, a rebuild skips them and no tombstone is needed):

- a COMMIT that replaced a record of the key (the replaced one, and what it replaced, are
  older records), put it again after a delete whose tombstone meta kept (the records
  before the delete: the tombstone is forgotten, the key marked with no expiry), or put
  it again while a record of it the GC dropped without a tombstone is still there
  (:class:`Ghosts`, until the GC deletes that record's chunk);
- ``kvfs meta rebuild``: each key with records of older writes;
- a database made before the set existed, or migrated from Redis: every key.

A key never overwritten has one write: its records (replicas, compaction and repair
copies) all carry the current value, so dropping it needs no tombstone (meta notes the
dropped record in :class:`Ghosts` until its chunk goes, for a put again).  GC_EXPIRE and
GC_EVICT leave the marked keys (``shadowed``); the GC driver writes their tombstones
(:func:`kvfs.writepath.write_tombstones`) and GC_TOMBSTONE removes them keeping the
tombstones, each then kept and dropped as a delete's.

Not covered: keys dropped as lost (REPORT_LOST, fsck: README, "Losing meta's database");
a tombstone's copy on a chunkserver that is lost or drained is not copied elsewhere; a GC
killed between a compaction's copy and its GC_RELOCATE, while a key it copied was deleted,
leaves that copy in an unreferenced chunk the next pass deletes (a rebuild in between,
after the tombstone went, would bring the key's last value back).
With ``--store redis-cluster://`` meta keeps none (its GC reclaims a tombstone's chunk
like any other; README, "No tombstones on Redis", says why): a Redis store recovers by
Redis's own persistence and replicas, not a rebuild from chunk records.

Cost per deleted key (and per key with older records the GC dropped), until its tombstone
is dropped: ``56 + len(key)`` bytes on each
of ``replicas`` chunkservers, one row in meta's store (key, layout, horizon: about
``len(key) + 30 + 10 * chunkservers`` bytes) and its entry in memory.  At most one per
key (a second delete of an absent key tracks nothing).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import crc32c
import msgpack
import msgspec

from kvfs.layout import Extent, Layout, Replica, server_of_chunk

SEQ_MASK = (1 << 40) - 1  # a chunk id's sequence number (see kvfs.layout.make_chunk_id)

Horizon = dict[int, int | None]  # server id -> highest chunk seq (None: not heard from yet)


def chunk_seq(chunk_id: int) -> int:
    return chunk_id & SEQ_MASK


class Server(Protocol):
    """What :func:`floors` and :func:`horizon_now` read of a chunkserver
    (:class:`kvfs.meta.index.ServerInfo`)."""

    chunks: dict[int, int]
    open_chunk: int | None
    last_heartbeat: float  # monotonic


class Tomb(msgspec.Struct, gc=False):
    """A kept tombstone.  Untracked by the cycle collector (no cycle goes through one): a
    full collection walked each one kept since start-up, 65 ms at 300k (bench/RESULTS.md)."""

    layout: Layout  # one extent of length 0: the tombstone's replicas
    horizon: Horizon
    since: float  # monotonic: a chunk table from every server after this


def tomb_layout(replicas: Iterable[Replica], created: float) -> Layout:
    return Layout(0, 0, created, None, (Extent(0, 0, tuple(replicas)),))


def highest_seq(s: Server) -> int:
    """The highest chunk sequence number in a server's chunk table (-1: none)."""
    seqs = [chunk_seq(c) for c in s.chunks]
    if s.open_chunk is not None:
        seqs.append(chunk_seq(s.open_chunk))
    return max(seqs, default=-1)


def horizon_now(servers: Mapping[int, Server], seq_high: Mapping[int, int], started: float) -> Horizon:
    """Per server, the highest chunk seq meta knows of now; None for a server not heard
    from since meta ``started`` (monotonic): its chunk table is not known yet."""
    return {sid: (max(highest_seq(s), seq_high.get(sid, -1)) if s.last_heartbeat >= started else None)
            for sid, s in servers.items()}


def raise_horizon(t: Tomb, chunk_id: int) -> bool:
    """Cover a chunk made after the delete that may hold an older record of the key (a
    compaction or repair copy that raced it); True if the horizon changed."""
    sid, seq = server_of_chunk(chunk_id), chunk_seq(chunk_id)
    if sid in t.horizon:
        h = t.horizon[sid]
        if h is None or h >= seq:  # None: fixed later, at that server's highest chunk then
            return False
    t.horizon[sid] = seq
    return True


@dataclass(frozen=True, slots=True)
class Floor:
    """What :func:`passed` needs of one server's chunk table: when it was sent (monotonic),
    its two lowest chunk seqs (one chunk may be excused) and its highest."""

    heard: float
    lowest: tuple[int, ...]
    highest: int


def floors(servers: Mapping[int, Server]) -> dict[int, Floor]:
    """Every registered server's :class:`Floor`, computed once for many :func:`passed`."""
    out = {}
    for sid, s in servers.items():
        seqs = [chunk_seq(c) for c in s.chunks]
        if s.open_chunk is not None:
            seqs.append(chunk_seq(s.open_chunk))
        seqs.sort()
        out[sid] = Floor(s.last_heartbeat, tuple(seqs[:2]), seqs[-1] if seqs else -1)
    return out


def passed(t: Tomb, floor: Mapping[int, Floor], compacting: int | None = None) -> bool:
    """No chunk that may hold an older record of the key is left: every registered server
    sent a chunk table after the delete, and none of its chunks is at or below the
    horizon, but ``compacting``: a chunk holding this tombstone that is being compacted now
    (its older records of the key, if any, go with the tombstone: compaction copies
    neither).  A pending horizon (server not heard from at the delete) is fixed at that
    server's highest chunk now, so it passes only once those chunks are gone."""
    excused = (-1, -1) if compacting is None else (server_of_chunk(compacting), chunk_seq(compacting))
    for sid, f in floor.items():
        if f.heard <= t.since:
            return False
        if sid not in t.horizon:
            continue  # registered after the delete: its chunks are all newer
        h = t.horizon[sid]
        if h is None:
            h = t.horizon[sid] = f.highest
        left = [q for q in f.lowest if (sid, q) != excused]
        if left and left[0] <= h:
            return False
    return True


GHOST_SLOTS = 1 << 20  # Ghosts' hash slots: 12 MiB once the first key is dropped without a tombstone
NO_GHOST = -1.0  # Ghosts.until_of: no dropped record in the key's slot


def ghost_hash(key: bytes) -> int:
    """A key's hash in :class:`Ghosts` (stable across restarts: stored in meta's ``ghosts``)."""
    return int(crc32c.crc32c(key))


class Ghosts:
    """The records of keys the GC dropped without a tombstone, while their chunks are there.

    A key put again while one is there has an older record (its dropped one), so the COMMIT
    marks it (``older``) and the GC drops it with a tombstone.  Keys are hashed into
    :data:`GHOST_SLOTS` slots, each with a count of records and the latest of their
    expiries (a collision marks a key that needed nothing: one tombstone more, never one
    less); per chunk, the slots of its records, forgotten when the chunk is deleted.
    Memory: the slots (12 MiB, allocated at the first drop) and 4 bytes per dropped record
    whose chunk is still there."""

    def __init__(self) -> None:
        self.count: array[int] | None = None  # per slot: records in chunks still there
        self.until: array[float] | None = None  # per slot: their latest expiry (inf: never)
        self.by_chunk: dict[int, array[int]] = {}
        self.records = 0

    def add(self, rows: Iterable[tuple[int, int, float | None]]) -> None:
        """(chunk, key hash, expiry) of each dropped record."""
        if self.count is None:
            self.count = array("I", bytes(4 * GHOST_SLOTS))
            self.until = array("d", bytes(8 * GHOST_SLOTS))
        count, last, by_chunk = self.count, self.until, self.by_chunk
        assert last is not None
        n = 0
        for c, h, until in rows:
            slot = h % GHOST_SLOTS
            slots = by_chunk.get(c)
            if slots is None:
                slots = by_chunk[c] = array("I")
            slots.append(slot)
            count[slot] += 1
            u = math.inf if until is None else until
            if u > last[slot]:
                last[slot] = u
            n += 1
        self.records += n

    def forget(self, chunks: Iterable[int]) -> int:
        """The chunks are gone, and their records with them; how many records that was."""
        n = 0
        for c in chunks:
            slots = self.by_chunk.pop(c, None)
            if slots is None:
                continue
            assert self.count is not None and self.until is not None
            for slot in slots:
                self.count[slot] -= 1
                if not self.count[slot]:
                    self.until[slot] = 0.0
            n += len(slots)
        self.records -= n
        return n

    def absent(self, h: int) -> bool:
        """No dropped record of this key hash is held (nor of another in its slot), so the
        store holds no ghost row of it in any chunk: a new one is written without reading
        one first (:meth:`kvfs.meta.rocks.RocksStore.delete_many`).  Exact while the store
        changes only as this does: its rows are loaded into it at start, and each write of
        them is added to it (or forgotten) once the store has them."""
        return self.count is None or not self.count[h % GHOST_SLOTS]

    def until_of(self, h: int) -> float | None:
        """The latest expiry of the dropped records in the key's slot (None: one never
        expires), or :data:`NO_GHOST`."""
        if not self.records or self.count is None or self.until is None:
            return NO_GHOST
        slot = h % GHOST_SLOTS
        if not self.count[slot]:
            return NO_GHOST
        u = self.until[slot]
        return None if u == math.inf else u


def encode_horizon(h: Horizon) -> bytes:
    return msgpack.packb(h)


def decode_horizon(blob: bytes) -> Horizon:
    return {int(k): (None if v is None else int(v))
            for k, v in msgpack.unpackb(blob, strict_map_key=False).items()}
