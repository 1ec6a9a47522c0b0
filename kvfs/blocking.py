"""The blocking client's own sockets to meta and the chunkservers, used in its callers' threads.

A blocking call that is one meta RPC and nothing more (``exists_many``, ``match_prefix``,
``release``), and the common case of ``get_many``/``get_into`` (layouts cached or one
LOOKUP, then one READV to each chunkserver holding the values: :meth:`kvfs.readpath.
ReadPath.fetch_now`), are sent and answered in the thread that made them, on plain
blocking sockets: no hop to the IO loop's thread and back.  That hop costs about three
thread wake-ups per call (the IO thread for the request, the caller for the answer, the
IO thread again for the next request), and on a loaded machine each wake-up waits for a
CPU; a 128-key lookup takes less CPU than those waits (bench/RESULTS.md), and the IO
thread waking for each READV answer while the callers take the GIL cost a 4 KiB
``get_many`` about 1 us per key.  Here the answer wakes one thread, the caller, out of
its ``recv``.

The sockets speak what :mod:`kvfs.transport`'s connections speak, with the same code: the
connect and TLS errors (:func:`kvfs.transport.connect_failure`, :mod:`kvfs.tls`), the
token handshake (:func:`kvfs.transport.answer_hello`, :mod:`kvfs.handshake`), the frames
(:class:`kvfs.protocol.FrameDecoder`) and the typed answers
(:func:`kvfs.transport.answer_of`, :mod:`kvfs.rpc`).  Each carries one call at a time.
A plain (not TLS) socket waits in the kernel, bounded by ``SO_RCVTIMEO``/``SO_SNDTIMEO``:
a receive or a send is one syscall, where a Python socket timeout polls before each (two
syscalls, each letting the GIL go to another caller's thread and back).
At most ``ClientConfig.meta_sockets`` go to meta (:class:`MetaSockets`) and at most
``ClientConfig.server_sockets`` to each chunkserver (:class:`ServerSockets`).  A call that
finds none free, a server these sockets cannot reach, or a socket lost before its answer
(e.g. the server restarted or closed it as idle), goes through the IO loop instead, whose
link fails over between metas and replicas and says why one cannot be reached.  A
chunkserver no socket could be opened to (refused, timed out: as
:meth:`kvfs.cluster.ClusterLink.call_server` takes it) is marked down on that link, so the
callers' reads and the IO loop's skip it alike (a lost socket is not: a server closes idle
ones, and the IO loop's read asks again).
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.cluster import ClusterLink, Endpoint
from kvfs.errors import (
    KVFSError,
    ProtocolError,
    RemoteProtocolError,
    Timeout,
    Unavailable,
    from_wire,
)
from kvfs.handshake import check_server_proof
from kvfs.protocol import Frame, FrameDecoder, Limits, PayloadAllocator, SharedReceivePool
from kvfs.rpc import OP_OF, Auth, Op, R, Request, decode, to_dict
from kvfs.tls import tls_failure
from kvfs.transport import (
    answer_hello,
    answer_of,
    check_size,
    closed_before_hello,
    connect_failure,
    handshake_timeout,
    peer_name,
    request_frame,
)

# a socket's receive buffer to start with: a lookup's answer of 128 keys fits many times;
# a larger answer grows it, and the socket's next call starts again from this size (a
# READV answer's payload over 64 KiB goes to its own buffer: ServerSockets' pool)
SCRATCH_BYTES = 16 * 1024
_TIMEVAL = struct.Struct("@ll")  # struct timeval, for SO_RCVTIMEO / SO_SNDTIMEO
_WAITALL = socket.MSG_WAITALL


def _timeval(seconds: float) -> bytes:
    """``seconds`` as a ``struct timeval``, at least 1 us (0 would mean: wait for ever)."""
    us = max(1, int(seconds * 1e6))
    return _TIMEVAL.pack(us // 1_000_000, us % 1_000_000)


class BlockingSocket:
    """One authenticated blocking connection to meta or a chunkserver: one request at a
    time.  ``allocator``: where payloads over 64 KiB are received (default: a fresh buffer)."""

    def __init__(self, sock: socket.socket, name: str, request_timeout_s: float,
                 allocator: PayloadAllocator | None = None) -> None:
        self.sock = sock
        self.name = name
        self.request_timeout_s = request_timeout_s
        self._timeout_s = -1.0  # the socket's timeout as last set here (-1: not yet)
        # after the handshake a plain socket waits in the kernel (SO_RCVTIMEO/SO_SNDTIMEO,
        # ``_wait_in_kernel``): one syscall per receive or send, where a Python timeout
        # polls first (two, each letting the GIL go to another thread and back)
        self._kernel_wait = False
        self._ids = itertools.count(1)
        self._allocator = allocator
        self._decoder = self._new_decoder()
        self.max_header = 0  # the largest request header / payload the server takes (0: any)
        self.max_payload = 0

    def _new_decoder(self) -> FrameDecoder:
        dec = FrameDecoder(Limits(), allocator=self._allocator, scratch_bytes=SCRATCH_BYTES,
                           typed=rpc.ANSWERS)
        # a payload over 64 KiB arrives in its one buffer, the end of it too (not staged in
        # scratch 16 KiB a receive): with the socket waiting in the kernel, one receive
        # waits for all of it (MSG_WAITALL, _receive)
        dec.vectored = True
        return dec

    @classmethod
    def open(cls, ep: Endpoint, token: str, *, connect_timeout_s: float, request_timeout_s: float,
             tls: ssl.SSLContext | None, allocator: PayloadAllocator | None = None,
             ) -> BlockingSocket:
        """Connect and authenticate, within ``connect_timeout_s`` for each of the two."""
        host, port, server_name = ep
        name = peer_name(host, port, server_name)
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as exc:  # TimeoutError is one
            raise connect_failure(exc, name, tls is not None, connect_timeout_s) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio's are
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        except OSError as exc:  # ssl.SSLError is one
            sock.close()
            raise connect_failure(exc, name, tls is not None, connect_timeout_s) from None
        conn = cls(sock, name, request_timeout_s, allocator)
        deadline = time.monotonic() + connect_timeout_s
        hello: Frame | None = None
        try:
            hello = conn._receive(0, deadline)
            if hello.op != Op.HELLO or hello.is_response:
                raise RemoteProtocolError(f"{name} sent op {hello.op} before its HELLO")
            _, auth = answer_hello(token, hello, name, local=sock.getsockname(),
                                   peer=sock.getpeername())
            reply = answer_of(Op.AUTH, conn._receive(conn.send(decode(auth, Auth)), deadline), name)
            check_server_proof(token, hello.header, auth, to_dict(reply), name)
            conn.max_header, conn.max_payload = reply.max_header, reply.max_payload
        except KVFSError:  # (some are OSErrors too) the server's answer, as it is
            conn.close()
            raise
        except TimeoutError:
            conn.close()
            raise handshake_timeout(name, tls is not None, hello is None, connect_timeout_s) from None
        except OSError as exc:  # (as the async connection's connection_lost takes it)
            conn.close()
            if isinstance(exc, ssl.SSLError):
                raise tls_failure(exc, name) from None
            if hello is None:
                raise closed_before_hello(name, tls is not None) from None
            raise Unavailable(f"connection to {name} lost in the handshake: {exc}") from None
        except BaseException:
            conn.close()
            raise
        if tls is None:
            conn._wait_in_kernel()
        return conn

    def _wait_in_kernel(self) -> None:
        """The socket in blocking mode, its waits bounded by the kernel: a send by
        ``request_timeout_s`` (SO_SNDTIMEO), a receive by what :meth:`_receive` sets
        (SO_RCVTIMEO); a wait past either ends with ``BlockingIOError``.  (A TLS socket
        keeps Python's timeouts: its reads would raise ``SSLWantReadError`` instead.)"""
        sock = self.sock
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.request_timeout_s))
        self._timeout_s = -1.0
        self._kernel_wait = True

    def call(self, request: Request[R]) -> R:
        """Send ``request`` and return its typed answer; an error frame raises its error.
        A timeout (``request_timeout_s``) raises :class:`Timeout`; the connection lost
        raises ``OSError`` (the caller drops this socket either way)."""
        answer: R = self.answer(OP_OF[type(request)], self.send(request),
                                time.monotonic() + self.request_timeout_s)[0]
        return answer

    def send(self, request: Request[R]) -> int:
        """Send ``request``; returns its id, for :meth:`answer`."""
        rid = next(self._ids)
        op = OP_OF[type(request)]
        frame = request_frame(op, rid, request)
        if self.max_header or self.max_payload:
            check_size(self.name, op, frame, self.max_header, self.max_payload)
        for part in frame:
            self.sock.sendall(part)
        return rid

    def answer(self, op: Op, rid: int, deadline: float) -> tuple[Any, bytes | memoryview]:
        """The typed answer to request ``rid`` (an ``op``) and its payload, within
        ``deadline`` (else :class:`Timeout`); an error frame raises its error."""
        try:
            frame = self._receive(rid, deadline)
        except TimeoutError as exc:
            if isinstance(exc, KVFSError):  # the server's answer (an error frame), as it is
                raise
            raise Timeout(f"{op.name} to {self.name} got no answer within "
                          f"{self.request_timeout_s}s") from None
        payload = frame.payload
        return answer_of(op, frame, self.name), (
            payload if isinstance(payload, (bytes, memoryview)) else memoryview(payload))  # type: ignore[arg-type]

    def _receive(self, rid: int, deadline: float) -> Frame:
        """The next frame (answer ``rid``; 0: the server's HELLO), within ``deadline``."""
        dec, sock = self._decoder, self.sock
        while not isinstance(ev := dec.next_event(), Frame):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not left - 1.0 <= self._timeout_s <= left + 0.01:  # (a syscall: not every call)
                if self._kernel_wait:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))
                else:
                    sock.settimeout(left)
                self._timeout_s = left
            buf = dec.get_buffer()
            try:  # (a payload's rest: one receive, woken once it is all there, or the time is up)
                n = sock.recv_into(buf, 0, _WAITALL if self._kernel_wait and dec.in_payload else 0)
            except (TimeoutError, BlockingIOError):  # (BlockingIOError: SO_RCVTIMEO's)
                continue  # up to 1 s before the deadline: it decides
            if not n:
                raise ConnectionResetError(f"{self.name} closed the connection")
            dec.buffer_updated(n)  # RemoteProtocolError on garbage
        if ev.is_error and ev.request_id == 0:
            # the server closed the connection saying why (e.g. idle for its idle_timeout_s,
            # while this socket waited in the pool): lost, as the async connection takes it
            raise ConnectionResetError(f"{self.name} closed the connection: {from_wire(ev.header)}")
        if ev.request_id != rid:
            raise RemoteProtocolError(f"{self.name} answered request {ev.request_id}, "
                                      f"expected {rid} (one at a time on this connection)")
        if dec.scratch_size > SCRATCH_BYTES and not dec.buffered_bytes:
            # a large answer grew the scratch buffer: that memory goes (a payload over 64 KiB
            # had a buffer of its own, the allocator's: the scratch buffer is kept then)
            self._decoder = self._new_decoder()
        return ev

    def shut(self) -> None:
        """From another thread: the call waiting on this socket ends at once (its receive
        sees the connection end)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


class SocketPool:
    """At most ``most`` :class:`BlockingSocket`\\ s (opened on demand by :meth:`_open`),
    each lent to one call at a time.  Fork-safe: a child of ``fork()`` leaves the parent's
    sockets alone and opens its own."""

    def __init__(self, *, most: int) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._idle: list[BlockingSocket] = []
        self._busy: set[BlockingSocket] = set()
        self._opening = 0  # sockets being opened (counted against `most`)
        self._closed = False
        self._pid = os.getpid()

    def _endpoint(self) -> Endpoint | None:
        """Where a new socket goes (under the lock); None: nowhere now."""
        raise NotImplementedError

    def _open(self, ep: Endpoint) -> BlockingSocket:
        raise NotImplementedError

    def _failed(self, ep: Endpoint, exc: KVFSError | OSError) -> None:
        """A socket to ``ep`` could not be opened (``exc``; under the lock)."""

    def close(self) -> None:
        """Closes the idle sockets and ends the calls on the others at once; nothing is
        lent any more."""
        with self._lock:
            if self._pid != os.getpid():  # (a child's: the parent's sockets are never shut)
                self._forked()
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for s in idle:
            s.close()
        for s in busy:
            s.shut()  # its caller closes it (_drop)

    def _forked(self) -> None:
        """In a child of ``fork()`` (under the lock): the parent's sockets are its own; this
        process's copies of them are closed (no shutdown: that would end the parent's)."""
        for s in [*self._idle, *self._busy]:
            s.close()
        self._idle, self._busy, self._opening = [], set(), 0
        self._pid = os.getpid()

    def _take(self) -> BlockingSocket | None:
        with self._lock:
            if self._pid != os.getpid():
                self._forked()
            if self._closed:
                return None
            if self._idle:
                idle = self._idle.pop()
                self._busy.add(idle)
                return idle
            if len(self._busy) + self._opening >= self.most:
                return None
            ep = self._endpoint()
            if ep is None:
                return None
            self._opening += 1
        s: BlockingSocket | None = None
        keep = False
        try:
            s = self._open(ep)
        except (KVFSError, OSError) as exc:  # the IO loop's link says why it fails
            with self._lock:
                self._failed(ep, exc)
        finally:
            with self._lock:
                self._opening -= 1
                keep = s is not None and not self._closed and self._pid == os.getpid()
                if keep and s is not None:
                    self._busy.add(s)
        if s is not None and not keep:
            s.close()  # the pool was closed meanwhile
        return s if keep else None

    def _give(self, s: BlockingSocket) -> None:
        with self._lock:
            if s in self._busy:
                self._busy.discard(s)
                if not self._closed:
                    self._idle.append(s)
                    return
        s.close()

    def _drop(self, s: BlockingSocket) -> None:
        with self._lock:
            self._busy.discard(s)
        s.close()


class MetaSockets(SocketPool):
    """At most ``most`` sockets to the metas ``link`` knows (opened in turn over the metas
    up, skipping for ``down_for_s`` one a socket could not be opened to)."""

    def __init__(self, link: ClusterLink, *, most: int, connect_timeout_s: float,
                 request_timeout_s: float, down_for_s: float) -> None:
        super().__init__(most=most)
        self._link = link
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._down_for_s = down_for_s
        self._down_until: dict[Endpoint, float] = {}  # metas a socket could not be opened to
        self._turn = 0

    def call(self, request: Request[R]) -> R | None:
        """``request``'s answer, or None: not sent here (no socket free, none could be
        opened, or the socket was lost before the answer, so meta may or may not have
        seen it); send it through the IO loop then.  Errors meta answers with, and a
        timeout, raise."""
        ms = self._take()
        if ms is None:
            return None
        link = self._link
        link.rpc_counts[OP_OF[type(request)].name] += 1
        try:
            answer = ms.call(request)
        except KVFSError as exc:
            if isinstance(exc, (ProtocolError, Unavailable)):  # the connection's state is unknown
                self._drop(ms)
            else:  # meta's answer, an error: the connection goes on
                self._give(ms)
            raise
        except OSError:  # lost (or shut by close())
            self._drop(ms)
            return None
        except BaseException:  # e.g. KeyboardInterrupt: the answer would be left on the socket
            self._drop(ms)
            raise
        self._give(ms)
        link.meta_calls[ms.name] += 1
        return answer

    def _forked(self) -> None:
        super()._forked()
        self._down_until.clear()

    def _open(self, ep: Endpoint) -> BlockingSocket:
        ms = BlockingSocket.open(ep, self._link.token, connect_timeout_s=self._connect_timeout_s,
                                 request_timeout_s=self._request_timeout_s, tls=self._link.tls)
        self._link.heard(ms.max_header)  # (batch calls are cut under it: AsyncClient.parts)
        return ms

    def _failed(self, ep: Endpoint, exc: KVFSError | OSError) -> None:
        self._down_until[ep] = time.monotonic() + self._down_for_s

    def _endpoint(self) -> Endpoint | None:
        """The meta a new socket goes to: the link's metas up, in turn, skipping those a
        socket could not be opened to within ``down_for_s`` (under the lock)."""
        now = time.monotonic()
        eps = [e for e in self._link.metas_up() if self._down_until.get(e, 0.0) <= now]
        if not eps:
            return None
        self._turn += 1
        return eps[self._turn % len(eps)]


class _ServerPool(SocketPool):
    """The sockets to chunkserver ``sid`` at one address."""

    def __init__(self, owner: ServerSockets, sid: int, addr: str) -> None:
        super().__init__(most=owner.most)
        self._owner = owner
        self.sid = sid
        self.addr = addr
        host, port = parse_addr(addr, what="chunkserver address")
        self._ep: Endpoint = (host, port, None)
        self.down_until = 0.0  # a socket could not be opened to it until then (monotonic)

    def _endpoint(self) -> Endpoint | None:
        return self._ep if self.down_until <= time.monotonic() else None

    def _open(self, ep: Endpoint) -> BlockingSocket:
        o = self._owner
        s = BlockingSocket.open(ep, o._link.token, connect_timeout_s=o._connect_timeout_s,
                                request_timeout_s=o._request_timeout_s, tls=o._link.tls,
                                allocator=o.rx_pool)
        o._link.heard(s.max_header)
        return s

    def _failed(self, ep: Endpoint, exc: KVFSError | OSError) -> None:
        self.down_until = time.monotonic() + self._owner._down_for_s
        if isinstance(exc, Unavailable):  # (as the IO loop's link marks one it cannot open)
            self._owner._link.mark_down_soon(self.sid, timed_out=isinstance(exc, Timeout))


# what a READV's answer is handed to, while its payload's buffer is lent: (server id, answer,
# payload); the payload is given back to the pool once it returns
Settle = Callable[[int, rpc.ReadVReply, memoryview], None]


class ServerSockets:
    """At most ``most`` sockets to each chunkserver, for the READVs of reads made in the
    callers' threads (:meth:`readvs`).  Payloads over 64 KiB are received into one pool of
    buffers kept for reuse, shared by every socket (``pool_bytes`` at most kept: the
    ``ClientConfig.read_pool_bytes`` of the IO loop's read path, again)."""

    def __init__(self, link: ClusterLink, *, most: int, connect_timeout_s: float,
                 request_timeout_s: float, down_for_s: float, pool_bytes: int) -> None:
        self._link = link
        self.most = most
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._down_for_s = down_for_s
        self.rx_pool = SharedReceivePool(pool_bytes, min_bytes=0)
        self._lock = threading.Lock()
        self._pools: dict[int, _ServerPool] = {}  # by server id (one address each)
        self._closed = False

    def _pool(self, sid: int, addr: str) -> _ServerPool | None:
        with self._lock:
            if self._closed:
                return None
            pool = self._pools.get(sid)
            if pool is not None and pool.addr == addr:
                return pool
            fresh = self._pools[sid] = _ServerPool(self, sid, addr)
        if pool is not None:
            pool.close()  # the server moved: its old sockets go
        return fresh

    def readvs(self, reads: Sequence[tuple[int, str, rpc.ReadV, float]], settle: Settle,
               late: set[int]) -> bool:
        """Each ``(server id, its address, READV, deadline)`` sent on a socket of its own,
        all of them before any answer is read (the servers work at once); each answer
        handed to ``settle`` as it is read.  True: every READV was answered and settled.
        False: not (no socket free, a server these sockets cannot reach, a connection lost,
        an error answer, a deadline passed: that server's id is added to ``late``): which
        were settled is undefined, and the caller reads again through the IO loop.  A
        socket whose answer was not read to its end (those, and an interrupt:
        ``KeyboardInterrupt`` is raised) is closed."""
        if self.most <= 0:
            return False
        taken: list[tuple[_ServerPool, BlockingSocket | None]] = []
        counts = self._link.rpc_counts
        try:
            for sid, addr, _, _ in reads:
                pool = self._pool(sid, addr)
                s = None if pool is None else pool._take()
                if pool is None or s is None:
                    return False
                taken.append((pool, s))
            rids = []
            for (_, s), (_, _, request, _) in zip(taken, reads, strict=True):
                assert s is not None
                counts["READV"] += 1
                rids.append(s.send(request))
            for i, (sid, _, _, deadline) in enumerate(reads):
                pool, s = taken[i]
                assert s is not None
                try:
                    answer, payload = s.answer(Op.READV, rids[i], deadline)
                except Timeout:
                    late.add(sid)
                    raise
                try:
                    settle(sid, answer, payload if isinstance(payload, memoryview)
                           else memoryview(payload))
                finally:
                    self.rx_pool.give(payload)
                taken[i] = (pool, None)  # answered: reusable
                pool._give(s)
            return True
        except (KVFSError, OSError):  # lost, shut by close(), timed out, an error answer
            return False
        finally:
            for pool, s in taken:
                if s is not None:
                    pool._drop(s)

    def close(self) -> None:
        """Closes the idle sockets and ends the calls on the others at once."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
        for pool in pools:
            pool.close()
