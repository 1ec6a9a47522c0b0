"""The ``MetaStore`` interface: every operation meta needs from where its index lives.

Two implementations: SQLite with meta's in-memory index in front (the embedded
default; today ``kvfs.meta.store`` + ``kvfs.meta.service``'s index) and Redis Cluster
(:mod:`kvfs.meta.redis_store`), where meta processes keep no index of their own and
several can serve one store.

Every call is batched and async.  Times are meta's clock (``now`` is passed in, so a
test's fake clock governs expiry and leases on every backend).  Each destructive call
is a compare-and-swap and says what it compares; on SQLite it is one transaction in one
event-loop step, on Redis one Lua script per Redis master (see the backend's notes on
what holds per key rather than per batch).
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvfs.layout import Layout

if TYPE_CHECKING:
    from kvfs.config import MetaConfig
    from kvfs.meta.index import ServerInfo


OVERFLOW_HOLDER = "*"  # a lease past a key's max_holders (no request can name it: kvfs.rpc.Holder)


class Lease(NamedTuple):
    """A lease a lookup asks for, on the keys it finds: ``holder``'s, until ``until``
    (meta's clock).  A key holds one lease per holder (each only ever lengthened); it is
    leased while any of them is unexpired.  A key that already has ``max_holders`` other
    holders' unexpired leases gets this one as :data:`OVERFLOW_HOLDER`'s instead: it pins
    the key until it runs out, and no release ends it."""

    holder: str
    until: float
    max_holders: int


class MetaStore(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def cluster_id(self, *, create: str | None = None) -> str:
        """This cluster's id, made once (``create`` gives it, default a random one)."""

    # keys ------------------------------------------------------------------------------
    async def commit(self, rows: Sequence[tuple[bytes, Layout]], now: float, *,
                     if_absent: bool = False) -> builtins.list[int]:
        """Store stamped layouts (overwrites replace; the old layout's bytes stop being
        live).  Raises :class:`kvfs.errors.StaleLayout` for a layout naming a retired
        chunk: that key is not committed.  ``if_absent``: a key present and unexpired at
        ``now`` keeps its value, as does a repeated key after its first row; returns the
        indexes of the rows not committed (always none without ``if_absent``)."""

    async def lookup(self, keys: Sequence[bytes], now: float,
                     lease: Lease | None = None) -> list[Layout | None]:
        """Layouts of unexpired keys (None for a miss); records the access (LRU); takes
        ``lease`` on the keys found."""

    async def peek(self, keys: Sequence[bytes], now: float) -> list[Layout | None]:
        """Layouts of unexpired keys, recording no access."""

    async def exists(self, keys: Sequence[bytes], now: float,
                     lease: Lease | None = None) -> list[bool]:
        """Which keys are present and unexpired; takes ``lease`` on those."""

    async def lease(self, keys: Sequence[bytes], now: float, lease: Lease) -> None:
        """Keep keys from eviction by ``lease`` (never shortening its holder's longer one)."""

    async def release(self, keys: Sequence[bytes], holder: str) -> int:
        """End ``holder``'s leases of keys (others' stay); returns how many it had one on."""

    async def get(self, keys: Sequence[bytes]) -> list[Layout | None]:
        """Stored layouts, expired ones included, recording no access (GC)."""

    async def leases(self, keys: Sequence[bytes]) -> dict[bytes, float]:
        """key -> the latest end of its holders' leases, of those of ``keys`` that hold one
        (it may have passed)."""

    async def match_prefix(self, keys: Sequence[bytes], now: float,
                           lease: Lease | None = None) -> int:
        """How many leading keys are present and unexpired; takes ``lease`` on them."""

    async def delete(self, keys: Sequence[bytes]) -> list[tuple[bytes, Layout]]:
        """Remove keys; returns the removed ones with their layouts."""

    async def list(self, prefix: bytes, start_after: bytes | None,
                   limit: int) -> list[tuple[bytes, Layout]]:
        """Keys starting with ``prefix`` after ``start_after``, in byte order, at most
        ``limit`` (expired ones included: the caller filters)."""

    async def touch(self, keys: Sequence[bytes], now: float) -> None: ...

    async def flush_access(self) -> None:
        """Write buffered access times (lookups record them in memory first)."""

    def scan(self, batch: int = 1000) -> AsyncIterator[builtins.list[tuple[bytes, Layout]]]:
        """Every stored key with its layout, in batches, no order (GC status, refs)."""

    # garbage collection ----------------------------------------------------------------
    async def expired(self, now: float, limit: int) -> builtins.list[bytes]:
        """Keys whose expiry passed, oldest expiry first (approximately across buckets)."""

    async def remove_expired(self, keys: Sequence[bytes], now: float) -> builtins.list[tuple[bytes, Layout]]:
        """Remove those of ``keys`` still expired at ``now`` (an overwrite since wins)."""

    async def lru(self, limit: int,
                  after: tuple[float, bytes] | None = None) -> builtins.list[tuple[bytes, float]]:
        """(key, last_access) least recently used first, after the ``after`` cursor."""

    async def evict(self, victims: Sequence[tuple[bytes, Layout]], now: float) -> builtins.list[tuple[bytes, Layout]]:
        """Remove each victim only if it still has that layout and no holder's lease past
        ``now``."""

    async def chunk_live(self, chunks: Sequence[int] | None = None) -> dict[int, int]:
        """Live bytes per chunk (every replica's value + record header + key), derived
        from the layouts; only chunks with live bytes, or only ``chunks``."""

    async def switch(self, rows: Sequence[tuple[bytes, Layout, Layout]]) -> builtins.list[bool]:
        """Compare-and-swap (key, expected, new): replaced only where the key still has
        exactly ``expected`` and ``new`` names no retired chunk (relocation, fsck)."""

    async def retire(self, server_id: int, chunks: Sequence[int], now: float) -> builtins.list[int]:
        """Mark chunks dead, only those no layout references; a dead chunk is refused
        by :meth:`commit` and :meth:`switch` forever after.  Returns the dead ones of
        ``chunks`` (retired now or before)."""

    async def dead_chunks(self) -> dict[int, float]:
        """Retired chunk -> when (every one: ``kvfs meta migrate``, tests)."""

    async def retired_among(self, chunks: Iterable[int]) -> set[int]:
        """Those of ``chunks`` that are retired (reads only those)."""

    async def retired_count(self) -> int: ...

    # registry and state ----------------------------------------------------------------
    async def servers(self) -> builtins.list[tuple[int, str, int, int]]:
        """(server_id, addr, capacity, free) of every registered chunkserver."""

    async def put_server(self, server_id: int, addr: str, capacity: int, free: int, key: str = "") -> None: ...

    async def registry(self) -> tuple[builtins.list[tuple[int, str, int, int, str]], dict[int, float]]:
        """(server_id, addr, capacity, free, data dir's key) of every registered chunkserver,
        and server_id -> its last heartbeat to any meta process sharing this store (wall
        clock): what a meta reads every ``registry_refresh_s``, in one round trip."""

    async def claim_server(self, server_id: int, addr: str) -> bool:
        """Take ``server_id`` for a new chunkserver at ``addr``; False if it is taken."""

    async def put_seen(self, server_id: int, at: float) -> None:
        """A chunkserver's heartbeat reached a meta process at ``at`` (wall clock)."""

    async def delete_server(self, server_id: int) -> None: ...

    async def get_state(self, name: str) -> Any: ...

    async def put_state(self, name: str, value: Any) -> None: ...

    async def add_counts(self, inc: dict[str, float], put: dict[str, float] | None = None) -> None:
        """Add to GC's counters (set those in ``put``); several metas add at once."""

    async def counts(self) -> dict[str, float]: ...

    async def claim(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew a lease for ``holder`` unless another holds it (expires by itself)."""

    async def count(self) -> int:
        """Keys stored (expired ones included)."""


class GcIndex(Protocol):
    """What meta's GC (:class:`kvfs.meta.gc.MetaGc`) works on: an index of keys with the
    chunkserver registry beside it.  Two implement it, so there is one GC for both
    backends: :class:`kvfs.meta.index.MetaIndex` (every key in memory over SQLite; a call
    that walks every key takes one loop step per page of them, ``WALK_PAGE``) and
    :class:`kvfs.meta.shared_index.SharedIndex` (a shared :class:`MetaStore`, Redis
    Cluster: each call one Lua script per involved master).
    Every destructive call is a compare-and-swap, so several GCs, in one meta or in
    several metas sharing a store, never undo each other's or a writer's change."""

    servers: dict[int, ServerInfo]
    config: MetaConfig

    def clock(self) -> float: ...

    def alive(self, s: ServerInfo) -> bool: ...

    def gone_servers(self) -> set[int]: ...

    def used(self, s: ServerInfo) -> int: ...

    async def refresh(self) -> None: ...

    async def list_keys(self, prefix: bytes, start_after: bytes | None,
                        limit: int) -> builtins.list[tuple[bytes, Layout]]:
        """Up to ``limit`` stored keys (expired ones included) under ``prefix`` after
        ``start_after``, in key order, with their layouts: O(the page) on either store."""

    def refs(self, chunks: Collection[int] = (), servers: Collection[int] = (),
             ) -> AsyncGenerator[builtins.list[tuple[bytes, Layout]], None]:
        """Every stored key (expired ones included) with a replica in one of ``chunks`` or on
        one of ``servers``, with its layout, each once, in batches (compaction's references,
        repair plans, drains).  Over Redis read from its chunk index: O(those keys)."""

    def expired_rows(self, now: float) -> AsyncIterator[builtins.list[tuple[bytes, Layout]]]:
        """Every stored key expired at ``now`` with its layout, in batches (dry runs, status).
        Over Redis read from its expiry index: O(those keys)."""

    async def key_stats(self, now: float) -> tuple[int, int, int]:
        """(unexpired keys, stored keys, bytes of the unexpired values); over Redis from
        counters, plus the keys expired but not swept yet."""

    def lru_order(self, batch: int = 1000, after: tuple[float, bytes] | None = None,
                  ) -> AsyncIterator[builtins.list[tuple[bytes, Layout, float]]]:
        """Every key with its layout and last use, least recently used first, in batches
        (``after``: only those after that last use and key)."""

    async def layouts(self, keys: Sequence[bytes]) -> builtins.list[Layout | None]:
        """Stored layouts (expired ones included), recording no access."""

    async def peek(self, keys: Sequence[bytes], now: float) -> builtins.list[Layout | None]: ...

    async def leased(self, keys: Sequence[bytes], now: float) -> set[bytes]:
        """Those of ``keys`` under some holder's lease past ``now``."""

    async def expire(self, now: float, limit: int) -> tuple[builtins.list[tuple[bytes, Layout]], bool,
                                                            builtins.list[tuple[bytes, Layout]]]:
        """Remove up to ``limit`` keys expired at ``now``: (the removed ones, more may be left,
        those left for a tombstone: :meth:`shadowed`)."""

    async def evict(self, victims: Sequence[tuple[bytes, Layout]],
                    now: float) -> builtins.list[tuple[bytes, Layout]]:
        """Remove each victim still with that layout and no holder's lease past ``now`` (or
        expired)."""

    async def drop_lost(self, rows: Sequence[tuple[bytes, Layout]]) -> int:
        """Remove each key that still has the given layout, leased or not."""

    async def shadowed(self, keys: Iterable[bytes], now: float) -> set[bytes]:
        """Those of ``keys`` with an older record a rebuild could read once the current one
        is gone: the GC removes them only with a tombstone (:meth:`drop_tombstoned`)."""

    async def drop_tombstoned(self, rows: Sequence[tuple[bytes, Layout, Layout]], now: float, *,
                              evict: bool) -> builtins.list[tuple[bytes, Layout]]:
        """(key, layout, tombstone): remove each key still with that layout and expired (or,
        ``evict``, with no lease past ``now``), keeping its tombstone."""

    async def switch(self, rows: Sequence[tuple[bytes, Layout, Layout]]) -> builtins.list[bool]:
        """(key, expected, new): replaced where the key still has ``expected`` and ``new``
        names no retired chunk."""

    async def live_bytes(self, chunks: Sequence[int] | None = None) -> dict[int, int]: ...

    async def server_live(self) -> dict[int, int]:
        """Live bytes on each registered server (``kvfs stat``, ``kvfs gc status``); over
        Redis from per-bucket counters, never a read of every chunk."""

    async def retire(self, server_id: int, chunks: Sequence[int], now: float) -> builtins.list[int]:
        """Mark dead those of ``chunks`` no layout references; the dead ones of ``chunks``."""

    async def retired_among(self, chunks: Iterable[int]) -> set[int]:
        """Those of ``chunks`` that are retired (refused by commit and switch forever)."""

    async def retired_count(self) -> int: ...

    async def delete_server(self, server_id: int) -> None: ...

    # the tombstones of deleted keys an index keeps (kvfs.meta.tombstones; SQLite only)
    async def tombstone_refs(self, chunks: Collection[int]) -> tuple[builtins.list[tuple[int, bytes, int]], int]:
        """(chunk, key, offset) of kept tombstones in ``chunks``; how many were forgotten."""

    async def tombstoned(self, keys: Iterable[bytes]) -> set[bytes]: ...

    async def relocate_tombstones(self, sid: int, new_chunk: int, by_key: dict[bytes, dict[tuple[int, int], int]],
                                  ) -> tuple[set[bytes], int]:
        """Move copied tombstones (GC_RELOCATE): (keys handled, replicas moved)."""

    async def raise_horizons(self, copies: Iterable[tuple[bytes, int]]) -> None: ...

    async def drop_passed(self) -> int:
        """Forget tombstones no older record can outlive any more; how many."""

    async def chunks_deleted(self, chunks: Collection[int]) -> None:
        """Chunks the GC deleted (the records of dropped keys in them: SQLite's ghosts)."""

    async def ghost_copies(self, copies: Iterable[tuple[bytes, int]]) -> None:
        """(key, chunk): a compaction or repair copied a record of a key dropped since (not
        deleted with a tombstone kept): a dropped record, in that chunk."""

    async def get_state(self, name: str) -> Any: ...

    async def put_state(self, name: str, value: Any) -> None: ...

    async def add_counts(self, inc: dict[str, float], put: dict[str, float] | None = None) -> None:
        """Add to GC's counters (and set those in ``put``), atomically against other metas."""

    async def counts(self) -> dict[str, float]: ...

    async def claim(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take (or renew) the lease ``name`` for ``holder`` for ``ttl_s`` unless another
        holder has it: the GC daemons of the metas sharing a store run one at a time."""
