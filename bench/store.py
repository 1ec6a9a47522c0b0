"""What the bench drives: the ``Store`` interface every store adapter and peer implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["PeerUnavailable", "Store"]


class PeerUnavailable(Exception):
    """A peer cannot run on this machine (binary missing, cannot start...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@runtime_checkable
class Store(Protocol):
    """What the runner drives. One key = one io; a call carries a batch of keys."""

    name: str

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None: ...

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...

    async def close(self) -> None: ...
