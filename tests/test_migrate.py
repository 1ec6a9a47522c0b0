"""`kvfs meta migrate`: a SQLite index moved to a real Redis Cluster (and back), then every
key read through a meta on the target, with real chunkservers on the same data dirs."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from kvfs.config import MetaConfig
from kvfs.launcher import LocalCluster
from kvfs.meta.index import METRICS_STATE
from kvfs.meta.migrate import MigrationRefused, migrate
from kvfs.meta.redis_local import LocalRedisCluster
from kvfs.meta.redis_store import RedisMetaStore
from kvfs.meta.store import MetaStore

pytestmark = pytest.mark.redis

HOUR = 3600.0


class Stop(Exception):
    """Fault injection: the migration stops after its first batch."""


def values(n: int, tag: bytes) -> dict[bytes, bytes]:
    return {b"%s/%04d" % (tag, i): b"%s-%d|" % (tag, i) * (1 + i % 7) for i in range(n)}


async def test_sqlite_index_moves_to_redis_and_back(tmp_path: Path, redis_cluster: LocalRedisCluster) -> None:
    root = tmp_path / "c"
    plain, ttl, gone = values(120, b"p"), values(30, b"t"), values(10, b"x")
    # meta's clock an hour behind: a 60 s TTL is past already when the migration runs
    on_sqlite = MetaConfig(data=root / "meta", listen="127.0.0.1:0", store="sqlite")
    async with LocalCluster(root, 2, meta=on_sqlite, clock=lambda: time.time() - HOUR) as c:
        async with c.client() as kv:
            await kv.put_many(list(plain.items()))
            await kv.put_many(list(ttl.items()), ttl=4 * HOUR)
            await kv.put_many(list(gone.items()), ttl=60)
            src_layouts = await kv.lookup(list(ttl), use_cache=False)
            listed = [e.key for e in await kv.list(b"")]
        cid = c.meta.cluster_id if c.meta else ""
    db = MetaStore(root / "meta" / "meta.sqlite3")
    db.add_dead([(987654321, 1, 1234.5)])  # a retired chunk, and some GC state
    db.put_state("paused", True)
    metrics = {"keys_expired": 7, "passes": 3, "pass_duration_s": 1.5}  # GC's counters
    db.put_state(METRICS_STATE, metrics)
    src_rows = {k: (b, e, a) for k, b, e, a in db.rows_after(None, 10_000)}
    db.close()

    ns = "mig" + uuid.uuid4().hex[:8]
    url = redis_cluster.url
    seen: list[int] = []

    def stop_once(rep: object) -> None:
        seen.append(1)
        if len(seen) == 1:
            raise Stop

    with pytest.raises(Stop):  # stopped part-way: a second run continues
        await migrate(f"sqlite:{root / 'meta'}", url, to_namespace=ns, batch=50, progress=stop_once,
                      progress_every=50)
    rep = await migrate(f"sqlite:{root / 'meta'}", url, to_namespace=ns, batch=50)
    assert rep.resumed_after is not None and rep.cluster_id == cid
    assert (rep.servers, rep.retired_chunks, rep.expired) == (2, 1, len(gone))
    assert rep.keys == len(plain) + len(ttl) - 50  # the first run's 50 were not read again

    store = RedisMetaStore(url, namespace=ns)
    await store.open()
    try:
        assert await store.count() == len(plain) + len(ttl)
        assert (987654321, 1, 1234.5) in await store.dead_rows()
        assert await store.get_state("paused") is True
        assert await store.cluster_id() == cid
        assert await store.counts() == metrics  # where the GC reads them (not a state entry)
        assert METRICS_STATE not in await store.all_state()
        # the LRU order and times are the source's
        lru = await store.lru(10_000)
        assert {k: a for k, a in lru} == {k: a for k, (_, e, a) in src_rows.items() if k not in gone}
    finally:
        await store.close()

    # a meta on the target, the same chunkservers: every key reads back, the TTLs kept
    meta = MetaConfig(data=root / "meta-redis", listen="127.0.0.1:0", store=url, store_namespace=ns)
    async with LocalCluster(root, 2, meta=meta) as c2, c2.client() as kv:
        assert await kv.get_many(list(plain)) == list(plain.values())
        assert await kv.get_many(list(ttl)) == list(ttl.values())
        assert await kv.get_many(list(gone)) == [None] * len(gone)
        assert await kv.lookup(list(ttl), use_cache=False) == src_layouts
        assert [e.key for e in await kv.list(b"")] == [k for k in listed if k not in gone]

    # done once: again is refused; so is a target holding anything else
    with pytest.raises(MigrationRefused, match="already holds the finished migration"):
        await migrate(f"sqlite:{root / 'meta'}", url, to_namespace=ns)
    other = tmp_path / "other"
    async with LocalCluster(other, 1, meta=replace(on_sqlite, data=other / "meta")) as c3, c3.client() as kv:
        await kv.put(b"k", b"v")
    with pytest.raises(MigrationRefused, match=r"holds a migration of cluster .*, not of sqlite:"):
        await migrate(f"sqlite:{other / 'meta'}", url, to_namespace=ns)
    busy = RedisMetaStore(url, namespace=ns + "b")  # a store in use: one key
    await busy.open()
    try:
        lay = src_layouts[0]
        assert lay is not None
        await busy.commit([(b"someone/else", lay)], time.time())
    finally:
        await busy.close()
    with pytest.raises(MigrationRefused, match=r"is not empty \(1 keys, cluster id None\)"):
        await migrate(f"sqlite:{other / 'meta'}", url, to_namespace=ns + "b")

    # and back: Redis to a fresh SQLite directory, every row as it is there now (the reads
    # above moved the last accesses on)
    store = RedisMetaStore(url, namespace=ns)
    await store.open()
    try:
        accessed = dict(await store.lru(10_000))
        counts = await store.counts()
        assert counts.items() >= metrics.items()
    finally:
        await store.close()
    back = tmp_path / "back"
    rep = await migrate(url, f"sqlite:{back}", from_namespace=ns)
    assert rep.keys == len(plain) + len(ttl) and rep.cluster_id == cid
    db = MetaStore(back / "meta.sqlite3")
    try:
        assert {k: (b, e, a) for k, b, e, a in db.rows_after(None, 10_000)} == \
            {k: (b, e, accessed[k]) for k, (b, e, _) in src_rows.items() if k not in gone}
        assert db.cluster_id() == cid and db.get_state("paused") is True
        assert db.get_state(METRICS_STATE) == counts
        assert (987654321, 1, 1234.5) in db.load_dead()
    finally:
        db.close()


def test_cli_refuses_bad_stores_by_name(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvfs", "meta", "migrate", *args],
                              capture_output=True, text=True, timeout=60)

    r = run("--from", f"sqlite:{tmp_path / 'none'}", "--to", "redis-cluster://127.0.0.1:1")
    assert r.returncode == 1 and f"no meta database at {tmp_path / 'none' / 'meta.sqlite3'}" in r.stderr
    r = run("--from", "mysql://x", "--to", "redis-cluster://127.0.0.1:1")
    assert r.returncode == 1 and ("bad store 'mysql://x': expected sqlite:PATH, rocksdb:PATH or "
                                  "redis-cluster://") in r.stderr
    r = run("--from", "sqlite:a", "--to", "sqlite:b")
    assert r.returncode == 1 and "--from and --to are both sqlite" in r.stderr
    r = run("--from", "rocksdb:a", "--to", "rocksdb:b")
    assert r.returncode == 1 and "--from and --to are both rocksdb" in r.stderr
    r = run("--from", "redis-cluster://127.0.0.1:1", "--to", "redis-cluster://127.0.0.1:1")
    assert r.returncode == 1 and "--from and --to are the same store" in r.stderr
