"""The asyncio side of the wire: :class:`FrameProtocol`, the ``asyncio.BufferedProtocol``
base of client connections (``kvfs/transport.py``) and server connections
(``kvfs/server.py``) around the sans-IO :class:`kvfs.protocol.FrameDecoder` (the
handshake's MACs are in :mod:`kvfs.handshake`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvfs.errors import KVFSError, ProtocolError
from kvfs.protocol import Buffer, FrameDecoder, Limits, PayloadAllocator

log = logging.getLogger("kvfs.wire")


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

    # asyncio callbacks -----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=4 * 1024 * 1024)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
            self.deliver()  # the frames before the bad one still count
            self.protocol_failed(exc)
            return
        if self.decoder.has_events:  # not while a large payload is still arriving
            self.deliver()

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
