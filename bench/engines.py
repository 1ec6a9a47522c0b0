"""Each engine's own objects with kvfs plugged in, built one way for the engine tests
(``tests/engines/``) and the plug-in benchmark (``bench/plugins.py``).

Run in the engine's venv (``.ci/engines.sh``): every engine is imported when a function
here needs it, so importing this module needs none of them.  The engines warn at import
(SGLang about GPU-only quantizers, vLLM and LMCache about CUDA); :func:`quiet_import`
imports with those warnings off.
"""

from __future__ import annotations

import hashlib
import importlib
import textwrap
import warnings
from pathlib import Path
from typing import Any


def quiet_import(module: str) -> Any:
    """``importlib.import_module(module)`` with the engines' import-time warnings off."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(module)


# SGLang HiCache ---------------------------------------------------------------------------
def sglang_host_pool(layout: str, *, tokens: int, layers: int, heads: int, dim: int, page: int,
                     host_ratio: float) -> Any:
    """A real ``MHATokenToKVPoolHost`` on CPU (bf16 K and V, ``layout``: layer_first,
    page_first or page_first_direct) over a device pool of ``tokens`` tokens; zeroed."""
    torch = quiet_import("torch")
    info_mod = quiet_import("sglang.srt.mem_cache.device_pool_info")
    mha = quiet_import("sglang.srt.mem_cache.pool_host.mha")
    k = tuple(torch.zeros(tokens + page, heads, dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(tokens + page, heads, dim, dtype=torch.bfloat16) for _ in range(layers))
    info = info_mod.MHABufferInfo(
        buffers=info_mod.KVBuffers(
            k=k, v=v, layout=info_mod.KVBufferLayout.NHD,
            k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64)),
        page_size=page, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    return mha.MHATokenToKVPoolHost(info, host_ratio, 0, page, layout, pin_memory=False,
                                    device="cpu", device_capacity_tokens=tokens, start_layer=0,
                                    end_layer=layers)


def sglang_storage(addr: str, token: str, pool: Any, namespace: str, *, model_name: str,
                   v1: bool = True, **extra: Any) -> Any:
    """``KvfsHiCacheStorage`` as SGLang's dynamic backend factory builds it from
    ``--hicache-storage-backend-extra-config`` (README), with ``pool`` registered."""
    from kvfs.integrations.sglang import KvfsHiCacheStorage

    cfg = quiet_import("sglang.srt.mem_cache.hicache_storage").HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=pool.layout != "layer_first", model_name=model_name,
        extra_config={"backend_name": "kvfs", "module_path": "kvfs.integrations.sglang",
                      "class_name": "KvfsHiCacheStorage", "interface_v1": int(v1),
                      "addr": addr, "token": token, "namespace": namespace, **extra})
    factory = quiet_import("sglang.srt.mem_cache.storage.backend_factory").StorageBackendFactory
    backend = factory.create_backend("dynamic", cfg, pool)
    assert isinstance(backend, KvfsHiCacheStorage), f"SGLang did not load the backend: {backend!r}"
    backend.register_mem_pool_host(pool)  # dynamic backends get the pool afterwards
    return backend


# LMCache ----------------------------------------------------------------------------------
def lmcache_config(path: Path, addr: str, token: str, *, max_local_cpu_gib: float,
                   chunk_size: int = 256, remote_url: bool = False, **extra: Any) -> Path:
    """Write an LMCache config that loads kvfs as its one remote storage plug-in (README);
    ``extra``: more ``extra_config`` settings (``kvfs_namespace``, ``kvfs_timeout_s``...)."""
    lines = "".join(f"  {k}: {v}\n" for k, v in extra.items())
    path.write_text(textwrap.dedent(f"""\
        chunk_size: {chunk_size}
        local_cpu: true
        max_local_cpu_size: {max_local_cpu_gib:.4f}
        remote_serde: naive
        {'remote_url: "plugin://kvfs"' if remote_url else ''}
        remote_storage_plugins: ["kvfs"]
        extra_config:
          remote_storage_plugin.kvfs.module_path: kvfs.integrations.lmcache
          remote_storage_plugin.kvfs.class_name: KvfsConnector
          kvfs_addr: "{addr}"
          kvfs_token: "{token}"
        """) + lines)
    return path


def lmcache_storage_manager(config: Path, metadata: Any) -> Any:
    """LMCache's ``StorageManager`` built from ``config`` (see :func:`lmcache_config`)."""
    cfg = quiet_import("lmcache.v1.config").LMCacheEngineConfig.from_file(str(config))
    events = quiet_import("lmcache.v1.event_manager").EventManager()
    sm_mod = quiet_import("lmcache.v1.storage_backend.storage_manager")
    return sm_mod.StorageManager(config=cfg, metadata=metadata, event_manager=events)


# vLLM -------------------------------------------------------------------------------------
def vllm_offloading_config(addr: str, token: str, *, engine_id: str, block_bytes: int,
                           cpu_blocks: int, model_name: str, **tier: Any) -> Any:
    """vLLM's ``OffloadingConfig`` for a ``TieringOffloadingSpec``: a CPU primary tier of
    ``cpu_blocks`` blocks and kvfs (``KvfsTier``, loaded by module path) behind it, as the
    README's ``kv_connector_extra_config``; ``tier``: more ``KvfsTier`` settings."""
    c = quiet_import("vllm.v1.kv_offload.config")
    tier_cfg = {"type": "KvfsTier", "module_path": "kvfs.integrations.vllm", "addr": addr,
                "token": token, **tier}
    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_blocks * block_bytes,
                      "secondary_tiers": [tier_cfg]},
        engine_id=engine_id, model=c.OffloadingModelConfig(name=model_name, dtype="bfloat16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))


def vllm_manager(config: Any) -> Any:
    """The offloading manager vLLM's ``OffloadingSpecFactory`` builds from ``config``."""
    factory = quiet_import("vllm.v1.kv_offload.factory").OffloadingSpecFactory
    return factory.create_spec(config).get_manager()


def vllm_offload_keys(n: int, seed: bytes) -> list[Any]:
    """Offload keys of a prefix chain (block hashes chained, KV-cache group 0)."""
    make_offload_key = quiet_import("vllm.v1.kv_offload.base").make_offload_key
    keys, h = [], seed
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "big")).digest()
        keys.append(make_offload_key(h, 0))
    return keys
