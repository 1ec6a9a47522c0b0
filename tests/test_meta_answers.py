"""What meta answers about its keys: STATS, LIST, EXISTS and the default TTL, with expired
and deleted keys in the index. Found untested by the mutation pass (tests/MUTATION.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock, clocked_client

from kvfs import rpc
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, MetaConfig
from kvfs.errors import InvalidArgument
from kvfs.launcher import LocalCluster
from kvfs.layout import Replica, make_chunk_id
from kvfs.meta.index import MetaIndex
from kvfs.server import reply_of

pytestmark = pytest.mark.usefixtures("meta_backend")  # each test over SQLite and Redis


async def settled_stats(kv: AsyncClient, garbage: int = 0) -> dict[str, Any]:
    """STATS once the servers' heartbeats reported the chunk sizes of all that was written
    (``garbage``: more than that many written bytes no longer live; a delete's tombstone is
    reported apart from the deleted record, so waiting for any garbage is not enough)."""
    deadline = time.monotonic() + 20
    while True:
        st = await kv.stats()
        written = sum(s["written"] for s in st["servers"])
        live = sum(s["live"] for s in st["servers"])
        if live > 0 and (written - live > garbage if garbage else written == live):
            return st
        assert time.monotonic() < deadline, st["servers"]
        await kv.servers(refresh=True)  # a round trip, then ask again (heartbeats every 0.2 s)


async def test_stats_list_and_exists_count_only_live_keys(kv: AsyncClient, clock: FakeClock) -> None:
    await kv.put_many({b"a": b"A" * 1000, b"b": b"B" * 2000})
    await kv.put(b"t", b"T" * 3000, ttl=10)
    st = await settled_stats(kv)
    assert (st["keys"], st["keys_stored"], st["bytes"]) == (3, 3, 6000)
    written = [s for s in st["servers"] if s["written"]]
    assert written and all(s["live"] == s["written"] and s["garbage"] == 0 for s in st["servers"])
    await kv.put(b"x", b"X" * 500)
    assert await kv.delete(b"x")
    st = await settled_stats(kv, garbage=500)  # x's record: written, no longer live
    assert sum(s["garbage"] for s in st["servers"]) > 500
    assert all(s["garbage"] == s["written"] - s["live"] for s in st["servers"])
    listing = [(i.key, i.size, i.expires_at) for i in await kv.list()]
    created_t = (await kv.list(b"t"))[0].created
    assert listing == [(b"a", 1000, None), (b"b", 2000, None), (b"t", 3000, created_t + 10)]
    clock.advance(11)  # t expired: still stored until GC, but no longer there for anyone
    st = await kv.stats()
    assert (st["keys"], st["keys_stored"], st["bytes"]) == (2, 3, 3000)
    assert [i.key for i in await kv.list()] == [b"a", b"b"]
    assert await kv.exists_many([b"a", b"t", b"x"]) == [True, False, False]


async def test_the_default_ttl_applies_only_where_a_put_names_none(tmp_path: Path, clock: FakeClock) -> None:
    root = tmp_path / "ttl"
    meta = MetaConfig(data=root / "meta", listen="127.0.0.1:0", default_ttl_s=5.0)
    async with LocalCluster(root, 1, clock=clock, meta=meta,
                            chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2)) as c, \
            clocked_client(c, clock) as kv:
        await kv.put(b"default", b"d")
        await kv.put(b"own", b"o", ttl=100)
        clock.advance(6)
        assert await kv.exists_many([b"default", b"own"]) == [False, True]


async def test_delete_checks_the_tombstones_it_is_given(cluster: LocalCluster, kv: AsyncClient,
                                                        clock: FakeClock, meta_backend: str) -> None:
    """DELETE's tombstones (where the client wrote them) are checked like a commit's
    layouts: one per key, each naming known chunkservers once, in chunks of their own. A refused DELETE removes
    nothing; an accepted one keeps a tombstone for each key it removes."""
    await kv.put_many({b"a": b"A" * 100, b"b": b"B" * 100})
    lay = await kv.layout(b"a")
    assert lay is not None
    reps = list(lay.extents[0].replicas)
    link = kv._link  # the RPC itself: the client writes its tombstones first
    with pytest.raises(InvalidArgument, match=r"^DELETE names 1 tombstones for 2 keys: give one per key, or none$"):
        await link.call_meta(rpc.Delete(keys=[b"a", b"b"], tombstones=[reps]))
    with pytest.raises(InvalidArgument, match=r"^tombstone of b'a' names one chunkserver twice$"):
        await link.call_meta(rpc.Delete(keys=[b"a"], tombstones=[[reps[0], reps[0]]]))
    ghost = Replica(999, reps[0].chunk_id, reps[0].offset)
    with pytest.raises(InvalidArgument, match=r"^tombstone of b'a' names unknown chunkserver 999$"):
        await link.call_meta(rpc.Delete(keys=[b"a"], tombstones=[[reps[0], ghost]]))
    other = next(cs.server_id for cs in cluster.chunkservers if cs is not None and cs.server_id != reps[0].server_id)
    misfiled = Replica(reps[0].server_id, make_chunk_id(other, 1), 0)  # another server's chunk
    with pytest.raises(InvalidArgument, match=rf"^tombstone of b'a': chunk id \S+ is chunkserver {other}'s, "
                                              rf"not chunkserver {reps[0].server_id}'s"):
        await link.call_meta(rpc.Delete(keys=[b"a"], tombstones=[[misfiled]]))
    assert await kv.get_many([b"a", b"b"]) == [b"A" * 100, b"B" * 100]
    assert (await link.call_meta(rpc.Delete(keys=[b"a", b"b", b"none"], tombstones=[reps] * 3))).deleted == 2
    assert await kv.exists_many([b"a", b"b"]) == [False, False]
    if meta_backend == "redis":  # the checks above hold there too; the tombstones kept
        return  # are SQLite's (kvfs.meta.tombstones): a meta on Redis keeps none
    meta = cluster.meta
    assert meta is not None and isinstance(meta.index, MetaIndex)
    kept = meta.index.tombstones
    assert set(kept) == {b"a", b"b"}  # not b"none": it removed nothing
    assert all(tuple(t.layout.extents[0].replicas) == tuple(reps) and t.layout.created == clock()
               for t in kept.values())


async def test_lookup_says_which_misses_are_directories(kv: AsyncClient, clock: FakeClock) -> None:
    """LOOKUP with ``dirs`` (the mount's probe, one round trip): a miss is a directory when
    an unexpired key lies under it plus ``/``; a key with a value is never one. Expired keys
    under it do not count, however many sort before a live one (they are listed by pages)."""
    await kv.put_many({b"d/x": b"1", b"f": b"2", b"f/y": b"3", b"e/zzz": b"4"})
    await kv.put_many({f"{p}/{i:03d}".encode(): b"t" for p in "eg" for i in range(70)}, ttl=10)

    async def probe(*keys: bytes) -> tuple[list[bool], list[bool]]:
        r = await kv._link.call_meta(rpc.Lookup(keys=list(keys), dirs=True))
        return [lay is not None for lay in r.layouts], r.dirs

    assert await probe(b"d", b"f", b"none", b"d/x", b"dd", b"e", b"g") == (
        [False, True, False, True, False, False, False], [True, False, False, False, False, True, True])
    clock.advance(11)  # the 140 keys with a TTL expired: e still has e/zzz, past 70 of them
    assert await probe(b"e", b"g", b"d") == ([False] * 3, [True, False, True])
    plain = await kv._link.call_meta(rpc.Lookup(keys=[b"d", b"f"]))
    assert [lay is not None for lay in plain.layouts] == [False, True] and not plain.dirs


async def test_key_queries_are_answered_in_the_step_that_read_them_from_an_index_in_memory(
        cluster: LocalCluster, kv: AsyncClient, meta_backend: str) -> None:
    """LOOKUP (with dirs too, where every key is found), EXISTS, MATCH_PREFIX, RELEASE and
    TOUCH: over SQLite (the index in meta's memory) the handler's answer itself, written at
    once with no task per request; over Redis an awaitable; the same answers either way."""
    await kv.put_many({b"p0": b"0" * 100, b"p1": b"1" * 200})
    svc = cluster.meta
    assert svc is not None
    asks: list[tuple[Any, Any, Any]] = [
        (svc.rpc_lookup, rpc.Lookup(keys=[b"p0", b"zz"], lease_s=30.0, holder="h"),
         lambda r: [None if lay is None else lay.size for lay in r.layouts] == [100, None]),
        (svc.rpc_lookup, rpc.Lookup(keys=[b"p1", b"p0"], dirs=True),  # a mount's, of files
         lambda r: r.dirs == [False, False] and [lay.size for lay in r.layouts] == [200, 100]),
        (svc.rpc_exists, rpc.Exists(keys=[b"p1", b"zz", b"p0"]),
         lambda r: r.exists == [True, False, True]),
        (svc.rpc_match_prefix, rpc.MatchPrefix(keys=[b"p0", b"p1", b"zz", b"p0"], lease_s=30.0, holder="h"),
         lambda r: r.n == 2),
        (svc.rpc_touch, rpc.Touch(keys=[b"p0", b"zz"]), lambda r: isinstance(r, rpc.Empty)),
        (svc.rpc_release, rpc.Release(keys=[b"p0", b"p1", b"zz"], holder="h"),
         lambda r: r.released == 2),
    ]
    for handler, request, right in asks:
        got = handler(request, memoryview(b""))
        if meta_backend != "redis":
            assert type(got) is tuple, f"{request!r} answered through {got!r}"
        header, payload = await reply_of(got)
        assert right(header), (request, header)
        assert not payload
    await kv.put(b"d/x", b"x")  # a miss that is a directory: looked for under "d/"
    header, _ = await reply_of(svc.rpc_lookup(rpc.Lookup(keys=[b"p0", b"d", b"zz"], dirs=True),
                                              memoryview(b"")))
    assert header.dirs == [False, True, False]
    with pytest.raises(InvalidArgument, match="longer than this meta's limit"):
        svc.rpc_exists(rpc.Exists(keys=[b"p0"], lease_s=1.0, holder="h" * 10_000), memoryview(b""))
