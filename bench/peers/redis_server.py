"""Redis as a peer: a private ``redis-server`` subprocess; MSET / MGET per batch, pipelined EXISTS."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import tempfile
import time
from typing import Any, Final, Literal

from ..store import PeerUnavailable, leading_present
from ._process import wait_or_kill

__all__ = ["RedisStore"]


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
    in one pipeline. ``exists_many`` (pipelined EXISTS) uses up to
    ``max_lookup_connections`` raw connections of its own.
    """

    def __init__(
        self,
        *,
        transport: Literal["tcp", "unix"] = "tcp",
        redis_server: str = "redis-server",
        start_timeout_s: float = 10.0,
        port_attempts: int = 20,
        max_command_bytes: int = 64 << 20,
        max_lookup_connections: int = 16,
        seed: int | None = None,
    ) -> None:
        """Configure only; ``start()`` launches the server (or use ``RedisStore.open``)."""
        # (duplicates: pairs up by shape with MooncakeStore.__init__: each peer keeps its own options)
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
        self.socket_timeout_s = 60.0
        self._lookup_slots = asyncio.Semaphore(max_lookup_connections)
        self._lookup_free: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    @classmethod
    async def open(cls, **kwargs: Any) -> RedisStore:
        """Configure (the constructor's keywords) and start; raises ``PeerUnavailable`` if
        Redis cannot run here."""
        store = cls(**kwargs)
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
                "socket_timeout": self.socket_timeout_s,
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

    def pids(self) -> dict[str, int]:
        """The server process, for ``--cpu``."""
        return {"redis-server": self._proc.pid} if self._proc is not None else {}

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

    async def exists_many(self, keys: list[bytes]) -> list[bool]:
        """One EXISTS per key, all in one pipeline (one round trip).

        The pipeline is written as raw RESP on a connection of its own and the
        replies parsed by hiredis: redis-py's pipeline object spends about 10 us
        of Python per command, which would measure redis-py rather than Redis.
        At most ``max_lookup_connections`` such calls are in flight.
        """
        if not keys:
            return []
        import hiredis

        async with self._lookup_slots:
            conn = self._lookup_free.pop() if self._lookup_free else await self._lookup_connect()
            reader, writer = conn
            try:
                async with asyncio.timeout(self.socket_timeout_s):
                    writer.write(b"".join(b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%b\r\n" % (len(k), k)
                                          for k in keys))
                    parser = hiredis.Reader()
                    out: list[bool] = []
                    while len(out) < len(keys):  # bounded: each pass parses a reply or reads bytes
                        reply = parser.gets()
                        if reply is False:
                            data = await reader.read(1 << 16)
                            if not data:
                                raise OSError("redis closed the lookup connection")
                            parser.feed(data)
                        elif isinstance(reply, hiredis.ReplyError):
                            raise OSError(f"redis EXISTS: {reply}")
                        else:
                            out.append(bool(reply))
            except BaseException:
                writer.close()
                raise
            self._lookup_free.append(conn)
            return out

    async def _lookup_connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.transport == "tcp":
            return await asyncio.open_connection("127.0.0.1", self.port)
        return await asyncio.open_unix_connection(self.unix_socket)

    async def match_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys exist: the pipelined EXISTS of ``exists_many``."""
        return leading_present(await self.exists_many(keys))

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

        conns, self._lookup_free = self._lookup_free, []
        for _, writer in conns:
            writer.close()

        client, self._client = self._client, None
        proc, self._proc = self._proc, None
        if client is not None:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(RedisError, OSError):
                    await client.execute_command("SHUTDOWN", "NOSAVE")
            await client.aclose()
        if proc is not None:
            if proc.returncode is None:
                await wait_or_kill(proc, 5.0)
            if proc.stderr is not None:
                await proc.stderr.read()
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            tmp.cleanup()
