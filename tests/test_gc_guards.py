"""The three GC safety guards of :mod:`kvfs.meta.gc`, each driven through its race.

Each test holds one RPC in meta's dispatch (:class:`Hold`) so that meta applies
racing RPCs in the order the test chooses, then checks the bytes a fresh
client reads back. Each fails when its guard is removed (see tests/MUTATION.md):

- GC_RETIRE refuses a chunk that a committed layout references
  (``chunk_live <= 0``);
- COMMIT refuses a layout naming a retired chunk (``check_not_dead``);
- GC_RELOCATE switches only a replica still at the copied (chunk, offset).

One chunkserver, so every put lands on the server being collected: placement
plays no part and every interleaving is deterministic. The cluster runs on a
fake clock; the passes use ``grace_s=0`` (the chunkserver's seal idles on the
real monotonic clock), so no step waits on time.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock

from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig
from kvfs.errors import StaleLayout
from kvfs.gc.driver import GarbageCollector, PassOptions
from kvfs.launcher import LocalCluster
from kvfs.rpc import Op
from kvfs.server import RpcServer

NOW = PassOptions(apply=True, grace_s=0)
WAIT_S = 30.0  # a deadline for an RPC to reach meta, never a sleep


def value_of(key: str, size: int = 8192) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Hold:
    """Holds every request of one op in a server's dispatch until :meth:`release`.

    Fault injection for ordering: ``arrived`` is set when the first request
    reaches the server, which then applies nothing of it until released."""

    def __init__(self, server: RpcServer, op: Op) -> None:
        self.op = op
        self.arrived = asyncio.Event()
        self._open = asyncio.Event()
        inner: Callable[..., Awaitable[Any]]
        inner, request_type = server.handlers[int(op)]

        async def held(*args: Any) -> Any:
            self.arrived.set()
            await self._open.wait()
            return await inner(*args)

        server.handlers[int(op)] = (held, request_type)

    async def reached(self) -> None:
        async with asyncio.timeout(WAIT_S):
            await self.arrived.wait()

    def release(self) -> None:
        self._open.set()


def hold(cluster: LocalCluster, op: Op) -> Hold:
    assert cluster.meta is not None
    return Hold(cluster.meta.rpc, op)


@pytest.fixture
async def one(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    root = tmp_path / "one"
    c = LocalCluster(root, 1, clock=clock, chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2))
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


def client(c: LocalCluster, clock: FakeClock) -> AsyncClient:
    kv = c.client()
    kv.clock = clock
    return kv


def chunk_files(c: LocalCluster) -> set[str]:
    return {p.name for p in c.root.glob("cs*/chunks/*.chunk")}


async def test_retire_refuses_a_chunk_a_commit_made_live(one: LocalCluster, clock: FakeClock) -> None:
    """put appends; GC plans the (still unreferenced) chunk for deletion; the commit lands;
    then GC_RETIRE arrives: it must see the new reference and retire nothing."""
    commit = hold(one, Op.COMMIT)
    retire = hold(one, Op.GC_RETIRE)
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.token) as gc:
        put = asyncio.create_task(kv.put("k", value_of("k")))
        await commit.reached()  # the bytes are appended, meta has not seen them
        gc_pass = asyncio.create_task(gc.run_pass(NOW))
        await retire.reached()  # sealed, planned for deletion as unreferenced
        files = chunk_files(one)
        assert len(files) == 1
        commit.release()
        await put  # the commit wins: the chunk was not retired yet
        retire.release()
        report = await gc_pass
        assert report.chunks_deleted == 0
        assert chunk_files(one) == files
    async with client(one, clock) as fresh:
        assert await fresh.get("k") == value_of("k")


async def test_commit_refuses_a_layout_naming_a_retired_chunk(one: LocalCluster, clock: FakeClock) -> None:
    """put appends; a whole GC pass retires and deletes the unreferenced chunk; then the commit
    arrives: it must be refused (StaleLayout), never make a key whose bytes are gone."""
    commit = hold(one, Op.COMMIT)
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.token) as gc:
        put = asyncio.create_task(kv.put("k", value_of("k")))
        await commit.reached()
        report = await gc.run_pass(NOW)
        assert report.chunks_deleted == 1 and chunk_files(one) == set()
        commit.release()
        with pytest.raises(StaleLayout, match="retry the put"):
            await put
        async with client(one, clock) as fresh:
            assert await fresh.get("k") is None
            assert await fresh.exists("k") is False
            await kv.put("k", value_of("k"))  # the retried put lands in a fresh chunk
            assert await fresh.get("k") == value_of("k")


async def test_relocate_never_undoes_an_overwrite_made_during_compaction(
        one: LocalCluster, clock: FakeClock) -> None:
    """GC copies a chunk's live records; an overwrite and a delete land; then GC_RELOCATE
    arrives: the overwritten key keeps its new bytes, the deleted key stays deleted."""
    keys = [f"k{i:03d}" for i in range(60)]
    newer = b""
    async with client(one, clock) as kv, GarbageCollector(one.addr, token=one.token) as gc:
        await kv.put_many([(k, value_of(k)) for k in keys])
        await kv.delete_many(keys[::2])  # half garbage: the chunk is compacted
        live = keys[1::2]
        over, gone, rest = live[0], live[1], live[2:]
        relocate = hold(one, Op.GC_RELOCATE)
        gc_pass = asyncio.create_task(gc.run_pass(NOW))
        await relocate.reached()  # live records copied to a new chunk, layouts not switched
        newer = value_of("newer")  # as long as the copied value: only its CRC tells them apart
        await kv.put(over, newer)  # on the same server: the only one
        await kv.delete(gone)
        relocate.release()
        report = await gc_pass
        assert report.chunks_compacted == 1 and report.chunks_deleted == 1
        assert report.relocations_lost == 2
        assert report.keys_relocated == len(rest)
    async with client(one, clock) as fresh:
        assert await fresh.get(over) == newer
        assert await fresh.get(gone) is None
        assert await fresh.get_many(rest) == [value_of(k) for k in rest]
        assert await fresh.get_many(keys[::2]) == [None] * len(keys[::2])
