"""A real-model prefix cache on kvfs: prefill once, store per-block KV, reuse it elsewhere.

A small Llama-architecture model is built from a ``transformers`` config (random weights,
fixed seed, nothing downloaded).  Prompt A is prefilled and its KV cache stored in kvfs,
one value per block of 16 tokens (every layer's K and V of the block, gathered without a
copy) under chained prefix keys (:func:`kvfs.prefix.chain_keys`).  Prompt B shares A's
first blocks: it asks kvfs how many leading blocks exist (one ``match_prefix``), loads them
(one ``get_into``, scattered straight into the cache tensors), and computes only its new
tokens.  Its next-token logits are compared with a full recompute of B.

    python examples/prefix_cache_demo.py       # needs torch and transformers
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvfs.launcher import LocalCluster
from kvfs.prefix import chain_keys

BLOCK = 16


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 5
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # type: ignore[attr-defined]


async def main() -> dict[str, float]:
    model = build_model()
    n_layers = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, 512, (1, 6 * BLOCK), generator=gen)
    # B shares A's first 5 blocks, then goes its own way
    prompt_b = torch.cat([prompt_a[:, : 5 * BLOCK],
                          torch.randint(0, 512, (1, 21), generator=gen)], dim=1)
    ns = "demo/llama-tiny/tp0"
    with tempfile.TemporaryDirectory() as tmp:
        async with LocalCluster(Path(tmp), chunkservers=3) as cluster, cluster.client() as kv:
            # --- node 1: prefill A and store every full block's KV -----------------------
            with torch.no_grad():
                out = model(prompt_a, use_cache=True)
            keys_a = chain_keys(prompt_a[0], BLOCK, ns)
            items = []
            for i, key in enumerate(keys_a):
                parts = []
                for layer in range(n_layers):
                    k, v = layer_kv(out.past_key_values, layer)
                    sl = slice(i * BLOCK, (i + 1) * BLOCK)
                    parts += [k[:, :, sl].contiguous(), v[:, :, sl].contiguous()]
                items.append((key, parts))  # one value per block, gathered from 2*layers tensors
            await kv.put_many(items)

            # --- node 2: serve B, loading the shared blocks --------------------------------
            with torch.no_grad():
                model(prompt_b[:, :BLOCK])  # warm up, so neither timing pays first-call costs
                t0 = time.perf_counter()
                full = model(prompt_b).logits[:, -1]
                t_full = time.perf_counter() - t0

                t0 = time.perf_counter()
                keys_b = chain_keys(prompt_b[0], BLOCK, ns)
                hit = await kv.match_prefix(keys_b, lease_s=30)
                k0, v0 = layer_kv(out.past_key_values, 0)
                shape = (1, k0.shape[1], hit * BLOCK, k0.shape[3])
                ks = [torch.empty(shape, dtype=k0.dtype) for _ in range(n_layers)]
                vs = [torch.empty(shape, dtype=v0.dtype) for _ in range(n_layers)]
                dests = []
                for i in range(hit):
                    sl = slice(i * BLOCK, (i + 1) * BLOCK)
                    # scatter each block straight into the cache tensors: [k0, v0, k1, v1, ...]
                    per = [t for layer in range(n_layers) for t in (ks[layer][:, :, sl],
                                                                    vs[layer][:, :, sl])]
                    dests.append(per)
                # strided slices cannot be written in place: read each block into one
                # contiguous staging tensor per layer and half, then copy into place
                staging = [[torch.empty_like(t.contiguous()) for t in per] for per in dests]
                sizes = await kv.get_into(keys_b[:hit], staging)
                for per, stage in zip(dests, staging, strict=True):
                    for dst, src in zip(per, stage, strict=True):
                        dst.copy_(src)
                cache = DynamicCache()
                for layer in range(n_layers):
                    cache.update(ks[layer], vs[layer], layer)
                new = prompt_b[:, hit * BLOCK :]
                pos = torch.arange(hit * BLOCK, prompt_b.shape[1]).unsqueeze(0)
                cached = model(new, past_key_values=cache, position_ids=pos,
                               cache_position=pos[0]).logits[:, -1]
                t_cached = time.perf_counter() - t0
    loaded = sum(sizes)
    ok = torch.allclose(cached, full, rtol=1e-4, atol=1e-5)
    print(f"blocks hit: {hit} of {len(keys_b)} full blocks ({hit * BLOCK} of "
          f"{prompt_b.shape[1]} tokens), bytes loaded: {loaded}")
    print(f"prefill without cache: {t_full * 1e3:.1f} ms; with kvfs: {t_cached * 1e3:.1f} ms "
          f"(lookup + load + {new.shape[1]} new tokens)")
    print(f"next-token logits equal a full recompute: {ok} "
          f"(max abs diff {float((cached - full).abs().max()):.2e})")
    if not ok:
        raise SystemExit("logits differ from a full recompute")
    return {"hit": hit, "bytes": loaded}


if __name__ == "__main__":
    asyncio.run(main())
