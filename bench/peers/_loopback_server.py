"""Raw loopback transfer server for ``LoopbackLimit`` (stdlib + optional uvloop only).

Runnable as a script (``python _loopback_server.py``): binds 127.0.0.1:0,
prints ``PORT <n>`` on stdout, and serves until its stdin reaches EOF (so it
never outlives the parent that holds the pipe).

Wire, one request after another on a connection (answers come in order):

* ``b"G" + u64 n`` -> the server sends n bytes from a preallocated buffer.
* ``b"P" + u64 n`` + n bytes -> the server receives them into a preallocated
  buffer (and drops them), then sends ``u64 n`` as the ack.
"""

from __future__ import annotations

import asyncio
import collections
import os
import struct
import sys
from typing import Final, cast

HEADER: Final = struct.Struct(">cQ")
ACK: Final = struct.Struct(">Q")
OP_GET: Final = b"G"
OP_PUT: Final = b"P"
DEFAULT_BUFFER_BYTES: Final = 1048576
WRITE_HIGH_WATER: Final = 4 << 20


class LoopbackServerProtocol(asyncio.BufferedProtocol):
    """One connection. Receives headers and put payloads with no per-request allocation."""

    def __init__(self, payload: memoryview, sink: memoryview) -> None:
        self._payload = payload
        self._sink = sink
        self._header = bytearray(HEADER.size)
        self._hview = memoryview(self._header)
        self._hpos = 0
        self._body_left = 0
        self._body_total = 0
        self._sends: collections.deque[tuple[bool, int]] = collections.deque()
        self._paused = False
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = tr = cast(asyncio.Transport, transport)
        tr.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._sends.clear()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body_left:
            return self._sink[: min(self._body_left, len(self._sink))]
        return self._hview[self._hpos :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body_left:
            self._body_left -= nbytes
            if self._body_left == 0:
                self._sends.append((False, self._body_total))
                self._pump()
            return
        self._hpos += nbytes
        if self._hpos < HEADER.size:
            return
        self._hpos = 0
        op, n = HEADER.unpack(self._header)
        if op == OP_GET:
            self._sends.append((True, n))
            self._pump()
        elif op == OP_PUT:
            if n == 0:
                self._sends.append((False, 0))
                self._pump()
            else:
                self._body_left = self._body_total = n
        elif self._transport is not None:
            self._transport.close()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._pump()

    def _pump(self) -> None:
        tr = self._transport
        while self._sends and not self._paused and tr is not None:
            is_data, n = self._sends[0]
            if not is_data:
                self._sends.popleft()
                tr.write(ACK.pack(n))
                continue
            chunk = min(n, len(self._payload))
            if chunk:
                tr.write(self._payload[:chunk])
            if n - chunk:
                self._sends[0] = (True, n - chunk)
            else:
                self._sends.popleft()


class LoopbackServer:
    """Owns the preallocated buffers and the listening server."""

    def __init__(self, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self._payload = memoryview(bytes(b"\xa5" * buffer_bytes))
        self._sink = memoryview(bytearray(buffer_bytes))
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1") -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: LoopbackServerProtocol(self._payload, self._sink), host, 0
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            if sys.version_info >= (3, 12):
                self._server.close_clients()
            await self._server.wait_closed()
            self._server = None


async def _serve_until_stdin_eof() -> None:
    server = LoopbackServer()
    port = await server.start()
    loop = asyncio.get_running_loop()
    eof = asyncio.Event()

    def on_stdin() -> None:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(0)
            eof.set()

    loop.add_reader(0, on_stdin)
    sys.stdout.write(f"PORT {port}\n")
    sys.stdout.flush()
    try:
        await eof.wait()
    finally:
        await server.close()


def main() -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(_serve_until_stdin_eof())
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve_until_stdin_eof())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
