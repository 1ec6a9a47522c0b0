"""Prefix keys: one key per full block of tokens, chained so a key names its whole prefix.

``h_i = H(h_{i-1} || tokens of block i)``: two prompts share the key of block i
exactly when they share tokens 0 .. (i+1)*block_tokens.  The hash depends only on
the token ids (packed as 4-byte little-endian unsigned integers), never on the
process or machine, so every node computes the same keys.  The namespace (model,
tensor-parallel rank, dtype, ...) is folded into the key so different models
never share a block::

    >>> from kvfs.prefix import chain_keys
    >>> keys = chain_keys(range(130), 64, "llama-8b/tp0")   # 2 full blocks; 2 tokens left over
    >>> len(keys), keys[0][:13]
    (2, b'llama-8b/tp0/')

``style="sglang"`` produces SGLang's HiCache page hash (SHA-256 over the prior
page's digest and the page's tokens, hex encoded; ``get_hash_str`` in
``sglang/srt/mem_cache/hicache_storage.py``), so keys computed outside SGLang
find the pages its kvfs plug-in stored under the same namespace.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable
from typing import Any, Literal

from kvfs.errors import InvalidArgument

Style = Literal["kvfs", "sglang"]
_PERSON = b"kvfs.prefix.v1"  # the kvfs chain's seed domain; change it only with a new version


def _pack(tokens: Any, what: str) -> array[int]:
    if hasattr(tokens, "tolist"):  # numpy array, torch tensor
        tokens = tokens.tolist()
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidArgument(f"{what}: token ids must be integers in [0, 2**32): {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte 'I'
        packed = array("L", packed)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed


def chain_digests(tokens: Iterable[int] | Any, block_tokens: int, namespace: str | bytes = "", *,
                  style: Style = "kvfs", parent: bytes | None = None) -> list[bytes]:
    """The raw digest of every full block of ``tokens`` (a trailing partial block has none).

    ``parent`` continues a chain: pass the last digest of the blocks before ``tokens``.
    """
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidArgument(f"block_tokens must be a positive int, got {block_tokens!r}")
    if style not in ("kvfs", "sglang"):
        raise InvalidArgument(f"style must be 'kvfs' or 'sglang', got {style!r}")
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    packed = _pack(tokens, "chain_keys")
    raw = packed.tobytes()
    step = 4 * block_tokens
    out: list[bytes] = []
    prev = parent
    if style == "kvfs":
        seed = hashlib.blake2b(ns, digest_size=32, person=_PERSON).digest()
        prev = seed if parent is None else parent
        for pos in range(0, len(raw) - step + 1, step):
            prev = hashlib.blake2b(prev + raw[pos : pos + step], digest_size=32).digest()
            out.append(prev)
    else:
        for pos in range(0, len(raw) - step + 1, step):
            h = hashlib.sha256()
            if prev:
                h.update(prev)
            h.update(raw[pos : pos + step])
            prev = h.digest()
            out.append(prev)
    return out


def namespaced(namespace: str | bytes, digest_hex: str | bytes) -> bytes:
    """The kvfs key of one block: ``namespace/hex`` (just ``hex`` with no namespace)."""
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    h = digest_hex.encode() if isinstance(digest_hex, str) else bytes(digest_hex)
    return ns + b"/" + h if ns else h


def chain_keys(tokens: Iterable[int] | Any, block_tokens: int, namespace: str | bytes = "", *,
               style: Style = "kvfs", parent: bytes | None = None) -> list[bytes]:
    """One kvfs key per full block: ``namespace/`` + the hex of that block's chained digest.

    Accepts a list of ints, a ``range``, a numpy array or a torch tensor of token ids.
    With ``style="sglang"`` and no namespace, ``key.decode()`` is exactly SGLang's page
    hash for that page.
    """
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return [namespaced(ns, d.hex()) for d in
            chain_digests(tokens, block_tokens, ns, style=style, parent=parent)]
