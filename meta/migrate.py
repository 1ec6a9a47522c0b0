"""``kvfs meta migrate``: move meta's index from one store to another, SQLite or RocksDB
to Redis Cluster or back, SQLite to RocksDB or back, or between two Redis stores (another
namespace: how a store made by an older kvfs, format 1 or 2, is brought to this kvfs's
format), with meta stopped.

What moves: every unexpired key with its layout (so its TTL) and its last access (the
LRU order), the cluster id, the chunkserver registry, the retired chunks (a late commit
naming one is still refused) and the GC state (paused, metrics, draining and
decommissioned servers).  Chunkservers' heartbeat times do not: they report again.
Between SQLite and RocksDB the delete tombstones, the ``older`` set (keys with older
records) and the dropped records meta keeps (:mod:`kvfs.meta.tombstones`) move too, as
they are.  To or from Redis they do not: the Redis store keeps none (README, "No
tombstones on Redis"), so a later ``kvfs meta rebuild`` may bring back keys deleted
before the migration; from Redis into SQLite or RocksDB every key is marked as having
older records (the GC then drops each once with a tombstone).

Memory stays bounded: keys stream in batches of ``batch`` (SQLite and RocksDB page by key,
Redis by its LRU index), each batch written before the next is read.

A target must be empty, or hold an unfinished migration of the same cluster: the
migration records its progress in the target's state (``migrated_from``: the source
cluster id, the last key written, done or not), so a run that stopped (^C, a crash)
is run again with the same arguments and continues (from SQLite or RocksDB: after the
last batch written; from Redis: from the start, every write an idempotent overwrite).
A target holding keys or a cluster id of anything else is refused by name, and so is
one whose migration finished.  The source is only read; a SQLite or RocksDB source's data dir
is locked for the run (a running meta there refuses it, and it refuses a meta).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfs.datadir import DirLock
from kvfs.errors import InvalidArgument
from kvfs.layout import Layout, decode_layout, encode_layout
from kvfs.meta.index import METRICS_STATE
from kvfs.meta.localstore import KINDS, open_local, store_path

MARK = "migrated_from"  # the target's state entry recording a migration's progress
Row = tuple[bytes, Layout, float]  # key, layout, last access


class MigrationRefused(InvalidArgument):
    """The target holds something else than an unfinished migration of this source."""


@dataclass
class MigrateReport:
    source: str
    target: str
    cluster_id: str
    keys: int = 0
    expired: int = 0  # expired at the migration's start: not moved
    servers: int = 0
    retired_chunks: int = 0
    state: int = 0
    resumed_after: bytes | None = None
    kept: int = 0  # tombstones, older records and dropped records copied (local to local)
    seconds: float = 0.0


def parse_spec(spec: str) -> tuple[str, str]:
    """``sqlite:PATH`` -> ("sqlite", PATH); ``rocksdb:PATH`` -> ("rocksdb", PATH);
    ``redis-cluster://...`` -> ("redis", URL)."""
    for kind in KINDS:
        if spec.startswith(f"{kind}:"):
            path = spec.removeprefix(f"{kind}:")
            if not path:
                raise InvalidArgument(f"bad store {spec!r}: expected {kind}:PATH (meta's data directory)")
            return kind, path
    if spec.startswith("redis-cluster://"):
        return "redis", spec
    raise InvalidArgument(f"bad store {spec!r:.200}: expected sqlite:PATH, rocksdb:PATH or "
                          "redis-cluster://HOST:PORT[,...]")


def _local_dir(path: str, kind: str) -> Path:
    """Meta's data dir: PATH is it, or its store (meta.sqlite3, meta.rocksdb)."""
    p = Path(path)
    return p.parent if p.name == store_path(p.parent, kind).name else p


class _Local:
    """A store in a meta data directory (:mod:`kvfs.meta.localstore`)."""

    def __init__(self, path: str, kind: str, *, source: bool) -> None:
        self.dir = _local_dir(path, kind)
        file = store_path(self.dir, kind)
        if source and not file.exists():
            raise InvalidArgument(f"no meta database at {file}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = DirLock(self.dir, "meta", hint="stop meta before migrating its index").acquire()
        try:
            self.store = open_local(self.dir, kind)
        except BaseException:
            self.lock.release()
            raise
        self.name = f"{kind}:{file}"
        self.mark_older = True  # as a target: False when the source is local too (migrate)

    async def close(self) -> None:
        self.store.close()
        self.lock.release()

    # reading
    async def cluster_id(self) -> str:
        return self.store.cluster_id()

    async def header(self) -> tuple[list[tuple[int, str, int, int]], list[tuple[int, int, float]], dict[str, Any]]:
        return self.store.load_servers(), self.store.load_dead(), self.store.all_state()

    async def rows(self, batch: int, after: bytes | None) -> AsyncIterator[list[Row]]:
        while True:
            got = self.store.rows_after(after, batch)
            if not got:
                return
            yield [(k, decode_layout(b), a) for k, b, _, a in got]
            after = got[-1][0]

    # writing
    async def count(self) -> int:
        return self.store.count()

    async def get_state(self, name: str) -> Any:
        return self.store.get_state(name)

    async def put_state(self, name: str, value: Any) -> None:
        self.store.put_state(name, value)

    async def existing_cluster_id(self) -> str | None:
        return self.store.stored_cluster_id()

    async def write_header(self, cid: str, servers: list[tuple[int, str, int, int]],
                           dead: list[tuple[int, int, float]], state: dict[str, Any]) -> None:
        self.store.cluster_id(create=cid)
        for row in servers:
            self.store.put_server(*row)
        self.store.add_dead(dead)
        for name, value in state.items():
            self.store.put_state(name, value)

    async def write_rows(self, rows: list[Row]) -> None:
        # ``mark_older``: the source (a Redis store) tracks no older records, so every key may
        # have some; a local source's own are copied after the rows instead (copy_kept)
        self.store.put_many(((k, encode_layout(lay), lay.expires_at, a) for k, lay, a in rows),
                            ((k, None) for k, _, _ in rows) if self.mark_older else ())

    async def copy_kept(self, src: _Local, batch: int) -> int:
        """The tombstones, older records and dropped records ``src`` keeps, as they are there,
        ``batch`` at a time (from one local store to the other: what keeps a deleted key
        deleted through a later rebuild); how many rows.  Those of keys not moved (expired)
        are forgotten by meta at its start, as after a crash."""
        n = 0
        tombs = ((k, encode_layout(lay), h) for k, lay, h in src.store.load_tombstones())
        while rows := list(itertools.islice(tombs, batch)):
            self.store.put_tombstones(rows)
            n += len(rows)
        older = src.store.load_older()
        while olds := list(itertools.islice(older, batch)):
            self.store.put_many((), olds)
            n += len(olds)
        ghosts = src.store.load_ghosts()
        while dropped := list(itertools.islice(ghosts, batch)):
            self.store.put_ghosts(dropped)
            n += len(dropped)
        return n


class _Redis:
    def __init__(self, url: str, namespace: str, *, source: bool = False) -> None:
        """A source may be a store made by an older kvfs (format 1 or 2): it is only read."""
        from kvfs.meta.redis_store import RedisMetaStore

        self.store = RedisMetaStore(url, namespace=namespace, read_old=source)
        self.name = f"{url} (namespace {namespace})"
        self.commit_concurrency = 32

    async def open(self) -> None:
        await self.store.open()

    async def close(self) -> None:
        await self.store.close()

    # reading
    async def cluster_id(self) -> str:
        return await self.existing_cluster_id() or await self.store.cluster_id()

    async def header(self) -> tuple[list[tuple[int, str, int, int]], list[tuple[int, int, float]], dict[str, Any]]:
        """As SQLite's: GC's counters (a hash of their own here) as the state entry
        ``metrics``."""
        state = await self.store.all_state()
        counts = await self.store.counts()
        if counts:
            state[METRICS_STATE] = counts
        return await self.store.servers(), await self.store.dead_rows(), state

    async def rows(self, batch: int, after: bytes | None) -> AsyncIterator[list[Row]]:
        """Every key, paged through the LRU index (its scores are the last accesses)."""
        cursor: tuple[float, bytes] | None = None
        while True:
            page = await self.store.lru(batch, cursor)
            if not page:
                return
            layouts = await self.store.peek([k for k, _ in page], time.time())
            yield [(k, lay, a) for (k, a), lay in zip(page, layouts, strict=True) if lay is not None]
            cursor = (page[-1][1], page[-1][0])

    # writing
    async def count(self) -> int:
        return await self.store.count()

    async def get_state(self, name: str) -> Any:
        return await self.store.get_state(name)

    async def put_state(self, name: str, value: Any) -> None:
        await self.store.put_state(name, value)

    async def existing_cluster_id(self) -> str | None:
        got = await self.store.r.get(self.store._g["cluster"])
        return None if got is None else got.decode()

    async def write_header(self, cid: str, servers: list[tuple[int, str, int, int]],
                           dead: list[tuple[int, int, float]], state: dict[str, Any]) -> None:
        await self.store.cluster_id(create=cid)
        for row in servers:
            await self.store.put_server(*row)
        known = await self.store.retired_among(c for c, _, _ in dead)
        groups: dict[tuple[int, float], list[int]] = defaultdict(list)
        for chunk, sid, at in dead:
            if chunk not in known:
                groups[sid, at].append(chunk)
        for (sid, at), chunks in groups.items():
            done = set(await self.store.retire(sid, chunks, at))
            if not done.issuperset(chunks):
                raise MigrationRefused(f"{self.name}: could not mark retired chunks "
                                       f"{sorted(set(chunks) - done)[:10]} dead (another GC holds the "
                                       "retire lock, or keys there use them); run again")
        state = dict(state)
        counts = state.pop(METRICS_STATE, None)
        if counts:  # where this store's GC reads them (a state entry, it restarted at 0)
            await self.store.add_counts({}, put=counts)
        for name, value in state.items():
            await self.store.put_state(name, value)

    async def write_rows(self, rows: list[Row]) -> None:
        by_expiry: dict[float | None, list[tuple[bytes, Layout]]] = defaultdict(list)
        for k, lay, _ in rows:
            by_expiry[lay.expires_at].append((k, lay))  # one commit stamps one expiry
        sem = asyncio.Semaphore(self.commit_concurrency)

        async def commit(group: list[tuple[bytes, Layout]]) -> None:
            async with sem:
                await self.store.commit(group, time.time())

        await asyncio.gather(*(commit(g) for g in by_expiry.values()))
        for k, _, a in rows:  # the source's last access, not the migration's
            await self.store.touch([k], a)
        await self.store.flush_access()


Store = _Local | _Redis


def _open(spec: str, namespace: str, *, source: bool) -> Store:
    kind, where = parse_spec(spec)
    return _Redis(where, namespace, source=source) if kind == "redis" else _Local(where, kind, source=source)


async def migrate(src_spec: str, dst_spec: str, *, from_namespace: str = "kvfs",
                  to_namespace: str = "kvfs", batch: int = 1000,
                  progress: Callable[[MigrateReport], None] | None = None,
                  progress_every: int = 100_000) -> MigrateReport:
    """Copy the index at ``src_spec`` into ``dst_spec`` (see the module's doc)."""
    if not 1 <= batch <= 100_000:
        raise InvalidArgument(f"--batch must be 1..100000, got {batch}")
    kinds = parse_spec(src_spec)[0], parse_spec(dst_spec)[0]
    if kinds[0] == kinds[1] != "redis":
        raise InvalidArgument(f"migrate moves between kinds of store (SQLite, RocksDB, Redis Cluster): "
                              f"--from and --to are both {kinds[0]} (copy a SQLite database with "
                              "kvfs meta backup)")
    if (src_spec, from_namespace) == (dst_spec, to_namespace):
        raise InvalidArgument("--from and --to are the same store: give another --to-namespace")
    t0 = time.perf_counter()
    src = _open(src_spec, from_namespace, source=True)
    try:
        dst = _open(dst_spec, to_namespace, source=False)
    except BaseException:
        await src.close()
        raise
    try:
        for s in (src, dst):
            if isinstance(s, _Redis):
                await s.open()
        if isinstance(src, _Local) and isinstance(dst, _Local):
            dst.mark_older = False  # the source's own older records are copied (copy_kept)
        cid = await src.cluster_id()
        rep = MigrateReport(src.name, dst.name, cid)
        mark = await dst.get_state(MARK)
        if mark is not None:
            if mark.get("cluster") != cid:
                raise MigrationRefused(f"{dst.name} holds a migration of cluster {mark.get('cluster')}, "
                                       f"not of {src.name} (cluster {cid})")
            if mark.get("done"):
                raise MigrationRefused(f"{dst.name} already holds the finished migration of {src.name} "
                                       f"({mark.get('keys')} keys); nothing to do")
        else:
            n = await dst.count()
            have = await dst.existing_cluster_id()
            if n or (have is not None and have != cid):
                raise MigrationRefused(f"{dst.name} is not empty ({n} keys, cluster id {have}): "
                                       "migrate into an empty store (another --to-namespace, or a "
                                       "fresh data directory)")
        servers, dead, state = await src.header()
        state.pop(MARK, None)
        await dst.write_header(cid, servers, dead, state)
        rep.servers, rep.retired_chunks, rep.state = len(servers), len(dead), len(state)
        after = None  # a SQLite source is read in key order: a second run continues after the last batch
        if mark is not None and isinstance(src, _Local) and mark.get("after") is not None:
            after = bytes.fromhex(mark["after"])
        rep.resumed_after = after
        keys = int(mark.get("keys", 0)) if after is not None and mark is not None else 0
        await dst.put_state(MARK, {"cluster": cid, "source": src.name, "done": False,
                                   "after": None if after is None else after.hex(), "keys": keys})
        now = time.time()
        next_report = progress_every
        async for rows in src.rows(batch, after):
            live = [r for r in rows if r[1].expires_at is None or r[1].expires_at > now]
            rep.expired += len(rows) - len(live)
            if live:
                await dst.write_rows(live)
            keys += len(live)
            rep.keys += len(live)
            if isinstance(src, _Local) and rows:
                await dst.put_state(MARK, {"cluster": cid, "source": src.name, "done": False,
                                           "after": rows[-1][0].hex(), "keys": keys})
            if progress is not None and rep.keys >= next_report:
                rep.seconds = time.perf_counter() - t0
                progress(rep)
                next_report += progress_every
        if isinstance(src, _Local) and isinstance(dst, _Local):
            rep.kept = await dst.copy_kept(src, batch)
        await dst.put_state(MARK, {"cluster": cid, "source": src.name, "done": True,
                                   "after": None, "keys": keys})
        rep.seconds = time.perf_counter() - t0
        return rep
    finally:
        await dst.close()
        await src.close()
