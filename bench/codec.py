"""RPC header codec cost: typed messages (msgspec, checked) vs plain msgpack maps (unchecked).

``python -m kvfs.bench.codec`` times encoding and decoding the headers of a LOOKUP
request, its answer and a COMMIT, each for a batch of 128 keys (one extent, one
replica per value), and prints microseconds per message.  "msgpack" is the plain
``msgpack.packb``/``unpackb`` of the same bytes into dicts and lists, with no check
of any field; "typed" encodes a :mod:`kvfs.rpc` message and decodes the bytes into
one, checking every field's type and bounds.

Then meta's side of a COMMIT of the same 128 layouts in each of its two forms, as the
server runs it (the header decoded straight from its bytes into a ``Commit`` and
checked, as :class:`kvfs.protocol.FrameDecoder` does with :data:`kvfs.rpc.REQUESTS`, the
layouts stamped, or :func:`kvfs.packed.unpack` for the packed form), and the client's encode of each
(the message built and packed into its header), in µs of this process's CPU per key, for
three layout shapes: one extent of one replica, one extent of three replicas, four
extents (a striped value) of one replica.
"""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import msgspec

from kvfs import rpc
from kvfs.layout import Extent, Layout, Replica
from kvfs.packed import pack, unpack
from kvfs.protocol import Flag, header_key, pack_header

BATCH = 128


def _batch() -> tuple[list[bytes], list[Layout]]:
    keys = [b"k%031d" % i for i in range(BATCH)]
    layouts = [Layout(4096, 123, 0.0, None, (Extent(4096, 123, (Replica(1, (1 << 40) | 5, 4096 * i),)),))
               for i in range(BATCH)]
    return keys, layouts


def _messages() -> list[tuple[str, msgspec.Struct]]:
    keys, layouts = _batch()
    return [
        (f"LOOKUP request ({BATCH} keys)", rpc.Lookup(keys=keys)),
        (f"LOOKUP answer ({BATCH} layouts)", rpc.Layouts(layouts=list(layouts))),
        (f"COMMIT request ({BATCH} items)", rpc.Commit(
            items=[rpc.CommitItem(k, lay) for k, lay in zip(keys, layouts, strict=True)])),
    ]


def _us(fn: Callable[[], Any], number: int = 500, timer: Callable[[], float] = time.perf_counter) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5, timer=timer)) / number * 1e6


def _cpu_us(fn: Callable[[], Any]) -> float:
    """This process's CPU time (steadier than the clock on a loaded machine)."""
    return _us(fn, 300, time.process_time)


def measure() -> list[tuple[str, float, float, float, float]]:
    """(message, msgpack pack, msgpack unpack, typed encode, typed decode+check) in µs."""
    enc = msgspec.msgpack.Encoder()
    out = []
    for name, msg in _messages():
        data = enc.encode(msg)
        plain = msgpack.unpackb(data, raw=False, strict_map_key=False)
        assert msgpack.packb(plain, use_bin_type=True) == data  # the same bytes on the wire
        dec = msgspec.msgpack.Decoder(type(msg))
        out.append((name,
                    _us(lambda p=plain: msgpack.packb(p, use_bin_type=True)),  # type: ignore[misc]
                    _us(lambda d=data: msgpack.unpackb(d, raw=False, strict_map_key=False)),  # type: ignore[misc]
                    _us(lambda m=msg: enc.encode(m)),  # type: ignore[misc]
                    _us(lambda d=data, c=dec: c.decode(d))))  # type: ignore[misc]
    return out


SHAPES = [(1, 1), (1, 3), (4, 1)]  # (extents, replicas) per value: plain, replicated, striped


def _shaped(extents: int, replicas: int) -> list[Layout]:
    return [Layout(4096 * extents, 123, 0.0, None, tuple(
        Extent(4096, 7 + e, tuple(Replica(s + 1, ((s + 1) << 40) | 5, 4096 * i) for s in range(replicas)))
        for e in range(extents))) for i in range(BATCH)]


def measure_commit() -> list[tuple[str, float, float]]:
    """(COMMIT form and layout shape, client encode, meta decode + check + stamp) in µs per key."""
    keys, _ = _batch()

    commit = rpc.REQUESTS[header_key(rpc.Op.COMMIT, Flag.NONE)]

    def meta_nested(data: bytes) -> list[tuple[bytes, Layout]]:
        req = commit(data)
        assert isinstance(req, rpc.Commit)
        return [(k, lay.stamped(1.0, None)) for k, lay in req.items]

    def meta_packed(data: bytes) -> Sequence[tuple[bytes, Layout]]:
        req = commit(data)
        assert isinstance(req, rpc.Commit) and req.packed is not None
        return unpack(req.packed, 1.0, None).staged

    out = []
    for extents, replicas in SHAPES:
        layouts = _shaped(extents, replicas)

        def nested(lays: list[Layout] = layouts) -> rpc.Commit:
            return rpc.Commit(items=[rpc.CommitItem(k, lay) for k, lay in zip(keys, lays, strict=True)])

        def packed(lays: list[Layout] = layouts) -> rpc.Commit:
            return rpc.Commit(packed=pack(keys, lays))

        a, b = pack_header(nested()), pack_header(packed())
        assert meta_nested(a) == meta_packed(b)
        shape = f"{extents} extent(s) x {replicas} replica(s)"
        out += [
            (f"items, {shape}", _cpu_us(lambda f=nested: pack_header(f())) / BATCH,  # type: ignore[misc]
             _cpu_us(lambda d=a: meta_nested(d)) / BATCH),  # type: ignore[misc]
            (f"packed, {shape}", _cpu_us(lambda f=packed: pack_header(f())) / BATCH,  # type: ignore[misc]
             _cpu_us(lambda d=b: meta_packed(d)) / BATCH),  # type: ignore[misc]
        ]
    return out


def main() -> int:
    print(f"{'message':34} {'msgpack pack':>13} {'unpack':>8} {'typed encode':>13} {'decode+check':>13}  (µs)")
    for name, mp_pack, mp_unpack, encode, decode in measure():
        print(f"{name:34} {mp_pack:13.1f} {mp_unpack:8.1f} {encode:13.1f} {decode:13.1f}")
    print(f"\n{'COMMIT of ' + str(BATCH) + ' layouts':40} {'client encode':>13} {'meta decode+check+stamp':>24}  (µs of CPU per key)")
    for form, enc, dec in measure_commit():
        print(f"{form:40} {enc:13.2f} {dec:24.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
