"""CPU per key of one service's handling of 4 KiB x 128 calls, in one process, no sockets:
the per-key work of each path alone, steadier on a shared machine than a whole cluster's
``kvfs bench --cpu`` (bench/RESULTS.md, "per-key CPU at 4 KiB").

    python -m kvfs.bench.percall PATH [--calls N] [--fsync MODE]

PATH is one of:

- ``append``: a chunkserver's APPEND: frame bytes fed to a ``FrameDecoder`` (payloads into
  a ``ReceivePool``, 64 KiB a receive), the typed request, ``ChunkStore.append``
  (``--fsync``, default batch), the answer's frame; 4 APPENDs at a time.
- ``readv``: a chunkserver's READV of 128 random values out of 4,096 in one chunk:
  frame, typed request, ``check_ranges``, ``ChunkStore.readv_into``, the answer's frame.
- ``put``: the client's ``WritePath.put`` and layout cache, with a link that answers at
  once (the APPEND and COMMIT frames encoded, their answers decoded).
- ``get``: the client's ``get_many`` of 128 cached layouts, with a link whose READV
  answers land in the sink the read path asks for, as the transport's would.
- ``get_into``: the same reads by ``get_into``, each of the 4 calls at a time into its
  own 128 views of one region (as ``kvfs bench --api get_into`` passes them), and by
  ``get_many`` again, alternating 3 times in this one process: the medians of each and
  of the 3 ratios.
- ``commit``: meta's COMMIT handler (4 at a time, overwrites of 8,192 keys, SQLite as
  configured by default), the request decoded and the answer encoded as the server does.
- ``lookups``: meta's EXISTS, MATCH_PREFIX and LOOKUP handlers on 128 present keys.

Prints ``us/key`` (``time.process_time``: every thread of this process).  ``--gc`` adds
``gc``: the CPU Python's cyclic GC took in the measured rounds of every path, per key, and
its collections by generation (``gc.callbacks``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from statistics import median
from typing import Any

import crc32c

from kvfs import rpc
from kvfs._loop import run
from kvfs.config import ClientConfig, FsyncMode, MetaConfig
from kvfs.layout import Extent, Layout, Replica
from kvfs.packed import pack
from kvfs.protocol import (
    Flag,
    Frame,
    FrameDecoder,
    FrameHead,
    ReceivePool,
    Scatter,
    encode_frame,
    header_key,
    pack_header,
)
from kvfs.rpc import Op
from kvfs.server import reply_of

N = 128  # keys per call
BS = 4096


def _keys(n: int, tag: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest().encode() for i in range(n)]


def _frame(op: int, msg: Any, payload: Sequence[memoryview] = ()) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(op, 1, msg, list(payload)))


def _typed(op: Op, header: bytes, flags: Flag = Flag.NONE) -> Any:
    """A request's header (``flags`` RESPONSE: an answer's) decoded and checked as its
    receiver does: straight from its bytes into its type (:data:`kvfs.rpc.REQUESTS`,
    :data:`kvfs.rpc.ANSWERS`)."""
    return (rpc.ANSWERS if flags else rpc.REQUESTS)[header_key(op, flags)](header)


class GcTimer:
    """Python's cyclic GC while measuring (``--gc``): CPU seconds (``time.process_time``, as
    the paths' own figure) and collections by generation, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds, self.keys, self.collections, self._start = 0.0, 0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.seconds += time.process_time() - self._start
            self.collections[info["generation"]] += 1

    def line(self) -> str:
        return (f"gc: {self.seconds / max(self.keys, 1) * 1e6:.2f} us/key "
                f"(collections by generation {'/'.join(map(str, self.collections))})")


GC: GcTimer | None = None  # set by --gc


async def _measure(one: Callable[[int], Awaitable[object]], calls: int, at_once: int) -> float:
    """CPU us per key of ``calls`` rounds of ``at_once`` concurrent ``one(i)``, after a warm-up."""
    for r in range(8):
        await asyncio.gather(*(one(r * at_once + k) for k in range(at_once)))
    if GC is not None:
        # (mypy takes ``gc`` for this repository's gc/ folder, kvfs.gc: the stdlib's here)
        gc.callbacks.append(GC)  # type: ignore[attr-defined]
        GC.keys += calls * at_once * N
    t = time.process_time()
    try:
        for r in range(calls):
            await asyncio.gather(*(one(r * at_once + k) for k in range(at_once)))
        return (time.process_time() - t) / (calls * at_once * N) * 1e6
    finally:
        if GC is not None:
            gc.callbacks.remove(GC)  # type: ignore[attr-defined]


async def append_path(calls: int, fsync: FsyncMode, tmp: Path) -> float:
    from kvfs.chunkserver.store import ChunkStore

    keys, vals = _keys(N), [os.urandom(BS) for _ in range(N)]
    crcs = [crc32c.crc32c(v) for v in vals]
    recs = [rpc.RecordHead(k, BS, c, None, 1, BS, c, 0) for k, c in zip(keys, crcs, strict=True)]
    frame = _frame(Op.APPEND, rpc.Append(records=recs), [memoryview(v) for v in vals])
    store = ChunkStore(tmp, chunk_bytes=64 << 20, fsync=fsync)
    store.server_id = 1
    pool = ReceivePool(128 << 20, min_bytes=0)  # as kvfs.server's
    decoders = [FrameDecoder(allocator=pool, typed=rpc.REQUESTS) for _ in range(4)]

    async def one(i: int) -> object:
        dec, view = decoders[i % 4], memoryview(frame)
        while view.nbytes:  # as a socket delivers it
            buf = dec.get_buffer(-1)
            n = min(buf.nbytes, view.nbytes, 65536)
            buf[:n] = view[:n]
            view = view[n:]
            dec.buffer_updated(n)
        f = dec.next_event()
        assert isinstance(f, Frame) and not isinstance(f.payload, Scatter)
        req = rpc.message(f, rpc.Append)
        locs = await store.append(req.records, memoryview(f.payload))
        out = encode_frame(Op.APPEND, 1, rpc.Appended(locations=locs), ())
        pool.give(f.payload)
        return out

    try:
        return await _measure(one, calls, 4)
    finally:
        await store.close()


async def readv_path(calls: int, tmp: Path) -> float:
    from kvfs.chunkserver.store import ChunkStore, check_ranges

    store = ChunkStore(tmp, chunk_bytes=64 << 20, fsync=FsyncMode.NEVER)
    store.server_id = 1
    locs: list[tuple[int, int]] = []
    for j in range(4096 // N):
        vals = [os.urandom(BS) for _ in range(N)]
        recs = [(k, BS, crc32c.crc32c(v), None) for k, v in zip(_keys(N, f"{j}-"), vals, strict=True)]
        locs += await store.append(recs, memoryview(b"".join(vals)))
    rnd = random.Random(1)
    frames = [_frame(Op.READV, rpc.ReadV(ranges=[rpc.Range(c, o, BS) for c, o in rnd.sample(locs, N)]))
              for _ in range(64)]
    decoders = [FrameDecoder(typed=rpc.REQUESTS) for _ in range(4)]

    async def one(i: int) -> object:
        dec = decoders[i % 4]
        dec.receive_data(frames[i % 64])
        f = dec.next_event()
        assert isinstance(f, Frame)
        req = rpc.message(f, rpc.ReadV)
        check_ranges(req.ranges, 4096, 64 << 20)
        payload, _, errors = await store.readv_into(req.ranges)
        reply = rpc.ReadVReply(errors={i: rpc.WireError(e.code, e.message) for i, e in errors.items()})
        return encode_frame(Op.READV, 1, reply, [payload])

    try:
        return await _measure(one, calls, 4)
    finally:
        await store.close()


class _Server:
    def __init__(self, sid: int) -> None:
        self.server_id, self.free, self.usable, self.alive, self.down = sid, 1 << 40, True, True, False


class _Link:
    """What the client's write and read paths ask of ``ClusterLink``, answered at once:
    requests encoded, answers decoded, READV answers into the sink the caller gives."""

    meta_open = True
    max_header = 0  # (no server's limit known: AsyncClient.parts)

    def __init__(self, values: dict[tuple[int, int], bytes] | None = None) -> None:
        self.values = values or {}

    async def servers(self, refresh: bool = False) -> list[_Server]:
        return [_Server(1), _Server(2), _Server(3)]

    def alive(self) -> dict[int, bool]:
        return {1: True, 2: True, 3: True}

    def timed_out(self) -> set[int]:
        return set()

    def bind_loop(self) -> None:
        pass

    @property
    def loop(self) -> asyncio.AbstractEventLoop:  # the loop it is used on (the layout cache's TOUCH)
        return asyncio.get_running_loop()

    async def call_meta(self, req: Any) -> Any:
        pack_header(req)
        if isinstance(req, rpc.Commit):
            return _typed(Op.COMMIT, pack_header(rpc.Committed(created=1.0, expires_at=None)), Flag.RESPONSE)
        return None  # (TOUCH)

    async def call_server(self, sid: int, req: Any, payload: Sequence[memoryview] = (),
                          sink: Callable[[FrameHead], Any] | None = None) -> tuple[Any, Any]:
        encode_frame(int(rpc.OP_OF[type(req)]), 1, req, list(payload))
        if isinstance(req, rpc.Append):
            locs = [(sid << 40 | 1, 1000 + i * 4200) for i in range(len(req.records))]
            return _typed(Op.APPEND, pack_header(rpc.Appended(locations=locs)), Flag.RESPONSE), b""
        assert sink is not None
        ranges = _typed(Op.READV, pack_header(req)).ranges
        data = [self.values[(c, o)] for c, o, _ in ranges]
        answer = _typed(Op.READV, pack_header(rpc.ReadVReply()), Flag.RESPONSE)
        buf = sink(FrameHead(int(Op.READV), 1, Flag.RESPONSE, None, sum(map(len, data)), answer))
        if isinstance(buf, Scatter):
            for part, d in zip(buf.parts, data, strict=True):
                part[:] = d
        else:
            pos = 0
            for d in data:
                buf[pos : pos + len(d)] = d
                pos += len(d)
        return answer, buf


async def put_path(calls: int) -> float:
    from kvfs.buffers import as_parts
    from kvfs.layoutcache import LayoutCache
    from kvfs.writepath import WritePath

    keys, vals = _keys(N), [os.urandom(BS) for _ in range(N)]
    link: Any = _Link()
    writer = WritePath(link, ClientConfig(), time.time)
    cache = LayoutCache(link, 100_000)

    async def one(i: int) -> object:
        lays = await writer.put(keys, [as_parts(v) for v in vals], replicas=1, ttl=None)
        cache.put_many(keys, lays)
        return lays

    return await _measure(one, calls, 1)


async def get_path(calls: int, into: bool = False) -> dict[str, float]:
    from kvfs.client import AsyncClient

    keys = _keys(4096)
    values: dict[tuple[int, int], bytes] = {}
    layouts = []
    for i in range(len(keys)):
        v, sid = os.urandom(BS), 1 + i % 2
        c = crc32c.crc32c(v)
        values[(sid << 40 | 1, i * 4200)] = v
        layouts.append(Layout(BS, c, 1.0, None, (Extent(BS, c, (Replica(sid, sid << 40 | 1, i * 4200),)),)))
    kv = AsyncClient("127.0.0.1:1", token="x" * 32)
    link: Any = _Link(values)
    kv._link = kv.reader._link = kv.layout_cache._link = link
    kv.layout_cache.put_many(keys, layouts)
    rnd = random.Random(1)
    batches = [rnd.sample(keys, N) for _ in range(64)]

    region = memoryview(bytearray(4 * N * BS))
    bufs = [[region[(w * N + k) * BS : (w * N + k + 1) * BS] for k in range(N)] for w in range(4)]

    async def many(i: int) -> object:
        return await kv.get_many(batches[i % 64])

    async def into_bufs(i: int) -> object:  # the 4 calls of a round are i % 4 = 0..3
        return await kv.get_into(batches[i % 64], bufs[i % 4])

    try:
        if not into:
            return {"get": await _measure(many, calls, 4)}
        got: list[tuple[float, float]] = []
        for _ in range(3):
            got.append((await _measure(many, calls, 4), await _measure(into_bufs, calls, 4)))
        return {"get": median(m for m, _ in got), "get_into": median(i for _, i in got),
                "get_into/get": median(i / m for m, i in got)}
    finally:
        await kv.layout_cache.close(1.0)  # its last TOUCH, to the fake link


async def _meta(tmp: Path) -> Any:
    from kvfs.meta.service import MetaService

    meta = MetaService(MetaConfig(data=tmp))
    await meta.rpc_register(rpc.Register(server_id=1, addr="127.0.0.1:1"), memoryview(b""))
    return meta


def _layouts(first: int) -> list[Layout]:
    return [Layout(BS, 7, 0.0, None, (Extent(BS, 7, (Replica(1, 1 << 40 | 1, (first + i) * 4200),)),))
            for i in range(N)]


async def commit_path(calls: int, tmp: Path) -> float:
    keys = _keys(8192)
    meta = await _meta(tmp)
    frames = [pack_header(rpc.Commit(packed=pack([keys[(j * N + i) % 8192] for i in range(N)], _layouts(j * N))))
              for j in range(256)]

    async def one(i: int) -> object:
        out, _ = await meta.rpc_commit(_typed(Op.COMMIT, frames[i % 256]), memoryview(b""))
        return pack_header(out)

    try:
        return await _measure(one, calls, 4)
    finally:
        await meta.close()


async def lookup_paths(calls: int, tmp: Path) -> dict[str, float]:
    keys = _keys(8192)
    meta = await _meta(tmp)
    for j in range(8192 // N):
        await meta.rpc_commit(rpc.Commit(packed=pack(keys[j * N : (j + 1) * N], _layouts(j * N))),
                              memoryview(b""))
    out = {}
    try:
        for name, typ, handler in (("exists", rpc.Exists, meta.rpc_exists),
                                   ("match_prefix", rpc.MatchPrefix, meta.rpc_match_prefix),
                                   ("lookup", rpc.Lookup, meta.rpc_lookup)):
            frames = [pack_header(typ(keys=keys[j * N : (j + 1) * N])) for j in range(64)]

            async def one(i: int, typ: Any = typ, handler: Any = handler, frames: list[bytes] = frames) -> object:
                answer, _ = await reply_of(handler(_typed(rpc.OP_OF[typ], frames[i % 64]), memoryview(b"")))
                return pack_header(answer)

            out[name] = await _measure(one, calls, 1)
    finally:
        await meta.close()
    return out


PATHS = ("append", "readv", "put", "get", "get_into", "commit", "lookups")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.percall", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", choices=PATHS)
    ap.add_argument("--calls", type=int, default=200, help="measured rounds of calls (default 200)")
    ap.add_argument("--fsync", choices=[m.value for m in FsyncMode], default="batch",
                    help="append: the store's durability (default batch)")
    ap.add_argument("--gc", action="store_true",
                    help="also print the CPU per key of Python's cyclic GC in the measured rounds")
    ns = ap.parse_args(argv)
    global GC
    GC = GcTimer() if ns.gc else None
    with tempfile.TemporaryDirectory(prefix="kvfs-percall-") as d:
        tmp = Path(d)
        if ns.path == "append":
            res: dict[str, float] = {"append": run(append_path(ns.calls, FsyncMode(ns.fsync), tmp))}
        elif ns.path == "readv":
            res = {"readv": run(readv_path(ns.calls, tmp))}
        elif ns.path == "put":
            res = {"put": run(put_path(ns.calls))}
        elif ns.path in ("get", "get_into"):
            res = run(get_path(ns.calls, into=ns.path == "get_into"))
        elif ns.path == "commit":
            res = {"commit": run(commit_path(ns.calls, tmp))}
        else:
            res = run(lookup_paths(ns.calls, tmp))
    for name, us in res.items():
        print(f"{name}: {us:.2f}" if "/" in name else f"{name}: {us:.2f} us/key")
    if GC is not None:
        print(GC.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
