"""Group commit of a client's puts (``WritePath.commit_packed``): COMMITs that come while
one of the client's is in flight wait for it and then go to meta as one, each put getting
its own per-key answer; a put alone is sent at once.  Through a real meta and chunkservers;
meta's COMMIT handler is wrapped to hold the first COMMIT and count what arrives."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import value_of
from poll import until
from test_writepath_columns import _written

from kvfs.client import AsyncClient
from kvfs.config import ClientConfig
from kvfs.errors import InvalidArgument
from kvfs.launcher import LocalCluster
from kvfs.packed import HEAD, join, pack, unpack
from kvfs.rpc import Commit, Op

GROUP = 4 * 1024 * 1024  # commit_group_bytes: group commit is off by default


@pytest.fixture
def client_config() -> ClientConfig:
    """conftest's ``kv`` with group commit on."""
    return ClientConfig(commit_group_bytes=GROUP)


def held_commits(c: LocalCluster) -> tuple[asyncio.Event, list[int]]:
    """Meta holds the first COMMIT it gets until the returned event is set; the list gets
    the number of keys of each COMMIT meta received, in arrival order."""
    assert c.meta is not None
    handlers = c.meta.rpc.handlers
    inner: Callable[..., Awaitable[Any]]
    inner, request_type = handlers[int(Op.COMMIT)]
    release = asyncio.Event()
    sizes: list[int] = []

    async def held(*args: Any) -> Any:
        req = next(a for a in args if isinstance(a, Commit))
        assert req.packed is not None
        sizes.append(HEAD.unpack_from(req.packed)[1])
        if len(sizes) == 1:
            await release.wait()
        return await inner(*args)

    handlers[int(Op.COMMIT)] = (held, request_type)
    return release, sizes


async def queued(kv: AsyncClient, *puts: Awaitable[list[bool]]) -> list[asyncio.Future[list[bool]]]:
    """Start each put once the one before has queued its COMMIT (one at a time: calls of
    one loop tick would be one put, batched)."""
    out = []
    for put in puts:
        out.append(asyncio.ensure_future(put))
        await until(lambda: len(kv.writer._commit_queue) >= len(out), f"{len(out)} COMMITs queued")
    return out


def items(prefix: str, n: int) -> list[tuple[str, bytes]]:
    return [(f"{prefix}{i}", value_of(f"{prefix}{i}")) for i in range(n)]


async def test_puts_in_flight_share_one_commit(cluster: LocalCluster, kv: AsyncClient) -> None:
    release, sizes = held_commits(cluster)
    first = asyncio.ensure_future(kv.put_many(items("a", 5)))
    await until(lambda: bool(sizes), "meta to get (and hold) the first COMMIT")
    later = await queued(kv, *(kv.put_many(items(p, n)) for p, n in (("b", 3), ("c", 4), ("d", 2))))
    assert sizes == [5]
    release.set()
    got = await asyncio.wait_for(asyncio.gather(first, *later), 30)
    assert got == [[True] * 5, [True] * 3, [True] * 4, [True] * 2]
    assert sizes == [5, 3 + 4 + 2]  # the three queued puts: one COMMIT
    assert kv.writer._committing is None and not kv.writer._commit_queue
    every = [k for p, n in (("a", 5), ("b", 3), ("c", 4), ("d", 2)) for k, _ in items(p, n)]
    async with cluster.client() as other:  # (no layout cached: meta's answers)
        assert await other.get_many(every) == [value_of(k) for k in every]
    # alone again: sent at once, nothing queued
    assert await kv.put_many(items("e", 2)) == [True, True]
    assert sizes == [5, 9, 2]


async def test_a_present_key_is_false_for_its_put_only(cluster: LocalCluster, kv: AsyncClient) -> None:
    await kv.put_many(items("old", 2))
    release, sizes = held_commits(cluster)
    first = asyncio.ensure_future(kv.put_many(items("x", 2), if_absent=True))
    await until(lambda: bool(sizes), "meta to get (and hold) the first COMMIT")
    a, b = await queued(kv, kv.put_many([("new0", b"A" * 4096), ("old1", b"A" * 4096),
                                         ("race", b"A" * 4096), ("new1", b"A" * 4096)], if_absent=True),
                        kv.put_many([("new2", b"B" * 4096), ("new3", b"B" * 4096)], if_absent=True))
    # both passed their EXISTS; another client commits "race" before their COMMIT goes
    async with cluster.client() as other:
        assert await other.put("race", b"O" * 4096) is True
    release.set()
    got = await asyncio.wait_for(asyncio.gather(first, a, b), 30)
    assert sizes == [2, 1, 3 + 2]  # (old1: found present by the EXISTS, not committed)
    assert got == [[True, True], [True, False, False, True], [True, True]]
    assert await kv.get_many(["old1", "race", "new0", "new1", "new2"]) == [
        value_of("old1"), b"O" * 4096, b"A" * 4096, b"A" * 4096, b"B" * 4096]


async def test_a_commit_meta_refuses_fails_the_put_it_came_from_only(cluster: LocalCluster,
                                                                    kv: AsyncClient) -> None:
    release, sizes = held_commits(cluster)
    first = asyncio.ensure_future(kv.put_many(items("f", 2)))
    await until(lambda: bool(sizes), "meta to get (and hold) the first COMMIT")
    # metadata over meta's max_key_meta_bytes (1 KiB; the client allows 64 KiB): meta refuses
    bad, good = await queued(kv, kv.put_many(items("bad", 2), meta=[None, {"s": "x" * 2000}]),
                             kv.put_many(items("good", 3)))
    release.set()
    assert await asyncio.wait_for(first, 30) == [True, True]
    with pytest.raises(InvalidArgument, match="max-key-meta"):
        await asyncio.wait_for(bad, 30)
    assert await asyncio.wait_for(good, 30) == [True] * 3
    assert sizes == [2, 2 + 3, 2, 3]  # the merged one refused, then each alone
    assert await kv.get_many(["good0", "good2", "bad0"]) == [value_of("good0"), value_of("good2"), None]


async def test_commits_of_other_options_and_cancelled_puts(cluster: LocalCluster) -> None:
    release, sizes = held_commits(cluster)
    # not batched: a cancelled call is cancelled where it waits (a batched one waits for its batch)
    async with cluster.client(ClientConfig(batch=False, commit_group_bytes=GROUP)) as kv:
        await _other_options_and_cancelled(kv, release, sizes)


async def _other_options_and_cancelled(kv: AsyncClient, release: asyncio.Event, sizes: list[int]) -> None:
    first = asyncio.ensure_future(kv.put_many(items("g", 1)))
    await until(lambda: bool(sizes), "meta to get (and hold) the first COMMIT")
    ttl, gone, plain = await queued(kv, kv.put_many(items("t", 2), ttl=60),
                                    kv.put_many(items("gone", 4)), kv.put_many(items("p", 3)))
    gone.cancel()
    release.set()
    got = await asyncio.wait_for(asyncio.gather(first, ttl, plain), 30)
    assert got == [[True], [True, True], [True] * 3]
    assert sizes == [1, 2, 3]  # other ttl: a COMMIT of its own; the cancelled put's keys not sent
    assert gone.cancelled()
    assert await kv.get_many(["t1", "p2", "gone0"]) == [value_of("t1"), value_of("p2"), None]


def test_join_is_pack_of_all() -> None:
    ws = [_written([4096 + i for i in range(n)], [1, 2], 1, {1: [(1 << 40, 64 * i) for i in range(n)]})
          for n in (3, 1, 5)]
    keys = [[b"w%d-%d" % (j, i) for i in range(len(w.sizes))] for j, w in enumerate(ws)]
    metas: list[list[bytes | None] | None] = [None, [b"\x81\xa1a\x01"], [None, b"\x80", None, None, b"\x80"]]
    blobs = [w.packed(k, m) for w, k, m in zip(ws, keys, metas, strict=True)]
    joined = join(blobs)
    every = [lay for w, m in zip(ws, metas, strict=True) for lay in w.layouts(0.0, None, m)]
    assert joined == pack([k for ks in keys for k in ks], every)
    assert [k for k, _ in unpack(joined, 1.0, None).staged] == [k for ks in keys for k in ks]
    assert join(blobs[:1]) is blobs[0]
