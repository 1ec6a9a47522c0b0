"""Hostile inputs against a real cluster: what each costs a server and when it is closed.

``python -m kvfs.bench.hostile`` starts meta and one chunkserver as child
processes (``kvfs up``'s :class:`~kvfs.launcher.ProcessCluster`), stores one
1 MiB value, then runs each attack below against a real socket while a good
client keeps reading that value.  For each attack it reports whether the
server is still alive, the peak growth of the server's RSS (sampled from
``/proc/PID/status`` every 20 ms), how many of the attack's connections the
server closed within ``--wait`` seconds and when the last one was closed (for the
idle connections, counted from the last connect).

Every attack is bounded in connections, bytes and time.  The tests
(``tests/test_hostile.py``) run the same functions with short timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack

from kvfs._loop import run
from kvfs.address import parse_addr
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig, TlsConfig, add_options, from_options, tls_argv, tls_fields
from kvfs.handshake import check_server_proof, client_auth, endpoint, new_nonce
from kvfs.protocol import FIXED, MAGIC, PROTOCOL_VERSION, Flag, FrameDecoder, Limits, frame_bytes
from kvfs.rpc import Op

MiB = 1024 * 1024


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` now, from ``/proc/PID/status``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssSampler:
    """The peak RSS of a process while a ``with`` block runs (a sampling thread)."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.start = rss_bytes(pid)
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, RuntimeError):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.peak = max(self.peak, rss_bytes(self.pid))
        except (OSError, RuntimeError):
            pass

    @property
    def growth(self) -> int:
        return self.peak - self.start


@dataclass
class Outcome:
    attack: str
    target: str
    server_alive: bool
    rss_growth_mib: float
    closed: int  # of the attack's connections, closed by the server within the wait
    connections: int
    last_close_s: float | None  # seconds from the attack's start to the last close seen
    good_client_ok: bool
    note: str = ""


def _open(host: str, port: int) -> socket.socket:
    s = socket.create_connection((host, port), timeout=10)
    s.setblocking(False)
    return s


def _is_closed(s: socket.socket) -> bool:
    """True once the peer closed (EOF or reset); drains what it sent so far."""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


@contextmanager
def _sockets(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def _wait_closed(socks: list[socket.socket], t0: float, wait_s: float,
                 tick: Callable[[float], None] | None = None) -> tuple[int, float | None]:
    """Poll until every socket is closed by the peer or ``wait_s`` passed."""
    closed_at: dict[int, float] = {}
    deadline = t0 + wait_s
    while len(closed_at) < len(socks):
        now = time.monotonic()
        for i, s in enumerate(socks):
            if i not in closed_at and _is_closed(s):
                closed_at[i] = now - t0
        if now >= deadline or len(closed_at) == len(socks):
            break
        if tick is not None:
            tick(now)
        time.sleep(0.05)
    return len(closed_at), (max(closed_at.values()) if closed_at else None)


def authed_socket(host: str, port: int, token: str) -> socket.socket:
    """A raw socket past the handshake (for attacks that need a token)."""
    s = socket.create_connection((host, port), timeout=10)
    dec = FrameDecoder(Limits())

    def next_frame() -> Any:
        while True:
            ev = dec.next_event()
            if hasattr(ev, "op"):
                return ev
            data = s.recv(65536)
            if not data:
                raise ConnectionError("server closed during the handshake")
            dec.receive_data(data)

    hello = next_frame()
    auth = client_auth(token, hello.header, new_nonce(), endpoint(s.getsockname()),
                       endpoint(s.getpeername()))
    s.sendall(frame_bytes(Op.AUTH, 1, auth))
    reply = next_frame()
    if reply.is_error:
        raise ConnectionError(f"AUTH refused: {reply.header.get('message')}")
    check_server_proof(token, hello.header, auth, reply.header, f"{host}:{port}")
    assert dec.buffered_bytes == 0
    s.setblocking(False)
    return s


# -- the attacks (blocking; run in a thread while the good client reads) ---------------
def attack_header(host: str, port: int, payload_bytes: int, wait_s: float) -> tuple[int, int, float | None]:
    """One connection; a 28-byte fixed header announcing ``payload_bytes``, no token."""
    with _sockets([_open(host, port)]) as socks:
        t0 = time.monotonic()
        socks[0].send(FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.AUTH, 0, 1, 0, payload_bytes))
        closed, last = _wait_closed(socks, t0, wait_s)
        return closed, 1, last


def attack_idle(host: str, port: int, n: int, wait_s: float) -> tuple[int, int, float | None]:
    """``n`` connections that never send a byte."""
    socks: list[socket.socket] = []
    with _sockets(socks):
        for _ in range(n):
            try:
                socks.append(_open(host, port))
            except OSError:  # refused at accept (max_connections) counts as closed
                break
        refused = n - len(socks)
        t0 = time.monotonic()  # times from the last connect (opening 1,000 takes a while)
        closed, last = _wait_closed(socks, t0, wait_s)
        return closed + refused, n, last


def attack_slowloris(host: str, port: int, n: int, every_s: float,
                     wait_s: float) -> tuple[int, int, float | None]:
    """``n`` connections, each sending one byte of a valid AUTH frame every ``every_s``."""
    frame = frame_bytes(Op.AUTH, 1, {"version": PROTOCOL_VERSION, "mac": b"\0" * 32,
                                     "nonce": b"\0" * 32})
    socks = [_open(host, port) for _ in range(n)]
    sent = [0] * n
    next_at = [time.monotonic()]

    def tick(now: float) -> None:
        if now < next_at[0]:
            return
        next_at[0] = now + every_s
        for i, s in enumerate(socks):
            if sent[i] < len(frame) - 1:  # never the last byte
                try:
                    s.send(frame[sent[i]:sent[i] + 1])
                    sent[i] += 1
                except OSError:
                    pass

    with _sockets(socks):
        t0 = time.monotonic()
        closed, last = _wait_closed(socks, t0, wait_s, tick)
        return closed, n, last


def attack_never_read(host: str, port: int, token: str, readv: list[list[int]], max_requests: int,
                      send_s: float) -> tuple[int, int, float | None]:
    """One authenticated connection pipelining READVs and never reading a reply.

    Sends until ``max_requests`` were sent or the socket stayed full for ``send_s``;
    returns (requests sent, 1, None)."""
    s = authed_socket(host, port, token)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    with _sockets([s]):
        sent = 0
        rid = 2
        pending = b""
        deadline = time.monotonic() + send_s
        while sent < max_requests and time.monotonic() < deadline:
            if not pending:
                pending = frame_bytes(Op.READV, rid, {"ranges": readv})
                rid += 1
            try:
                n = s.send(pending)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            pending = pending[n:]
            if not pending:
                sent += 1
        time.sleep(1.0)  # let the server act on what it received
        return sent, 1, None


def attack_readv_repeat(host: str, port: int, token: str, rng: list[int], times: int,
                        wait_s: float) -> tuple[int, int, float | None, str]:
    """One READV naming the same range ``times`` times; reads the answer's header only."""
    s = authed_socket(host, port, token)
    with _sockets([s]):
        t0 = time.monotonic()
        s.sendall(frame_bytes(Op.READV, 2, {"ranges": [rng] * times}))
        s.setblocking(True)
        s.settimeout(wait_s)
        buf = b""
        try:
            while len(buf) < FIXED.size:
                chunk = s.recv(65536)
                if not chunk:
                    return 1, 1, time.monotonic() - t0, "closed without an answer"
                buf += chunk
            *_, flags, _, hlen, plen = FIXED.unpack_from(buf)
            while len(buf) < FIXED.size + hlen:
                buf += s.recv(65536)
        except TimeoutError:
            return 0, 1, None, "no answer"

        header = msgpack.unpackb(buf[FIXED.size:FIXED.size + hlen], raw=False)
        if flags & Flag.ERROR:
            return 0, 1, None, f"refused: {header.get('message')}"
        return 0, 1, None, f"answered with a {plen / MiB:.0f} MiB payload"


# -- the harness -----------------------------------------------------------------------
async def _good_reads(addr: str, token: str, key: str, stop: asyncio.Event,
                      config: ClientConfig | None = None) -> tuple[int, int]:
    """Reads ``key`` over and over with its own client; (ok, failed) counts."""
    ok = failed = 0
    async with AsyncClient(addr, token=token, config=config) as kv:
        while not stop.is_set():
            try:
                async with asyncio.timeout(10):
                    v = await kv.get(key)
                ok += v is not None and len(v) == MiB
                failed += v is None or len(v) != MiB
            except Exception:
                failed += 1
            await asyncio.sleep(0.05)
    return ok, failed


async def run_attacks(wait_s: float = 12.0, idle_n: int = 1000, loris_n: int = 50,
                      meta_args: tuple[str, ...] = (), cs_args: tuple[str, ...] = (),
                      only: set[str] | None = None, tls: TlsConfig | None = None,
                      ) -> list[Outcome]:
    """Each attack against a fresh cluster (freed memory is not returned to the OS, so
    a cluster that already served one attack would hide the cost of the next).

    ``tls``: the servers speak TLS (these files) and the good client too; the attacks
    stay raw TCP, so they hit the TLS handshake, and the two that need a token (which
    test the layer after TLS, unchanged by it) are left out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    names = ["512 MiB header, no token", "100 GiB header, no token", f"{idle_n} idle connections",
             f"slow-loris, {loris_n} conns, 1 B / 0.5 s", "never-reading client, READV 4 x 1 MiB",
             "READV naming one 1 MiB range 1,000 times"]
    if tls is not None:
        names = [n for n in names if "READV" not in n]
        meta_args, cs_args = (*meta_args, *tls_argv(tls)), (*cs_args, *tls_argv(tls))
    out: list[Outcome] = []
    for name in names:
        if only is None or any(w in name for w in only):
            out.append(await _one_attack(name, wait_s, idle_n, loris_n, meta_args, cs_args, tls))
    return out


async def _one_attack(name: str, wait_s: float, idle_n: int, loris_n: int,
                      meta_args: tuple[str, ...], cs_args: tuple[str, ...],
                      tls: TlsConfig | None = None) -> Outcome:
    from kvfs.launcher import ProcessCluster

    config = ClientConfig(**tls_fields(tls)) if tls is not None else None
    with tempfile.TemporaryDirectory(prefix="kvfs-hostile-") as tmp:
        cluster = ProcessCluster(Path(tmp), 1, listen="127.0.0.1:0", meta_args=meta_args,
                                 chunkserver_args=cs_args)
        await cluster.start()
        try:
            token = cluster.token
            rngs = []
            async with cluster.client(config=config) as kv:
                for i in range(4):
                    await kv.put(f"victim{i}", os.urandom(MiB))
                    lay = await kv.layout(f"victim{i}")
                    assert lay is not None
                    ext = lay.extents[0]
                    rngs.append([ext.replicas[0].chunk_id, ext.replicas[0].offset, ext.length])
            assert cluster.meta is not None
            meta = ("meta", cluster.meta.pid, parse_addr(cluster.addr))
            cs_proc = cluster.chunkservers[0]
            cs = ("chunkserver", cs_proc.pid, parse_addr(cs_proc.ready_line.split()[-1]))
            attacks: dict[str, tuple[tuple[str, int, tuple[str, int]], Callable[..., Any]]] = {
                "512 MiB header": (cs, lambda h, p: attack_header(h, p, 512 * MiB, wait_s)),
                "100 GiB header": (meta, lambda h, p: attack_header(h, p, 100 << 30, wait_s)),
                "idle connections": (cs, lambda h, p: attack_idle(h, p, idle_n, wait_s)),
                "slow-loris": (meta, lambda h, p: attack_slowloris(h, p, loris_n, 0.5, wait_s)),
                "never-reading": (cs, lambda h, p: attack_never_read(h, p, token, rngs, 100, 6.0)),
                "1,000 times": (cs, lambda h, p: attack_readv_repeat(h, p, token, rngs[0], 1000,
                                                                      wait_s)),
            }
            ((tname, pid, (host, port)), fn), = (v for k, v in attacks.items() if k in name)
            stop = asyncio.Event()
            good = asyncio.create_task(_good_reads(cluster.addr, token, "victim0", stop, config))
            await asyncio.sleep(0.2)
            with RssSampler(pid) as rss:
                res = await asyncio.to_thread(fn, host, port)
            stop.set()
            ok, failed = await good
            note = res[3] if len(res) > 3 else ""
            if name.startswith("never-reading"):
                note = f"{res[0]} requests sent"
                res = (0, 1, None)
            alive = True
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            return Outcome(name, tname, alive, round(rss.growth / MiB, 1), res[0], res[1],
                           None if res[2] is None else round(res[2], 2),
                           ok > 0 and failed == 0, note)
        finally:
            await cluster.stop()


def format_table(rows: list[Outcome]) -> str:
    lines = ["| attack | server | alive | RSS peak growth | closed by server | last closed after "
             "| good client | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        last = "-" if r.last_close_s is None else f"{r.last_close_s:.1f} s"
        lines.append(f"| {r.attack} | {r.target} | {'yes' if r.server_alive else 'NO'} "
                     f"| +{r.rss_growth_mib:.0f} MiB | {r.closed}/{r.connections} | {last} "
                     f"| {'reads ok' if r.good_client_ok else 'FAILED'} | {r.note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfs.bench.hostile", description=__doc__)
    p.add_argument("--wait", type=float, default=12.0, help="seconds to wait for the server to close")
    p.add_argument("--idle", type=int, default=1000, help="idle connections to open")
    p.add_argument("--loris", type=int, default=50, help="slow-loris connections")
    p.add_argument("--only", action="append", default=None, help="run attacks whose name has this")
    p.add_argument("--json", action="store_true")
    add_options(p, TlsConfig)  # --tls-*: TLS servers (and good client), attacks left raw
    ns = p.parse_args(argv)
    tls = from_options(TlsConfig, ns)
    rows = run(run_attacks(ns.wait, ns.idle, ns.loris, only=set(ns.only) if ns.only else None,
                           tls=tls if tls.tls_cert is not None else None))
    print(json.dumps([asdict(r) for r in rows], indent=1) if ns.json else format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
