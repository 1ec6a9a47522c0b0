"""The blocking client's get_many/get_into made in the caller's thread (kvfs.blocking's
ServerSockets, ReadPath.fetch_now), and every way such a read goes back to the IO loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ThreadCluster, flip_byte

import kvfs
from kvfs.address import parse_addr
from kvfs.blocking import SCRATCH_BYTES, BlockingSocket, _timeval
from kvfs.chunkserver import ChunkServer
from kvfs.cluster import ClusterLink
from kvfs.config import ClientConfig, OnLost
from kvfs.errors import ChecksumMismatch, Timeout
from kvfs.launcher import ProcessCluster, ServiceProcess
from kvfs.protocol import Flag, ReceivePool, frame_bytes
from kvfs.rpc import Op
from kvfs.transport import Connection

# every two 4 KiB values of a put_many go to the next server: a call's keys span them all
SPREAD = ClientConfig(put_group_bytes=8192)


@contextmanager
def _io_loop_held(kv: kvfs.Client) -> Iterator[None]:
    """The client's IO loop blocked: a call that hops to it waits (and fails the test's
    deadline) instead of answering."""
    gate, done = threading.Event(), threading.Event()
    waited: list[bool] = []

    def hold() -> None:
        waited.append(gate.wait(30))
        done.set()

    kv._loop.call_soon_threadsafe(hold)
    try:
        yield
    finally:
        gate.set()
    assert done.wait(30) and waited == [True], "a call waited for the IO loop"


def test_get_many_and_get_into_are_made_in_the_callers_thread(tcluster: ThreadCluster) -> None:
    """With the IO loop held, get_many and get_into still answer: the LOOKUP on a meta
    socket, one READV per chunkserver on the client's own sockets, every byte checked;
    misses, empty values and too-small buffers as the async client says them."""
    vals = {f"here/{i}".encode(): os.urandom(4096) for i in range(60)}
    vals[b"here/empty"] = b""
    vals[b"here/odd"] = os.urandom(1000)
    with kvfs.Client(tcluster.addr, token=tcluster.token, config=SPREAD) as kv:
        kv.put_many(vals)
        servers = {kv.layout(k).extents[0].replicas[0].server_id  # type: ignore[union-attr]
                   for k in vals if vals[k]}
        assert len(servers) > 1, "every value landed on one server"
        keys = [*vals, b"here/none"]
        counts = kv.aio.rpc_counts
        kv.aio.layout_cache.clear()  # the first call looks them up
        before = dict(counts)
        with _io_loop_held(kv):
            assert kv.get_many(keys) == [*vals.values(), None]
            assert counts["LOOKUP"] - before.get("LOOKUP", 0) == 1
            assert counts["READV"] - before.get("READV", 0) == len(servers)
            bufs = [bytearray(len(v)) for v in vals.values()] + [bytearray(10)]
            assert kv.get_into(keys, bufs) == [*map(len, vals.values()), kvfs.MISS]
            assert [bytes(b) for b in bufs[:-1]] == list(vals.values())
            roomy = [bytearray(5000), bytearray(500), bytearray(0)]
            assert kv.get_into([b"here/0", b"here/odd", b"here/1"], roomy) == [4096, kvfs.TOO_SMALL,
                                                                              kvfs.TOO_SMALL]
            assert bytes(roomy[0][:4096]) == vals[b"here/0"] and roomy[1] == bytearray(500)
            assert kv.get_many([b"here/none"]) == [None] and kv.get_many([]) == []
            assert kv.get_into([], []) == []
        # the rest from the cache, but for the key never found (a miss is not cached)
        assert counts["LOOKUP"] - before.get("LOOKUP", 0) == 3
        assert all(len(p._idle) == 1 for p in kv._server_sockets._pools.values())


def test_reads_from_many_threads_get_their_own_values(tcluster: ThreadCluster) -> None:
    """Threads reading at once, each its own and shared keys, get_many and get_into into
    buffers of their own: every value is the one put."""
    vals = {f"mt/{i}".encode(): os.urandom(4096 + i) for i in range(200)}
    with kvfs.Client(tcluster.addr, token=tcluster.token, config=SPREAD) as kv:
        kv.put_many(vals)
        keys = list(vals)

        def worker(t: int) -> None:
            rnd = random.Random(t)
            for n in range(40):
                some = rnd.sample(keys, 64)
                if n % 2:
                    assert kv.get_many(some) == [vals[k] for k in some]
                else:
                    bufs = [bytearray(len(vals[k])) for k in some]
                    assert kv.get_into(some, bufs) == [len(vals[k]) for k in some]
                    assert [bytes(b) for b in bufs] == [vals[k] for k in some]

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            for f in [pool.submit(worker, t) for t in range(6)]:
                f.result(120)
        assert all(len(p._idle) <= p.most for p in kv._server_sockets._pools.values())


def test_a_corrupt_record_read_in_the_callers_thread_is_a_miss(tmp_path: Path) -> None:
    """A record whose bytes fail their CRC: the read goes again through the IO loop, which
    makes the key a miss (or raises, ``on_lost="raise"``) and reports it lost; its
    neighbours in the same READV are read right."""
    with ThreadCluster(tmp_path) as three_cs:
        _corrupt_record_is_a_miss(three_cs)


def _corrupt_record_is_a_miss(three_cs: ThreadCluster) -> None:
    vals = {f"bad/{i}".encode(): os.urandom(4096) for i in range(8)}
    with kvfs.Client(three_cs.addr, token=three_cs.token) as kv:
        kv.put_many(vals)
        lay = kv.layout(b"bad/3")
        assert lay is not None
        rep = lay.extents[0].replicas[0]
        cs = three_cs.cluster.chunkservers[three_cs.cluster.index_of(rep.server_id)]
        assert cs is not None
        keys = list(vals)
        assert kv.get_many(keys) == list(vals.values())  # layouts cached, sockets open
        flip_byte(cs.store.chunk_path(rep.chunk_id), rep.offset + 100)
        with (kvfs.Client(three_cs.addr, token=three_cs.token,
                          config=ClientConfig(on_lost=OnLost.RAISE)) as strict,
              pytest.raises(ChecksumMismatch, match="bad/3")):
            strict.get_many(keys)
        bufs = [bytearray(4096) for _ in keys]
        got = kv.get_into(keys, bufs)
        assert got == [kvfs.MISS if k == b"bad/3" else 4096 for k in keys]
        assert [bytes(b) for k, b in zip(keys, bufs, strict=True) if k != b"bad/3"] == \
            [v for k, v in vals.items() if k != b"bad/3"]
        assert kv.get_many(keys) == [None if k == b"bad/3" else v for k, v in vals.items()]


def test_a_dead_chunkserver_is_read_from_its_replica_or_missed(tmp_path: Path) -> None:
    """A chunkserver stopped after its sockets were opened: the caller-thread read fails,
    and the IO loop's read takes the other replica (``replicas=2``) or makes the key a
    miss (one replica); the other keys are read right."""
    with ThreadCluster(tmp_path) as three_cs:
        _dead_server_is_read_from_replica(three_cs)


def _dead_server_is_read_from_replica(three_cs: ThreadCluster) -> None:
    cluster = three_cs.cluster
    two = {f"two/{i}".encode(): os.urandom(4096) for i in range(6)}
    one = {f"one/{i}".encode(): os.urandom(4096) for i in range(6)}
    with kvfs.Client(three_cs.addr, token=three_cs.token, config=SPREAD) as kv:
        kv.put_many(two, replicas=2)
        kv.put_many(one, replicas=1)
        everything = {**two, **one}
        keys = list(everything)
        assert kv.get_many(keys) == list(everything.values())  # every server's sockets open
        victim = kv.layout(b"one/0").extents[0].replicas[0].server_id  # type: ignore[union-attr]
        three_cs.call(cluster.stop_chunkserver(cluster.index_of(victim)))
        gone = {k for k in one
                if kv.layout(k).extents[0].replicas[0].server_id == victim}  # type: ignore[union-attr]
        want = [None if k in gone else v for k, v in everything.items()]
        assert kv.get_many(keys) == want
        bufs = [bytearray(4096) for _ in keys]
        assert kv.get_into(keys, bufs) == [kvfs.MISS if k in gone else 4096 for k in keys]
        assert [bytes(b) for k, b in zip(keys, bufs, strict=True) if k not in gone] == \
            [v for k, v in everything.items() if k not in gone]
        assert kv.get_many(keys) == want  # again, the server marked down


def _read_again(kv: kvfs.Client, keys: list[bytes], want: list[bytes]) -> None:
    """Polls (30 s at most) until ``keys`` read as ``want``: a server marked down after a
    timeout is read again once it answers a probe (or, held by a test, its mark ends)."""
    deadline = time.monotonic() + 30
    while kv.get_many(keys) != want:
        assert time.monotonic() < deadline, "the server was never read again"
        time.sleep(0.05)


@contextmanager
def _one_value(c: ThreadCluster, key: bytes, *, down_for_s: float,
               ) -> Iterator[tuple[kvfs.Client, ChunkServer]]:
    """A blocking client of ``c``'s one chunkserver (``request_timeout_s=0.5``) that has put
    ``key`` (4 KiB of ``v``) and read it back once in its own thread (its socket there
    open), and that chunkserver."""
    cs = c.cluster.chunkservers[0]
    assert cs is not None
    with kvfs.Client(c.addr, token=c.token,
                     config=ClientConfig(request_timeout_s=0.5, down_for_s=down_for_s)) as kv:
        kv.put(key, b"v" * 4096)
        assert kv.get_many([key]) == [b"v" * 4096]
        yield kv, cs


def test_a_read_held_past_the_request_timeout_is_a_miss(one_cs: ThreadCluster) -> None:
    """A READV on the caller's socket held at the chunkserver past ``request_timeout_s``:
    that socket is closed (its late answer never taken for another call's), the server is
    marked down (a timeout: its probe starts), and the read made again through the IO loop
    does not ask it: a miss.  Once the server answers again and its mark ends, so do reads."""
    with _one_value(one_cs, b"slow/k", down_for_s=0.5) as (kv, cs):
        (pool,) = kv._server_sockets._pools.values()
        (sock,) = pool._idle
        held = one_cs.hold(cs.rpc)
        try:
            sent = kv.aio.rpc_counts["READV"]
            assert kv.get_many([b"slow/k"]) == [None]
            assert kv.aio.rpc_counts["READV"] - sent == 1  # not sent again through the IO loop
            assert sock.sock.fileno() == -1 and sock not in pool._idle
        finally:
            one_cs.loop.call_soon_threadsafe(held.release)
        _read_again(kv, [b"slow/k"], [b"v" * 4096])


def test_a_hung_chunkserver_is_read_from_its_replica(tmp_path: Path) -> None:
    """With ``replicas=2``, a value whose first replica's server hangs is read from the
    other replica by the IO loop's read, which does not ask the hung server again."""
    with ThreadCluster(tmp_path, chunkservers=2) as two_cs, \
            kvfs.Client(two_cs.addr, token=two_cs.token,
                        config=ClientConfig(request_timeout_s=1.0)) as kv:
        value = os.urandom(4096)
        kv.put(b"rep/k", value, replicas=2)
        assert kv.get_many([b"rep/k"]) == [value]
        first = kv.layout(b"rep/k").extents[0].replicas[0].server_id  # type: ignore[union-attr]
        cs = two_cs.cluster.chunkservers[two_cs.cluster.index_of(first)]
        assert cs is not None
        held = two_cs.hold(cs.rpc)
        try:
            sent = kv.aio.rpc_counts["READV"]
            buf = bytearray(4096)
            assert kv.get_into([b"rep/k"], [buf]) == [4096] and bytes(buf) == value
            assert kv.aio.rpc_counts["READV"] - sent == 2  # the hung server once, the replica once
        finally:
            two_cs.loop.call_soon_threadsafe(held.release)


def _first_server(kv: kvfs.Client, key: bytes, which: int = 0) -> int:
    lay = kv.layout(key)
    assert lay is not None
    return lay.extents[0].replicas[which].server_id


def _process_of(kv: kvfs.Client, pc: ProcessCluster, sid: int) -> ServiceProcess:
    addr = next(s.addr for s in kv._run(kv.aio.servers()) if s.server_id == sid)
    return next(p for p in pc.chunkservers if addr in p.ready_line)


@pytest.mark.subprocess
async def test_a_stopped_chunkserver_times_out_once_then_misses_at_once(
        proc_cluster: ProcessCluster) -> None:
    """A chunkserver process stopped (SIGSTOP: it holds its connections and accepts, it
    never answers): the first blocking read of its values times out once in the caller's
    thread, which marks it down as the IO loop's reads do; later reads do not ask it while
    the mark holds (no READV: its values are misses at once, the other servers' values
    are read).  After SIGCONT, once the mark ends, its values are read again."""
    vals = {f"stop1/{i}".encode(): os.urandom(4096) for i in range(24)}
    cfg = ClientConfig(put_group_bytes=8192, request_timeout_s=1.0, down_for_s=5.0)

    def run() -> None:
        with kvfs.Client(proc_cluster.addr, token=proc_cluster.token, config=cfg) as kv:
            kv.put_many(vals)
            assert kv.get_many(list(vals)) == list(vals.values())  # layouts cached, sockets open
            victim = _first_server(kv, b"stop1/0")
            mine = [k for k in vals if _first_server(kv, k) == victim]
            others = {_first_server(kv, k) for k in vals} - {victim}
            assert others, "every value landed on one server"
            counts = kv.aio.rpc_counts
            with _stopped_after_one_timeout(kv, _process_of(kv, proc_cluster, victim), mine, victim):
                sent = counts["READV"]
                assert kv.get_many(mine) == [None] * len(mine)
                assert counts["READV"] - sent == 0, "the stopped server was asked again"
                sent = counts["READV"]
                assert kv.get_many(list(vals)) == [None if k in mine else v for k, v in vals.items()]
                assert counts["READV"] - sent == len(others)
                _no_socket_opens_once(proc_cluster, cfg, victim, mine)
            _read_again(kv, mine, [vals[k] for k in mine])

    await asyncio.to_thread(run)


@pytest.mark.subprocess
async def test_a_stopped_chunkserver_is_not_asked_again_until_it_answers_a_probe(
        proc_cluster: ProcessCluster) -> None:
    """A chunkserver stopped (SIGSTOP), ``down_for_s`` far shorter than the request timeout:
    the first blocking read times out in the caller's thread and marks it down as timed
    out; reads from several threads across many ``down_for_s`` periods (until two probes
    of it have timed out) send it no READV, in the callers' threads or through the IO
    loop, and are misses.  After SIGCONT a probe is answered and its values are read
    again."""
    vals = {f"probe/{i}".encode(): os.urandom(4096) for i in range(24)}
    cfg = ClientConfig(put_group_bytes=8192, request_timeout_s=3.0, down_for_s=0.2,
                       connect_timeout_s=1.0)

    def run() -> None:
        with kvfs.Client(proc_cluster.addr, token=proc_cluster.token, config=cfg) as kv, \
                concurrent.futures.ThreadPoolExecutor(4) as pool:
            kv.put_many(vals)
            assert kv.get_many(list(vals)) == list(vals.values())  # layouts cached, sockets open
            victim = _first_server(kv, b"probe/0")
            mine = [k for k in vals if _first_server(kv, k) == victim]
            counts = kv.aio.rpc_counts
            with _stopped_after_one_timeout(kv, _process_of(kv, proc_cluster, victim), mine, victim):
                sent, pings = counts["READV"], counts["PING"]
                deadline = time.monotonic() + 60
                while counts["PING"] - pings < 2:  # two probes timed out meanwhile
                    assert time.monotonic() < deadline, "the stopped server was never probed"
                    got = list(pool.map(lambda _: kv.get_many(mine), range(4)))
                    assert got == [[None] * len(mine)] * 4
                    assert counts["READV"] == sent, "the stopped server was asked again"
                    time.sleep(0.02)
                assert kv._run(_timed_out(kv.aio.link)) == {victim}
            _read_again(kv, mine, [vals[k] for k in mine])
            assert not kv._run(_timed_out(kv.aio.link))

    await asyncio.to_thread(run)


@contextmanager
def _stopped_after_one_timeout(kv: kvfs.Client, proc: ServiceProcess,
                               mine: list[bytes], victim: int) -> Iterator[None]:
    """``proc`` (server ``victim``) stopped (SIGSTOP) and ``mine`` (values only it holds)
    read once: one READV, in the caller's thread, timed out, misses; then polled until the
    probe that timeout started timed out too (the server confirmed timed out); SIGCONT on
    the way out."""
    counts = kv.aio.rpc_counts
    proc.kill(signal.SIGSTOP)
    try:
        sent = counts["READV"]
        assert kv.get_into(mine, [bytearray(4096) for _ in mine]) == [kvfs.MISS] * len(mine)
        assert counts["READV"] - sent == 1  # the caller's, timed out; not sent again
        _until_timed_out(kv, kv.aio.link, victim)
        yield
    finally:
        proc.kill(signal.SIGCONT)


def _no_socket_opens_once(pc: ProcessCluster, cfg: ClientConfig, victim: int,
                          mine: list[bytes]) -> None:
    """A client that has no socket to the stopped server yet: the caller's thread opens one
    (no handshake within ``connect_timeout_s``), which marks the server down as timed out,
    so the IO loop's read does not wait for a handshake again: a miss, no connection
    opened there."""
    cfg = replace(cfg, connect_timeout_s=1.0)
    with kvfs.Client(pc.addr, token=pc.token, config=cfg) as fresh:
        link = fresh.aio.link
        port = parse_addr(next(s.addr for s in fresh._run(fresh.aio.servers())
                               if s.server_id == victim))[1]
        opened: list[int] = []
        open_ = link._open

        async def spy(host: str, port: int, server_name: str | None = None) -> Connection:
            opened.append(port)
            return await open_(host, port, server_name)

        assert fresh.get_many(mine) == [None] * len(mine)
        _until_timed_out(fresh, link, victim)  # its probe timed out too
        link._open = spy  # type: ignore[method-assign]
        assert fresh.get_many(mine) == [None] * len(mine)
        assert port not in opened, "the IO loop waited for the stopped server's handshake again"
        assert fresh._run(_timed_out(link)) == {victim}


async def _timed_out(link: ClusterLink) -> set[int]:
    return link.timed_out()  # (on the IO loop: the link's state is its own)


def _until_timed_out(kv: kvfs.Client, link: ClusterLink, victim: int) -> None:
    """Polls (60 s at most) until ``victim`` is confirmed timed out on ``link``: the probe
    its first timeout started timed out too."""
    deadline = time.monotonic() + 60
    while kv._run(_timed_out(link)) != {victim}:
        assert time.monotonic() < deadline, "the stopped server was never confirmed timed out"
        time.sleep(0.02)


def test_a_server_that_times_out_once_but_answers_its_probe_is_not_condemned(
        one_cs: ThreadCluster) -> None:
    """Confirm before condemn: a READV held at the chunkserver past ``request_timeout_s``
    (its PING still answered) marks it down, but only as a refused connection would: the
    probe that timeout starts at once is answered, the mark ends, and a read of a value
    only it holds, once the READV is released, is a hit (not a miss until a later probe)."""
    with _one_value(one_cs, b"once/k", down_for_s=3600.0) as (kv, cs):
        (sid,) = kv._server_sockets._pools
        link = kv.aio.link
        held = one_cs.hold(cs.rpc)
        try:
            pings = kv.aio.rpc_counts["PING"]
            assert kv.get_many([b"once/k"]) == [None]  # timed out in the caller's thread
            deadline = time.monotonic() + 60
            while not kv._run(_alive(link))[sid]:
                assert time.monotonic() < deadline, "the mark never ended"
                time.sleep(0.02)
            assert kv.aio.rpc_counts["PING"] > pings and not kv._run(_timed_out(link))
        finally:
            one_cs.loop.call_soon_threadsafe(held.release)
        assert kv.get_many([b"once/k"]) == [b"v" * 4096]
        assert not kv._run(_timed_out(link))


async def _alive(link: ClusterLink) -> dict[int, bool]:
    return link.alive()


@pytest.mark.subprocess
@pytest.mark.parametrize("hedge_after_s", [None, 0.3])
async def test_a_stopped_first_replica_costs_one_wait_then_none(
        proc_cluster: ProcessCluster, hedge_after_s: float | None) -> None:
    """``replicas=2``, the first replica's server stopped: the first blocking read waits for
    it once (``request_timeout_s``, or ``hedge_after_s``) and reads the other replica; later
    reads go to the other replica at once, in the caller's thread (the IO loop held), and
    never ask the stopped server."""
    vals = {f"stop2/{i}".encode(): os.urandom(4096) for i in range(24)}
    cfg = ClientConfig(put_group_bytes=8192, hedge_after_s=hedge_after_s, down_for_s=30.0,
                       request_timeout_s=1.0 if hedge_after_s is None else 30.0)

    def run() -> None:
        with kvfs.Client(proc_cluster.addr, token=proc_cluster.token, config=cfg) as kv:
            kv.put_many(vals, replicas=2)
            assert kv.get_many(list(vals)) == list(vals.values())  # layouts cached, sockets open
            victim = _first_server(kv, b"stop2/0")
            mine = [k for k in vals if _first_server(kv, k) == victim]
            second = {_first_server(kv, k, 1) for k in mine}
            want = [vals[k] for k in mine]
            proc = _process_of(kv, proc_cluster, victim)
            counts = kv.aio.rpc_counts
            proc.kill(signal.SIGSTOP)
            try:
                sent = counts["READV"]
                assert kv.get_many(mine) == want
                assert counts["READV"] - sent == 1 + len(second)  # the stopped one, once
                sent = counts["READV"]
                assert kv.get_many(mine) == want
                assert counts["READV"] - sent == len(second), "the stopped server was asked again"
                bufs = [bytearray(4096) for _ in mine]
                with _io_loop_held(kv):
                    assert kv.get_into(mine, bufs) == [4096] * len(mine)
                assert [bytes(b) for b in bufs] == want
            finally:
                proc.kill(signal.SIGCONT)

    await asyncio.to_thread(run)


def test_server_sockets_zero_reads_through_the_io_loop(one_cs: ThreadCluster) -> None:
    with kvfs.Client(one_cs.addr, token=one_cs.token, config=ClientConfig(server_sockets=0)) as kv:
        kv.put(b"k", b"v")
        assert kv.get_many([b"k"]) == [b"v"]
        assert not kv._server_sockets._pools  # none opened
    with pytest.raises(ValueError, match="server_sockets must be >= 0"):
        ClientConfig(server_sockets=-1)


def test_a_blocking_socket_keeps_its_scratch_buffer_small() -> None:
    """An answer with a large header grows the socket's scratch buffer: the memory goes
    once the answer is taken; an answer whose large payload went to the allocator's buffer
    leaves the decoder (and its scratch buffer) as it is, for the next call."""
    a, b = socket.socketpair()
    with a, b:
        pool = ReceivePool(1 << 20, min_bytes=0)
        s = BlockingSocket(a, "peer", 30.0, allocator=pool)
        deadline = time.monotonic() + 30
        b.sendall(frame_bytes(Op.PING, 1, {"pad": "x" * 100_000}, flags=Flag.RESPONSE))
        assert s._receive(1, deadline).header["pad"] == "x" * 100_000
        assert s._decoder.scratch_size == SCRATCH_BYTES
        dec = s._decoder
        b.sendall(frame_bytes(Op.READV, 2, {}, [b"v" * 200_000], flags=Flag.RESPONSE))
        frame = s._receive(2, deadline)
        assert bytes(frame.payload) == b"v" * 200_000  # type: ignore[arg-type]
        assert s._decoder is dec and pool.reused == 0


def test_a_plain_blocking_socket_waits_in_the_kernel_and_still_times_out() -> None:
    """After the handshake a plain socket is in blocking mode (no poll before each receive
    and send: one syscall each), its waits bounded by SO_RCVTIMEO/SO_SNDTIMEO: an answer
    that never comes still ends in ``Timeout`` at the deadline, and a wait of under a
    microsecond is never asked of the kernel as 0 (which would mean: wait for ever)."""
    a, b = socket.socketpair()
    with a, b:
        s = BlockingSocket(a, "peer", 0.3)
        s._wait_in_kernel()
        assert a.gettimeout() is None
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16) == _timeval(0.3)
        t0 = time.monotonic()
        with pytest.raises(Timeout, match=r"PING to peer got no answer within 0\.3s"):
            s.answer(Op.PING, 1, t0 + 0.3)
        b.sendall(frame_bytes(Op.PING, 2, {"n": 2}, flags=Flag.RESPONSE))
        assert s._receive(2, time.monotonic() + 5).header == {"n": 2}
    assert _timeval(1e-9) == _timeval(0) != b"\0" * len(_timeval(0))
    assert _timeval(2.5) == _timeval(2.5000001)


class _CountingSocket(socket.socket):
    """A socket that notes the flags of every receive, and tells when the first is done."""

    def __init__(self, fileno: int) -> None:
        super().__init__(fileno=fileno)
        self.flags: list[int] = []
        self.first = threading.Event()

    def recv_into(self, buffer: memoryview, nbytes: int = 0, flags: int = 0) -> int:  # type: ignore[override]
        n = super().recv_into(buffer, nbytes, flags)
        self.flags.append(flags)
        self.first.set()
        return n


def test_a_large_payload_arriving_in_pieces_is_received_with_one_wait() -> None:
    """A READV answer's payload over 64 KiB goes to its own buffer; once its header is in,
    the rest of the payload is one receive that waits for all of it (MSG_WAITALL), not one
    receive (each letting the GIL go and back) per piece as it arrives."""
    a, b = socket.socketpair()
    sock = _CountingSocket(a.detach())
    with sock, b:
        s = BlockingSocket(sock, "peer", 30.0, allocator=ReceivePool(1 << 20, min_bytes=0))
        s._wait_in_kernel()
        value = bytes(range(256)) * 800  # 204,800 bytes
        frame = frame_bytes(Op.READV, 1, {}, [value], flags=Flag.RESPONSE)
        head = len(frame) - len(value) + 1000

        def send() -> None:
            b.sendall(frame[:head])
            assert sock.first.wait(30)  # the first receive took the header: the rest in pieces
            for at in range(head, len(frame), 50_000):
                b.sendall(frame[at : at + 50_000])

        sender = threading.Thread(target=send)
        sender.start()
        try:
            got = s._receive(1, time.monotonic() + 30)
        finally:
            sender.join(30)
        assert bytes(got.payload) == value  # type: ignore[arg-type]
        assert sock.flags == [0, socket.MSG_WAITALL]
