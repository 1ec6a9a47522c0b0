"""Mooncake Store over its TCP transport as a peer (``mooncake-transfer-engine-non-cuda``).

The peer starts two processes on loopback: ``mooncake_master`` (metadata) and
one ``mooncake_client`` that mounts the only memory segment
(``segment_bytes``, 2 GiB by default). The bench process sets up a
``MooncakeDistributedStore`` with a segment of size 0, so every byte it puts
or gets crosses the TCP transport to the segment process, as a remote
inference node's would. Transfer-engine metadata goes peer to peer
(``P2PHANDSHAKE``): no etcd or HTTP metadata server.

Calls are ``batch_put_from`` / ``batch_get_into`` on registered buffers (the
zero-copy API an engine uses): values are staged into a registered buffer
before a put; ``get_into`` receives into registered buffers the caller took
from ``buffer()``; ``get_many`` copies each value out of a registered buffer
into ``bytes`` (what a caller that wants separate values pays; the size of
each value is the one this store put, as Mooncake's get needs it up front). A key that was
already put is rewritten with ``batch_upsert_from`` (Mooncake objects are
immutable: a plain put of an existing key is a no-op), so repeated write passes
really move the bytes. The store's calls block;
they run on ``threads`` worker threads so ``iodepth`` calls can be in flight.

Keys in flight are bounded. Every key of a ``batch_put_from`` / ``batch_get_into``
is one transfer on Mooncake's TCP transport, which queues at most
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (default 1024) transfers per peer, parks
as many again for at most ``MC_TCP_ADMISSION_TIMEOUT_MS`` (1 s), and fails the
rest (its log: "TCP lane queue-full rejection"; the key's code: -800,
TRANSFER_FAIL). So a call of more than ``max_keys_in_flight // threads`` keys is
split into calls of at most that many, run on the same ``threads`` workers: at
most ``max_keys_in_flight`` keys (default: that queue's size) are in flight. The
bench's calls (4 KiB x 128 keys, iodepth 4: 512 keys; its prefill's too) are not
split; a larger call is.

Mooncake binds fixed ports (it has no port 0): the master's RPC and metrics
ports and the client's service port are three consecutive ports from a
random start in ``PORT_RANGE``, below Linux's ephemeral ports (which
outgoing connections take) and above Mooncake's own automatic ones. A
process is ready once it itself listens on its ports (read from ``/proc``:
a connect could reach another process on the same port). A process that
exits at start while one of its ports is taken by another socket is started
again from another port, up to ``port_attempts`` times; a client that fails
so takes its master with it (the master would keep the segment the client
mounted before it failed, and hand puts to it). If the package is missing the peer raises
``PeerUnavailable`` and the comparison shows why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from ..store import PeerUnavailable, leading_present
from ._process import listening_ports, ports_in_use, wait_or_kill

__all__ = ["MooncakeStore"]

# below Linux's default ephemeral ports (32768-60999), above Mooncake's automatic ones
# (its client's 12300-14300, its transfer engine's 15000-17000)
PORT_RANGE: Final = (20000, 32768)
_ADDR_IN_USE: Final = ("Address already in use", "address in use")
POLL_S: Final = 0.02
# Mooncake's TCP transport: transfers queued per peer (its MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER)
QUEUED_TRANSFERS_ENV: Final = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
QUEUED_TRANSFERS_DEFAULT: Final = 1024


def _transport_queue() -> int:
    """The TCP transport's per-peer queue in this process (its env setting, else its default)."""
    try:
        return max(1, int(os.environ[QUEUED_TRANSFERS_ENV]))
    except (KeyError, ValueError):
        return QUEUED_TRANSFERS_DEFAULT


def _tool(name: str) -> str | None:
    """A Mooncake binary: the package's own, else a console script on $PATH or beside
    this interpreter (which execs that binary, after starting a Python)."""
    with contextlib.suppress(ImportError):
        import mooncake

        own = Path(mooncake.__file__).parent / name
        if own.is_file() and os.access(own, os.X_OK):
            return str(own)
    found = shutil.which(name)
    if found is not None:
        return found
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else None


class _Arena:
    """A registered buffer handed out in slices; reused between calls."""

    def __init__(self, store: Any, nbytes: int) -> None:
        import numpy as np

        self.array = np.empty(max(nbytes, 1), dtype=np.uint8)
        self.view = self.array.data.cast("B")
        self.ptr = int(self.array.ctypes.data)
        self.nbytes = len(self.view)
        rc = store.register_buffer(self.ptr, self.nbytes)
        if rc != 0:
            raise OSError(f"mooncake register_buffer({self.nbytes}) returned {rc}")


class MooncakeStore:
    """Mooncake Store (master + one segment process) behind the bench ``Store`` interface."""

    def __init__(
        self,
        *,
        segment_bytes: int = 2 << 30,
        threads: int = 4,
        max_keys_in_flight: int | None = None,
        start_timeout_s: float = 30.0,
        port_attempts: int = 10,
        seed: int | None = None,
    ) -> None:
        """Configure only; ``start()`` launches the processes (or use ``MooncakeStore.open``)."""
        self.name = "mooncake"
        self.segment_bytes = segment_bytes
        self.threads = threads
        self.max_keys_in_flight = max_keys_in_flight or _transport_queue()
        if self.max_keys_in_flight < threads:
            raise ValueError(f"max_keys_in_flight ({self.max_keys_in_flight}) < threads ({threads})")
        self.keys_per_call = self.max_keys_in_flight // threads
        self.start_timeout_s = start_timeout_s
        self.port_attempts = port_attempts
        self._rng = random.Random(seed)
        self.master_port = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._procs: list[asyncio.subprocess.Process] = []
        self._store: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._free: list[_Arena] = []
        self._written: set[str] = set()
        self._sizes: dict[bytes, int] = {}

    @classmethod
    async def open(cls, **kwargs: Any) -> MooncakeStore:
        """Configure and start; raises ``PeerUnavailable`` if Mooncake cannot run here."""
        store = cls(**kwargs)
        await store.start()
        return store

    # -- processes -----------------------------------------------------------

    async def start(self) -> MooncakeStore:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise PeerUnavailable(
                f"mooncake not installed (pip install mooncake-transfer-engine-non-cuda): {e}"
            ) from None
        master, client = _tool("mooncake_master"), _tool("mooncake_client")
        if master is None or client is None:
            raise PeerUnavailable("mooncake_master / mooncake_client not found")
        if self._tmp is not None:
            raise RuntimeError("MooncakeStore already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="kvfs-bench-mooncake-")
        try:
            await self._launch(master, client)
            store = MooncakeDistributedStore()
            rc = await asyncio.to_thread(
                store.setup, "127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "",
                f"127.0.0.1:{self.master_port}",
            )
            if rc != 0:
                raise PeerUnavailable(f"mooncake setup() returned {rc}: {self._log_tail()!r}")
            self._store = store
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvfs-bench-mooncake")
        except BaseException:
            await self.close()
            raise
        return self

    def _ports(self) -> list[int]:
        """Each start's first port: its master's RPC port; +1 its metrics, +2 its client's."""
        lo, hi = PORT_RANGE
        return [self._rng.randrange(lo, hi - 2) for _ in range(self.port_attempts)]

    def _log(self, name: str) -> Path:
        assert self._tmp is not None
        return Path(self._tmp.name) / name

    def _log_tail(self, nbytes: int = 1500) -> str:
        out = []
        for name in ("mooncake_master.log", "mooncake_client.log"):
            with contextlib.suppress(OSError):
                out.append(self._log(name).read_bytes()[-nbytes:].decode(errors="replace"))
        return "\n".join(out)

    async def _spawn(self, argv: list[str], log: str) -> asyncio.subprocess.Process:
        assert self._tmp is not None
        with open(self._log(log), "wb") as f:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=f, stderr=asyncio.subprocess.STDOUT,
                cwd=self._tmp.name,
            )
        self._procs.append(proc)
        return proc

    async def _wait_ready(self, proc: asyncio.subprocess.Process, ports: Sequence[int], log: str) -> bool:
        """True once ``proc`` itself listens on every port; False if it exited first."""
        deadline = time.monotonic() + self.start_timeout_s
        want = set(ports)
        while proc.returncode is None:
            if want <= listening_ports(proc.pid):
                return True
            if time.monotonic() > deadline:
                raise PeerUnavailable(f"{log}: ports {sorted(want)} not open within {self.start_timeout_s:g}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), POLL_S)
        return False

    async def _start(self, argv: list[str], ports: list[int]) -> bool:
        """Start a process; True once it listens on ``ports``, False if it exited while one
        of them was taken (raises ``PeerUnavailable`` if it exited for another reason)."""
        name = Path(argv[0]).name
        proc = await self._spawn(argv, f"{name}.log")
        if await self._wait_ready(proc, ports, name):
            return True
        self._procs.remove(proc)
        if set(ports) & ports_in_use() or any(s in self._log_tail() for s in _ADDR_IN_USE):
            return False
        raise PeerUnavailable(f"{name} exited at start: {self._log_tail()!r}")

    async def _launch(self, master: str, client: str) -> None:
        """The master, then the segment client, on three ports from a random start; if the
        client's port was taken, both again elsewhere (the master would keep the segment the
        client mounted before it failed, and hand puts to it)."""
        for port in self._ports():
            if not await self._start([
                master, f"-rpc_port={port}", "-rpc_address=127.0.0.1", f"-metrics_port={port + 1}",
                "-metrics_host=127.0.0.1", "-enable_metric_reporting=false", "-logtostderr",
            ], [port, port + 1]):
                continue
            self.master_port = port
            if await self._start([
                client, f"-master_server_address=127.0.0.1:{port}", "-metadata_server=P2PHANDSHAKE",
                "-host=127.0.0.1", f"-port={port + 2}", f"-global_segment_size={self.segment_bytes}",
                "-protocol=tcp", "-logtostderr",
            ], [port + 2]):
                return
            await self._stop_processes()
        raise PeerUnavailable(f"mooncake: no free ports in {self.port_attempts} attempts")

    async def _stop_processes(self) -> None:
        procs, self._procs = self._procs, []
        for proc in reversed(procs):  # the segment client first, then the master
            if proc.returncode is None:
                proc.terminate()
                await wait_or_kill(proc, 10.0)

    def pids(self) -> dict[str, int]:
        """The peer's own processes (for ``--cpu``)."""
        names = ("mooncake_master", "mooncake_client")
        return {n: p.pid for n, p in zip(names, self._procs, strict=False)}

    # -- buffers -------------------------------------------------------------

    def _take(self, nbytes: int) -> _Arena:
        for i, a in enumerate(self._free):
            if a.nbytes >= nbytes:
                return self._free.pop(i)
        return _Arena(self._store, nbytes)

    def buffer(self, nbytes: int) -> memoryview:
        """A registered buffer of ``nbytes`` for ``get_into`` (kept until close)."""
        return self._take(nbytes).view[:nbytes]

    async def _call(self, fn: Any, *args: Any) -> Any:
        if self._pool is None or self._store is None:
            raise RuntimeError("MooncakeStore is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _transfer(self, fn: Any, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """``fn(keys, ptrs, sizes)`` (a batch put or get) in calls of at most ``keys_per_call``
        keys on the worker threads, so at most ``max_keys_in_flight`` keys are in flight;
        each key's code, in order."""
        n = self.keys_per_call
        if len(keys) <= n:
            rcs: list[int] = await self._call(fn, keys, ptrs, sizes)
            return rcs
        parts = await asyncio.gather(*(self._call(fn, keys[i : i + n], ptrs[i : i + n], sizes[i : i + n])
                                       for i in range(0, len(keys), n)))
        return [rc for part in parts for rc in part]

    # -- Store ---------------------------------------------------------------

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        sizes = [len(v) for _, v in items]
        arena = self._take(sum(sizes))
        try:
            ptrs, pos = [], 0
            for (_, v), n in zip(items, sizes, strict=True):
                arena.view[pos : pos + n] = v
                ptrs.append(arena.ptr + pos)
                pos += n
            keys = [k.decode("latin-1") for k, _ in items]
            fresh = [i for i, k in enumerate(keys) if k not in self._written]
            again = [i for i, k in enumerate(keys) if k in self._written]
            for idx, fn in ((fresh, self._store.batch_put_from), (again, self._store.batch_upsert_from)):
                if not idx:
                    continue
                rcs = await self._transfer(fn, [keys[i] for i in idx], [ptrs[i] for i in idx],
                                           [sizes[i] for i in idx])
                bad = [rc for rc in rcs if rc != 0]
                if bad:
                    raise OSError(f"mooncake put: {len(bad)} of {len(idx)} keys failed (code {bad[0]})")
            self._written.update(keys)
            self._sizes.update((k, n) for (k, _), n in zip(items, sizes, strict=True))
        finally:
            self._free.append(arena)

    async def get_into(self, keys: list[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Each value into its buffer (from ``buffer()``); bytes read per key, < 0 for a miss."""
        import numpy as np

        ptrs = [int(np.frombuffer(b, dtype=np.uint8).ctypes.data) for b in buffers]
        if self._store is None:
            raise RuntimeError("MooncakeStore is closed")
        return await self._transfer(self._store.batch_get_into, [k.decode("latin-1") for k in keys], ptrs,
                                    [len(b) for b in buffers])

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        sizes = [self._sizes.get(k, -1) for k in keys]
        known = [i for i, n in enumerate(sizes) if n >= 0]  # a key this store never put is a miss
        arena = self._take(sum(sizes[i] for i in known))
        try:
            ptrs, pos = [], 0
            for i in known:
                ptrs.append(arena.ptr + pos)
                pos += sizes[i]
            rcs = await self._transfer(self._store.batch_get_into, [keys[i].decode("latin-1") for i in known],
                                       ptrs, [sizes[i] for i in known]) if known else []
            out: list[bytes | None] = [None] * len(keys)
            pos = 0
            for i, rc in zip(known, rcs, strict=True):
                n = sizes[i]
                if rc == n:
                    out[i] = bytes(arena.view[pos : pos + n])
                pos += n
            return out
        finally:
            self._free.append(arena)

    async def exists_many(self, keys: list[bytes]) -> list[bool]:
        rcs = await self._call(self._store.batch_is_exist, [k.decode("latin-1") for k in keys])
        return [rc == 1 for rc in rcs]

    async def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys exist (one ``batch_is_exist``)."""
        return leading_present(await self.exists_many(keys))

    async def close(self) -> None:
        store, self._store = self._store, None
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if store is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(store.remove_all, True)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(store.close)
        self._free.clear()
        await self._stop_processes()
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            tmp.cleanup()

