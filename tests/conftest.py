"""Shared fixtures: an in-process cluster on 127.0.0.1 port 0, and real processes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import os
import selectors
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from kvfs._loop import new_event_loop
from kvfs.address import parse_addr
from kvfs.client import AsyncClient
from kvfs.config import ChunkServerConfig, ClientConfig, FsyncMode, MetaConfig, TlsConfig
from kvfs.gc import driver as gc_driver
from kvfs.gc import repair as gc_repair
from kvfs.gc import scrub as gc_scrub
from kvfs.launcher import LocalCluster, ProcessCluster, ServiceProcess
from kvfs.protocol import NEED_DATA, Frame, FrameDecoder
from kvfs.rpc import Op
from kvfs.server import RpcServer, _ServerProtocol, reply_of
from kvfs.transport import Connection

if TYPE_CHECKING:  # imported in the fixtures: redis-py is a test extra, absent in engine venvs
    from fuse_mount import Mount

    from kvfs.fs import KVFileSystem  # fsspec: imported where used
    from kvfs.meta.redis_local import LocalRedisCluster
    from kvfs.meta.redis_store import RedisMetaStore

T = TypeVar("T")


async def raw_connect(addr: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Frame]:
    """A plain socket to a kvfs server, its HELLO read (for tests that send raw bytes)."""
    host, port = parse_addr(addr)
    reader, writer = await asyncio.open_connection(host, port)
    hello = await read_frame(reader)
    assert hello.op == Op.HELLO
    return reader, writer, hello


async def chunkserver_connection(c: LocalCluster) -> tuple[Connection, _ServerProtocol, int]:
    """A connection of our own to ``c``'s first chunkserver (authenticated), the server's
    side of it (its protocol object) and the port it came from."""
    cs = c.chunkservers[0]
    assert cs is not None
    conn = await Connection.open(*parse_addr("kvfs://" + cs.addr), c.token)
    try:
        assert conn._proto.transport is not None
        here = conn._proto.transport.get_extra_info("sockname")[1]
        (proto,) = [p for p in cs.rpc.connections
                    if p.transport is not None and p.transport.get_extra_info("peername")[1] == here]
    except BaseException:
        conn.abort()
        raise
    assert isinstance(proto, _ServerProtocol)
    return conn, proto, here


async def read_frame(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> Frame:
    dec = FrameDecoder()
    async with asyncio.timeout(timeout_s):
        while True:
            ev = dec.next_event()
            if ev is not NEED_DATA:
                assert isinstance(ev, Frame)
                return ev
            data = await reader.read(65536)
            assert data, "connection closed before a frame arrived"
            dec.receive_data(data)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def first_line(proc: subprocess.Popen[bytes], what: str, timeout_s: float = 60.0,
               detail: Callable[[], str] = lambda: "") -> str:
    """The first line ``proc`` writes to its stdout pipe (as ``readline`` gives it: ``""``
    if it exits first), within ``timeout_s``: past that ``proc`` is killed and this fails
    naming ``what`` (and ``detail()``, e.g. its stderr).  Reads byte by byte, so the pipe
    holds the rest for whoever reads it next."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    line = bytearray()
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait()
                proc.stdout.close()
                raise AssertionError(f"no {what} within {timeout_s}s (pid {proc.pid}, "
                                     f"killed now) {detail()}")
            if not sel.select(left):
                continue  # the deadline passed: failed above
            byte = os.read(fd, 1)
            if not byte:  # it exited (or closed its stdout)
                break
            line += byte
    return line.decode()


class FakeClock:
    """An injectable clock: tests advance it instead of sleeping."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Hold:
    """Holds every request of one op in a server's dispatch until :meth:`release`.

    Fault injection for ordering: ``arrived`` is set when the first request
    reaches the server, which then applies nothing of it until released.  With ``when``,
    only the requests it accepts are held (the others are answered as usual)."""

    def __init__(self, server: RpcServer, op: Op, when: Callable[[Any], bool] | None = None) -> None:
        self.op = op
        self.arrived = asyncio.Event()
        self._open = asyncio.Event()
        self._error: BaseException | None = None
        self._inside = 0  # requests in the handler now
        self._empty = asyncio.Event()
        inner: Callable[..., Awaitable[Any]]
        inner, request_type = server.handlers[int(op)]  # (handler, request type)

        async def held(*args: Any) -> Any:
            if when is not None and not when(args[0]):
                return await reply_of(inner(*args))
            self.arrived.set()
            self._inside += 1
            self._empty.clear()
            try:
                await self._open.wait()
                if self._error is not None:
                    raise self._error
                return await reply_of(inner(*args))
            finally:
                self._inside -= 1
                if not self._inside:
                    self._empty.set()

        server.handlers[int(op)] = (held, request_type)

    async def reached(self, *senders: asyncio.Future[Any]) -> None:
        """Wait for the op to arrive (30 s at most, never a sleep). If one of ``senders`` (the
        tasks meant to send it) ends first, fail at once with what it returned or raised."""
        arrived = asyncio.ensure_future(self.arrived.wait())
        try:
            async with asyncio.timeout(30):
                await asyncio.wait([arrived, *senders], return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrived.cancel()
        if not self.arrived.is_set():
            ended = next(t for t in senders if t.done())
            raise AssertionError(f"{self.op.name} never arrived: its sender ended with {ended.result()!r}")

    def reached_from_thread(self, sending: Callable[[], bool] = lambda: True, what: str = "") -> None:
        """:meth:`reached` for a test thread outside the server's loop: poll ``arrived`` with a
        30 s deadline; fail at once, naming ``what``, if ``sending()`` (is the sender still at
        it?) turns false first."""
        deadline = time.monotonic() + 30
        while not self.arrived.is_set():
            assert time.monotonic() < deadline and sending(), f"{what or self.op.name} never reached the server"
            threading.Event().wait(0.001)

    def release(self, error: BaseException | None = None) -> None:
        """Let the held requests run; with ``error``, each fails with it instead."""
        self._error = error
        self._open.set()

    async def drained(self) -> None:
        """Wait until every request that arrived has been answered (call after release)."""
        async with asyncio.timeout(30):
            await self._empty.wait()


async def kvfs_admin(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    """``python -m kvfs ARGS --addr CLUSTER`` with the admin token: exit status and stdout
    (its stderr goes to the test's, which pytest shows when a test fails)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvfs", *args, "--addr", cluster.addr,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "KVFS_ADMIN_TOKEN": cluster.admin_token, "KVFS_TOKEN": cluster.token})
    out, err = await proc.communicate()
    sys.stderr.write(err.decode())
    return await proc.wait(), out.decode()


def clocked_client(c: LocalCluster, clock: FakeClock) -> AsyncClient:
    """A client of ``c`` on the test's fake clock (TTLs and leases follow ``clock``)."""
    kv = c.client()
    kv.clock = clock
    return kv


def readv_calls(cluster: LocalCluster) -> int:
    """READV requests ``cluster``'s chunkservers have answered so far."""
    return sum(cs.readv_calls for cs in cluster.chunkservers if cs is not None)


def value_of(key: str, size: int = 4096) -> bytes:
    """``size`` bytes that only ``key`` gives: a wrong or stale read shows as other bytes."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def flip_byte(path: Path, at: int) -> None:
    """Fault injection: byte ``at`` of the file at ``path`` inverted (a corrupt record)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


async def reports_checked(cluster: LocalCluster, deadline_s: float = 30.0) -> None:
    """Until ``cluster``'s meta has checked (and mended) every replica readers reported bad
    to it (read repair: REPORT_BAD): its checking task awaited, with a deadline."""
    assert cluster.meta is not None
    gc = cluster.meta.gc
    async with asyncio.timeout(deadline_s):  # (a report may start a new task as one ends)
        while gc._checking is not None and not gc._checking.done():
            await asyncio.wait([gc._checking])
    assert not gc._suspects, "reported replicas are held with no task checking them"


def hold(cluster: LocalCluster, op: Op) -> Hold:
    """Hold ``op`` in the cluster's meta (the test then picks what meta applies first)."""
    assert cluster.meta is not None
    return Hold(cluster.meta.rpc, op)


# tests driven by an inference engine's own package run only in that engine's venv
# (.ci/engines.sh, .ci/run): elsewhere they are not even collected
_ENGINE_TESTS = {"sglang": "sglang", "lmcache": "lmcache", "vllm": "vllm", "demo": "transformers"}
collect_ignore_glob = [f"engines/test_{name}.py" for name, module in _ENGINE_TESTS.items()
                       if importlib.util.find_spec(module) is None]
if all(importlib.util.find_spec(m) is None for m in ("sglang", "lmcache")):  # one half each
    collect_ignore_glob.append("engines/test_mount_backends.py")


def guarded_loop() -> asyncio.AbstractEventLoop:
    """uvloop (as the services run), whose ``close()`` fails on child processes still running.

    uvloop's ``close()`` waits for every child started on the loop (``create_subprocess_exec``)
    to exit, and a kvfs service exits only with its parent: a test that left a
    :class:`ServiceProcess` running stalled its own teardown forever, in C, where
    pytest-timeout's signal never reaches Python (test_meta_shared's two-metas GC test, after
    a merge dropped its ``stop()`` calls).  Here every child's transport is closed first (a
    running child gets SIGKILL), and the close raises naming those that were still running:
    an error in that test's teardown, not a hang."""
    import uvloop

    class Loop(uvloop.Loop):
        def __init__(self) -> None:
            super().__init__()
            self.children: list[asyncio.SubprocessTransport] = []

        async def subprocess_exec(self, *args: Any, **kwargs: Any) -> Any:
            transport, protocol = await super().subprocess_exec(*args, **kwargs)
            self.children.append(transport)
            return transport, protocol

        async def _reaped(self, timeout_s: float = 30.0) -> None:
            """Until the loop has seen every child exit, and run their pipes' close callbacks."""
            async with asyncio.timeout(timeout_s):
                while any(t.get_returncode() is None for t in self.children):
                    await asyncio.sleep(0.01)
                for _ in range(3):
                    await asyncio.sleep(0)

        def close(self) -> None:
            left = [f"pid {pid} ({_cmdline(pid)})" for pid in
                    (t.get_pid() for t in self.children) if _running(pid)]
            if not self.is_closed() and not self.is_running():
                for t in self.children:
                    t.close()  # SIGKILL if the loop has not seen it exit; its pipes closed
                self.run_until_complete(self._reaped())
            self.children.clear()
            super().close()
            if left:
                raise RuntimeError("the test left child processes running (killed now; stop "
                                   "every ServiceProcess / ProcessCluster it starts): "
                                   + "; ".join(left))

    return Loop()


def _running(pid: int) -> bool:
    """``pid`` exists and has not exited (a zombie exited: the loop reaps it on close)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Write kvfs's bytecode once, before any test starts a server process.

    Where ``PYTHONDONTWRITEBYTECODE`` is set (this machine, and containers often) no process
    writes ``.pyc`` files, so every ``python -m kvfs ...`` a test starts compiled kvfs from
    source: ``kvfs up`` took 4.1 s to answer instead of 1.2 s (bench/RESULTS.md, start-up).
    Files already compiled are skipped by their mtime."""
    import compileall

    for name in ("kvfs", "kvfs.chunkserver", "kvfs.meta", "kvfs.gc", "kvfs.bench"):
        spec = importlib.util.find_spec(name)
        for where in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(where, quiet=2)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Every async test runs on uvloop, as the services do (:func:`guarded_loop`)."""
    return {"uvloop": guarded_loop}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(autouse=True)
def _gc_warnings_fresh() -> None:
    """The GC's per-server warnings are held back per process (kvfs.gc.logs): each test sees
    its own first ones, as a fresh process would."""
    for module in (gc_driver, gc_repair, gc_scrub):
        module.warn.forget()


# A test that blocks the event loop (importing torch, building a 1 GiB array: 10 s each on a
# loaded 2-core machine) also stops the chunkservers' heartbeats; a timeout as long as pytest's
# keeps them alive through it.
TEST_HEARTBEAT_TIMEOUT_S = 120.0


@pytest.fixture
async def cluster(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    root = tmp_path / "cluster"
    c = LocalCluster(root, 3, clock=clock, meta=MetaConfig(
        data=root / "meta", listen="127.0.0.1:0", heartbeat_timeout_s=TEST_HEARTBEAT_TIMEOUT_S))
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


@pytest.fixture
def client_config() -> ClientConfig | None:
    """``kv``'s client config (None: the cluster's default); a test module overrides it."""
    return None


@pytest.fixture
async def kv(cluster: LocalCluster, clock: FakeClock, client_config: ClientConfig | None,
             ) -> AsyncIterator[AsyncClient]:
    client = cluster.client(client_config)
    client.clock = clock
    await client.open()
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def running_proc_cluster(root: Path) -> AsyncIterator[ProcessCluster]:
    """Meta and 3 chunkservers as child processes on 127.0.0.1 port 0, stopped on exit."""
    c = ProcessCluster(root, 3, listen="127.0.0.1:0")
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


@pytest.fixture
async def proc_cluster(tmp_path: Path) -> AsyncIterator[ProcessCluster]:
    async with running_proc_cluster(tmp_path / "pcluster") as c:
        yield c


class LoopThread:
    """An event loop on a thread of its own, for synchronous callers of async code."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def module_proc_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    """``proc_cluster``, one per test module, for synchronous tests (its children started,
    watched and stopped on a :class:`LoopThread`).  A test's own code that holds the GIL for
    seconds (an engine's numpy writes to a FUSE mount of the cluster) stalls the servers of a
    :class:`ThreadCluster`, which share its process; it cannot stall these."""
    lt = LoopThread("proc-cluster")
    try:
        running = running_proc_cluster(tmp_path_factory.mktemp("pcluster"))
        c = lt.call(running.__aenter__(), timeout_s=180)  # 4 interpreters start (60 s each at most)
        try:
            yield c
        finally:
            lt.call(running.__aexit__(None, None, None))
    finally:
        lt.close()


class ThreadCluster(LoopThread):
    """A LocalCluster on its own event-loop thread, for synchronous callers (fsspec, FUSE)."""

    def __init__(self, root: Path, chunkservers: int = 3, tls: TlsConfig | None = None) -> None:
        super().__init__("cluster")
        # the fsspec/FUSE suites test behaviour with thousands of single-file puts; syncing
        # each one (the default, tested in test_durability.py) only makes them slow
        self.cluster = LocalCluster(root, chunkservers,
                                    meta=MetaConfig(data=root / "meta", listen="127.0.0.1:0",
                                                    fsync=FsyncMode.NEVER),
                                    chunkserver=ChunkServerConfig(data=root, heartbeat_interval_s=0.2,
                                                                  fsync=FsyncMode.NEVER),
                                    tls=tls)
        self.addr = self.call(self.cluster.start())
        self.token = self.cluster.token

    def stop_services(self) -> None:
        self.call(self.cluster.stop())

    def start_services(self) -> None:
        """Meta on its old port, the chunkservers on new ones (they re-register)."""
        self.call(self.cluster.start_meta())
        for i in range(self.cluster.n):
            self.call(self.cluster.start_chunkserver(i))

    @contextlib.contextmanager
    def fsspec(self) -> Iterator[KVFileSystem]:
        """This cluster through fsspec (an instance of its own: fsspec's cache skipped)."""
        from kvfs.fs import KVFileSystem

        fs = KVFileSystem(self.addr, token=self.token, skip_instance_cache=True)
        try:
            yield fs
        finally:
            fs.close()

    def close(self) -> None:
        try:
            self.call(self.cluster.stop())
        finally:
            super().close()

    def __enter__(self) -> ThreadCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hold(self, server: RpcServer, op: Op = Op.READV) -> Hold:
        """A :class:`Hold` of ``op`` in one of this cluster's servers (made on its loop)."""
        async def make() -> Hold:
            return Hold(server, op)

        return self.call(make())


@pytest.fixture
def one_cs(tmp_path: Path) -> Iterator[ThreadCluster]:
    """A threaded cluster of one chunkserver: every READV goes to it."""
    with ThreadCluster(tmp_path, chunkservers=1) as c:
        yield c



@pytest.fixture(scope="module")
def tcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadCluster]:
    """One threaded cluster per test module (the fsspec suite and the FUSE tests)."""
    c = ThreadCluster(tmp_path_factory.mktemp("tcluster"))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def mount(tcluster: ThreadCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """A real ``kvfs mount`` of the module's ``tcluster`` (FUSE, root; skipped elsewhere)."""
    from fuse_mount import Mount, _skip_reason

    if _skip_reason():
        pytest.skip(_skip_reason() or "")
    root = tmp_path_factory.mktemp("fuse")
    m = Mount(root / "mnt", tcluster, root / "logs")
    try:
        yield m
    finally:
        m.cleanup()


__all__ = ["FakeClock", "Hold", "LoopThread", "ThreadCluster", "flip_byte", "guarded_loop", "hold", "new_event_loop",
           "value_of"]


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A real 3-master Redis Cluster from ``redis-server`` on 127.0.0.1 (marker ``redis``),
    shared by the session: each test works in its own namespace of it."""
    import shutil

    from kvfs.meta.redis_local import LocalRedisCluster

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with LocalRedisCluster(tmp_path_factory.mktemp("redis")) as rc:
        yield rc


def meta_on(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every :class:`LocalCluster` or :class:`ProcessCluster` the test starts (and restarts)
    runs its meta with ``--store kind`` (``rocksdb``, ``sqlite``), unless the test gave it a
    store."""
    from dataclasses import replace

    start_local = LocalCluster.start_meta

    async def on_kind(self: LocalCluster) -> str:
        if self.meta_config.store is None:
            self.meta_config = replace(self.meta_config, store=kind)
        return await start_local(self)

    meta_proc = ProcessCluster._meta_process

    def process_on_kind(self: ProcessCluster, listen: str) -> ServiceProcess:
        if "--store" not in self.meta_args:
            self.meta_args = (*self.meta_args, "--store", kind)
        return meta_proc(self, listen)

    monkeypatch.setattr(LocalCluster, "start_meta", on_kind)
    monkeypatch.setattr(ProcessCluster, "_meta_process", process_on_kind)


@pytest.fixture(params=["rocksdb", pytest.param("sqlite", marks=pytest.mark.meta_sqlite)])
def local_meta(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test over each store meta keeps its own index over (:mod:`kvfs.meta.localstore`):
    SQLite and RocksDB, for what the Redis store does not keep (tombstones, older records,
    dropped records, rebuilds).  The SQLite half is marker ``meta_sqlite``."""
    meta_on(request.param, monkeypatch)
    return str(request.param)


@pytest.fixture(params=["rocksdb", pytest.param("sqlite", marks=pytest.mark.meta_sqlite),
                        pytest.param("redis", marks=[pytest.mark.redis, pytest.mark.meta_redis])])
def meta_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test over each meta backend: SQLite (``--store sqlite``) and RocksDB (``--store
    rocksdb``, the default), for every :class:`LocalCluster` or :class:`ProcessCluster` the
    test starts; and Redis
    Cluster, where each puts its meta on the session's Redis Cluster, in a namespace of its
    own (kept across that cluster's meta restarts).  A module opts in with
    ``pytestmark = pytest.mark.usefixtures("meta_backend")``; the SQLite and Redis halves
    are markers ``meta_sqlite`` and ``meta_redis`` (not in the default run: .ci/run runs them)."""
    if request.param in ("sqlite", "rocksdb"):
        meta_on(request.param, monkeypatch)
        return str(request.param)
    from dataclasses import replace

    rc: LocalRedisCluster = request.getfixturevalue("redis_cluster")
    start_meta = LocalCluster.start_meta

    async def on_redis(self: LocalCluster) -> str:
        if self.meta_config.store is None:
            self.meta_config = replace(self.meta_config, store=rc.url,
                                       store_namespace="c" + uuid.uuid4().hex[:12])
        return await start_meta(self)

    meta_process = ProcessCluster._meta_process

    def process_on_redis(self: ProcessCluster, listen: str) -> ServiceProcess:
        if "--store" not in self.meta_args:
            self.meta_args = (*self.meta_args, "--store", rc.url,
                              "--store-namespace", "p" + uuid.uuid4().hex[:12])
        return meta_process(self, listen)

    monkeypatch.setattr(LocalCluster, "start_meta", on_redis)
    monkeypatch.setattr(ProcessCluster, "_meta_process", process_on_redis)
    return "redis"


@pytest.fixture
async def redis_store(redis_cluster: LocalRedisCluster, request: pytest.FixtureRequest,
                      ) -> AsyncIterator[RedisMetaStore]:
    """A :class:`RedisMetaStore` in a namespace of its own on the session's cluster."""
    from kvfs.meta.redis_store import RedisMetaStore

    ns = "t" + uuid.uuid4().hex[:12]
    buckets = getattr(request, "param", 16)
    store = RedisMetaStore(redis_cluster.url, namespace=ns, buckets=buckets)
    await store.open()
    try:
        yield store
    finally:
        await store.close()
