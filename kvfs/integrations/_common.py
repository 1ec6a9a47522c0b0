"""What the engine plug-ins share: a client whose calls never outwait the engine, and
byte views over engine tensors (no copies)."""

from __future__ import annotations

import logging
from typing import Any

from kvfs.buffers import Parts, as_view, regions
from kvfs.config import ClientConfig, EngineConfig, tls_fields
from kvfs.errors import InvalidArgument, KVFSError
from kvfs.sync import Client

log = logging.getLogger("kvfs.integrations")

# What a plug-in turns into a miss/failure for its engine: kvfs errors, a call that ran past
# its timeout, a closed client.  Anything else is a bug and propagates.
SOFT_ERRORS: tuple[type[BaseException], ...] = (KVFSError, TimeoutError, OSError)


def client_config(cfg: EngineConfig) -> ClientConfig:
    """A client's settings tuned for an engine: RPCs give up after ``timeout_s``, so a dead
    or slow cluster costs the engine a bounded wait, then a miss."""
    return ClientConfig(request_timeout_s=cfg.timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                        **tls_fields(cfg))


def open_client(cfg: EngineConfig) -> Client:
    """A blocking client with :func:`client_config`'s settings."""
    return Client(cfg.addr, token=cfg.token, config=client_config(cfg))


class TensorBytes:
    """A flat byte view over one contiguous CPU tensor, addressed by data pointer."""

    def __init__(self, tensor: Any) -> None:
        if not tensor.is_contiguous():
            raise ValueError("the engine's host buffer must be contiguous")
        self.tensor = tensor  # keeps the memory alive while views exist
        self.view = as_view(tensor, writable=True, what="host buffer")
        self.base = int(tensor.data_ptr())

    def parts(self, ptrs: list[int], sizes: list[int], per: int, *,
              base: int | None = None) -> list[Parts]:
        """Each page's ``per`` regions: ``sizes[i]`` bytes at each pointer, as views grouped
        a page at a time (the bounds checked once, for all: nothing per region);
        ``base=0``: the pointers are offsets into the buffer already."""
        base = self.base if base is None else base
        offs = [p - base for p in ptrs] if base else ptrs
        try:
            return regions(self.view, offs, sizes, per, writable=True, what="host buffer")
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None


def wait(fut: Any, cfg: EngineConfig) -> Any:
    """The result of a ``submit_*`` future, waiting at most a few RPC timeouts (a call may
    take a lookup, a read and a retry); a late one is cancelled and raises TimeoutError."""
    try:
        return fut.result(3 * cfg.timeout_s)
    except TimeoutError:
        fut.cancel()
        raise
