"""vLLM 0.33.0's KV-offload tiering on kvfs, on CPU: vLLM's ``OffloadingSpecFactory`` builds
the ``TieringOffloadingSpec`` of the README's config, which makes the primary CPU tier and
loads ``KvfsTier`` by module path; its ``TieringOffloadingManager`` is
driven the way vLLM's scheduler drives it (store to CPU, cascade to kvfs; on another engine,
look up, promote, read the primary tier), and every byte is compared."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import numpy as np
    from vllm.v1.kv_offload.base import (
        LookupResult,
        ReqContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from conftest import ThreadCluster

import kvfs
from kvfs.bench.engines import vllm_manager, vllm_offload_keys, vllm_offloading_config
from kvfs.integrations.vllm import KvfsTier

pytestmark = pytest.mark.engines
BLOCK_BYTES = 64 * 1024  # one worker's KV bytes per block; a chunk is one block
CHUNKS = 16  # primary (CPU) tier slots per engine
END_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def engine(tc: ThreadCluster, engine_id: str, **tier: Any) -> TieringOffloadingManager:
    # kv_connector_extra_config of vLLM's OffloadingConnector, as in the README
    manager = vllm_manager(vllm_offloading_config(tc.addr, tc.token, engine_id=engine_id,
                                                  block_bytes=BLOCK_BYTES, cpu_blocks=CHUNKS,
                                                  model_name="test/llama", **tier))
    assert isinstance(manager, TieringOffloadingManager)
    assert [type(t) for t in manager.secondary_tiers] == [KvfsTier]  # loaded by module path
    return manager


@contextlib.contextmanager
def two_engines(tc: ThreadCluster, name: str, **tier: Any,
                ) -> Iterator[tuple[TieringOffloadingManager, TieringOffloadingManager]]:
    """Engines ``name-a`` and ``name-b`` on one cluster, shut down after."""
    a = engine(tc, f"{name}-a", **tier)
    b = engine(tc, f"{name}-b", **tier)
    try:
        yield a, b
    finally:
        a.shutdown()
        b.shutdown()


def kvfs_tier(manager: TieringOffloadingManager) -> KvfsTier:
    tier = manager.secondary_tiers[0]
    assert isinstance(tier, KvfsTier)
    return tier


@contextlib.contextmanager
def request(manager: TieringOffloadingManager, req_id: str) -> Iterator[ReqContext]:
    """A request's context, begun and finished on ``manager`` as vLLM's scheduler does."""
    ctx = ReqContext(req_id=req_id)
    with manager.lock:
        manager.on_new_request(ctx)
    yield ctx
    with manager.lock:
        manager.on_request_finished(ctx)


def chain(n: int, seed: str) -> list[Any]:
    return vllm_offload_keys(n, seed.encode())


def rows(manager: TieringOffloadingManager) -> np.ndarray:
    """The primary tier's KV memory, one row per chunk (what a GPU worker reads and writes)."""
    view = manager.primary_tier.get_kv_memoryview()
    return np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)


def step_until(manager: TieringOffloadingManager, done: Callable[[], bool],
               timeout_s: float = 60.0) -> None:
    """Run scheduler steps (the end-of-step hook) until ``done()``; never past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "vLLM's tiering manager did not get there"
        with manager.lock:
            manager.on_schedule_end(END_STEP)
        time.sleep(0.01)


def store_through_primary(manager: TieringOffloadingManager, keys: list[Any], req: str,
                          seed: int) -> dict[Any, bytes]:
    """What vLLM does for newly computed blocks: GPU -> CPU slots, then the cascade of the
    tiering manager to every secondary tier (here kvfs).  Returns each key's bytes."""
    ctx = ReqContext(req_id=req)
    prim = rows(manager)
    rng = np.random.default_rng(seed)
    with manager.lock:
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        want = {}
        for key, cid in zip(keys, out.store_spec.chunk_ids, strict=True):  # the worker's copy
            prim[cid] = rng.integers(0, 256, prim.shape[1], dtype=np.uint8)
            want[key] = prim[cid].tobytes()
        manager.complete_store(keys, ctx)  # -> KvfsTier.submit_store
        manager.on_request_finished(ctx)
    step_until(manager, lambda: not manager.has_pending_work())
    return want


def lookup_all(manager: TieringOffloadingManager, keys: list[Any], ctx: ReqContext,
               until: Callable[[list[LookupResult]], bool]) -> list[LookupResult]:
    """Look every key up once per step, as the scheduler does, until ``until(results)``."""
    got: list[LookupResult] = []

    def probe() -> bool:
        nonlocal got
        with manager.lock:
            got = [manager.lookup(k, ctx) for k in keys]
        return until(got)

    step_until(manager, probe)
    return got


def promote(manager: TieringOffloadingManager, keys: list[Any], ctx: ReqContext) -> list[Any]:
    """Lookups until each key is promoted from kvfs (HIT_PENDING) or missing, then steps until
    the loads land.  Returns the lookups' final answers."""
    lookup_all(manager, keys, ctx, lambda r: LookupResult.RETRY not in r)
    return lookup_all(manager, keys, ctx,
                      lambda r: LookupResult.HIT_PENDING not in r and LookupResult.RETRY not in r)


def read_primary(manager: TieringOffloadingManager, keys: list[Any], ctx: ReqContext) -> list[bytes]:
    prim = rows(manager)
    with manager.lock:
        spec = manager.prepare_load(keys, ctx)
        data = [prim[c].tobytes() for c in spec.chunk_ids]
        manager.complete_load(keys, ctx)
    return data


def test_store_lookup_promote_bit_exact_across_engines(tcluster: ThreadCluster) -> None:
    with two_engines(tcluster, "store") as (a, b):
        keys = chain(6, "round-trip")
        want = store_through_primary(a, keys, "req-a", seed=1)
        tier = kvfs_tier(a)
        with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:  # in kvfs, as stored
            assert kv.get_many([tier.kvfs_key(k) for k in keys]) == [want[k] for k in keys]
            names = [f"{tier.namespace}/{bytes(k).hex()}".encode() for k in keys]
            assert tier.kvfs_keys(keys) == [tier.kvfs_key(k) for k in keys] == names

        # another engine with the same layout: its lookups find the chunks in kvfs, promote
        # them into its own CPU tier, and its reads see the same bytes
        with request(b, "req-b") as ctx:
            other = chain(2, "never-stored")
            got = promote(b, keys + other, ctx)
            assert got == [LookupResult.HIT] * len(keys) + [LookupResult.MISS] * len(other)
            assert read_primary(b, keys, ctx) == [want[k] for k in keys]  # bit-exact
            meta = tcluster.cluster.meta
            assert meta is not None
            leased = set(meta.index.leases)  # type: ignore[union-attr]  # (SQLite meta)
            tb = kvfs_tier(b)
            assert {tb.kvfs_key(k) for k in keys} <= leased  # its lookup pinned the hits
            assert not {tb.kvfs_key(k) for k in other} & leased
            # vLLM's lookup thread waits for the answer: asked in that thread, on the
            # client's own meta socket (one caller: one socket), not through kvfs's IO thread
            assert len(tb.client._meta_sockets._idle) == 1


def test_partial_load_reports_the_keys_that_arrived(tcluster: ThreadCluster) -> None:
    with two_engines(tcluster, "partial") as (a, b), request(b, "req-b") as ctx:
        keys = chain(5, "partial")
        want = store_through_primary(a, keys, "req-a", seed=2)
        tier = kvfs_tier(b)
        lookup_all(b, keys, ctx, lambda r: LookupResult.RETRY not in r)  # all promoted...
        gone = [keys[1], keys[3]]
        with kvfs.Client(tcluster.addr, token=tcluster.token) as kv:  # ...then two vanish
            assert kv.delete_many([tier.kvfs_key(k) for k in gone]) == 2
        results: list[Any] = []
        finished = tier.get_finished_jobs

        def spy() -> Any:  # what the tier tells vLLM's manager
            out = list(finished())
            results.extend(out)
            return out

        tier.get_finished_jobs = spy
        got = lookup_all(b, keys, ctx, lambda r: LookupResult.HIT_PENDING not in r)
        loads = [r for r in results if r.successful_keys is not None or not r.success]
        assert len(loads) == 1 and not loads[0].success
        assert set(loads[0].successful_keys) == set(keys) - set(gone)
        # vLLM keeps the chunks that arrived and recomputes the others
        assert got == [LookupResult.MISS if k in gone else LookupResult.HIT for k in keys]
        kept = [k for k in keys if k not in gone]
        assert read_primary(b, kept, ctx) == [want[k] for k in kept]


def test_cluster_killed_mid_run_is_misses_and_failed_jobs_in_bounded_time(
        tmp_path: Path) -> None:
    tc = ThreadCluster(tmp_path / "c")
    try:
        with two_engines(tc, "down", timeout_s=1, connect_timeout_s=1) as (a, b):
            stored = chain(4, "down")
            store_through_primary(a, stored, "req-a", seed=3)
            tc.stop_services()  # the whole cluster dies mid-run
            started = time.monotonic()
            failed: list[Any] = []
            tier = kvfs_tier(a)
            finished = tier.get_finished_jobs

            def spy() -> Any:
                out = list(finished())
                failed.extend(r for r in out if not r.success)
                return out

            tier.get_finished_jobs = spy
            # a store now fails, reported as a failed job (vLLM's back-pressure counts it)
            store_through_primary(a, chain(2, "after-death"), "req-a2", seed=4)
            assert len(failed) == 1
            # lookups on another engine are misses: the engine recomputes
            with request(b, "req-b") as ctx:
                got = lookup_all(b, stored, ctx, lambda r: LookupResult.RETRY not in r)
            assert got == [LookupResult.MISS] * len(stored)
            assert time.monotonic() - started < 60  # bounded: never a hang
    finally:
        tc.close()


def test_unknown_setting_is_refused_by_name(tcluster: ThreadCluster) -> None:
    with pytest.raises(ValueError, match="unknown setting 'adress'"):
        engine(tcluster, "typo", adress="kvfs://x:1")
