"""The blocking client's own sockets to meta, used in its callers' threads.

A blocking call that is one meta RPC and nothing more (``exists_many``, ``match_prefix``,
``release``) is sent and answered in the thread that made it, on a plain blocking socket:
no hop to the IO loop's thread and back.  That hop costs about three thread wake-ups per
call (the IO thread for the request, the caller for the answer, the IO thread again for the
next request), and on a loaded machine each wake-up waits for a CPU; a 128-key lookup
takes less CPU than those waits (bench/RESULTS.md).  Here the answer wakes one thread, the
caller, out of its ``recv``.

The sockets speak what :mod:`kvfs.transport`'s connections speak, with the same code: the
connect and TLS errors (:func:`kvfs.transport.connect_failure`, :mod:`kvfs.tls`), the
token handshake (:func:`kvfs.transport.answer_hello`, :mod:`kvfs.handshake`), the frames
(:class:`kvfs.protocol.FrameDecoder`) and the typed answers
(:func:`kvfs.transport.answer_of`, :mod:`kvfs.rpc`).  At most ``most`` of them are open
(``ClientConfig.meta_sockets``), each carrying one call at a time.  A call that finds none
free, a meta these sockets cannot reach, or a socket lost before its answer (e.g. meta
restarted or closed it as idle), goes through the IO loop instead, whose link fails over
between metas and says why one cannot be reached.
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl
import threading
import time

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
from kvfs.protocol import Frame, FrameDecoder, Limits
from kvfs.rpc import OP_OF, Auth, Op, R, Request, decode, to_dict
from kvfs.tls import tls_failure
from kvfs.transport import (
    answer_hello,
    answer_of,
    closed_before_hello,
    connect_failure,
    handshake_timeout,
    peer_name,
    request_frame,
)

# a socket's receive buffer to start with: a lookup's answer of 128 keys fits many times;
# a larger answer grows it, and the socket's next call starts again from this size
SCRATCH_BYTES = 16 * 1024


class MetaSocket:
    """One authenticated blocking connection to meta: one request at a time."""

    def __init__(self, sock: socket.socket, name: str, request_timeout_s: float) -> None:
        self.sock = sock
        self.name = name
        self.request_timeout_s = request_timeout_s
        self._timeout_s = -1.0  # the socket's timeout as last set here (-1: not yet)
        self._ids = itertools.count(1)
        self._decoder = FrameDecoder(Limits(), scratch_bytes=SCRATCH_BYTES)

    @classmethod
    def open(cls, ep: Endpoint, token: str, *, connect_timeout_s: float, request_timeout_s: float,
             tls: ssl.SSLContext | None) -> MetaSocket:
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
        conn = cls(sock, name, request_timeout_s)
        deadline = time.monotonic() + connect_timeout_s
        hello: Frame | None = None
        try:
            hello = conn._receive(0, deadline)
            if hello.op != Op.HELLO or hello.is_response:
                raise RemoteProtocolError(f"{name} sent op {hello.op} before its HELLO")
            _, auth = answer_hello(token, hello, name, local=sock.getsockname(),
                                   peer=sock.getpeername())
            reply = conn._exchange(decode(auth, Auth), deadline)
            check_server_proof(token, hello.header, auth, to_dict(reply), name)
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
        return conn

    def call(self, request: Request[R]) -> R:
        """Send ``request`` and return its typed answer; an error frame raises its error.
        A timeout (``request_timeout_s``) raises :class:`Timeout`; the connection lost
        raises ``OSError`` (the caller drops this socket either way)."""
        try:
            return self._exchange(request, time.monotonic() + self.request_timeout_s)
        except TimeoutError as exc:
            if isinstance(exc, KVFSError):  # meta's answer (an error frame), as it is
                raise
            op = OP_OF[type(request)]
            raise Timeout(f"{op.name} to {self.name} got no answer within "
                          f"{self.request_timeout_s}s") from None

    def _exchange(self, request: Request[R], deadline: float) -> R:
        op = OP_OF[type(request)]
        rid = next(self._ids)
        for part in request_frame(op, rid, request):
            self.sock.sendall(part)
        answer: R = answer_of(op, self._receive(rid, deadline), self.name)
        return answer

    def _receive(self, rid: int, deadline: float) -> Frame:
        """The next frame (answer ``rid``; 0: the server's HELLO), within ``deadline``."""
        dec, sock = self._decoder, self.sock
        got = 0
        while not isinstance(ev := dec.next_event(), Frame):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not left - 1.0 <= self._timeout_s <= left + 0.01:  # (a syscall: not every call)
                sock.settimeout(left)
                self._timeout_s = left
            try:
                n = sock.recv_into(dec.get_buffer())
            except TimeoutError:
                continue  # up to 1 s before the deadline: it decides
            if not n:
                raise ConnectionResetError(f"{self.name} closed the connection")
            got += n
            dec.buffer_updated(n)  # RemoteProtocolError on garbage
        if ev.is_error and ev.request_id == 0:
            # the server closed the connection saying why (e.g. idle for its idle_timeout_s,
            # while this socket waited in the pool): lost, as the async connection takes it
            raise ConnectionResetError(f"{self.name} closed the connection: {from_wire(ev.header)}")
        if ev.request_id != rid:
            raise RemoteProtocolError(f"{self.name} answered request {ev.request_id}, "
                                      f"expected {rid} (one at a time on this connection)")
        if got > SCRATCH_BYTES and not dec.buffered_bytes:  # a large answer: its memory goes
            self._decoder = FrameDecoder(Limits(), scratch_bytes=SCRATCH_BYTES)
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


class MetaSockets:
    """At most ``most`` :class:`MetaSocket`\\ s to the metas ``link`` knows (opened on
    demand, in turn over the metas up), each lent to one call at a time.  Fork-safe: a
    child of ``fork()`` leaves the parent's sockets alone and opens its own."""

    def __init__(self, link: ClusterLink, *, most: int, connect_timeout_s: float,
                 request_timeout_s: float, down_for_s: float) -> None:
        self._link = link
        self.most = most
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._down_for_s = down_for_s
        self._lock = threading.Lock()
        self._idle: list[MetaSocket] = []
        self._busy: set[MetaSocket] = set()
        self._opening = 0  # sockets being opened (counted against `most`)
        self._down_until: dict[Endpoint, float] = {}  # metas a socket could not be opened to
        self._turn = 0
        self._closed = False
        self._pid = os.getpid()

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

    def close(self) -> None:
        """Closes the idle sockets and ends the calls on the others at once; nothing is
        lent any more."""
        with self._lock:
            if self._pid != os.getpid():  # (a child's: the parent's sockets are never shut)
                self._forked()
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for ms in idle:
            ms.close()
        for ms in busy:
            ms.shut()  # its caller closes it (_drop)

    def _forked(self) -> None:
        """In a child of ``fork()`` (under the lock): the parent's sockets are its own; this
        process's copies of them are closed (no shutdown: that would end the parent's)."""
        for ms in [*self._idle, *self._busy]:
            ms.close()
        self._idle, self._busy, self._opening = [], set(), 0
        self._down_until.clear()
        self._pid = os.getpid()

    def _take(self) -> MetaSocket | None:
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
            ep = self._next_meta()
            if ep is None:
                return None
            self._opening += 1
        ms: MetaSocket | None = None
        keep = False
        try:
            ms = MetaSocket.open(ep, self._link.token, connect_timeout_s=self._connect_timeout_s,
                                 request_timeout_s=self._request_timeout_s, tls=self._link.tls)
        except (KVFSError, OSError):  # the IO loop's link tries it too, and says why it fails
            with self._lock:
                self._down_until[ep] = time.monotonic() + self._down_for_s
        finally:
            with self._lock:
                self._opening -= 1
                keep = ms is not None and not self._closed and self._pid == os.getpid()
                if keep and ms is not None:
                    self._busy.add(ms)
        if ms is not None and not keep:
            ms.close()  # the pool was closed meanwhile
        return ms if keep else None

    def _next_meta(self) -> Endpoint | None:
        """The meta a new socket goes to: the link's metas up, in turn, skipping those a
        socket could not be opened to within ``down_for_s`` (under the lock)."""
        now = time.monotonic()
        eps = [e for e in self._link.metas_up() if self._down_until.get(e, 0.0) <= now]
        if not eps:
            return None
        self._turn += 1
        return eps[self._turn % len(eps)]

    def _give(self, ms: MetaSocket) -> None:
        with self._lock:
            if ms in self._busy:
                self._busy.discard(ms)
                if not self._closed:
                    self._idle.append(ms)
                    return
        ms.close()

    def _drop(self, ms: MetaSocket) -> None:
        with self._lock:
            self._busy.discard(ms)
        ms.close()

