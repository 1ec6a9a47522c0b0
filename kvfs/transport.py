"""Client connections: one persistent, multiplexed connection per server."""

from __future__ import annotations

import asyncio
import itertools
import math
import ssl
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvfs.errors import (
    FrameTooLarge,
    KVFSError,
    LocalProtocolError,
    RemoteProtocolError,
    Timeout,
    Unavailable,
    from_wire,
)
from kvfs.frame_protocol import FrameProtocol
from kvfs.handshake import Role, check_server_proof, client_auth, endpoint, new_nonce
from kvfs.protocol import (
    FIXED,
    PROTOCOL_VERSION,
    Buffer,
    Frame,
    FrameHead,
    Limits,
    Scatter,
    encode_frame,
)
from kvfs.rpc import ANSWERS, OP_OF, RPCS, Auth, Hello, Op, R, Request, decode, message, to_dict
from kvfs.tls import MUTUAL_TLS_HINT, PLAINTEXT_HINT, connect_options, tls_failure

Sink = Callable[[FrameHead], "bytearray | memoryview | Scatter | None"]


class _ClientProtocol(FrameProtocol):
    def __init__(self, name: str, limits: Limits | None, tls: bool = False) -> None:
        super().__init__(limits, allocator=self._allocate, typed=ANSWERS)
        self.name = name
        self.tls = tls
        self.pending: dict[int, asyncio.Future[Frame]] = {}
        self.sinks: dict[int, Sink] = {}
        self.decoder.head_first = self.sinks  # a sink's answer: its header received alone
        self.hello: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self.error: KVFSError | None = None

    def _allocate(self, head: FrameHead) -> bytearray | memoryview | Scatter:
        """A response's large payload goes where its caller asked (see ``call(sink=)``), if
        its header decoded into its typed answer (:attr:`FrameHead.message`: what a sink
        reads; a bad answer's payload goes to a buffer of its own, and its call fails)."""
        sink = self.sinks.pop(head.request_id, None)
        if sink is not None and head.message is not None:
            where = sink(head)
            if where is not None:
                return where
        return bytearray(head.payload_len)

    def frame_received(self, frame: object) -> None:
        assert isinstance(frame, Frame)
        if frame.op == Op.HELLO and not frame.is_response:
            if not self.hello.done():
                self.hello.set_result(frame)
            return
        fut = self.pending.pop(frame.request_id, None)
        if fut is None:
            if frame.is_error:  # a connection-level error (request id 0)
                self.error = from_wire(frame.header)
                if not self.hello.done():
                    self.hello.set_exception(self.error)
            return
        if not fut.done():
            fut.set_result(frame)

    def protocol_failed(self, exc: KVFSError) -> None:
        self.error = exc
        super().protocol_failed(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        err = self.error
        if err is None and isinstance(exc, ssl.SSLError):  # e.g. mutual TLS refused this client
            err = tls_failure(exc, self.name)
        elif err is None and not self.hello.done():
            err = closed_before_hello(self.name, self.tls)
        if err is None:
            err = Unavailable(f"connection to {self.name} lost" + (f": {exc}" if exc else ""))
        if not self.hello.done():
            self.hello.set_exception(err)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending.clear()


def peer_name(host: str, port: int, server_name: str | None) -> str:
    """How errors name a server: ``HOST:PORT``, or the name TLS checks and the address."""
    return f"{host}:{port}" if server_name is None else f"{server_name} ({host}:{port})"


def connect_failure(exc: OSError, name: str, tls: bool, timeout_s: float) -> KVFSError:
    """What a failed connect (the TCP connect, or the TLS handshake with it) to ``name`` means."""
    if isinstance(exc, TimeoutError):
        return Timeout(f"connecting to {name} timed out after {timeout_s}s"
                       + (" (in the TLS handshake?)" if tls else ""))
    if isinstance(exc, ssl.SSLError) or (
            tls and isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError))):
        return tls_failure(exc, name)
    return Unavailable(f"cannot connect to {name}: {exc.strerror or exc}")


def closed_before_hello(name: str, tls: bool) -> Unavailable:
    """``name`` closed the connection before its HELLO: what that likely means.  A TLS
    server closes a plaintext client at its handshake timeout; under TLS 1.3 a server
    refusing the client's certificate (or its absence) closes the connection after the
    TLS handshake, with no alert the client sees."""
    return Unavailable(f"{name} closed the connection before its HELLO ("
                       + (MUTUAL_TLS_HINT if tls else PLAINTEXT_HINT) + ")")


def handshake_timeout(name: str, tls: bool, no_hello: bool, timeout_s: float) -> Timeout:
    """The token handshake with ``name`` did not finish in time (``no_hello``: the server
    never said HELLO, as a TLS server does to a plaintext client)."""
    hint = f" ({PLAINTEXT_HINT})" if not tls and no_hello else ""
    return Timeout(f"handshake with {name} timed out after {timeout_s}s{hint}")


def answer_hello(token: str, frame: Frame, name: str, *, local: Any, peer: Any,
                 ) -> tuple[Hello, dict[str, Any]]:
    """A server's HELLO, checked, and the AUTH header that answers it (its MAC binds the
    connection's two ends, ``local`` and ``peer`` as the client's socket names them)."""
    version = frame.header.get("version")
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError(f"{name} speaks protocol {version}, we speak {PROTOCOL_VERSION}")
    try:
        hello = decode(frame.header, Hello)
    except msgspec.ValidationError as exc:
        raise RemoteProtocolError(f"{name} sent a bad HELLO: {exc}") from None
    return hello, client_auth(token, frame.header, new_nonce(), local=endpoint(local),
                              peer=endpoint(peer))


def request_frame(op: Op, rid: int, header: dict[str, Any] | msgspec.Struct | None,
                  payload: Sequence[Buffer] = ()) -> list[Buffer]:
    """A request's frame (:func:`kvfs.protocol.encode_frame`); a header msgpack refuses is
    the caller's error."""
    try:
        return encode_frame(op, rid, header, payload)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode {op.name} request: {exc}") from None


def check_size(name: str, op: Op, frame: Sequence[Buffer], max_header: int, max_payload: int) -> None:
    """Refuse, here, a request larger than the server ``name`` said it takes (its AUTH
    answer; 0: not said): sent, it would make the server close the connection, failing
    every other call on it too."""
    hlen, plen = FIXED.unpack_from(frame[0])[5:7]
    for what, size, limit, option in (("header", hlen, max_header, "--max-header"),
                                      ("payload", plen, max_payload, "--max-payload")):
        if limit and size > limit:
            raise FrameTooLarge(f"{op.name} request {what} of {size} bytes exceeds the limit of "
                                f"{limit} that {name} takes ({option}); not sent: split the batch")


def answer_of(op: Op, frame: Frame, name: str) -> Any:
    """The typed answer (:data:`kvfs.rpc.RPCS`) in a response frame from ``name``; an
    error frame raises its error."""
    if frame.is_error:
        raise from_wire(frame.header)
    try:
        return message(frame, RPCS[op].response)
    except msgspec.ValidationError as exc:
        raise RemoteProtocolError(f"{name} sent a bad {op.name} answer: {exc}") from None


class Connection:
    """An authenticated connection carrying many requests in flight."""

    def __init__(self, proto: _ClientProtocol, name: str, request_timeout_s: float) -> None:
        self._proto = proto
        self.name = name
        self.request_timeout_s = request_timeout_s
        self._ids = itertools.count(1)
        # the calls waiting for answers: request id -> (deadline, its wait), timed out by one
        # timer at the earliest deadline at most (_expire), not one armed and cancelled per
        # call (about 1.2 us an RPC on uvloop: bench/RESULTS.md, issue 11, put side)
        self._deadlines: dict[int, tuple[float, asyncio.Future[Frame]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self.service = ""
        self.role: Role | None = None  # what the server granted this connection's token
        self.max_header = 0  # the largest request header / payload the server takes (0: any)
        self.max_payload = 0

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        token: str,
        *,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 60.0,
        limits: Limits | None = None,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> Connection:
        """``tls``: speak TLS, verifying the server's certificate names ``server_name``
        (default ``host``; a name resolved to ``host`` by the caller) (:func:`kvfs.tls.client_context`);
        None: plaintext."""
        name = peer_name(host, port, server_name)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: _ClientProtocol(name, limits, tls is not None), host, port,
                    **connect_options(tls, server_name or host, connect_timeout_s))
        except (TimeoutError, OSError) as exc:  # ssl.SSLError is an OSError
            raise connect_failure(exc, name, tls is not None, connect_timeout_s) from None
        conn = cls(proto, name, request_timeout_s)
        try:
            async with asyncio.timeout(connect_timeout_s):
                frame = await proto.hello
                assert proto.transport is not None
                hello, auth = answer_hello(token, frame, name,
                                           local=proto.transport.get_extra_info("sockname"),
                                           peer=proto.transport.get_extra_info("peername"))
                reply = await conn.call(decode(auth, Auth))
                conn.role = check_server_proof(token, frame.header, auth, to_dict(reply), name)
                conn.service = hello.service
                conn.max_header, conn.max_payload = reply.max_header, reply.max_payload
        except TimeoutError:
            conn.close()
            # lost before its HELLO in the same turn of the loop as the timeout (a client
            # starved of CPU sees both at once): the loss, which says why, is the error
            lost = proto.hello.exception() if proto.hello.done() and not proto.hello.cancelled() \
                else None
            if lost is not None:
                raise lost from None
            no_hello = proto.hello.cancelled() or not proto.hello.done()
            raise handshake_timeout(name, tls is not None, no_hello, connect_timeout_s) from None
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def is_closed(self) -> bool:
        return self._proto.closed.is_set()

    async def call(self, request: Request[R], payload: Sequence[Buffer] = (), *,
                   timeout_s: float | None = None) -> R:
        """Send one typed request (:mod:`kvfs.rpc`) and return its typed answer; error
        frames raise."""
        return (await self.exchange(request, payload, timeout_s=timeout_s))[0]

    async def exchange(self, request: Request[R], payload: Sequence[Buffer] = (), *,
                       timeout_s: float | None = None, sink: Sink | None = None,
                       ) -> tuple[R, bytes | bytearray | memoryview | Scatter]:
        """:meth:`call` that also returns the answer's raw payload.

        ``sink(head)`` may name where a large response payload is received (one buffer
        or a :class:`Scatter` of buffers whose sizes add up to the payload); None = a
        new buffer.  Small payloads always arrive as ``bytes``.
        """
        op = OP_OF[type(request)]
        frame = await self.call_raw(op, request, payload, timeout_s=timeout_s, sink=sink)
        answer: R = answer_of(op, frame, self.name)
        return answer, frame.payload

    async def call_raw(
        self,
        op: Op,
        header: dict[str, Any] | msgspec.Struct | None = None,
        payload: Sequence[Buffer] = (),
        *,
        timeout_s: float | None = None,
        sink: Sink | None = None,
    ) -> Frame:
        """Send one request with any header (tests feed servers malformed ones) and wait
        for its response frame; error frames raise (:func:`answer_of` decodes it)."""
        proto = self._proto
        if proto.closed.is_set():
            raise proto.error or Unavailable(f"connection to {self.name} is closed")
        rid = next(self._ids)
        frame_out = request_frame(op, rid, header, payload)
        if self.max_header or self.max_payload:
            check_size(self.name, op, frame_out, self.max_header, self.max_payload)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Frame] = loop.create_future()
        proto.pending[rid] = fut
        if sink is not None:
            proto.sinks[rid] = sink
        proto.write(frame_out)
        deadline = loop.time() + (timeout_s or self.request_timeout_s)
        # the answer's wait times out by the connection's timer failing its future
        # (asyncio.timeout's context manager costs a few us more per call: bench/RESULTS.md)
        self._deadlines[rid] = (deadline, fut)
        if deadline < self._timer_at:
            self._arm(loop, deadline)
        try:
            # waiting for room to write counts too: a peer that stops reading never makes it
            if not proto._can_write.is_set():
                async with asyncio.timeout_at(deadline):
                    await proto.drain()
            frame = await fut
        except TimeoutError:
            proto.pending.pop(rid, None)
            began = proto.decoder.arriving(rid)
            # the answer may still be arriving into a caller's buffer: stop the stream, now
            # (a close would first flush what is buffered, to a peer that may never read it,
            # and leave the connection half closed meanwhile)
            self.abort()
            waited = timeout_s or self.request_timeout_s
            if began is None:
                raise Timeout(f"{op.name} to {self.name} got no answer within {waited}s") from None
            raise Timeout(f"{op.name} to {self.name}: its answer began but did not end within "
                          f"{waited}s ({began[0]} of its {began[1]} payload bytes received)") from None
        except BaseException:  # cancelled: the caller may reuse its buffers once this returns
            if sink is not None and rid not in proto.sinks:  # its answer is arriving into them
                proto.decoder.drop_payload(rid)
            if fut.done() and not fut.cancelled():
                fut.exception()  # (timed out as it was cancelled: retrieved, not logged)
            raise
        finally:
            del self._deadlines[rid]
            proto.pending.pop(rid, None)
            proto.sinks.pop(rid, None)
        if frame.is_error:
            raise from_wire(frame.header)
        return frame

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        """The timer set to fire at ``at`` (no later than any waiting call's deadline)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._expire, loop), at

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer fired: each call whose deadline has passed ends its wait in
        ``TimeoutError``; the timer is set again for the earliest deadline left, if any."""
        passed = max(loop.time(), self._timer_at)  # (the timer's own deadline has passed)
        self._timer, self._timer_at = None, math.inf
        left = math.inf
        for at, fut in self._deadlines.values():
            if at > passed:
                left = min(left, at)
            elif not fut.done():
                fut.set_exception(TimeoutError())
        if left < math.inf:
            self._arm(loop, left)

    def close(self) -> None:
        # (the timer stays: a close waits to send what is buffered, and a peer that reads
        # nothing holds it open; the calls' deadlines still end their waits)
        if self._proto.transport is not None:
            self._proto.transport.close()

    def abort(self) -> None:
        """Close at once, dropping unsent bytes: calls still waiting on it fail now."""
        self._disarm()
        if self._proto.transport is not None:
            self._proto.transport.abort()

    def _disarm(self) -> None:
        """No timer left holding an aborted connection (and its decoder's buffers) until its
        last deadline: its calls end with it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    async def wait_closed(self) -> None:
        await self._proto.closed.wait()
