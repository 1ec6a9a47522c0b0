"""The Redis Cluster meta store against a real 3-master cluster (``redis-server``)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from kvfs.errors import InvalidArgument, StaleLayout, Unavailable
from kvfs.layout import Extent, Layout, Replica
from kvfs.meta.redis_local import LocalRedisCluster, _command
from kvfs.meta.redis_store import (
    RedisMetaStore,
    decode_value,
    encode_value,
    live_contrib,
    parse_url,
)
from kvfs.meta.storeapi import Lease

pytestmark = pytest.mark.redis

NOW = 1_800_000_000.0
BIG = (5000 << 40) | 12345  # a chunk id past 2**53: Lua must never turn it into a double


def lay(*replicas: tuple[int, int, int], size: int = 100, expires_at: float | None = None,
        created: float = NOW) -> Layout:
    """One extent of ``size`` bytes with the given (server, chunk, offset) replicas."""
    return Layout(size, 7, created, expires_at,
                  (Extent(size, 9, tuple(Replica(*r) for r in replicas)),))


def expected_live(rows: dict[bytes, Layout]) -> dict[int, int]:
    out: dict[int, int] = {}
    for k, v in rows.items():
        for c, n in live_contrib(k, v).items():
            out[c] = out.get(c, 0) + n
    return out


def test_value_codec_round_trips_big_chunk_ids() -> None:
    v = lay((5000, BIG, 2**40), expires_at=NOW + 0.125)
    enc = encode_value(b"k", v)
    assert decode_value(enc) == v
    assert str(BIG).encode() in enc.split(b"|")[0]


def test_url_parsing() -> None:
    assert parse_url("redis-cluster://127.0.0.1:7000,h:7001") == [("127.0.0.1", 7000), ("h", 7001)]
    for bad in ("redis://h:1", "redis-cluster://", "redis-cluster://h"):
        with pytest.raises(InvalidArgument):
            parse_url(bad)


def test_a_cluster_needs_three_masters(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 3 masters"):
        LocalRedisCluster(tmp_path, masters=2).start()


def test_a_bad_timeout_is_refused_by_name() -> None:
    for bad in (0.0, -1.0, 1e9):
        with pytest.raises(InvalidArgument, match="--store-timeout"):
            RedisMetaStore("redis-cluster://127.0.0.1:1", timeout_s=bad)


async def test_a_hung_master_makes_calls_unavailable_not_wait(tmp_path: Path) -> None:
    """A master that stops answering (SIGSTOP: hung, or cut off by the network) makes each
    call fail as ``Unavailable`` within a few store timeouts: while the other masters still
    count it alive, and once they declare the cluster down (a script then answers "cluster
    is down").  After SIGCONT the same store serves again.  Before the store bounded its
    calls, redis-py's retries and slot-map reads took a minute per call on a stopped
    master, and the second call raised a raw ``ResponseError``."""
    with LocalRedisCluster(tmp_path) as rc:
        store = RedisMetaStore(rc.url, namespace="hung", buckets=16, timeout_s=0.5)
        await store.open()
        try:
            rows = {b"k%d" % i: lay((1, 10, i * 100)) for i in range(64)}
            await store.commit(list(rows.items()), NOW)
            victim, others = rc.nodes[0], rc.nodes[1:]
            os.kill(victim.proc.pid, signal.SIGSTOP)
            try:
                async with asyncio.timeout(60):  # a hang guard: the property is that calls end
                    with pytest.raises(Unavailable):
                        await store.lookup(list(rows), NOW)
                    while not all(b"cluster_state:fail" in (_command(n.port, b"CLUSTER", b"INFO") or b"")
                                  for n in others):  # past cluster-node-timeout (2 s)
                        await asyncio.sleep(0.1)
                    nm = store.r.nodes_manager  # keys whose bucket a live master serves:
                    live = [k for k in rows  # a script there answers "cluster is down"
                            if nm.get_node_from_slot(store._slots[store.bucket(k)]).port != victim.port]
                    assert live
                    with pytest.raises(Unavailable, match="cluster is down"):
                        await store.lookup(live, NOW)
                    with pytest.raises(Unavailable):
                        await store.commit([(b"new", lay((1, 11, 0)))], NOW)
            finally:
                os.kill(victim.proc.pid, signal.SIGCONT)
            rc.wait_ok()
            deadline = time.monotonic() + 60
            while True:
                try:
                    assert await store.lookup(list(rows), NOW) == list(rows.values())
                    break
                except Unavailable:
                    assert time.monotonic() < deadline, "the store never served again after SIGCONT"
                    await asyncio.sleep(0.1)
        finally:
            await store.close()


async def test_layouts_round_trip_across_buckets(redis_store: RedisMetaStore) -> None:
    s = redis_store
    rows = {f"key-{i}".encode(): lay((1, 10 + i % 3, i * 100), size=i + 1) for i in range(60)}
    rows[b"big"] = lay((5000, BIG, 0), (2, 20, 4096))
    await s.commit(list(rows.items()), NOW)
    assert len({s.bucket(k) for k in rows}) > 8  # the batch spans buckets (and so nodes)
    keys = [*rows, b"missing"]
    assert await s.lookup(keys, NOW) == [*rows.values(), None]
    assert await s.exists(keys, NOW) == [True] * len(rows) + [False]
    assert await s.count() == len(rows)
    assert await s.match_prefix([b"key-0", b"key-1", b"nope", b"key-2"], NOW) == 2
    seen = {k: v async for batch in s.scan(batch=7) for k, v in batch}
    assert seen == rows


async def test_expiry_is_exact_with_meta_clock(redis_store: RedisMetaStore) -> None:
    s = redis_store
    await s.commit([(b"a", lay((1, 1, 0), expires_at=NOW + 10)),
                    (b"b", lay((1, 1, 200), expires_at=NOW + 10))], NOW)
    await s.commit([(b"c", lay((1, 1, 400)))], NOW)
    assert await s.exists([b"a", b"c"], NOW + 9.999) == [True, True]
    assert await s.lookup([b"a", b"c"], NOW + 10) == [None, lay((1, 1, 400))]
    assert await s.match_prefix([b"a"], NOW + 10) == 0
    assert sorted(await s.expired(NOW + 10, 100)) == [b"a", b"b"]
    assert await s.expired(NOW + 9, 100) == []
    # b is overwritten without a TTL before the sweep: the sweep must not remove it
    await s.commit([(b"b", lay((1, 2, 0)))], NOW + 11)
    gone = await s.remove_expired([b"a", b"b"], NOW + 11)
    assert [k for k, _ in gone] == [b"a"]
    assert await s.lookup([b"a", b"b"], NOW + 11) == [None, lay((1, 2, 0))]
    assert await s.expired(NOW + 100, 100) == []


async def test_live_bytes_follow_commits_overwrites_and_deletes(redis_store: RedisMetaStore) -> None:
    s = redis_store
    rows = {f"k{i}".encode(): lay((1, 100 + i % 4, i * 512), (2, BIG + i % 2, i * 512), size=300 + i)
            for i in range(40)}
    await s.commit(list(rows.items()), NOW)
    assert await s.chunk_live() == expected_live(rows)
    over = {k: lay((3, 200, 0), size=50) for k in list(rows)[:10]}
    await s.commit(list(over.items()), NOW)
    rows.update(over)
    assert await s.chunk_live() == expected_live(rows)
    gone = await s.delete([*list(rows)[5:15], b"never"])
    assert sorted(k for k, _ in gone) == sorted(list(rows)[5:15])
    for k in list(rows)[5:15]:
        del rows[k]
    assert await s.chunk_live() == expected_live(rows)
    assert await s.chunk_live([100, BIG, 999]) == {c: n for c, n in expected_live(rows).items()
                                                   if c in (100, BIG)}
    await s.delete(list(rows))
    assert await s.chunk_live() == {}


async def test_switch_is_a_compare_and_swap(redis_store: RedisMetaStore) -> None:
    s = redis_store
    old = lay((1, 10, 0))
    await s.commit([(b"k", old), (b"j", old)], NOW)
    moved = lay((1, 11, 64))
    # a stale source (the key was overwritten since the copy) is refused
    newer = lay((1, 12, 0))
    await s.commit([(b"j", newer)], NOW + 1)
    assert await s.switch([(b"k", old, moved), (b"j", old, moved), (b"gone", old, moved)]) == [
        True, False, False]
    assert await s.lookup([b"k", b"j"], NOW + 1) == [moved, newer]
    assert await s.chunk_live() == expected_live({b"k": moved, b"j": newer})
    # a switch into a retired chunk is refused too
    assert await s.retire(1, [13], NOW) == [13]
    assert await s.switch([(b"k", moved, lay((1, 13, 0)))]) == [False]
    assert await s.lookup([b"k"], NOW + 1) == [moved]


async def test_retire_refuses_live_chunks_and_commits_refuse_dead_ones(
        redis_store: RedisMetaStore) -> None:
    s = redis_store
    await s.commit([(f"k{i}".encode(), lay((1, 10, i * 200))) for i in range(20)], NOW)
    assert await s.retire(1, [10, 11, BIG], NOW) == [11, BIG]  # 10 is live in some bucket
    assert set(await s.dead_chunks()) == {11, BIG}
    assert await s.retired_among([10, 11, 12, BIG, 11]) == {11, BIG}  # only those asked
    assert await s.retired_among(range(-9000, 9000)) == {11}  # past one HMGET's fields
    assert await s.retired_among([]) == set()
    assert await s.retired_count() == 2
    assert await s.retire(1, [11], NOW + 5) == [11]  # already dead: still reported
    assert (await s.dead_chunks())[11] == NOW
    with pytest.raises(StaleLayout, match="chunk 11"):
        await s.commit([(b"late", lay((1, 11, 0)))], NOW)
    assert await s.lookup([b"late"], NOW) == [None]
    # 10 stayed usable in every bucket (the refused retire undid its marks)
    await s.commit([(f"n{i}".encode(), lay((1, 10, 9000 + i))) for i in range(20)], NOW)
    await s.delete([f"k{i}".encode() for i in range(20)] + [f"n{i}".encode() for i in range(20)])
    assert await s.retire(1, [10], NOW) == [10]


async def test_list_pages_in_byte_order(redis_store: RedisMetaStore) -> None:
    s = redis_store
    # skewed: most keys in bucket 0, so its buffer runs dry and is refilled mid-page
    keys = [k for i in range(0, 1800, 3) if s.bucket(k := f"p/{i:04d}".encode()) == 0 or i % 10 == 0]
    keys += [b"q/1", b"p", b"o/9", b"p/\xff"]
    await s.commit([(k, lay((1, 1, 0))) for k in keys], NOW)
    want = sorted(k for k in keys if k.startswith(b"p/"))
    got: list[bytes] = []
    after = None
    while True:
        page = await s.list(b"p/", after, 50)
        got += [k for k, _ in page]
        if len(page) < 50:
            break
        after = page[-1][0]
    assert got == want
    assert [k for k, _ in await s.list(b"", None, 1000)] == sorted(keys)
    tail = sorted(k for k in keys if k.startswith(b"p/1") and k > b"p/1050")[:3]
    assert [k for k, _ in await s.list(b"p/1", b"p/1050", 3)] == tail


async def test_lru_orders_by_access_and_pages_through_ties(redis_store: RedisMetaStore) -> None:
    s = redis_store
    keys = [f"k{i:03d}".encode() for i in range(300)]
    await s.commit([(k, lay((1, 1, 0))) for k in keys], NOW)  # all tied at NOW
    await s.lookup(keys[:5], NOW + 10)
    await s.touch(keys[5:7], NOW + 5)
    await s.flush_access()
    order = await s.lru(1000)
    assert [k for k, _ in order] == sorted(keys[7:]) + keys[5:7] + keys[:5]
    pages: list[bytes] = []
    after = None
    while True:
        page = await s.lru(4, after)
        pages += [k for k, _ in page]
        if len(page) < 4:
            break
        after = (page[-1][1], page[-1][0])
    assert pages == [k for k, _ in order]


async def test_evict_yields_to_leases_and_overwrites(redis_store: RedisMetaStore) -> None:
    s = redis_store
    rows = {k: lay((1, 1, i * 100)) for i, k in enumerate([b"a", b"b", b"c", b"d"])}
    await s.commit(list(rows.items()), NOW)
    assert await s.match_prefix([b"a", b"b"], NOW, lease=Lease("h", NOW + 30, 32)) == 2
    await s.commit([(b"c", lay((1, 2, 0)))], NOW + 1)  # overwritten after the victim was chosen
    gone = await s.evict(list(rows.items()), NOW + 1)
    assert sorted(k for k, _ in gone) == [b"d"]
    # a lease is only lengthened, and it lapses with meta's clock
    assert await s.match_prefix([b"a"], NOW, lease=Lease("h", NOW + 5, 32)) == 1
    assert await s.evict([(b"a", rows[b"a"])], NOW + 29) == []
    assert [k for k, _ in await s.evict([(b"a", rows[b"a"])], NOW + 31)] == [b"a"]


async def test_registry_state_and_cluster_id(redis_store: RedisMetaStore) -> None:
    s = redis_store
    cid = await s.cluster_id()
    assert await s.cluster_id(create="other") == cid
    await s.put_server(2, "127.0.0.1:9", 100, 50)
    await s.put_server(1, "127.0.0.1:8", 10, 5)
    await s.put_server(2, "127.0.0.1:10", 100, 40, "key2")
    assert await s.servers() == [(1, "127.0.0.1:8", 10, 5), (2, "127.0.0.1:10", 100, 40)]
    assert await s.claim_server(3, "127.0.0.1:11")  # a claimed id: a row with no key yet
    await s.put_seen(2, NOW)
    assert await s.registry() == ([(1, "127.0.0.1:8", 10, 5, ""), (2, "127.0.0.1:10", 100, 40, "key2"),
                                   (3, "127.0.0.1:11", 0, 0, "")], {2: NOW})
    assert await s.get_state("metrics") is None
    await s.put_state("metrics", {"passes": 3})
    assert await s.get_state("metrics") == {"passes": 3}


async def test_two_stores_share_one_namespace(redis_cluster: LocalRedisCluster,
                                              redis_store: RedisMetaStore) -> None:
    """Stateless meta: a second process on the same store sees every commit, and the
    bucket count is the store's, not the opener's."""
    await redis_store.commit([(b"shared", lay((1, 1, 0)))], NOW)
    other = RedisMetaStore(redis_cluster.url, namespace=redis_store.ns, buckets=3)
    await other.open()
    try:
        assert other.buckets == redis_store.buckets
        assert await other.lookup([b"shared"], NOW) == [lay((1, 1, 0))]
        assert await other.cluster_id() == await redis_store.cluster_id()
    finally:
        await other.close()


async def test_a_stale_slot_map_is_refreshed_and_nothing_runs_twice(redis_store: RedisMetaStore) -> None:
    """Slots that moved (failover, resharding): the script reaching the wrong master fails
    before writing anything, and the store sends those buckets again after re-reading the
    slot map.  Here the client's map sends one master's slots to another."""
    s = redis_store
    rows = {f"k{i}".encode(): lay((1, 1, i * 100)) for i in range(60)}
    await s.commit(list(rows.items()), NOW)
    nm = s.r.nodes_manager
    masters = sorted({nodes[0].name: nodes[0] for nodes in nm.slots_cache.values()}.items())
    (_, a), (_, b) = masters[0], masters[1]
    for nodes in nm.slots_cache.values():
        if nodes[0].name == a.name:
            nodes[0] = b
    gone = await s.delete(list(rows))
    assert sorted(k for k, _ in gone) == sorted(rows)  # each removed once, reported once
    assert await s.chunk_live() == {}
    assert await s.count() == 0


async def test_drop_lost_ignores_leases_and_keeps_overwrites(redis_store: RedisMetaStore,
                                                             tmp_path: Path) -> None:
    """REPORT_LOST on the shared index: a compare-and-delete on the layout read."""
    from kvfs.config import MetaConfig
    from kvfs.meta.shared_index import SharedIndex

    ix = SharedIndex(MetaConfig(data=tmp_path), redis_store, lambda: NOW)
    rows = {k: lay((1, 1, i * 100)) for i, k in enumerate([b"a", b"b", b"c"])}
    await redis_store.commit(list(rows.items()), NOW)
    assert await redis_store.match_prefix([b"a"], NOW, lease=Lease("h", NOW + 30, 32)) == 1
    await redis_store.commit([(b"c", lay((1, 2, 0)))], NOW + 1)  # overwritten meanwhile
    assert await ix.drop_lost(list(rows.items())) == 2
    assert await redis_store.lookup([b"a", b"b", b"c"], NOW + 2) == [None, None, lay((1, 2, 0))]


async def test_a_redis_that_may_evict_keys_is_refused_at_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Any ``maxmemory-policy`` but ``noeviction``, on any node, refuses the store by name
    before anything is written (meta's start too); read from CONFIG GET, or INFO memory
    where CONFIG is forbidden (as on managed Redis: here an ACL); where neither answers, a
    warning names the nodes and the store opens.  A migration's source (read_old) is only
    warned about."""
    from kvfs.config import MetaConfig
    from kvfs.meta.service import MetaService

    with LocalRedisCluster(tmp_path / "redis") as rc:
        node = rc.nodes[1]
        assert _command(node.port, b"CONFIG", b"SET", b"maxmemory-policy", b"allkeys-lru") == b"+OK"
        with pytest.raises(InvalidArgument, match=rf"maxmemory-policy is not noeviction on "
                           rf"127\.0\.0\.1:{node.port} \(allkeys-lru\).*CONFIG SET maxmemory-policy noeviction"):
            await RedisMetaStore(rc.url, namespace="ev").open()
        meta = MetaService(MetaConfig(data=tmp_path / "meta", listen="127.0.0.1:0", store=rc.url,
                                      store_namespace="ev"))
        try:
            with pytest.raises(InvalidArgument, match=r"allkeys-lru"):
                await meta.start()
        finally:
            await meta.close()
        assert all(_command(n.port, b"DBSIZE") == b":0" for n in rc.nodes)  # nothing written

        with caplog.at_level(logging.WARNING, logger="kvfs.meta.redis"):
            source = RedisMetaStore(rc.url, namespace="ev", read_old=True)
            await source.open()
            await source.close()
        assert "allkeys-lru" in caplog.text and "only read" in caplog.text

        assert _command(node.port, b"CONFIG", b"SET", b"maxmemory-policy", b"volatile-lru") == b"+OK"
        for n in rc.nodes:  # CONFIG forbidden: the policy comes from INFO memory
            assert _command(n.port, b"ACL", b"SETUSER", b"default", b"-config") == b"+OK"
        with pytest.raises(InvalidArgument, match=rf"{node.port} \(volatile-lru\)"):
            await RedisMetaStore(rc.url, namespace="ev").open()

        for n in rc.nodes:  # neither answers: a warning naming every node, and the store opens
            assert _command(n.port, b"ACL", b"SETUSER", b"default", b"-info") == b"+OK"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvfs.meta.redis"):
            store = RedisMetaStore(rc.url, namespace="ev")
            await store.open()
            try:
                await store.commit([(b"k", lay((1, 1, 0)))], NOW)
                assert await store.lookup([b"k"], NOW) == [lay((1, 1, 0))]
            finally:
                await store.close()
        assert "could not read maxmemory-policy" in caplog.text
        assert all(n.addr in caplog.text for n in rc.nodes)
