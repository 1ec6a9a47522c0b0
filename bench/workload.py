"""A mixed read/write workload that checks every byte it reads, for fault tests and the soak.

Writers ``put_many`` new keys in small batches; a key counts as committed only once its
put returned.  Readers ``get_many`` random committed keys and compare each value with
the bytes its key determines (:class:`Values`), so a wrong byte can never pass unseen.
Figures are kept per phase (:meth:`MixedWorkload.phase`): reads, wrong values, misses
of committed keys, read errors, failed puts, and the longest single read (the stall a
reader saw).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvfs.client import AsyncClient
from kvfs.errors import KVFSError

MiB = 1024 * 1024


@dataclass(frozen=True)
class Values:
    """The value each key always holds: 1 KiB to ``max_small`` bytes (from its hash), one
    key in ``large_every`` 1.5 MiB (striped over two servers), its digest repeated, so
    any wrong byte is detectable."""

    max_small: int = 64 * 1024
    large_every: int = 50

    def size(self, key: bytes) -> int:
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        if self.large_every and h % self.large_every == 0:
            return 3 * MiB // 2
        return 1024 + h % max(self.max_small - 1024, 1)

    def of(self, key: bytes) -> bytes:
        n = self.size(key)
        d = hashlib.blake2b(key, digest_size=64).digest()
        return (d * (n // len(d) + 1))[:n]


@dataclass
class Figures:
    """What one phase of the workload saw."""

    name: str
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    puts_ok: int = 0
    puts_failed: int = 0
    asked: int = 0  # values asked for (each key of a get_many, answered or not)
    reads: int = 0  # values read (each key of a get_many that returned)
    wrong: int = 0  # values whose bytes differ from what was put: must always be 0
    misses: int = 0  # committed keys read as missing
    read_errors: int = 0  # get_many calls that raised
    longest_read_s: float = 0.0  # the longest single get_many: the stall a reader saw
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.name, "seconds": round(self.seconds, 2), "puts_ok": self.puts_ok,
                "puts_failed": self.puts_failed, "asked": self.asked, "reads": self.reads, "wrong": self.wrong,
                "misses": self.misses, "read_errors": self.read_errors,
                "longest_read_s": round(self.longest_read_s, 3), "errors": dict(self.errors)}


class MixedWorkload:
    """``writers`` + ``readers`` coroutines until :meth:`stop`; ``writer`` and ``reader``
    may be one client or two (a reader with its own layout cache asks meta as a fresh
    process would)."""

    def __init__(self, writer: AsyncClient, reader: AsyncClient, *, prefix: str = "w",
                 writers: int = 2, readers: int = 3, batch: int = 8,
                 values: Values = Values(), write_pause_s: float = 0.0,
                 max_keys: int = 100_000) -> None:
        self.writer, self.reader = writer, reader
        self.prefix = prefix
        self.nwriters, self.nreaders, self.batch = writers, readers, batch
        self.values = values
        self.write_pause_s = write_pause_s  # pacing between a writer's puts
        self.max_keys = max_keys
        self.committed: list[bytes] = []
        self.history: list[Figures] = []
        self.now = Figures("start")
        self._seq = 0
        self._stop = asyncio.Event()
        self._progress = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random(1)

    def phase(self, name: str) -> Figures:
        """Close the current phase (returned) and start counting a new one."""
        done = self.now
        done.ended = time.monotonic()
        self.history.append(done)
        self.now = Figures(name)
        return done

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write_loop(i)) for i in range(self.nwriters)]
        self._tasks += [loop.create_task(self._read_loop()) for _ in range(self.nreaders)]

    async def stop(self) -> Figures:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.phase("stopped")

    async def wait_reads(self, n: int, timeout_s: float) -> None:
        """Until readers asked for ``n`` more values in this phase, answered or not (or the
        timeout: then the figures say how few)."""
        target = self.now.asked + n
        async with self._progress:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._progress.wait_for(lambda: self.now.asked >= target)
            except TimeoutError:
                pass

    async def wait_committed(self, n: int, timeout_s: float) -> None:
        """Until at least ``n`` keys are committed (or the timeout)."""
        async with self._progress:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._progress.wait_for(lambda: len(self.committed) >= n)
            except TimeoutError:
                pass

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    def _new_keys(self) -> list[bytes]:
        keys = []
        for _ in range(self.batch):
            self._seq += 1
            keys.append(f"{self.prefix}/{self._seq:08d}".encode())
        return keys

    async def _write_loop(self, i: int) -> None:
        while not self._stop.is_set() and len(self.committed) < self.max_keys:
            keys = self._new_keys()
            fig = self.now
            try:
                await self.writer.put_many([(k, self.values.of(k)) for k in keys])
            except KVFSError as exc:
                fig.puts_failed += 1
                fig.errors[f"put: {type(exc).__name__}"] += 1
                await asyncio.sleep(0.05)  # pacing after a failure, not a wait for a condition
                continue
            fig.puts_ok += 1
            self.committed.extend(keys)
            await self._notify()
            await asyncio.sleep(self.write_pause_s)

    async def _read_loop(self) -> None:
        while not self._stop.is_set():
            if not self.committed:
                await asyncio.sleep(0.01)
                continue
            keys = [self._rng.choice(self.committed) for _ in range(self.batch)]
            fig = self.now
            t0 = time.monotonic()
            try:
                got = await self.reader.get_many(keys)
            except KVFSError as exc:
                fig.asked += len(keys)
                fig.read_errors += 1
                fig.errors[f"get: {type(exc).__name__}"] += 1
                fig.longest_read_s = max(fig.longest_read_s, time.monotonic() - t0)
                await self._notify()
                await asyncio.sleep(0.05)
                continue
            fig.asked += len(keys)
            fig.longest_read_s = max(fig.longest_read_s, time.monotonic() - t0)
            for k, v in zip(keys, got, strict=True):
                fig.reads += 1
                if v is None:
                    fig.misses += 1
                elif v != self.values.of(k):
                    fig.wrong += 1
            await self._notify()


async def verify_all(client: AsyncClient, keys: list[bytes], values: Values, *,
                     batch: int = 64) -> tuple[int, int, int]:
    """Read every key once: (misses, wrong values, keys whose read raised)."""
    misses = wrong = failed = 0
    for i in range(0, len(keys), batch):
        part = keys[i:i + batch]
        try:
            got = await client.get_many(part)
        except KVFSError:
            for k in part:  # one by one: which keys cannot be read
                try:
                    v = await client.get(k)
                except KVFSError:
                    failed += 1
                    continue
                misses += v is None
                wrong += v is not None and v != values.of(k)
            continue
        for k, v in zip(part, got, strict=True):
            misses += v is None
            wrong += v is not None and v != values.of(k)
    return misses, wrong, failed


async def under_replicated(client: AsyncClient, keys: list[bytes], replicas: int) -> int:
    """Keys with an extent held by fewer than ``replicas`` servers that meta reports alive
    (a missing key counts too)."""
    alive = {s.server_id for s in await client.servers(refresh=True) if s.alive}
    short = 0
    for i in range(0, len(keys), 256):
        layouts = await asyncio.gather(*(client.layout(k) for k in keys[i:i + 256]))
        for lay in layouts:
            if lay is None or any(sum(r.server_id in alive for r in e.replicas) < replicas
                                  for e in lay.extents):
                short += 1
    return short
