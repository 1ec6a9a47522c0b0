"""Read repair: a replica that a read finds failing its CRC-32C (the value read from another
replica) is reported to meta (REPORT_BAD), which checks it on its chunkserver and repairs it
from a good copy, as `kvfs gc scrub` would; a report alone changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import TEST_HEARTBEAT_TIMEOUT_S, hold, kvfs_admin, reports_checked

from kvfs import rpc
from kvfs.bench.reliability import flip_byte, until_mended
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig, MetaConfig
from kvfs.launcher import LocalCluster
from kvfs.layout import Layout
from kvfs.rpc import Op
from kvfs.sync import Client

DEADLINE_S = 30.0
both_backends = pytest.mark.usefixtures("meta_backend")


@pytest.fixture
def suspect_replicas() -> int:
    return MetaConfig.__dataclass_fields__["suspect_replicas"].default  # type: ignore[no-any-return]


@pytest.fixture
async def cluster(tmp_path: Path, suspect_replicas: int) -> AsyncIterator[LocalCluster]:
    root = tmp_path / "cluster"
    c = LocalCluster(root, 3, meta=MetaConfig(
        data=root / "meta", listen="127.0.0.1:0", heartbeat_timeout_s=TEST_HEARTBEAT_TIMEOUT_S,
        suspect_replicas=suspect_replicas))
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


async def metrics(cluster: LocalCluster) -> dict[str, float]:
    rc, out = await kvfs_admin(cluster, "gc", "status", "--json")
    assert rc == 0, out
    return json.loads(out)["metrics"]  # type: ignore[no-any-return]


async def layout_without(kv: AsyncClient, key: str, old: Layout) -> Layout:
    """The key's layout once meta no longer names ``old``'s first replica (polled)."""
    lay = await until_mended(kv, key, old.extents[0].replicas[0], DEADLINE_S)
    assert lay is not None, f"{key}: its corrupt replica was not repaired in {DEADLINE_S}s"
    return lay


async def corrupt_first_replica(cluster: LocalCluster, key: str, value: bytes) -> Layout:
    """``key`` put with 2 replicas, then a byte of its first replica flipped; its layout."""
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put(key, value)
        old = await kv.layout(key)
    assert old is not None
    flip_byte(cluster, old.extents[0].replicas[0], len(value) // 2)
    return old


@both_backends
async def test_a_replica_a_read_finds_corrupt_is_repaired_from_the_good_one(cluster: LocalCluster) -> None:
    values = {f"k{i}": os.urandom(20_000 + i) for i in range(8)}
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many(list(values.items()))
        old = await kv.layout("k3")
    assert old is not None
    flip_byte(cluster, old.extents[0].replicas[0], 100)
    async with cluster.client(ClientConfig(replicas=2)) as reader:
        assert await reader.get_many(list(values)) == list(values.values())  # the other replica
        fixed = await layout_without(reader, "k3", old)
    assert len(fixed.extents[0].replicas) == 2
    assert old.extents[0].replicas[1] in fixed.extents[0].replicas  # the good copy stays
    await reports_checked(cluster)
    m = await metrics(cluster)
    assert (m["replicas_reported_bad"], m["extents_repaired"], m["keys_lost"]) == (1, 1, 0), m
    rc, out = await kvfs_admin(cluster, "gc", "status")
    assert rc == 0 and "bad replicas: 1 found where readers reported them" in out, out
    rc, out = await kvfs_admin(cluster, "gc", "scrub")  # every replica good again
    assert rc == 0 and "0 failing their checksum, 0 missing" in out, out
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        assert await kv.get_many(list(values)) == list(values.values())


async def test_the_blocking_client_reports_a_corrupt_replica_too(cluster: LocalCluster) -> None:
    value = os.urandom(50_000)
    old = await corrupt_first_replica(cluster, "b", value)

    def read() -> bytes | None:  # on a thread: its calls block, and this loop runs the cluster
        with Client(cluster.addr, token=cluster.token, config=ClientConfig(replicas=2)) as blocking:
            return blocking.get("b")

    assert await asyncio.to_thread(read) == value
    async with cluster.client() as kv:
        await layout_without(kv, "b", old)
    await reports_checked(cluster)
    assert (await metrics(cluster))["replicas_reported_bad"] == 1


async def test_a_read_does_not_wait_for_its_report(cluster: LocalCluster) -> None:
    """Meta holding the REPORT_BAD (fault injection: as a meta that is down or slow would): the
    read that found the bad replica still returns the good copy's bytes, and a second read of
    it too (its replica added to the report being sent); then meta checks the replica once
    (the second report names a replica being checked, or one the layout no longer names)."""
    value = os.urandom(40_000)
    old = await corrupt_first_replica(cluster, "h", value)
    held = hold(cluster, Op.REPORT_BAD)
    async with cluster.client(ClientConfig(replicas=2)) as reader:
        async with asyncio.timeout(DEADLINE_S):
            assert await reader.get("h") == value
            await held.reached()
            assert await reader.get("h") == value
        held.release()
        await layout_without(reader, "h", old)
    await reports_checked(cluster)
    assert (await metrics(cluster))["replicas_reported_bad"] == 1


@both_backends
async def test_a_report_of_a_good_replica_or_one_no_layout_names_changes_nothing(
        cluster: LocalCluster) -> None:
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put("g", b"good" * 1000)
        lay = await kv.layout("g")
        assert lay is not None
        r = lay.extents[0].replicas[0]
        noted = await kv._link.call_meta(rpc.ReportBad(items=[
            rpc.BadReplica(b"g", r.server_id, r.chunk_id, r.offset),
            rpc.BadReplica(b"g", r.server_id, r.chunk_id, r.offset + 4096),  # names no replica
            rpc.BadReplica(b"absent", r.server_id, r.chunk_id, r.offset)]))
        assert noted.queued == 1
        await reports_checked(cluster)
        assert await kv.layout("g") == lay
        assert await kv.get("g") == b"good" * 1000
    m = await metrics(cluster)
    assert (m["replicas_reported_bad"], m["extents_repaired"], m["replicas_dropped"]) == (0, 0, 0), m


@pytest.mark.parametrize("suspect_replicas", [1])
async def test_reports_past_suspect_replicas_are_dropped(cluster: LocalCluster) -> None:
    async with cluster.client(ClientConfig(replicas=2)) as kv:
        await kv.put_many([("a", b"a" * 5000), ("b", b"b" * 5000)])
        items = []
        for key in ("a", "b"):
            lay = await kv.layout(key)
            assert lay is not None
            r = lay.extents[0].replicas[0]
            items.append(rpc.BadReplica(key.encode(), r.server_id, r.chunk_id, r.offset))
        assert cluster.meta is not None
        cluster.meta.gc._checking = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
        try:  # (fault injection: a check still running, so the first report stays held)
            assert (await kv._link.call_meta(rpc.ReportBad(items=items))).queued == 1
            assert (await kv._link.call_meta(rpc.ReportBad(items=items[1:]))).queued == 0
        finally:
            cluster.meta.gc._checking = None
            cluster.meta.gc._suspects.clear()


@pytest.mark.parametrize("suspect_replicas", [0])
async def test_suspect_replicas_0_ignores_reports(cluster: LocalCluster) -> None:
    value = os.urandom(30_000)
    old = await corrupt_first_replica(cluster, "z", value)
    async with cluster.client(ClientConfig(replicas=2)) as reader:
        assert await reader.get("z") == value
    # the reader's close waited for its REPORT_BAD's answer: meta has had it, and held nothing
    assert cluster.meta is not None and cluster.meta.gc._checking is None
    assert not cluster.meta.gc._suspects
    async with cluster.client() as kv:
        assert await kv.layout("z") == old
    assert (await metrics(cluster))["replicas_reported_bad"] == 0


def test_suspect_replicas_must_not_be_negative(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--suspect-replicas must be at least 0, got -1"):
        replace(MetaConfig(data=tmp_path), suspect_replicas=-1)
