"""kvfs.prefix: chained block keys, stable across processes, SGLang's page-hash format."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from kvfs import InvalidArgument
from kvfs.prefix import chain_digests, chain_keys, namespaced

TOKENS = list(range(1000, 1130))  # 2 full blocks of 64 and 2 tokens left over


def sglang_reference(tokens: list[int], page: int) -> list[str]:
    """SGLang 0.5.23's get_hash_str chain, restated from its source."""
    out: list[str] = []
    prior: str | None = None
    for i in range(0, len(tokens) - page + 1, page):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[i : i + page]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


def test_one_key_per_full_block_under_the_namespace() -> None:
    keys = chain_keys(TOKENS, 64, "llama/tp0")
    assert len(keys) == 2
    assert all(k.startswith(b"llama/tp0/") and len(k) == len(b"llama/tp0/") + 64 for k in keys)
    assert chain_keys(TOKENS[:63], 64, "m") == []


def test_a_key_names_its_whole_prefix() -> None:
    a = chain_keys(TOKENS, 64, "m")
    changed_first = chain_keys([7, *TOKENS[1:]], 64, "m")
    changed_second = chain_keys([*TOKENS[:64], 7, *TOKENS[65:]], 64, "m")
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # a change propagates down
    assert changed_second[0] == a[0] and changed_second[1] != a[1]
    assert chain_keys(TOKENS + [1] * 64, 64, "m")[:2] == a  # a longer prompt shares the prefix


def test_namespaces_keep_models_apart() -> None:
    a, b = chain_keys(TOKENS, 64, "model-a"), chain_keys(TOKENS, 64, "model-b")
    assert {k.split(b"/")[-1] for k in a}.isdisjoint(k.split(b"/")[-1] for k in b)


def test_known_value_is_pinned() -> None:
    # a change to the hash would orphan every stored block: this must never move
    assert chain_keys(range(130), 64, "llama-8b/tp0")[0] == (
        b"llama-8b/tp0/3f4d3b4077a0c6471f57eefae652a4ba42771a5c31185beae79ba6a9ae64171f")


def test_same_keys_in_another_process() -> None:
    code = ("from kvfs.prefix import chain_keys;"
            "print(b','.join(chain_keys(range(1000, 1130), 64, 'm')).decode())")
    env_seed = {"PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, **env_seed}).stdout.strip()
    assert out.encode().split(b",") == chain_keys(TOKENS, 64, "m")


def test_sglang_style_matches_sglang_page_hash() -> None:
    ref = sglang_reference(TOKENS, 64)
    assert [k.decode() for k in chain_keys(TOKENS, 64, style="sglang")] == ref
    assert chain_keys(TOKENS, 64, "ns", style="sglang") == [namespaced("ns", h) for h in ref]


@pytest.mark.parametrize("style", ["kvfs", "sglang"])
def test_parent_continues_a_chain(style: str) -> None:
    whole = chain_digests(TOKENS, 16, "m", style=style)  # type: ignore[arg-type]
    head = chain_digests(TOKENS[:64], 16, "m", style=style)  # type: ignore[arg-type]
    tail = chain_digests(TOKENS[64:], 16, "m", style=style, parent=head[-1])  # type: ignore[arg-type]
    assert head + tail == whole


def test_numpy_and_torch_like_inputs() -> None:
    arr = np.array(TOKENS, dtype=np.int64)
    assert chain_keys(arr, 64, "m") == chain_keys(TOKENS, 64, "m")


@pytest.mark.parametrize(("tokens", "block", "match"), [
    ([1, -2], 1, "token ids"),
    ([1, 2**32], 1, "token ids"),
    (["a"], 1, "token ids"),
    ([1, 2], 0, "block_tokens"),
])
def test_bad_input_is_named(tokens: list[object], block: int, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        chain_keys(tokens, block, "m")  # type: ignore[arg-type]
