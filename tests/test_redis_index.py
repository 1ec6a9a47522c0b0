"""The Redis store's chunk index, server index and counters against a real 3-master cluster:
they follow every change to a key, a stale entry is checked and dropped, and reading them
costs the keys they name, not the keys stored (counted in Redis's own command statistics)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest

from kvfs.errors import InvalidArgument
from kvfs.layout import Extent, Layout, Replica, make_chunk_id, server_of_chunk
from kvfs.meta.redis_local import LocalRedisCluster, _command
from kvfs.meta.redis_store import _LUA_UNREF, FORMAT, RedisMetaStore, encode_value, live_contrib

pytestmark = pytest.mark.redis

NOW = 1_800_000_000.0
A, B = make_chunk_id(1, 1), make_chunk_id(1, 2)  # two chunks of server 1
C = make_chunk_id(2, 1)  # one of server 2
BIG = make_chunk_id(5000, 12345)  # past 2**53: the Lua server index divides it as a string


def lay(*replicas: tuple[int, int, int], size: int = 100, expires_at: float | None = None) -> Layout:
    """One extent of ``size`` bytes with the given (server, chunk, offset) replicas."""
    return Layout(size, 7, NOW, expires_at, (Extent(size, 9, tuple(Replica(*r) for r in replicas)),))


def chunks_of(v: Layout) -> set[int]:
    return {r.chunk_id for x in v.extents for r in x.replicas}


async def _every_bucket(s: RedisMetaStore, names: list[bytes], read: str) -> list[set[bytes]]:
    """Each name's members over every bucket (``read``: HKEYS of a hash, SMEMBERS of a set),
    read directly in one pipeline, merged per name."""
    p = s._pipe()
    for name in names:
        for b in range(s.buckets):
            getattr(p, read)(s._k(b, name))
    got = await p.execute()
    n = s.buckets
    return [set().union(*got[i * n:(i + 1) * n]) for i in range(len(names))]


async def raw_chunk_index(s: RedisMetaStore, chunks: Iterable[int]) -> dict[int, set[bytes]]:
    """Every bucket's ``c<CID>`` hash of ``chunks`` (its fields: the keys)."""
    cs = list(chunks)
    return dict(zip(cs, await _every_bucket(s, [b"c%d" % c for c in cs], "hkeys"), strict=True))


async def raw_server_index(s: RedisMetaStore, sids: Iterable[int]) -> dict[int, set[int]]:
    """Every bucket's ``s<SID>`` set of ``sids`` (its members: chunk ids)."""
    ss = list(sids)
    got = await _every_bucket(s, [b"s%d" % sid for sid in ss], "smembers")
    return {sid: {int(c) for c in m} for sid, m in zip(ss, got, strict=True)}


async def refs(s: RedisMetaStore, chunks: Iterable[int] = (), servers: Iterable[int] = ()) -> dict[bytes, Layout]:
    out: dict[bytes, Layout] = {}
    async for rows in s.refs(chunks, servers):
        for k, v in rows:
            assert k not in out, f"{k!r} named twice"
            out[k] = v
    return out


async def check_indexes(s: RedisMetaStore, cur: dict[bytes, Layout], chunks: Iterable[int]) -> None:
    """The raw indexes and counters are exactly what ``cur`` (every stored key) derives."""
    chunks = list(chunks)
    want = {c: {k for k, v in cur.items() if c in chunks_of(v)} for c in chunks}
    assert await raw_chunk_index(s, chunks) == want
    for c in chunks:
        assert await refs(s, [c]) == {k: cur[k] for k in want[c]}
    sids = {server_of_chunk(c) for c in chunks}
    assert await raw_server_index(s, sids) == {
        sid: {c for v in cur.values() for c in chunks_of(v) if server_of_chunk(c) == sid} for sid in sids}
    for sid in sids:
        assert await refs(s, servers=[sid]) == {
            k: v for k, v in cur.items() if any(r.server_id == sid for x in v.extents for r in x.replicas)}
    assert await s.key_stats(0.0) == (len(cur), len(cur), sum(v.size for v in cur.values()))
    live: Counter[int] = Counter()
    for k, v in cur.items():
        for c, n in live_contrib(k, v).items():
            live[server_of_chunk(c)] += n
    assert await s.server_live([*sids, 99]) == {sid: live[sid] for sid in [*sids, 99]}


async def test_the_indexes_follow_commit_overwrite_delete_relocation_expiry_eviction(
        redis_store: RedisMetaStore) -> None:
    s = redis_store
    all_chunks = (A, B, C, BIG)
    cur = {b"k%d" % i: lay((1, A, i * 100), (2, C, i * 100), size=100 + i) for i in range(40)}
    cur[b"big"] = lay((5000, BIG, 0), (1, B, 0), size=7)
    await s.commit(list(cur.items()), NOW)
    ttl = {b"t%d" % i: lay((1, B, 9000 + i), expires_at=NOW + 10) for i in range(5)}
    await s.commit(list(ttl.items()), NOW)
    cur.update(ttl)
    await check_indexes(s, cur, all_chunks)

    cur[b"k0"] = lay((1, B, 500))  # an overwrite moves the key to another chunk
    await s.commit([(b"k0", cur[b"k0"])], NOW)
    for k, _ in await s.delete([b"k1", b"never"]):
        del cur[k]
    moved = lay((1, B, 700), (2, C, 200), size=102)  # a relocation A -> B, and one that lost its race
    assert await s.switch([(b"k2", cur[b"k2"], moved), (b"k3", lay((1, A, 1)), moved)]) == [True, False]
    cur[b"k2"] = moved
    await check_indexes(s, cur, all_chunks)

    for k, _ in await s.remove_expired([k for k in ttl], NOW + 11):
        del cur[k]
    for k, _ in await s.evict([(b"k4", cur[b"k4"]), (b"k5", lay((1, A, 0)))], NOW):  # k5: not its layout
        del cur[k]
    assert b"k4" not in cur and b"k5" in cur
    await check_indexes(s, cur, all_chunks)

    await s.delete(list(cur))
    cur.clear()
    await check_indexes(s, cur, all_chunks)
    assert await s.chunk_live() == {}


async def test_key_stats_leave_out_what_expired_but_is_not_swept(redis_store: RedisMetaStore) -> None:
    s = redis_store
    keep = {b"k%d" % i: lay((1, A, i), size=1000 + i) for i in range(30)}
    ttl = {b"t%d" % i: lay((1, A, 100 + i), size=50, expires_at=NOW + 10) for i in range(7)}
    await s.commit(list(keep.items()), NOW)
    await s.commit(list(ttl.items()), NOW)
    total = sum(v.size for v in keep.values())
    assert await s.key_stats(NOW) == (37, 37, total + 7 * 50)
    assert await s.key_stats(NOW + 10) == (30, 37, total)  # expiry is <= now, as lookups see it
    assert {k for rows in [r async for r in s.expired_rows(NOW + 10, batch=2)] for k, _ in rows} == set(ttl)
    assert [r async for r in s.expired_rows(NOW)] == []
    await s.remove_expired(list(ttl), NOW + 10)
    assert await s.key_stats(NOW + 10) == (30, 30, total)


async def test_a_stale_index_entry_is_checked_and_dropped_never_trusted(redis_store: RedisMetaStore) -> None:
    """Entries that do not hold (injected by hand: the scripts never leave one) are left out
    of refs() and removed by a compare-and-delete; the true ones stay."""
    s = redis_store
    cur = {b"in-a": lay((1, A, 0)), b"in-b": lay((1, B, 0))}
    await s.commit(list(cur.items()), NOW)
    stale = {b"in-b": A, b"ghost": A, b"in-a": C}  # key -> a chunk it is not in (ghost: no key)
    for k, c in stale.items():
        await s.r.hset(s._k(s.bucket(k), b"c%d" % c), k, b"")
    await s.r.sadd(s._k(s.bucket(b"in-a"), b"s2"), str(C))  # C "has keys" in in-a's bucket
    assert (await raw_chunk_index(s, [A]))[A] == {b"in-a", b"in-b", b"ghost"}
    assert await refs(s, [A]) == {b"in-a": cur[b"in-a"]}
    assert await refs(s, servers=[2]) == {}
    assert await raw_chunk_index(s, [A, B, C]) == {A: {b"in-a"}, B: {b"in-b"}, C: set()}
    # an entry read as stale whose key changed before the drop (in-b moved into A meanwhile)
    # is kept: the drop compares against the stored value, not what refs() read
    cur[b"in-b"] = lay((1, A, 64))
    await s.commit([(b"in-b", cur[b"in-b"])], NOW)
    dropped = await s._per_node(_LUA_UNREF, (), {s.bucket(b"in-b"): [b"in-b", str(A)]}, 2)
    assert [n for _, n in dropped] == [0]
    assert await refs(s, [A]) == cur


def command_calls(rc: LocalRedisCluster) -> Counter[str]:
    """Calls per command, summed over the cluster's nodes (INFO commandstats; commands a
    script runs count too), less the test's and the client's bookkeeping (a connection a
    reconnect opens says HELLO: seen once in the full suite)."""
    out: Counter[str] = Counter()
    for n in rc.nodes:
        info = _command(n.port, b"INFO", b"commandstats") or b""
        for line in info.decode().splitlines():
            if line.startswith("cmdstat_"):
                name, stats = line[len("cmdstat_"):].split(":", 1)
                if name not in ("info", "cluster", "ping", "command", "config",
                                "hello", "client", "auth", "select", "readonly"):  # connecting
                    out[name] += int(stats.split("calls=")[1].split(",")[0])
    return out


async def test_refs_stats_and_expired_keys_cost_what_they_name_not_the_keys_stored(
        redis_cluster: LocalRedisCluster, redis_store: RedisMetaStore) -> None:
    """The same reads, before and after 3,000 more keys are stored elsewhere, make exactly
    the same Redis commands (scripts' included), and none of them walks a whole structure
    (SCAN, HSCAN, HGETALL, KEYS; HKEYS reads one chunk's entries of one bucket)."""
    s = redis_store
    probe = make_chunk_id(7, 1)
    named = {b"p%d" % i: lay((7, probe, i * 100), (8, make_chunk_id(8, 1), i * 100)) for i in range(6)}
    named |= {b"e%d" % i: lay((7, probe, 900 + i), expires_at=NOW + 1) for i in range(3)}
    await s.commit([(k, v) for k, v in named.items() if v.expires_at is None], NOW)
    await s.commit([(k, v) for k, v in named.items() if v.expires_at is not None], NOW)

    async def reads() -> tuple[Counter[str], tuple[object, ...]]:
        before = command_calls(redis_cluster)
        got = (await refs(s, [probe]), await refs(s, servers=[7]), await s.key_stats(NOW + 5),
               [r async for r in s.expired_rows(NOW + 5)], await s.server_live([1, 7, 8]))
        after = command_calls(redis_cluster)
        return after - before, got

    small, got_small = await reads()
    filler = [(b"f%d" % i, lay((1, make_chunk_id(1, 100 + i % 50), i), (2, C, i))) for i in range(3000)]
    for i in range(0, len(filler), 500):
        await s.commit(filler[i:i + 500], NOW)
    big, got_big = await reads()
    assert got_small[:2] == got_big[:2] == (named, named)
    assert got_big[2] == (3006, 3009, 6 * 100 + 3000 * 100)
    assert got_big[4][7] == got_small[4][7] > 0 and got_big[4][1] > got_small[4][1] == 0
    assert small == big, "a read's cost grew with keys it does not name"
    assert not {"scan", "hscan", "sscan", "zscan", "hgetall", "hvals", "keys"} & set(big)
    assert big["hkeys"] > 0 and big["smembers"] > 0 and big["eval"] > 0  # it read the indexes


async def test_a_store_made_before_the_index_is_refused_by_name_and_migrates(
        redis_cluster: LocalRedisCluster, redis_store: RedisMetaStore, tmp_path: Path) -> None:
    """A format-1 store (no chunk index; values without the size field) is refused, is read
    as a migration source, and the copy in a new namespace has the indexes."""
    from kvfs.meta.migrate import migrate

    s = redis_store
    await s.cluster_id(create="c-old")
    await s.r.delete(s._g["format"])
    old = {b"k%d" % i: lay((1, A, i * 100), size=10 + i) for i in range(20)}
    for k, v in old.items():  # as format 1 wrote them: "EXPIRES;CID:N,...|layout"
        new = encode_value(k, v)
        semi = new.index(b";")
        v1 = new[:semi] + new[new.index(b";", semi + 1):]
        b = s.bucket(k)
        await s.r.hset(s._k(b, b"h"), k, v1)
        await s.r.zadd(s._k(b, b"k"), {k: 0})
        await s.r.zadd(s._k(b, b"a"), {k: NOW})
    again = RedisMetaStore(redis_cluster.url, namespace=s.ns)
    with pytest.raises(InvalidArgument, match=rf"format 1, this kvfs needs {FORMAT} .*--from-namespace {s.ns}"):
        await again.open()
    to_ns = s.ns + "-v2"
    rep = await migrate(redis_cluster.url, redis_cluster.url, from_namespace=s.ns, to_namespace=to_ns)
    assert rep.keys == 20 and rep.cluster_id == "c-old"
    moved = RedisMetaStore(redis_cluster.url, namespace=to_ns)
    await moved.open()
    try:
        assert await moved.lookup(list(old), NOW) == list(old.values())
        await check_indexes(moved, old, [A])
    finally:
        await moved.close()
    with pytest.raises(InvalidArgument, match="the same store"):
        await migrate(redis_cluster.url, redis_cluster.url, from_namespace=to_ns, to_namespace=to_ns)
