"""Every RPC of meta and chunkservers fed bad requests generated from the table in
:mod:`kvfs.rpc`: each field of each request missing, mistyped and out of bounds (and, in
rows and layouts, each field of the first element).  Every one must be answered with
``InvalidArgument`` naming that field, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
import msgspec
import msgspec.inspect as mi
import pytest

from kvfs import rpc
from kvfs.address import parse_addr
from kvfs.errors import InvalidArgument, KVFSError
from kvfs.handshake import Role
from kvfs.launcher import LocalCluster
from kvfs.protocol import FIXED, MAGIC, PROTOCOL_VERSION, Flag, Frame, FrameDecoder
from kvfs.rpc import RPCS, Op, Service
from kvfs.transport import Connection

CONNECTION_OPS = {Op.HELLO, Op.AUTH}  # checked by the connection before dispatch (test_faults)
BIG = 10_000  # a length bound up to this is tested by sending one element more


def _strip(t: mi.Type) -> tuple[mi.Type, bool]:
    """(the non-None member of ``X | None``, whether None is allowed)."""
    if isinstance(t, mi.UnionType):
        rest = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(t.types)
    return t, False


def _fields(t: mi.Type) -> tuple[mi.Field, ...] | None:
    if isinstance(t, (mi.StructType, mi.NamedTupleType)):
        return t.fields
    return None


def _is_array(t: mi.Type) -> bool:
    return isinstance(t, mi.NamedTupleType) or (isinstance(t, mi.StructType) and t.array_like)


def valid(t: mi.Type) -> Any:
    """A smallest value of type ``t`` that passes its checks."""
    t, nullable = _strip(t)
    if nullable:
        return None
    if isinstance(t, mi.IntType):
        return t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else 0)
    if isinstance(t, mi.FloatType):
        return t.ge if t.ge is not None else (t.gt + 1.0 if t.gt is not None else 0.0)
    if isinstance(t, mi.BytesType):
        return b"k" * max(1, t.min_length or 0)
    if isinstance(t, mi.StrType):
        return "a" * max(1, t.min_length or 0)
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.UnionType):
        return valid(t.types[0])
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return [valid(t.item_type)] * max(1, t.min_length or 0)
    if isinstance(t, mi.DictType):
        return {valid(t.key_type): valid(t.value_type)}
    if isinstance(t, mi.TupleType):  # a fixed-length array (an APPEND answer's location)
        return [valid(item) for item in t.item_types]
    fields = _fields(t)
    if fields is not None:
        if _is_array(t):
            return [valid(f.type) for f in fields]
        return {f.encode_name: valid(f.type) for f in fields if f.required}
    raise AssertionError(f"no valid value for {t}")


def wrong_type(t: mi.Type) -> Any:
    t, _ = _strip(t)
    return 12345 if isinstance(t, mi.StrType) else "not this type"


def out_of_bounds(t: mi.Type) -> list[Any]:
    t, _ = _strip(t)
    out: list[Any] = []
    if isinstance(t, (mi.IntType, mi.FloatType)):
        one = 1 if isinstance(t, mi.IntType) else 1.0
        if t.ge is not None:
            out.append(t.ge - one)
        if t.gt is not None:
            out.append(t.gt)
        if t.le is not None:
            out.append(t.le + one if isinstance(t, mi.IntType) else t.le * 2 + 1)
        if t.lt is not None:
            out.append(t.lt)
        if isinstance(t, mi.FloatType) and out:
            out.append(float("nan"))
    elif isinstance(t, (mi.BytesType, mi.StrType, mi.ListType, mi.VarTupleType, mi.DictType)):
        if t.min_length:
            out.append(valid(t)[:0])
        if t.max_length is not None and t.max_length <= BIG:
            if isinstance(t, mi.BytesType):
                out.append(b"k" * (t.max_length + 1))
            elif isinstance(t, mi.StrType):
                out.append("a" * (t.max_length + 1))
            elif isinstance(t, mi.DictType):
                out.append({i: valid(t.value_type) for i in range(t.max_length + 1)})
            else:
                out.append([valid(t.item_type)] * (t.max_length + 1))
        if isinstance(t, mi.StrType) and t.pattern is not None:
            out.append("a\x00")  # a character no field's pattern allows (a lease holder's)
    return out


def mutations(t: mi.Type, depth: int = 8) -> Iterator[tuple[str, Any, Any]]:
    """(path below the field, the bad value there, the field's whole value) for type ``t``."""
    for v in [wrong_type(t), *out_of_bounds(t)]:
        yield "", v, v
    if depth == 0:
        return
    inner, _ = _strip(t)
    if isinstance(inner, (mi.ListType, mi.VarTupleType)):
        for path, leaf, v in mutations(inner.item_type, depth - 1):
            yield "[0]" + path, leaf, [v]
    elif isinstance(inner, mi.DictType):
        for _, leaf, v in mutations(inner.value_type, depth - 1):
            yield "[value]", leaf, {valid(inner.key_type): v}
        key = wrong_type(inner.key_type)
        yield "[key]", key, {key: valid(inner.value_type)}
    elif isinstance(inner, mi.TupleType):
        good = valid(inner)
        yield "", good[:-1], good[:-1]  # an element short
        for i, item in enumerate(inner.item_types):
            for path, leaf, v in mutations(item, depth - 1):
                yield f"[{i}]" + path, leaf, [*good[:i], v, *good[i + 1 :]]
    elif _is_array(inner):
        fields = _fields(inner)
        assert fields is not None
        good = valid(inner)
        required = sum(1 for f in fields if f.required)  # trailing fields may have defaults
        yield "", good[: required - 1], good[: required - 1]  # a required field short
        for i, f in enumerate(fields):
            for path, leaf, v in mutations(f.type, depth - 1):
                yield f"[{i}]" + path, leaf, [*good[:i], v, *good[i + 1 :]]


def bad_requests(request: type[msgspec.Struct]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(what, header, text the error must contain) for every field of ``request``."""
    info = mi.type_info(request)
    assert isinstance(info, mi.StructType)
    base = {f.encode_name: valid(f.type) for f in info.fields if f.required}
    yield "unknown field", {**base, "no_such_field": 1}, "no_such_field"
    for f in info.fields:
        name = f.encode_name
        if f.required:
            yield f"{name} missing", {k: v for k, v in base.items() if k != name}, f"`{name}`"
        for path, leaf, v in mutations(f.type):
            yield f"{name}{path} = {leaf!r:.60}", {**base, name: v}, f"$.{name}"


def test_every_field_is_mutated() -> None:
    """The generator itself: a bounded field of each kind yields its bad values."""
    cases = {what: expect for what, _, expect in bad_requests(rpc.Lookup)}
    assert "keys missing" in cases and "unknown field" in cases
    assert any(w.startswith("keys = []") for w in cases)  # below min_length
    assert any(w.startswith("keys[0] = b''") for w in cases)  # an empty key
    assert any(w.startswith("keys[0] = b'kkkk") for w in cases)  # a key over 1 KiB
    commit = [w for w, _, _ in bad_requests(rpc.Commit)]
    assert any(w.startswith("items[0][1][4][0][2][0][1] = -1") for w in commit)  # a replica's chunk id
    assert any(w.startswith("ttl_s = nan") for w in commit)
    release = [w for w, _, _ in bad_requests(rpc.Release)]
    assert any(w.startswith("holder = 'a\\x00'") for w in release)  # outside its pattern


def _both_ways(data: bytes, typ: type[Any], typed: Mapping[int, Any], op: Op, flags: Flag,
               ) -> tuple[str, bool]:
    """What a header's bytes decode to through a decoder with typed decoders (and
    :func:`kvfs.rpc.message`), and what the plain way (msgpack map, then its type) makes of
    them: "" when the same, else both; and whether the typed decode made the message."""
    def plain() -> str:
        try:
            return repr(rpc.decode(msgpack.unpackb(data, raw=False, strict_map_key=False), typ))
        except msgspec.ValidationError as exc:
            return f"invalid: {exc}"

    dec = FrameDecoder(typed=typed)
    dec.receive_data(FIXED.pack(MAGIC, PROTOCOL_VERSION, op, int(flags), 1, len(data), 0) + data)
    frame = dec.next_event()
    assert isinstance(frame, Frame)
    try:
        got = repr(rpc.message(frame, typ))
    except msgspec.ValidationError as exc:
        got = f"invalid: {exc}"
    want = plain()
    return ("" if got == want else f"{op.name} {data!r:.80}: typed {got[:200]} / plain {want[:200]}",
            frame.message is not None)


def test_typed_and_plain_decodes_agree_on_every_header() -> None:
    """Every request and every answer of the table, well formed and with each field missing,
    mistyped and out of bounds, as a peer's msgpack bytes: decoded straight into its type
    (:data:`kvfs.rpc.REQUESTS`, :data:`kvfs.rpc.ANSWERS`) it is the same message, or the
    same error in the same words, as the plain map checked against its type (what a peer of
    before made of the same bytes: the wire is unchanged)."""
    differ: list[str] = []
    checked = made = 0
    for op, r in RPCS.items():
        sides = [(r.response, rpc.ANSWERS, Flag.RESPONSE)]
        if op not in CONNECTION_OPS:
            sides.append((r.request, rpc.REQUESTS, Flag.NONE))
        for typ, typed, flags in sides:
            info = mi.type_info(typ)
            assert isinstance(info, mi.StructType)
            good = {f.encode_name: valid(f.type) for f in info.fields if f.required}
            headers = [good] + [h for _, h, _ in bad_requests(typ)]
            for header in headers:
                data = msgpack.packb(header, use_bin_type=True)
                difference, typed_made = _both_ways(data, typ, typed, op, flags)
                if difference:
                    differ.append(difference)
                checked += 1
                made += typed_made
    assert not differ, "\n".join(differ[:20])
    assert checked > 1000 and made > 2 * len(RPCS)  # (each answer, most requests, some mutations)


async def _fuzz(addr: str, tokens: Mapping[Role, str], service: Service) -> tuple[int, list[str]]:
    """Returns (InvalidArgument answers naming the field, everything else that happened).
    Each op is sent over a connection of the first role the table lets call it."""
    host, port = parse_addr(addr)
    conns = {role: await Connection.open(host, port, tokens[role], request_timeout_s=30)
             for role in (Role.ADMIN, Role.SERVER)}
    named = 0
    wrong: list[str] = []
    try:
        for op, r in RPCS.items():
            if r.service is not service or op in CONNECTION_OPS:
                continue
            conn = conns[Role.ADMIN if Role.ADMIN in r.roles else Role.SERVER]
            for what, header, expect in bad_requests(r.request):
                try:
                    await conn.call_raw(op, header)
                except InvalidArgument as exc:
                    if expect in exc.message:
                        named += 1
                    else:
                        wrong.append(f"{op.name} {what}: error does not name {expect!r}: {exc.message}")
                except KVFSError as exc:
                    wrong.append(f"{op.name} {what}: {type(exc).__name__}: {exc}")
                else:
                    wrong.append(f"{op.name} {what}: accepted")
        for conn in conns.values():
            assert (await conn.call(rpc.Ping())).service == service.value
    finally:
        for conn in conns.values():
            conn.close()
    return named, wrong


@pytest.mark.parametrize("service", [Service.META, Service.CHUNKSERVER])
async def test_every_bad_field_is_named(cluster: LocalCluster, service: Service) -> None:
    addr = cluster.addr
    if service is Service.CHUNKSERVER:
        cs = cluster.chunkservers[0]
        assert cs is not None
        addr = "kvfs://" + cs.addr
    expected = sum(len(list(bad_requests(r.request))) for op, r in RPCS.items()
                   if r.service is service and op not in CONNECTION_OPS)
    named, wrong = await _fuzz(addr, cluster.tokens, service)
    assert wrong == []
    assert named == expected > 50
    async with cluster.client() as kv:  # and still works for a real client
        await kv.put_many({f"f{i}": b"v" * 100 for i in range(30)})
        assert await kv.get_many([f"f{i}" for i in range(30)]) == [b"v" * 100] * 30


async def test_bad_packed_commits_are_named_and_meta_keeps_serving(cluster: LocalCluster) -> None:
    """The packed COMMIT form (kvfs.packed) over a real connection: every malformed blob of
    test_packed, a layout naming an unknown chunkserver, metadata over ``--max-key-meta``
    are refused naming what is wrong; the two forms commit the same layouts."""
    from test_packed import BAD, MIXED

    from kvfs.layout import Extent, Layout, Replica
    from kvfs.packed import pack

    host, port = parse_addr(cluster.addr)
    conn = await Connection.open(host, port, cluster.tokens[Role.CLIENT], request_timeout_s=30)
    try:
        for what, blob, expect in BAD:
            with pytest.raises(InvalidArgument) as exc:
                await conn.call_raw(Op.COMMIT, {"packed": blob()})
            if len(blob()) >= 20:  # (shorter: the typed field's min_length names $.packed)
                assert expect in exc.value.message, what
            assert "$.packed" in exc.value.message, what
        with pytest.raises(InvalidArgument, match="not both"):
            await conn.call_raw(Op.COMMIT, {"packed": pack([b"k"], [MIXED[0][1]]),
                                            "items": [[b"k", [0, 0, 0.0, None, []]]]})
        with pytest.raises(InvalidArgument, match="names unknown chunkserver 999"):
            await conn.call(rpc.Commit(packed=pack([b"k"], [
                Layout(1, 0, 0.0, None, (Extent(1, 0, (Replica(999, 999 << 40, 0),)),))])))
        limit = cluster.meta_config.max_key_meta_bytes
        big = Layout(0, 0, 0.0, None, (), b"m" * (limit + 1))
        with pytest.raises(InvalidArgument, match=r"metadata of \d+ bytes for key b'km' is larger"):
            await conn.call(rpc.Commit(packed=pack([b"km"], [big])))
        # both forms, the same layouts (empty values: no chunk needed)
        lay = Layout(0, 0, 0.0, None, (), b"\x80")
        a = await conn.call(rpc.Commit(items=[rpc.CommitItem(b"by-items", lay)]))
        b = await conn.call(rpc.Commit(packed=pack([b"by-packed"], [lay])))
        got = (await conn.call(rpc.Lookup(keys=[b"by-items", b"by-packed"]))).layouts
        assert got == [lay.stamped(a.created, a.expires_at), lay.stamped(b.created, b.expires_at)]
        assert (await conn.call(rpc.Ping())).service == "meta"
    finally:
        conn.close()
