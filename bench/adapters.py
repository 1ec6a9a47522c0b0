"""kvfs as a bench ``Store``: the one adapter, and the variants the internal comparisons use."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "ChainReads",
    "ChainStore",
    "CountingStore",
    "KvfsClientLike",
    "KvfsStore",
    "SeparatePutStore",
    "SingleGetStore",
    "kvfs_store",
]


class KvfsClientLike(Protocol):
    """The part of the kvfs client API the bench needs."""

    async def put_many(self, items: Iterable[tuple[bytes, bytes]], /) -> Any: ...

    async def get_many(self, keys: list[bytes], /) -> Sequence[bytes | None]: ...


class KvfsStore:
    """A kvfs client as a bench ``Store``: one ``put_many``/``get_many``/... per call.

    ``client`` is an ``AsyncClient``, or the blocking ``kvfs.Client``: then
    ``blocking`` is that client (the runner calls it from ``iodepth`` threads)
    and the async methods go through its ``submit_*`` futures. ``close()``
    closes the client too unless ``close_client=False`` (for a client the
    caller owns and keeps using). ``server_pids`` names the cluster's
    processes for ``--cpu``.
    """

    def __init__(self, client: Any, *, name: str = "kvfs", close_client: bool = True,
                 server_pids: dict[str, int] | None = None) -> None:
        from kvfs import Client

        self.name = name
        self.client = client
        self.blocking: Client | None = client if isinstance(client, Client) else None
        self._close_client = close_client
        self._server_pids = dict(server_pids or {})

    def pids(self) -> dict[str, int]:
        """The cluster's processes (meta, cs0, ...), when known, for ``--cpu``."""
        return dict(self._server_pids)

    async def _call(self, op: str, *args: Any) -> Any:
        if self.blocking is not None:
            return await asyncio.wrap_future(getattr(self.blocking, f"submit_{op}")(*args))
        return await getattr(self.client, op)(*args)

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        await self._call("put_many", items)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return list(await self._call("get_many", keys))

    async def get_into(self, keys: list[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Each value into its caller buffer; sizes, -1 for a miss."""
        out: list[int] = await self._call("get_into", keys, buffers)
        return out

    async def exists_many(self, keys: list[bytes]) -> list[bool]:
        out: list[bool] = await self._call("exists_many", keys)
        return out

    async def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are present (one meta call)."""
        return int(await self._call("match_prefix", keys))

    async def close(self) -> None:
        if not self._close_client:
            return
        if self.blocking is not None:
            await asyncio.to_thread(self.blocking.close)
            return
        closer = getattr(self.client, "close", None) or getattr(self.client, "aclose", None)
        if closer is not None:
            res = closer()
            if asyncio.iscoroutine(res):
                await res


def kvfs_store(client: KvfsClientLike, *, name: str = "kvfs", close_client: bool = False) -> KvfsStore:
    """Wrap a kvfs client the caller owns as a bench ``Store`` (left open on close)."""
    return KvfsStore(client, name=name, close_client=close_client)


class SingleGetStore(KvfsStore):
    """A batch of B keys is read as B concurrent single-key ``get()`` calls."""

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self.client.get(k) for k in keys)))


class SeparatePutStore(KvfsStore):
    """Writes every key with its own ``put()`` (one call per block)."""

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        for k, v in items:
            await self.client.put(k, v)


class ChainStore(KvfsStore):
    """Writes each chain of ``n`` keys (by key index // n) with one ``put_many``."""

    def __init__(self, client: Any, n: int, name: str = "kvfs") -> None:
        super().__init__(client, name=name)
        self.n = n

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        chains: dict[int, list[tuple[bytes, bytes]]] = {}
        for k, v in items:
            chains.setdefault(int(k[-16:], 16) // self.n, []).append((k, v))
        await asyncio.gather(*(self._call("put_many", c) for c in chains.values()))


@dataclass
class ChainReads:
    """Server reads while a chain workload read: per server (spans, readv calls)."""

    calls: int = 0
    before: list[tuple[int, int]] | None = None
    after: list[tuple[int, int]] | None = None

    def per_chain(self) -> list[tuple[float, float]] | None:
        if not self.calls or self.before is None or self.after is None:
            return None
        return [((a[0] - b[0]) / self.calls, (a[1] - b[1]) / self.calls)
                for a, b in zip(self.after, self.before, strict=True)]


class CountingStore:
    """Wraps a store; snapshots server read counters at the first read and on close."""

    def __init__(self, inner: KvfsStore, snap: Callable[[], list[tuple[int, int]] | None],
                 reads: ChainReads) -> None:
        self.name = inner.name
        self._inner = inner
        self._snap = snap
        self._reads = reads

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        await self._inner.put_many(items)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if self._reads.before is None:
            self._reads.before = self._snap()
        self._reads.calls += 1
        return await self._inner.get_many(keys)

    async def close(self) -> None:
        self._reads.after = self._snap()
        await self._inner.close()
