"""The asyncio RPC server shared by meta and chunkservers.

One protocol object per connection owning one :class:`FrameDecoder`; the
first frame must be AUTH (HMAC of the server's nonce with the cluster token).
Each request is decoded and checked against its type in :data:`kvfs.rpc.RPCS`
before dispatch: a bad request gets ``InvalidArgument`` naming the field and
the server keeps serving.  It then runs as its own task, so many are in flight
per connection; an exception other than a :class:`KVFSError` inside a handler
is a server bug and answers ``ServerError``, never "bad input".  A frame that
breaks the protocol gets an error frame and closes that connection only.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from kvfs.errors import (
    AuthError,
    InvalidArgument,
    KVFSError,
    LocalProtocolError,
    ServerError,
    VersionMismatch,
)
from kvfs.frame_protocol import FrameProtocol, auth_mac
from kvfs.protocol import PROTOCOL_VERSION, Buffer, Flag, Frame, Limits, Scatter, encode_frame
from kvfs.rpc import RPCS, Auth, Empty, Hello, Op, Request, Response, Service, decode

log = logging.getLogger("kvfs.server")

Reply = tuple[Response, Sequence[Buffer]]
Handler = Callable[[Any, memoryview], Awaitable[Reply]]


class RpcServer:
    """Serves ``handler.rpc_<name>(request, payload)`` coroutines for one service; each
    handler object may serve part of the service's RPCs (e.g. meta's GC component)."""

    def __init__(self, handlers: object | Sequence[object], service: Service, token: str,
                 limits: Limits | None = None):
        self.service = service
        self.token = token
        self.limits = limits or Limits()
        self.handlers: dict[int, tuple[Handler, type[Request[Any]]]] = {}
        objs = handlers if isinstance(handlers, (list, tuple)) else [handlers]
        for op, rpc in RPCS.items():
            if rpc.service not in (service, Service.ANY):
                continue
            for obj in objs:
                fn = getattr(obj, rpc.handler, None)
                if fn is not None:
                    self.handlers[int(op)] = (fn, rpc.request)
        self._server: asyncio.base_events.Server | None = None
        self.connections: set[_ServerProtocol] = set()
        self.host = ""
        self.port = 0
        self.requests_served = 0

    async def start(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerProtocol(self), host, port)
        sock = self._server.sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        return self.host, self.port

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening, let in-flight requests finish up to ``grace_s``, then cut."""
        if self._server is not None:
            self._server.close()
        tasks = [t for c in self.connections for t in c.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for conn in list(self.connections):
            for t in conn.tasks:
                t.cancel()
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()


class _ServerProtocol(FrameProtocol):
    def __init__(self, server: RpcServer) -> None:
        super().__init__(server.limits)
        self.server = server
        self.nonce = os.urandom(16)
        self.authed = False
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)
        hello = Hello(version=PROTOCOL_VERSION, nonce=self.nonce, service=self.server.service.value)
        self.write(encode_frame(Op.HELLO, 0, hello))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.server.connections.discard(self)

    def protocol_failed(self, exc: KVFSError) -> None:
        self.write(encode_frame(0, 0, exc.to_wire(), flags=Flag.RESPONSE | Flag.ERROR))
        super().protocol_failed(exc)

    def frame_received(self, frame: object) -> None:
        assert isinstance(frame, Frame)
        if not self.authed:
            self._authenticate(frame)
            return
        entry = self.server.handlers.get(frame.op)
        if entry is None:
            self._reply_error(frame, InvalidArgument(
                f"op {frame.op} is not served by the {self.server.service.value} service"))
            return
        handler, typ = entry
        try:
            request = decode(frame.header, typ)
        except msgspec.ValidationError as exc:
            self._reply_error(frame, InvalidArgument(f"bad {Op(frame.op).name} request: {exc}"))
            return
        task = asyncio.get_running_loop().create_task(self._run(handler, request, frame))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _authenticate(self, frame: Frame) -> None:
        err: KVFSError | None = None
        if frame.op != Op.AUTH:
            err = LocalProtocolError(f"expected AUTH as the first frame, got op {frame.op}")
        elif frame.header.get("version") != PROTOCOL_VERSION:
            err = VersionMismatch(
                f"client speaks protocol version {frame.header.get('version')!r}; "
                f"this server speaks {PROTOCOL_VERSION}")
        else:
            try:
                mac = decode(frame.header, Auth).mac
            except msgspec.ValidationError as exc:
                mac = b""
                err = InvalidArgument(f"bad AUTH request: {exc}")
            good = auth_mac(self.server.token, self.nonce)
            if err is None and not hmac.compare_digest(mac, good):
                err = AuthError("wrong cluster token (check KVFS_TOKEN or the token file)")
        if err is not None:
            log.warning("refusing connection from %s: %s", self._peer(), err)
            self._reply_error(frame, err)
            assert self.transport is not None
            self.transport.close()
            return
        self.authed = True
        self.write(encode_frame(frame.op, frame.request_id, Empty(), flags=Flag.RESPONSE))

    def _peer(self) -> str:
        return str(self.transport.get_extra_info("peername")) if self.transport else "?"

    def _reply_error(self, frame: Frame, err: KVFSError) -> None:
        self.write(encode_frame(frame.op, frame.request_id, err.to_wire(),
                                flags=Flag.RESPONSE | Flag.ERROR))

    async def _run(self, handler: Handler, request: Request[Any], frame: Frame) -> None:
        name = Op(frame.op).name
        try:
            assert not isinstance(frame.payload, Scatter)  # servers use the default allocator
            header, payload = await handler(request, memoryview(frame.payload))
            reply = encode_frame(frame.op, frame.request_id, header, payload, flags=Flag.RESPONSE)
        except KVFSError as exc:
            self._reply_error(frame, exc)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the handler: never relabelled as bad input
            log.exception("%s failed", name)
            self._reply_error(frame, ServerError(f"{name} failed on the server: {type(exc).__name__}: {exc}"))
            return
        self.server.requests_served += 1
        self.write(reply)
        if not self._can_write.is_set():
            await self.drain()
