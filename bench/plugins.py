"""Per-page cost of a load through an engine plug-in next to a direct ``get_into``, in one run.

    .engines/sglang/bin/python -m kvfs.bench.plugins sglang     [--pages 256] [--batch 64]
    .engines/lmcache/bin/python -m kvfs.bench.plugins lmcache   [--rounds 8] [--page-kib 128]
    .engines/vllm/bin/python -m kvfs.bench.plugins vllm
    .engines/sglang/bin/python -m kvfs.bench.plugins sglang --model 8b --layout layer_first

Run in the engine's venv (``.ci/engines.sh``).  Starts meta + ``--chunkservers`` chunkservers
as processes (``kvfs.launcher.ProcessCluster``) in a temp dir, stores ``--pages`` pages of
``--page-kib`` through the plug-in, then per round reads them all back in batches of
``--batch`` two ways, each batch read both ways back to back (alternating which goes first):

- **plug-in**: the engine's own call into the plug-in -- SGLang: ``batch_get_v1`` (zero-copy,
  into a real ``MHATokenToKVPoolHost``, ``--layout``); LMCache: the connector's
  ``batched_get`` on LMCache's event loop (allocating from its CPU pool, the chunk header
  scattered off; the objects are given back untimed, as LMCache frees a chunk it used
  however it was read); vLLM: ``submit_load`` of a ``TransferJob``
  into the primary tier, ``drain_jobs``, ``get_finished_jobs``;
- **direct**: ``get_into`` of the same keys on the plug-in's own ``kvfs.Client`` into one
  contiguous buffer per page (the value's size), the simplest way to read them;
- where the plug-in scatters a value over several buffers (SGLang: K and V regions, per layer
  in ``layer_first``; LMCache: chunk header + payload), also ``get_into`` into those same
  buffer lists, directly: what kvfs's scatter costs, apart from the rest of the plug-in's
  code (SGLang: the lists as the plug-in builds them, ``_page_parts``).

``--op lookup`` times the engine's lookup instead, the same way: the plug-in's (SGLang
``batch_exists``, LMCache ``batched_contains``, the ``batch_lookup`` that vLLM's lookup
thread calls) next to the blocking client's own ``match_prefix`` / ``exists_many`` of the
same keys, with the same lease (what the plug-in asks kvfs for, made directly).

``--op lookup`` asks for the same keys every round, so a plug-in that keeps what it built per
key (LMCache's ``kvfs_key_memo``) is timed on keys it has seen.  ``--fresh-keys`` makes every
call ask for keys never asked for before: ``(rounds + 1) x 2 x --pages`` keys are stored
through the plug-in first (a block of ``--pages`` per way per round, the warm-up round
included; at most 256 MiB in all, so use a small ``--page-kib``: 8 is the least LMCache's
geometry takes), each way's calls in a round take their own block, and LMCache's memo of the
keys its puts built is emptied before the rounds: a first lookup by this connector, of chunks
stored before (by another instance, or forgotten).  ``--key-memo`` sets LMCache's
``kvfs_key_memo`` (0: off).

LMCache's chunk keys (``--hash``): by default (``builtin``) they are made as an LMCache 0.5.6
engine makes them: LMCache's own ``ChunkedTokenDatabase`` (built from the run's LMCache config
and metadata) hashes a seeded token sequence of ``--pages`` x 256 tokens chunk by chunk, each
chunk's hash that of the one before and its tokens.  Its default ``pre_caching_hash_algorithm``
is ``builtin``: Python's ``hash()`` of a tuple, so each chunk hash is a signed 64-bit int and
its key text a ``%x`` of up to 16 hex digits, with a ``-`` for half of them.  vLLM has no
``builtin`` hash, so LMCache takes Python's whether vLLM is installed or not; its other choices
(vLLM's ``sha256``/``sha256_cbor``/``xxhash``) are folded to the digest's first 8 bytes, 64 bits
too.  ``--hash sha256`` uses the keys of LMCache's checker (``create_test_key``: a whole
sha256 of a name, 256 bits, 64 hex digits), which the token database never makes: the key
text to format is longer, so the plug-in's lookup costs more there.

``--model``: the KV geometry.  ``small`` (the default) is a 4-layer model whose pages are
``--page-kib`` (SGLang: 8 KV heads, 16-token pages, so 16 KiB regions at 128 KiB pages in
``layer_first``; LMCache: 2 KV heads, 256-token chunks; vLLM: one block of that size).
``8b`` is a Llama-3-8B-class model: 32 layers, 8 KV heads, head_dim 128, bf16 (128 KiB of
K+V per token), in each engine's usual unit: SGLang 64-token pages (8 MiB; ``layer_first``
regions of 128 KiB), LMCache 256-token chunks (32 MiB), vLLM 16-token blocks (2 MiB); with
fewer pages and pages per call by default, so a run holds a few hundred MiB.

Prints per-page microseconds (median and quartiles over the calls), the client process's CPU
per page (``time.process_time`` around each call: the caller's thread, kvfs's IO thread,
the engine's threads; not the chunkservers), and two ratios plug-in / direct: of the total
times, and the median of each back-to-back pair's ratio (less moved by the load of a shared
machine).  Issue 12's target: the plug-in adds at most 20 %, both
<= 1.20.  Every page read through the plug-in is compared with what was stored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvfs.bench.engines import (
    lmcache_config,
    lmcache_storage_manager,
    quiet_import,
    sglang_host_pool,
    sglang_storage,
    vllm_manager,
    vllm_offload_keys,
    vllm_offloading_config,
)
from kvfs.launcher import ProcessCluster

TARGET = 1.20  # issue 12: a plug-in adds at most 20 % per page
FRESH_KIB = 256 << 10  # --fresh-keys: most KiB stored


@dataclass(frozen=True)
class Model:
    """A KV geometry (bf16 K and V) and each engine's unit of it, with the run's defaults."""

    layers: int
    heads: int  # KV heads
    dim: int  # head_dim; 0: set by --page-kib
    sglang_page: int  # tokens per SGLang page
    lmcache_heads: int
    vllm_block: int  # tokens per vLLM block; 0: one block is --page-kib
    pages: dict[str, int]  # default --pages per engine
    batch: dict[str, int]  # default --batch per engine

    def dim_for(self, page_bytes: int, tokens: int, heads: int) -> int:
        """head_dim: the model's, or what makes a page of ``tokens`` tokens ``page_bytes``."""
        return self.dim or page_bytes // (2 * self.layers * heads * tokens * 2)


MODELS = {
    # 4 layers; the page size (--page-kib) sets head_dim: 16 KiB regions at 128 KiB
    "small": Model(layers=4, heads=8, dim=0, sglang_page=16, lmcache_heads=2, vllm_block=0,
                   pages=dict(sglang=256, lmcache=256, vllm=256),
                   batch=dict(sglang=64, lmcache=64, vllm=64)),
    # Llama-3-8B: 32 layers, 8 KV heads (GQA), head_dim 128: 128 KiB of K+V per token
    "8b": Model(layers=32, heads=8, dim=128, sglang_page=64, lmcache_heads=8, vllm_block=16,
                pages=dict(sglang=32, lmcache=16, vllm=128),
                batch=dict(sglang=8, lmcache=4, vllm=32)),
}


@dataclass
class Case:
    """One engine's two ways to read batch ``b`` (each returns the pages it got), what they
    read, and how to check the plug-in's bytes."""

    name: str
    page_bytes: int
    batches: list[range]
    plugin: Callable[[range], int]
    direct: Callable[[range], int]
    check: Callable[[], None]
    close: Callable[[], None]
    # get_into into the very buffers the plug-in scatters each value over (None: one buffer)
    direct_parts: Callable[[range], int] | None = None
    # after each timed call: give back what the engine would free once it used the pages
    release: Callable[[], None] = lambda: None
    # --op lookup: the engine's lookup through the plug-in, and the blocking client's own
    # call that it makes (each returns the pages found)
    lookup: Callable[[range], int] | None = None
    lookup_direct: Callable[[range], int] | None = None
    # --fresh-keys: forget what the plug-in kept from the puts about the keys (LMCache's memo)
    forget: Callable[[], None] = lambda: None


@contextlib.contextmanager
def cluster(root: Path, chunkservers: int) -> Iterator[tuple[str, str]]:
    """Meta + chunkservers as child processes, driven from a loop on a thread of ours."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="cluster", daemon=True)
    thread.start()
    pc = ProcessCluster(root, chunkservers, listen="127.0.0.1:0")
    try:
        asyncio.run_coroutine_threadsafe(pc.start(), loop).result(180)
        yield pc.addr, pc.token
    finally:
        asyncio.run_coroutine_threadsafe(pc.stop(), loop).result(180)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _split(n: int, batch: int) -> list[range]:
    return [range(s, min(s + batch, n)) for s in range(0, n, batch)]


def _random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# SGLang HiCache -----------------------------------------------------------------------------
def sglang_case(addr: str, token: str, ns: argparse.Namespace) -> Case:
    torch = quiet_import("torch")
    from kvfs.prefix import chain_keys, namespaced

    m: Model = ns.model
    layers, heads, page = m.layers, m.heads, m.sglang_page
    dim = m.dim_for(ns.page_kib * 1024, page, heads)  # K+V, bf16
    tokens = ns.pages * page
    pool = sglang_host_pool(ns.layout, tokens=tokens, layers=layers, heads=heads, dim=dim, page=page,
                            host_ratio=1.0)
    flat = pool.kv_buffer.view(torch.uint8).view(-1)
    flat.copy_(torch.from_numpy(_random_bytes(flat.numel(), 1)))
    page_bytes = int(pool.get_size_per_token()) * page
    namespace = f"bench/sglang/{ns.layout}"
    backend = sglang_storage(addr, token, pool, namespace, model_name="bench/llama")
    hashes = [h.decode() for h in chain_keys(range(tokens), page, style="sglang")]
    keys = [namespaced(namespace, h) for h in hashes]
    idx = torch.arange(0, tokens)
    batches = _split(ns.pages, ns.batch)
    want = [pool.get_data_page(i * page).clone() for i in range(ns.pages)]
    for b in batches:
        sl = slice(b.start * page, b.stop * page)
        assert backend.batch_set_v1(hashes[b.start : b.stop], idx[sl]) == [True] * len(b)
    flat.zero_()  # so the check below sees what the plug-in loaded
    direct_bufs = list(np.empty((ns.pages, page_bytes), dtype=np.uint8))  # one row per page

    def plugin(b: range) -> int:
        sl = slice(b.start * page, b.stop * page)
        return sum(backend.batch_get_v1(hashes[b.start : b.stop], idx[sl]))

    def direct(b: range) -> int:
        got = backend.client.get_into(keys[b.start : b.stop], direct_bufs[b.start : b.stop])
        return sum(n == page_bytes for n in got)

    def direct_parts(b: range) -> int:  # the plug-in's own region lists (kvfs.buffers.Parts)
        parts = backend._page_parts(len(b), idx[b.start * page : b.stop * page])
        got = backend.client.get_into(keys[b.start : b.stop], parts)
        return sum(n == page_bytes for n in got)

    def check() -> None:
        for i in range(ns.pages):
            got = pool.get_data_page(i * page)
            if not torch.equal(got.view(torch.int16), want[i].view(torch.int16)):
                raise SystemExit(f"sglang: page {i} read back wrong through the plug-in")

    def lookup(b: range) -> int:
        return int(backend.batch_exists(hashes[b.start : b.stop]))

    def lookup_direct(b: range) -> int:
        return backend.client.match_prefix(keys[b.start : b.stop], lease_s=backend.config.lease_s)

    return Case(f"SGLang HiCache `batch_get_v1` ({ns.layout})", page_bytes, batches, plugin,
                direct, check, backend.close, direct_parts, lookup=lookup,
                lookup_direct=lookup_direct)


# LMCache ---------------------------------------------------------------------------------------
def lmcache_case(addr: str, token: str, ns: argparse.Namespace) -> Case:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    torch = quiet_import("torch")
    check_utils = quiet_import("lmcache.v1.check.utils")
    from kvfs.integrations.lmcache import KvfsConnector
    from kvfs.prefix import namespaced

    model = "bench-model"
    metadata = check_utils._get_default_metadata(model)
    # vLLM's KV shape [layers, 2, tokens, heads, head_size] (bf16), 256-token chunks
    m: Model = ns.model
    chunk, layers, heads = 256, m.layers, m.lmcache_heads
    metadata.kv_shape = (layers, 2, chunk, heads, m.dim_for(ns.page_kib * 1024, chunk, heads))
    metadata.chunk_size = chunk
    pooled = min(ns.pages, 4 * ns.batch) if ns.fresh_keys else ns.pages  # held at a time
    pool_gib = 2.5 * pooled * layers * 2 * chunk * heads * metadata.kv_shape[-1] * 2 / (1 << 30)
    namespace = "bench-lmcache"
    cfg_path = lmcache_config(Path(tempfile.mkdtemp(prefix="kvfs-bench-lmcache-")) / "lmcache.yaml",
                              addr, token, chunk_size=chunk, max_local_cpu_gib=pool_gib,
                              kvfs_namespace=namespace,
                              **({} if ns.key_memo is None else {"kvfs_key_memo": ns.key_memo}))
    sm = lmcache_storage_manager(cfg_path, metadata)
    remote = check_utils.find_remote_backend(sm)
    conn = getattr(remote, "connection", None)
    conn = getattr(conn, "_connector", conn)  # inside LMCache's InstrumentedRemoteConnector
    assert isinstance(conn, KvfsConnector), f"LMCache did not load the connector: {conn!r}"
    loop = conn.loop

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    if ns.hash == "sha256":  # LMCache's checker's keys: 256-bit hashes of names
        lm_keys = [check_utils.create_test_key(model, f"bench-{i}") for i in range(ns.pages)]
    else:  # what an engine's lookup and store name: LMCache's token database, its default hash
        db = quiet_import("lmcache.v1.token_database").ChunkedTokenDatabase(sm.config, metadata)
        tokens = np.random.default_rng(3).integers(0, 128256, ns.pages * chunk).tolist()
        lm_keys = [k for _, _, k in db.process_tokens(tokens)]
        if len(lm_keys) != ns.pages or len({k.chunk_hash for k in lm_keys}) != ns.pages:
            raise SystemExit(f"lmcache: the token database made {len(lm_keys)} keys, "
                             f"not {ns.pages} distinct ones")
    keys = [namespaced(namespace, k.to_string()) for k in lm_keys]
    batches = _split(ns.pages, ns.batch)
    want: list[bytes] = []
    for b in batches:
        objs = [check_utils.create_test_memory_obj_for_storage_manager(sm, metadata) for _ in b]
        for j, o in enumerate(objs):
            o.tensor.view(torch.uint8).view(-1).copy_(
                torch.from_numpy(_random_bytes(o.get_size(), b.start + j)))
        want += [bytes(o.byte_array) for o in objs]
        run(conn.batched_put(lm_keys[b.start : b.stop], objs))
        for o in objs:
            o.ref_count_down()
    page_bytes = len(want[0])
    value_bytes = conn.remote_metadata_bytes + page_bytes
    direct_bufs = list(np.empty((ns.pages, value_bytes), dtype=np.uint8))  # one row per page
    last: dict[int, bytes] = {}

    held: list[tuple[int, Any]] = []

    def plugin(b: range) -> int:
        objs = run(conn.batched_get(lm_keys[b.start : b.stop]))
        held.extend((i, o) for i, o in zip(b, objs, strict=True) if o is not None)
        return sum(o is not None for o in objs)

    def release() -> None:  # untimed: LMCache frees a chunk once it used it, whoever read it
        for i, o in held:
            if i % 17 == 0:
                last[i] = bytes(o.byte_array)
            o.ref_count_down()
        held.clear()

    def direct(b: range) -> int:
        got = conn.client.get_into(keys[b.start : b.stop], direct_bufs[b.start : b.stop])
        return sum(n == value_bytes for n in got)

    headers = [bytearray(conn.remote_metadata_bytes) for _ in range(ns.pages)]
    payloads = np.empty((ns.pages, page_bytes), dtype=np.uint8)

    def direct_parts(b: range) -> int:
        got = conn.client.get_into(keys[b.start : b.stop],
                                   [[headers[i], payloads[i]] for i in b])
        return sum(n == value_bytes for n in got)

    def check() -> None:
        for i, got in last.items():
            if got != want[i]:
                raise SystemExit(f"lmcache: chunk {i} read back wrong through the plug-in")
        if not last:
            raise SystemExit("lmcache: nothing was checked")

    def close() -> None:
        sm.close()
        shutil.rmtree(cfg_path.parent, ignore_errors=True)

    def lookup(b: range) -> int:
        return int(conn.batched_contains(lm_keys[b.start : b.stop]))

    def lookup_direct(b: range) -> int:
        return conn.client.match_prefix(keys[b.start : b.stop], lease_s=conn.config.lease_s)

    def forget() -> None:  # the memo of the kvfs keys the puts built (a bench-only reach in)
        with conn._memo_lock:
            conn._last_template[5].clear()

    return Case(f"LMCache connector `batched_get` ({chunk}-token chunks)", page_bytes, batches,
                plugin, direct, check, close, direct_parts, release, lookup, lookup_direct,
                forget)


# vLLM -------------------------------------------------------------------------------------------
def vllm_case(addr: str, token: str, ns: argparse.Namespace) -> Case:
    base = quiet_import("vllm.v1.kv_offload.base")
    TransferJob = quiet_import("vllm.v1.kv_offload.tiering.base").TransferJob
    from kvfs.integrations.vllm import KvfsTier

    m: Model = ns.model
    block = m.vllm_block * m.layers * 2 * m.heads * m.dim * 2 if m.vllm_block else ns.page_kib * 1024
    manager = vllm_manager(vllm_offloading_config(
        addr, token, engine_id=f"bench-{os.getpid()}", block_bytes=block, cpu_blocks=ns.pages, model_name="bench/llama",
        namespace="bench-vllm"))
    tier = manager.secondary_tiers[0]
    assert isinstance(tier, KvfsTier), f"vLLM did not load the tier: {tier!r}"
    view = manager.primary_tier.get_kv_memoryview()
    prim = np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)
    if prim.shape[0] < ns.pages or prim.shape[1] != block:
        raise SystemExit(f"vllm: primary tier is {prim.shape}, wanted {ns.pages} x {block}")
    offload_keys = vllm_offload_keys(ns.pages, b"bench")
    keys = [tier.kvfs_key(k) for k in offload_keys]
    batches = _split(ns.pages, ns.batch)
    prim[: ns.pages] = _random_bytes(ns.pages * block, 2).reshape(ns.pages, block)
    want = prim[: ns.pages].copy()
    job_ids = iter(range(1, 1 << 30))

    def transfer(b: range, load: bool) -> int:
        job = TransferJob(job_id=next(job_ids), keys=offload_keys[b.start : b.stop],
                          chunk_ids=np.arange(b.start, b.stop, dtype=np.int64),
                          is_promotion=load, req_context=base.ReqContext(req_id="bench"))
        (tier.submit_load if load else tier.submit_store)(job)
        tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        assert len(results) == 1, results
        return len(b) if results[0].success else len(results[0].successful_keys or ())

    for b in batches:
        if transfer(b, load=False) != len(b):
            raise SystemExit("vllm: a store through the tier failed")
    prim[: ns.pages] = 0
    direct_bufs = list(np.empty((ns.pages, block), dtype=np.uint8))  # one row per page

    def direct(b: range) -> int:
        got = tier.client.get_into(keys[b.start : b.stop], direct_bufs[b.start : b.stop])
        return sum(n == block for n in got)

    def check() -> None:
        bad = np.flatnonzero((prim[: ns.pages] != want).any(axis=1))
        if bad.size:
            raise SystemExit(f"vllm: chunks {bad[:5].tolist()} read back wrong through the tier")

    def close() -> None:  # the tier, then the primary tier's /dev/shm region, unlinked
        nonlocal prim
        prim = np.empty((0, 0), dtype=np.uint8)  # the last view of the region's memory
        manager.shutdown()

    ctx = base.ReqContext(req_id="bench-lookup")

    def lookup(b: range) -> int:  # what vLLM's lookup thread calls for a step's keys
        return sum(tier._lookups.batch_lookup(offload_keys[b.start : b.stop], ctx))

    def lookup_direct(b: range) -> int:
        return sum(tier.client.exists_many(keys[b.start : b.stop], lease_s=tier.config.lease_s))

    return Case("vLLM tier `submit_load` + `get_finished_jobs`", block, batches,
                lambda b: transfer(b, load=True), direct, check, close, lookup=lookup,
                lookup_direct=lookup_direct)


CASES = {"sglang": sglang_case, "lmcache": lmcache_case, "vllm": vllm_case}


def timed(fn: Callable[[range], int], b: range, what: str,
          after: Callable[[], None]) -> tuple[float, float]:
    """Seconds and the client process's CPU seconds for one call on batch ``b`` (``after``
    runs untimed); every page must arrive."""
    c0, t0 = time.process_time(), time.perf_counter()
    got = fn(b)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    after()
    if got != len(b):
        raise SystemExit(f"{what}: {got} of {len(b)} pages arrived")
    return dt, dc


def measure(case: Case, rounds: int,
            fresh: int = 0) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per batch, the plug-in and the direct read back to back (which goes first alternates),
    ``rounds`` passes over every batch: seconds per page of each call, and client CPU seconds
    per page, the ways' lists paired.  ``fresh``: the pages a round's batches cover, each way
    each round (warm-up included) then shifted to a block of them of its own, after the ones
    before: no call asks for a key any call asked for before."""
    ways = {"plug-in": case.plugin, "direct": case.direct}
    if case.direct_parts is not None:
        ways["direct, the plug-in's buffers"] = case.direct_parts
    blocks = itertools.count()

    def shifts() -> dict[str, int]:  # all 0 unless fresh
        return {name: next(blocks) * fresh for name in ways}

    def at(b: range, shift: int) -> range:
        return range(b.start + shift, b.stop + shift)

    shift = shifts()
    for b in case.batches:  # warm-up: connections and layouts cached alike
        for name, fn in ways.items():
            timed(fn, at(b, shift[name]), name, case.release)
    per: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    flip = False
    for _ in range(rounds):
        shift = shifts()
        for b in case.batches:
            order = list(reversed(ways)) if flip else list(ways)  # plug-in first or last
            flip = not flip
            for name in order:
                dt, dc = timed(ways[name], at(b, shift[name]), name, case.release)
                per[name].append(dt / len(b))
                cpu[name].append(dc / len(b))
    return per, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.plugins", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=sorted(CASES))
    ap.add_argument("--model", choices=sorted(MODELS), default="small",
                    help="KV geometry: small (4 layers, --page-kib pages) or 8b (Llama-3-8B "
                         "class: 32 layers, 8 KV heads, head_dim 128); default small")
    ap.add_argument("--pages", type=int, help="pages stored and read (default: small 256; "
                    "8b: sglang 32, lmcache 16, vllm 128)")
    ap.add_argument("--page-kib", type=int, default=128,
                    help="page size in KiB, --model small only (default 128)")
    ap.add_argument("--batch", type=int, help="pages per call (default: small 64; 8b: "
                    "sglang 8, lmcache 4, vllm 32)")
    ap.add_argument("--rounds", type=int, default=8, help="passes over the pages (default 8)")
    ap.add_argument("--chunkservers", type=int, default=3, help="chunkservers (default 3)")
    ap.add_argument("--op", choices=["load", "lookup"], default="load",
                    help="what is timed: load (the default) or lookup: the engine's lookup "
                         "through the plug-in (SGLang batch_exists, LMCache batched_contains, "
                         "vLLM's lookup thread's batch_lookup) next to the blocking client's "
                         "own match_prefix / exists_many of the same keys")
    ap.add_argument("--fresh-keys", action="store_true",
                    help="--op lookup: every call asks for keys never asked for before "
                         "((rounds + 1) x 2 x --pages stored first, at most 256 MiB; use a "
                         "small --page-kib such as 8); LMCache's key memo emptied after the puts")
    ap.add_argument("--key-memo", type=int, help="lmcache: the connector's kvfs_key_memo (default: the "
                    "connector's, 16384; 0: no memo)")
    ap.add_argument("--hash", choices=["builtin", "sha256"], default="builtin",
                    help="lmcache: the chunk keys' hashes. builtin (the default): made by "
                         "LMCache's own ChunkedTokenDatabase with LMCache 0.5.6's default "
                         "pre_caching_hash_algorithm, builtin: Python's hash() of a tuple, a "
                         "signed 64-bit int (every algorithm it has gives 64 bits); sha256: "
                         "LMCache's checker's create_test_key, 256-bit sha256 of a name, "
                         "which engines never make")
    ap.add_argument("--layout", default="page_first",
                    choices=["layer_first", "page_first", "page_first_direct"],
                    help="SGLang's host layout (default page_first)")
    ns = ap.parse_args(argv)
    model, ns.model = ns.model, MODELS[ns.model]
    ns.pages = ns.pages or ns.model.pages[ns.engine]
    ns.batch = ns.batch or ns.model.batch[ns.engine]
    if ns.key_memo is not None and ns.engine != "lmcache":
        ap.error("--key-memo: lmcache only")
    if ns.hash != "builtin" and ns.engine != "lmcache":
        ap.error("--hash: lmcache only")
    round_pages = ns.pages
    if ns.fresh_keys:
        if ns.op != "lookup" or model != "small":
            ap.error("--fresh-keys: with --op lookup and --model small only")
        ns.pages = (ns.rounds + 1) * 2 * round_pages  # a block per way per round
        if ns.pages * ns.page_kib > FRESH_KIB:
            ap.error(f"--fresh-keys: {ns.pages} pages of --page-kib {ns.page_kib} is over "
                     f"{FRESH_KIB >> 10} MiB; lower --page-kib, --pages or --rounds")
    root = Path(tempfile.mkdtemp(prefix="kvfs-bench-plugins-"))
    try:
        with cluster(root / "cluster", ns.chunkservers) as (addr, token):
            case = CASES[ns.engine](addr, token, ns)
            if ns.fresh_keys:
                case.batches = _split(round_pages, ns.batch)  # shifted per way and round
                case.forget()
            if ns.op == "lookup":
                assert case.lookup is not None and case.lookup_direct is not None
                case.name = case.name.split(" `")[0] + " lookup"
                case.plugin, case.direct = case.lookup, case.lookup_direct
                case.direct_parts, case.release = None, lambda: None
                case.check = lambda: None  # nothing is read; every page must be found
            try:
                per, cpu = measure(case, ns.rounds, round_pages if ns.fresh_keys else 0)
                case.check()
            finally:
                case.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    us = {name: [x * 1e6 for x in xs] for name, xs in per.items()}
    plug, direct = statistics.median(us["plug-in"]), statistics.median(us["direct"])
    total = sum(us["plug-in"]) / sum(us["direct"])
    paired = statistics.median(p / d for p, d in zip(us["plug-in"], us["direct"], strict=True))
    fresh = f", fresh keys every call ({ns.pages} stored)" if ns.fresh_keys else ""
    fresh += "" if ns.key_memo is None else f", kvfs_key_memo {ns.key_memo}"
    fresh += f", {ns.hash} chunk hashes" if ns.engine == "lmcache" else ""
    print(f"{case.name}{fresh}, model {model}: {round_pages} pages of {case.page_bytes / 1024:g} KiB, calls of "
          f"{ns.batch} pages, {ns.rounds} rounds, {len(us['direct'])} calls each way back to "
          f"back, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    cpu_us = {name: statistics.median(xs) * 1e6 for name, xs in cpu.items()}
    for name, xs in us.items():
        q = statistics.quantiles(xs, n=4)
        print(f"  {name}: us/page median {statistics.median(xs):,.1f}, quartiles "
              f"{q[0]:,.1f}-{q[2]:,.1f}, mean {statistics.mean(xs):,.1f}; client CPU us/page "
              f"median {cpu_us[name]:,.1f}")
    verdict = "met" if max(total, paired) <= TARGET else "MISSED"
    parts = us.get("direct, the plug-in's buffers")
    pcol = (f"{statistics.median(parts):,.1f} "
            f"({sum(us['plug-in']) / sum(parts):.2f})" if parts else "-")
    direct_call = "get_into" if ns.op == "load" else "lookup"
    print(f"| engine | plug-in us/page | direct {direct_call} us/page | plug-in/direct (totals) | "
          "median of paired ratios | target <= 1.20 | get_into into the plug-in's buffers "
          "(plug-in/that) | client CPU us/page plug-in / direct (ratio) |")
    print(f"| {ns.engine} | {plug:,.1f} | {direct:,.1f} | {total:.2f} | {paired:.2f} | {verdict} "
          f"| {pcol} | {cpu_us['plug-in']:,.1f} / {cpu_us['direct']:,.1f} "
          f"({cpu_us['plug-in'] / cpu_us['direct']:.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
