"""The raw loopback ceiling: the same bytes per batch over one TCP connection, no storage."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, cast

from ..store import PeerUnavailable
from ._loopback_server import ACK, HEADER, OP_GET, OP_PUT, LoopbackServer
from ._process import wait_or_kill

__all__ = ["LoopbackLimit"]


class _LoopbackClientProtocol(asyncio.BufferedProtocol):
    """Receives every answer straight into the buffer of the request at the head."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._pending: collections.deque[tuple[asyncio.Future[int], memoryview, list[int]]] = (
            collections.deque()
        )
        self._scratch = memoryview(bytearray(64 << 10))
        self._drained = asyncio.Event()
        self._drained.set()
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = tr = cast(asyncio.Transport, transport)
        tr.set_write_buffer_limits(high=4 << 20)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("loopback server closed the connection")
        while self._pending:
            fut, _, _ = self._pending.popleft()
            if not fut.done():
                fut.set_exception(self.lost)
        self._drained.set()

    def pause_writing(self) -> None:
        self._drained.clear()

    def resume_writing(self) -> None:
        self._drained.set()

    async def drained(self) -> None:
        await self._drained.wait()

    def expect(self, buf: memoryview) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if self.lost is not None:
            fut.set_exception(self.lost)
            return fut
        if len(buf) == 0:
            fut.set_result(0)
        else:
            self._pending.append((fut, buf, [0]))
        return fut

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._pending:
            _, buf, pos = self._pending[0]
            return buf[pos[0] :]
        return self._scratch  # bytes nobody asked for: protocol error, see buffer_updated

    def buffer_updated(self, nbytes: int) -> None:
        if not self._pending:
            if self.transport is not None:
                self.transport.close()
            return
        fut, buf, pos = self._pending[0]
        pos[0] += nbytes
        if pos[0] == len(buf):
            self._pending.popleft()
            if not fut.done():
                fut.set_result(len(buf))


class LoopbackLimit:
    """The raw loopback ceiling: the same bytes per batch, no storage behind them.

    ``get_many`` of B keys of S bytes is one request for B*S bytes that the
    server sends from a preallocated buffer and the client receives, with
    ``asyncio.BufferedProtocol``, into a preallocated ``bytearray``.
    ``put_many`` sends the B values (one vectored write) and waits for the
    server's ack after it has received them all. Requests are multiplexed on one
    connection, answered in order, so iodepth > 1 pipelines them.

    The payload is not round-tripped: ``put_many`` only remembers each key's
    length. ``get_many`` returns ``None`` for a key never put and, with
    ``copy_out=False`` (default, the true ceiling), one shared zero-filled
    ``bytes`` of the right length per key; ``copy_out=True`` returns each value
    as a fresh ``bytes`` copied out of the receive buffer (what a real client
    pays to hand out separate values).

    ``server="process"`` (default) runs the server in its own Python process,
    like Redis or a kvfs chunkserver; ``server="inprocess"`` puts it on the
    caller's event loop (no subprocess; both ends then share one core).
    """

    def __init__(
        self,
        *,
        server: Literal["process", "inprocess"] = "process",
        copy_out: bool = False,
        start_timeout_s: float = 10.0,
    ) -> None:
        """Configure only; ``start()`` connects (or use ``LoopbackLimit.open``)."""
        self.name = "loopback"
        self.server = server
        self.copy_out = copy_out
        self.start_timeout_s = start_timeout_s
        self.bytes_sent = 0
        self.bytes_received = 0
        self._sizes: dict[bytes, int] = {}
        self._zeros: dict[int, bytes] = {}
        self._free: list[bytearray] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._server: LoopbackServer | None = None
        self._proto: _LoopbackClientProtocol | None = None

    @classmethod
    async def open(
        cls,
        *,
        server: Literal["process", "inprocess"] = "process",
        copy_out: bool = False,
        start_timeout_s: float = 10.0,
    ) -> LoopbackLimit:
        limit = cls(server=server, copy_out=copy_out, start_timeout_s=start_timeout_s)
        await limit.start()
        return limit

    async def start(self) -> LoopbackLimit:
        if self._proto is not None or self._proc is not None or self._server is not None:
            raise RuntimeError("LoopbackLimit already started")
        try:
            if self.server == "inprocess":
                self._server = LoopbackServer()
                port = await self._server.start()
            else:
                port = await self._spawn(self.start_timeout_s)
            loop = asyncio.get_running_loop()
            _, proto = await loop.create_connection(_LoopbackClientProtocol, "127.0.0.1", port)
            self._proto = proto
        except BaseException:
            await self.close()
            raise
        return self

    async def _spawn(self, timeout_s: float) -> int:
        script = Path(__file__).with_name("_loopback_server.py")
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), timeout_s)
        except TimeoutError:
            raise PeerUnavailable(f"loopback server did not start within {timeout_s:g}s") from None
        if not line.startswith(b"PORT "):
            # The child died before binding: nothing more to wait for.
            raise PeerUnavailable(f"loopback server failed to start: {line!r}")
        return int(line.split()[1])

    def pids(self) -> dict[str, int]:
        """The server process, for ``--cpu``."""
        return {"loopback-server": self._proc.pid} if self._proc is not None else {}

    def _buffer(self, n: int) -> bytearray:
        for i, buf in enumerate(self._free):
            if len(buf) >= n:
                return self._free.pop(i)
        return bytearray(n)

    def _conn(self) -> _LoopbackClientProtocol:
        proto = self._proto
        if proto is None or proto.transport is None:
            raise RuntimeError("LoopbackLimit is closed")
        if proto.lost is not None:
            raise proto.lost
        return proto

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        proto = self._conn()
        assert proto.transport is not None
        total = sum(len(v) for _, v in items)
        ack = proto.expect(memoryview(bytearray(ACK.size)))
        proto.transport.writelines([HEADER.pack(OP_PUT, total), *(v for _, v in items)])
        self.bytes_sent += total
        await proto.drained()
        await ack
        for k, v in items:
            self._sizes[k] = len(v)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        proto = self._conn()
        assert proto.transport is not None
        sizes = [self._sizes.get(k) for k in keys]
        total = sum(s for s in sizes if s is not None)
        buf = self._buffer(total)
        try:
            if total:
                done = proto.expect(memoryview(buf)[:total])
                proto.transport.write(HEADER.pack(OP_GET, total))
                received = await done  # not `+= await`: that reads the counter before awaiting
                self.bytes_received += received
            out: list[bytes | None] = []
            if self.copy_out:
                view = memoryview(buf)
                pos = 0
                for s in sizes:
                    if s is None:
                        out.append(None)
                    else:
                        out.append(bytes(view[pos : pos + s]))
                        pos += s
                view.release()
            else:
                for s in sizes:
                    out.append(None if s is None else self._zero(s))
            return out
        finally:
            self._free.append(buf)

    async def get_into(self, keys: list[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """The limit for reads into caller buffers: one request, received into each buffer in turn."""
        proto = self._conn()
        assert proto.transport is not None
        sizes = [self._sizes.get(k, -1) for k in keys]
        dests = [b[:s] for b, s in zip(buffers, sizes, strict=True) if s > 0]
        total = sum(len(d) for d in dests)
        if total:
            done = [proto.expect(d) for d in dests]
            proto.transport.write(HEADER.pack(OP_GET, total))
            self.bytes_received += sum(await asyncio.gather(*done))
        return sizes

    def _zero(self, n: int) -> bytes:
        z = self._zeros.get(n)
        if z is None:
            z = self._zeros[n] = bytes(n)
        return z

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()
        server, self._server = self._server, None
        if server is not None:
            await server.close()
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
                with contextlib.suppress(ConnectionError):
                    await proc.stdin.wait_closed()
            await wait_or_kill(proc, 5.0)
            if proc.stdout is not None:
                await proc.stdout.read()
