"""SGLang 0.5.23's own HiCache code paths on kvfs, on CPU: a real MHATokenToKVPoolHost in
each host layout, the storage built by SGLang's dynamic backend factory, and the
controller's page backup / prefetch functions (zero-copy v1 and the generic path)."""

from __future__ import annotations

import functools
import queue
import time
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

with warnings.catch_warnings():  # sglang warns about GPU-only quantizers at import
    warnings.simplefilter("ignore")
    import torch
    from sglang.srt.managers.cache_controller import (
        HiCacheController,
        PrefetchOperation,
        StorageOperation,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from conftest import ThreadCluster

from kvfs.bench.engines import sglang_host_pool, sglang_storage
from kvfs.integrations.sglang import KvfsHiCacheStorage
from kvfs.prefix import chain_keys

pytestmark = pytest.mark.engines
LAYERS, HEADS, DIM, PAGE = 3, 2, 16, 4
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def host_pool(layout: str, tokens: int = 64) -> MHATokenToKVPoolHost:
    pool = sglang_host_pool(layout, tokens=tokens, layers=LAYERS, heads=HEADS, dim=DIM, page=PAGE,
                            host_ratio=2.0)
    gen = torch.Generator().manual_seed(7)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(torch.bfloat16))
    return pool


def storage(tc: ThreadCluster, pool: Any, namespace: str, v1: bool = True,
            **extra: Any) -> KvfsHiCacheStorage:
    backend: KvfsHiCacheStorage = sglang_storage(tc.addr, tc.token, pool, namespace,
                                                 model_name="test/llama", v1=v1, **extra)
    return backend


def controller(backend: KvfsHiCacheStorage, pool: Any, v1: bool) -> SimpleNamespace:
    """The controller's page functions, unbound, on the state they read."""
    ctl = SimpleNamespace(storage_backend=backend, mem_pool_host=pool, storage_host_pool=pool,
                          page_size=PAGE, prefetch_sync_queue=queue.Queue())
    get = HiCacheController._page_get_zero_copy if v1 else HiCacheController._generic_page_get
    put = HiCacheController._page_set_zero_copy if v1 else HiCacheController._generic_page_set
    ctl.page_get_func = functools.partial(get, ctl)
    ctl.page_set_func = functools.partial(put, ctl)
    ctl._page_transfer_kv_batch = functools.partial(HiCacheController._page_transfer_kv_batch, ctl)
    return ctl


def pages(pool: Any, first_token: int, n: int) -> list[torch.Tensor]:
    return [pool.get_data_page(first_token + i * PAGE).clone() for i in range(n)]


@pytest.mark.parametrize("v1", [True, False], ids=["zero-copy", "generic"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_then_prefetch_bit_exact(tcluster: ThreadCluster, layout: str, v1: bool) -> None:
    pool = host_pool(layout)
    backend = storage(tcluster, pool, f"t/{layout}/{v1}", v1)
    ctl = controller(backend, pool, v1)
    tokens = list(range(100, 100 + 6 * PAGE))
    hashes = [k.decode() for k in chain_keys(tokens, PAGE, style="sglang")]
    src = torch.arange(0, 6 * PAGE)
    before = pages(pool, 0, 6)
    op = StorageOperation(src, tokens, hash_value=hashes)
    HiCacheController._page_backup(ctl, op)
    assert op.completed_tokens == 6 * PAGE
    assert not backend.client._meta_sockets._idle
    assert backend.batch_exists(hashes) == 6
    assert backend.batch_exists([*hashes[:3], "f" * 64, hashes[4]]) == 3
    # SGLang waits for the answer: asked in its thread, on the client's own meta socket (one
    # caller: one socket, reused), not through kvfs's IO thread
    assert len(backend.client._meta_sockets._idle) == 1

    dst = torch.arange(32, 32 + 6 * PAGE)  # other host slots, zeroed first
    for i in range(6):
        pool.set_from_flat_data_page(32 + i * PAGE, torch.zeros_like(before[i]))
    fetch = PrefetchOperation("req-1", tokens)
    fetch.hash_value, fetch.host_indices = hashes, dst
    assert HiCacheController._page_transfer(ctl, fetch) == 6
    for a, b in zip(before, pages(pool, 32, 6), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit-exact
    backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_regions_are_those_sglang_names(tcluster: ThreadCluster, layout: str) -> None:
    """The plug-in computes a call's page regions from lines it read off SGLang's
    ``get_page_buffer_meta`` at registration: the same regions, in the same order, for
    pages anywhere in the pool and out of order.  A page's views are kept after its first
    use: a later call on it gets the same views, and still the regions SGLang names."""
    pool = host_pool(layout)
    backend = storage(tcluster, pool, f"regions/{layout}")
    assert backend._regions is not None  # the lines hold in every host layout
    base = pool.kv_buffer.data_ptr()

    def parts(slots: list[int]) -> list[Any]:  # page slots of the 16 in the pool (128 tokens)
        idx = torch.cat([torch.arange(s * PAGE, (s + 1) * PAGE) for s in slots])
        got = backend._page_parts(len(slots), idx)
        ptrs, sizes = pool.get_page_buffer_meta(idx)
        want = [backend._host.view[p - base : p - base + n]  # type: ignore[union-attr]
                for p, n in zip(ptrs, sizes, strict=True)]
        flat = [v for page in got for v in page]
        assert [v.nbytes for v in flat] == list(sizes)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(flat, want, strict=True))
        return got

    first = parts([13, 0, 2, 15, 7])
    again = parts([0, 9, 13])  # two pages used before, one not
    assert again[0] is first[1] and again[2] is first[0]  # kept, not made again
    assert all(again[1] is not p for p in first)
    backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_copy_pages_are_one_key_each_and_written_once(tcluster: ThreadCluster,
                                                           layout: str) -> None:
    pool = host_pool(layout)
    backend = storage(tcluster, pool, f"once/{layout}")
    hashes = [k.decode() for k in chain_keys(range(8 * PAGE), PAGE, style="sglang")]
    idx = torch.arange(0, 8 * PAGE)
    assert backend.batch_set_v1(hashes, idx) == [True] * 8
    counts = backend.client.aio.rpc_counts
    before = dict(counts)
    assert backend.batch_set_v1(hashes, idx) == [True] * 8  # already there: nothing written
    assert counts["APPEND"] == before["APPEND"] and counts["COMMIT"] == before["COMMIT"]
    assert counts["EXISTS"] == before["EXISTS"] + 1  # put_many(if_absent=True): its one check
    half = [k.decode() for k in chain_keys(range(12 * PAGE), PAGE, style="sglang")]
    assert backend.batch_set_v1(half[4:], torch.arange(4 * PAGE, 12 * PAGE)) == [True] * 8
    assert len(backend.client.list(f"once/{layout}/")) == 12  # only the 4 new pages were added
    infos = backend.client.list(f"once/{layout}/")
    assert len(infos) == 12  # K and V (and every layer) of a page in one value
    assert {i.size for i in infos} == {pool.get_size_per_token() * PAGE}
    assert backend.batch_get_v1([], idx[:0]) == [] and backend.batch_exists([]) == 0
    backend.close()


def test_cluster_down_is_a_miss_in_bounded_time(tmp_path: Any) -> None:
    tc = ThreadCluster(tmp_path / "c")
    try:
        pool = host_pool("page_first")
        backend = storage(tc, pool, "down", timeout_s=1, connect_timeout_s=1)
        hashes = [k.decode() for k in chain_keys(range(4 * PAGE), PAGE, style="sglang")]
        idx = torch.arange(0, 4 * PAGE)
        assert backend.batch_set_v1(hashes, idx) == [True] * 4
        tc.stop_services()  # the whole cluster dies mid-run
        started = time.monotonic()
        assert backend.batch_exists(hashes) == 0
        assert backend.batch_get_v1(hashes, idx) == [False] * 4
        assert backend.batch_set_v1(hashes, idx) == [False] * 4
        assert time.monotonic() - started < 30  # bounded: never a hang
        tc.start_services()
        deadline = time.monotonic() + 30
        while backend.batch_exists(hashes) != 4:  # served again once it is back
            assert time.monotonic() < deadline, "kvfs did not come back"
            time.sleep(0.1)
        backend.close()
    finally:
        tc.close()


def test_chain_keys_match_sglang_hashes() -> None:
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = list(range(5000, 5000 + 3 * 64))
    try:
        ours = get_hash_str(tokens, None, page_size=64)
    except RuntimeError as exc:  # its native hash needs a C++ toolchain and libcrypto
        pytest.skip(f"SGLang's native page hash is unavailable here: {exc}")
    assert [k.decode() for k in chain_keys(tokens, 64, style="sglang")] == ours
