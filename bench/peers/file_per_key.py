"""One file per key (SGLang HiCacheFile / LMCache local-disk style): write = tmp file + rename."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ..store import leading_present

T = TypeVar("T")

__all__ = ["FilePerKeyStore"]


class FilePerKeyStore:
    """One file per key under ``root/<2 hex digits>/<key hex>``.

    The shard is ``crc32(key) & 0xff`` so that keys sharing a prefix spread over
    the 256 directories. Keys whose hex would pass ``max_name_bytes`` are named
    by their SHA-256 instead. A put writes ``<name>.tmp<n>`` then renames it over
    the final name (atomic replace, like SGLang's HiCacheFile and LMCache's disk
    backend); ``fsync=True`` adds an fsync before the rename. A batch is split
    into up to ``threads`` slices that run in parallel in a small thread pool.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        threads: int = 4,
        fsync: bool = False,
        max_name_bytes: int = 200,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.name = "file-per-key"
        self.root = Path(root)
        self._fsync = fsync
        self._max_name = max_name_bytes
        self._threads = threads
        self._tmp_ids = itertools.count()
        self.root.mkdir(parents=True, exist_ok=True)
        for shard in range(256):
            (self.root / f"{shard:02x}").mkdir(exist_ok=True)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="kvfs-bench-file"
        )

    def path_for(self, key: bytes) -> Path:
        name = key.hex()
        if len(name) > self._max_name:
            name = "h-" + hashlib.sha256(key).hexdigest()
        return self.root / f"{zlib.crc32(key) & 0xFF:02x}" / name

    def _put_slice(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for key, value in items:
            final = self.path_for(key)
            tmp = final.with_name(f"{final.name}.tmp{next(self._tmp_ids)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(value)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)

    def _get_slice(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                with open(self.path_for(key), "rb", buffering=0) as f:
                    out.append(f.readall())
            except FileNotFoundError:
                out.append(None)
        return out

    def _slices(self, n: int) -> list[slice]:
        parts = min(self._threads, n)
        step = -(-n // parts)
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise RuntimeError("FilePerKeyStore is closed")
        return self._pool

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        loop = asyncio.get_running_loop()
        pool = self._executor()
        await asyncio.gather(
            *(
                loop.run_in_executor(pool, self._put_slice, items[s])
                for s in self._slices(len(items))
            )
        )

    async def _per_slice(self, fn: Callable[[Sequence[bytes]], list[T]], keys: list[bytes]) -> list[T]:
        """``fn`` over the keys, one slice a pool thread, the answers in key order."""
        if not keys:
            return []
        loop = asyncio.get_running_loop()
        pool = self._executor()
        parts = await asyncio.gather(*(loop.run_in_executor(pool, fn, keys[s]) for s in self._slices(len(keys))))
        return [v for part in parts for v in part]

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return await self._per_slice(self._get_slice, keys)

    async def exists_many(self, keys: list[bytes]) -> list[bool]:
        """One ``stat`` per key, in the thread pool's slices."""
        return await self._per_slice(self._exists_slice, keys)

    async def match_prefix(self, keys: list[bytes]) -> int:
        return leading_present(await self.exists_many(keys))

    def _exists_slice(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.path_for(k).exists() for k in keys]

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
