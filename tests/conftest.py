"""Shared fixtures: an in-process cluster on 127.0.0.1 port 0, and real processes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvfs._loop import new_event_loop
from kvfs.client import AsyncClient
from kvfs.config import MetaConfig
from kvfs.launcher import LocalCluster, ProcessCluster

T = TypeVar("T")


class FakeClock:
    """An injectable clock: tests advance it instead of sleeping."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Every async test runs on uvloop, as the services do."""
    return {"uvloop": new_event_loop}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


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
async def kv(cluster: LocalCluster, clock: FakeClock) -> AsyncIterator[AsyncClient]:
    client = cluster.client()
    client.clock = clock
    await client.open()
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def proc_cluster(tmp_path: Path) -> AsyncIterator[ProcessCluster]:
    c = ProcessCluster(tmp_path / "pcluster", 3, listen="127.0.0.1:0")
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


class ThreadCluster:
    """A LocalCluster on its own event-loop thread, for synchronous callers (fsspec, FUSE)."""

    def __init__(self, root: Path, chunkservers: int = 3) -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cluster", daemon=True)
        self.thread.start()
        self.cluster = LocalCluster(root, chunkservers)
        self.addr = self.call(self.cluster.start())
        self.token = self.cluster.token

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop_services(self) -> None:
        self.call(self.cluster.stop())

    def start_services(self) -> None:
        """Meta on its old port, the chunkservers on new ones (they re-register)."""
        self.call(self.cluster.start_meta())
        for i in range(self.cluster.n):
            self.call(self.cluster.start_chunkserver(i))

    def close(self) -> None:
        try:
            self.call(self.cluster.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()



@pytest.fixture(scope="module")
def tcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadCluster]:
    """One threaded cluster per test module (the fsspec suite and the FUSE tests)."""
    c = ThreadCluster(tmp_path_factory.mktemp("tcluster"))
    try:
        yield c
    finally:
        c.close()


__all__ = ["FakeClock", "ThreadCluster", "new_event_loop"]
