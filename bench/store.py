"""What the bench drives: the ``Store`` interface every store adapter and peer implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["PeerUnavailable", "Store", "leading_present"]


class PeerUnavailable(Exception):
    """A peer cannot run on this machine (binary missing, cannot start...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@runtime_checkable
class Store(Protocol):
    """What the runner drives. One key = one io; a call carries a batch of keys.

    Optional, looked up by name: ``get_into(keys, buffers)``,
    ``exists_many(keys)``, ``match_prefix(keys)`` (the ``--api`` reads; a
    store without one is skipped for those rows), ``buffer(n)`` (get_into's
    buffers), ``pids()`` (``--cpu``) and ``blocking`` (see ``run_workload``).
    """

    name: str

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None: ...

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...

    async def close(self) -> None: ...


def leading_present(flags: Sequence[bool]) -> int:
    """``match_prefix`` from ``exists_many``: how many leading keys are present."""
    for i, present in enumerate(flags):
        if not present:
            return i
    return len(flags)
