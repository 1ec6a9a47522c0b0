"""kvfs.bench.peers: every baseline store round-trips bytes; the loopback moves the bytes."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.bench.compare import peer_factories
from kvfs.bench.peers import (
    FilePerKeyStore,
    LoopbackLimit,
    MooncakeStore,
    PeerUnavailable,
    RedisStore,
    Store,
    run_fio_file,
)

HAVE_REDIS = shutil.which("redis-server") is not None
HAVE_FIO = shutil.which("fio") is not None
needs_redis = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server not installed")
try:
    import mooncake.store  # noqa: F401

    HAVE_MOONCAKE = True
except ImportError:
    HAVE_MOONCAKE = False
needs_mooncake = pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake not installed")
needs_fio = pytest.mark.skipif(not HAVE_FIO, reason="fio not installed")


def _items(*, empty: bool = True) -> list[tuple[bytes, bytes]]:
    rnd = os.urandom
    items = [
        (b"k-small", rnd(100)),
        (b"k-4k", rnd(4096)),
        (b"k-empty", b""),
        (b"k-1m", rnd(1 << 20)),
        (bytes(range(256)), rnd(513)),  # every byte value in the key
        (b"long-" + b"x" * 300, rnd(64)),  # hex name too long: hashed
        *((b"batch-%04d" % i, rnd(4096)) for i in range(200)),
    ]
    return [kv for kv in items if empty or kv[1]]


async def _roundtrip(store: Store, *, empty: bool = True) -> None:
    items = _items(empty=empty)
    await store.put_many(items)
    keys = [k for k, _ in items]
    got = await store.get_many([*keys, b"never-written"])
    assert got[:-1] == [v for _, v in items]
    assert got[-1] is None
    lookups: Any = store
    if hasattr(lookups, "exists_many"):  # the --api exists_many / match_prefix reads
        assert await lookups.exists_many([keys[0], b"never-written", keys[-1]]) == [True, False, True]
        assert await lookups.match_prefix([*keys[:3], b"never-written", keys[3]]) == 3
        assert await lookups.match_prefix(keys) == len(keys)
        assert await lookups.exists_many([]) == []
    # Overwrite replaces the value.
    await store.put_many([(b"k-small", b"new value")])
    assert await store.get_many([b"k-small", b"k-4k"]) == [b"new value", items[1][1]]
    assert await store.get_many([]) == []
    await store.put_many([])


@pytest.fixture
async def file_store(tmp_path: Path) -> AsyncIterator[FilePerKeyStore]:
    store = FilePerKeyStore(tmp_path / "store", threads=3)
    try:
        yield store
    finally:
        await store.close()


async def test_file_per_key_roundtrip(file_store: FilePerKeyStore) -> None:
    assert isinstance(file_store, Store)
    await _roundtrip(file_store)


async def test_file_per_key_layout(file_store: FilePerKeyStore) -> None:
    await file_store.put_many([(b"abc", b"v")])
    path = file_store.path_for(b"abc")
    assert path.name == b"abc".hex()
    assert path.parent.parent == file_store.root
    assert len(path.parent.name) == 2
    assert path.read_bytes() == b"v"
    assert not [p for p in path.parent.iterdir() if ".tmp" in p.name]  # renamed, no leftovers
    assert len([p for p in file_store.root.iterdir() if p.is_dir()]) == 256
    assert len(file_store.path_for(b"y" * 1000).name) < 100


async def test_a_file_cell_removes_the_files_of_the_cells_before_it(tmp_path: Path) -> None:
    """Each file cell gets a fresh store; the last cell's files go before the next file cell
    starts (its set-up), not when it closes (where the next peer's timed cell would pay for
    the unlinks)."""
    make = peer_factories(tmp_path)["file"]
    first = await make()
    assert isinstance(first, FilePerKeyStore)
    await first.put_many([(b"k", b"v" * 4096)])
    await first.close()
    assert first.root.exists()  # closing keeps them
    second = await make()
    assert isinstance(second, FilePerKeyStore)
    assert not first.root.exists() and second.root.exists() and second.root != first.root
    await second.close()


async def test_file_per_key_closed(tmp_path: Path) -> None:
    store = FilePerKeyStore(tmp_path)
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await store.get_many([b"k"])


@needs_redis
@pytest.mark.subprocess
@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_redis_roundtrip(transport: str) -> None:
    store = await RedisStore.open(transport="tcp" if transport == "tcp" else "unix")
    try:
        assert isinstance(store, Store)
        if transport == "tcp":
            assert 20000 <= store.port < 60000
        else:
            assert store.port == 0
        await _roundtrip(store)
    finally:
        await store.close()
    await store.close()  # idempotent


@needs_mooncake
@pytest.mark.subprocess
async def test_mooncake_roundtrip_over_tcp() -> None:
    try:
        store = await MooncakeStore.open(segment_bytes=64 << 20)
    except PeerUnavailable as e:  # e.g. its fixed ports kept colliding on a busy machine
        pytest.skip(f"mooncake could not start here: {e.reason[:300]}")
    try:
        assert isinstance(store, Store)
        assert set(store.pids()) == {"mooncake_master", "mooncake_client"}
        await _roundtrip(store, empty=False)  # Mooncake refuses empty values (INVALID_PARAMS)
        items = _items(empty=False)
        await store.put_many(items)  # a second put of the same keys rewrites them (upsert)
        assert await store.exists_many([items[0][0], b"absent"]) == [True, False]
        bufs = [store.buffer(len(v)) for _, v in items]
        got = await store.get_into([k for k, _ in items], bufs)
        assert got == [len(v) for _, v in items]
        assert [bytes(b) for b in bufs] == [v for _, v in items]
    finally:
        await store.close()
    await store.close()  # idempotent


@needs_mooncake
@pytest.mark.subprocess
async def test_mooncake_prefill_shape_over_the_transport_queue() -> None:
    """The bench's 4 KiB shape: puts and reads of 128 keys, 4 in flight, then puts and reads
    of 2048 keys, two calls at once. Mooncake's TCP transport queues 1024 transfers per peer
    and fails the rest (TRANSFER_FAIL); the peer keeps its keys in flight within that queue."""
    import asyncio

    from kvfs.bench.runner import Workload, run_workload

    try:
        store = await MooncakeStore.open(segment_bytes=64 << 20)
    except PeerUnavailable as e:
        pytest.skip(f"mooncake could not start here: {e.reason[:300]}")
    try:
        wl = Workload(name="mc-4k", rw="randread", bs=4096, batch=128, iodepth=4, nkeys=4096,
                      time_based=False, runtime_s=600.0, verify=True)  # prefill: calls of 128 keys
        res = await run_workload(store, wl, progress=False)
        assert (res.missing, res.mismatched) == (0, 0)
        assert res.read.total_ios == 4096
        # puts, get_into and get_many of more keys than the queue holds, two calls at once
        items = [(b"q%05d" % i, os.urandom(4096)) for i in range(4096)]
        await asyncio.gather(store.put_many(items[:2048]), store.put_many(items[2048:]))
        items = items[::2]  # 2048 of them, from both puts
        bufs = [store.buffer(4096) for _ in items]
        keys = [k for k, _ in items]
        got, values = await asyncio.gather(store.get_into(keys, bufs), store.get_many(keys))
        assert got == [4096] * len(items)
        assert [bytes(b) for b in bufs] == [v for _, v in items]
        assert values == [v for _, v in items]
        assert store.keys_per_call * store.threads <= store.max_keys_in_flight == 1024
    finally:
        await store.close()


@needs_mooncake
@pytest.mark.subprocess
async def test_mooncake_two_peers_at_once_on_the_same_ports() -> None:
    """Two peers seeded alike start at once and try the same ports: a process whose port was
    taken exits, and is started again on other ports; each peer talks to its own processes."""
    import asyncio

    from kvfs.bench.peers._process import listening_ports

    opened = await asyncio.gather(*(MooncakeStore.open(segment_bytes=32 << 20, seed=4321) for _ in range(2)),
                                  return_exceptions=True)
    stores = [s for s in opened if isinstance(s, MooncakeStore)]
    try:
        assert len(stores) == 2, opened
        a, b = stores
        assert a.master_port != b.master_port
        for s in stores:
            assert s.master_port in listening_ports(s.pids()["mooncake_master"])
        await asyncio.gather(a.put_many([(b"k", b"from a")]), b.put_many([(b"k", b"from b")]))
        assert await a.get_many([b"k"]) == [b"from a"]
        assert await b.get_many([b"k"]) == [b"from b"]
    finally:
        for s in stores:
            await s.close()


@needs_mooncake
@pytest.mark.subprocess
async def test_mooncake_port_taken_before_start_moves_on() -> None:
    """A foreign socket listening on the master's first port: the peer must not take it for
    its master (a connect would reach it), and starts the master elsewhere."""
    import socket

    first = MooncakeStore(seed=99)._ports()[0]
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", first))
        except OSError:
            pytest.skip(f"port {first} is taken here already")
        sock.listen()
        try:
            store = await MooncakeStore.open(segment_bytes=32 << 20, seed=99)
        except PeerUnavailable as e:
            pytest.fail(f"the peer did not move past a taken port: {e.reason[:500]}")
        try:
            assert store.master_port != first
            await store.put_many([(b"k", b"v")])
            assert await store.get_many([b"k"]) == [b"v"]
        finally:
            await store.close()


async def test_mooncake_missing_package_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(PeerUnavailable, match="mooncake not installed"):
        await MooncakeStore.open()


@needs_redis
@pytest.mark.subprocess
async def test_redis_large_batches_are_split() -> None:
    store = await RedisStore.open(transport="unix", max_command_bytes=64 << 10)
    try:
        items = [(b"k%05d" % i, os.urandom(1000)) for i in range(5000)]
        await store.put_many(items)  # ~80 MSETs in one pipeline
        got = await store.get_many([k for k, _ in items])  # 2 MGETs (4096 keys each at most)
        assert got == [v for _, v in items]
    finally:
        await store.close()


async def test_redis_missing_binary_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(PeerUnavailable, match="not installed") as ei:
        await RedisStore.open(redis_server=str(tmp_path / "no-such-redis-server"))
    assert "not installed" in ei.value.reason


@needs_redis
@pytest.mark.subprocess
async def test_redis_port_retry_after_address_in_use() -> None:
    """Two stores seeded alike try the same first port; the second moves on."""
    first = await RedisStore.open(seed=1234)
    try:
        second = await RedisStore.open(seed=1234)
        try:
            assert second.port != first.port
            await second.put_many([(b"a", b"b")])
            assert await second.get_many([b"a"]) == [b"b"]
        finally:
            await second.close()
    finally:
        await first.close()


@pytest.mark.parametrize(
    "server", ["inprocess", pytest.param("process", marks=pytest.mark.subprocess)]
)
async def test_loopback_moves_the_bytes(server: str) -> None:
    lim = await LoopbackLimit.open(server="process" if server == "process" else "inprocess")
    try:
        items = [(b"k%03d" % i, os.urandom(4096)) for i in range(128)] + [(b"big", bytes(3 << 20))]
        await lim.put_many(items)
        sent = sum(len(v) for _, v in items)
        assert lim.bytes_sent == sent
        keys = [k for k, _ in items]
        got = await lim.get_many([*keys, b"never-put"])
        assert lim.bytes_received == sent
        assert [None if v is None else len(v) for v in got] == [len(v) for _, v in items] + [None]
        # A second round reuses the preallocated receive buffer.
        await lim.get_many(keys[:10])
        assert lim.bytes_received == sent + 10 * 4096
        assert await lim.get_many([b"never-put"]) == [None]
        assert lim.bytes_received == sent + 10 * 4096
    finally:
        await lim.close()


async def test_loopback_pipelines_concurrent_calls() -> None:
    import asyncio

    lim = await LoopbackLimit.open(server="inprocess", copy_out=True)
    try:
        await lim.put_many([(b"a", b"x" * 1000), (b"b", b"y" * 5000)])
        results = await asyncio.gather(*(lim.get_many([b"a", b"b"]) for _ in range(16)))
        for got in results:
            assert [len(v) if v is not None else None for v in got] == [1000, 5000]
        assert lim.bytes_received == 16 * 6000
    finally:
        await lim.close()


@needs_fio
def test_run_fio_file_returns_fio_json(tmp_path: Path) -> None:
    # not time based: fio stops after the file's 256 reads; the runtime is only a cap, generous
    # so that a loaded machine still finishes them (0.2 s did 4 of 256 at load 9)
    res = run_fio_file("4k", "1m", "randread", 60.0, tmp_path, name="fio-check", time_based=False)
    (job,) = res["jobs"]
    assert job["jobname"] == "fio-check"
    rd = job["read"]
    assert rd["total_ios"] == 256
    for key in ("iops", "bw_bytes", "bw", "runtime", "io_bytes", "clat_ns", "lat_ns"):
        assert key in rd
    assert "99.000000" in rd["clat_ns"]["percentile"]
    assert not list(tmp_path.iterdir())  # --unlink=1


@needs_fio
def test_our_json_is_a_subset_of_real_fio(tmp_path: Path) -> None:
    from kvfs.bench.stats import LatencyRecorder, format_job_text, job_json

    real = run_fio_file("4k", "256k", "read", 0.2, tmp_path, time_based=False)["jobs"][0]
    rec = LatencyRecorder()
    rec.record(1000, 1, 4096, 0)
    ours = job_json("x", read=rec, runtime_ns=1_000_000)
    for ddir in ("read", "write"):
        missing = set(ours[ddir]) - set(real[ddir]) - {"call_lat_ns"}  # our one, documented addition
        assert not missing, f"{ddir}: our keys fio does not have: {missing}"
        assert set(ours[ddir]["clat_ns"]) <= set(real[ddir]["clat_ns"])
    for key in ("jobname", "groupid", "error", "job options", "latency_us", "latency_ms"):
        assert key in real
        assert key in ours
    assert list(ours["latency_ms"]) == list(real["latency_ms"])
    # The text formatter reads real fio JSON too.
    assert "  read: IOPS=" in format_job_text(real)


def test_run_fio_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(PeerUnavailable, match="not installed"):
        run_fio_file(4096, 4096, "read", 0.1, tmp_path, fio=str(tmp_path / "no-fio"))
