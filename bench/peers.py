"""Baseline stores the bench compares kvfs with, behind one async interface.

* ``FilePerKeyStore``: one file per key, write = tmp file + rename (SGLang
  HiCacheFile / LMCache local-disk style).
* ``RedisStore``: its own ``redis-server`` subprocess; MSET / MGET per batch.
* ``LoopbackLimit``: not a store but the ceiling: the same bytes per batch moved
  over one loopback TCP connection with no storage behind it.
* ``run_fio_file``: the real ``fio`` binary on a file, for the raw-disk row.

A peer that cannot run here raises ``PeerUnavailable(reason)``; callers print
``skipped: <reason>``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, Literal, Protocol, cast, runtime_checkable

from ._loopback_server import ACK, HEADER, OP_GET, OP_PUT, LoopbackServer

__all__ = [
    "FilePerKeyStore",
    "LoopbackLimit",
    "PeerUnavailable",
    "RedisStore",
    "Store",
    "run_fio_file",
]


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


# ---------------------------------------------------------------------------
# One file per key


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

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        loop = asyncio.get_running_loop()
        pool = self._executor()
        parts = await asyncio.gather(
            *(loop.run_in_executor(pool, self._get_slice, keys[s]) for s in self._slices(len(keys)))
        )
        return [v for part in parts for v in part]

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


# ---------------------------------------------------------------------------
# Redis

REDIS_PORT_RANGE: Final = (20000, 60000)


def _no_retry() -> Any:
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Retry(NoBackoff(), 0)


_ADDR_IN_USE = "Address already in use"


class RedisStore:
    """A private ``redis-server`` subprocess; MSET per put batch, MGET per get batch.

    Use ``await RedisStore.open(...)``. ``transport="tcp"`` (the default: kvfs
    talks TCP) listens on 127.0.0.1 at a port Redis binds itself: ports are tried
    from a random start in 20000-60000, and a start that fails with "Address
    already in use" moves to the next port (``port_attempts`` tries). Redis
    cannot report a port it picked (``--port 0`` means "no TCP"), and picking a
    free port by binding and releasing one is forbidden here. ``transport="unix"``
    runs with ``--port 0 --unixsocket`` and needs no port at all. Either way the
    server has a unix socket in its private temp dir, used to wait for ``PING``.

    No persistence (``--save '' --appendonly no``), no memory limit. Batches
    above ``max_command_bytes`` are split into several MSET/MGET commands sent
    in one pipeline.
    """

    def __init__(
        self,
        *,
        transport: Literal["tcp", "unix"] = "tcp",
        redis_server: str = "redis-server",
        start_timeout_s: float = 10.0,
        port_attempts: int = 20,
        max_command_bytes: int = 64 << 20,
        seed: int | None = None,
    ) -> None:
        """Configure only; ``start()`` launches the server (or use ``RedisStore.open``)."""
        self.name = "redis"
        self.transport = transport
        self.redis_server = redis_server
        self.start_timeout_s = start_timeout_s
        self.port_attempts = port_attempts
        self.max_command_bytes = max_command_bytes
        self.seed = seed
        self.port = 0
        self.unix_socket = ""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._client: Any = None

    @classmethod
    async def open(
        cls,
        *,
        transport: Literal["tcp", "unix"] = "tcp",
        redis_server: str = "redis-server",
        start_timeout_s: float = 10.0,
        port_attempts: int = 20,
        max_command_bytes: int = 64 << 20,
        seed: int | None = None,
    ) -> RedisStore:
        """Configure and start; raises ``PeerUnavailable`` if Redis cannot run here."""
        store = cls(
            transport=transport,
            redis_server=redis_server,
            start_timeout_s=start_timeout_s,
            port_attempts=port_attempts,
            max_command_bytes=max_command_bytes,
            seed=seed,
        )
        await store.start()
        return store

    async def start(self) -> RedisStore:
        exe = shutil.which(self.redis_server)
        if exe is None:
            raise PeerUnavailable(f"{self.redis_server} not installed")
        try:
            import redis.asyncio as aioredis
        except ImportError as e:  # pragma: no cover - redis-py is a bench dependency
            raise PeerUnavailable(f"redis-py not installed ({e})") from e
        if self._tmp is not None:
            raise RuntimeError("RedisStore already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="kvfs-bench-redis-")
        self.unix_socket = os.path.join(self._tmp.name, "redis.sock")
        try:
            await self._launch(exe)
            # No retries (redis-py retries with backoff by default): a bench must
            # not hide failures, and SHUTDOWN's dropped connection is expected.
            common: dict[str, Any] = {
                "socket_timeout": 60,
                "socket_connect_timeout": 10,
                "retry": _no_retry(),
            }
            if self.transport == "tcp":
                self._client = aioredis.Redis(host="127.0.0.1", port=self.port, **common)
            else:
                self._client = aioredis.Redis(unix_socket_path=self.unix_socket, **common)
            await self._client.ping()
        except BaseException:
            await self.close()
            raise
        return self

    def _args(self, exe: str, port: int) -> list[str]:
        assert self._tmp is not None
        return [
            exe,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--unixsocket", self.unix_socket,
            "--unixsocketperm", "700",
            "--dir", self._tmp.name,
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", "0",
            "--daemonize", "no",
            "--protected-mode", "no",
            "--logfile", os.path.join(self._tmp.name, "redis.log"),
        ]  # fmt: skip

    def _log_tail(self, nbytes: int = 2000) -> str:
        if self._tmp is None:
            return ""
        try:
            with open(os.path.join(self._tmp.name, "redis.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    async def _launch(self, exe: str) -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import BusyLoadingError
        from redis.exceptions import ConnectionError as RedisConnectionError

        transport, timeout_s = self.transport, self.start_timeout_s
        lo, hi = REDIS_PORT_RANGE
        first = random.Random(self.seed).randrange(lo, hi)
        ports = (
            [0]
            if transport == "unix"
            else [lo + (first - lo + i) % (hi - lo) for i in range(self.port_attempts)]
        )
        for port in ports:
            deadline = time.monotonic() + timeout_s
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_socket)
            self._proc = await asyncio.create_subprocess_exec(
                *self._args(exe, port),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            probe = aioredis.Redis(
                unix_socket_path=self.unix_socket, socket_connect_timeout=1, retry=_no_retry()
            )
            try:
                # Poll PING with a deadline; stop early if the process exits.
                while True:
                    if self._proc.returncode is not None:
                        break
                    try:
                        if await probe.ping():
                            self.port = port
                            return
                    except (RedisConnectionError, BusyLoadingError, OSError):
                        pass
                    if time.monotonic() > deadline:
                        raise PeerUnavailable(
                            f"redis-server did not answer PING within {timeout_s:g}s: "
                            f"{self._log_tail(500)!r}"
                        )
                    await asyncio.sleep(0.005)
            finally:
                await probe.aclose()
            assert self._proc.stderr is not None
            err = (await self._proc.stderr.read()).decode(errors="replace")
            await self._proc.wait()
            log = self._log_tail() + err
            self._proc = None
            if _ADDR_IN_USE in log and transport == "tcp":
                continue
            raise PeerUnavailable(f"redis-server exited at start: {log.strip()[-500:]!r}")
        raise PeerUnavailable(f"redis-server: no free port in {len(ports)} attempts")

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        groups = self._split(items)
        if len(groups) == 1:
            await self._client.execute_command("MSET", *itertools.chain.from_iterable(items))
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for g in groups:
                pipe.execute_command("MSET", *itertools.chain.from_iterable(g))
            await pipe.execute()

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        # Values are unknown before the read: split MGETs by key count only.
        groups = [keys[i : i + 4096] for i in range(0, len(keys), 4096)]
        if len(groups) == 1:
            out: list[bytes | None] = await self._client.execute_command("MGET", *keys)
            return out
        async with self._client.pipeline(transaction=False) as pipe:
            for g in groups:
                pipe.execute_command("MGET", *g)
            parts: list[list[bytes | None]] = await pipe.execute()
        return [v for part in parts for v in part]

    def _split(self, items: list[tuple[bytes, bytes]]) -> list[list[tuple[bytes, bytes]]]:
        groups: list[list[tuple[bytes, bytes]]] = [[]]
        acc = 0
        for kv in items:
            n = len(kv[0]) + len(kv[1]) + 32
            if groups[-1] and acc + n > self.max_command_bytes:
                groups.append([])
                acc = 0
            groups[-1].append(kv)
            acc += n
        return groups

    async def close(self) -> None:
        from redis.exceptions import RedisError

        client, self._client = self._client, None
        proc, self._proc = self._proc, None
        if client is not None:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(RedisError, OSError):
                    await client.execute_command("SHUTDOWN", "NOSAVE")
            await client.aclose()
        if proc is not None:
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(proc.wait(), 5.0)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
            if proc.stderr is not None:
                await proc.stderr.read()
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            tmp.cleanup()


# ---------------------------------------------------------------------------
# Loopback limit


class _LoopbackClientProtocol(asyncio.BufferedProtocol):
    """Receives every answer straight into the buffer of the request at the head."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._pending: collections.deque[tuple[asyncio.Future[int], memoryview, list[int]]] = (
            collections.deque()
        )
        self._scratch = memoryview(bytearray(64 << 10))
        self._drained = asyncio.Event()
        self._drained.set()
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = tr = cast(asyncio.Transport, transport)
        tr.set_write_buffer_limits(high=4 << 20)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("loopback server closed the connection")
        while self._pending:
            fut, _, _ = self._pending.popleft()
            if not fut.done():
                fut.set_exception(self.lost)
        self._drained.set()

    def pause_writing(self) -> None:
        self._drained.clear()

    def resume_writing(self) -> None:
        self._drained.set()

    async def drained(self) -> None:
        await self._drained.wait()

    def expect(self, buf: memoryview) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if self.lost is not None:
            fut.set_exception(self.lost)
            return fut
        if len(buf) == 0:
            fut.set_result(0)
        else:
            self._pending.append((fut, buf, [0]))
        return fut

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._pending:
            _, buf, pos = self._pending[0]
            return buf[pos[0] :]
        return self._scratch  # bytes nobody asked for: protocol error, see buffer_updated

    def buffer_updated(self, nbytes: int) -> None:
        if not self._pending:
            if self.transport is not None:
                self.transport.close()
            return
        fut, buf, pos = self._pending[0]
        pos[0] += nbytes
        if pos[0] == len(buf):
            self._pending.popleft()
            if not fut.done():
                fut.set_result(len(buf))


class LoopbackLimit:
    """The raw loopback ceiling: the same bytes per batch, no storage behind them.

    ``get_many`` of B keys of S bytes is one request for B*S bytes that the
    server sends from a preallocated buffer and the client receives, with
    ``asyncio.BufferedProtocol``, into a preallocated ``bytearray``.
    ``put_many`` sends the B values (one vectored write) and waits for the
    server's ack after it has received them all. Requests are multiplexed on one
    connection, answered in order, so iodepth > 1 pipelines them.

    The payload is not round-tripped: ``put_many`` only remembers each key's
    length. ``get_many`` returns ``None`` for a key never put and, with
    ``copy_out=False`` (default, the true ceiling), one shared zero-filled
    ``bytes`` of the right length per key; ``copy_out=True`` returns each value
    as a fresh ``bytes`` copied out of the receive buffer (what a real client
    pays to hand out separate values).

    ``server="process"`` (default) runs the server in its own Python process,
    like Redis or a kvfs chunkserver; ``server="inprocess"`` puts it on the
    caller's event loop (no subprocess; both ends then share one core).
    """

    def __init__(
        self,
        *,
        server: Literal["process", "inprocess"] = "process",
        copy_out: bool = False,
        start_timeout_s: float = 10.0,
    ) -> None:
        """Configure only; ``start()`` connects (or use ``LoopbackLimit.open``)."""
        self.name = "loopback"
        self.server = server
        self.copy_out = copy_out
        self.start_timeout_s = start_timeout_s
        self.bytes_sent = 0
        self.bytes_received = 0
        self._sizes: dict[bytes, int] = {}
        self._zeros: dict[int, bytes] = {}
        self._free: list[bytearray] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._server: LoopbackServer | None = None
        self._proto: _LoopbackClientProtocol | None = None

    @classmethod
    async def open(
        cls,
        *,
        server: Literal["process", "inprocess"] = "process",
        copy_out: bool = False,
        start_timeout_s: float = 10.0,
    ) -> LoopbackLimit:
        limit = cls(server=server, copy_out=copy_out, start_timeout_s=start_timeout_s)
        await limit.start()
        return limit

    async def start(self) -> LoopbackLimit:
        if self._proto is not None or self._proc is not None or self._server is not None:
            raise RuntimeError("LoopbackLimit already started")
        try:
            if self.server == "inprocess":
                self._server = LoopbackServer()
                port = await self._server.start()
            else:
                port = await self._spawn(self.start_timeout_s)
            loop = asyncio.get_running_loop()
            _, proto = await loop.create_connection(_LoopbackClientProtocol, "127.0.0.1", port)
            self._proto = proto
        except BaseException:
            await self.close()
            raise
        return self

    async def _spawn(self, timeout_s: float) -> int:
        script = Path(__file__).with_name("_loopback_server.py")
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), timeout_s)
        except TimeoutError:
            raise PeerUnavailable(f"loopback server did not start within {timeout_s:g}s") from None
        if not line.startswith(b"PORT "):
            # The child died before binding: nothing more to wait for.
            raise PeerUnavailable(f"loopback server failed to start: {line!r}")
        return int(line.split()[1])

    def _buffer(self, n: int) -> bytearray:
        for i, buf in enumerate(self._free):
            if len(buf) >= n:
                return self._free.pop(i)
        return bytearray(n)

    def _conn(self) -> _LoopbackClientProtocol:
        proto = self._proto
        if proto is None or proto.transport is None:
            raise RuntimeError("LoopbackLimit is closed")
        if proto.lost is not None:
            raise proto.lost
        return proto

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        proto = self._conn()
        assert proto.transport is not None
        total = sum(len(v) for _, v in items)
        ack = proto.expect(memoryview(bytearray(ACK.size)))
        proto.transport.writelines([HEADER.pack(OP_PUT, total), *(v for _, v in items)])
        self.bytes_sent += total
        await proto.drained()
        await ack
        for k, v in items:
            self._sizes[k] = len(v)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        proto = self._conn()
        assert proto.transport is not None
        sizes = [self._sizes.get(k) for k in keys]
        total = sum(s for s in sizes if s is not None)
        buf = self._buffer(total)
        try:
            if total:
                done = proto.expect(memoryview(buf)[:total])
                proto.transport.write(HEADER.pack(OP_GET, total))
                received = await done  # not `+= await`: that reads the counter before awaiting
                self.bytes_received += received
            out: list[bytes | None] = []
            if self.copy_out:
                view = memoryview(buf)
                pos = 0
                for s in sizes:
                    if s is None:
                        out.append(None)
                    else:
                        out.append(bytes(view[pos : pos + s]))
                        pos += s
                view.release()
            else:
                for s in sizes:
                    out.append(None if s is None else self._zero(s))
            return out
        finally:
            self._free.append(buf)

    def _zero(self, n: int) -> bytes:
        z = self._zeros.get(n)
        if z is None:
            z = self._zeros[n] = bytes(n)
        return z

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()
        server, self._server = self._server, None
        if server is not None:
            await server.close()
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
                with contextlib.suppress(ConnectionError):
                    await proc.stdin.wait_closed()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.read()


# ---------------------------------------------------------------------------
# fio on a file


def run_fio_file(
    bs: int | str,
    size: int | str,
    rw: str,
    runtime_s: float,
    directory: str | os.PathLike[str],
    *,
    name: str | None = None,
    iodepth: int = 1,
    ioengine: str = "psync",
    direct: bool = False,
    ramp_time_s: float = 0.0,
    time_based: bool = True,
    fio: str = "fio",
    extra_args: Sequence[str] = (),
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run the real fio on a file in ``directory``; return its parsed JSON.

    Blocking (call it through ``asyncio.to_thread`` from a loop). The file is
    laid out by fio and removed afterwards (``--unlink=1``). Without
    ``direct=True`` reads come from the page cache, as the other peers' do.
    """
    exe = shutil.which(fio)
    if exe is None:
        raise PeerUnavailable(f"{fio} not installed")
    job = name or f"fio-{rw}-{bs}"
    args = [
        exe,
        f"--name={job}",
        f"--directory={os.fspath(directory)}",
        f"--ioengine={ioengine}",
        f"--bs={bs}",
        f"--size={size}",
        f"--rw={rw}",
        f"--iodepth={iodepth}",
        f"--direct={int(direct)}",
        f"--runtime={max(1, round(runtime_s * 1000))}ms",
        "--unlink=1",
        "--output-format=json",
    ]
    if time_based:
        args.append("--time_based")
    if ramp_time_s > 0:
        args.append(f"--ramp_time={round(ramp_time_s * 1000)}ms")
    args.extend(extra_args)
    limit = timeout_s if timeout_s is not None else runtime_s + ramp_time_s + 120.0
    try:
        # cwd: fio drops ``local-<job>-<n>-verify.state`` files in its working dir
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=limit, check=False, cwd=directory
        )
    except subprocess.TimeoutExpired as e:
        raise PeerUnavailable(f"fio did not finish within {limit:g}s") from e
    start = proc.stdout.find("{")
    if proc.returncode != 0 or start < 0:
        msg = (proc.stderr or proc.stdout).strip()[-500:]
        raise PeerUnavailable(f"fio failed (exit {proc.returncode}): {msg}")
    result: dict[str, Any] = json.loads(proc.stdout[start:])
    return result
