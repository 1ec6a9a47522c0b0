"""A meta that lost its database (or another cluster's meta) can never make chunkservers delete."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.chunkserver import ChunkServer
from kvfs.errors import InvalidArgument, Unavailable, WrongCluster
from kvfs.gc import GarbageCollector, PassOptions
from kvfs.handshake import Role
from kvfs.launcher import LocalCluster
from kvfs.meta.localstore import drop_stores
from kvfs.transport import Connection


def _chunk_files(cluster: LocalCluster) -> set[Path]:
    return {p for i in range(cluster.n) for p in (cluster.root / f"cs{i}" / "chunks").glob("*.chunk")}


async def _register_again(cs: ChunkServer) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            await cs._register()
            return
        except Unavailable:  # the connection to the old meta, found closed: the next try reconnects
            assert time.monotonic() < deadline


async def test_a_fresh_meta_cannot_make_chunkservers_delete(tmp_path: Path) -> None:
    """Before cluster ids: meta's database deleted + restart, and GC deleted every chunk file."""
    async with LocalCluster(tmp_path / "c", 3) as cluster:
        async with cluster.client() as kv:
            await kv.put_many({f"k{i}".encode(): os.urandom(20_000) for i in range(60)})
        files = _chunk_files(cluster)
        assert files
        old_id = cluster.meta.cluster_id  # type: ignore[union-attr]
        await cluster.stop_meta()
        drop_stores(tmp_path / "c" / "meta")
        await cluster.start_meta()  # a fresh database: a new cluster id
        assert cluster.meta is not None and cluster.meta.cluster_id != old_id
        for cs in cluster.chunkservers:
            assert cs is not None and cs.store.cluster_id == old_id
            with pytest.raises(WrongCluster, match="rebuild"):
                await _register_again(cs)  # what its heartbeat loop retries: refused every time
        assert not cluster.meta.index.servers
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            for _ in range(3):
                await gc.run_pass(PassOptions(apply=True, grace_s=0.0))
        assert _chunk_files(cluster) == files


async def test_a_chunkserver_refuses_deletes_for_another_cluster(cluster: LocalCluster) -> None:
    cs = cluster.chunkservers[0]
    assert cs is not None and cs.store.cluster_id == cluster.meta.cluster_id  # type: ignore[union-attr]
    host, port = parse_addr(cs.addr)
    conn = await Connection.open(host, port, cluster.admin_token)
    try:
        for cid in (None, "0" * 32):
            with pytest.raises(WrongCluster, match="refused"):
                await conn.call(rpc.ChunkDelete(chunks=list(cs.store.sizes), cluster_id=cid))
    finally:
        conn.close()


async def test_meta_refuses_an_unknown_chunkserver_that_holds_chunks(cluster: LocalCluster) -> None:
    host, port = parse_addr(cluster.addr)
    conn = await Connection.open(host, port, cluster.tokens[Role.SERVER])
    try:
        with pytest.raises(WrongCluster, match="never seen"):
            await conn.call(rpc.Register(server_id=99, addr="127.0.0.1:1", capacity=1, free=1,
                                         cluster_id=None, nchunks=5))
        with pytest.raises(WrongCluster, match="belongs to cluster"):
            await conn.call(rpc.Register(server_id=1, addr="127.0.0.1:1", capacity=1, free=1,
                                         cluster_id="other", nchunks=0))
        # a new, empty chunkserver joins and learns the id
        r = await conn.call(rpc.Register(addr="127.0.0.1:1", capacity=1, free=1))
        assert r.cluster_id == cluster.meta.cluster_id  # type: ignore[union-attr]
    finally:
        conn.close()


async def test_meta_refuses_another_data_dir_taking_a_live_chunkservers_id(cluster: LocalCluster) -> None:
    """A live chunkserver's id is not given to a server at another address that cannot prove
    its data dir (another key): the registry keeps the live one's address."""
    cs = cluster.chunkservers[0]
    assert cs is not None and cs.store.key
    meta = cluster.meta
    assert meta is not None
    sid = cs.store.server_id
    host, port = parse_addr(cluster.addr)
    conn = await Connection.open(host, port, cluster.tokens[Role.SERVER])
    try:
        with pytest.raises(InvalidArgument, match=f"chunkserver {sid} is alive at {cs.addr}"):
            await conn.call(rpc.Register(server_id=sid, addr="127.0.0.1:1", capacity=1, free=1,
                                         key="another data dir", cluster_id=meta.cluster_id))
        assert meta.index.servers[sid].addr == cs.addr
        assert meta.index.servers[sid].key == cs.store.key
    finally:
        conn.close()


async def test_the_cluster_id_survives_restarts(cluster: LocalCluster) -> None:
    before = cluster.meta.cluster_id  # type: ignore[union-attr]
    await cluster.stop_meta()
    await cluster.start_meta()
    assert cluster.meta.cluster_id == before  # type: ignore[union-attr]
    await cluster.stop_chunkserver(1)
    cs = await cluster.start_chunkserver(1)
    assert cs.store.cluster_id == before


async def test_a_refused_chunkserver_start_leaves_nothing_running(tmp_path: Path) -> None:
    """A chunkserver refused by meta (another cluster's data dir) is closed by its own start():
    its listener, meta connection and data-dir lock are gone, and the cluster still stops."""
    cluster = LocalCluster(tmp_path / "c", 2)
    await cluster.start()
    try:
        await cluster.stop_chunkserver(1)
        await cluster.stop_meta()
        drop_stores(tmp_path / "c" / "meta")
        await cluster.start_meta()  # a fresh database: a new cluster id, so cs1 is refused
        with pytest.raises(WrongCluster, match="rebuild"):
            await cluster.start_chunkserver(1)
        assert cluster.chunkservers[1] is None
        again = ChunkServer(cluster.cs_config(1), tokens=cluster.tokens)  # the data-dir lock is free
        again.lock.release()
        await again.store.close()
    finally:
        async with asyncio.timeout(30):
            await cluster.stop()
