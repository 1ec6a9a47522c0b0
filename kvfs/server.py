"""The asyncio RPC server shared by meta and chunkservers.

One protocol object per connection owning one :class:`FrameDecoder`; the
first frame must be AUTH (HMAC of the server's nonce with the cluster token).
Each request runs as its own task, so many are in flight per connection.  A
bad request gets an error frame and the server keeps serving; a frame that
breaks the protocol gets an error frame and closes that connection only.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

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
from kvfs.rpc import HANDLER_NAMES, RPCS, Op, Service

log = logging.getLogger("kvfs.server")

Reply = tuple[dict[str, Any], Sequence[Buffer]]
Handler = Callable[[dict[str, Any], memoryview], Awaitable[Reply]]


class RpcServer:
    """Serves ``handler.rpc_<name>(header, payload)`` coroutines for one service."""

    def __init__(self, handler: object, service: Service, token: str, limits: Limits | None = None):
        self.service = service
        self.token = token
        self.limits = limits or Limits()
        self.handlers: dict[int, Handler] = {}
        for op, name in HANDLER_NAMES.items():
            fn = getattr(handler, name, None)
            if fn is not None and RPCS[op].service in (service, Service.ANY):
                self.handlers[int(op)] = fn
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
        hello = {"version": PROTOCOL_VERSION, "nonce": self.nonce, "service": self.server.service.value}
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
        handler = self.server.handlers.get(frame.op)
        if handler is None:
            self._reply_error(frame, InvalidArgument(
                f"op {frame.op} is not served by the {self.server.service.value} service"))
            return
        task = asyncio.get_running_loop().create_task(self._run(handler, frame))
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
            mac = frame.header.get("mac")
            good = auth_mac(self.server.token, self.nonce)
            if not isinstance(mac, bytes) or not hmac.compare_digest(mac, good):
                err = AuthError("wrong cluster token (check KVFS_TOKEN or the token file)")
        if err is not None:
            log.warning("refusing connection from %s: %s", self._peer(), err)
            self._reply_error(frame, err)
            assert self.transport is not None
            self.transport.close()
            return
        self.authed = True
        self.write(encode_frame(frame.op, frame.request_id, {}, flags=Flag.RESPONSE))

    def _peer(self) -> str:
        return str(self.transport.get_extra_info("peername")) if self.transport else "?"

    def _reply_error(self, frame: Frame, err: KVFSError) -> None:
        self.write(encode_frame(frame.op, frame.request_id, err.to_wire(),
                                flags=Flag.RESPONSE | Flag.ERROR))

    async def _run(self, handler: Handler, frame: Frame) -> None:
        try:
            assert not isinstance(frame.payload, Scatter)  # servers use the default allocator
            header, payload = await handler(frame.header, memoryview(frame.payload))
        except KVFSError as exc:
            self._reply_error(frame, exc)
            return
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
            self._reply_error(frame, InvalidArgument(
                f"malformed {Op(frame.op).name} request: {type(exc).__name__}: {exc}"))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("%s failed", Op(frame.op).name)
            self._reply_error(frame, ServerError(f"{Op(frame.op).name} failed on the server: {exc}"))
            return
        try:
            reply = encode_frame(frame.op, frame.request_id, header, payload, flags=Flag.RESPONSE)
        except (TypeError, ValueError, OverflowError) as exc:  # e.g. a value msgpack cannot hold
            self._reply_error(frame, InvalidArgument(
                f"{Op(frame.op).name} request led to an answer that cannot be encoded: {exc}"))
            return
        self.server.requests_served += 1
        self.write(reply)
        if not self._can_write.is_set():
            await self.drain()
