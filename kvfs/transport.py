"""Client connections: one persistent, multiplexed connection per server."""

from __future__ import annotations

import asyncio
import itertools
import ssl
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvfs.errors import (
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
    PROTOCOL_VERSION,
    Buffer,
    Frame,
    FrameHead,
    Limits,
    Scatter,
    encode_frame,
)
from kvfs.rpc import OP_OF, RPCS, Auth, Hello, Op, R, Request, decode, to_dict
from kvfs.tls import MUTUAL_TLS_HINT, PLAINTEXT_HINT, connect_options, tls_failure

Sink = Callable[[FrameHead], "bytearray | memoryview | Scatter | None"]


class _ClientProtocol(FrameProtocol):
    def __init__(self, name: str, limits: Limits | None, tls: bool = False) -> None:
        super().__init__(limits, allocator=self._allocate)
        self.name = name
        self.tls = tls
        self.pending: dict[int, asyncio.Future[Frame]] = {}
        self.sinks: dict[int, Sink] = {}
        self.hello: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self.error: KVFSError | None = None

    def _allocate(self, head: FrameHead) -> bytearray | memoryview | Scatter:
        """A response's large payload goes where its caller asked (see ``call(sink=)``)."""
        sink = self.sinks.pop(head.request_id, None)
        if sink is not None:
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
            # TLS 1.3: a server refusing our client certificate (or its absence) closes the
            # connection after the handshake, and asyncio reports no alert
            err = Unavailable(f"{self.name} closed the connection before its HELLO ("
                              + (MUTUAL_TLS_HINT if self.tls else PLAINTEXT_HINT) + ")")
        if err is None:
            err = Unavailable(f"connection to {self.name} lost" + (f": {exc}" if exc else ""))
        if not self.hello.done():
            self.hello.set_exception(err)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending.clear()


class Connection:
    """An authenticated connection carrying many requests in flight."""

    def __init__(self, proto: _ClientProtocol, name: str, request_timeout_s: float) -> None:
        self._proto = proto
        self.name = name
        self.request_timeout_s = request_timeout_s
        self._ids = itertools.count(1)
        self.service = ""
        self.role: Role | None = None  # what the server granted this connection's token

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
        name = f"{host}:{port}" if server_name is None else f"{server_name} ({host}:{port})"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: _ClientProtocol(name, limits, tls is not None), host, port,
                    **connect_options(tls, server_name or host, connect_timeout_s))
        except TimeoutError:
            raise Timeout(f"connecting to {name} timed out after {connect_timeout_s}s"
                          + (" (in the TLS handshake?)" if tls is not None else "")) from None
        except ssl.SSLError as exc:
            raise tls_failure(exc, name) from None
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
            if tls is None:
                raise Unavailable(f"cannot connect to {name}: {exc.strerror or exc}") from None
            raise tls_failure(exc, name) from None
        except OSError as exc:
            raise Unavailable(f"cannot connect to {name}: {exc.strerror or exc}") from None
        conn = cls(proto, name, request_timeout_s)
        try:
            async with asyncio.timeout(connect_timeout_s):
                frame = await proto.hello
                version = frame.header.get("version")
                if version != PROTOCOL_VERSION:
                    raise RemoteProtocolError(f"{name} speaks protocol {version}, we speak {PROTOCOL_VERSION}")
                try:
                    hello = decode(frame.header, Hello)
                except msgspec.ValidationError as exc:
                    raise RemoteProtocolError(f"{name} sent a bad HELLO: {exc}") from None
                assert proto.transport is not None
                auth = client_auth(token, frame.header, new_nonce(),
                                   local=endpoint(proto.transport.get_extra_info("sockname")),
                                   peer=endpoint(proto.transport.get_extra_info("peername")))
                reply = await conn.call(decode(auth, Auth))
                conn.role = check_server_proof(token, frame.header, auth, to_dict(reply), name)
                conn.service = hello.service
        except TimeoutError:
            conn.close()
            no_hello = proto.hello.cancelled() or not proto.hello.done()
            hint = f" ({PLAINTEXT_HINT})" if tls is None and no_hello else ""
            raise Timeout(f"handshake with {name} timed out after {connect_timeout_s}s{hint}"
                          ) from None
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
        try:
            answer: R = decode(frame.header, RPCS[op].response)  # type: ignore[assignment]
        except msgspec.ValidationError as exc:
            raise RemoteProtocolError(f"{self.name} sent a bad {op.name} answer: {exc}") from None
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
        for its response frame; error frames raise."""
        proto = self._proto
        if proto.closed.is_set():
            raise proto.error or Unavailable(f"connection to {self.name} is closed")
        rid = next(self._ids)
        try:
            frame_out = encode_frame(op, rid, header, payload)
        except (TypeError, ValueError, OverflowError) as exc:  # msgpack refuses the header
            raise LocalProtocolError(f"cannot encode {op.name} request: {exc}") from None
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        proto.pending[rid] = fut
        if sink is not None:
            proto.sinks[rid] = sink
        proto.write(frame_out)
        try:
            if not proto._can_write.is_set():
                await proto.drain()
            async with asyncio.timeout(timeout_s or self.request_timeout_s):
                frame = await fut
        except TimeoutError:
            proto.pending.pop(rid, None)
            # the answer may still be arriving into a caller's buffer: stop the stream
            self.close()
            raise Timeout(f"{op.name} to {self.name} got no answer within "
                          f"{timeout_s or self.request_timeout_s}s") from None
        except BaseException:  # cancelled: the caller may reuse its buffers once this returns
            if sink is not None and rid not in proto.sinks:  # its answer is arriving into them
                proto.decoder.drop_payload(rid)
            raise
        finally:
            proto.pending.pop(rid, None)
            proto.sinks.pop(rid, None)
        if frame.is_error:
            raise from_wire(frame.header)
        return frame

    def close(self) -> None:
        if self._proto.transport is not None:
            self._proto.transport.close()

    async def wait_closed(self) -> None:
        await self._proto.closed.wait()
