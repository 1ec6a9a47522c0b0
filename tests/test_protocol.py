"""The sans-IO wire protocol, byte by byte."""

from __future__ import annotations

import asyncio
import inspect
import os
import struct
from itertools import accumulate
from typing import Any, get_type_hints

import msgpack
import msgspec
import pytest
from hypothesis import Phase, event, example, given, settings
from hypothesis import strategies as st

from kvfs import rpc
from kvfs.chunkserver.service import ChunkServer
from kvfs.errors import FrameTooLarge, RemoteProtocolError, VersionMismatch
from kvfs.meta.gc import MetaGc
from kvfs.meta.service import MetaService
from kvfs.protocol import (
    FIXED,
    MAGIC,
    NEED_DATA,
    PROTOCOL_VERSION,
    Flag,
    Frame,
    FrameDecoder,
    FrameHead,
    Limits,
    encode_frame,
    frame_bytes,
)
from kvfs.rpc import OP_OF, RPCS, Op, Request, Response, Service
from kvfs.transport import _ClientProtocol, answer_of


def drain(dec: FrameDecoder) -> list[Frame]:
    out = []
    while True:
        ev = dec.next_event()
        if ev is NEED_DATA:
            return out
        assert isinstance(ev, Frame)
        out.append(ev)


def test_golden_bytes() -> None:
    data = frame_bytes(Op.PING, 7, {"a": 1}, [b"xyz"], Flag.RESPONSE)
    # magic, version 2, op 3, flags 1, request id 7, header 4 bytes (msgpack {"a": 1}), payload 3
    assert data == (b"KVFS\x02\x03\x01\x00" + (7).to_bytes(8, "little") + (4).to_bytes(4, "little")
                    + (3).to_bytes(8, "little") + b"\x81\xa1a\x01" + b"xyz")


FRAMES = [
    (Op.LOOKUP, 1, {"keys": [b"a", b"b"]}, b""),
    (Op.APPEND, 2, {"records": [[b"k", 5, 123, None]]}, b"hello"),
    (Op.READV, 3, {}, bytes(range(256)) * 1000),  # a "big" payload with its own buffer
    (Op.PING, 4, {}, b""),
]


def _stream() -> bytes:
    return b"".join(frame_bytes(op, rid, h, [p] if p else []) for op, rid, h, p in FRAMES)


def _check(frames: list[Frame]) -> None:
    assert [(f.op, f.request_id, f.header, bytes(f.payload)) for f in frames] == [
        (int(op), rid, h, p) for op, rid, h, p in FRAMES]


def test_whole() -> None:
    dec = FrameDecoder()
    dec.receive_data(_stream())
    _check(drain(dec))


def test_one_byte_at_a_time() -> None:
    dec = FrameDecoder()
    frames: list[Frame] = []
    for b in _stream():
        dec.receive_data(bytes([b]))
        frames.extend(drain(dec))
    _check(frames)


def test_trailing_partial_frame_waits() -> None:
    dec = FrameDecoder()
    extra = frame_bytes(Op.PING, 9, {}, [b"tail"])
    dec.receive_data(_stream() + extra[:-2])
    _check(drain(dec))
    assert dec.next_event() is NEED_DATA
    dec.receive_data(extra[-2:])
    (f,) = drain(dec)
    assert f.request_id == 9 and bytes(f.payload) == b"tail"


def test_big_payload_lands_in_allocated_buffer() -> None:
    target = bytearray(300_000)
    dec = FrameDecoder(allocator=lambda head: target)
    dec.receive_data(frame_bytes(Op.READV, 1, {}, [b"\x07" * 300_000]))
    (f,) = drain(dec)
    assert f.payload is target and target == b"\x07" * 300_000


@pytest.mark.parametrize("size", [1_000, 300_000], ids=["inline", "own-buffer"])
def test_arriving_says_how_much_of_a_payload_came(size: int) -> None:
    """``arriving(request_id)``: none before the frame's header, (received, length) while its
    payload comes (in scratch or in its own buffer), none once whole or for another id."""
    dec = FrameDecoder()
    data = frame_bytes(Op.READV, 7, {"x": 1}, [os.urandom(size)])
    head = len(data) - size
    dec.receive_data(data[: head - 1])
    assert dec.arriving(7) is None
    dec.receive_data(data[head - 1 : head + 10])
    assert dec.arriving(7) == (10, size) and dec.arriving(8) is None
    dec.receive_data(data[head + 10 : -1])
    assert dec.arriving(7) == (size - 1, size)
    dec.receive_data(data[-1:])
    assert dec.arriving(7) is None
    (f,) = drain(dec)
    assert f.request_id == 7 and bytes(f.payload) == data[head:]


def test_get_buffer_hands_out_payload_buffer() -> None:
    dec = FrameDecoder()
    data = frame_bytes(Op.READV, 1, {}, [b"z" * 1_000_000])
    pos, calls = 0, 0
    while pos < len(data):
        buf = dec.get_buffer(-1)
        n = min(len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        dec.buffer_updated(n)
        pos += n
        calls += 1
    (f,) = drain(dec)
    assert bytes(f.payload) == b"z" * 1_000_000
    assert calls <= 3  # scratch, then the payload's own buffer in one piece


def test_bad_magic() -> None:
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="magic"):
        dec.receive_data(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 20)
    with pytest.raises(RemoteProtocolError):  # dead after an error
        dec.receive_data(b"x")


def test_wrong_version() -> None:
    dec = FrameDecoder()
    with pytest.raises(VersionMismatch, match="version 9"):
        dec.receive_data(frame_bytes(Op.PING, 1, {}, version=9))


def test_huge_payload_refused_before_reading_it() -> None:
    dec = FrameDecoder(Limits(max_payload_bytes=1 << 30))
    head = FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.APPEND, 0, 1, 0, 100 << 30)
    with pytest.raises(FrameTooLarge, match="107374182400 bytes exceeds"):
        dec.receive_data(head)


def test_header_must_be_a_map() -> None:
    hdr = b"\x93\x01\x02\x03"  # msgpack [1, 2, 3]
    data = FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.PING, 0, 1, len(hdr), 0) + hdr
    with pytest.raises(RemoteProtocolError, match="must be a map"):
        FrameDecoder().receive_data(data)


def test_undecodable_header() -> None:
    hdr = b"\xc1\xc1\xc1"  # never-used msgpack byte
    data = FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.PING, 0, 1, len(hdr), 0) + hdr
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        FrameDecoder().receive_data(data)


def test_unknown_flags() -> None:
    data = FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.PING, 0x80, 1, 0, 0)
    with pytest.raises(RemoteProtocolError, match="flags"):
        FrameDecoder().receive_data(data)


@pytest.mark.parametrize("flags", [Flag.NONE, Flag.RESPONSE, Flag.ERROR, Flag.RESPONSE | Flag.ERROR])
def test_each_known_flag_combination_is_decoded_as_that_flag(flags: Flag) -> None:
    dec = FrameDecoder()
    dec.receive_data(frame_bytes(Op.PING, 1, {}, [], flags))
    (frame,) = drain(dec)
    assert frame.flags == flags and isinstance(frame.flags, Flag)
    assert (frame.is_response, frame.is_error) == (Flag.RESPONSE in flags, Flag.ERROR in flags)


def test_a_typed_header_is_decoded_once_into_its_message() -> None:
    """With a table of typed decoders (a client's: :data:`kvfs.rpc.ANSWERS`), an answer's
    header comes out as its typed message, made straight from the bytes; its plain map is
    still there when asked; frames the table does not name (an error, a request) come out
    as plain maps, as before."""
    dec = FrameDecoder(typed=rpc.ANSWERS)
    answer = rpc.Appended(locations=[(1 << 40 | 5, 4096 * i) for i in range(3)])
    dec.receive_data(frame_bytes(Op.APPEND, 1, answer, [], Flag.RESPONSE)
                     + frame_bytes(Op.APPEND, 2, {"code": 3, "message": "no"}, [],
                                   Flag.RESPONSE | Flag.ERROR)
                     + frame_bytes(Op.APPEND, 3, {"records": []}))
    typed, error, request = drain(dec)
    assert type(typed.message) is rpc.Appended and typed.message == answer
    assert rpc.message(typed, rpc.Appended) is typed.message  # no second decode
    assert typed.header == {"locations": [[1 << 40 | 5, 0], [1 << 40 | 5, 4096], [1 << 40 | 5, 8192]]}
    assert error.message is None and error.header == {"code": 3, "message": "no"}
    assert request.message is None and request.header == {"records": []}


def test_a_header_not_of_its_type_is_its_plain_map_and_named_as_before() -> None:
    """A header the typed decode refuses comes out as its plain map, and checking it names
    what is wrong in the words the plain path always used."""
    dec = FrameDecoder(typed=rpc.REQUESTS)
    bad = {"ranges": [[1, "0", 4096]]}
    dec.receive_data(frame_bytes(Op.READV, 1, bad))
    (frame,) = drain(dec)
    assert frame.message is None and frame.header == bad
    with pytest.raises(msgspec.ValidationError) as typed:
        rpc.message(frame, rpc.ReadV)
    with pytest.raises(msgspec.ValidationError) as plain:
        rpc.decode(bad, rpc.ReadV)
    assert str(typed.value) == str(plain.value) == "Expected `int`, got `str` - at `$.ranges[0][1]`"


async def test_a_sink_is_given_only_an_answer_whose_header_checked_out() -> None:
    """A client's sink (where a large answer's payload goes: kvfs.readpath's read straight
    into the caller's buffers) reads the typed answer; an answer whose header is not of its
    type goes to a buffer of its own instead, and its call fails naming what is wrong."""
    proto = _ClientProtocol("peer", None)
    loop = asyncio.get_running_loop()
    seen: list[rpc.ReadVReply] = []

    def sink(head: FrameHead) -> None:
        seen.append(rpc.message(head, rpc.ReadVReply))
        return None  # a buffer of the decoder's

    futs = {rid: loop.create_future() for rid in (1, 2)}
    proto.pending.update(futs)
    proto.sinks.update({1: sink, 2: sink})
    payload = bytes(range(256)) * 400  # past the inline 64 KiB: the sink is asked
    proto.decoder.receive_data(frame_bytes(Op.READV, 1, rpc.ReadVReply(), [payload], Flag.RESPONSE)
                               + frame_bytes(Op.READV, 2, {"errors": "a table?"}, [payload],
                                             Flag.RESPONSE))
    proto.deliver()
    assert seen == [rpc.ReadVReply()]
    good, bad = futs[1].result(), futs[2].result()
    assert answer_of(Op.READV, good, "peer") == rpc.ReadVReply() and bytes(good.payload) == payload
    assert bytes(bad.payload) == payload
    with pytest.raises(RemoteProtocolError, match=r"peer sent a bad READV answer: Expected `object`"):
        answer_of(Op.READV, bad, "peer")


@pytest.mark.parametrize(("header", "error"), [
    (b"\x93\x01\x02\x03", "frame header must be a map, got list"),
    (b"\xc1\xc1\xc1", "undecodable frame header"),
    (b"\x81\xa6ranges\x91\xc1", "undecodable frame header"),  # garbage inside a field
    (b"\x81\xa6ranges\x91\x93\x01\x00\x01\x01", "undecodable frame header"),  # trailing bytes
    (b"\x81\xa6ranges\x91\x93\x01\x00\x01\xa2\xff\xfe", "undecodable frame header"),  # not UTF-8
])
def test_garbage_is_the_same_protocol_error_with_typed_decoders(header: bytes, error: str) -> None:
    """A header that is not msgpack, or not a map, is the same protocol error whether or not
    the decoder knows its frame's type: the typed decode refuses it, the plain one names it."""
    data = FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.READV, 0, 1, len(header), 0) + header
    for typed in (None, rpc.REQUESTS):
        with pytest.raises(RemoteProtocolError, match=error):
            FrameDecoder(typed=typed).receive_data(data)


def test_an_answer_nested_past_the_typed_decoders_depth_is_a_protocol_error() -> None:
    """An answer's unknown field is skipped by its typed decode, but one nested too deep
    makes msgspec recurse out (RecursionError): that too is the plain map's protocol error,
    not an exception that escapes the decoder (a hostile server, even before AUTH)."""
    header = b"\x81\xa3zzz" + b"\x91" * 3000 + b"\x90"
    data = FIXED.pack(MAGIC, PROTOCOL_VERSION, Op.AUTH, int(Flag.RESPONSE), 1, len(header), 0)
    for typed in (None, rpc.ANSWERS):
        with pytest.raises(RemoteProtocolError, match="undecodable frame header"):
            FrameDecoder(typed=typed).receive_data(data + header)


def test_a_request_is_read_by_a_server_that_predates_its_optional_fields_unless_it_uses_them() -> None:
    """A request's fields at their defaults are not sent: a server whose request type lacks
    them (an older meta's ``GcEvict``, before ``after`` and ``chunk``) reads it; one that
    uses such a field is refused, the field named."""
    class OlderGcEvict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        high: float = 0.9
        low: float = 0.8
        apply: bool = False
        server_id: int | None = None
        after_expire: bool = False
        older: bool = True

    older = msgspec.msgpack.Decoder(OlderGcEvict)
    sent = msgspec.msgpack.encode(rpc.GcEvict(high=0.95, apply=True))
    assert older.decode(sent) == OlderGcEvict(high=0.95, apply=True)
    assert msgspec.msgpack.decode(sent) == {"high": 0.95, "apply": True}
    with pytest.raises(msgspec.ValidationError, match="chunk"):
        older.decode(msgspec.msgpack.encode(rpc.GcEvict(apply=True, chunk=7)))


def test_encode_frame_keeps_payload_buffers() -> None:
    payload = memoryview(bytearray(b"abc"))
    bufs = encode_frame(Op.APPEND, 1, {}, [payload])
    assert bufs[1] is payload  # never re-packed
    assert struct.unpack_from("<Q", bufs[0], 20)[0] == 3


# the classes whose rpc_* methods serve each service (kvfs.server.RpcServer dispatches to them)
SERVICE_CLASSES: dict[Service, list[type]] = {Service.META: [MetaService, MetaGc],
                                              Service.CHUNKSERVER: [ChunkServer]}
CONNECTION_OPS = {Op.HELLO, Op.AUTH}  # answered by the connection itself, before dispatch


def test_rpc_table_is_consistent() -> None:
    """Every op has one request type, a response type, and one handler per service it is
    served by, taking exactly that request type; every handler belongs to an op."""
    assert set(RPCS) == set(Op)
    assert len(OP_OF) == len(RPCS)  # a request type names one op
    handlers = {r.handler: r for r in RPCS.values()}
    for op, r in RPCS.items():
        assert r.op is op
        assert issubclass(r.request, Request) and issubclass(r.response, Response)
        if op in CONNECTION_OPS:
            continue
        services = list(SERVICE_CLASSES) if r.service is Service.ANY else [r.service]
        for svc in services:
            found = [c for c in SERVICE_CLASSES[svc] if hasattr(c, r.handler)]
            assert len(found) == 1, f"{op.name}: {svc.value} needs exactly one {r.handler}, has {found}"
            fn = getattr(found[0], r.handler)
            params = list(inspect.signature(fn).parameters)
            assert params[0] == "self" and len(params) == 3, f"{r.handler}{params}"
            assert get_type_hints(fn)[params[1]] is r.request, f"{r.handler} takes {r.request.__name__}"
    for svc, classes in SERVICE_CLASSES.items():
        for cls in classes:
            for name in dir(cls):
                if name.startswith("rpc_"):
                    assert name in handlers, f"{cls.__name__}.{name} is no RPC of kvfs.rpc.RPCS"
                    assert handlers[name].service in (svc, Service.ANY), f"{name} served by {svc.value}"


FUZZ_LIMITS = Limits(max_header_bytes=1 << 12, max_payload_bytes=1 << 16)
_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack encodes
_maps = st.dictionaries(st.text(max_size=8), st.one_of(_ints, st.text(max_size=20),
                                                       st.binary(max_size=20), st.none()), max_size=4)
_headers = st.sampled_from([0, 0, 0, 1, 2]).flatmap(lambda kind: [
    _maps.map(msgpack.packb),
    st.one_of(_ints, st.text(max_size=10), st.lists(_ints, max_size=3)).map(msgpack.packb),  # no map
    st.binary(max_size=40),  # anything
][kind])


@st.composite
def mutated_frames(draw: st.DrawFn) -> tuple[bytes, tuple[int, ...], bytes, bytes]:
    """A frame whose fixed-header fields are each valid or not, and its msgpack and payload."""
    header = draw(_headers)
    payload = draw(st.binary(max_size=300))
    # mostly one broken field at a time, so every check is reached on its own
    broken = draw(st.sets(st.sampled_from(["magic", "version", "flags", "hlen", "plen"]), max_size=2))

    def field(name: str, valid: int | bytes, mutant: st.SearchStrategy[Any]) -> Any:
        return draw(mutant) if name in broken else valid

    fields = (
        field("magic", MAGIC, st.binary(min_size=4, max_size=4)),
        field("version", PROTOCOL_VERSION, st.integers(0, 255)),
        draw(st.integers(0, 255)),  # op: any number is a frame (dispatch judges ops)
        field("flags", draw(st.sampled_from([0, 1, 2, 3])), st.integers(4, 0xFFFF)),
        draw(st.integers(0, 2**64 - 1)),
        field("hlen", len(header), st.one_of(st.integers(0, 2**32 - 1),
                                             st.integers(0, FUZZ_LIMITS.max_header_bytes + 1))),
        field("plen", len(payload), st.one_of(st.integers(0, 2**64 - 1),
                                              st.integers(0, FUZZ_LIMITS.max_payload_bytes + 1))),
    )
    return FIXED.pack(*fields), fields, header, payload


def _expected_errors(data: bytes, fields: tuple[int, ...]) -> tuple[set[type], bool]:
    """The error types the decoder may raise on the first frame of ``data``, and whether it must.

    The fixed header's checks (magic, version, both size limits) must fire as soon as its
    28 bytes are in, before any header byte is parsed; the msgpack header's checks and the
    flags once the whole header is in. Anything not named here is a bug in the decoder.
    """
    magic, version, _op, flags, _rid, hlen, plen = fields
    if len(data) < FIXED.size:
        return set(), False
    fixed: set[type] = set()
    if magic != MAGIC:
        fixed.add(RemoteProtocolError)
    if version != PROTOCOL_VERSION:
        fixed.add(VersionMismatch)
    if hlen > FUZZ_LIMITS.max_header_bytes or plen > FUZZ_LIMITS.max_payload_bytes:
        fixed.add(FrameTooLarge)
    bad_flags = bool(flags & ~int(Flag.RESPONSE | Flag.ERROR))
    if fixed:
        return fixed | ({RemoteProtocolError} if bad_flags else set()), True
    if len(data) < FIXED.size + hlen:
        return {RemoteProtocolError} if bad_flags else set(), False
    raw = data[FIXED.size : FIXED.size + hlen]
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False) if hlen else {}
        bad_header = not isinstance(header, dict)
    except Exception:
        bad_header = True
    return ({RemoteProtocolError} if bad_flags or bad_header else set()), bad_flags or bad_header


@settings(max_examples=400, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(mutated_frames(), st.one_of(st.none(), st.integers(0, 400)), st.integers(1, 50),
       st.integers(0, 64), st.sampled_from([None, rpc.REQUESTS, rpc.ANSWERS]))
# hlen 1 over an empty header: the header byte the decoder reads is the payload's first (0x80, {})
@example((FIXED.pack(MAGIC, PROTOCOL_VERSION, 0, 0, 0, 1, 0), (MAGIC, PROTOCOL_VERSION, 0, 0, 0, 1, 0),
          b"", b"\x80"), None, 1, 0, None)
def test_fuzz_only_protocol_errors(frame: tuple[bytes, tuple[int, ...], bytes, bytes],
                                   cut: int | None, step: int, inline: int,
                                   typed: dict[int, Any] | None) -> None:
    """Frames with a valid prefix and mutated fields, cut anywhere and fed in pieces: the
    decoder raises exactly the error a broken field calls for (and only once it has the
    bytes to know), or returns the frame as sent. Nothing else ever comes out, whether or
    not it decodes headers into their types (a server's requests, a client's answers)."""
    prefix, fields, header, payload = frame
    data = (prefix + header + payload)[:cut]  # cut None: whole
    allowed, required = _expected_errors(data, fields)
    dec = FrameDecoder(FUZZ_LIMITS, inline_payload_bytes=inline, typed=typed)
    got: list[Frame] = []
    try:
        for i in range(0, len(data), step):
            dec.receive_data(data[i : i + step])
            got.extend(drain(dec))
    except RemoteProtocolError as exc:
        if got:  # the first frame came out whole; what follows it is arbitrary bytes
            return
        event(f"{type(exc).__name__}: {str(exc)[:18]}")
        assert type(exc) in allowed, f"{type(exc).__name__}: {exc}; expected one of {allowed}"
        return
    assert not required, f"no error, expected one of {allowed}"
    _magic, _version, op, flags, rid, hlen, plen = fields
    body = data[FIXED.size + hlen :]
    if len(data) >= FIXED.size + hlen and len(body) >= plen:
        first = got[0]
        event("frame decoded")
        assert (first.op, first.request_id, first.flags, bytes(first.payload)) == (
            op, rid, flags, body[:plen])
        sent = data[FIXED.size : FIXED.size + hlen]  # hlen may be mutated: the bytes the frame holds
        plain = msgpack.unpackb(sent, raw=False, strict_map_key=False) if hlen else {}
        if first.message is None:
            assert first.header == plain
        else:  # decoded into its type: the message the plain map converts to
            assert first.message == msgspec.convert(plain, type(first.message))
    else:
        event("incomplete")
        assert got == []  # an incomplete frame is never handed out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.binary(max_size=100_000)), max_size=5),
       st.integers(min_value=1, max_value=70_000))
def test_fuzz_roundtrip_any_split(frames: list[tuple[int, bytes]], step: int) -> None:
    data = b"".join(frame_bytes(op, i, {"i": i}, [p]) for i, (op, p) in enumerate(frames))
    dec = FrameDecoder()
    got: list[Frame] = []
    for i in range(0, len(data), step):
        dec.receive_data(data[i : i + step])
        got.extend(drain(dec))
    assert [(f.op, f.header["i"], bytes(f.payload)) for f in got] == [
        (op, i, p) for i, (op, p) in enumerate(frames)]


@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_scatter_payload_lands_in_each_buffer(step: int) -> None:
    from kvfs.protocol import Scatter

    parts = [bytearray(100_000), bytearray(0), bytearray(3), bytearray(200_000)]
    payload = os.urandom(300_003)
    dec = FrameDecoder(allocator=lambda head: Scatter([memoryview(p) for p in parts]))
    data = frame_bytes(Op.READV, 5, {"x": 1}, [payload]) + frame_bytes(Op.PING, 6, {})
    for i in range(0, len(data), step):
        dec.receive_data(data[i : i + step])
    f, g = drain(dec)
    assert isinstance(f.payload, Scatter) and g.request_id == 6
    assert b"".join(parts) == payload
    assert [bytes(p) for p in f.payload.parts] == [bytes(p) for p in parts]


def _readv_into(views: list[memoryview], src: memoryview) -> int:
    """As readv(2) fills ``views`` from ``src``: in order, the last one maybe in part;
    returns the bytes placed."""
    n = 0
    for v in views:
        k = min(v.nbytes, len(src) - n)
        v[:k] = src[n : n + k]
        n += k
        if n == len(src):
            break
    return n


@pytest.mark.parametrize(("step", "most"), [(1, 1024), (5000, 2), (16_384, 3), (1 << 20, 1024)])
def test_vectored_receives_fill_the_scatter_buffers_across_their_edges(step: int, most: int) -> None:
    """A transport's vectored receive (``payload_views`` then ``payload_updated``) fills
    several buffers per receive, ending anywhere inside one; the rest arrives the plain
    way.  The bytes land in order, and the next frame decodes after the payload."""
    from kvfs.protocol import Scatter

    parts = [bytearray(70_000), bytearray(0), bytearray(3), bytearray(16_384), bytearray(50_000)]
    payload = os.urandom(sum(map(len, parts)))
    dec = FrameDecoder(allocator=lambda head: Scatter([memoryview(p) for p in parts]))
    assert dec.payload_views(most) == []  # nothing arriving yet
    data = memoryview(frame_bytes(Op.READV, 5, {"x": 1}, [payload]) + frame_bytes(Op.PING, 6, {}))
    dec.receive_data(data[:100])  # the header and the first bytes of the payload
    pos = 100
    while views := dec.payload_views(most):
        assert len(views) <= most
        n = _readv_into(views, data[pos : pos + step])
        dec.payload_updated(n)
        pos += n
    dec.receive_data(data[pos:])  # the last buffer (a vectored receive needs two) and PING
    f, g = drain(dec)
    assert isinstance(f.payload, Scatter) and g.request_id == 6
    assert b"".join(parts) == payload
    assert dec.payload_views(most) == []


def test_a_vectored_receive_is_offered_about_vector_bytes_of_many_small_buffers() -> None:
    """A payload over many small buffers (an engine's per-layer regions): each vectored
    receive is offered the buffers from the first unfilled one up to the one holding the
    byte VECTOR_BYTES further on, not every buffer left; across receives ending inside a
    buffer, every byte still lands in order."""
    from kvfs.protocol import VECTOR_BYTES, Scatter

    size = 16 * 1024 + 5
    parts = [bytearray(size) for _ in range(3 * VECTOR_BYTES // size)]
    payload = os.urandom(size * len(parts))
    dec = FrameDecoder(allocator=lambda head: Scatter([memoryview(p) for p in parts]))
    data = memoryview(frame_bytes(Op.READV, 5, {}, [payload]))
    dec.receive_data(data[:1000])
    pos, got = 1000, 0
    while views := dec.payload_views(len(parts)):
        offered = sum(v.nbytes for v in views)
        assert offered - views[-1].nbytes < VECTOR_BYTES  # the last one holds that byte
        assert offered >= min(VECTOR_BYTES, len(data) - pos)
        n = _readv_into(views, data[pos : pos + min(offered, 1_000_003)])  # ends inside a buffer
        dec.payload_updated(n)
        pos += n
        got += 1
    dec.receive_data(data[pos:])
    (f,) = drain(dec)
    assert isinstance(f.payload, Scatter) and b"".join(parts) == payload and got > 3


@pytest.mark.parametrize("vectored", [True, False], ids=["readv", "plain"])
def test_a_dropped_payload_stops_landing_in_its_buffers(vectored: bool) -> None:
    """``drop_payload`` (the caller of a response being received gave up): the rest of the
    payload goes into a throwaway buffer (reused past DROP_BUFFER_BYTES), not the caller's;
    the frame still ends where it should and the next one decodes.  Another request id is
    left alone."""
    from kvfs.protocol import DROP_BUFFER_BYTES, Scatter

    parts = [bytearray(1_500_000), bytearray(3), bytearray(1_200_000)]
    payload = os.urandom(sum(map(len, parts)))
    assert len(payload) > 2 * DROP_BUFFER_BYTES
    sc = Scatter([memoryview(p) for p in parts], _cat)
    dec = FrameDecoder(allocator=lambda head: sc)
    data = memoryview(frame_bytes(Op.READV, 5, {"x": 1}, [payload]) + frame_bytes(Op.PING, 6, {}))
    cut = 200_000
    dec.receive_data(data[:cut])  # the header and the first bytes of the payload
    dec.drop_payload(4)  # not the frame arriving: nothing changes
    dec.receive_data(data[cut : cut + 1000])
    cut += 1000
    got = bytes(parts[0])
    dec.drop_payload(5)
    pos = cut
    while vectored and (views := dec.payload_views(3)):
        n = 0
        for v in views:
            k = min(v.nbytes, 300_000 - n)
            v[:k] = data[pos + n : pos + n + k]
            n += k
        dec.payload_updated(n)
        pos += n
    dec.receive_data(data[pos:])
    f, g = drain(dec)
    assert f.request_id == 5 and g.request_id == 6
    assert isinstance(f.payload, Scatter) and all(p.obj not in parts for p in f.payload.parts)
    body = cut - (len(data) - len(payload) - len(frame_bytes(Op.PING, 6, {})))  # payload bytes before
    assert bytes(parts[0]) == got and got[:body] == payload[:body]  # the drop landed
    assert not any(parts[0][body:]) and not any(parts[1]) and not any(parts[2])  # nothing after
    assert sc.done == []  # no part was full before the drop; the throwaway's are not folded


def _cat(view: memoryview, acc: bytes | int) -> bytes:
    """A Scatter's fold for the tests: the value's bytes as they were when folded."""
    return (acc or b"") + bytes(view)


@pytest.mark.parametrize("head_alone", [False, True], ids=["with-payload", "head-alone"])
@pytest.mark.parametrize("vectored", [False, True], ids=["plain", "readv"])
@pytest.mark.parametrize("step", [1, 1000, 65_536, 300_001])
def test_a_scatters_fold_runs_on_the_bytes_each_receive_lands(vectored: bool, step: int,
                                                             head_alone: bool) -> None:
    """A Scatter's ``fold`` (the client's CRC-32C of a range) runs over the bytes each
    receive lands, while they are fresh in the CPU's caches, not once the whole payload is
    in: after every receive, every payload byte in is folded, and ``done`` holds a result
    for exactly the values whose last byte is in (a value's parts joined by ``joins``;
    empty parts, small parts staged in scratch), each over the value's final bytes (a CRC
    taken as they landed equals the CRC of what the parts hold at the end only if each
    piece was final when folded).  The first receive brings the header and the first
    payload bytes, or the header alone (then steps of 1 and 1000 end a receive exactly at
    the end of the first part with bytes, before the empty one that joins it)."""
    import crc32c

    from kvfs.protocol import Scatter

    sizes = [0, 70_000, 0, 3, 4096, 4096, 0, 70_000, 5, 0]
    joins = [False, False, True, False, False, True, False, False, True, True]
    parts = [bytearray(n) for n in sizes]
    made: list[Scatter] = []
    folded = [0]

    def fold(view: memoryview, acc: int) -> int:
        folded[0] += view.nbytes
        return crc32c.crc32c(view, acc)

    def alloc(head: FrameHead) -> Scatter:
        made.append(Scatter([memoryview(p) for p in parts], fold, joins))
        return made[-1]

    payload = os.urandom(sum(sizes))
    dec = FrameDecoder(allocator=alloc)
    data = memoryview(frame_bytes(Op.READV, 5, {"x": 1}, [payload]) + frame_bytes(Op.PING, 6, {}))
    start = len(data) - len(payload) - len(frame_bytes(Op.PING, 6, {}))  # where the payload starts
    ends = list(accumulate(sizes))
    last = [k for k in range(len(sizes)) if k + 1 == len(sizes) or not joins[k + 1]]  # values' last parts
    pos = 0
    while pos < len(data):
        views = dec.payload_views(len(parts)) if vectored else []
        if views:
            n = _readv_into(views, data[pos : pos + step])
            dec.payload_updated(n)
        else:
            buf = dec.get_buffer(-1)
            n = min(buf.nbytes, start if head_alone and not pos else step, len(data) - pos)
            buf[:n] = data[pos : pos + n]
            dec.buffer_updated(n)
        pos += n
        if made:
            got = min(max(pos - start, 0), len(payload))
            assert folded[0] == got
            assert len(made[0].done) == sum(1 for k in last if ends[k] <= got)
    f, g = drain(dec)
    assert f.payload is made[0] and g.request_id == 6
    values = [b"".join(parts[a : b + 1]) for a, b in zip([0, *(k + 1 for k in last[:-1])], last, strict=True)]
    assert made[0].done == [crc32c.crc32c(v) for v in values] and len(values) == 6
    assert b"".join(parts) == payload


def test_small_scatter_parts_share_one_receive() -> None:
    """Parts smaller than the inline limit are received together into the scratch buffer
    and copied out (one receive for the run of them, as a socket filling each buffer it is
    handed would take); a large part is received in place; the next frame still parses."""
    from kvfs.protocol import Scatter

    sizes = [4096] * 40 + [1] + [0] + [200_000] + [4096] * 3 + [70_000] + [5]
    parts = [bytearray(n) for n in sizes]
    payload = os.urandom(sum(sizes))
    dec = FrameDecoder(allocator=lambda head: Scatter([memoryview(p) for p in parts]))
    data = memoryview(frame_bytes(Op.READV, 5, {}, [payload]) + frame_bytes(Op.PING, 6, {}))
    receives, in_place = 0, []
    while data.nbytes:  # like a socket: each receive fills as much of the buffer as it has
        buf = dec.get_buffer(-1)
        n = min(buf.nbytes, data.nbytes)
        buf[:n] = data[:n]
        in_place += [p for p in parts if buf.obj is p]
        data = data[n:]
        dec.buffer_updated(n)
        receives += 1
    f, g = drain(dec)
    assert isinstance(f.payload, Scatter) and g.request_id == 6
    assert b"".join(parts) == payload
    assert [len(p) for p in in_place] == [200_000, 70_000]  # the large parts, in place
    assert receives <= 6  # header, the 41 small parts, 200 kB, 3 small, 70 kB, the tail + PING


@pytest.mark.parametrize("one_buffer", [False, True])
def test_with_head_first_a_payload_is_received_in_place_after_its_header(one_buffer: bool) -> None:
    """A client with answers pending that have a payload place of their own (``head_first``:
    its sinks) on a vectored transport, after an answer whose payload had a place of its
    own, is offered HEAD_PEEK bytes by a receive between frames: the next header arrives
    alone, and a large payload's bytes after it land in their place (43 values' views, as a
    4 KiB x 128 get_into's; or one pooled buffer, as get_many's), not in scratch to be copied
    out.  After a small frame (e.g. one key's answer) a receive is offered all of scratch."""
    from kvfs.protocol import HEAD_PEEK, Scatter

    sizes = [4096 * 43] if one_buffer else [4096] * 43
    parts = {rid: [bytearray(n) for n in sizes] for rid in (5, 7)}
    payloads = {rid: os.urandom(4096 * 43) for rid in (5, 7)}
    dec = FrameDecoder(allocator=lambda head: Scatter([memoryview(p) for p in parts[head.request_id]]))
    dec.vectored = True
    dec.head_first = {7: "a sink"}
    got: list[Frame] = []
    in_scratch = 0  # bytes received into scratch after the first answer
    # like a socket: the first answer arrives, then the second and PING; each receive fills
    # what it can of what has arrived
    for data in (memoryview(frame_bytes(Op.READV, 5, {}, [payloads[5]])),
                 memoryview(frame_bytes(Op.READV, 7, {}, [payloads[7]]) + frame_bytes(Op.PING, 9, {}))):
        while data.nbytes:
            buf = dec.get_buffer(-1)
            n = min(buf.nbytes, data.nbytes)
            buf[:n] = data[:n]
            if got and not any(buf.obj is p for p in parts[7]):
                in_scratch += n
            data = data[n:]
            dec.buffer_updated(n)
            got += drain(dec)
    assert [f.request_id for f in got] == [5, 7, 9]
    assert [b"".join(parts[rid]) for rid in (5, 7)] == [payloads[5], payloads[7]]
    assert in_scratch <= 2 * HEAD_PEEK  # the second header and PING (and a few payload bytes)
    assert dec.get_buffer(-1).nbytes > HEAD_PEEK  # after PING's small frame: no peek
    data = memoryview(frame_bytes(Op.READV, 5, {}, [payloads[5]]))  # another one in place
    while data.nbytes:
        buf = dec.get_buffer(-1)
        n = min(buf.nbytes, data.nbytes)
        buf[:n] = data[:n]
        data = data[n:]
        dec.buffer_updated(n)
        got += drain(dec)
    assert dec.get_buffer(-1).nbytes == HEAD_PEEK  # answers with places still pending: a peek
    dec.head_first = {}
    assert dec.get_buffer(-1).nbytes > HEAD_PEEK  # none pending (or a server's decoder): no peek


def test_scatter_of_the_wrong_size_is_refused() -> None:
    from kvfs.protocol import Scatter

    dec = FrameDecoder(allocator=lambda head: Scatter([memoryview(bytearray(10))]))
    with pytest.raises(RemoteProtocolError, match="wrong size"):
        dec.receive_data(frame_bytes(Op.READV, 1, {}, [b"x" * 100_000]))
