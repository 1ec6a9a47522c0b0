"""The asyncio side of the wire: :class:`FrameProtocol`, the ``asyncio.BufferedProtocol``
base of client connections (``kvfs/transport.py``) and server connections
(``kvfs/server.py``) around the sans-IO :class:`kvfs.protocol.FrameDecoder` (the
handshake's MACs are in :mod:`kvfs.handshake`), and its two ways past the transport's
writes: :meth:`FrameProtocol.send_file`, a frame whose payload is ``sendfile``d, and a
frame of many buffers written by one ``os.writev`` while the transport holds nothing
(:meth:`FrameProtocol.write` given its size)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping, Sequence

from kvfs.errors import KVFSError, ProtocolError
from kvfs.fileparts import FileParts
from kvfs.protocol import Buffer, FrameDecoder, HeaderDecode, Limits, PayloadAllocator

log = logging.getLogger("kvfs.wire")

IOV_MAX = 1024  # buffers one vectored receive fills, or one writev sends, at most (Linux's limit)
WRITE_HIGH = 4 * 1024 * 1024  # the transport's write buffer: pause_writing past it


def _cork(fd: int, on: int) -> None:
    """TCP_CORK on (1) or off (0, which sends what it held): while a sendfile answer is
    written, the kernel sends only full segments (the prefix rides with the first bytes,
    many small ranges do not each push one out), so the reader is woken less often (its CPU
    per GB at 64 KiB ranges: bench/RESULTS.md)."""
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, on)
    finally:
        sock.detach()


class FrameProtocol(asyncio.BufferedProtocol):
    """Receives frames into a :class:`FrameDecoder`; subclasses handle them."""

    def __init__(self, limits: Limits | None = None, allocator: PayloadAllocator | None = None,
                 *, scratch_bytes: int = 256 * 1024, typed: Mapping[int, HeaderDecode] | None = None):
        self.decoder = FrameDecoder(limits, allocator=allocator, scratch_bytes=scratch_bytes,
                                    typed=typed)
        # called once per receive (per destination part of a scattered read): no wrapper frame
        self.get_buffer = self.decoder.get_buffer  # type: ignore[method-assign]
        self.transport: asyncio.Transport | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.closed = asyncio.Event()
        self.holding = False  # frames already decoded wait in the decoder (backpressure)
        self._fd = -1  # the socket, for vectored receives and send_file (-1: none; TLS: never)
        # send_file: one at a time; while one runs the transport is not written (``write``
        # holds frames in _held, sent after it, in order; ``drain`` waits for its end)
        self._file_lock = asyncio.Lock()
        self._raw = False
        self._raw_idle = asyncio.Event()
        self._raw_idle.set()
        self._held: list[Buffer] = []
        self._raw_wait: asyncio.Future[None] | None = None  # send_file waiting for room

    # asyncio callbacks -----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=WRITE_HIGH)  # type: ignore[attr-defined]
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
        self._wake_raw(ConnectionResetError("the connection closed during a sendfile"))

    # for subclasses --------------------------------------------------------
    def frame_received(self, frame: object) -> None:
        raise NotImplementedError

    def protocol_failed(self, exc: KVFSError) -> None:
        """The peer broke the protocol: nothing more can be decoded, so nothing buffered for
        it is worth sending; abort (a close waits for ever to flush to a peer that stops
        reading).  The server overrides this to send an error frame first (a bounded close)."""
        log.warning("aborting connection: %s", exc)
        if self.transport is not None:
            self.transport.abort()

    def write(self, buffers: Sequence[Buffer], nbytes: int = -1) -> None:
        """``nbytes``, where the caller knows it: the buffers' total, which lets one of
        many buffers be written straight into the socket (:meth:`_writev`)."""
        transport = self.transport
        assert transport is not None
        if transport.is_closing():
            return
        if self._raw:  # a send_file is writing the socket: this frame goes after it
            self._held.extend(buffers)
        elif len(buffers) == 1:
            transport.write(buffers[0])
        elif (nbytes < 0 or self._fd < 0 or len(buffers) > IOV_MAX
              or transport.get_write_buffer_size()):
            transport.writelines(buffers)
        else:
            self._writev(buffers, nbytes)

    def _writev(self, buffers: Sequence[Buffer], nbytes: int) -> None:
        """``buffers`` (``nbytes`` in all) written into the socket by one ``writev`` of our
        own, the transport holding nothing (so nothing goes out of order): the transport's
        ``writelines`` costs ~4 us more for 44 buffers (bench/RESULTS.md, issue 11).  What the
        socket does not take, or all of it after an error, goes to the transport, which
        sends it once there is room, or reports the error (closing the connection)."""
        try:
            sent = os.writev(self._fd, buffers)
        except OSError:  # EAGAIN: nothing taken; any other error: the transport's to report
            sent = 0
        if sent >= nbytes:
            return
        rest = list(buffers)
        while sent:
            first = memoryview(rest[0])
            if first.nbytes > sent:
                rest[0] = first[sent:]
                break
            sent -= first.nbytes
            del rest[0]
        assert self.transport is not None
        self.transport.writelines(rest)

    def writable(self) -> bool:
        """Whether a frame written now goes out without waiting: the transport below its
        high-water mark and no :meth:`send_file` running."""
        return self._can_write.is_set() and not self._raw

    async def drain(self) -> None:
        """Wait until :meth:`writable` (or the connection is lost)."""
        while True:
            await self._can_write.wait()
            if not self._raw:
                return
            await self._raw_idle.wait()

    @property
    def can_send_files(self) -> bool:
        """Whether :meth:`send_file` can write this connection's socket (plain TCP)."""
        return self._fd >= 0

    async def send_file(self, prefix: bytes, parts: FileParts, timeout_s: float) -> None:
        """Write one frame, ``prefix`` then ``parts`` (``sendfile``: page cache -> socket),
        straight into the socket: after every byte the transport holds, before any frame
        written later (held meanwhile), one at a time per connection, so frames never
        interleave.  ``timeout_s`` bounds each wait for the peer to take bytes.

        Raises TimeoutError (the peer took nothing for ``timeout_s``), :class:`ShortFile`
        (a file shrank), ConnectionError or another OSError (the peer or the connection
        gone).  A frame cut short cannot be finished or taken back: once a byte of it was
        written, any failure (cancellation too) aborts the connection here, before a held
        frame could follow it.  The socket is written through a ``dup`` of its fd: the
        transport may close its own fd meanwhile (its number then reused by another file),
        never ours."""
        assert self._fd >= 0 and self.transport is not None
        loop = asyncio.get_running_loop()
        async with self._file_lock:
            transport = self.transport
            self._raw = True
            self._raw_idle.clear()
            fd = -1
            started = False
            try:
                if transport.is_closing():
                    raise ConnectionResetError("the connection is closing")
                await self._flushed(timeout_s)
                fd = os.dup(self._fd)
                _cork(fd, 1)
                loop.add_writer(fd, self._wake_raw, None)
                head = memoryview(prefix)
                started = True
                while head.nbytes or not parts.done:
                    if transport.is_closing():
                        raise ConnectionResetError("the connection closed during a sendfile")
                    if head.nbytes:
                        try:
                            head = head[os.write(fd, head):]
                        except BlockingIOError:
                            pass
                    if not head.nbytes:
                        parts.send(fd)
                    if head.nbytes or not parts.done:
                        self._raw_wait = loop.create_future()
                        async with asyncio.timeout(timeout_s):
                            await self._raw_wait
            except BaseException:
                if started and not transport.is_closing():
                    transport.abort()  # unsent bytes (held frames) dropped with it
                raise
            finally:
                self._raw_wait = None
                if fd >= 0:
                    loop.remove_writer(fd)
                    with contextlib.suppress(OSError):  # the connection is gone
                        _cork(fd, 0)
                    os.close(fd)
                self._raw = False
                held, self._held = self._held, []
                if held and not transport.is_closing():
                    transport.writelines(held)
                self._raw_idle.set()

    async def _flushed(self, timeout_s: float) -> None:
        """Wait until the transport has written every byte it holds: asked of it by a
        high-water mark of 0 for the time (it pauses writing now, resumes once empty)."""
        transport = self.transport
        assert transport is not None
        if not transport.get_write_buffer_size():
            return
        transport.set_write_buffer_limits(high=0, low=0)
        try:
            async with asyncio.timeout(timeout_s):
                await self._can_write.wait()
        finally:
            transport.set_write_buffer_limits(high=WRITE_HIGH)
        if transport.is_closing():
            raise ConnectionResetError("the connection closed during a sendfile")
        if transport.get_write_buffer_size():  # never: the transport resumes only once empty
            raise ConnectionError("the transport did not flush before a sendfile")

    def _wake_raw(self, exc: BaseException | None) -> None:
        """The socket took bytes (the writer callback of :meth:`send_file`'s fd), or the
        connection was lost (``exc``)."""
        fut = self._raw_wait
        if fut is not None and not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
