"""What meta answers about its keys: STATS, LIST, EXISTS and the default TTL, with expired
and deleted keys in the index. Found untested by the mutation pass (tests/MUTATION.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conftest import FakeClock, clocked_client

from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, MetaConfig
from kvfs.launcher import LocalCluster


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
