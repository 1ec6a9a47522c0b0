"""The core cluster end to end: in-process servers over real sockets, real files, real SQLite."""

from __future__ import annotations

import ctypes
import itertools
import os
from typing import Any

import numpy as np
import pytest

import kvfs
from kvfs.buffers import Parts, as_parts, as_parts_many, as_view, nbytes, regions
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig
from kvfs.errors import InvalidArgument
from kvfs.launcher import LocalCluster
from kvfs.layout import MAX_KEY_BYTES
from kvfs.layoutcache import Single

# the tests that exercise meta run over both meta backends; the data-path ones over SQLite only
both_backends = pytest.mark.usefixtures("meta_backend")


async def test_20mib_value_is_striped_over_servers(kv: AsyncClient) -> None:
    big = os.urandom(20 << 20)
    await kv.put(b"big", big)
    layout = await kv.layout(b"big")
    assert layout is not None and layout.size == len(big)
    servers = {r.server_id for e in layout.extents for r in e.replicas}
    assert len(layout.extents) == 20 and len(servers) >= 2
    kv.layout_cache.clear()
    assert await kv.get(b"big") == big


@both_backends
async def test_10k_small_keys(kv: AsyncClient) -> None:
    items = {f"blk/{i:05d}".encode(): os.urandom(64 + i % 200) for i in range(10_000)}
    await kv.put_many(items)
    kv.layout_cache.clear()
    assert await kv.get_many(list(items)) == list(items.values())
    # values written together land contiguously in one chunk, in call order
    first, second = await kv.layout(b"blk/00000"), await kv.layout(b"blk/00001")
    assert first is not None and second is not None
    r0, r1 = first.extents[0].replicas[0], second.extents[0].replicas[0]
    assert r0.chunk_id == r1.chunk_id and r0.offset < r1.offset


@pytest.mark.parametrize("replicas", [1, 2])
async def test_put_layouts_built_by_the_client_are_meta_s(cluster: LocalCluster, replicas: int) -> None:
    """The layouts a put caches (built from where the APPENDs put each record) are the ones
    meta committed, for a put of small values only (packed COMMIT) and for one mixing small,
    striped and empty values, with one replica and with two.  Runs of 300 bytes rotate over
    the servers, so a value's record sits at a different index in each server's APPEND."""
    kv = cluster.client(ClientConfig(put_group_bytes=300))
    await kv.open()
    try:
        small = {f"s{i}".encode(): os.urandom(100 + i) for i in range(9)}
        mixed = {b"m0": b"abc", b"big": os.urandom((1 << 20) + 5), b"empty": b"", b"m1": os.urandom(200),
                 b"m2": os.urandom(200)}
        for items in (small, mixed):
            await kv.put_many(items, replicas=replicas, meta=[{"i": i} for i in range(len(items))])
            for key in items:
                entry = kv.layout_cache._layouts[key]
                # a put of small values of one replica caches them unbuilt (built when read)
                assert isinstance(entry, Single) == (replicas == 1 and items is small)
                cached = entry.layout() if isinstance(entry, Single) else entry
                assert cached is not None and cached == await kv.layout(key)
                assert all(len({r.server_id for r in e.replicas}) == replicas for e in cached.extents)
            kv.layout_cache.clear()
            assert await kv.get_many(list(items)) == list(items.values())
        big = await kv.layout(b"big")
        assert big is not None and len(big.extents) == 2  # striped: the mixed put's other form
    finally:
        await kv.close()


@both_backends
async def test_match_prefix_stops_at_first_missing(kv: AsyncClient) -> None:
    chain = [f"h{i}".encode() for i in range(10)]
    await kv.put_many({k: b"x" * 100 for i, k in enumerate(chain) if i != 7})
    assert await kv.match_prefix(chain) == 7
    assert await kv.match_prefix([b"nope", *chain]) == 0
    assert await kv.exists_many([chain[0], chain[7], chain[9]]) == [True, False, True]


@both_backends
async def test_get_many_with_misses_and_empty_value(kv: AsyncClient) -> None:
    await kv.put_many([(b"a", b"1"), ("b", b""), (b"c", bytearray(b"333"))])
    assert await kv.get_many([b"a", b"b", b"nope", "c"]) == [b"1", b"", None, b"333"]


async def test_get_into_caller_buffers(kv: AsyncClient) -> None:
    vals = [os.urandom(1000), os.urandom(3 << 20)]
    await kv.put_many({b"x": vals[0], b"y": vals[1]})
    buf = bytearray(1000)
    arr = np.zeros(4 << 20, dtype=np.uint8)
    sizes = await kv.get_into([b"x", b"y", b"z"], [buf, arr, bytearray(10)])
    assert sizes == [1000, 3 << 20, -1]
    assert buf == vals[0] and arr[: 3 << 20].tobytes() == vals[1]
    small = bytearray(10)
    # per-key results: a too-small buffer and a miss do not fail their neighbours
    assert await kv.get_into([b"y", b"x", b"z"], [small, buf, bytearray(1)]) == [
        kvfs.TOO_SMALL, 1000, kvfs.MISS]
    assert small == bytearray(10)  # nothing was read for it
    with pytest.raises(InvalidArgument, match="read-only"):
        await kv.get_into([b"x"], [b"immutable"])
    region = memoryview(bytearray(2000))  # views of one region, one of them read-only
    with pytest.raises(InvalidArgument, match="buffer 1 is read-only"):
        await kv.get_into([b"x", b"x"], [region[:1000], region[1000:].toreadonly()])
    assert region == bytes(2000)  # refused before anything was read
    assert await kv.get_into([b"x", b"x"], [region[:1000], region[1000:]]) == [1000, 1000]
    assert region == vals[0] * 2
    with pytest.raises(InvalidArgument, match="2 buffers"):
        await kv.get_into([b"x"], [bytearray(1), bytearray(1)])


@pytest.mark.parametrize("size", [0, 1, 4096, 3 << 20], ids=["empty", "1B", "4KiB", "striped"])
async def test_scatter_gather_per_key(kv: AsyncClient, size: int) -> None:
    """A value gathered from several buffers on put, scattered into several on get,
    including splits that cross stripe units; the bytes are those of the concatenation."""
    data = os.urandom(size)
    cuts = sorted({0, size // 3, size // 3 + 1, size - 7 if size > 7 else size, size})
    parts = [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]
    await kv.put_many([(b"sg", parts), (b"whole", data)])
    assert await kv.get(b"sg") == data
    k_half, v_half = np.zeros(size // 2, dtype=np.uint8), bytearray(size - size // 2 + 5)
    tail = bytearray(3)
    sizes = await kv.get_into([b"whole", b"sg"], [[k_half, v_half, tail], [bytearray(size)]])
    assert sizes == [size, size]
    assert k_half.tobytes() + bytes(v_half[: size - size // 2]) == data
    assert bytes(v_half[size - size // 2 :]) == b"\0" * 5 and tail == bytearray(3)
    assert await kv.get_into([b"sg"], [[bytearray(size // 2)]]) == (
        [kvfs.TOO_SMALL] if size else [0])


def test_regions_are_checked_once_and_passed_through() -> None:
    """``kvfs.buffers.regions``: one value's views per ``per`` regions, each group with its
    total (sizes alike or not); ``as_parts``/``nbytes`` take a group as it is; a region out
    of bounds, sizes that do not group, a read-only buffer asked writable, are refused by
    name.  A read-only group is not taken where a writable one is needed."""
    buf = np.arange(100, dtype=np.uint8)
    got = regions(buf, [10, 0, 50, 90], [5, 3, 7, 10], 2, writable=True)
    assert [type(g) for g in got] == [Parts, Parts]
    assert [[bytes(v) for v in g] for g in got] == [[bytes(range(10, 15)), bytes(range(3))],
                                                    [bytes(range(50, 57)), bytes(range(90, 100))]]
    assert [g.nbytes for g in got] == [8, 17] and [nbytes(g) for g in got] == [8, 17]
    assert as_parts(got[1], writable=True) is got[1]
    got[0][0][:] = b"\xff" * 5  # views of the buffer itself, no copies
    assert (buf[10:15] == 255).all()
    same = regions(memoryview(buf), [0, 4, 8, 12], [4] * 4, 2)
    assert [g.nbytes for g in same] == [8, 8] and not same[0].writable
    again = as_parts(same[0], writable=True)  # made read-only: checked again, view by view
    assert again is not same[0] and again == list(same[0])
    with pytest.raises(InvalidArgument, match=r"host: region 95\+10 is outside its 100 bytes"):
        regions(buf, [0, 95], [5, 10], 1, what="host")
    with pytest.raises(InvalidArgument, match="3 offsets and 3 sizes do not make values of 2"):
        regions(buf, [0, 1, 2], [1, 1, 1], 2)
    with pytest.raises(InvalidArgument, match="read-only"):
        regions(b"immutable", [0], [1], 1, writable=True)
    with pytest.raises(InvalidArgument, match="read-only"):
        as_parts(regions(b"immutable", [0], [1], 1)[0], writable=True)


def test_a_ctypes_byte_array_is_a_flat_view_of_itself() -> None:
    """A memoryview of a ctypes byte array (format "<B", as LMCache's memory objects hand
    out) is taken as flat bytes: a "B" view of the same memory, no copy; a read-only one
    is refused where a writable one is needed."""
    arr = (ctypes.c_ubyte * 8)()
    view = as_view(memoryview(arr), writable=True)
    assert view.format == "B" and view.nbytes == 8
    view[2:4] = b"\x07\x09"
    assert list(arr) == [0, 0, 7, 9, 0, 0, 0, 0]
    assert nbytes(as_parts([bytearray(3), memoryview(arr)], writable=True)) == 11
    with pytest.raises(InvalidArgument, match="read-only"):
        as_view(memoryview(arr).toreadonly(), writable=True)


def test_as_parts_many_checks_every_buffer() -> None:
    """``as_parts_many``: flat byte views (checked all at once) and bytearrays become one-view
    lists of the same memory with their sizes; anything else goes through ``as_parts`` one
    by one.  A read-only, strided or wide view among flat ones is refused by its index."""
    region = memoryview(bytearray(12))
    views = [region[0:4], region[4:12], region[12:12]]
    parts, sizes = as_parts_many(views, writable=True, what="buffer")
    assert sizes == [4, 8, 0] and [p[0].obj for p in parts] == [region.obj] * 3
    parts[1][0][:] = b"\x01" * 8
    assert bytes(region[4:12]) == b"\x01" * 8
    ro = [views[0], region[4:8].toreadonly()]
    assert as_parts_many(ro)[1] == [4, 4]  # read-only is fine for reading from
    with pytest.raises(InvalidArgument, match="buffer 1 is read-only"):
        as_parts_many(ro, writable=True, what="buffer")
    with pytest.raises(InvalidArgument, match="buffer 1 must be C-contiguous"):
        as_parts_many([views[0], region[::2]], writable=True, what="buffer")
    wide = memoryview(np.zeros(3, dtype=np.uint32))  # taken as its 12 bytes
    assert as_parts_many([views[0], wide], writable=True)[1] == [4, 12]
    arrays = [bytearray(3), bytearray(5)]
    parts, sizes = as_parts_many(arrays, writable=True)
    assert sizes == [3, 5] and parts[1][0].obj is arrays[1]
    mixed = [bytearray(2), [bytearray(1), np.zeros(4, dtype=np.uint8)], np.zeros(6, dtype=np.uint8)]
    assert as_parts_many(mixed, writable=True)[1] == [2, 5, 6]
    with pytest.raises(InvalidArgument, match="buffer 1 is read-only"):
        as_parts_many([bytearray(1), b"x"], writable=True, what="buffer")
    assert as_parts_many([]) == ([], [])


@both_backends
async def test_get_into_one_unreadable_key_fails_alone(cluster: LocalCluster,
                                                       kv: AsyncClient) -> None:
    await kv.put_many({b"a": os.urandom(5000)})
    la = await kv.layout(b"a")
    assert la is not None
    sa = la.extents[0].replicas[0].server_id
    for i in range(50):  # placement is random: find a key that landed elsewhere
        b = f"b{i}".encode()
        await kv.put(b, os.urandom(6000))
        lb = await kv.layout(b)
        assert lb is not None
        sb = lb.extents[0].replicas[0].server_id
        if sb != sa:
            break
    else:
        raise AssertionError("50 puts all landed on one server")
    await cluster.stop_chunkserver(cluster.index_of(sb))
    bufs = [bytearray(5000), bytearray(6000)]
    assert await kv.get_into([b"a", b], bufs) == [5000, kvfs.MISS]  # on_lost="miss"
    assert bytes(bufs[0]) == await kv.get(b"a")


@both_backends
async def test_overwrite_and_delete(kv: AsyncClient) -> None:
    await kv.put(b"k", b"old")
    await kv.put(b"k", b"new")
    assert await kv.get(b"k") == b"new"
    assert await kv.delete_many([b"k", b"never"]) == 1
    assert await kv.get(b"k") is None


@both_backends
async def test_list_is_paginated_and_sorted(kv: AsyncClient) -> None:
    await kv.put_many({f"p/{i:04d}".encode(): b"v" for i in range(2500)})
    await kv.put(b"q/other", b"v")
    infos = await kv.list(b"p/", page_size=1000)
    assert [i.key for i in infos] == [f"p/{i:04d}".encode() for i in range(2500)]
    assert (await kv.list("p/", limit=3))[2].key == b"p/0002"


@both_backends
async def test_ttl_expires_via_clock(kv: AsyncClient, clock: object) -> None:
    await kv.put(b"short", b"v", ttl=10)
    await kv.put(b"long", b"v")
    assert await kv.get(b"short") == b"v"
    clock.advance(11)  # type: ignore[attr-defined]
    # an expired cached layout is a miss, the key asked twice in one call too
    assert await kv.get_many([b"short", b"long", b"short"]) == [None, b"v", None]
    assert await kv.match_prefix([b"long", b"short"]) == 1


@both_backends
async def test_replicas_survive_a_lost_server(cluster: LocalCluster, kv: AsyncClient) -> None:
    data = os.urandom(3 << 20)
    await kv.put(b"r", data, replicas=2)
    layout = await kv.layout(b"r")
    assert layout is not None
    assert all(len({r.server_id for r in e.replicas}) == 2 for e in layout.extents)
    victim = layout.extents[0].replicas[0].server_id
    await cluster.stop_chunkserver(cluster.index_of(victim))
    assert await kv.get(b"r") == data


@both_backends
async def test_sync_client(cluster: LocalCluster) -> None:
    import asyncio

    def work() -> None:
        with kvfs.Client(cluster.addr, token=cluster.token) as kv:
            kv.put(b"s", b"sync")
            kv.put_many({b"s1": b"1", b"s2": b"2"})
            assert kv.get(b"s") == b"sync"
            assert kv.get_many([b"s1", b"s2", b"s3"]) == [b"1", b"2", None]
            assert kv.match_prefix([b"s1", b"s2"]) == 2
            assert kv.delete(b"s")

    await asyncio.to_thread(work)


@both_backends
@pytest.mark.parametrize("key", [b"", b"k" * (MAX_KEY_BYTES + 1), 123])
async def test_bad_keys(kv: AsyncClient, key: object) -> None:
    with pytest.raises(InvalidArgument, match="key"):
        await kv.put(key, b"v")  # type: ignore[arg-type]


@both_backends
async def test_empty_key_list_is_an_empty_answer_without_an_rpc(kv: AsyncClient) -> None:
    before = dict(kv.rpc_counts)
    assert await kv.get_many([]) == []
    assert await kv.put_many({}) == []
    assert await kv.put_many([]) == []
    assert await kv.put_many([], if_absent=True) == []
    assert await kv.get_into([], []) == []
    assert await kv.get_ranges([]) == []
    assert await kv.exists_many([]) == []
    assert await kv.match_prefix([]) == 0
    assert await kv.delete_many([]) == 0
    assert dict(kv.rpc_counts) == before


async def test_value_too_large(kv: AsyncClient, tmp_path: object) -> None:
    import mmap

    path = os.path.join(str(tmp_path), "sparse")
    with open(path, "wb") as f:
        f.truncate((1 << 30) + 1)  # sparse: no memory, no disk
    with (open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
          pytest.raises(InvalidArgument, match="exceeds the limit")):
        await kv.put(b"huge", m)


async def test_not_bytes_value(kv: AsyncClient) -> None:
    with pytest.raises(InvalidArgument, match="bytes-like"):
        await kv.put(b"k", "a str")


@pytest.fixture
def torch() -> Any:
    """Imported before the cluster starts: on a loaded machine the import can block the
    loop past the heartbeat timeout and every chunkserver would look dead."""
    return pytest.importorskip("torch")


async def test_torch_tensors_in_and_out(torch: Any, kv: AsyncClient) -> None:
    src = torch.randn(4, 256, dtype=torch.bfloat16)
    await kv.put(b"tensor", src)
    dst = torch.empty_like(src)
    assert await kv.get_into([b"tensor"], [dst]) == [src.numel() * 2]
    assert torch.equal(src, dst)


@both_backends
async def test_stats_name_meta_store_and_its_bytes_on_disk(meta_backend: str, kv: AsyncClient) -> None:
    await kv.put_many([(f"s{i}", b"v" * 100) for i in range(50)])
    st = await kv.stats()
    kind = {"sqlite": "sqlite", "rocksdb": "rocksdb", "redis": "redis-cluster"}[meta_backend]
    assert st["store"] == kind and st["keys"] == 50
    assert (st["store_bytes"] > 0) == (kind != "redis-cluster")  # Redis holds it elsewhere


async def test_get_ranges_reads_only_covering_extents(cluster: LocalCluster, kv: AsyncClient) -> None:
    big = os.urandom(5 << 20)  # 5 stripe units
    await kv.put_many({b"big": big, b"small": b"0123456789"})
    stores = [cs.store for cs in cluster.chunkservers if cs is not None]
    before = sum(s.bytes_read for s in stores)
    got = await kv.get_ranges([(b"big", (2 << 20) + 10, (2 << 20) + 4106), (b"small", 2, 5),
                               (b"small", -3, None), (b"nope", 0, 1), (b"big", 10, 5)])
    assert got == [big[(2 << 20) + 10 : (2 << 20) + 4106], b"234", b"789", None, b""]
    read = sum(s.bytes_read for s in stores) - before
    assert read < (1 << 20) + 64 * 1024  # one unit of big (plus alignment), never all 5 MiB
    span = await kv.get_ranges([(b"big", (1 << 20) - 5, (1 << 20) + 5)])  # crosses two units
    assert span == [big[(1 << 20) - 5 : (1 << 20) + 5]]


@pytest.fixture
def gib_value() -> Any:
    """Made before the cluster starts (on a loaded machine, building 1 GiB can block the
    loop past the heartbeat timeout and every chunkserver would look dead)."""
    block = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
    value = np.tile(block, 1024)
    value[:: 1 << 20] = np.arange(1024) % 251  # every stripe unit differs
    return value


async def test_one_gib_value(gib_value: Any, kv: AsyncClient) -> None:
    """The largest value the API promises, written and read back byte-identical."""
    value = gib_value
    await kv.put(b"gib", value)
    layout = await kv.layout(b"gib")
    assert layout is not None and layout.size == 1 << 30 and len(layout.extents) == 1024
    out = np.empty(1 << 30, dtype=np.uint8)
    assert await kv.get_into([b"gib"], [out]) == [1 << 30]
    assert np.array_equal(value, out)


async def test_a_large_put_many_is_spread_in_contiguous_runs(kv: AsyncClient) -> None:
    items = {f"run/{i:04d}".encode(): os.urandom(256 * 1024) for i in range(256)}  # 64 MiB
    await kv.put_many(items)
    servers = []
    for k in items:
        lay = await kv.layout(k)
        assert lay is not None
        servers.append(lay.extents[0].replicas[0].server_id)
    per_run = kv.config.put_group_bytes // (256 * 1024)  # 16 values: runs of 4 MiB
    assert 1 < per_run < 256
    assert len(set(servers)) == 3  # 16 runs over the 3 servers
    runs = [servers[i : i + per_run] for i in range(0, 256, per_run)]
    assert all(len(set(run)) == 1 for run in runs)  # each run's values on one server
    assert all(a != b for a, b in itertools.pairwise(runs))  # the next run on the next server


@pytest.mark.parametrize("replicas", [1, 2])
async def test_put_layouts_are_what_meta_committed(kv: AsyncClient, replicas: int) -> None:
    """put_many's common case builds each value's views, sizes, key checks and layouts in C
    loops (no Python step per value): the layouts it returns and caches are meta's, byte for
    byte, for bytes, bytearray and memoryview values, str keys and a key given twice; the
    last value of a repeated key stays; no key stays in the running-puts table.  The layout
    returned is the cache's entry itself (built once: a read does not build it again)."""
    region = bytearray(os.urandom(3 * 4096))
    items: list[tuple[Any, Any]] = [(f"k{i}", os.urandom(4096)) for i in range(40)]
    items += [(b"ba", bytearray(b"x" * 100)), (b"mv", memoryview(region)[4096:8192]),
              (b"k3", b"again")]
    layouts = await kv.put_layouts(items, replicas=replicas)
    keys = [k.encode() if isinstance(k, str) else k for k, _ in items]
    assert not kv._putting
    cached = {k: kv.layout_cache._layouts[k] for k in keys}  # (before the LOOKUP replaces them)
    got = await kv.lookup(keys, use_cache=False)
    last = {k: i for i, k in enumerate(keys)}
    for i, (k, lay) in enumerate(zip(keys, layouts, strict=True)):
        assert lay is not None and len(lay.extents[0].replicas) == replicas
        if last[k] == i:
            assert got[i] == lay
            assert cached[k] is lay
    kv.layout_cache.clear()
    assert await kv.get_many(keys) == [bytes(items[last[k]][1]) for k in keys]


async def test_put_many_names_the_bad_key_or_value(kv: AsyncClient) -> None:
    with pytest.raises(InvalidArgument, match="empty key"):
        await kv.put_many([(b"a", b"1"), (b"", b"2")])
    with pytest.raises(InvalidArgument, match=f"longer than the limit of {MAX_KEY_BYTES}"):
        await kv.put_many([(b"a", b"1"), (b"k" * (MAX_KEY_BYTES + 1), b"2")])
    with pytest.raises(InvalidArgument, match="value for key b'bad'"):
        await kv.put_many([(b"a", b"1"), (b"bad", "a str")])
    assert not kv._putting
    assert await kv.get_many([b"a"]) == [None]


def test_norm_keys_checks_every_key() -> None:
    longest = b"k" * MAX_KEY_BYTES
    assert kvfs.layout.norm_keys([b"a", longest, b"bc"]) == [b"a", longest, b"bc"]
    assert kvfs.layout.norm_keys(iter(["a", bytearray(b"b"), memoryview(b"c"), b"d"])) == [b"a", b"b", b"c", b"d"]
    assert kvfs.layout.norm_keys([]) == []
    for bad, what in (([b"a", b""], "empty key"), ([longest + b"k", b"a"], "longer than the limit"),
                      ([b"a", 3], "must be bytes or str")):
        with pytest.raises(InvalidArgument, match=what):
            kvfs.layout.norm_keys(bad)  # type: ignore[arg-type]
