"""The asyncio side of the wire: :class:`FrameProtocol`, the ``asyncio.BufferedProtocol``
base of client connections (``kvfs/transport.py``) and server connections
(``kvfs/server.py``) around the sans-IO :class:`kvfs.protocol.FrameDecoder` (the
handshake's MACs are in :mod:`kvfs.handshake`)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

from kvfs.errors import KVFSError, ProtocolError
from kvfs.protocol import Buffer, FrameDecoder, Limits, PayloadAllocator

log = logging.getLogger("kvfs.wire")

IOV_MAX = 1024  # buffers one vectored receive fills at most (Linux's limit)


class FrameProtocol(asyncio.BufferedProtocol):
    """Receives frames into a :class:`FrameDecoder`; subclasses handle them."""

    def __init__(self, limits: Limits | None = None, allocator: PayloadAllocator | None = None,
                 *, scratch_bytes: int = 256 * 1024):
        self.decoder = FrameDecoder(limits, allocator=allocator, scratch_bytes=scratch_bytes)
        # called once per receive (per destination part of a scattered read): no wrapper frame
        self.get_buffer = self.decoder.get_buffer  # type: ignore[method-assign]
        self.transport: asyncio.Transport | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.closed = asyncio.Event()
        self.holding = False  # frames already decoded wait in the decoder (backpressure)
        self._fd = -1  # the socket, for vectored receives (-1: none; TLS: never)

    # asyncio callbacks -----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=4 * 1024 * 1024)  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None:
            self._fd = sock.fileno()
            self.decoder.vectored = True

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.decoder.buffer_updated(nbytes)
            if self._fd >= 0:
                self._receive_parts()
        except ProtocolError as exc:
            self.deliver()  # the frames before the bad one still count
            self.protocol_failed(exc)
            return
        if self.decoder.has_events:  # not while a large payload is still arriving
            self.deliver()

    def _receive_parts(self) -> None:
        """A payload arriving into many buffers (e.g. an engine's per-layer regions of a
        page, one READV answer of many values) is received with vectored reads, up to
        :data:`IOV_MAX` buffers a call, straight into them, while the socket has bytes:
        the transport alone would ask the socket once per buffer.  Called between two of
        the transport's own receives, so nothing is read out of order; what is left when
        the socket runs dry (or fails) is the transport's to receive (or report)."""
        dec, fd, readv = self.decoder, self._fd, os.readv
        while views := dec.payload_views(IOV_MAX):
            try:
                n = readv(fd, views)
            except OSError:  # EAGAIN: the transport receives the rest once there is more
                return
            if not n:
                return
            dec.payload_updated(n)

    def deliver(self) -> None:
        """Hand decoded frames to :meth:`frame_received` until none is left or
        :attr:`holding` is set."""
        try:
            while not self.holding:
                ev = self.decoder.next_event()
                if not hasattr(ev, "op"):
                    break
                self.frame_received(ev)
        except ProtocolError:
            pass  # the decoder's error: buffer_updated reports it

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._can_write.set()
        self.closed.set()

    # for subclasses --------------------------------------------------------
    def frame_received(self, frame: object) -> None:
        raise NotImplementedError

    def protocol_failed(self, exc: KVFSError) -> None:
        log.warning("closing connection: %s", exc)
        if self.transport is not None:
            self.transport.close()

    def write(self, buffers: Sequence[Buffer]) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        if len(buffers) == 1:
            self.transport.write(buffers[0])
        else:
            self.transport.writelines(buffers)

    async def drain(self) -> None:
        await self._can_write.wait()
