"""Large puts: each server's records go as APPENDs of at most ``max_rpc_bytes``, all sent
at once (the server writes one while it receives the next); a striped value's whole CRC is
combined from its units' CRCs (``kvfs/crc.py``), never summed a second time."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import crc32c
import pytest

from kvfs.chunkserver.store import ChunkStore
from kvfs.config import ClientConfig
from kvfs.crc import crc32c_combine
from kvfs.errors import ChecksumMismatch
from kvfs.launcher import LocalCluster

MiB = 1 << 20


def test_combine_equals_the_crc_of_the_joined_bytes() -> None:
    rng = random.Random(11)
    sizes = [0, 1, 2, 3, 4, 7, 8, 255, 256, 4096, 65_537, MiB]
    for _ in range(300):
        a = rng.randbytes(rng.choice([*sizes, rng.randrange(5000)]))
        b = rng.randbytes(rng.choice([*sizes, rng.randrange(5000)]))
        assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
    # many parts folded left, as a striped value's units are
    parts = [rng.randbytes(rng.randrange(1, 70_000)) for _ in range(20)]
    whole = 0
    for i, p in enumerate(parts):
        whole = crc32c_combine(whole, crc32c.crc32c(p), len(p)) if i else crc32c.crc32c(p)
    assert whole == crc32c.crc32c(b"".join(parts))


async def test_one_servers_pieces_are_in_flight_together(tmp_path: Path) -> None:
    """With one server and 4 pieces, no piece is answered before all 4 were sent: a writer
    that waited for each answer before sending the next would never send the second."""
    cfg = ClientConfig(max_rpc_bytes=MiB)
    async with LocalCluster(tmp_path, 1) as cluster:
        kv = cluster.client(cfg)
        try:
            link = kv.writer._link
            real = link.call_server
            started: list[int] = []
            all_sent = asyncio.Event()

            async def gated(sid: int, request: Any, payload: Sequence[Any] = (), **kw: Any) -> Any:
                started.append(sum(len(memoryview(p)) for p in payload))
                if len(started) == 4:
                    all_sent.set()
                async with asyncio.timeout(10):  # sequential sends: the first never returns
                    await all_sent.wait()
                return await real(sid, request, payload, **kw)

            link.call_server = gated  # type: ignore[method-assign]
            values = {f"p{i}".encode(): os.urandom(512 * 1024) for i in range(8)}  # 4 MiB
            await kv.put_many(values)
            assert sorted(started) == [MiB] * 4
            link.call_server = real  # type: ignore[method-assign]
            kv.layout_cache.clear()
            assert await kv.get_many(list(values)) == list(values.values())
        finally:
            await kv.close()
        (server,) = cluster.chunkservers
        assert server is not None and server.append_calls == 4


async def test_striped_values_in_pieces_read_back_with_whole_crcs(tmp_path: Path) -> None:
    async with LocalCluster(tmp_path, 3) as cluster:
        kv = cluster.client(ClientConfig(max_rpc_bytes=2 * MiB))
        try:
            values = {b"v8": os.urandom(8 * MiB), b"odd": os.urandom(5 * MiB + 12_345),
                      b"small": os.urandom(1000)}
            await kv.put_many(values)
            for k, v in values.items():
                lay = await kv.layout(k)
                assert lay is not None and lay.size == len(v)
                assert lay.crc == crc32c.crc32c(v)  # the combined whole CRC, as summed at once
                assert len(lay.extents) == -(-len(v) // MiB)
            kv.layout_cache.clear()
            assert await kv.get_many(list(values)) == list(values.values())
            out = [bytearray(len(v)) for v in values.values()]
            assert await kv.get_into(list(values), out) == [len(v) for v in values.values()]
            assert [bytes(o) for o in out] == list(values.values())
        finally:
            await kv.close()


async def test_a_refused_piece_fails_the_put_and_nothing_is_visible(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = ChunkStore.append

    async def second_is_corrupt(self: ChunkStore, records: Any, payload: memoryview) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # fault injection: this piece arrived corrupted
            raise ChecksumMismatch("value arrived corrupted (CRC-32C mismatch)")
        return await real(self, records, payload)

    async with LocalCluster(tmp_path, 1) as cluster:
        kv = cluster.client(ClientConfig(max_rpc_bytes=MiB))
        try:
            values = {f"f{i}".encode(): os.urandom(512 * 1024) for i in range(8)}
            monkeypatch.setattr(ChunkStore, "append", second_is_corrupt)
            with pytest.raises(ChecksumMismatch):
                await kv.put_many(values)
            assert calls == 4  # every piece ended before the put failed: none left running
            assert await kv.get_many(list(values)) == [None] * len(values)
            monkeypatch.setattr(ChunkStore, "append", real)
            await kv.put_many(values)
            assert await kv.get_many(list(values)) == list(values.values())
        finally:
            await kv.close()
