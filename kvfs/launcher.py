"""Starting whole clusters: in-process (tests, notebooks) or as child processes (`kvfs up`).

This is the only module that knows every service.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvfs._parent import ENV as PARENT_ENV
from kvfs.address import TOKEN_ENV, parse_addr, service_tokens, user_token_path, write_secret
from kvfs.chunkserver import ChunkServer
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, ClientConfig, GcConfig, MetaConfig, TlsConfig, tls_fields
from kvfs.datadir import DirLock, private_dir
from kvfs.errors import Unavailable
from kvfs.handshake import Role
from kvfs.meta import MetaService
from kvfs.tls import TLS_ENV

READY_TIMEOUT_S = 60.0


class LocalCluster:
    """Meta and N chunkservers in this event loop, on 127.0.0.1 port 0."""

    def __init__(self, root: Path, chunkservers: int = 3, *, clock: Callable[[], float] = time.time,
                 meta: MetaConfig | None = None, chunkserver: ChunkServerConfig | None = None,
                 gc: GcConfig | None = None, tls: TlsConfig | None = None) -> None:
        """``tls``: the TLS files of every service, the GC and :meth:`client` (over the
        ``meta``/``chunkserver``/``gc`` configs' own)."""
        self.root = root
        self.n = chunkservers
        self.clock = clock
        self.tokens = service_tokens(root, create=True)
        self.token = self.tokens[Role.CLIENT]
        self.admin_token = self.tokens[Role.ADMIN]
        self.meta_config = meta or MetaConfig(data=root / "meta", listen="127.0.0.1:0")
        self.cs_template = chunkserver or ChunkServerConfig(data=root, heartbeat_interval_s=0.2)
        self.tls = tls
        if tls is not None:
            files = tls_fields(tls)
            self.meta_config = replace(self.meta_config, **files)
            self.cs_template = replace(self.cs_template, **files)
            gc = None if gc is None else replace(gc, **files)
        self.meta: MetaService | None = None
        self.chunkservers: list[ChunkServer | None] = []
        self.addr = ""
        self.gc_config = gc
        self._gc_task: asyncio.Task[None] | None = None
        self._gc_stop = asyncio.Event()

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def cs_config(self, i: int, listen: str = "127.0.0.1:0") -> ChunkServerConfig:
        return replace(self.cs_template, data=self.root / f"cs{i}", meta=self.addr,
                       listen=listen)

    async def start(self) -> str:
        try:
            await self.start_meta()
            for i in range(self.n):
                cs = ChunkServer(self.cs_config(i), tokens=self.tokens)
                await cs.start()  # a start that fails closes what it opened
                self.chunkservers.append(cs)
        except BaseException:
            await self.stop()  # nothing half-started is left running
            raise
        if self.gc_config is not None:
            self.start_gc(self.gc_config)
        return self.addr

    def start_gc(self, config: GcConfig) -> None:
        """Run the GC daemon loop as a task of this event loop (optional in-process GC)."""
        from kvfs.gc import PassOptions, run_daemon

        opts = PassOptions.from_config(config)
        self._gc_stop = asyncio.Event()
        self._gc_task = asyncio.get_running_loop().create_task(
            run_daemon(self.addr, self.admin_token, opts, config.interval_s, self._gc_stop,
                       tls=config))

    async def stop_gc(self) -> None:
        if self._gc_task is not None:
            self._gc_stop.set()
            task, self._gc_task = self._gc_task, None
            await task

    async def start_meta(self) -> str:
        self.meta = MetaService(self.meta_config, clock=self.clock, tokens=self.tokens)
        self.addr = await self.meta.start()
        _, port = parse_addr(self.addr)
        self.meta_config = replace(self.meta_config, listen=f"127.0.0.1:{port}")
        return self.addr

    async def stop_meta(self) -> None:
        if self.meta is not None:
            await self.meta.close()
            self.meta = None

    def index_of(self, server_id: int) -> int:
        """The slot (for stop/start_chunkserver) of the running chunkserver meta knows as ``server_id``."""
        return next(i for i, cs in enumerate(self.chunkservers)
                    if cs is not None and cs.server_id == server_id)

    async def stop_chunkserver(self, i: int) -> str:
        cs = self.chunkservers[i]
        assert cs is not None
        addr = cs.addr
        await cs.close()
        self.chunkservers[i] = None
        return addr

    async def start_chunkserver(self, i: int, listen: str = "127.0.0.1:0") -> ChunkServer:
        cs = ChunkServer(self.cs_config(i, listen), tokens=self.tokens)
        await cs.start()
        self.chunkservers[i] = cs
        return cs

    async def stop(self) -> None:
        await self.stop_gc()
        for i, cs in enumerate(self.chunkservers):
            if cs is not None:
                await cs.close()
                self.chunkservers[i] = None
        await self.stop_meta()

    def client(self, config: ClientConfig | None = None) -> AsyncClient:
        if config is None and self.tls is not None:
            config = ClientConfig(**tls_fields(self.tls))
        return AsyncClient(self.addr, token=self.token, config=config)


def describe_exit(returncode: int) -> str:
    """``-9`` -> ``killed by SIGKILL``, ``2`` -> ``exited with status 2``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with status {returncode}"


class ServiceProcess:
    """One service as a child process (`kvfs meta ...` / `kvfs chunkserver ...`).

    The child gets ``$KVFS_PARENT_PID`` and so dies with this process (:mod:`kvfs._parent`).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.ready_line = ""
        self.started_at = 0.0

    async def start(self) -> str:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE,
            env={**self.env, PARENT_ENV: str(os.getpid())}, start_new_session=True)
        self.started_at = time.monotonic()
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                while True:
                    line = (await self.proc.stdout.readline()).decode()
                    if not line:
                        code = await self.proc.wait()
                        raise Unavailable(f"{self.name} {describe_exit(code)} while starting "
                                          f"(command: {' '.join(self.argv)})")
                    if " ready " in line:
                        self.ready_line = line.strip()
                        return self.ready_line
        except TimeoutError:
            self.kill()
            await self.proc.wait()
            raise Unavailable(f"{self.name} did not report ready within {READY_TIMEOUT_S}s") from None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.kill(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s):
                    await self.proc.wait()
            except TimeoutError:
                self.kill(signal.SIGKILL)
                await self.proc.wait()
        return self.proc.returncode


class ProcessCluster:
    """Meta and N chunkservers as child processes; what `kvfs up` runs.

    ``redis_args`` (not None): meta keeps its index in a local Redis Cluster, one more
    child (``python -m kvfs.meta.redis_local DATA/redis --persistent ...``, which runs the
    ``redis-server`` nodes, restarts one that exits, and takes them down with it); meta
    gets its address as ``--store``.
    The data directory is locked (``DATA/up.pid``, a :class:`DirLock`) from :meth:`start` to :meth:`stop`.
    :meth:`supervise` reports a child that exits and restarts it with backoff.
    """

    def __init__(self, data: Path, chunkservers: int = 3, *, listen: str = "127.0.0.1:7070",
                 meta_args: tuple[str, ...] = (), chunkserver_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, gc: bool = False,
                 gc_args: tuple[str, ...] = (), redis_args: tuple[str, ...] | None = None) -> None:
        self.data = data.resolve()
        self.n = chunkservers
        self.listen = listen
        self.meta_args = meta_args
        self.cs_args = chunkserver_args
        self.env_base = env
        self.token = self.admin_token = ""
        self.tokens: dict[Role, str] = {}
        self.env: dict[str, str] = {}
        self.meta: ServiceProcess | None = None
        self.chunkservers: list[ServiceProcess] = []
        self.addr = ""
        self.gc_enabled = gc
        self.gc_args = gc_args
        self.gc: ServiceProcess | None = None
        self.redis_args = redis_args
        self.redis: ServiceProcess | None = None
        self.store_url: str | None = None  # redis-cluster://... of the local Redis Cluster
        self.lock = DirLock(self.data, "kvfs up", name="up.pid", hint="stop that one first")
        self._stopping = False

    def _kvfs(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "kvfs", *args]

    async def start(self) -> str:
        private_dir(self.data)
        self.lock.acquire()
        self._stopping = False
        try:
            self.tokens = service_tokens(self.data, create=True)
            self.token, self.admin_token = self.tokens[Role.CLIENT], self.tokens[Role.ADMIN]
            # tokens travel to the children in the environment, never on a command line
            # TLS files go as flags (kvfs up's own), never from a client's $KVFS_TLS_*
            self.env = {**{k: v for k, v in (self.env_base or os.environ).items()
                           if k not in TLS_ENV.values()},
                        **{TOKEN_ENV[r]: t for r, t in self.tokens.items()}}
            if self.redis_args is not None:
                await self.start_redis()
            await self.start_meta(self.listen)
            for i in range(self.n):
                self.chunkservers.append(self._cs_process(i))
            await asyncio.gather(*(cs.start() for cs in self.chunkservers))
            if self.gc_enabled:
                await self.start_gc()
        except BaseException:
            await self.stop()
            raise
        return self.addr

    async def start_meta(self, listen: str) -> str:
        self.meta = self._meta_process(listen)
        line = await self.meta.start()
        self.addr = line.split()[-1]
        return self.addr

    async def start_redis(self) -> str:
        """The local Redis Cluster (its ports are kept in DATA/redis: a restart finds it again)."""
        self.redis = self._redis_process()
        line = await self.redis.start()
        self.store_url = line.split()[-1]
        return self.store_url

    def _redis_process(self) -> ServiceProcess:
        return ServiceProcess("redis", [sys.executable, "-m", "kvfs.meta.redis_local",
                                        str(self.data / "redis"), "--persistent",
                                        *(self.redis_args or ())], self.env)

    def _meta_process(self, listen: str) -> ServiceProcess:
        store = () if self.store_url is None else ("--store", self.store_url)
        return ServiceProcess("meta", self._kvfs(
            "meta", "--data", str(self.data / "meta"), "--listen", listen, *store, *self.meta_args),
            self.env)

    def _cs_process(self, i: int) -> ServiceProcess:
        return ServiceProcess(f"chunkserver {i}", self._kvfs(
            "chunkserver", "--data", str(self.data / f"cs{i}"), "--meta", self.addr,
            "--listen", "127.0.0.1:0", *self.cs_args), self.env)

    def _gc_process(self) -> ServiceProcess:
        return ServiceProcess("gc", self._kvfs("gc", "daemon", "--meta", self.addr, *self.gc_args),
                              self.env)

    async def start_gc(self) -> None:
        """The GC daemon (`kvfs gc daemon`) as one more child process."""
        self.gc = self._gc_process()
        await self.gc.start()

    async def restart_chunkserver(self, i: int) -> None:
        await self.chunkservers[i].stop()
        self.chunkservers[i] = self._cs_process(i)
        await self.chunkservers[i].start()

    async def restart_meta(self) -> None:
        assert self.meta is not None
        await self.meta.stop()
        await self.start_meta(self._meta_listen())

    def _meta_listen(self) -> str:
        """Meta restarts on the port it had, so clients and chunkservers find it again."""
        host, _ = parse_addr(self.listen, what="listen address")
        _, port = parse_addr(self.addr)
        return f"{host}:{port}"

    def services(self) -> list[ServiceProcess]:
        return [p for p in (self.meta, *self.chunkservers, self.gc, self.redis) if p is not None]

    async def supervise(self, report: Callable[[str], None], *, restart: bool = True,
                        backoff_s: float = 0.5, backoff_max_s: float = 30.0,
                        stable_s: float = 10.0) -> None:
        """Watch every child until :meth:`stop`: report one that exits (name, pid, status or
        signal) at once, and, with ``restart``, start it again on the same data dir after a
        backoff that doubles while it keeps failing (reset once it stayed up ``stable_s``).
        Runs until cancelled."""
        slots = ["meta", *(f"cs{i}" for i in range(len(self.chunkservers)))]
        if self.gc is not None:
            slots.append("gc")
        if self.redis is not None:
            slots.append("redis")

        async def watch(slot: str) -> None:
            failures = 0
            while True:
                svc = self._slot(slot)
                if svc is None or svc.proc is None:
                    return
                code = await svc.proc.wait()
                if self._stopping:
                    return
                quick = time.monotonic() - svc.started_at < stable_s
                failures = failures + 1 if quick else 0
                if not restart:
                    report(f"{svc.name} (pid {svc.pid}) {describe_exit(code)}; not restarted "
                           f"(--no-restart)")
                    return
                while True:
                    delay = min(backoff_max_s, backoff_s * 2 ** max(failures - 1, 0))
                    report(f"{svc.name} (pid {svc.pid}) {describe_exit(code)}; restarting in "
                           f"{delay:g}s")
                    await asyncio.sleep(delay)
                    new = self._replace(slot)
                    try:
                        line = await new.start()
                    except Unavailable as exc:
                        failures += 1
                        report(f"{svc.name}: restart failed: {exc}")
                        code = new.proc.returncode if new.proc and new.proc.returncode is not None else -9
                        svc = new
                        continue
                    report(f"{new.name} restarted (pid {new.pid}): {line}")
                    break

        await asyncio.gather(*(watch(slot) for slot in slots))

    def _slot(self, slot: str) -> ServiceProcess | None:
        if slot == "meta":
            return self.meta
        if slot == "gc":
            return self.gc
        if slot == "redis":
            return self.redis
        return self.chunkservers[int(slot.removeprefix("cs"))]

    def _replace(self, slot: str) -> ServiceProcess:
        """A fresh (not yet started) process for ``slot``, put in its place so stop() sees it."""
        if slot == "meta":
            self.meta = self._meta_process(self._meta_listen())
            return self.meta
        if slot == "gc":
            self.gc = self._gc_process()
            return self.gc
        if slot == "redis":
            self.redis = self._redis_process()
            return self.redis
        i = int(slot.removeprefix("cs"))
        self.chunkservers[i] = self._cs_process(i)
        return self.chunkservers[i]

    async def stop(self) -> None:
        self._stopping = True
        try:
            if self.gc is not None:
                await self.gc.stop()
            await asyncio.gather(*(cs.stop() for cs in self.chunkservers))
            if self.meta is not None:
                await self.meta.stop()
            if self.redis is not None:
                await self.redis.stop(timeout_s=30.0)  # it stops its nodes (each writes its file)
        finally:
            self.lock.release()

    def write_user_token(self) -> Path:
        """The client and admin tokens for this address, where clients look (mode 0600);
        returns the client token's path."""
        host, port = parse_addr(self.addr)
        for role in (Role.ADMIN, Role.CLIENT):
            path = user_token_path(host, port, role)
            write_secret(path, self.tokens[role])
        return path

    def client(self, **kw: Any) -> AsyncClient:
        return AsyncClient(self.addr, token=self.token, **kw)
