"""A dead chunkserver costs no write: clients remember it (``down_for_s``) and re-place
a put whose target dies on the live servers within the same call (issue 10)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.client import AsyncClient
from kvfs.cluster import ClusterLink
from kvfs.config import ClientConfig
from kvfs.errors import FrameTooLarge, KVFSError
from kvfs.launcher import LocalCluster, ProcessCluster


async def test_a_down_mark_outlives_a_refresh_and_ends(cluster: LocalCluster, kv: AsyncClient) -> None:
    host, port = parse_addr(kv.addr)
    for down_for_s in (3600.0, 0.0):
        link = ClusterLink([(host, port)], kv.token, down_for_s=down_for_s)
        try:
            sid = (await link.servers())[0].server_id
            link.mark_down(sid)
            assert not link.timed_out()  # (refused or lost: reads still ask it if only it can)
            link.mark_down(10_000)  # not a known server: nothing is kept for it
            entry = next(s for s in await link.servers(refresh=True) if s.server_id == sid)
            assert entry.alive  # meta still says so...
            assert link.alive()[sid] is (down_for_s == 0)  # ...and the mark holds until it ends
            assert not link.timed_out()
            assert entry.down is (down_for_s > 0)
            assert 10_000 not in link.alive() and len(link._down_until) <= 1
            if down_for_s:
                await link.call_server(sid, rpc.Ping())  # an answer ends the mark at once
                assert link.alive()[sid] and not link.timed_out()
        finally:
            link.close()


async def test_a_timed_out_mark_is_probed_until_it_ends(cluster: LocalCluster, kv: AsyncClient) -> None:
    """Confirm before condemn: a timeout gives an ordinary mark (the server not timed out:
    reads still ask it for a value only it holds) and starts a probe at once (one task per
    server); a PING answered ends the mark, a refused one leaves an ordinary mark; closing
    the link stops the probes.  (A probe that times out too: tests/test_lost.py,
    tests/test_sync_reads.py.)"""
    host, port = parse_addr(kv.addr)
    link = ClusterLink([(host, port)], kv.token, down_for_s=3600.0)
    try:
        sids = [s.server_id for s in await link.servers()]
        link.mark_down(sids[0], timed_out=True)
        link.mark_down(sids[0], timed_out=True)  # one probe per server
        assert list(link._probes) == [sids[0]] and not link.timed_out()
        assert not link.alive()[sids[0]]
        async with asyncio.timeout(30):  # answered: the mark ends (not after down_for_s)
            while not link.alive()[sids[0]]:
                await asyncio.sleep(0.01)
        assert link.rpc_counts["PING"] >= 1 and not link._probes and not link.timed_out()

        addr = await cluster.stop_chunkserver(0)  # refused from now on
        gone = next(s.server_id for s in await link.servers() if s.addr == addr)
        pings = link.rpc_counts["PING"]
        link.mark_down(gone, timed_out=True)
        async with asyncio.timeout(30):
            while link._probes:
                await asyncio.sleep(0.01)
        assert link.rpc_counts["PING"] > pings and not link.timed_out()
        assert not link.alive()[gone]  # the ordinary mark stays (down_for_s)

        live = next(sid for sid in sids if sid != gone)
        link.mark_down(live, timed_out=True)
        probe = link._probes[live]
    finally:
        await link.aclose()
    assert probe.done() and not link._probes


async def test_a_failed_call_marks_the_server_down(cluster: LocalCluster) -> None:
    async with cluster.client(ClientConfig(replicas=2, down_for_s=3600)) as kv:
        await kv.put(b"before", b"x" * 1000)
        addr0 = await cluster.stop_chunkserver(0)  # meta keeps calling it alive (heartbeat timeout 120 s)
        sid0 = next(s.server_id for s in await kv.servers() if s.addr == addr0)
        for i in range(20):  # each put would use server 0 with odds 2/3
            await kv.put(f"after{i}", os.urandom(1000))
        s0 = next(s for s in await kv.servers(refresh=True) if s.server_id == sid0)
        assert s0.down
        for i in range(20):
            lay = await kv.layout(f"after{i}")
            assert lay is not None
            assert sid0 not in {r.server_id for r in lay.extents[0].replicas}


@pytest.mark.subprocess
async def test_sigkill_during_put_many_stream_fails_no_put(tmp_path: Path) -> None:
    """3 chunkserver processes, replicas=2, one SIGKILLed while put_many calls stream in:
    no put fails and every value reads back right.  Meta keeps reporting the dead server
    alive throughout (a long heartbeat timeout), the case the client must handle alone."""
    cluster = ProcessCluster(tmp_path / "pc", 3, listen="127.0.0.1:0",
                             meta_args=("--heartbeat-timeout", "300s", "--dead-after", "600s"))
    await cluster.start()
    try:
        # a short down_for_s: the mark ends mid-stream, so the dead server is tried again
        # (and left out again) more than once
        cfg = ClientConfig(replicas=2, down_for_s=0.5, connect_timeout_s=5, request_timeout_s=30)
        async with cluster.client(config=cfg) as kv:
            written: dict[bytes, bytes] = {}
            failures: list[KVFSError] = []
            halfway = asyncio.Event()
            n_calls = 120

            async def writer() -> None:
                for call in range(n_calls):
                    batch = {f"c{call}-{j}".encode(): os.urandom(1024 * (1 + (call + j) % 32))
                             for j in range(8)}
                    try:
                        await kv.put_many(batch)
                        written.update(batch)
                    except KVFSError as exc:
                        failures.append(exc)
                    if call == 20:
                        halfway.set()

            task = asyncio.create_task(writer())
            await asyncio.wait([task, asyncio.create_task(halfway.wait())],
                               return_when=asyncio.FIRST_COMPLETED)  # a writer that died fails below
            assert halfway.is_set(), task.exception()
            victim = cluster.chunkservers[1]
            victim.kill(signal.SIGKILL)
            await task
            assert failures == []
            assert len(written) == 8 * n_calls
            victim_sid = next(s.server_id for s in await kv.servers(refresh=True)
                              if s.addr in victim.ready_line)
            assert next(s for s in await kv.servers() if s.server_id == victim_sid).alive  # meta's view
            # the stream did run into the dead server: puts after the kill avoided it
            layouts = await kv.lookup(list(written), use_cache=False)
            after = [lay for k, lay in zip(written, layouts, strict=True)
                     if lay is not None and int(k[1:].split(b"-")[0]) > 40]
            assert len(after) == 8 * (n_calls - 41) and all(victim_sid not in {r.server_id for e in lay.extents for r in e.replicas}
                                 and len({r.server_id for e in lay.extents for r in e.replicas}) == 2
                                 for lay in after)
            got = await kv.get_many(list(written))
            bad = [k for k, v in zip(written, got, strict=True) if v != written[k]]
            assert bad == []
        async with cluster.client(config=ClientConfig(replicas=2)) as fresh:  # no cache, no marks
            got = await fresh.get_many(list(written))
            assert [k for k, v in zip(written, got, strict=True) if v != written[k]] == []
    finally:
        await cluster.stop()


async def test_an_append_answered_with_too_few_locations_fails_that_server_alone(
        cluster: LocalCluster, kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunkserver whose APPEND answer has fewer locations than records (fault injection:
    the answer cut short) is left out of the put like one that cannot be reached: the values
    are placed again on the others and read back right; when every server answers so, the put
    fails with a kvfs error naming it (not an IndexError), and nothing is visible."""
    link = kv.writer._link
    real = link.call_server
    broken: set[int] = set()

    async def short(sid: int, request: Any, payload: Sequence[Any] = (), **kw: Any) -> Any:
        h, data = await real(sid, request, payload, **kw)
        if isinstance(request, rpc.Append) and (not broken or sid in broken):
            broken.add(sid)  # the first server asked, or every server
            return rpc.Appended(locations=h.locations[:-1]), data
        return h, data

    monkeypatch.setattr(link, "call_server", short)
    values = {f"short/{i}".encode(): os.urandom(2000 + i) for i in range(8)}
    await kv.put_many(values)
    (bad,) = broken
    for k in values:
        lay = await kv.layout(k)
        assert lay is not None and lay.extents[0].replicas[0].server_id != bad
    kv.layout_cache.clear()
    assert await kv.get_many(list(values)) == list(values.values())

    broken.update(s.server_id for s in await kv.servers())
    with pytest.raises(KVFSError, match="locations"):
        await kv.put_many({b"short/none": b"x" * 100})
    monkeypatch.undo()
    assert await kv.get_many([b"short/none"]) == [None]


async def test_a_delete_whose_tombstones_are_answered_with_too_few_locations_deletes_nothing(
        kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tombstone APPEND answered with fewer locations than keys (fault injection) is a kvfs
    error of that server, like one refused: no server took the tombstones, so the delete
    fails and the key stays (not a ValueError half-way through the answer)."""
    await kv.put_many({b"tomb/a": b"1" * 100, b"tomb/b": b"2" * 100})
    link = kv.writer._link
    real = link.call_server

    async def short(sid: int, request: Any, payload: Sequence[Any] = (), **kw: Any) -> Any:
        h, data = await real(sid, request, payload, **kw)
        if isinstance(request, rpc.Append):
            return rpc.Appended(locations=h.locations[:-1]), data
        return h, data

    monkeypatch.setattr(link, "call_server", short)
    with pytest.raises(KVFSError, match="locations"):
        await kv.delete_many([b"tomb/a", b"tomb/b"])
    monkeypatch.undo()
    kv.layout_cache.clear()
    assert await kv.get_many([b"tomb/a", b"tomb/b"]) == [b"1" * 100, b"2" * 100]
    assert await kv.delete_many([b"tomb/a", b"tomb/b"]) == 2


async def test_a_server_refusing_the_clients_append_as_too_large_fails_the_put_at_once(
        kv: AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunkserver's ``FrameTooLarge`` (this client's request against the server's limit,
    fault injection) reaches the caller as it is, after one APPEND: it is no fault of that
    server, so the values are not placed again on the others (which would refuse the same)."""
    link = kv.writer._link
    real = link.call_server
    asked: list[int] = []

    async def refuse(sid: int, request: Any, payload: Sequence[Any] = (), **kw: Any) -> Any:
        if isinstance(request, rpc.Append):
            asked.append(sid)
            raise FrameTooLarge("frame of 9 bytes over the limit of 8")
        return await real(sid, request, payload, **kw)

    monkeypatch.setattr(link, "call_server", refuse)
    with pytest.raises(FrameTooLarge, match="over the limit"):
        await kv.put_many({b"big/a": b"x" * 100})
    monkeypatch.undo()
    assert len(asked) == 1
    assert await kv.get_many([b"big/a"]) == [None]
