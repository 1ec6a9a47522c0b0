"""Waiting for a cluster's state in tests: poll with a deadline, never a bare sleep.

Shared by the tests that start a second meta or restart one and must wait until it sees
the chunkservers alive again (tests/test_meta_shared.py, test_if_absent.py, test_key_meta.py),
by the fork tests waiting for their child (test_sync.py, test_leases.py), by the tests
waiting for meta to declare a stopped chunkserver dead (test_repair.py, test_meta_noscan.py),
and, for any other condition, :func:`until`."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

from kvfs.client import AsyncClient
from kvfs.launcher import LocalCluster


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Return once ``cond()`` holds, polled with a deadline; fail naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what} ({timeout_s:g} s)"
        await asyncio.sleep(0.01)


async def until_alive(kv: AsyncClient, n: int, who: str = "meta", timeout_s: float = 30.0) -> None:
    """Return once ``kv``'s meta lists at least ``n`` chunkservers alive; fail naming ``who``
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (alive := sum(s.alive for s in await kv.servers(refresh=True))) < n:
        assert time.monotonic() < deadline, f"{who} saw {alive} of {n} chunkservers alive after {timeout_s:g} s"
        await asyncio.sleep(0.05)


def wait_child(pid: int, timeout_s: float = 60.0) -> int:
    """Wait for a forked child (polled, with a deadline); returns its exit code."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        assert time.monotonic() < deadline, f"forked child {pid} did not finish in {timeout_s:g} s"
        threading.Event().wait(0.05)


async def until_dead(cluster: LocalCluster, sid: int, timeout_s: float = 30.0) -> None:
    """Return once the cluster's meta counts chunkserver ``sid`` dead (its replicas lost)."""
    assert cluster.meta is not None
    ix = cluster.meta.index
    deadline = time.monotonic() + timeout_s
    while not ix.dead(ix.servers[sid]):
        assert time.monotonic() < deadline, f"server {sid} never declared dead"
        await asyncio.sleep(0.05)
