"""Every RPC of meta and chunkservers fed malformed headers: an answer (often an error
frame) every time, and the server keeps serving."""

from __future__ import annotations

import random
from typing import Any

from kvfs.address import parse_addr
from kvfs.errors import KVFSError
from kvfs.launcher import LocalCluster
from kvfs.rpc import RPCS, Op, Service
from kvfs.transport import Connection

NASTY: list[Any] = [None, -1, 0, 2**64 - 1, -(2**63), 1.5e308, float("nan"), "x", b"", b"\xff" * 2000, [], {}, [[1, 2]],
                    [[b"k", -5, 0, None]], {"a": [None]}, [None, None, None, None, None],
                    [[b"k", [1, 0, 0.0, None, [[1, 0, [[1, 1, 0]]]]]]]]
FIELDS = ["keys", "items", "ranges", "records", "prefix", "start_after", "limit", "lease_s",
          "ttl_s", "server_id", "addr", "capacity", "free", "used", "chunks", "chunk_id",
          "apply", "threshold", "high", "low", "grace_s", "moves", "run", "paused", "idle_s"]


async def _fuzz(addr: str, token: str, service: Service, rng: random.Random) -> int:
    host, port = parse_addr(addr)
    conn = await Connection.open(host, port, token, request_timeout_s=30)
    answered = 0
    try:
        ops = [op for op, r in RPCS.items() if r.service == service]
        for _ in range(400):
            op = rng.choice(ops)
            header = {f: rng.choice(NASTY) for f in rng.sample(FIELDS, rng.randint(0, 4))}
            payload = [rng.randbytes(rng.randint(0, 64))] if rng.random() < 0.3 else []
            try:
                await conn.call(op, header, payload)
            except KVFSError:
                pass
            answered += 1
        assert (await conn.call(Op.PING, {})).header["service"] == service.value
    finally:
        conn.close()
    return answered


async def test_meta_survives_malformed_requests(cluster: LocalCluster) -> None:
    rng = random.Random(1)
    assert await _fuzz(cluster.addr, cluster.admin_token, Service.META, rng) == 400
    async with cluster.client() as kv:  # and still works for a real client
        await kv.put(b"after-fuzz", b"ok")
        assert await kv.get(b"after-fuzz") == b"ok"


async def test_chunkserver_survives_malformed_requests(cluster: LocalCluster) -> None:
    rng = random.Random(2)
    cs = cluster.chunkservers[0]
    assert cs is not None
    assert await _fuzz("kvfs://" + cs.addr, cluster.admin_token, Service.CHUNKSERVER, rng) == 400
    async with cluster.client() as kv:
        await kv.put_many({f"f{i}": b"v" * 100 for i in range(30)})
        assert await kv.get_many([f"f{i}" for i in range(30)]) == [b"v" * 100] * 30
