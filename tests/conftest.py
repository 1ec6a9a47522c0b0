"""Shared fixtures: an in-process cluster on 127.0.0.1 port 0, and real processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvfs._loop import new_event_loop
from kvfs.client import AsyncClient
from kvfs.launcher import LocalCluster, ProcessCluster


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


@pytest.fixture
async def cluster(tmp_path: Path, clock: FakeClock) -> AsyncIterator[LocalCluster]:
    c = LocalCluster(tmp_path / "cluster", 3, clock=clock)
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


__all__ = ["FakeClock", "new_event_loop"]
