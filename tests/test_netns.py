"""Meta and 4 chunkservers, each on its own host (network namespace), under a mixed
read/write workload that checks every byte (kvfs.bench.workload: every read API, while some
keys are overwritten, some deleted, some put with a TTL, and present ones put with
if_absent; files read through fsspec's open and read and written through a ``kvfs mount``
of the cluster, here in the root namespace with the test's clients): a chunkserver SIGKILLed,
a host's link cut, meta restarted.  Each fault's
figures (values lost, wrong bytes, the longest a reader waited, the time until every
committed key had its replicas again) are printed and, when ``$KVFS_FAULT_TABLE`` names a
file, appended to it as JSON lines (RELIABILITY.md).

Marker ``netns`` (root; .ci/run runs them); skipped, with the reason, without root, ``ip``
or FUSE.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
from fuse_mount import needs_fuse
from netns import NetLab, NetnsCluster, netns_unavailable

from kvfs.address import TOKEN_ENV
from kvfs.bench.soak import MOUNT_ATTR_S, MOUNT_WRITE_EVERY, start_mount, stop_mount
from kvfs.bench.workload import (
    Figures,
    MixedWorkload,
    Values,
    under_replicated,
    verify_all,
)
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig
from kvfs.fs import KVFileSystem
from kvfs.handshake import Role
from kvfs.layout import Layout
from kvfs.sync import Client

NO_LAYOUT = Layout(0, 0, 0.0, None, ())
pytestmark = [pytest.mark.netns, pytest.mark.subprocess, pytest.mark.timeout(600), needs_fuse]

HEARTBEAT_TIMEOUT_S = 2.0  # meta: a chunkserver silent this long is not placed on or read from
DEAD_AFTER_S = 4.0  # meta: ... and this long is dead: the GC daemon's repair copies its extents
CONNECT_TIMEOUT_S = 1.0
REQUEST_TIMEOUT_S = 2.0
# a read of a value that cannot be read ends (one connect and one request timeout per
# replica tried, and a refreshed server list) within this
READ_BOUND_S = 2 * (CONNECT_TIMEOUT_S + REQUEST_TIMEOUT_S) + 2.0
VALUES = Values(max_small=32 * 1024, large_every=100)
BASELINE_KEYS = 400
FAULT_READS = 600  # values read while a fault is on, at least
FAULT_HOLD_S = 3 * HEARTBEAT_TIMEOUT_S  # and this long: meta marks the server dead meanwhile
RESTORE_DEADLINE_S = 90.0


@pytest.fixture
def lab() -> Iterator[NetLab]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with NetLab(hosts=5) as lab:
        reason = lab.blocked()
        if reason:
            pytest.skip(reason)
        yield lab


def client_config(replicas: int) -> ClientConfig:
    return ClientConfig(replicas=replicas, connect_timeout_s=CONNECT_TIMEOUT_S,
                        request_timeout_s=REQUEST_TIMEOUT_S, servers_refresh_s=0.5)


@pytest.fixture
async def cluster(lab: NetLab, tmp_path: Path) -> AsyncIterator[NetnsCluster]:
    c = NetnsCluster(lab, tmp_path / "c", 4,
                     meta_args=("--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT_S}s",
                                "--dead-after", f"{DEAD_AFTER_S}s"),
                     chunkserver_args=("--heartbeat-interval", "250ms"),
                     gc=True, gc_args=("--interval", "1s"))
    try:
        await c.start()
        yield c
    finally:
        await c.stop()


def record(row: dict[str, Any]) -> None:
    line = json.dumps(row, sort_keys=True)
    print(line)
    path = os.environ.get("KVFS_FAULT_TABLE")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


async def restore_time(admin: AsyncClient, keys: list[bytes], replicas: int,
                       since: float, gone: Collection[bytes] = ()) -> tuple[float, float]:
    """Seconds from ``since`` until every key in ``keys`` has ``replicas`` copies on servers
    meta reports alive, counted to the end of the poll that saw it (an upper bound; fails the
    test past RESTORE_DEADLINE_S), and the seconds that poll took (it asks meta for every
    key's layout): the figure's resolution.  ``gone``: keys deleted (it may grow meanwhile:
    the workload runs on), which have no copies to count."""
    while True:
        t0 = time.monotonic()
        short = await under_replicated(admin, [k for k in keys if k not in gone], replicas)
        if short == 0:
            end = time.monotonic()
            return end - since, end - t0
        assert time.monotonic() - since < RESTORE_DEADLINE_S, (
            f"replicas not restored within {RESTORE_DEADLINE_S}s")
        await asyncio.sleep(0.2)


async def run_faults(cluster: NetnsCluster, replicas: int,
                     check: Callable[[str, Figures], None]) -> tuple[MixedWorkload, list[dict[str, Any]]]:
    """Baseline, then each fault (on, FAULT_READS values read, healed, time to restore):
    returns the workload (stopped) and one row per fault."""
    lab = cluster.lab
    cfg = client_config(replicas)
    writer = cluster.client(config=cfg)
    reader = cluster.client(config=cfg)  # its own layout cache: it asks meta as a fresh reader does
    admin = cluster.client(config=cfg)
    # the blocking client's reads run in its callers' threads, on sockets of its own
    blocking = await asyncio.to_thread(Client, cluster.addr, token=cluster.token, config=cfg)
    files = KVFileSystem(cluster.addr, token=cluster.token, config=cfg, skip_instance_cache=True)
    mnt = cluster.data.parent / "mnt"  # another node's mount (its timeout: 3 s, within READ_BOUND_S)
    mounter = await start_mount(cluster.addr, {**os.environ, TOKEN_ENV[Role.CLIENT]: cluster.token},
                                mnt, replicas)
    rows: list[dict[str, Any]] = []
    load = MixedWorkload(writer, reader, prefix=f"r{replicas}", values=VALUES, write_pause_s=0.05,
                         max_keys=20_000, blocking=blocking, overwrite_every=4,
                         delete_every=7, ttl_every=5, if_absent_every=6, mount=mnt,
                         mount_stale_s=MOUNT_ATTR_S, mount_write_every=MOUNT_WRITE_EVERY, files=files)

    async def fault(name: str, on: Callable[[], Awaitable[None]],
                    off: Callable[[], Awaitable[None]], *, heals: bool = True) -> None:
        """``heals``: the restore time counts from ``off``, else from ``on`` (repair)."""
        load.phase(name)
        await on()
        t0 = time.monotonic()
        await load.wait_reads(FAULT_READS, timeout_s=120)
        await asyncio.sleep(max(0.0, FAULT_HOLD_S - (time.monotonic() - t0)))  # the fault's length
        await off()
        healed = time.monotonic() if heals else t0
        during = load.phase(f"after {name}")
        check(name, during)
        keys = [k for k in load.committed if k not in load.expiry]  # (no copies once expired)
        if replicas == 1 and not heals:  # nothing can restore what had its only copy there
            restore_s = poll_s = float("nan")
        else:
            restore_s, poll_s = await restore_time(admin, keys, replicas, healed, load.deleting)
        row = {"replicas": replicas, "fault": name, **during.to_dict(), "keys_committed": len(keys),
               "restore_s": round(restore_s, 2), "restore_poll_s": round(poll_s, 2)}
        record(row)
        rows.append(row)

    try:
        load.start()
        await load.wait_committed(BASELINE_KEYS, timeout_s=120)  # spread over every server
        await load.wait_reads(FAULT_READS, timeout_s=120)
        base = load.phase("baseline")
        assert base.reads > 0 and base.wrong == 0 and base.misses == 0 and base.read_errors == 0, base
        assert set(base.by_api) == set(load.apis), base  # every read API it has is checked
        record({"replicas": replicas, "fault": "none (baseline)", **base.to_dict()})

        cs = 1

        async def kill() -> None:
            await cluster.kill_chunkserver(cs)

        async def restart() -> None:
            await cluster.start_chunkserver(cs)

        await fault("SIGKILL of chunkserver 1, restarted", kill, restart)

        host = cluster.host_of_chunkserver(2)

        async def cut() -> None:
            lab.cut(host)

        async def heal() -> None:
            lab.heal(host)

        await fault("link of chunkserver 2's host cut (ip link down), healed", cut, heal)

        async def meta_down() -> None:
            await cluster.kill_meta()

        async def meta_up() -> None:
            await cluster.start_meta_again()

        await fault("meta SIGKILLed, restarted on its port", meta_down, meta_up)

        async def kill3() -> None:
            await cluster.kill_chunkserver(3)

        async def nothing() -> None:
            pass

        await fault(f"SIGKILL of chunkserver 3, never restarted (dead after {DEAD_AFTER_S:g}s, "
                    "the GC daemon repairs)", kill3, nothing, heals=False)
        await load.stop()
    finally:
        for c in (writer, reader, admin):
            await c.close()
        await asyncio.to_thread(blocking.close)
        await asyncio.to_thread(files.close)
        await stop_mount(mounter, mnt)
    return load, rows


async def test_replicas_2_every_committed_value_stays_readable(cluster: NetnsCluster) -> None:
    def check(name: str, f: Figures) -> None:
        assert f.wrong == 0, (name, dict(f.errors), f)  # errors first: the repr is cut
        assert f.misses == 0, (name, f)  # a committed value is never a miss with a replica left
        assert f.stored_absent == 0, (name, f)  # nor absent for put(if_absent=True)
        if "meta" not in name:  # reads of uncached layouts need meta; the others must not fail
            assert f.read_errors == 0, (name, f)

    load, rows = await run_faults(cluster, 2, check)
    assert len(rows) == 4
    fresh = cluster.client(config=client_config(2))
    try:
        misses, wrong, failed = await verify_all(fresh, load.committed, VALUES,
                                                 **load.expected())
    finally:
        await fresh.close()
    record({"replicas": 2, "fault": "final check", "keys_committed": len(load.committed),
            "misses": misses, "wrong": wrong, "failed": failed})
    assert (misses, wrong, failed) == (0, 0, 0)


async def test_replicas_1_lost_values_end_within_a_bound(cluster: NetnsCluster) -> None:
    def check(name: str, f: Figures) -> None:
        assert f.wrong == 0, (name, dict(f.errors), f)  # errors first: the repr is cut
        # a value that cannot be read ends the read (a miss or an error), never a hang
        assert f.longest_read_s < READ_BOUND_S, (name, f)

    load, rows = await run_faults(cluster, 1, check)
    assert len(rows) == 4
    fresh = cluster.client(config=client_config(1))
    try:
        dead = {s.server_id for s in await fresh.servers(refresh=True) if not s.alive}
        on_dead = [k for k in load.committed if k not in load.deleting and k not in load.expiry
                   and any(r.server_id in dead for e in (await fresh.layout(k) or NO_LAYOUT).extents
                          for r in e.replicas)]
        t0 = time.monotonic()
        misses, wrong, failed = await verify_all(fresh, load.committed, VALUES,
                                                 **load.expected())
        verify_s = time.monotonic() - t0
        exists = await fresh.exists_many(on_dead) if on_dead else []
    finally:
        await fresh.close()
    record({"replicas": 1, "fault": "final check", "keys_committed": len(load.committed),
            "keys_on_the_dead_server": len(on_dead), "misses": misses, "wrong": wrong,
            "failed": failed, "verify_s": round(verify_s, 2)})
    assert wrong == 0
    # only the values whose one copy was on the server that never came back are lost
    assert misses + failed == len(on_dead) > 0
    assert not any(exists)  # and exists() does not count them
