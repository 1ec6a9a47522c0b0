"""The asyncio RPC server shared by meta and chunkservers.

One protocol object per connection owning one :class:`FrameDecoder`; the
first frame must be AUTH (:mod:`kvfs.handshake`: the token's role, both sides
proven, bound to the connection); each op then needs a role the RPC table grants.
Each request is decoded and checked against its type in :data:`kvfs.rpc.RPCS`
before dispatch: a bad request gets ``InvalidArgument`` naming the field and
the server keeps serving.  It then runs as its own task, so many are in flight
per connection, unless its handler answers at once (a plain function that returns
its answer rather than an awaitable: written from the receive callback, no task)
while the connection can take it; an exception other than a :class:`KVFSError`
inside a handler is a server bug and answers ``ServerError``, never "bad input".  A frame that
breaks the protocol gets an error frame and closes that connection only.  Every
close the server starts flushes for at most ``send_timeout_s``, then aborts.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, cast

import msgspec

from kvfs.config import ServerConfig
from kvfs.errors import (
    AuthError,
    InvalidArgument,
    KVFSError,
    LocalProtocolError,
    ServerError,
    Timeout,
    Unavailable,
    VersionMismatch,
)
from kvfs.fileparts import FileParts, ShortFile
from kvfs.frame_protocol import FrameProtocol
from kvfs.handshake import Role, endpoint, new_nonce, server_check
from kvfs.protocol import (
    FIXED,
    FIXED_SIZE,
    PROTOCOL_VERSION,
    Buffer,
    Flag,
    Frame,
    Limits,
    ReceivePool,
    Scatter,
    encode_frame,
    header_key,
)
from kvfs.ratelog import RateLimitedLog
from kvfs.rpc import REQUESTS, RPCS, Auth, Hello, Op, Request, Response, Service, decode, message
from kvfs.tls import server_context, server_options

log = logging.getLogger("kvfs.server")

# an answer's header and payload: buffers, or file bytes to ``sendfile`` (plain TCP; a
# handler gives them only where reading them in the event loop would do: never over TLS)
Reply = tuple[Response, Sequence[Buffer] | FileParts]
# an ``async def`` handler, or a plain one that returns its answer where it has it at once
# (no await: the server writes it without a task) and an awaitable of it where not
Handler = Callable[[Any, memoryview], Awaitable[Reply] | Reply]
# the roles that may call each op, by the op's number as frames carry it (looked up for every
# request: no ``Op(...)`` enum lookup on the way)
_ROLES = {int(op): rpc.roles for op, rpc in RPCS.items()}


def _frame_bytes(frame: Sequence[Buffer]) -> int:
    """An encoded frame's size: its head (fixed part and header) and the payload it announces."""
    return len(frame[0]) + FIXED.unpack_from(frame[0])[-1]


async def reply_of(got: Reply | Awaitable[Reply]) -> Reply:
    """A handler's answer: ``got`` itself, or what it gives once awaited."""
    return got if type(got) is tuple else await cast("Awaitable[Reply]", got)


class RpcServer:
    """Serves ``handler.rpc_<name>(request, payload)`` coroutines for one service; each
    handler object may serve part of the service's RPCs (e.g. meta's GC component).

    ``handler.reply_cost(op, request)``, when defined, says how many reply bytes a
    request will produce; they count against ``max_inflight_bytes`` before it runs.
    """

    def __init__(self, handlers: object | Sequence[object], service: Service,
                 tokens: Mapping[Role, str], config: ServerConfig | None = None):
        self.service = service
        self.tokens = dict(tokens)
        self.config = config = config or ServerConfig()
        self.limits = Limits(max_header_bytes=config.max_header_bytes,
                             max_payload_bytes=config.max_payload_bytes)
        self.handshake_limits = Limits(max_header_bytes=config.max_handshake_bytes - FIXED_SIZE,
                                       max_payload_bytes=0, ops=frozenset({int(Op.AUTH)}))
        self.handlers: dict[int, tuple[Handler, type[Request[Any]]]] = {}
        objs = handlers if isinstance(handlers, (list, tuple)) else [handlers]
        self.reply_cost: Callable[[int, Any], int] | None = None
        for obj in objs:
            self.reply_cost = self.reply_cost or getattr(obj, "reply_cost", None)
        for op, rpc in RPCS.items():
            if rpc.service not in (service, Service.ANY):
                continue
            for obj in objs:
                fn = getattr(obj, rpc.handler, None)
                if fn is not None:
                    self.handlers[int(op)] = (fn, rpc.request)
        # the requests of the ops served, decoded straight into their types (kvfs.rpc.REQUESTS)
        keys = [header_key(op, Flag.NONE) for op in self.handlers]
        self.typed = {k: REQUESTS[k] for k in keys if k in REQUESTS}
        self.peer_log = RateLimitedLog(log, config.bad_request_log_interval_s, held="from this host")
        # request payloads past the decoder's inline 64 KiB land in reused buffers, shared by
        # every connection: a fresh one costs zeroing and a page fault per 4 KiB, about 4 us
        # per key of a 4 KiB x 128 APPEND (bench/RESULTS.md, "per-key CPU at 4 KiB")
        self.receive_pool = ReceivePool(config.receive_pool_bytes, min_bytes=0)
        self.tls = server_context(config, f"{service.value} server")  # None: plaintext
        self._server: asyncio.base_events.Server | None = None
        self.connections: set[_ServerProtocol] = set()
        self.host = ""
        self.port = 0
        self.requests_served = 0
        self.refused_connections = 0

    async def start(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerProtocol(self), host, port,
            **server_options(self.tls, self.config.handshake_timeout_s))
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
            conn.close_bounded()
        if self._server is not None:
            await self._server.wait_closed()


class _ServerProtocol(FrameProtocol):
    """One connection.  Before AUTH only a handshake frame of ``max_handshake_bytes`` is
    accepted and the decoder's buffer stays that small; ``handshake_timeout_s`` closes a
    connection that did not authenticate, ``idle_timeout_s`` one that went quiet.
    Requests and reply bytes in flight are counted; past a limit reading pauses (and
    frames already decoded wait) until replies drain."""

    def __init__(self, server: RpcServer) -> None:
        cfg = server.config
        super().__init__(server.handshake_limits, server.receive_pool,
                         scratch_bytes=cfg.max_handshake_bytes, typed=server.typed)
        self.server = server
        self.nonce = new_nonce()
        self.authed = False
        self.role: Role | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.inflight_requests = 0
        self.inflight_bytes = 0
        self.peak_inflight_requests = 0
        self.peak_inflight_bytes = 0
        self._loop = asyncio.get_running_loop()
        self._last_rx = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._accepted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server = self.server
        if len(server.connections) >= server.config.max_connections:
            server.refused_connections += 1
            server.peer_log.warning(self._host(), "refusing a connection from %s: %d connections "
                                    "open (max_connections)", self._peer(), len(server.connections))
            self.write(encode_frame(0, 0, Unavailable(
                f"server has {len(server.connections)} connections open (max_connections); "
                "try again later").to_wire(), flags=Flag.RESPONSE | Flag.ERROR))
            self.close_bounded()
            return
        self._accepted = True
        server.connections.add(self)
        self._timer = self._loop.call_later(server.config.handshake_timeout_s, self._expired)
        hello = Hello(version=PROTOCOL_VERSION, nonce=self.nonce, service=server.service.value)
        self.write(encode_frame(Op.HELLO, 0, hello))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()

    def buffer_updated(self, nbytes: int) -> None:
        self._last_rx = self._loop.time()
        super().buffer_updated(nbytes)

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._accepted:  # refused at accept: read nothing into memory
            return memoryview(bytearray(64))
        return super().get_buffer(sizehint)

    def _expired(self) -> None:
        """The handshake or idle timer fired."""
        self._timer = None
        cfg = self.server.config
        if not self.authed:
            self.server.peer_log.warning(self._host(), "closing %s: no AUTH within %ss "
                                         "(handshake_timeout_s)", self._peer(),
                                         cfg.handshake_timeout_s)
            self._close_with(Timeout(f"no AUTH within {cfg.handshake_timeout_s}s"))
            return
        quiet = self._loop.time() - self._last_rx
        if self.inflight_requests == 0 and quiet >= cfg.idle_timeout_s:
            log.debug("closing %s: idle for %.0fs", self._peer(), quiet)
            self._close_with(Unavailable(f"connection idle for {cfg.idle_timeout_s}s; closed"))
            return
        wait = max(cfg.idle_timeout_s - quiet, cfg.idle_timeout_s / 8)
        self._timer = self._loop.call_later(wait, self._expired)

    def _close_with(self, err: KVFSError) -> None:
        """A connection-level error frame, then abort (never wait on a peer that does not
        read)."""
        if self.transport is None or self.transport.is_closing():
            return
        self.write(encode_frame(0, 0, err.to_wire(), flags=Flag.RESPONSE | Flag.ERROR))
        self.transport.abort()

    def close_bounded(self) -> None:
        """Close, letting what is buffered (an error frame, answers) flush for at most
        ``send_timeout_s``, then abort: a close alone waits for ever on a peer that reads
        nothing, holding the connection, its buffer and its slot in ``max_connections``."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.close()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(self.server.config.send_timeout_s, transport.abort)

    def protocol_failed(self, exc: KVFSError) -> None:
        self.server.peer_log.warning(self._host(), "closing connection from %s: %s",
                                     self._peer(), exc)
        if self.transport is not None and not self.transport.is_closing():
            self.write(encode_frame(0, 0, exc.to_wire(), flags=Flag.RESPONSE | Flag.ERROR))
            self.close_bounded()

    def frame_received(self, frame: object) -> None:
        assert isinstance(frame, Frame)
        if not self.authed:
            self._authenticate(frame)
            return
        entry = self.server.handlers.get(frame.op)
        if entry is None:
            self._bad_request(frame, InvalidArgument(
                f"op {frame.op} is not served by the {self.server.service.value} service"))
            return
        roles = _ROLES[frame.op]
        if self.role not in roles:
            assert self.role is not None
            self._bad_request(frame, AuthError(
                f"this token may not call {Op(frame.op).name}: it needs the "
                f"{' or '.join(r.value for r in roles)} token, this connection authenticated "
                f"with the {self.role.value} token"))
            return
        handler, typ = entry
        try:
            request = message(frame, typ)
        except msgspec.ValidationError as exc:
            self._bad_request(frame, InvalidArgument(f"bad {Op(frame.op).name} request: {exc}"))
            return
        cost = len(frame.payload)
        if self.server.reply_cost is not None:
            try:
                cost += self.server.reply_cost(frame.op, request)
            except KVFSError as exc:  # e.g. READV past max_ranges: refused before it runs
                self._bad_request(frame, exc)
                return
        assert not isinstance(frame.payload, Scatter)  # servers receive into one buffer
        try:
            got = handler(request, memoryview(frame.payload))
            if type(got) is tuple:
                header, payload = got
                if not isinstance(payload, FileParts) and self.writable():
                    self._write_now(frame, header, payload, cost)  # answered at once: no task
                    return
        except Exception as exc:  # raised before any await: answered as in _serve
            self._failed(frame, exc)
            self.server.receive_pool.give(frame.payload)
            return
        self.inflight_requests += 1
        self.inflight_bytes += cost
        self._check_backpressure()
        self._start(self._run(got, frame, cost), got)

    def _start(self, coro: Coroutine[Any, Any, None], got: object = None) -> None:
        task = self._loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(functools.partial(self._ended, got))

    def _ended(self, got: object, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled() and inspect.iscoroutine(got):
            got.close()  # cancelled before it began: ``got`` never awaited (no warning)

    def _write_now(self, frame: Frame, header: Response, payload: Sequence[Buffer], cost: int) -> None:
        """An answer a handler had at once, written now (the connection can take it): the
        request was never in flight, unless the write leaves the transport past its
        high-water mark, where it is held (counted) until there is room, as in :meth:`_serve`."""
        reply = encode_frame(frame.op, frame.request_id, header, payload, flags=Flag.RESPONSE)
        self.server.requests_served += 1
        size = _frame_bytes(reply)
        self.write(reply, size)
        if self.writable():
            self.server.receive_pool.give(frame.payload)
            return
        self.inflight_requests += 1
        self.inflight_bytes += max(size, cost)
        self._check_backpressure()
        self._start(self._until_room(frame, max(size, cost)))

    async def _until_room(self, frame: Frame, charged: int) -> None:
        try:
            await self._room()
        finally:
            self._release(frame, charged)

    def _check_backpressure(self) -> None:
        cfg = self.server.config
        self.peak_inflight_requests = max(self.peak_inflight_requests, self.inflight_requests)
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, self.inflight_bytes)
        full = (self.inflight_requests >= cfg.max_inflight_requests
                or self.inflight_bytes >= cfg.max_inflight_bytes)
        transport = self.transport
        if transport is None or full == self.holding:
            return
        self.holding = full
        if transport.is_closing():
            return
        if full:
            transport.pause_reading()
        else:
            transport.resume_reading()
            self.deliver()

    def _authenticate(self, frame: Frame) -> None:
        err: KVFSError | None = None
        reply: dict[str, Any] = {}
        if frame.op != Op.AUTH:
            err = LocalProtocolError(f"expected AUTH as the first frame, got op {frame.op}")
        elif frame.header.get("version") != PROTOCOL_VERSION:
            err = VersionMismatch(
                f"client speaks protocol version {frame.header.get('version')!r}; "
                f"this server speaks {PROTOCOL_VERSION}")
        else:
            assert self.transport is not None
            try:
                decode(frame.header, Auth)
                self.role, reply = server_check(
                    self.server.tokens, self.nonce, self.server.service.value, frame.header,
                    local=endpoint(self.transport.get_extra_info("sockname")),
                    peer=endpoint(self.transport.get_extra_info("peername")),
                    bind_addresses=self.server.config.bind_auth_to_addresses)
            except msgspec.ValidationError as exc:
                err = InvalidArgument(f"bad AUTH request: {exc}")
            except KVFSError as exc:
                err = exc
        if err is not None:
            self.server.peer_log.warning(self._host(), "refusing connection from %s: %s",
                                         self._peer(), err)
            self._reply_error(frame, err)
            self.close_bounded()
            return
        self.authed = True
        self.decoder.set_limits(self.server.limits, scratch_bytes=256 * 1024)
        reply |= {"max_header": self.server.limits.max_header_bytes,
                  "max_payload": self.server.limits.max_payload_bytes}
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(self.server.config.idle_timeout_s, self._expired)
        self.write(encode_frame(frame.op, frame.request_id, reply, flags=Flag.RESPONSE))

    def _peer(self) -> str:
        return str(self.transport.get_extra_info("peername")) if self.transport else "?"

    def _host(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return str(peer[0]) if isinstance(peer, tuple) else str(peer)

    def _reply_error(self, frame: Frame, err: KVFSError) -> None:
        self.write(encode_frame(frame.op, frame.request_id, err.to_wire(),
                                flags=Flag.RESPONSE | Flag.ERROR))

    async def _run(self, got: Reply | Awaitable[Reply], frame: Frame, charged: int) -> None:
        try:
            charged = await self._serve(got, frame, charged)
        finally:
            self._release(frame, charged)

    def _release(self, frame: Frame, charged: int) -> None:
        """A request in flight is done: its payload buffer back, its counts off."""
        self.server.receive_pool.give(frame.payload)
        self.inflight_requests -= 1
        self.inflight_bytes -= charged
        self._check_backpressure()

    def _failed(self, frame: Frame, exc: Exception) -> None:
        """The answer to a handler that raised ``exc``."""
        name = Op(frame.op).name
        if isinstance(exc, ShortFile):  # a chunk file shrank under the read: nothing sent yet
            self._bad_request(frame, Unavailable(f"{name} failed on the server: {exc}"))
        elif isinstance(exc, KVFSError):
            self._bad_request(frame, exc)
        else:  # a bug in the handler: never relabelled as bad input
            log.error("%s failed", name, exc_info=exc)
            self._reply_error(frame, ServerError(f"{name} failed on the server: {type(exc).__name__}: {exc}"))

    async def _serve(self, got: Reply | Awaitable[Reply], frame: Frame, charged: int) -> int:
        """Waits for a request's answer (``got``: the handler's) and writes it once the
        transport can take it; returns the bytes charged to this request (grown to the
        answer's real size)."""
        files: FileParts | None = None
        try:
            try:
                header, payload = await reply_of(got)
                if isinstance(payload, FileParts):
                    files, payload = payload, ()
                    if not self.can_send_files:  # no plain socket (TLS): read them here
                        payload = [files.read()]
                        files.close()
                        files = None
                reply = encode_frame(frame.op, frame.request_id, header, payload, flags=Flag.RESPONSE,
                                     payload_bytes=None if files is None else files.nbytes)
            except Exception as exc:  # (not CancelledError: a BaseException)
                self._failed(frame, exc)
                return charged
            size = _frame_bytes(reply)
            if size > charged:
                self.inflight_bytes += size - charged
                charged = size
                self._check_backpressure()
            self.server.requests_served += 1
            await self._room()  # answers wait here, counted, not in an unbounded write buffer
            if files is not None:
                await self._send_files(bytes(reply[0]), files)
                return charged
            self.write(reply)
            await self._room()
            return charged
        finally:
            if files is not None:
                files.close()

    async def _send_files(self, prefix: bytes, files: FileParts) -> None:
        """An answer whose payload is chunk-file bytes, ``sendfile``d into the socket
        (:meth:`FrameProtocol.send_file`).  Once it began, a frame cut short cannot be
        finished or taken back: any failure aborts the connection (its peer's calls fail as
        from a lost server and go to other replicas; never wrong or misframed bytes)."""
        timeout_s = self.server.config.send_timeout_s
        try:
            await self.send_file(prefix, files, timeout_s)
            return
        except TimeoutError:
            log.info("aborting the connection from %s: it read none of its answers for %ss "
                     "(send_timeout_s)", self._peer(), timeout_s)
        except ShortFile as exc:
            log.warning("aborting the connection from %s: a chunk file shrank while its bytes "
                        "were sent (%s)", self._peer(), exc)
        except OSError as exc:  # the peer went away
            log.debug("aborting the connection from %s: %s", self._peer(), exc)
        except asyncio.CancelledError:
            self._abort()
            raise
        self._abort()

    def _abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    async def _room(self) -> None:
        """Wait until the transport can take more, at most ``send_timeout_s``: a peer that
        stops reading its answers would otherwise hold this request (its count, its answer)
        for ever, and the idle timer never fires while requests are in flight.  On expiry the
        connection is aborted (unsent bytes dropped), which lets every waiting answer end.
        A ``sendfile`` running on the connection is waited for without that bound: it has
        its own, for each wait of it for the peer to read."""
        while not self.writable():
            if self._raw:
                await self._raw_idle.wait()
                continue
            timeout_s = self.server.config.send_timeout_s
            try:
                async with asyncio.timeout(timeout_s):
                    await self._can_write.wait()
            except TimeoutError:
                if self.transport is not None and not self.transport.is_closing():
                    log.info("aborting the connection from %s: it read none of its answers for %ss "
                             "(send_timeout_s)", self._peer(), timeout_s)
                    self.transport.abort()
                return

    def _bad_request(self, frame: Frame, err: KVFSError) -> None:
        if isinstance(err, (InvalidArgument, AuthError)):
            self.server.peer_log.warning(self._host(), "bad %s request from %s: %s",
                                         Op(frame.op).name if frame.op in Op._value2member_map_
                                         else frame.op, self._peer(), err)
        self._reply_error(frame, err)
