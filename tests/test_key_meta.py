"""Small per-key metadata: ``put(..., meta={...})`` stored in the key's layout, returned by
``get_meta``, bounded by meta's ``max_key_meta_bytes``, kept across a meta restart and a
GC relocation, on SQLite and on the Redis store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import numpy as np
import pytest
from conftest import FakeClock
from poll import until_alive

import kvfs
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig
from kvfs.errors import InvalidArgument
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster
from kvfs.layout import Extent, Layout, Replica, decode_layout, encode_layout, encode_layout_buffer
from kvfs.meta.redis_store import RedisMetaStore

# the tests through a cluster run over both meta backends; the Redis store's own once
both_backends = pytest.mark.usefixtures("meta_backend")

PAGE = {"dtype": "bfloat16", "shape": [2, 8, 64], "layout": "page_first", "tp_rank": 0}


@both_backends
async def test_meta_round_trips_and_survives_a_meta_restart(cluster: LocalCluster, kv: AsyncClient) -> None:
    assert await kv.put_many([("a", b"A" * 100), ("b", b"B"), ("c", b"C")],
                             meta=[PAGE, None, {"n": 1, "raw": b"\x00\xff", "ok": True}]) == [True] * 3
    assert await kv.put("d", b"D", meta=PAGE) is True
    want = [PAGE, {}, {"n": 1, "raw": b"\x00\xff", "ok": True}, PAGE, None]
    assert await kv.get_meta(["a", "b", "c", "d", "nope"]) == want
    async with cluster.client() as fresh:  # from meta (LOOKUP), not the writer's cache
        assert await fresh.get_meta(["a", "b", "c", "d", "nope"]) == want
        assert await fresh.get_into(["a"], [bytearray(100)]) == [100]
        sent = dict(fresh.rpc_counts)
        assert await fresh.get_meta(["a"]) == [PAGE]  # after a read: from the layout cache
        assert fresh.rpc_counts == sent
    # if_absent keeps the stored value's metadata with it
    assert await kv.put("a", b"x", meta={"other": 1}, if_absent=True) is False
    await cluster.stop_meta()
    await cluster.start_meta()
    async with cluster.client() as fresh:
        assert await fresh.get_meta(["a", "b", "c", "d", "nope"]) == want
        assert await fresh.get("a") == b"A" * 100
    # an overwrite replaces it; an overwrite without meta drops it
    async with cluster.client() as kv2:
        await until_alive(kv2, len(cluster.chunkservers), "the restarted meta")
        await kv2.put("a", b"a2", meta={"v": 2})
        await kv2.put("d", b"d2")
        assert await kv2.get_meta(["a", "d"]) == [{"v": 2}, {}]


@both_backends
async def test_bad_or_large_meta_is_refused_naming_the_key(cluster: LocalCluster, kv: AsyncClient) -> None:
    with pytest.raises(InvalidArgument, match=r"key b'big' is larger than this meta's limit of 1024"):
        await kv.put(b"big", b"v", meta={"s": "x" * 2000})  # meta's default max_key_meta_bytes
    with pytest.raises(InvalidArgument, match=r"b'huge'.*protocol's limit"):
        await kv.put(b"huge", b"v", meta={"s": "x" * 70_000})  # refused before any byte is sent
    with pytest.raises(InvalidArgument, match=r"b'np'.*not msgpack"):
        await kv.put(b"np", b"v", meta={"dtype": np.dtype("float16")})
    with pytest.raises(InvalidArgument, match=r"b'ints'.*str keys"):
        await kv.put(b"ints", b"v", meta={1: "x"})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument, match="2 items but 1 meta"):
        await kv.put_many([("x", b"1"), ("y", b"2")], meta=[PAGE])
    assert await kv.exists_many([b"big", b"huge", b"np", b"ints", b"x"]) == [False] * 5
    await kv.put(b"fits", b"v", meta={"s": "x" * 1000})
    assert await kv.get_meta([b"fits"]) == [{"s": "x" * 1000}]


@both_backends
async def test_blocking_client_meta(cluster: LocalCluster) -> None:
    def work() -> None:
        with kvfs.Client(cluster.addr, token=cluster.token) as kv:
            assert kv.submit_put_many([(b"s", b"1")], meta=[PAGE]).result() == [True]
            kv.put(b"t", b"2", meta={"k": "v"})
            assert kv.get_meta([b"s", b"t"]) == [PAGE, {"k": "v"}]
            assert kv.submit_get_meta([b"nope"]).result() == [None]

    await asyncio.to_thread(work)


@both_backends
async def test_gc_relocation_keeps_meta(tmp_path: Path, clock: FakeClock) -> None:
    root = tmp_path / "c"
    c = LocalCluster(root, 1, clock=clock, chunkserver=ChunkServerConfig(
        data=root, heartbeat_interval_s=0.2, chunk_bytes=64 * 1024))
    async with c, c.client() as kv, GarbageCollector(c.addr, token=c.admin_token) as gc:
        await kv.put_many([(f"k{i}", bytes([i]) * 8192) for i in range(20)],
                          meta=[{"i": i} for i in range(20)])
        before = await kv.lookup([b"k0"], use_cache=False)
        await kv.delete_many([f"k{i}" for i in range(1, 20, 2)])  # half of each chunk: garbage
        r = await gc.run_pass(PassOptions(apply=True, grace_s=0, threshold=0.3))
        assert r.keys_relocated > 0
        assert await kv.lookup([b"k0"], use_cache=False) != before  # it moved
        async with c.client() as fresh:
            keep = [f"k{i}" for i in range(0, 20, 2)]
            assert await fresh.get_meta(keep) == [{"i": i} for i in range(0, 20, 2)]
            assert await fresh.get_many(keep) == [bytes([i]) * 8192 for i in range(0, 20, 2)]


def lay(chunk: int, meta: bytes | None = None) -> Layout:
    return Layout(10, 7, 1.0, None, (Extent(10, 9, (Replica(1, chunk, 0),)),), meta)


def test_a_layout_without_meta_encodes_as_before() -> None:
    """Stored layouts keep their bytes (Redis compare-and-swaps compare them)."""
    plain = lay(1)
    old = msgspec.msgpack.encode([10, 7, 1.0, None, [[10, 9, [[1, 1, 0]]]]])
    assert encode_layout(plain) == old and decode_layout(old) == plain
    assert decode_layout(encode_layout(lay(1, b"\x81\xa1k\x01"))) == lay(1, b"\x81\xa1k\x01")
    for layout in (plain, lay(1, b"\x81\xa1k\x01")):  # meta's SQLite rows: the same bytes
        buf = encode_layout_buffer(layout)
        assert isinstance(buf, bytearray) and buf == encode_layout(layout)


@pytest.mark.redis
async def test_redis_store_keeps_meta(redis_store: RedisMetaStore) -> None:
    now = 1_800_000_000.0
    m = msgspec.msgpack.encode(PAGE)
    await redis_store.commit([(b"a", lay(1, m)), (b"b", lay(2))], now)
    assert await redis_store.lookup([b"a", b"b"], now) == [lay(1, m), lay(2)]
    assert await redis_store.switch([(b"a", lay(1, m), lay(3, m))]) == [True]  # CAS compares it too
    assert await redis_store.peek([b"a"], now) == [lay(3, m)]
