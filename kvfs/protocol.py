"""The kvfs wire protocol, sans-IO: bytes in, frames out.

A frame is::

    fixed header (28 B, little endian)
        magic       4s   b"KVFS"
        version     u8   PROTOCOL_VERSION
        op          u8   an :class:`kvfs.rpc.Op`
        flags       u16  :class:`Flag`
        request_id  u64  matches a response to its request
        header_len  u32  bytes of the msgpack header that follows
        payload_len u64  raw payload bytes after the header (never msgpack)
    msgpack header (a map)
    payload

Nothing here touches sockets or asyncio.  :class:`FrameDecoder` follows the
``asyncio.BufferedProtocol`` shape (``get_buffer``/``buffer_updated``) so the
transport can receive straight into the decoder's memory -- and large payloads
straight into their own buffer -- while tests feed it plain bytes with
:meth:`FrameDecoder.receive_data`.  Limits are checked on the fixed header,
before any body byte is parsed or any memory is reserved for it.
"""

from __future__ import annotations

import enum
import struct
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass
from itertools import accumulate
from operator import attrgetter
from typing import Any

import msgpack
import msgspec

from kvfs.errors import FrameTooLarge, RemoteProtocolError, VersionMismatch

MAGIC = b"KVFS"
PROTOCOL_VERSION = 2  # 2: typed messages (kvfs.rpc)
FIXED = struct.Struct("<4sBBHQIQ")
FIXED_SIZE = FIXED.size  # 28

Buffer = bytes | bytearray | memoryview


class Flag(enum.IntFlag):
    NONE = 0
    RESPONSE = 1
    ERROR = 2


# per frame, as ints and a table: IntFlag's operators and constructor run Python code in
# the enum module (several us a frame)
_RESPONSE, _ERROR = int(Flag.RESPONSE), int(Flag.ERROR)
_FLAG_OF = {int(f): f for f in (Flag.NONE, Flag.RESPONSE, Flag.ERROR, Flag.RESPONSE | Flag.ERROR)}


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one frame may announce, checked on its fixed header before anything is
    allocated for it.  ``ops``: the only op numbers accepted (None: any), e.g. AUTH
    alone before a peer has authenticated."""

    max_header_bytes: int = 64 * 1024 * 1024
    max_payload_bytes: int = 1024 * 1024 * 1024 + 1024 * 1024  # a 1 GiB value + slack
    ops: frozenset[int] | None = None


# a frame's header decoded straight from its bytes into its typed message (e.g.
# ``msgspec.msgpack.Decoder(rpc.ReadV).decode``), by the key :func:`header_key` gives its op
# and flags (:class:`FrameDecoder`'s ``typed``)
HeaderDecode = Callable[[Buffer], msgspec.Struct]


def header_key(op: int, flags: int) -> int:
    """The key of a frame's op and flags in a table of :data:`HeaderDecode`\\ s."""
    return flags << 8 | op


class FrameHead:
    """What the decoder knows once a frame's headers are parsed (what a payload allocator
    is given).  ``message``: the header decoded into its typed message (:class:`FrameDecoder`'s
    ``typed`` table knew the frame's type and the header checked out); else None and
    ``header`` is the plain msgpack map.  ``header`` of a typed frame is the plain map its
    message encodes to, made when asked."""

    __slots__ = ("_header", "flags", "message", "op", "payload_len", "request_id")

    def __init__(self, op: int, request_id: int, flags: Flag, header: dict[str, Any] | None,
                 payload_len: int, message: msgspec.Struct | None = None) -> None:
        self.op = op
        self.flags = flags
        self.request_id = request_id
        self.payload_len = payload_len
        self.message = message
        self._header = header if header is not None or message is not None else {}

    @property
    def header(self) -> dict[str, Any]:
        header = self._header
        if header is None:  # (cold: no decoder's path asks) the map the message encodes to
            assert self.message is not None
            header = self._header = _plain_header(memoryview(pack_header(self.message)))
        return header

    @property
    def is_response(self) -> bool:
        return bool(int(self.flags) & _RESPONSE)

    @property
    def is_error(self) -> bool:
        return bool(int(self.flags) & _ERROR)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(op={self.op}, flags={self.flags!r}, request_id="
                f"{self.request_id}, header={self.message or self._header!r}, "
                f"payload_len={self.payload_len})")


class Frame(FrameHead):
    """A whole frame: its head and its payload.  (The decoder makes one object per frame:
    its head, given to the payload allocator, becomes the frame once its payload is in.)"""

    __slots__ = ("payload",)

    def __init__(self, op: int, request_id: int, flags: Flag = Flag.NONE,
                 header: dict[str, Any] | None = None, payload: Buffer | Scatter = b"", *,
                 message: msgspec.Struct | None = None, payload_len: int | None = None) -> None:
        super().__init__(op, request_id, flags, header,
                         len(payload) if payload_len is None else payload_len, message)
        self.payload = payload


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()

class Scatter:
    """A payload received straight into several buffers, in order (e.g. the caller's
    destination for each range of a READV answer): no intermediate copy.

    ``fold``: a function ``fold(view, acc) -> acc`` the decoder applies to the bytes each
    receive lands, part by part, while they are still in the CPU's caches (``acc`` starts
    at 0 for each value), e.g. ``crc32c.crc32c``: a CRC-32C over bytes just copied ran
    about 1.7x as fast here as over bytes copied 16-32 MiB before (bench/RESULTS.md).
    ``joins``: one per part, whether it continues the value of the part before it (a value
    received into several views: the fold goes on over them; the first part's is never
    read); without it each part is a value of its own.  Each value's result goes to
    ``done``, in order, once its last byte is in; ``done`` holds one for every value once
    the payload is whole, unless its receive was dropped (:meth:`FrameDecoder.drop_payload`)."""

    __slots__ = ("done", "fold", "joins", "parts")

    def __init__(self, parts: list[memoryview], fold: Callable[[memoryview, Any], Any] | None = None,
                 joins: Sequence[bool] | None = None) -> None:
        if joins is not None and len(joins) != len(parts):
            raise ValueError(f"Scatter: {len(joins)} joins for {len(parts)} parts")
        self.parts = parts
        self.fold = fold
        self.joins = joins
        self.done: list[Any] = []

    def __len__(self) -> int:
        return sum(p.nbytes for p in self.parts)


# the rest of a payload whose caller gave up is received (and dropped) into a buffer this
# large, over and over (FrameDecoder.drop_payload)
DROP_BUFFER_BYTES = 1024 * 1024
# one vectored receive is offered the unfilled buffers covering at most this many bytes (a
# socket rarely holds more): not every buffer of a large answer, each one costing the call
VECTOR_BYTES = 4 * 1024 * 1024
# a receive between frames while an answer with a payload place of its own may come next
# (FrameDecoder.head_first) is offered this much: its header (37 bytes for a READV answer
# without errors) and a few payload bytes, so the rest of the payload is received in place
HEAD_PEEK = 128
_NBYTES = attrgetter("nbytes")

PayloadAllocator = Callable[[FrameHead], "bytearray | memoryview | Scatter"]


def _default_alloc(head: FrameHead) -> bytearray:
    return bytearray(head.payload_len)


def _unshared(buf: bytearray) -> bool:
    """No view of ``buf`` is alive anywhere: a bytearray with exported views cannot be
    resized.  A one-byte shrink and regrow inside its allocation: no copy."""
    try:
        last = buf.pop()
    except BufferError:
        return False
    buf.append(last)
    return True


class ReceivePool:
    """Large payloads received into buffers kept for reuse, a :data:`PayloadAllocator`: a
    fresh buffer costs zeroing and a page fault per 4 KiB on every receive.  A chunkserver's
    request payloads (APPEND values, which go straight from this buffer to ``pwritev``) and
    a client's READV answers whose values are copied out (:mod:`kvfs.readpath`, with
    ``min_bytes=0``) are received into one each.

    :meth:`give` takes a payload back once its request is done.  A buffer is kept only
    while no view of it is alive anywhere (:func:`_unshared`: e.g. a write still running
    in a thread holds its views), so bytes being used are never received over; and at most
    ``max_bytes`` of buffers are kept between requests (0: none, a fresh buffer each).
    Payloads under ``min_bytes`` get a fresh buffer, as before.
    """

    GRAIN = 1 << 20  # buffers are made in whole MiB, so one fits payloads of nearby sizes

    def __init__(self, max_bytes: int, min_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._free: list[bytearray] = []
        self.kept_bytes = 0  # in the free list now
        self.reused = 0  # payloads received into a kept buffer (a public counter)

    @property
    def buffers(self) -> int:
        """Buffers kept for reuse now."""
        return len(self._free)

    def __call__(self, head: FrameHead) -> bytearray | memoryview:
        return self.take(head.payload_len)

    def take(self, n: int) -> bytearray | memoryview:
        """A buffer of ``n`` bytes: a kept one that fits, or a fresh one (under
        ``min_bytes``: a fresh bytearray of exactly ``n``)."""
        if n < self.min_bytes or not self.max_bytes:
            return bytearray(n)
        free = self._free
        best = -1
        for i, buf in enumerate(free):  # the smallest kept buffer that fits
            if len(buf) >= n and (best < 0 or len(buf) < len(free[best])):
                best = i
        if best >= 0:
            buf = free.pop(best)
            self.kept_bytes -= len(buf)
            self.reused += 1
        else:
            buf = bytearray(max(1, -(-n // self.GRAIN)) * self.GRAIN)  # never empty
        return memoryview(buf)[:n]

    def give(self, payload: object) -> None:
        """``payload`` (what this pool handed out, or any other payload: ignored) is no
        longer used by its request."""
        if not isinstance(payload, memoryview) or not isinstance(payload.obj, bytearray):
            return
        buf = payload.obj
        try:
            payload.release()
        except BufferError:  # something still reads through this very view
            return
        if (not buf or len(buf) < self.min_bytes
                or self.kept_bytes + len(buf) > self.max_bytes):
            return
        if not _unshared(buf):  # a view is still alive (e.g. a write still running)
            return
        self._free.append(buf)
        self.kept_bytes += len(buf)


class SharedReceivePool(ReceivePool):
    """A :class:`ReceivePool` that several threads take buffers from and give them back to
    (the blocking client's sockets to the chunkservers, :mod:`kvfs.blocking`)."""

    def __init__(self, max_bytes: int, min_bytes: int = 1 << 20) -> None:
        super().__init__(max_bytes, min_bytes)
        self._lock = threading.Lock()

    def __call__(self, head: FrameHead) -> bytearray | memoryview:
        with self._lock:
            return super().__call__(head)

    def give(self, payload: object) -> None:
        with self._lock:
            super().give(payload)


_ENCODER = msgspec.msgpack.Encoder()


def pack_header(header: dict[str, Any] | msgspec.Struct) -> bytes:
    """A header (a plain map or a typed message of :mod:`kvfs.rpc`) as msgpack."""
    return _ENCODER.encode(header)


def encode_frame(
    op: int,
    request_id: int,
    header: dict[str, Any] | msgspec.Struct | None = None,
    payload: Sequence[Buffer] = (),
    flags: Flag = Flag.NONE,
    *,
    version: int = PROTOCOL_VERSION,
    payload_bytes: int | None = None,
) -> list[Buffer]:
    """The buffers to write, in order: one prefix, then the payload parts as given.
    ``payload_bytes``: the payload's size when it is not among the buffers (a prefix alone,
    its payload sent from files: :class:`kvfs.fileparts.FileParts`)."""
    hdr = pack_header({} if header is None else header)
    if payload_bytes is not None:
        plen = payload_bytes
    elif memoryview not in (kinds := set(map(type, payload))):  # (in C: no step per part)
        plen = sum(map(len, payload))
    elif len(kinds) == 1:
        plen = sum(map(_NBYTES, payload))
    else:
        plen = sum(len(p) if not isinstance(p, memoryview) else p.nbytes for p in payload)
    prefix = FIXED.pack(MAGIC, version, op, int(flags), request_id, len(hdr), plen) + hdr
    return [prefix, *payload]


def frame_bytes(*args: Any, **kwargs: Any) -> bytes:
    """:func:`encode_frame` joined into one ``bytes`` (tests and small frames)."""
    return b"".join(bytes(b) for b in encode_frame(*args, **kwargs))


def _plain_header(raw: memoryview) -> dict[str, Any]:
    """A frame's header as a plain map; a protocol error if it is not msgpack or not a map."""
    if not raw.nbytes:
        return {}
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types on garbage
        raise RemoteProtocolError(f"undecodable frame header: {exc}") from None
    if not isinstance(header, dict):
        raise RemoteProtocolError(f"frame header must be a map, got {type(header).__name__}")
    return header


class FrameDecoder:
    """Turns a byte stream into :class:`Frame` events.

    Small frames are parsed out of one growing scratch buffer; a payload
    larger than ``inline_payload_bytes`` gets its own buffer from
    ``allocator`` and :meth:`get_buffer` hands out that buffer directly, so
    bulk bytes are written once, by the kernel, into their final place.
    After an error the decoder is dead: every later call raises it again.

    ``typed``: the frames whose header is decoded straight from its bytes into a typed
    message (:attr:`Frame.message`), by :func:`header_key` of their op and flags (e.g.
    :data:`kvfs.rpc.ANSWERS` on a client).  A header that does not decode into its type is
    decoded as a plain map instead, as every other frame's is: garbage (not msgpack, not a
    map, nested too deep) stays the protocol error it always was, and a map is the receiver's
    to check (its check names the field that is wrong).  What the typed decode lets pass that
    the plain one refuses lies inside a field the message does not have: an answer's unknown
    fields are skipped unread (e.g. a string that is not UTF-8), not checked as msgpack types.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        allocator: PayloadAllocator | None = None,
        scratch_bytes: int = 256 * 1024,
        inline_payload_bytes: int = 64 * 1024,
        typed: Mapping[int, HeaderDecode] | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.typed = typed or {}
        self.allocator = allocator or _default_alloc
        self._scratch = bytearray(scratch_bytes)
        self._start = 0
        self._end = 0
        self._inline = inline_payload_bytes
        self._head: Frame | None = None
        self._head_size = 0  # fixed + msgpack bytes of the pending head
        # a large payload being received into its own buffer(s)
        self._segs: list[memoryview] | None = None
        # where each part starts in the payload, then where the last one ends (running sums)
        self._bounds: list[int] = []
        self._seg_i = 0
        self._seg_filled = 0
        self._big_filled = 0
        self._big_owner: bytearray | memoryview | Scatter | None = None
        self._fold: Scatter | None = None  # the payload's Scatter, if it has a ``fold``
        self._fold_i = self._fold_at = 0  # the part being folded, its bytes folded so far
        self._fold_acc: Any = 0  # the value's result so far (its parts before this one too)
        self._staged = False  # the last get_buffer handed out scratch for small parts
        # the transport follows each receive with vectored ones (payload_views): a small part
        # is received in place too, no run of them staged in scratch and copied out
        self.vectored = False
        # while non-empty (a client's pending sinks: answers whose payloads have a place of
        # their own), and vectored, a receive between frames after one whose payload had a
        # place of its own (_big_last: small answers, e.g. one key's, cost no receive more) is
        # offered HEAD_PEEK bytes only: the next payload lands in its place by the receives
        # after its header, not in scratch to be copied out (one receive more per frame, a
        # copy of the payload less)
        self.head_first: Sized = ()
        self._big_last = False
        self._events: deque[Frame] = deque()
        self._error: RemoteProtocolError | None = None

    def set_limits(self, limits: Limits, scratch_bytes: int | None = None) -> None:
        """New limits from the next frame on (e.g. once a peer authenticated); grows the
        scratch buffer to ``scratch_bytes``."""
        self.limits = limits
        if scratch_bytes is not None and scratch_bytes > len(self._scratch):
            self._compact(scratch_bytes)

    # -- BufferedProtocol shape ------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._error is not None:
            raise self._error
        segs = self._segs
        if segs is not None:
            while self._seg_filled == segs[self._seg_i].nbytes:  # skip full (or empty) parts
                self._seg_i += 1
                self._seg_filled = 0
            seg = segs[self._seg_i]
            if seg.nbytes - self._seg_filled >= self._inline or self.vectored:
                return seg[self._seg_filled :]  # a large part: the kernel writes it in place
            # small parts (e.g. 4 KiB values into their own buffers): one receive into the
            # scratch buffer for the run of them, copied out, instead of one receive each
            self._staged = True
            return memoryview(self._scratch)[: self._small_run()]
        if self._end == len(self._scratch):
            self._compact(len(self._scratch))
        if self._start == self._end and self._big_last and self.head_first and self.vectored:
            return memoryview(self._scratch)[self._end : self._end + HEAD_PEEK]
        return memoryview(self._scratch)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._error is not None:
            raise self._error
        try:
            if self._segs is not None:
                if self._staged:  # received into the scratch buffer (its start): copy out
                    self._staged = False
                    self._end += nbytes
                    self._fill_parts()
                else:
                    self._seg_filled += nbytes
                    self._big_filled += nbytes
                assert self._head is not None
                if self._big_filled < self._head.payload_len:
                    if self._fold is not None:
                        self._fold_upto(self._seg_i, self._seg_filled)
                    return
                self._finish_big()
            else:
                self._end += nbytes
            self._parse()
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    def payload_views(self, most: int) -> list[memoryview]:
        """While a payload received into several buffers (a :class:`Scatter`) is arriving:
        the unfilled rest of those buffers, at most ``most`` of them, for one vectored
        receive straight into them (then :meth:`payload_updated`); else ``[]``."""
        segs = self._segs
        if segs is None or len(segs) - self._seg_i < 2:
            return []
        i, filled = self._seg_i, self._seg_filled
        while filled == segs[i].nbytes:  # skip full (or empty) parts
            i, filled = i + 1, 0
        # the parts up to the one holding byte _big_filled + VECTOR_BYTES, found by bisection
        stop = min(i + most, bisect_right(self._bounds, self._big_filled + VECTOR_BYTES, i))
        return [segs[i][filled:], *segs[i + 1 : stop]]

    def payload_updated(self, nbytes: int) -> None:
        """``nbytes`` were received into the buffers :meth:`payload_views` gave, in order."""
        head, bounds = self._head, self._bounds
        assert self._segs is not None and head is not None and nbytes > 0
        done = self._big_filled = self._big_filled + nbytes
        if done == head.payload_len:
            self._finish_big()
            return
        i = bisect_right(bounds, done, self._seg_i) - 1  # the first part not full yet
        self._seg_i, self._seg_filled = i, done - bounds[i]
        if self._fold is not None:
            self._fold_upto(i, self._seg_filled)

    def drop_payload(self, request_id: int) -> None:
        """If the payload of frame ``request_id`` is arriving into its own buffers now, the
        rest of it goes into a throwaway buffer instead, and the frame, once whole, carries
        that: its caller gave up (cancelled) and its buffers must not be written any more.
        Called only then: it costs the normal path nothing."""
        head = self._head
        if self._segs is None or head is None or head.request_id != request_id:
            return
        rest = head.payload_len - self._big_filled
        junk = memoryview(bytearray(min(rest, DROP_BUFFER_BYTES)))
        parts = [junk] * (rest // junk.nbytes)  # the same memory again and again
        if rest % junk.nbytes:
            parts.append(junk[: rest % junk.nbytes])
        self._segs, self._big_owner, self._fold = parts, Scatter(parts), None
        self._bounds = list(accumulate(map(_NBYTES, parts), initial=self._big_filled))
        self._seg_i = self._seg_filled = 0

    def arriving(self, request_id: int) -> tuple[int, int] | None:
        """``(payload bytes received, payload length)`` while frame ``request_id`` is
        arriving (its header decoded, its payload not whole yet), else None: whether a
        call's answer began (a timed-out call's error says so)."""
        head = self._head
        if head is None or head.request_id != request_id:
            return None
        if self._segs is not None:
            return self._big_filled, head.payload_len
        return max(0, self._end - self._start - self._head_size), head.payload_len

    def receive_data(self, data: Buffer) -> None:
        """Feed bytes from anywhere (tests, non-buffered transports)."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            buf = self.get_buffer(view.nbytes)
            n = min(len(buf), view.nbytes)
            buf[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)

    def next_event(self) -> Frame | _NeedData:
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            raise self._error
        return NEED_DATA

    @property
    def has_events(self) -> bool:
        """Whether decoded frames (or an error) wait for :meth:`next_event`."""
        return bool(self._events) or self._error is not None

    @property
    def scratch_size(self) -> int:
        """The scratch buffer's size now (it grows for a large header or small payload)."""
        return len(self._scratch)

    @property
    def buffered_bytes(self) -> int:
        return self._end - self._start + self._big_filled

    @property
    def in_payload(self) -> bool:
        """Whether the buffer :meth:`get_buffer` last handed out is all payload of the
        frame arriving (a part received in place, not scratch): a receive into it may wait
        until it is full, as no byte of a later frame can belong there."""
        return self._segs is not None and not self._staged

    # -- internals ---------------------------------------------------------
    def _compact(self, need: int) -> None:
        """Move unparsed bytes to the front; grow so ``need`` bytes fit."""
        avail = self._end - self._start
        if self._start:
            self._scratch[:avail] = self._scratch[self._start : self._end]
            self._start, self._end = 0, avail
        if need > len(self._scratch) or self._end == len(self._scratch):
            grown = bytearray(max(need, 2 * len(self._scratch)))
            grown[:avail] = self._scratch[:avail]
            self._scratch = grown

    def _parse_head(self) -> Frame | None:
        avail = self._end - self._start
        if avail < FIXED_SIZE:
            if len(self._scratch) - self._start < FIXED_SIZE:
                self._compact(FIXED_SIZE)
            return None
        magic, version, op, flags, rid, hlen, plen = FIXED.unpack_from(self._scratch, self._start)
        if magic != MAGIC:
            what = ("a TLS handshake: the peer speaks TLS and this side does not"
                    if bytes(magic[:2]) == b"\x16\x03" else "not a kvfs peer?")
            raise RemoteProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): {what}")
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"peer speaks kvfs protocol version {version}, this side speaks {PROTOCOL_VERSION}"
            )
        if hlen > self.limits.max_header_bytes:
            raise FrameTooLarge(
                f"frame header of {hlen} bytes exceeds the limit of {self.limits.max_header_bytes}"
            )
        if plen > self.limits.max_payload_bytes:
            raise FrameTooLarge(
                f"frame payload of {plen} bytes exceeds the limit of {self.limits.max_payload_bytes}"
            )
        ops = self.limits.ops
        if ops is not None and op not in ops:
            raise RemoteProtocolError(f"op {op} is not accepted here (expected one of {sorted(ops)})")
        size = FIXED_SIZE + hlen
        if avail < size:
            if len(self._scratch) - self._start < size:
                self._compact(size)
            return None
        raw = memoryview(self._scratch)[self._start + FIXED_SIZE : self._start + size]
        message = header = None
        try:
            typed = self.typed.get(flags << 8 | op) if hlen and self.typed else None  # header_key
            if typed is not None:
                try:
                    message = typed(raw)
                except (msgspec.DecodeError, RecursionError):  # (ValidationError too; an
                    pass  # unknown field nested past msgspec's depth recurses out) the plain way
            if message is None:
                header = _plain_header(raw)
        finally:
            raw.release()
        flag = _FLAG_OF.get(flags)
        if flag is None:
            raise RemoteProtocolError(f"unknown frame flags {flags:#x}")
        self._head_size = size
        return Frame(op, rid, flag, header, b"", message=message, payload_len=plen)

    def _parse(self) -> None:
        while True:
            if self._head is None:
                self._head = self._parse_head()
                if self._head is None:
                    return
            head = self._head
            body_at = self._start + self._head_size
            avail = self._end - body_at
            if head.payload_len <= self._inline:
                if avail < head.payload_len:
                    need = self._head_size + head.payload_len
                    if len(self._scratch) - self._start < need:
                        self._compact(need)
                    return
                payload = bytes(self._scratch[body_at : body_at + head.payload_len])
                self._start = body_at + head.payload_len
                self._big_last = False
                self._emit(head, payload)
                continue
            self._big_last = True
            owner = self.allocator(head)
            segs = owner.parts if isinstance(owner, Scatter) else [memoryview(owner).cast("B")]
            bounds = list(accumulate(map(_NBYTES, segs), initial=0))
            if bounds[-1] != head.payload_len:
                raise RemoteProtocolError("payload allocator returned buffers of the wrong size")
            self._start = body_at
            self._big_owner, self._segs, self._bounds = owner, segs, bounds
            if isinstance(owner, Scatter) and owner.fold is not None:
                self._fold, self._fold_i, self._fold_at, self._fold_acc = owner, 0, 0, 0
            self._fill_parts()  # what already arrived with the header
            if self._big_filled == head.payload_len:
                self._finish_big()
                continue
            if self._fold is not None:
                self._fold_upto(self._seg_i, self._seg_filled)
            return

    def _small_run(self) -> int:
        """Bytes to receive into the scratch buffer: the rest of the current (small) part
        and the small parts after it, up to the next large part (received in place) or the
        scratch buffer's size; past the payload's end (its last parts all small), the next
        frames' bytes may come too.  Nothing unparsed waits in scratch while a payload
        arrives, so the receive goes to its start."""
        segs, i, cap = self._segs, self._seg_i, len(self._scratch)
        assert segs is not None
        self._start = self._end = 0
        n = segs[i].nbytes - self._seg_filled
        i += 1
        while n < cap and i < len(segs) and segs[i].nbytes < self._inline:
            n += segs[i].nbytes
            i += 1
        return cap if i == len(segs) else min(n, cap)

    def _fill_parts(self) -> None:
        """Copy the payload bytes waiting in scratch (``_start`` on) into the parts."""
        segs, head = self._segs, self._head
        assert segs is not None and head is not None
        pos = self._start
        end = pos + min(self._end - pos, head.payload_len - self._big_filled)
        i, filled = self._seg_i, self._seg_filled
        with memoryview(self._scratch) as scratch:
            while pos < end:
                seg = segs[i]
                room = seg.nbytes - filled
                if not room:
                    i, filled = i + 1, 0
                    continue
                n = min(room, end - pos)
                seg[filled : filled + n] = scratch[pos : pos + n]
                pos += n
                filled += n
        self._big_filled += pos - self._start
        self._start, self._seg_i, self._seg_filled = pos, i, filled

    def _fold_upto(self, end: int, filled: int) -> None:
        """The Scatter's ``fold`` applied to the bytes received since the last call, up to
        byte ``filled`` of part ``end``; each value whose last byte that passes (empty
        parts there included) goes to ``done``."""
        segs, sc = self._segs, self._fold
        assert segs is not None and sc is not None and sc.fold is not None
        fold, done, joins, n = sc.fold, sc.done, sc.joins, len(segs)
        i, at, acc = self._fold_i, self._fold_at, self._fold_acc
        while i < n and (i < end or (i == end and at < filled) or (not at and not segs[i].nbytes)):
            seg = segs[i]
            stop = seg.nbytes if i < end else filled if i == end else 0
            if stop > at:
                acc = fold(seg[at:stop], acc)
            if stop < seg.nbytes:
                at = stop
                continue
            i, at = i + 1, 0  # the part is whole: so is its value, unless the next part joins it
            if joins is None or i == n or not joins[i]:
                done.append(acc)
                acc = 0
        self._fold_i, self._fold_at, self._fold_acc = i, at, acc

    def _finish_big(self) -> None:
        head, owner = self._head, self._big_owner
        assert head is not None and owner is not None
        if self._fold is not None:
            self._fold_upto(len(self._segs or ()), 0)
            self._fold = None
        self._segs = self._big_owner = None
        self._bounds = []
        self._seg_i = self._seg_filled = self._big_filled = 0
        self._emit(head, owner)

    def _emit(self, head: Frame, payload: Buffer | Scatter) -> None:
        self._head = None
        if self._start == self._end:
            self._start = self._end = 0
        head.payload = payload
        self._events.append(head)
