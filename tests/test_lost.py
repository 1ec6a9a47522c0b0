"""Failures are misses: a value no replica can serve (its server killed, its record
corrupt or gone) is a miss for that key alone, never wrong bytes; ``on_lost="raise"``
keeps the errors, naming the key."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from conftest import flip_byte, reports_checked

import kvfs
from kvfs import rpc
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig
from kvfs.errors import ChecksumMismatch, StaleLayout, Unavailable
from kvfs.launcher import LocalCluster, ProcessCluster
from kvfs.layout import Replica
from kvfs.stream import ValueReader, read_units

RAISE = ClientConfig(on_lost="raise")


def test_on_lost_is_checked() -> None:
    assert ClientConfig().on_lost == "miss"
    with pytest.raises(ValueError, match="on_lost must be one of miss, raise, got 'ignore'"):
        ClientConfig(on_lost="ignore")  # type: ignore[arg-type]


async def _replica_file(cluster: LocalCluster, kv: AsyncClient, key: bytes,
                        which: int = 0) -> tuple[int, Replica, Path]:
    """(chunkserver index, replica, chunk file) of replica ``which`` of ``key``'s first extent."""
    layout = await kv.layout(key)
    assert layout is not None
    rep = layout.extents[0].replicas[which]
    idx = next(i for i, c in enumerate(cluster.chunkservers) if c and c.server_id == rep.server_id)
    cs = cluster.chunkservers[idx]
    assert cs is not None
    return idx, rep, cs.store.chunk_path(rep.chunk_id)


@pytest.mark.subprocess
async def test_batch_with_a_killed_only_replica_misses_that_key_alone(
        proc_cluster: ProcessCluster) -> None:
    items = {f"k{i}".encode(): os.urandom(20_000 + i) for i in range(30)}
    async with proc_cluster.client() as kv, proc_cluster.client(config=RAISE) as strict:
        for k, v in items.items():  # separate puts: placement spreads them over the servers
            await kv.put(k, v, replicas=1)
        where = {k: (await kv.layout(k)).extents[0].replicas[0].server_id  # type: ignore[union-attr]
                 for k in items}
        victim_sid = where[b"k0"]
        lost = [k for k in items if where[k] == victim_sid]
        kept = [k for k in items if where[k] != victim_sid]
        assert kept, "every key landed on one server"
        victim_addr = next(s.addr for s in await kv.servers() if s.server_id == victim_sid)
        victim = next(p for p in proc_cluster.chunkservers if victim_addr in p.ready_line)
        victim.kill(signal.SIGKILL)
        await asyncio.wait_for(victim.proc.wait(), 30)

        keys = list(items)
        got = await kv.get_many(keys)
        assert got == [None if k in lost else items[k] for k in keys]
        assert await kv.get(b"k0") is None
        bufs = [bytearray(len(items[k])) for k in keys]
        sizes = await kv.get_into(keys, bufs)
        assert sizes == [kvfs.MISS if k in lost else len(items[k]) for k in keys]
        assert [bytes(b) for b, k in zip(bufs, keys, strict=True) if k in kept] == [items[k] for k in kept]

        with pytest.raises(Unavailable, match="k0"):
            await strict.get_many(keys)
        assert await strict.get_many(kept) == [items[k] for k in kept]
        sizes = await strict.get_into(keys, [bytearray(len(items[k])) for k in keys])
        assert sizes == [kvfs.FAILED if k in lost else len(items[k]) for k in keys]

    def blocking() -> list[bytes | None]:
        with kvfs.Client(proc_cluster.addr, token=proc_cluster.token) as c:
            return c.get_many(keys)

    assert await asyncio.to_thread(blocking) == [None if k in lost else items[k] for k in keys]


async def test_corrupt_record_is_a_miss_never_wrong_bytes(cluster: LocalCluster,
                                                          kv: AsyncClient) -> None:
    items = {b"victim": os.urandom(10_000), b"n1": os.urandom(3000), b"n2": os.urandom(5000)}
    await kv.put_many(items)
    _, rep, path = await _replica_file(cluster, kv, b"victim")
    flip_byte(path, rep.offset + 1234)
    keys = list(items)
    async with cluster.client(RAISE) as strict:
        with pytest.raises(ChecksumMismatch, match="victim"):
            await strict.get_ranges([(b"victim", 0, 10)])  # reported lost: meta drops it
        assert await strict.lookup([b"victim", b"n1"], use_cache=False) == [None, await kv.layout(b"n1")]
    assert await kv.get_ranges([(b"victim", 0, 10), (b"n1", 5, 9)]) == [None, items[b"n1"][5:9]]
    assert await kv.get_many(keys) == [None, items[b"n1"], items[b"n2"]]
    assert await kv.get(b"victim") is None
    bufs = [bytearray(10_000), bytearray(3000), bytearray(5000)]
    assert await kv.get_into(keys, bufs) == [kvfs.MISS, 3000, 5000]
    assert [bytes(b) for b in bufs[1:]] == [items[b"n1"], items[b"n2"]]


async def test_a_corrupt_large_value_received_into_its_bytes_is_a_miss(cluster: LocalCluster,
                                                                       kv: AsyncClient) -> None:
    """A value get_many receives straight into the bytes it returns (300 KB): corrupt, it is
    None, never the bytes received; its neighbours are read."""
    items = {b"big/victim": os.urandom(300_000), b"big/n1": os.urandom(300_000),
             b"big/n2": os.urandom(3000)}
    await kv.put_many(items)
    _, rep, path = await _replica_file(cluster, kv, b"big/victim")
    flip_byte(path, rep.offset + 200_000)
    assert await kv.get_many(list(items)) == [None, items[b"big/n1"], items[b"big/n2"]]
    assert await kv.layout(b"big/victim") is None  # reported lost: meta forgot it


async def test_a_corrupt_small_value_beside_a_large_one_is_a_miss(cluster: LocalCluster,
                                                                  kv: AsyncClient) -> None:
    """One 100 KB value and 32 small ones in one READV: every value goes straight into the
    bytes get_many returns (the small ones received in place by the async client, copied
    from a pooled receive by the blocking one's own sockets); a corrupt small one is None,
    its neighbours right, through either client."""
    items = {b"mix/big": os.urandom(100_000)} | {b"mix/%02d" % i: os.urandom(4096) for i in range(32)}
    await kv.put_many(items)
    keys = list(items)
    for victim, read in ((b"mix/03", "async"), (b"mix/17", "blocking")):
        _, rep, path = await _replica_file(cluster, kv, victim)
        flip_byte(path, rep.offset + 100)
        if read == "async":
            got = await kv.get_many(keys)
        else:
            def blocking() -> list[bytes | None]:
                with kvfs.Client(cluster.addr, token=cluster.token) as c:
                    return c.get_many(keys)

            got = await asyncio.to_thread(blocking)
        gone = {b"mix/03", victim}
        assert got == [None if k in gone else items[k] for k in keys], read


async def test_mount_reads_of_a_lost_value_follow_on_lost(cluster: LocalCluster,
                                                          kv: AsyncClient) -> None:
    """``read_units`` (the FUSE mount's reads): a unit no replica can serve is a miss (None)
    or, with ``on_lost="raise"``, its error; its neighbours in the batch are read."""
    items = {b"m/victim": os.urandom(10_000), b"m/n1": os.urandom(3000)}
    await kv.put_many(items)
    _, rep, path = await _replica_file(cluster, kv, b"m/victim")
    flip_byte(path, rep.offset + 99)
    wants: list[tuple[ValueReader | bytes, int]] = [(b"m/victim", 0), (b"m/n1", 0), (b"m/none", 0)]
    async with cluster.client(RAISE) as strict:
        with pytest.raises(ChecksumMismatch, match="victim"):
            await read_units(strict, wants)
    got = await read_units(kv, wants)
    assert got[0] is None and got[2] is None
    assert got[1] is not None and got[1][1:] == (0, items[b"m/n1"])
    assert await kv.layout(b"m/victim") is None  # reported lost: meta forgot it


async def test_one_corrupt_replica_of_two_reads_the_other(cluster: LocalCluster,
                                                          kv: AsyncClient) -> None:
    value = os.urandom(10_000)
    await kv.put(b"twice", value, replicas=2)
    _, rep, path = await _replica_file(cluster, kv, b"twice", 0)
    flip_byte(path, rep.offset + 10)
    async with cluster.client() as reader:  # its close waits until its report is answered
        assert await reader.get(b"twice") == value
    await reports_checked(cluster)  # the get reported the bad copy: meta mended it first
    kv.layout_cache.clear()
    for which in (0, 1):  # now both copies meta names are damaged
        _, rep, path = await _replica_file(cluster, kv, b"twice", which)
        flip_byte(path, rep.offset + 11)
    assert await kv.get_many([b"twice"]) == [None]


async def test_missing_record_is_a_miss(cluster: LocalCluster, kv: AsyncClient) -> None:
    await kv.put_many({b"gone": b"x" * 5000, b"other": b"y" * 5000})
    idx, rep, path = await _replica_file(cluster, kv, b"gone")
    other = await kv.layout(b"other")
    assert other is not None
    await cluster.stop_chunkserver(idx)
    os.truncate(path, rep.offset)  # the committed bytes are lost (and any after them)
    await cluster.start_chunkserver(idx)
    kv.layout_cache.clear()
    async with cluster.client(RAISE) as strict:
        with pytest.raises(StaleLayout, match="gone"):
            await strict.get(b"gone")
    got = await kv.get_many([b"gone", b"other"])
    assert got[0] is None and got[1] in (None, b"y" * 5000)  # "other" may follow it in the chunk


# telling meta (REPORT_LOST) ------------------------------------------------------------
async def test_a_lost_key_is_dropped_from_meta(cluster: LocalCluster, kv: AsyncClient) -> None:
    await kv.put_many({b"bad": os.urandom(8000), b"good": os.urandom(8000)})
    _, rep, path = await _replica_file(cluster, kv, b"bad")
    flip_byte(path, rep.offset + 77)
    assert await kv.exists_many([b"bad", b"good"]) == [True, True]
    assert await kv.get_many([b"bad", b"good"]) == [None, await kv.get(b"good")]
    assert await kv.exists_many([b"bad", b"good"]) == [False, True]  # meta dropped it
    assert await kv.layout(b"bad") is None
    assert (await kv.stats())["gc"]["metrics"]["keys_lost"] == 1  # and counted it


async def test_an_unreachable_key_is_not_dropped(cluster: LocalCluster, kv: AsyncClient) -> None:
    await kv.put(b"away", os.urandom(8000))
    idx, _, _ = await _replica_file(cluster, kv, b"away")
    await cluster.stop_chunkserver(idx)
    assert await kv.get(b"away") is None  # a miss now...
    assert await kv.layout(b"away") is not None  # ...but kept: the server may come back
    await cluster.start_chunkserver(idx)
    assert (await kv.get(b"away")) is not None


async def test_a_lost_report_never_drops_an_overwrite(cluster: LocalCluster, kv: AsyncClient) -> None:
    """The reader read the old layout (corrupt); a writer overwrote the key meanwhile: the
    report names the old layout, so meta keeps the new value."""
    await kv.put(b"race", b"o" * 8000)
    old = await kv.layout(b"race")
    assert old is not None
    _, rep, path = await _replica_file(cluster, kv, b"race")
    flip_byte(path, rep.offset + 5)
    async with cluster.client() as writer:
        await writer.put(b"race", b"n" * 8000)
    assert kv.layout_cache.get_many([b"race"], kv.clock())[0] == [old]  # kv still holds the old one
    assert await kv.get(b"race") is None  # it read the old, corrupt bytes: a miss, not wrong bytes
    assert await kv.get(b"race") == b"n" * 8000  # the overwrite was kept; the stale layout forgotten
    # the RPC itself: a compare-and-swap on the layout
    meta = kv._link  # the client token may call it
    assert (await meta.call_meta(rpc.ReportLost(items=[rpc.LostItem(b"race", old)]))).dropped == 0
    new = await kv.layout(b"race")
    assert new is not None
    assert (await meta.call_meta(rpc.ReportLost(items=[rpc.LostItem(b"race", new)]))).dropped == 1
    assert await kv.layout(b"race") is None


# hedged reads ------------------------------------------------------------------------------
@pytest.mark.subprocess
async def test_a_hung_replica_is_hedged(proc_cluster: ProcessCluster) -> None:
    """A chunkserver stopped (SIGSTOP: connections open, nothing answered): reads of values
    with a second replica complete from it after hedge_after_s, right bytes, and the
    counter says the hedge happened."""
    items = {f"h{i}".encode(): os.urandom(30_000 + i) for i in range(12)}
    cfg = ClientConfig(hedge_after_s=0.3)
    async with proc_cluster.client(config=cfg) as kv:
        await kv.put_many(items, replicas=2)
        first = (await kv.layout(b"h0")).extents[0].replicas[0].server_id  # type: ignore[union-attr]
        assert await kv.get_many(list(items)) == list(items.values())  # connections open
        assert kv.reader.hedged == 0
        addr = next(s.addr for s in await kv.servers() if s.server_id == first)
        victim = next(p for p in proc_cluster.chunkservers if addr in p.ready_line)
        victim.kill(signal.SIGSTOP)
        try:
            kv.layout_cache.clear()
            assert await kv.get_many(list(items)) == list(items.values())
            assert kv.reader.hedged >= 1
            bufs = [bytearray(len(v)) for v in items.values()]
            assert await kv.get_into(list(items), bufs) == [len(v) for v in items.values()]
            assert [bytes(b) for b in bufs] == list(items.values())
        finally:
            victim.kill(signal.SIGCONT)


@pytest.mark.subprocess
async def test_a_value_only_a_timed_out_server_holds_is_a_miss_at_once(
        proc_cluster: ProcessCluster) -> None:
    """A chunkserver stopped (SIGSTOP): the first read of a value only it holds times out
    (a miss) and marks it down as timed out; later reads do not ask it while the mark
    holds (no READV, no second timeout: a miss at once), the other servers' values are
    read; after SIGCONT and the mark's end it is read again."""
    items = {f"t{i}".encode(): os.urandom(4096) for i in range(24)}
    cfg = ClientConfig(put_group_bytes=8192, request_timeout_s=1.0, down_for_s=5.0)
    async with proc_cluster.client(config=cfg) as kv:
        counts = kv.rpc_counts
        async with _stopped_after_one_timeout(proc_cluster, kv, items) as (victim_sid, mine, others):
            sent = counts["READV"]
            assert await kv.get_many(list(items)) == [None if k in mine else v
                                                      for k, v in items.items()]
            assert counts["READV"] - sent == len(others), "the stopped server was asked again"
            assert kv._link.timed_out() == {victim_sid}
        await _read_again(kv, mine, [items[k] for k in mine])


@pytest.mark.subprocess
async def test_a_timed_out_server_is_not_asked_again_until_it_answers_a_probe(
        proc_cluster: ProcessCluster) -> None:
    """A chunkserver stopped (SIGSTOP), ``down_for_s`` far shorter than the request timeout:
    after the first read's timeout, reads from several tasks across many ``down_for_s``
    periods (until two probes of it have timed out) send it no READV and are misses; the
    mark does not lapse with time.  After SIGCONT a probe is answered and its values are
    read again."""
    items = {f"p{i}".encode(): os.urandom(4096) for i in range(24)}
    cfg = ClientConfig(put_group_bytes=8192, request_timeout_s=3.0, down_for_s=0.2,
                       connect_timeout_s=1.0)
    async with proc_cluster.client(config=cfg) as kv:
        counts = kv.rpc_counts
        async with _stopped_after_one_timeout(proc_cluster, kv, items) as (victim_sid, mine, _):
            sent, pings = counts["READV"], counts["PING"]
            async with asyncio.timeout(60):
                while counts["PING"] - pings < 2:  # two probes timed out meanwhile
                    got = await asyncio.gather(*(kv.get_many(mine) for _ in range(4)))
                    assert got == [[None] * len(mine)] * 4
                    assert counts["READV"] == sent, "the stopped server was asked again"
                    await asyncio.sleep(0.02)
            assert kv._link.timed_out() == {victim_sid}
        await _read_again(kv, mine, [items[k] for k in mine])  # once a probe is answered
        assert not kv._link.timed_out()


@asynccontextmanager
async def _stopped_after_one_timeout(pc: ProcessCluster, kv: AsyncClient, items: dict[bytes, bytes],
                                     ) -> AsyncIterator[tuple[int, list[bytes], set[int]]]:
    """``items`` put (one replica) and read (connections open), then the server holding the
    first key's bytes stopped (SIGSTOP) and the keys it holds read once: one READV, timed
    out (the server marked down as timed out), misses.  Yields that server, its keys, the
    other servers holding any; SIGCONT on the way out."""
    await kv.put_many(items)
    where = {k: (await kv.layout(k)).extents[0].replicas[0].server_id  # type: ignore[union-attr]
             for k in items}
    victim_sid = where[next(iter(items))]
    others = set(where.values()) - {victim_sid}
    assert others, "every key landed on one server"
    assert await kv.get_many(list(items)) == list(items.values())
    addr = next(s.addr for s in await kv.servers() if s.server_id == victim_sid)
    victim = next(p for p in pc.chunkservers if addr in p.ready_line)
    mine = [k for k in items if where[k] == victim_sid]
    victim.kill(signal.SIGSTOP)
    try:
        sent = kv.rpc_counts["READV"]
        assert await kv.get_many(mine) == [None] * len(mine)
        assert kv.rpc_counts["READV"] - sent == 1
        async with asyncio.timeout(60):  # its probe timed out too: confirmed timed out
            while kv._link.timed_out() != {victim_sid}:
                await asyncio.sleep(0.02)
        yield victim_sid, mine, others
    finally:
        victim.kill(signal.SIGCONT)


async def _read_again(kv: AsyncClient, keys: list[bytes], want: list[bytes]) -> None:
    """Polls (30 s at most) until ``keys`` read as ``want``: a server marked down after a
    timeout is read again once it answers a probe."""
    async with asyncio.timeout(30):
        while await kv.get_many(keys) != want:
            await asyncio.sleep(0.05)


def test_hedge_after_is_checked() -> None:
    assert ClientConfig().hedge_after_s == 2.0 and ClientConfig(hedge_after_s=None).hedge_after_s is None
    with pytest.raises(ValueError, match="hedge_after_s must be positive"):
        ClientConfig(hedge_after_s=0)
