"""Connections to a cluster: meta, the chunkservers, and the live server list.

Meta may be several processes serving one store (Redis-backed: any of them answers
any call).  A link takes a list of meta addresses (``kvfs://H1:P1,H2:P2``; a DNS name
resolving to several addresses counts as each of them, the certificate checked
against the name): a client spreads its calls over them in turn (``spread_meta``),
a chunkserver or the GC sticks to one until it fails.  A meta that cannot be reached
(refused, connect timeout, connection lost) is marked down for ``down_for_s`` and the
call goes to the next; a meta that answers, even with an error, is not skipped, and
an RPC that timed out on a live connection is not sent again elsewhere.

One :class:`ClusterLink` per user of the cluster: the client (:mod:`kvfs.client`),
the GC driver (:mod:`kvfs.gc.driver`) and a chunkserver's registration and
heartbeats (only its meta connection).  Connections are opened on first use,
one persistent multiplexed connection per peer, and re-opened after a peer
restarts; the server list is re-read from meta every ``servers_refresh_s``.
A chunkserver a call could not reach (connection refused or lost, timeout) is
marked down here for ``down_for_s``: placement and reads skip it at once instead
of waiting for meta to notice, and a refresh from meta does not undo the mark
(a call to it that succeeds does; see :meth:`ClusterLink.mark_down`).  Reads still
ask a server marked down for a value it alone holds (a refused connection fails
fast; a restarted server answers), except one *confirmed hung*
(:meth:`ClusterLink.timed_out`): asking it again would cost the timeout again, so
its values are misses while that mark holds.  Confirm before condemn: a call that
times out gives an ordinary mark and starts a probe at once (one ``PING`` on a fresh
connection, within ``connect_timeout_s``; one probe task per server).  An answer ends
the mark (one transient stall costs one probe's round trip), a refused or lost probe
leaves the ordinary mark, and only a probe that times out too makes the server timed
out; that mark does not end with time: the probe goes on every ``down_for_s`` and only
an answer ends it, so no read waits for a server still hung.
:mod:`kvfs.transport` is the one connection underneath; this module is the only
place that pools them (:mod:`kvfs.blocking` keeps the blocking client's few plain
sockets to meta, for calls made in its callers' threads).

A link belongs to one event loop at a time (:meth:`ClusterLink.bind_loop`): it binds
to the first loop that uses it, moves to another once nothing is open, and refuses
at once (instead of hanging until a timeout) while connections of another live loop
are open.  In a child after ``fork()`` the parent's connections are dropped, never
touched, and it reconnects.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import socket
import ssl
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from kvfs import rpc
from kvfs.address import format_addrs, parse_addr
from kvfs.errors import InvalidArgument, KVFSError, LocalProtocolError, Timeout, Unavailable
from kvfs.protocol import Buffer, Scatter
from kvfs.rpc import OP_OF, R, Request
from kvfs.transport import Connection, Sink


@dataclass(slots=True)
class ServerEntry:
    """A chunkserver as meta last reported it (``alive``), and whether this link saw a
    call to it fail within ``down_for_s`` (``down``: placement and reads skip it)."""

    server_id: int
    addr: str
    capacity: int
    free: int
    alive: bool
    down: bool = False

    @property
    def usable(self) -> bool:
        return self.alive and not self.down


Endpoint = tuple[str, int, str | None]  # host or address, port, the name TLS checks
K = TypeVar("K")


async def _reopen(conns: dict[K, Connection], locks: dict[K, asyncio.Lock], key: K,
                  open_: Callable[[], Awaitable[Connection]]) -> Connection:
    """``conns[key]``, opened (``open_()``) if it is missing or closed: one opening per key
    at a time, the calls waiting on it take the connection it opened.  (Callers check for
    an open one first, without this call: that is their every call's path.)"""
    async with locks[key]:
        conn = conns.get(key)
        if conn is None or conn.is_closed:
            conn = conns[key] = await open_()
    return conn


class ClusterLink:
    """Meta at ``metas`` (one or several (host, port)) and, through it, the chunkservers."""

    def __init__(self, metas: Sequence[tuple[str, int]], token: str, *, connect_timeout_s: float = 5.0,
                 request_timeout_s: float = 60.0, servers_refresh_s: float = 2.0,
                 down_for_s: float = 5.0, tls: ssl.SSLContext | None = None,
                 spread_meta: bool = True) -> None:
        """``tls``: every connection speaks TLS with this context
        (:func:`kvfs.tls.client_context`); None: plaintext.  ``down_for_s``: how long a
        server (or meta) a call could not reach stays marked down (:meth:`mark_down`).
        ``spread_meta``: each meta call goes to the next meta in turn; False: to the one
        that answered last (failing over to the next)."""
        if not metas:
            raise InvalidArgument("no meta address")
        self.metas = list(metas)
        self.meta_addr = format_addrs(self.metas)
        self.spread_meta = spread_meta
        self._endpoints: list[Endpoint] = []  # resolved on first use
        self._turn = 0  # the next meta (spread), or the one in use (sticky)
        self._meta_down_until: dict[Endpoint, float] = {}
        self.meta_calls: dict[str, int] = defaultdict(int)  # answered meta calls, by meta address
        self.token = token
        self.tls = tls
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.servers_refresh_s = servers_refresh_s
        self.down_for_s = down_for_s
        self._down_until: dict[int, float] = {}  # server id -> monotonic end of its mark; known ids only
        self._timed_out: set[int] = set()  # servers confirmed hung: a call and its probe timed out
        self._suspect: set[int] = set()  # servers a call timed out on, their first probe pending
        self._probes: dict[int, asyncio.Task[None]] = {}  # timed-out server id -> its probe (on _loop)
        self.rpc_counts: dict[str, int] = defaultdict(int)  # calls sent, by op name
        self.on_rebind: list[Callable[[], None]] = []  # users' per-loop state to make anew
        self._pid = os.getpid()
        self._orphans: list[object] = []  # a parent's connections, kept (never closed) after fork()
        self._reset(None)
        self._servers: dict[int, ServerEntry] = {}
        self._servers_at = -1e18
        self.cluster_id: str | None = None  # meta's, as of the last server list
        # the smallest request header a server this link opened takes (their AUTH answers;
        # 0: none known): the client's batch calls are cut under it (AsyncClient.parts)
        self.max_header = 0

    def _reset(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Fresh per-loop state: connections and locks belong to one event loop."""
        self._loop = loop
        self._metas: dict[Endpoint, Connection] = {}
        self._meta_locks: dict[Endpoint, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._conns: dict[int, Connection] = {}
        self._conn_locks: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)

    def bind_loop(self) -> None:
        """Follow the running loop (see the module's doc); on a move, ``on_rebind``
        callbacks remake their users' per-loop state (batchers, tasks)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        pid = os.getpid()
        if pid != self._pid:
            self._orphans.append((self._metas, self._conns))
            self._pid = pid
            self._probes = {}  # the parent's loop's tasks: never touched here
        elif self._loop is not None and (
                any(not c.is_closed for c in self._metas.values())
                or any(not c.is_closed for c in self._conns.values())) and not self._loop.is_closed():
            raise LocalProtocolError(
                f"this AsyncClient has connections open on another event loop ({self._loop!r}) "
                f"and was called from {loop!r}; close() it first, make one client per loop, "
                "or use the blocking kvfs.Client (thread-safe, submit_* futures)")
        self._stop_probes()  # (tasks of the old loop: cancelled there)
        self._reset(loop)
        for fn in self.on_rebind:
            fn()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this link is bound to (None: not yet)."""
        return self._loop

    def call_soon_threadsafe(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the loop this link is bound to, from any thread (none bound, or
        closed: not run)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # closed meanwhile
                pass

    def connections(self) -> list[Connection]:
        """The open connections, meta's first (a debug hook: e.g. tests checking TLS)."""
        conns = [*self._metas.values(), *self._conns.values()]
        return [c for c in conns if not c.is_closed]

    @property
    def meta_open(self) -> bool:
        return any(not c.is_closed for c in self._metas.values())

    def close(self) -> None:
        """Close every connection and stop the probes (the link's loop's own; from another
        thread, :meth:`aclose` on that loop)."""
        for c in [*self._metas.values(), *self._conns.values()]:
            c.close()
        self._metas.clear()
        self._conns.clear()
        self._stop_probes()

    async def aclose(self) -> None:
        """Close every connection and wait, within ``connect_timeout_s``, until each has closed
        and each probe has stopped: a TLS connection's shutdown takes loop turns, and a loop
        stopped and closed before them still holds their sockets (uvloop's close then fails
        with EBUSY)."""
        conns = [*self._metas.values(), *self._conns.values()]
        probes = list(self._probes.values())
        self.close()
        waits = [asyncio.ensure_future(c.wait_closed()) for c in conns] + probes
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self.connect_timeout_s)
            for w in pending:
                w.cancel()

    async def _open(self, host: str, port: int, server_name: str | None = None) -> Connection:
        conn = await Connection.open(host, port, self.token, connect_timeout_s=self.connect_timeout_s,
                                     request_timeout_s=self.request_timeout_s, tls=self.tls,
                                     server_name=server_name)
        self.heard(conn.max_header)
        return conn

    def heard(self, max_header: int) -> None:
        """A server said (AUTH) it takes request headers of at most ``max_header`` bytes (0:
        any); also from the blocking client's own sockets' threads (:mod:`kvfs.blocking`: a
        race keeps one of the values, and all a cluster's servers usually say the same)."""
        if max_header and (not self.max_header or max_header < self.max_header):
            self.max_header = max_header

    # meta ----------------------------------------------------------------------------
    async def _resolve(self) -> list[Endpoint]:
        """Each meta address; a name resolving to several addresses as each of them (a
        name that does not resolve stays as it is: connecting then says why)."""
        loop = asyncio.get_running_loop()
        out: list[Endpoint] = []
        for host, port in self.metas:
            try:
                ipaddress.ip_address(host)
                out.append((host, port, None))
                continue
            except ValueError:
                pass
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                infos = []
            addrs = list(dict.fromkeys(str(i[4][0]) for i in infos))
            out += [(a, port, host) for a in addrs] if len(addrs) > 1 else [(host, port, None)]
        return list(dict.fromkeys(out))

    async def _meta_order(self) -> list[Endpoint]:
        """The metas to try for one call (:meth:`_order`), resolved first if not yet."""
        if not self._endpoints:
            self._endpoints = await self._resolve()
        return self._order()

    def _order(self) -> list[Endpoint]:
        """:meth:`_meta_order` once resolved: from this call's turn on, the metas not marked
        down first (the marked ones last, in case they are back)."""
        eps = self._endpoints
        if len(eps) == 1:  # one meta: tried whether marked down or not, as below
            return eps
        start = self._turn % len(eps)
        if self.spread_meta:
            self._turn += 1
        ring = eps[start:] + eps[:start]
        now = time.monotonic()
        up = [e for e in ring if self._meta_down_until.get(e, 0.0) <= now]
        return up + [e for e in ring if e not in up]

    async def _meta_conn_to(self, ep: Endpoint) -> Connection:
        conn = self._metas.get(ep)
        if conn is not None and not conn.is_closed:
            return conn
        return await _reopen(self._metas, self._meta_locks, ep, lambda: self._open(*ep))

    def metas_up(self) -> list[Endpoint]:
        """The metas (resolved by the first meta call; none before it) not marked down, in
        order.  Safe to read from other threads (the blocking client's meta sockets,
        :mod:`kvfs.blocking`): it only reads."""
        now = time.monotonic()
        down = self._meta_down_until
        return [e for e in self._endpoints if down.get(e, 0.0) <= now]

    def _meta_failed(self, ep: Endpoint) -> None:
        self._meta_down_until[ep] = time.monotonic() + self.down_for_s
        if not self.spread_meta and self._endpoints and self._endpoints[self._turn % len(self._endpoints)] == ep:
            self._turn += 1  # sticky: the next meta becomes the one in use

    def _meta_ok(self, ep: Endpoint) -> None:
        self._meta_down_until.pop(ep, None)
        if not self.spread_meta:
            self._turn = self._endpoints.index(ep)

    def _all_failed(self, tried: list[Endpoint], last: Unavailable) -> Unavailable:
        if len(tried) == 1:
            return last
        return Unavailable(f"no meta service reachable at {self.meta_addr} (tried {len(tried)}): {last}")

    async def meta_conn(self) -> Connection:
        """A connection to a meta that can be reached (the next in turn)."""
        self.bind_loop()
        order = await self._meta_order()
        last: Unavailable | None = None
        for ep in order:
            try:
                conn = await self._meta_conn_to(ep)
            except Unavailable as exc:
                last = exc
                self._meta_failed(ep)
                continue
            self._meta_ok(ep)
            return conn
        assert last is not None
        raise self._all_failed(order, last)

    async def call_meta(self, request: Request[R]) -> R:
        """One RPC to a meta (the next in turn); one that cannot be reached is marked
        down and the call goes to the next.  A connection found closed (that meta
        restarted) is re-opened once first."""
        self.bind_loop()
        self.rpc_counts[OP_OF[type(request)].name] += 1
        # (resolved and connected, the usual case: no coroutine made for either)
        order = self._order() if self._endpoints else await self._meta_order()
        last: Unavailable | None = None
        for ep in order:
            for _ in (0, 1):
                conn = self._metas.get(ep)
                reused = conn is not None and not conn.is_closed
                if not reused:
                    try:
                        conn = await self._meta_conn_to(ep)
                    except Unavailable as exc:
                        last = exc
                        break
                assert conn is not None
                try:
                    answer = await conn.call(request)
                except Unavailable as exc:
                    if not conn.is_closed:
                        raise  # it answered (or a live connection timed out): not sent again
                    last = exc
                    if not reused:
                        break
                    continue  # an older connection, found closed: that meta may have restarted
                self._meta_ok(ep)
                self.meta_calls[conn.name] += 1
                return answer
            self._meta_failed(ep)
        assert last is not None
        raise self._all_failed(order, last)

    # the server list --------------------------------------------------------------------
    async def servers(self, *, refresh: bool = False) -> list[ServerEntry]:
        """The chunkservers meta knows, re-read every ``servers_refresh_s`` (or now)."""
        now = time.monotonic()
        if refresh or now - self._servers_at > self.servers_refresh_s:
            h = await self.call_meta(rpc.Servers())
            self.cluster_id = h.cluster_id
            fresh = {s.server_id: ServerEntry(s.server_id, s.addr, s.capacity, s.free, s.alive)
                     for s in h.servers}
            for sid, conn in list(self._conns.items()):
                if sid not in fresh or fresh[sid].addr != self._servers.get(sid, fresh[sid]).addr:
                    conn.close()
                    del self._conns[sid]
            for sid in list(self._down_until):  # a forgotten or moved server: its mark goes too
                if sid not in fresh or fresh[sid].addr != self._servers.get(sid, fresh[sid]).addr:
                    del self._down_until[sid]
                    self._timed_out.discard(sid)
            for sid in [sid for sid in self._probes
                        if sid not in fresh or fresh[sid].addr != self._servers.get(sid, fresh[sid]).addr]:
                self._suspect.discard(sid)
                self._probes.pop(sid).cancel()  # its server forgotten or moved: not probed
            self._servers, self._servers_at = fresh, now
        self._expire_marks(now)
        return list(self._servers.values())

    def alive(self) -> dict[int, bool]:
        """Whether each known server is usable: alive as meta last said and not marked
        down here (no RPC)."""
        self._expire_marks(time.monotonic())
        return {s.server_id: s.usable for s in self._servers.values()}

    def server_addrs(self) -> dict[int, str | None]:
        """Each known server's address when it is usable now (as :meth:`alive` says), None
        when not (no RPC).  Safe from other threads (the blocking client's reads in its
        callers' threads, :mod:`kvfs.blocking`): it only reads."""
        now = time.monotonic()
        down = self._down_until
        return {sid: s.addr if s.alive and down.get(sid, 0.0) <= now else None
                for sid, s in self._servers.items()}

    def timed_out(self) -> set[int]:
        """The servers confirmed hung: a call to them timed out and so did the probe that
        followed (:meth:`_probe`), the mark holding until a probe is answered: reads do not ask them
        (:meth:`kvfs.readpath.ReadPath.fetch`), not even for a value one of them alone
        holds.  Safe from other threads: it only reads."""
        now = time.monotonic()
        down = self._down_until
        return {sid for sid in self._timed_out.copy() if down.get(sid, 0.0) > now}

    def mark_down(self, sid: int, *, timed_out: bool = False) -> None:
        """Skip server ``sid`` for ``down_for_s``: a call to it could not reach it.  The
        mark outlives refreshes from meta (which may still call it alive) and ends early
        when a call to it succeeds or meta moves or forgets it.  One mark per known server.
        ``timed_out`` (it got no answer in time): the mark is an ordinary one still, and a
        probe starts at once (:meth:`_probe`) to confirm the server hung before its values
        become misses (:meth:`timed_out`).  A confirmed mark does not end with
        ``down_for_s`` while its probe runs: only an answer ends it.  The link's loop's
        own: other threads call :meth:`mark_down_soon`."""
        entry = self._servers.get(sid)
        if entry is None:
            return
        if timed_out and sid not in self._timed_out and sid not in self._probes and self._start_probe(sid):
            self._suspect.add(sid)
        held = sid in self._timed_out and sid in self._probes
        self._down_until[sid] = math.inf if held else time.monotonic() + self.down_for_s
        entry.down = True

    def mark_down_soon(self, sid: int, *, timed_out: bool = False) -> None:
        """:meth:`mark_down` from any thread (the blocking client's callers': its sockets'
        failures), made on the link's loop before anything queued there after this call."""
        self.call_soon_threadsafe(partial(self.mark_down, sid, timed_out=timed_out))

    def _expire_marks(self, now: float) -> None:
        for sid, entry in self._servers.items():
            until = self._down_until.get(sid)
            if until is not None and now >= until:
                del self._down_until[sid]
                self._timed_out.discard(sid)
            entry.down = sid in self._down_until

    def _mark_up(self, sid: int) -> None:
        self._timed_out.discard(sid)
        self._suspect.discard(sid)
        if self._down_until.pop(sid, None) is not None and sid in self._servers:
            self._servers[sid].down = False

    # probes of timed-out servers -------------------------------------------------------
    def _start_probe(self, sid: int) -> bool:
        """Whether server ``sid`` is probed (:meth:`_probe`): its probe already runs, or is
        started now, on the link's loop (none when the link has no loop, or ``down_for_s``
        is 0: a timeout then gives an ordinary mark only)."""
        if sid in self._probes:
            return True
        loop = self._loop  # (mark_down runs on it)
        if loop is None or loop.is_closed() or self.down_for_s <= 0:
            return False
        self._probes[sid] = loop.create_task(self._probe(sid), name=f"kvfs probe of chunkserver {sid}")
        return True

    def _stop_probes(self) -> None:
        """Cancel every probe (on its own loop); the marks they held end ``down_for_s`` from
        now, as any other mark."""
        probes, self._probes = self._probes, {}
        self._suspect = set()
        until = time.monotonic() + self.down_for_s
        for sid, task in probes.items():
            if self._down_until.get(sid) == math.inf:
                self._down_until[sid] = until
            loop = task.get_loop()
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # closed meanwhile
                    pass

    async def _probe(self, sid: int) -> None:
        """After a call to server ``sid`` timed out: one ``PING`` on a fresh connection at
        once (handshake and answer each within ``connect_timeout_s``), then, while the
        server stays hung, one every ``down_for_s``.  An answer (even an error) ends the
        mark; a refused or lost connection leaves an ordinary mark (:meth:`mark_down`:
        ends after ``down_for_s``; a restarted server answers reads at once); a timeout
        confirms the server hung (:meth:`timed_out`: its mark holds until an answer).  Ends
        when the mark ends otherwise (a call answered, meta moved or forgot the server) or
        the link closes."""
        me = asyncio.current_task()
        try:
            while True:
                entry = self._servers.get(sid)
                if entry is None or (sid not in self._suspect and sid not in self._timed_out):
                    return
                answered = await self._ping(entry.addr)
                now = self._servers.get(sid)
                if now is None or now.addr != entry.addr or (
                        sid not in self._suspect and sid not in self._timed_out):
                    return  # ended meanwhile
                if answered is None:  # timed out: hung (confirmed, or still)
                    self._suspect.discard(sid)
                    self._timed_out.add(sid)
                    self._down_until[sid] = math.inf
                    now.down = True
                    await asyncio.sleep(self.down_for_s)
                    continue
                if answered:
                    self._mark_up(sid)
                else:
                    self._suspect.discard(sid)
                    self._timed_out.discard(sid)
                    self._down_until[sid] = time.monotonic() + self.down_for_s
                return
        finally:
            if self._probes.get(sid) is me:
                del self._probes[sid]
                self._suspect.discard(sid)
                if self._down_until.get(sid) == math.inf:  # (an error ended it)
                    self._down_until[sid] = time.monotonic() + self.down_for_s

    async def _ping(self, addr: str) -> bool | None:
        """One probe of the chunkserver at ``addr``: True when it answered, False when the
        connection was refused or lost, None when it timed out."""
        self.rpc_counts[OP_OF[rpc.Ping].name] += 1
        host, port = parse_addr(addr, what="chunkserver address")
        try:
            conn = await self._open(host, port)
        except Timeout:
            return None
        except Unavailable:
            return False
        except KVFSError:  # it answered the handshake, with an error
            return True
        try:
            await conn.call(rpc.Ping(), timeout_s=self.connect_timeout_s)
        except Timeout:
            return None
        except Unavailable:
            return False
        except KVFSError:
            return True
        finally:
            conn.close()
        return True

    # chunkservers ---------------------------------------------------------------------
    async def server_conn(self, sid: int) -> Connection:
        self.bind_loop()
        conn = self._conns.get(sid)
        if conn is not None and not conn.is_closed:
            return conn
        return await _reopen(self._conns, self._conn_locks, sid, lambda: self._open_server(sid))

    async def _open_server(self, sid: int) -> Connection:
        # a second try after re-reading the server list: a restarted server may have moved
        for attempt in (0, 1):
            entry = self._servers.get(sid)
            if entry is None or attempt:
                await self.servers(refresh=True)
                if attempt and entry is not None and self._servers.get(sid) == entry:
                    break
                entry = self._servers.get(sid)
            if entry is None:
                raise Unavailable(f"chunkserver {sid} is not known to meta")
            host, port = parse_addr(entry.addr, what="chunkserver address")
            try:
                return await self._open(host, port)
            except Unavailable as exc:  # (a Timeout: connected, no handshake in time)
                self.mark_down(sid, timed_out=isinstance(exc, Timeout))
                error = Unavailable(f"chunkserver {sid} at {entry.addr}: {exc}")
        raise error

    async def call_server(self, sid: int, request: Request[R], payload: Sequence[Buffer] = (),
                          sink: Sink | None = None) -> tuple[R, memoryview | Scatter]:
        """One RPC to chunkserver ``sid``: its answer and raw payload.  A connection that
        fails (refused, lost, timed out: ``Unavailable``) marks the server down
        (:meth:`mark_down`; a ``Timeout`` as timed out); an answer clears the mark."""
        self.rpc_counts[OP_OF[type(request)].name] += 1
        self.bind_loop()
        conn = self._conns.get(sid)  # (open, the usual case: no coroutine made for it)
        if conn is None or conn.is_closed:
            conn = await self.server_conn(sid)
        try:
            answer, body = await conn.exchange(request, payload, sink=sink)
        except Unavailable as exc:
            self.mark_down(sid, timed_out=isinstance(exc, Timeout))
            raise Unavailable(f"chunkserver {sid} ({conn.name}): {exc}") from None
        self._mark_up(sid)
        return answer, body if isinstance(body, Scatter) else memoryview(body)
