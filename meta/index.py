"""Meta's index: key -> layout in memory over SQLite, live bytes per chunk, chunkservers.

Shared by meta's RPC handlers (:mod:`kvfs.meta.service`) and its GC component
(:mod:`kvfs.meta.gc`), which is handed this index to work on.

Invariants:
- every change is answered only once it is durable, the same way
  (:class:`~kvfs.meta.walsync.WalSync`): its transaction is written to SQLite's WAL
  (``--store rocksdb``: one write batch to RocksDB's, :mod:`kvfs.meta.rocks`)
  without a sync on the event loop (:meth:`MetaStore.unsynced`), then one ``fdatasync``
  of the WAL runs in meta's sync thread (:meth:`MetaStore.sync_wal`) while the loop goes
  on answering lookups, and the change is answered when a sync that started after its
  write returns (one covers every transaction written before it: the WAL is written in
  order; the changes written while one sync runs share the next).  A change is a COMMIT's
  group, a DELETE, a registration, the access-time flush (``--fsync never``: answered
  when written, no sync) and each of GC's changes (relocations, retirements, tombstones,
  expiry, eviction, GC state and counters: synced in every ``--fsync`` mode).  An answer
  waits for every change written before it, its own or not, so nothing the GC does (an
  unlink) rests on a change that is not on disk, nor a retirement it repeats;
- the in-memory index is updated in the step that writes the transaction, so the
  two never disagree for a reader, and SQLite holds the transactions in the order
  the index applied them (only the loop uses its SQLite connection; the sync thread
  opens the WAL file by path, and checkpoints on a connection of its own).  So a
  committed key is visible to lookups from that step, before its COMMIT is answered
  (one sync later), and a deleted one is a miss from then on.  A crash in between can
  lose the change from meta, and only together with every transaction after it (the
  WAL is replayed in order up to the first frame not on disk): meta restarts in a
  state it was in, and the lost key reads as a miss (its records are still on the
  chunks: ``kvfs meta rebuild`` finds them), or a key whose DELETE was never answered
  reads as before it, never wrong bytes.  A COMMIT whose
  ``if_absent`` found a key present is answered only after the sync covering that
  key's own transaction (see the next point), so "present" is never said of a key
  that is not durable;
- group commit: the COMMITs that arrive while one group is synced are written
  after that sync returned, by the next group, together, in one transaction and
  one sync, in arrival order (``commit_group_max_keys``/``_bytes`` bound a group; a
  larger COMMIT is queued in parts of ``commit_group_max_keys``, a group each, so a
  crash may keep a prefix of them; ``--fsync always`` writes one COMMIT per
  transaction).  No group is written while
  a group waits for its sync, so when one is written every earlier group is durable (a
  group that wrote nothing, every key present, is answered at once).  Each is checked
  (unknown server, retired chunk) in the step that writes it;
- a failed WAL sync fails every change waiting for it, and meta refuses every commit,
  delete and GC change after it (:class:`~kvfs.errors.ServerError` naming the failure)
  until it is restarted: after a failed ``fdatasync`` Linux may have dropped the dirty
  pages, and a later sync can succeed without them;
- ``chunk_live`` is derived from the layouts and the tombstones kept
  (:mod:`kvfs.meta.tombstones`; rebuilt at start), never stored; so are ``chunk_keys``
  (the keys whose layout names each chunk) and ``value_bytes`` from the layouts,
  changed with ``entries`` in the same steps, and ``tomb_chunks`` (the keys whose kept
  tombstone names each chunk), changed with ``tombstones``;
- an expired key is a miss for every RPC, before GC removes it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import logging
import time
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvfs.chunkserver.records import RECORD  # the record format: meta counts its bytes
from kvfs.config import FsyncMode, MetaConfig
from kvfs.errors import ServerError, StaleLayout
from kvfs.layout import Layout, Replica, encode_layout, encode_layout_buffer, server_of_chunk
from kvfs.meta.keymap import KeyMap
from kvfs.meta.leases import Leases
from kvfs.meta.localstore import LocalStore
from kvfs.meta.lruorder import LruOrder
from kvfs.meta.repair import readable
from kvfs.meta.store import NO_EXPIRY
from kvfs.meta.storeapi import Lease
from kvfs.meta.tombstones import (
    NO_GHOST,
    Floor,
    Ghosts,
    Tomb,
    chunk_seq,
    decode_horizon,
    encode_horizon,
    floors,
    ghost_hash,
    horizon_now,
    passed,
    raise_horizon,
    tomb_layout,
)
from kvfs.meta.walsync import WalSync

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

log = logging.getLogger("kvfs.meta")

RECORD_OVERHEAD_BYTES = RECORD.size  # a chunk record's fixed header; its key follows
# keys a walk of many keys (GC's and STATS's: :func:`pages`) takes per loop step:
# the other clients wait at most one page's work (bench/meta_stall.py)
WALK_PAGE = 1000
# keys one transaction of a large change writes (a DELETE's, a repair's switches), the loop
# free between them: SQLite writes a random page per key
WRITE_PAGE = 1000
# The keys of a chunk (``chunk_keys``, ``tomb_chunks``), each mapped to None: a set of them,
# made after start-up's gc.freeze(), is tracked by the cycle collector, and every full
# collection walked every key in it (37 ms at 1M keys committed since start, 2026-12-05,
# bench/RESULTS.md); a dict of bytes to None is untracked by the first collection that sees it
KeySet = dict[bytes, None]
S = TypeVar("S", bound="SupportsRichComparison")  # (what sorted_pages sorts)
T = TypeVar("T")
METRICS_STATE = "metrics"  # the state entry holding GC's counters (Redis: a hash of their own)
_UNSET = object()


@dataclass(slots=True)
class ServerInfo:
    server_id: int
    addr: str
    capacity: int = 0
    free: int = 0
    used: int = 0
    last_heartbeat: float = -1e18  # monotonic
    chunks: dict[int, int] = field(default_factory=dict)  # chunk_id -> bytes written
    open_chunk: int | None = None  # the chunk appends go to (never compacted or deleted)
    wanted: int = 0  # bytes of the last append refused for lack of space (evict to fit it)
    key: str = ""  # the chunkserver's data-dir key: only it may move its id to a new address
    disk: str | None = None  # the filesystem it stores on (host:st_dev); None: own --capacity
    reported_capacity: int = 0  # as the server reported them; capacity/free are its share
    reported_free: int = 0
    shared_by: int = 1  # servers on its disk (each gets 1/shared_by of its space)


CommitCheck = Callable[[Sequence[tuple[bytes, Layout]]], None]  # raises for a layout it refuses


@dataclass(slots=True)
class PendingCommit:
    """One COMMIT waiting for the next group transaction."""

    staged: Sequence[tuple[bytes, Layout]]  # key, stamped layout (if_absent: those to write)
    rows: list[tuple[bytearray, bytearray, float, float]]  # their SQLite rows (store.PUT_KV)
    nbytes: int  # keys + encoded layouts
    now: float
    expires_at: float | None
    check: CommitCheck | None
    chunks: Collection[int] | None  # every chunk id the layouts name, if the caller had them
    if_absent: bool
    present: list[int]  # indexes of the COMMIT's rows not written: their key was present
    done: asyncio.Future[None]


def answer(commits: Iterable[PendingCommit]) -> None:
    """Answer written COMMITs (one whose handler was cancelled meanwhile: no one to tell)."""
    for c in commits:
        if not c.done.done():
            c.done.set_result(None)


async def pages(rows: Sequence[T], size: int | None = None) -> AsyncIterator[Sequence[T]]:
    """``rows`` ``size`` (default :data:`WALK_PAGE`) at a time, one page (and what the caller
    does with it) per loop step: work over every key, or over as many, never holds the loop
    for all."""
    n = WALK_PAGE if size is None else size
    for i in range(0, len(rows), n):
        yield rows[i:i + n]
        await asyncio.sleep(0)  # (the loop serves the others before the next page)


async def listed(keys: KeyMap[Any]) -> list[bytes]:
    """Every key of ``keys``, a shard per loop step: ``list()`` of a KeyMap is one step for
    every key (47-49 ms at 1M keys; 14-23 ms for one dict), this at most a shard's (0.2 ms;
    bench/RESULTS.md).  A key put meanwhile into a shard already listed is left out, and
    one removed is kept: the walks that take it look each key up again."""
    out: list[bytes] = []
    for shard in keys.shards:
        out.extend(shard)
        await asyncio.sleep(0)
    return out


async def walked(keys: KeyMap[Any]) -> AsyncIterator[Sequence[bytes]]:
    """Every key of ``keys``, a page of :data:`WALK_PAGE` per loop step, listed a shard at
    a time: for the walks that take the keys in no order (the drop of passed tombstones, of
    ended leases), no list of every key (the flush's forgetting of 3M ended leases through
    :func:`listed` had one step of 31-33 ms, through this none over 4 ms; bench/RESULTS.md).
    As :func:`listed`, a key put meanwhile may be left out and one removed kept: the walks
    look each key up again."""
    n = WALK_PAGE
    left: list[bytes] = []
    for shard in keys.shards:
        left += shard
        if len(left) >= n:
            full = len(left) - len(left) % n
            for i in range(0, full, n):
                yield left[i:i + n]
                await asyncio.sleep(0)
            left = left[full:]
    if left:
        yield left
        await asyncio.sleep(0)


async def sorted_pages(rows: Sequence[T], made: Callable[[Sequence[T]], Iterable[S]],
                       batch: int | None = None) -> AsyncIterator[list[S]]:
    """What ``made`` makes of ``rows``, in sorted order, ``batch`` (default a page) at a
    time, never sorting more than a page in one step: each page (:func:`pages`) made and
    sorted in its step, then the pages merged lazily, a batch per step."""
    runs = [sorted(made(page)) async for page in pages(rows)]
    merged = heapq.merge(*runs)
    while out := list(itertools.islice(merged, batch or WALK_PAGE)):
        yield out
        await asyncio.sleep(0)


def disk_bytes(layout: Layout) -> int:
    """Bytes a layout occupies on disk, every replica counted."""
    return sum(n for _, n in layout.chunk_bytes())


def add_live(live: dict[int, int], layout: Layout, sign: int, key: bytes) -> None:
    """Live bytes per chunk: each replica's value plus its record header and key, so a
    chunk of only live records has zero garbage."""
    overhead = RECORD_OVERHEAD_BYTES + len(key)
    for e in layout.extents:  # layout.chunk_bytes(), inlined: this runs per committed key
        n = sign * (e.length + overhead)
        for r in e.replicas:
            live[r.chunk_id] = live.get(r.chunk_id, 0) + n


def stale(key: bytes, chunk: int | str) -> StaleLayout:
    return StaleLayout(f"layout for {key[:64]!r} names chunk {chunk}, which garbage collection "
                       "already reclaimed (the put took longer than the GC grace period); retry the put")


class ServerRegistry:
    """The chunkservers meta knows and their liveness: what every meta keeps in memory,
    whichever store holds the keys."""

    def __init__(self, config: MetaConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.servers: dict[int, ServerInfo] = {}
        self.started = time.monotonic()  # servers known before a restart get dead_after_s from here

    def alive(self, s: ServerInfo) -> bool:
        return time.monotonic() - s.last_heartbeat < self.config.heartbeat_timeout_s

    def dead(self, s: ServerInfo) -> bool:
        """Silent for ``dead_after_s`` (since meta started, for a server not seen since)."""
        after = max(self.config.dead_after_s, self.config.heartbeat_timeout_s)
        return time.monotonic() - max(s.last_heartbeat, self.started) >= after

    def gone_servers(self) -> set[int]:
        """Servers whose replicas count as lost: dead ones."""
        return {sid for sid, s in self.servers.items() if self.dead(s)}

    def used(self, s: ServerInfo) -> int:
        return sum(s.chunks.values())

    async def save_server(self, s: ServerInfo, *, registered: bool) -> None:
        """Record a registration (``registered``) or a heartbeat where the store keeps them."""

    async def refresh(self) -> None:
        """Read servers other meta processes registered (none: this meta is the only one)."""

    async def new_server_id(self, addr: str, taken: Iterable[int] = ()) -> int:
        """An id no chunkserver has, nor ``taken`` (one meta: the next after the largest)."""
        return max((*self.servers, *taken), default=0) + 1

    def share_disks(self) -> None:
        """Chunkservers on one filesystem share its space: each of the n gets 1/n of the
        capacity and free space they report, so every total (``kvfs stat``, ``kvfs gc
        status``, the mount's ``df``) counts the disk once and fill ratios are the disk's."""
        on_disk: dict[str, int] = {}
        for s in self.servers.values():
            if s.disk is not None:
                on_disk[s.disk] = on_disk.get(s.disk, 0) + 1
        for s in self.servers.values():
            n = on_disk.get(s.disk, 1) if s.disk is not None else 1
            s.shared_by = n
            s.capacity, s.free = s.reported_capacity // n, s.reported_free // n


class MetaIndex(ServerRegistry):
    """Every key in memory over a store in meta's data directory: SQLite (the embedded
    default) or RocksDB (:mod:`kvfs.meta.localstore`)."""

    def __init__(self, config: MetaConfig, store: LocalStore, clock: Callable[[], float]) -> None:
        super().__init__(config, clock)
        self.store = store
        # key -> layout: the index holds the layout itself, no object per key around it (a
        # commit makes none but the layout: bench/RESULTS.md); a key's last access (LRU) is
        # its layout's ``created`` (meta's commit time) unless it was read since: ``accessed``;
        # both, and ``dirty_access``, split over many dicts, the same key in the same shard of
        # each (a dict's growth copies it whole in one step: kvfs.meta.keymap)
        self.entries: KeyMap[Layout] = KeyMap()
        self.accessed: KeyMap[float] = KeyMap()  # keys read since their commit -> last access
        self._lru = LruOrder()  # eviction's order, kept from one walk to the next
        self.chunk_live: dict[int, int] = {}
        # chunk id -> the keys whose layout names a replica in it (compaction's references,
        # GC_CHUNK_REFS of chunks: O(those keys), never a walk of every key); derived from the
        # layouts with ``chunk_live``, the tombstones' own references left to tombstone_refs
        self.chunk_keys: dict[int, KeySet] = {}
        self.value_bytes = 0  # the stored values' sizes, summed (STATS: key_stats, no walk)
        self.tombstones: KeyMap[Tomb] = KeyMap()  # deleted keys' tombstones kept (kvfs.meta.tombstones)
        # the servers' floors the last walk of drop_passed took (None: none yet), and the
        # tombstones made since the oldest chunk table in them, oldest first: those a chunk
        # table heard since can let pass (the others wait for a chunk to go)
        self._dropped_at: dict[int, Floor] | None = None
        self._young: collections.deque[tuple[float, bytes]] = collections.deque()
        # chunk id -> the keys whose kept tombstone has a replica in it (tombstone_refs: O(those
        # tombstones)); derived, changed with ``tombstones`` wherever their live bytes change
        self.tomb_chunks: dict[int, KeySet] = {}
        # keys with older records on the chunks -> the latest expiry among them (None: never);
        # the GC drops these with a tombstone (kvfs.meta.tombstones, "older records")
        self.older: KeyMap[float | None] = KeyMap()  # (as ``entries``: overwrites can reach every key)
        self.ghosts = Ghosts()  # records of keys dropped without a tombstone, chunks still there
        self.seq_high: dict[int, int] = {}  # server id -> highest chunk seq a layout named
        self.leases = Leases()  # key -> holder -> lease end (storeapi.Lease)
        self.dirty_access: KeyMap[float] = KeyMap()  # last_access not yet written to the store
        self.retired: dict[int, float] = {}  # retired chunks: refused by commit and switch forever
        self.claims: dict[str, tuple[str, float]] = {}  # lease name -> (holder, monotonic end)
        self.leases_overflowed = 0  # leases given the overflow holder since start (STATS)
        self.commit_groups = 0  # group transactions written
        self.commit_syncs = 0  # WAL syncs that answered COMMITs (batch/always)
        self._commits: collections.deque[PendingCommit] = collections.deque()
        self._commit_handle: asyncio.Handle | None = None
        # batch/always: every change is written unsynced, then the WAL is synced in a thread
        self._sync_after = config.fsync != FsyncMode.NEVER
        # (GC's changes are synced in every mode; the checkpoints in the sync thread only
        # with batch/always: with never it seldom runs, and the loop's connection checkpoints)
        self._wal = WalSync(store, checkpoint=self._sync_after)
        self._syncing: asyncio.Future[None] | None = None  # a group waiting for its sync (done: answered)

    def load(self) -> None:
        # every stored key: its live bytes and chunk keys as add_live and index_chunks count
        # them, inlined (per key: a meta's start-up is this loop), seq_high once per chunk
        entries, accessed, mask = self.entries.shards, self.accessed.shards, self.entries.mask
        live, keys_in = self.chunk_live, self.chunk_keys
        get, nbytes = live.get, 0
        for key, layout, last_access in self.store.load():
            i = hash(key) & mask  # (the shard: KeyMap's, inlined, as in every per-key loop here)
            entries[i][key] = layout
            nbytes += layout.size
            if last_access != layout.created:
                accessed[i][key] = last_access
            overhead = RECORD_OVERHEAD_BYTES + len(key)
            for e in layout.extents:
                n = e.length + overhead
                for r in e.replicas:
                    cid = r.chunk_id
                    live[cid] = get(cid, 0) + n
                    try:
                        keys_in[cid][key] = None
                    except KeyError:
                        keys_in[cid] = {key: None}
        self.note_chunk_ids(list(live))
        self.value_bytes = nbytes
        self.retired = {c: t for c, _, t in self.store.load_dead()}
        since = time.monotonic()
        stale = []  # put again after the delete (the put's own forget did not reach the disk)
        for key, layout, horizon in self.store.load_tombstones():
            if key in self.entries:
                stale.append(key)
                continue
            h = decode_horizon(horizon)
            for sid, seq in h.items():
                if seq is not None:
                    self.seq_high[sid] = max(self.seq_high.get(sid, -1), seq)
            self.tombstones[key] = Tomb(layout, h, since)
            self.add_live(layout, +1, key)
            self.index_chunks(key, layout, True, self.tomb_chunks)
        if stale:
            self.store.forget_tombstones(stale)
        gone = []  # removed, and the row's delete did not reach the disk
        for key, until in self.store.load_older():
            if key in self.entries:
                self.older[key] = until
            else:
                gone.append(key)
        if gone:
            self.store.forget_older(gone)
        self.ghosts.add(self.store.load_ghosts())
        for sid, addr, capacity, free in self.store.load_servers():
            self.servers[sid] = ServerInfo(sid, addr, capacity, free, reported_capacity=capacity,
                                           reported_free=free)
        log.info("meta loaded %d keys, %d chunkservers", len(self.entries), len(self.servers))

    def flush_access(self) -> None:
        """Write the access times at once (a closing meta's)."""
        if self.dirty_access:
            self.store.touch_many((t, k) for k, t in self.dirty_access.items())
            self.dirty_access.clear()

    # durability of changes (kvfs.meta.walsync) ------------------------------------------
    def _writing(self, *, gc: bool = False) -> contextlib.AbstractContextManager[None]:
        """A change's transactions: with ``--fsync batch``/``always``, or for GC's changes
        (``gc``: synced in every mode, so no chunk is unlinked on the strength of a change
        not on disk), written unsynced and owed a sync its answer waits for
        (:meth:`_settled`); ``--fsync never``: written at the store's NORMAL.  Refused
        after a failed sync."""
        if self._wal.failed is not None:
            raise self._wal.failed
        return self._wal.unsynced() if gc or self._sync_after else contextlib.nullcontext()

    async def _settled(self, *, gc: bool = False) -> None:
        """Return once every change written so far is durable (``--fsync never``: at once,
        but for GC's changes, ``gc``); raises :class:`ServerError` if its sync failed."""
        if gc or self._sync_after:
            await self._wal.settle()

    @property
    def refusing(self) -> str:
        """Why every change is refused now ("": none is): a failed WAL sync (until meta is
        restarted), or the store's own refusal (:attr:`RocksStore.refusing`)."""
        failed = self._wal.failed
        return str(failed) if failed is not None else self.store.refusing

    async def _write(self, write: Callable[..., object], *args: Any) -> None:
        """``write(*args)``: one change of meta's own (not GC's), answered once durable."""
        with self._writing():
            write(*args)
        await self._settled()

    # reading ------------------------------------------------------------------------
    def get(self, key: bytes, now: float) -> Layout | None:
        lay = self.entries.get(key)
        if lay is None or lay.expired(now):
            return None
        return lay

    def last_access(self, key: bytes) -> float:
        """When a present key was last read (LOOKUP, TOUCH), or else committed."""
        t = self.accessed.get(key)
        return self.entries[key].created if t is None else t

    def readable(self, key: bytes, now: float, gone: set[int]) -> bool:
        """Unexpired, and every extent has a replica off the ``gone`` servers."""
        lay = self.get(key, now)
        return lay is not None and readable(lay, gone)

    # changing -----------------------------------------------------------------------
    def index_chunks(self, key: bytes, layout: Layout, add: bool,
                     keys_in: dict[int, KeySet] | None = None) -> None:
        """``chunk_keys`` (or ``keys_in``: ``tomb_chunks``) as ``key``'s layout ``layout``
        is set (``add``) or replaced or removed (not: called first for the old layout, then
        for a new one)."""
        if keys_in is None:
            keys_in = self.chunk_keys
        for e in layout.extents:
            for r in e.replicas:
                cid = r.chunk_id
                if add:
                    try:
                        keys_in[cid][key] = None
                    except KeyError:
                        keys_in[cid] = {key: None}
                elif (ks := keys_in.get(cid)) is not None:
                    ks.pop(key, None)
                    if not ks:
                        del keys_in[cid]

    def add_live(self, layout: Layout, sign: int, key: bytes, live: dict[int, int] | None = None) -> None:
        if live is None:
            live = self.chunk_live
            if sign > 0:
                self.note_chunks(layout)
        add_live(live, layout, sign, key)

    def check_not_dead(self, rows: Iterable[tuple[bytes, Layout]], chunks: Collection[int] | None = None) -> None:
        """StaleLayout for a layout naming a retired chunk (a put that outlasted the grace
        period: its chunk was reclaimed before the commit).  ``chunks``: every chunk id the
        layouts name, when the caller has them (a packed COMMIT's chunk column): looked up
        as they are, in C (``isdisjoint``), instead of walking each layout's replicas in
        Python (0.02 against 0.10 us per key of one replica, bench/RESULTS.md); the layouts
        are walked only to name the key of a retired one."""
        dead = self.retired
        if not dead:
            return
        if chunks is not None and dead.keys().isdisjoint(chunks):
            return
        for key, lay in rows:
            cid = self.dead_in(lay)
            if cid is not None:
                raise stale(key, cid)

    def dead_in(self, layout: Layout) -> int | None:
        """A retired chunk the layout names, if any."""
        dead = self.retired
        if dead:
            for e in layout.extents:
                for r in e.replicas:
                    if r.chunk_id in dead:
                        return r.chunk_id
        return None

    def note_chunks(self, layout: Layout) -> None:
        """Raise ``seq_high`` to the chunks a layout names (tombstones' horizons)."""
        self.note_chunk_ids(r.chunk_id for e in layout.extents for r in e.replicas)

    def note_chunk_ids(self, chunks: Iterable[int]) -> None:
        """Raise ``seq_high`` to these chunks (a commit group's: each chunk once)."""
        high = self.seq_high
        for cid in chunks:
            sid, seq = server_of_chunk(cid), chunk_seq(cid)
            if high.get(sid, -1) < seq:
                high[sid] = seq

    def switch_layouts(self, staged: list[tuple[bytes, Layout, Layout]]) -> None:
        """Replace the layouts (the old, the new) of existing keys, keeping their last
        access: one SQLite transaction (owed a sync: the caller settles), then the index."""
        if not staged:
            return
        replaced = [(k, old.expires_at) for k, old, lay in staged
                    if old.expires_at is not None and old.expires_at != lay.expires_at] \
            if self.store.expiry_index_by_hand else ()
        with self._writing(gc=True):
            self.store.put_many(((k, encode_layout(lay), lay.expires_at, self.last_access(k))
                                 for k, _, lay in staged), (), replaced)
        accessed, entries = self.accessed, self.entries
        for k, old, lay in staged:
            if lay.created != old.created and k not in accessed:
                accessed[k] = old.created
            self.add_live(old, -1, k)
            self.index_chunks(k, old, False)
            entries[k] = lay
            self.value_bytes += lay.size - old.size
            self.add_live(lay, +1, k)
            self.index_chunks(k, lay, True)

    def remove(self, keys: Iterable[bytes], tombstones: dict[bytes, Layout] | None = None, *,
               sync: bool = True) -> list[tuple[bytes, Layout]]:
        """Delete keys from SQLite (one transaction, owed a sync the caller settles; ``sync``:
        whatever ``--fsync``, as GC's changes are) and the index, keeping the tombstones given
        for them (:mod:`kvfs.meta.tombstones`; a key given none goes as a GC drop does, its
        records noted as ghosts); returns the removed ones."""
        gone = list(dict.fromkeys(k for k in keys if k in self.entries))
        if not gone:
            return []
        keep = {k: tombstones[k] for k in gone if k in tombstones} if tombstones else {}
        for lay in keep.values():  # the horizon covers the tombstones' own chunks
            self.note_chunks(lay)
        horizon = horizon_now(self.servers, self.seq_high, self.started) if keep else {}
        blob = encode_horizon(horizon)
        older, entries = self.older, self.entries
        ghosts = []  # (chunk, key hash, expiry): each record of a key dropped without a tombstone
        for k in gone:
            if k not in keep:
                lay = entries[k]
                h, until = ghost_hash(k), lay.expires_at
                ghosts += [(c, h, until) for c in dict.fromkeys(r.chunk_id for x in lay.extents for r in x.replicas)]
        replaced = [(k, exp) for k in gone if (exp := entries[k].expires_at) is not None] \
            if self.store.expiry_index_by_hand else ()
        with self._writing(gc=sync):
            self.store.delete_many(gone, ((k, encode_layout(lay), blob) for k, lay in keep.items()),
                                   [k for k in gone if k in older] if older else (), ghosts, replaced,
                                   ghost_absent=self.ghosts.absent)
        if ghosts:
            self.ghosts.add(ghosts)
        since = time.monotonic()
        for k, lay in keep.items():
            self.tombstones[k] = Tomb(lay, dict(horizon), since)
            self._young.append((since, k))
            self.add_live(lay, +1, k)
            self.index_chunks(k, lay, True, self.tomb_chunks)
        out = []
        for k in gone:
            lay = self.entries.pop(k)
            out.append((k, lay))
            self.value_bytes -= lay.size
            self.add_live(lay, -1, k)
            self.index_chunks(k, lay, False)
            self.accessed.pop(k, None)
            self.dirty_access.pop(k, None)
            self.leases.forget(k)
            older.pop(k, None)
        return out

    # meta's key RPCs (service.py's handlers; the Redis-backed index has the same calls) --
    async def save_server(self, s: ServerInfo, *, registered: bool) -> None:
        if registered:
            await self._write(self.store.put_server, s.server_id, s.addr, s.reported_capacity,
                              s.reported_free)

    def lease(self, keys: Iterable[bytes], now: float, lease: Lease) -> None:
        """Keep keys from eviction by ``lease``: its holder's, only ever lengthened; past
        ``max_holders`` unexpired others on a key, the overflow holder's (storeapi.Lease)."""
        self.leases_overflowed += self.leases.lease(keys, now, lease)

    def lease_end(self, key: bytes) -> float:
        """The latest end of the key's leases, any holder's (0: none)."""
        return self.leases.end(key)

    async def release(self, keys: Sequence[bytes], holder: str) -> int:
        return self.release_now(keys, holder)

    # The key RPCs' answers, had at once (this index is in memory): meta's service answers
    # them without a task (``*_now``); the async forms are the MetaStore interface's.
    def release_now(self, keys: Sequence[bytes], holder: str) -> int:
        """End ``holder``'s leases of keys; returns how many it had one on."""
        return self.leases.release(keys, holder)

    async def lookup(self, keys: Sequence[bytes], now: float,
                     lease: Lease | None = None) -> list[Layout | None]:
        return self.lookup_now(keys, now, lease)

    def lookup_now(self, keys: Sequence[bytes], now: float,
                   lease: Lease | None = None) -> list[Layout | None]:
        out: list[Layout | None] = []
        dirty, accessed, entries, mask = self.dirty_access.shards, self.accessed.shards, self.entries.shards, self.entries.mask
        for k in keys:  # (self.get, inlined: this runs per looked-up key)
            i = hash(k) & mask
            lay = entries[i].get(k)
            if lay is None:
                out.append(None)
                continue
            exp = lay.expires_at
            if exp is not None and exp <= now:
                out.append(None)
            else:
                out.append(lay)
                accessed[i][k] = dirty[i][k] = now
        if lease is not None:
            self.lease([k for k, lay in zip(keys, out, strict=True) if lay is not None], now, lease)
        return out

    async def touch(self, keys: Sequence[bytes], now: float) -> None:
        self.touch_now(keys, now)

    def touch_now(self, keys: Sequence[bytes], now: float) -> None:
        entries, accessed, dirty, mask = self.entries.shards, self.accessed.shards, self.dirty_access.shards, self.entries.mask
        for k in keys:
            i = hash(k) & mask
            if k in entries[i]:
                accessed[i][k] = dirty[i][k] = now

    def _present(self, keys: Sequence[bytes], now: float) -> list[bool]:
        """:meth:`readable` of each key, for lookups of many keys: with no server gone (the
        common case) a key is readable when present and unexpired, decided in one loop
        without a call per key."""
        gone = self.gone_servers()
        if gone:
            return [self.readable(k, now, gone) for k in keys]
        entries, mask = self.entries.shards, self.entries.mask
        out = []
        for k in keys:
            lay = entries[hash(k) & mask].get(k)
            if lay is None:
                out.append(False)
            else:
                exp = lay.expires_at
                out.append(exp is None or exp > now)  # (Layout.expired, inlined)
        return out

    async def exists(self, keys: Sequence[bytes], now: float,
                     lease: Lease | None = None) -> list[bool]:
        return self.exists_now(keys, now, lease)

    def exists_now(self, keys: Sequence[bytes], now: float,
                   lease: Lease | None = None) -> list[bool]:
        out = self._present(keys, now)
        if lease is not None:
            self.lease([k for k, ok in zip(keys, out, strict=True) if ok], now, lease)
        return out

    async def match_prefix(self, keys: Sequence[bytes], now: float, lease: Lease | None) -> int:
        return self.match_prefix_now(keys, now, lease)

    def match_prefix_now(self, keys: Sequence[bytes], now: float, lease: Lease | None) -> int:
        present = self._present(keys, now)
        n = present.index(False) if False in present else len(present)
        if lease is not None:
            self.lease(keys[:n], now, lease)
        return n

    async def commit(self, staged: Sequence[tuple[bytes, Layout]], now: float,
                     expires_at: float | None, check: CommitCheck | None = None, *,
                     if_absent: bool = False, chunks: Collection[int] | None = None) -> list[int]:
        """Store the layouts, durable once it returns; returns the indexes of ``staged`` not
        committed: with ``if_absent``, those whose key is present (readable, earlier in
        ``staged``, or written by an earlier COMMIT of the same group).  The layouts are
        stamped ``created=now`` (meta's COMMIT handler's stamp): a key's last access is its
        layout's ``created`` until it is read (``accessed``).  ``check(staged)``
        runs in the step that writes the rows (a chunk may be retired while the commit
        waits for its group); what it raises is this commit's answer, and nothing of it
        is written.  ``chunks``, if given: every chunk id ``staged`` names (the retired
        check looks these up: :meth:`check_not_dead`)."""
        if self._wal.failed is not None:
            raise self._wal.failed
        n = self.config.commit_group_max_keys
        if len(staged) <= n:
            pending = self._queue_commit(staged, now, expires_at, check, if_absent, chunks)
            await pending.done
            return pending.present
        # Past a group's keys: in parts of a group's keys, each queued once the one before
        # is written and synced, so the loop is free between them and the COMMITs that
        # arrive meanwhile go in between (one group of 16,384 keys held it 38-71 ms on
        # RocksDB, bench/RESULTS.md); a packed COMMIT's part is built as it is queued (a
        # slice of :class:`~kvfs.packed.LazyStaged`).  As a DELETE's pages, a crash may keep a prefix of the
        # parts; a part that fails is the COMMIT's answer, and the parts after it are not
        # written.
        present: list[int] = []
        for i in range(0, len(staged), n):
            pending = self._queue_commit(staged[i:i + n], now, expires_at, check, if_absent, chunks)
            await pending.done
            present += [i + j for j in pending.present]
        return present

    def _queue_commit(self, staged: Sequence[tuple[bytes, Layout]], now: float,
                      expires_at: float | None, check: CommitCheck | None, if_absent: bool,
                      chunks: Collection[int] | None) -> PendingCommit:
        """A COMMIT (or a part of one) queued for the next group."""
        exp = NO_EXPIRY if expires_at is None else expires_at
        rows = [(bytearray(k), encode_layout_buffer(lay), exp, now) for k, lay in staged]
        loop = asyncio.get_running_loop()
        pending = PendingCommit(staged, rows, sum(len(r[0]) + len(r[1]) for r in rows), now,
                                expires_at, check, chunks, if_absent, [], loop.create_future())
        self._commits.append(pending)
        if self._commit_handle is None and self._syncing is None:  # (a sync's end writes the queue)
            self._commit_handle = loop.call_soon(self._write_commits)  # after this step's COMMITs
        return pending

    def _take_group(self) -> list[PendingCommit]:
        """The next group: whole COMMITs in arrival order, up to the bounds (at least one)."""
        cfg = self.config
        one = cfg.fsync == FsyncMode.ALWAYS
        group: list[PendingCommit] = []
        keys = nbytes = 0
        written: set[bytes] | None = None  # the group's keys so far, once an if_absent needs them
        gone: set[int] | None = None
        while self._commits:
            c = self._commits[0]
            if group and (one or keys + len(c.rows) > cfg.commit_group_max_keys
                          or nbytes + c.nbytes > cfg.commit_group_max_bytes):
                break
            self._commits.popleft()
            if c.done.done():  # its handler was cancelled (server closing): not written
                continue
            try:
                if c.check is not None:
                    c.check(c.staged)
                self.check_not_dead(c.staged, c.chunks)
            except Exception as exc:
                c.done.set_exception(exc)
                continue
            if c.if_absent:
                if written is None:
                    written = {k for g in group for k, _ in g.staged}
                if gone is None:
                    gone = self.gone_servers()
                kept = []
                for i, (k, _) in enumerate(c.staged):
                    if k in written or self.readable(k, c.now, gone):
                        c.present.append(i)
                    else:
                        written.add(k)
                        kept.append(i)
                if c.present:
                    c.staged = [c.staged[i] for i in kept]
                    c.rows = [c.rows[i] for i in kept]
            elif written is not None:
                written.update(k for k, _ in c.staged)
            group.append(c)
            keys += len(c.rows)
            nbytes += c.nbytes
        return group

    def _write_commits(self) -> None:
        self._commit_handle = None
        written = self._write_next_group()
        if self._sync_after and any(c.rows for c in written):
            self._await_sync(written)  # the queue is written when it returns
            return
        answer(written)  # --fsync never, or nothing written: every earlier group is durable
        if self._commits:  # past the bounds: the rest in the next step
            self._commit_handle = asyncio.get_running_loop().call_soon(self._write_commits)

    def _write_next_group(self) -> list[PendingCommit]:
        """Write the next group; returns its COMMITs that were written (not yet answered:
        the others were, with their error)."""
        group = self._take_group()
        if not group:
            return []
        try:
            self._write_group(group)
            return group
        except Exception as exc:
            if len(group) == 1:
                group[0].done.set_exception(exc)
                return []
            written = []
            for c in group:  # the shared transaction failed: each COMMIT alone, its own answer
                try:
                    self._write_group([c])
                    written.append(c)
                except Exception as exc1:
                    c.done.set_exception(exc1)
            return written

    def _await_sync(self, covered: list[PendingCommit]) -> None:
        """Sync the WAL in the sync thread (:class:`WalSync`); ``covered`` (written before it)
        are answered when it returns, and the COMMITs queued meanwhile are written then."""
        self._syncing = asyncio.get_running_loop().create_future()
        self._wal.after(lambda exc: self._synced(exc, covered))

    def _synced(self, exc: ServerError | None, covered: list[PendingCommit]) -> None:
        syncing, self._syncing = self._syncing, None
        assert syncing is not None
        syncing.set_result(None)
        if exc is None:
            self.commit_syncs += 1
            answer(covered)
            if self._commits and self._commit_handle is None:  # (after the answers go out)
                self._commit_handle = asyncio.get_running_loop().call_soon(self._write_commits)
            return
        for c in (*covered, *self._commits):  # (the sync thread logged the failure)
            if not c.done.done():
                c.done.set_exception(exc)
        self._commits.clear()

    def _older_after(self, group: list[PendingCommit]) -> dict[bytes, float | None]:
        """The keys the group's rows give an older record (``older``'s changed values): a key
        overwritten (the record replaced, and those before it), put again after a delete
        whose tombstone meta kept (records before the delete: their expiry unknown), or
        put again while a record of it dropped without a tombstone is there (``ghosts``)."""
        entries, olders, tombs, ghosts = self.entries.shards, self.older.shards, self.tombstones.shards, self.ghosts
        mask = self.entries.mask
        out: dict[bytes, float | None] = {}
        last: dict[bytes, Layout] = {}  # a key twice in the group: its first row is older
        for c in group:
            for key, lay in c.staged:
                i = hash(key) & mask
                older = olders[i]  # (the key's shard: KeyMap's, inlined)
                if older.get(key, _UNSET) is None:  # an older record that never expires: stays
                    continue  # so (its value is None whatever this row is: not written again)
                before = last.get(key)
                if before is None:
                    before = entries[i].get(key)
                last[key] = lay
                ghost: float | None = NO_GHOST
                if before is None and key not in tombs[i]:
                    if not ghosts.records:
                        continue
                    ghost = ghosts.until_of(ghost_hash(key))  # dropped, its record still there?
                    if ghost == NO_GHOST:
                        continue
                if key in out:
                    until = out[key]
                elif key in older:
                    until = older[key]
                elif before is not None:
                    until = before.expires_at
                elif ghost != NO_GHOST:
                    until = ghost
                else:
                    until = None  # after a delete
                if before is not None:
                    exp = before.expires_at
                    until = None if until is None or exp is None else max(until, exp)
                if key in out or key not in older or older[key] != until:  # (unchanged: not written again)
                    out[key] = until
        return out

    def _replaced_expiries(self, group: list[PendingCommit]) -> list[tuple[bytes, float]]:
        """(key, expiry) of the expiry entries the group's rows leave stale, for a store that
        keeps its expiry index by hand (RocksDB's): each key's entry before the group and
        the entries of its earlier rows in the group, but not its last row's."""
        final: dict[bytes, float | None] = {}
        rows = 0
        for c in group:
            rows += len(c.staged)
            for key, lay in c.staged:
                final[key] = lay.expires_at
        entries, mask = self.entries.shards, self.entries.mask
        out: list[tuple[bytes, float]] = []
        if rows == len(final):  # each key once: the common case
            for key, new in final.items():
                before = entries[hash(key) & mask].get(key)
                if before is not None and (exp := before.expires_at) is not None and exp != new:
                    out.append((key, exp))
            return out
        met: dict[bytes, set[float]] = {}  # a key's expiries before the group and in it
        for c in group:
            for key, lay in c.staged:
                if lay.expires_at is not None:
                    met.setdefault(key, set()).add(lay.expires_at)
        for key, new in final.items():
            before = entries[hash(key) & mask].get(key)
            olds = met.get(key, set())
            if before is not None and before.expires_at is not None:
                olds.add(before.expires_at)
            olds.discard(new)
            out += [(key, e) for e in olds]
        return out

    def _write_group(self, group: list[PendingCommit]) -> None:
        """One transaction for the group's rows (batch/always: not synced yet), then the
        index, in one step; the caller answers them."""
        rows = [c.rows for c in group if c.rows]  # (if_absent may have left nothing to write)
        older = self._older_after(group) if rows else {}
        replaced = self._replaced_expiries(group) if rows and self.store.expiry_index_by_hand else ()
        with self._writing():
            if rows:
                self.store.put_many(rows[0] if len(rows) == 1 else itertools.chain.from_iterable(rows),
                                    older.items(), replaced)
                self.commit_groups += 1
            if self.tombstones:  # a put of a deleted key: its new record is newer than the tombstone
                tombs, mask = self.tombstones.shards, self.tombstones.mask
                self.forget_tombstones([k for c in group for k, _ in c.staged if k in tombs[hash(k) & mask]])
        self.older.update(older)
        # the entries and the live bytes per chunk, key by key (add_live's, inlined: this runs
        # per committed key); seq_high once per chunk the group names (note_chunks' work)
        # and ``chunk_keys`` (index_chunks's, inlined too)
        entries, live, keys_in, mask = self.entries.shards, self.chunk_live, self.chunk_keys, self.entries.mask
        get, chunks, nbytes = live.get, set(), 0
        for c in group:
            for key, lay in c.staged:
                shard = entries[hash(key) & mask]
                old = shard.get(key)
                shard[key] = lay
                nbytes += lay.size
                overhead = RECORD_OVERHEAD_BYTES + len(key)
                if old is not None:
                    nbytes -= old.size
                    for e in old.extents:
                        n = e.length + overhead
                        for r in e.replicas:
                            live[r.chunk_id] = get(r.chunk_id, 0) - n
                    self.index_chunks(key, old, False)  # (an overwrite: not the common case)
                for e in lay.extents:
                    n = e.length + overhead
                    for r in e.replicas:
                        cid = r.chunk_id
                        live[cid] = get(cid, 0) + n
                        chunks.add(cid)
                        try:
                            keys_in[cid][key] = None
                        except KeyError:
                            keys_in[cid] = {key: None}
        self.value_bytes += nbytes
        if self.accessed:  # (its last access is its commit now: the layout's created)
            accessed, dirty = self.accessed.shards, self.dirty_access.shards
            for c in group:
                for key, _ in c.staged:
                    i = hash(key) & mask
                    if accessed[i].pop(key, None) is not None:
                        dirty[i].pop(key, None)
        self.note_chunk_ids(chunks)

    async def delete(self, keys: Sequence[bytes], tombstones: Sequence[Layout] = ()) -> int:
        """Remove keys; ``tombstones[i]`` (if given): where key ``i``'s tombstone was
        written, kept for each key removed (:mod:`kvfs.meta.tombstones`)."""
        where = dict(zip(keys, tombstones, strict=True)) if tombstones else None
        n = 0
        # WRITE_PAGE keys a transaction, the loop free between them (16,384 keys in one held
        # it 0.7-0.9 s at 300k keys, bench/RESULTS.md); a tombstone whose chunk GC retired
        # since DELETE checked it is not kept: its key goes as a GC drop does, its records
        # noted as ghosts
        async for page in pages(keys, WRITE_PAGE):
            if where and self.retired:
                for k in page:
                    if (lay := where.get(k)) is not None and self.dead_in(lay) is not None:
                        del where[k]
            n += len(self.remove(page, where, sync=False))
        await self._settled()  # (every change before it too: a delete of nothing waits for them)
        return n

    # tombstones (kvfs.meta.tombstones) -------------------------------------------------
    def forget_tombstones(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        self.store.forget_tombstones(keys)
        for k in keys:
            t = self.tombstones.pop(k, None)
            if t is not None:
                self.add_live(t.layout, -1, k)
                self.index_chunks(k, t.layout, False, self.tomb_chunks)

    def save_tombstones(self, keys: Iterable[bytes]) -> None:
        """Write moved tombstones, or raised horizons (one transaction, owed a sync: the
        caller settles)."""
        keys = list(keys)
        if not keys:
            return
        with self._writing(gc=True):
            self.store.put_tombstones((k, encode_layout(t.layout), encode_horizon(t.horizon))
                                      for k in keys if (t := self.tombstones.get(k)) is not None)

    def move_tombstones(self, staged: Sequence[tuple[bytes, Layout]]) -> None:
        """Point tombstones at their compacted copies (a GC relocation)."""
        for k, lay in staged:
            t = self.tombstones[k]
            self.add_live(t.layout, -1, k)
            self.index_chunks(k, t.layout, False, self.tomb_chunks)
            t.layout = lay
            self.add_live(lay, +1, k)
            self.index_chunks(k, lay, True, self.tomb_chunks)
        self.save_tombstones(k for k, _ in staged)

    # tombstones in GC's calls (storeapi.GcIndex; the Redis store keeps none) ------------
    async def tombstone_refs(self, chunks: Collection[int]) -> tuple[list[tuple[int, bytes, int]], int]:
        """(chunk, key, offset) of the kept tombstones in ``chunks`` (compaction copies them
        forward), after forgetting those no older record can outlive any more (how many).
        O(those tombstones), from ``tomb_chunks``, a page of :data:`WALK_PAGE` per step (a walk
        of every tombstone in one step held the loop 260-420 ms at 400k kept, bench/RESULTS.md);
        each tombstone as it is at its page's step.  The floors are taken once, at the start:
        a tombstone that passed then has passed for good (chunks only go, heartbeats only come)."""
        refs: list[tuple[int, bytes, int]] = []
        if not chunks or not self.tombstones:
            return refs, 0
        floor = floors(self.servers)
        done: list[tuple[bytes, Tomb]] = []
        tombs, keys_in = self.tombstones, self.tomb_chunks
        async for page in pages(list({k for c in chunks for k in keys_in.get(c, ())})):
            for k in page:
                t = tombs.get(k)
                if t is None:  # forgotten since the walk began (a put again)
                    continue
                mine = [r for r in t.layout.extents[0].replicas if r.chunk_id in chunks]
                if not mine:  # (moved out of them since)
                    continue
                if any(passed(t, floor, compacting=r.chunk_id) for r in mine):
                    done.append((k, t))  # needed no more: not copied
                    continue
                refs += [(r.chunk_id, k, r.offset) for r in mine]
        gone = [k for k, t in done if tombs.get(k) is t]  # (not one kept anew since: a delete after a put)
        if gone:
            with self._writing(gc=True):
                self.forget_tombstones(gone)
            await self._settled(gc=True)
        return refs, len(gone)

    async def tombstoned(self, keys: Iterable[bytes]) -> set[bytes]:
        """Those of ``keys`` deleted with a tombstone kept (and not put again)."""
        tombs = self.tombstones
        return {k for k in keys if k in tombs and k not in self.entries} if tombs else set()

    async def relocate_tombstones(self, sid: int, new_chunk: int,
                                  by_key: dict[bytes, dict[tuple[int, int], int]]) -> tuple[set[bytes], int]:
        """GC_RELOCATE's tombstones: point each copied tombstone at its copy, or raise the
        horizon of a deleted key whose older record was copied; (the keys handled here,
        the tombstone replicas moved)."""
        handled: set[bytes] = set()
        tombs: list[tuple[bytes, Layout]] = []
        raised: list[bytes] = []
        moved = 0
        for key in await self.tombstoned(by_key):
            handled.add(key)
            t = self.tombstones[key]
            mapping = by_key[key]
            reps = []
            n = 0
            for r in t.layout.extents[0].replicas:
                no = mapping.get((r.chunk_id, r.offset)) if r.server_id == sid else None
                reps.append(r if no is None else Replica(sid, new_chunk, no))
                n += no is not None
            if n:
                tombs.append((key, tomb_layout(reps, t.layout.created)))
                moved += n
            elif raise_horizon(t, new_chunk):  # an older record now in new_chunk
                raised.append(key)
        if tombs:
            self.move_tombstones(tombs)
        if raised:
            self.save_tombstones(raised)
        await self._settled(gc=True)
        return handled, moved

    async def raise_horizons(self, copies: Iterable[tuple[bytes, int]]) -> None:
        """A repair copied a record of a key deleted since the plan into that chunk: the
        key's tombstone must outlive it too."""
        raised = [k for k, cid in copies if k not in self.entries
                  and (t := self.tombstones.get(k)) is not None and raise_horizon(t, cid)]
        self.save_tombstones(raised)
        await self._settled(gc=True)

    async def drop_passed(self) -> int:
        """Forget the tombstones no older record of their key can outlive any more
        (:func:`kvfs.meta.tombstones.passed`; their bytes become garbage), a page of
        :data:`WALK_PAGE` a step, each forgotten in its page's transaction (a walk of every
        tombstone in one step held the loop 2.7-3.1 s with 400k passed, bench/RESULTS.md); how
        many.  The floors are taken once: a tombstone that passed then has passed for good.
        GC_DELETED asks after every batch a pass compacts, and a walk of every tombstone for
        each was 10 % of meta's CPU in the full-cluster soak (bench/RESULTS.md), so only what
        may have passed since the last walk is walked: every tombstone once a server's lowest
        chunks changed (or the servers did); once only chunk tables were heard, the
        tombstones younger than the oldest of those the last walk took (the others had been
        heard of then, and wait for a chunk to go); nothing when nothing changed.  No
        tombstone is ever moved below a floor; one whose horizon on a server is still open
        (that server unheard of at the delete) gets it at the walk that next checks it, at
        that server's highest chunk then, later than it might have: it passes no sooner."""
        floor, last = floors(self.servers), self._dropped_at
        if floor == last:
            return 0
        tombs, n = self.tombstones, 0
        todo: AsyncIterator[Sequence[bytes]]
        if last is None or last.keys() != floor.keys() or any(
                f.lowest != last[sid].lowest for sid, f in floor.items()):
            todo = walked(tombs)
        else:
            heard = min((f.heard for f in last.values()), default=0.0)
            todo = pages([k for since, k in self._young if since >= heard])
        async for page in todo:
            done = [k for k in page if (t := tombs.get(k)) is not None and passed(t, floor)]
            if done:
                with self._writing(gc=True):
                    self.forget_tombstones(done)
                n += len(done)
        self._dropped_at = floor
        heard = min((f.heard for f in floor.values()), default=float("inf"))
        young = self._young
        while young and young[0][0] < heard:  # heard of by every server: a chunk must go first
            young.popleft()
        await self._settled(gc=True)
        return n

    async def ghost_copies(self, copies: Iterable[tuple[bytes, int]]) -> None:
        """A record copied (compaction, repair) of a key dropped since without a tombstone
        kept: a dropped record in that chunk (its expiry unknown here: never)."""
        rows = [(c, ghost_hash(k), None) for k, c in copies if k not in self.tombstones]
        if rows:
            with self._writing(gc=True):
                self.store.put_ghosts(rows, self.ghosts.absent)
            self.ghosts.add(rows)
        await self._settled(gc=True)

    async def chunks_deleted(self, chunks: Collection[int]) -> None:
        """Chunks the GC deleted: the records of dropped keys in them are gone too."""
        if self.ghosts.forget(chunks):
            with self._writing():
                self.store.forget_ghosts(chunks)
        await self._settled()

    async def drop_lost(self, rows: Sequence[tuple[bytes, Layout]]) -> int:
        """Remove each key that still has the given layout (compare-and-swap: a key
        overwritten since is kept); returns how many were removed."""
        entries = self.entries
        doomed = [k for k, lay in rows if entries.get(k) == lay]
        n = len(self.remove(doomed))
        await self._settled(gc=True)
        return n

    async def list_keys(self, prefix: bytes, start_after: bytes | None,
                        limit: int) -> list[tuple[bytes, Layout]]:
        return self.store.list(prefix, start_after, limit)

    async def key_stats(self, now: float) -> tuple[int, int, int]:
        """(unexpired keys, stored keys, bytes of the unexpired values): the stored ones'
        counts less the expired ones not swept yet (:meth:`expired_rows`), no walk."""
        stored, nbytes, gone = len(self.entries), self.value_bytes, 0
        async for rows in self.expired_rows(now):
            gone += len(rows)
            nbytes -= sum(lay.size for _, lay in rows)
        return stored - gone, stored, nbytes

    async def server_live(self) -> dict[int, int]:
        """Each server's live bytes: its chunk table's chunks' (in memory)."""
        live = self.chunk_live
        return {sid: sum(live.get(c, 0) for c in s.chunks) for sid, s in self.servers.items()}

    async def live_bytes(self, chunks: Sequence[int] | None = None) -> dict[int, int]:
        if chunks is None:
            return self.chunk_live
        live = self.chunk_live
        return {c: live[c] for c in chunks if c in live}

    async def peek(self, keys: Sequence[bytes], now: float) -> list[Layout | None]:
        return [self.get(k, now) for k in keys]

    # GC's operations (storeapi.GcIndex; SharedIndex has them over its store) ----------
    async def refs(self, chunks: Collection[int] = (), servers: Collection[int] = (),
                   ) -> AsyncGenerator[list[tuple[bytes, Layout]], None]:
        """The keys of ``chunks``, and of every chunk on ``servers``, from ``chunk_keys``, a
        page per step: O(those keys).  A server's chunks are the indexed ones whose ids name
        it (:func:`~kvfs.layout.server_of_chunk`: meta takes no layout whose chunk id names
        another server than its replica's, :func:`~kvfs.layout.misfiled`), so a repair plan
        or a drain visits the keys on the gone servers, and a key repaired away from them
        leaves their chunks: the next plan does not visit it again.  The chunks are those
        indexed when the walk starts (a chunk first written to meanwhile is not visited)."""
        cs, ss = set(chunks), set(servers)
        if ss:
            cs.update(c for c in self.chunk_keys if server_of_chunk(c) in ss)
        entries, seen = self.entries, set[bytes]()
        for c in cs:
            async for page in pages(list(self.chunk_keys.get(c, ()))):
                yield [(k, lay) for k in page if k not in seen and (lay := entries.get(k)) is not None
                       and any(r.chunk_id in cs for x in lay.extents for r in x.replicas)]
                if len(cs) > 1:  # (a key with replicas in two of them: once)
                    seen.update(page)

    async def expired_rows(self, now: float) -> AsyncIterator[list[tuple[bytes, Layout]]]:
        """The keys expired at ``now``, with their layouts, from SQLite's expiry index
        (O(those keys)), a page of :data:`WALK_PAGE` per query and step."""
        entries, after = self.entries, None
        while rows := self.store.expired_after(now, WALK_PAGE, after):
            after = rows[-1]  # (SQLite's own order: the cursor moves whatever the index holds)
            yield [(k, lay) for _, k in rows if (lay := entries.get(k)) is not None and lay.expired(now)]
            await asyncio.sleep(0)

    async def lru_order(self, batch: int = 1000, after: tuple[float, bytes] | None = None,
                        ) -> AsyncIterator[list[tuple[bytes, Layout, float]]]:
        """Least recently used first (key, layout, last use), ``batch`` keys per step (only
        those after ``after``, a last use and key), going on from the order the
        last sort made (:class:`kvfs.meta.lruorder.LruOrder`: a walk that needs a few keys
        sorts none): a key read or put again since that sort comes after the keys it saw,
        as does one put since.  A sort takes each page of :data:`WALK_PAGE` keys by last
        access in a step of its own; the pages are merged as walks need them.  A key read
        or put again after its page was sorted is left out of that order (it is no longer
        where its page put it), as is one removed."""
        accessed, entries = self.accessed, self.entries

        def last_use(k: bytes) -> float | None:
            lay = entries.get(k)
            return None if lay is None else accessed.get(k, lay.created)

        async for keys in self._lru.walk(last_use, self._lru_pages, batch, WALK_PAGE, after):
            # (a key removed while the walk gave the loop back, its batch not yet whole: left out)
            yield [(k, lay, t) for k, t in keys if (lay := entries.get(k)) is not None]

    async def _lru_pages(self) -> list[tuple[array[float], tuple[bytes, ...]]]:
        """Every key's last use and the key, a page of :data:`WALK_PAGE` at a time, each
        page sorted in a step of its own (:meth:`lru_order`'s sort, merged as walks need)."""
        accessed, entries = self.accessed, self.entries
        out: list[tuple[array[float], tuple[bytes, ...]]] = []
        async for page in pages(await listed(entries)):
            rows = sorted((accessed.get(k, lay.created), k) for k in page if (lay := entries.get(k)) is not None)
            # (a tuple of bytes: the cycle collector untracks it at its first look, a list it walks)
            out.append((array("d", [t for t, _ in rows]), tuple([k for _, k in rows])))
        return out

    async def layouts(self, keys: Sequence[bytes]) -> list[Layout | None]:
        return [self.entries.get(k) for k in keys]

    async def leased(self, keys: Sequence[bytes], now: float) -> set[bytes]:
        """O(``keys``): the keys whose every lease ended are forgotten by :meth:`flush`
        (here, each of eviction's batches walked every leased key: quadratic)."""
        return {k for k in keys if self.lease_end(k) > now} if self.leases else set()

    async def expire(self, now: float, limit: int) -> tuple[list[tuple[bytes, Layout]], bool,
                                                            list[tuple[bytes, Layout]]]:
        keys = self.store.expired(now, limit)
        gone = []
        for k in keys:
            lay = self.entries.get(k)
            if lay is None or lay.expired(now):
                gone.append(k)
        shadowed = await self.shadowed(gone, now)
        kept = [(k, self.entries[k]) for k in gone if k in shadowed]
        removed = self.remove(k for k in gone if k not in shadowed)
        await self._settled(gc=True)
        return removed, len(keys) == limit, kept

    async def shadowed(self, keys: Iterable[bytes], now: float) -> set[bytes]:
        """Those of ``keys`` with an older record that a rebuild could still read (unexpired)
        once their current one is gone: the GC drops them with a tombstone."""
        older = self.older
        if not older:
            return set()
        return {k for k in keys if k in older and ((u := older[k]) is None or u > now)}

    async def drop_tombstoned(self, rows: Sequence[tuple[bytes, Layout, Layout]], now: float, *,
                              evict: bool) -> list[tuple[bytes, Layout]]:
        """Remove each key that still has the given layout and is still expired (``evict``:
        or unleased), keeping the tombstone the GC wrote for it (the third layout)."""
        keep: dict[bytes, Layout] = {}
        for k, lay, tomb in rows:
            if self.entries.get(k) == lay and (
                    lay.expired(now) or (evict and self.lease_end(k) <= now)):
                keep[k] = tomb
        removed = self.remove(list(keep), keep)
        await self._settled(gc=True)
        return removed

    async def evict(self, victims: Sequence[tuple[bytes, Layout]], now: float) -> list[tuple[bytes, Layout]]:
        """Each page of victims checked and removed in a step (and transaction) of its own:
        still that layout, and unleased and not read since ``now`` (when they were chosen,
        over many steps), or expired."""
        removed, accessed = [], self.accessed
        async for page in pages(victims):
            removed += self.remove([k for k, lay in page if self.entries.get(k) == lay and (
                lay.expired(now) or (self.lease_end(k) <= now and accessed.get(k, lay.created) <= now))])
        await self._settled(gc=True)
        return removed

    async def switch(self, rows: Sequence[tuple[bytes, Layout, Layout]]) -> list[bool]:
        """Compare-and-swap each key's layout, :data:`WRITE_PAGE` keys a transaction, the loop
        free between them (a repair's 16,384 switches in one held it 0.55-0.9 s at 300k keys,
        bench/RESULTS.md), synced once all are written; a key changed meanwhile keeps its
        change."""
        out = []
        async for page in pages(rows, WRITE_PAGE):
            staged: list[tuple[bytes, Layout, Layout]] = []
            for k, old, new in page:
                cur = self.entries.get(k)
                ok = cur is not None and cur == old and self.dead_in(new) is None
                out.append(ok)
                if ok:
                    assert cur is not None
                    staged.append((k, cur, new))
            self.switch_layouts(staged)
        await self._settled(gc=True)
        return out

    async def retire(self, server_id: int, chunks: Sequence[int], now: float) -> list[int]:
        live, dead = self.chunk_live, self.retired
        retired = [c for c in dict.fromkeys(chunks) if c in dead or live.get(c, 0) <= 0]
        fresh = [c for c in retired if c not in dead]
        if fresh:
            with self._writing(gc=True):
                self.store.add_dead((c, server_id, now) for c in fresh)
            for c in fresh:
                dead[c] = now
                live.pop(c, None)
        # on disk (an earlier call's retirements too) before the GC driver unlinks anything
        await self._settled(gc=True)
        return retired

    async def retired_among(self, chunks: Iterable[int]) -> set[int]:
        return {c for c in chunks if c in self.retired}

    async def retired_count(self) -> int:
        return len(self.retired)

    async def delete_server(self, server_id: int) -> None:
        self.servers.pop(server_id, None)
        await self._write(self.store.delete_server, server_id)

    async def get_state(self, name: str) -> Any:
        return self.store.get_state(name)

    async def put_state(self, name: str, value: Any) -> None:
        await self._write(self.store.put_state, name, value)

    async def add_counts(self, inc: dict[str, float], put: dict[str, float] | None = None) -> None:
        counts = self.store.get_state(METRICS_STATE) or {}
        for k, v in inc.items():
            counts[k] = counts.get(k, 0) + v
        counts.update(put or {})
        await self._write(self.store.put_state, METRICS_STATE, counts)

    async def counts(self) -> dict[str, float]:
        return dict(self.store.get_state(METRICS_STATE) or {})

    async def claim(self, name: str, holder: str, ttl_s: float) -> bool:
        t = time.monotonic()
        cur = self.claims.get(name)
        if cur is not None and cur[0] != holder and cur[1] > t:
            return False
        self.claims[name] = (holder, t + ttl_s)
        return True

    async def flush(self) -> None:
        """The index's upkeep every ``--access-flush-interval``: forget the keys whose every
        lease ended, then write the access times (``--fsync batch``/``always``: synced in
        the sync thread, off the loop), each a page per step (:func:`pages`: 100k keys
        read since the last flush took 1.6-2.1 s in one step at 1M keys), the access times
        a transaction a page; those are not written after a failed sync (nothing written
        since is durable).  A key read again meanwhile is written by the next flush; one
        put again, whose row's last access is its commit, keeps the later of the two
        (:meth:`MetaStore.touch_many`).  Those not written when it stops (cancelled at
        close, a failure) are handed back to ``dirty_access``, for close or the next."""
        now, leases = self.clock(), self.leases
        async for keys in walked(leases.ends):
            leases.forget_ended(keys, now)
        if self._wal.failed is not None:
            return
        dirty, self.dirty_access = self.dirty_access, KeyMap()
        try:
            # in key order: a page updates neighbouring rows, each of SQLite's pages once
            async for page in sorted_pages(await listed(dirty), lambda keys: ((k, dirty[k]) for k in keys)):
                with self._writing():
                    self.store.touch_many((t, k) for k, t in page)
                for k, _ in page:
                    del dirty[k]
                # synced before the next page, so the sync thread checkpoints the WAL as it
                # grows (a page of random keys rewrites some 1,000 of SQLite's pages), never
                # the loop's connection (LOOP_CHECKPOINT_FRAMES)
                await self._settled()
        except ServerError:  # its sync failed: logged, later changes refused
            pass
        finally:
            for k, t in dirty.items():  # (a key read again since keeps its later time)
                self.dirty_access.setdefault(k, t)

    async def close(self) -> None:
        if self._commit_handle is not None:
            self._commit_handle.cancel()
            self._commit_handle = None
        # queued COMMITs whose handlers still wait: written, synced and answered, not dropped
        # (a failed sync fails them); the sync in flight is waited for, so no thread is left
        while self._syncing is not None or self._commits:
            if self._commit_handle is not None:
                self._commit_handle.cancel()
                self._commit_handle = None
            if self._syncing is not None:
                await asyncio.wait([self._syncing])  # done once _synced answered
            else:
                self._write_commits()
        await self._wal.close()  # the syncs other changes wait for too; no thread left
        try:
            self.flush_access()
        except Exception as exc:  # (rocksdict raises plain Exception) e.g. the disk is full
            # a key's last access is an LRU hint: lost, its commit time orders it; the store
            # is still closed and the data directory unlocked
            log.warning("meta closes without writing %d keys' last access: %r",
                        len(self.dirty_access), exc)
        self.store.close()
