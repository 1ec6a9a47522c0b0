"""A bounded soak (issue 10): meta, 4 chunkservers and the GC daemon (repair on) as processes,
several client processes running the mixed workload of :mod:`kvfs.bench.workload` (every value
read is compared with the bytes its key and version determine).  Each process reads through
``get_many`` and ``get_into`` of its ``AsyncClient`` and of a blocking ``kvfs.Client``,
``get_ranges``, one ``get`` per key at once, each key's file through a blocking fsspec
``KVFileSystem``'s ``open``, and with ``--mount`` through a ``kvfs mount`` of the cluster too
(FUSE, as root), whole or a slice; with ``--mount`` some new keys, and some next versions,
are written as files through it too (with ``--write-behind``, the mount's, each batch's
directory fsynced before its keys count as written).  It puts some of its keys again as new
versions, which every read must see whole; deletes some; puts some with a TTL, which a read
must miss once it ended; and puts present keys with ``if_absent``, which must change none
while a replica is up.  Midway:

- one bit flipped in a stored value on a live chunkserver (a replica of a seed key),
- a chunkserver SIGKILLed, kept down until meta declares it dead and the GC daemon has
  repaired its extents onto the others, then restarted on its data dir.

At the end a fresh client reads every committed key once (an overwritten key: its newest
version a put returned for, or a newer one put after; a deleted or expired key: a miss, or
a wrong value).  Prints the operations done, wrong
values (must be 0), committed values lost (must be 0 with ``--replicas 2``), read errors,
failed puts, the longest read, and the seconds from the kill until every extent had its
replicas again; ``--json FILE`` writes the same figures.  RELIABILITY.md has a run's figures.

With ``--capacity SIZE`` each chunkserver has that capacity, so the cluster fills and the GC
daemon evicts: a committed key may then miss, but only one meta no longer has after the miss
(eviction never brings a key back), and never one a lease holds (readers lease batches of the
oldest keys with ``exists_many`` or ``match_prefix`` and read them again halfway through the
lease).

Usage: python -m kvfs.bench.soak [--seconds 180] [--clients 3] [--replicas 2] [--mount [--write-behind SIZE]]
                                [--capacity SIZE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvfs._parent import ENV as PARENT_ENV
from kvfs._parent import die_with_parent
from kvfs.address import TOKEN_ENV
from kvfs.bench.reliability import until_mended
from kvfs.bench.workload import MixedWorkload, Values, verify_all
from kvfs.client import AsyncClient
from kvfs.config import ClientConfig
from kvfs.fs import KVFileSystem
from kvfs.handshake import Role
from kvfs.launcher import ProcessCluster, ServiceProcess
from kvfs.layout import Replica
from kvfs.mount import is_mounted
from kvfs.sync import Client
from kvfs.units import parse_size

CHUNKSERVERS = 4
SEED_KEYS = 64  # written first; every client also reads them; one of them gets the flipped bit
VALUES = Values(max_small=32 * 1024, large_every=100)
HEARTBEAT_TIMEOUT_S = 1.5
DEAD_AFTER_S = 3.0
RESTORE_DEADLINE_S = 120.0  # the kill's restore time past this: reported as not restored
SUM_FIELDS = ("puts_ok", "puts_failed", "asked", "reads", "wrong", "misses", "read_errors", "overwritten",
              "deleted", "expiring", "after_ttl", "kept_present", "stored_absent", "left_old", "files_written",
              "leased", "evicted", "rewritten")
OVERWRITE_EVERY = 4  # every 4th put of a writer puts a batch of its keys again, as new versions
DELETE_EVERY = 7  # and every 7th deletes a batch of them
TTL_EVERY = 5  # and every 5th puts its new keys with a 2 s TTL
IF_ABSENT_EVERY = 6  # and every 6th puts a batch of present keys with if_absent
MOUNT_ATTR_S = 1.0  # the mount's --attr-timeout: how long it may show a deleted or expired file
MOUNT_WRITE_EVERY = 3  # with --mount, every 3rd put writes its new keys as files through it
LEASE_EVERY = 4  # about one read in 4 is instead a lease of the oldest keys, read again halfway
LEASE_S = 3.0  # through it (with --capacity, a leased key must not be evicted)


def client_config(replicas: int) -> ClientConfig:
    return ClientConfig(replicas=replicas, connect_timeout_s=1.0, request_timeout_s=2.0,
                        servers_refresh_s=0.5)


# one client process -----------------------------------------------------------------
async def client_main(addr: str, prefix: str, seconds: float, replicas: int, out: Path,
                      mount: Path | None = None, evicting: bool = False) -> None:
    """Run the workload for ``seconds`` (a writer and a reader client of its own, and the files
    under ``mount``), then write its figures and committed keys to ``out`` (JSON)."""
    cfg = client_config(replicas)
    blocking = await asyncio.to_thread(Client, addr, config=cfg)  # its own IO thread and sockets
    files = KVFileSystem(addr, config=cfg, skip_instance_cache=True)  # fsspec's open(): its own loop
    try:
        async with AsyncClient(addr, config=cfg) as writer, AsyncClient(addr, config=cfg) as reader:
            load = MixedWorkload(writer, reader, prefix=prefix, values=VALUES, write_pause_s=0.05,
                                 max_keys=50_000, blocking=blocking, overwrite_every=OVERWRITE_EVERY,
                                 delete_every=DELETE_EVERY, ttl_every=TTL_EVERY,
                                 if_absent_every=IF_ABSENT_EVERY, mount=mount,
                                 mount_stale_s=MOUNT_ATTR_S, mount_write_every=MOUNT_WRITE_EVERY,
                                 files=files, lease_every=LEASE_EVERY, lease_s=LEASE_S,
                                 evicting=evicting)
            load.committed.extend(seed_keys())
            load.start()
            await asyncio.sleep(seconds)  # the soak's length: the workload runs meanwhile
            fig = await load.stop()
    finally:
        await asyncio.to_thread(blocking.close)
        await asyncio.to_thread(files.close)
    row = fig.to_dict()
    row["keys"] = [k.decode() for k in load.committed[SEED_KEYS:]]
    row["versions"] = {k.decode(): span for k, span in load.versions().items()}
    row["deleted_keys"] = sorted(k.decode() for k in load.deleted)
    row["maybe_deleted"] = sorted(k.decode() for k in load.deleting - load.deleted)
    row["expiry"] = {k.decode(): span for k, span in load.expiry.items()}  # judged at each read
    out.write_text(json.dumps(row))


def seed_keys() -> list[bytes]:
    return [f"seed/{i:04d}".encode() for i in range(SEED_KEYS)]


# the parent -----------------------------------------------------------------------------
def server_index(cluster: ProcessCluster) -> dict[int, int]:
    """server id -> chunkserver index (from each data dir's state.json)."""
    out = {}
    for i in range(cluster.n):
        st = json.loads((cluster.data / f"cs{i}" / "state.json").read_text())
        out[int(st["server_id"])] = i
    return out


async def flip_bit(cluster: ProcessCluster, admin: AsyncClient,
                   key: bytes) -> tuple[int, set[int], Replica]:
    """Flip one bit in the middle of ``key``'s first replica (on its live server); returns
    that server's index, the indexes of every server holding ``key``, and the replica."""
    lay = await admin.layout(key)
    assert lay is not None, key
    rep = lay.extents[0].replicas[0]
    idx = server_index(cluster)
    holders = {idx[r.server_id] for e in lay.extents for r in e.replicas}
    path = cluster.data / f"cs{idx[rep.server_id]}" / "chunks" / f"{rep.chunk_id:016x}.chunk"
    at = rep.offset + lay.extents[0].length // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    return idx[rep.server_id], holders, rep


async def mended(admin: AsyncClient, key: bytes, rep: Replica, since: float) -> float | None:
    """Seconds from ``since`` until meta's layout of ``key`` no longer names replica ``rep``
    (a reader found it corrupt and meta repaired it, read repair, or the GC daemon's background
    scrub did; polled), or None when the
    key is gone or past RESTORE_DEADLINE_S."""
    left = RESTORE_DEADLINE_S - (time.monotonic() - since)
    lay = await until_mended(admin, key, rep, left, poll_s=0.2)
    return None if lay is None else time.monotonic() - since


async def restored(admin: AsyncClient, sid: int, since: float) -> float | None:
    """Seconds from ``since`` until meta declared server ``sid`` dead and no extent was left
    under-replicated (polled), or None past RESTORE_DEADLINE_S."""
    while time.monotonic() - since < RESTORE_DEADLINE_S:
        st = await admin.stats()
        dead = any(s["server_id"] == sid and s.get("dead") for s in st["servers"])
        rep = st["gc"].get("repair") or {}
        if dead and not rep.get("under_replicated_extents") and not rep.get("unrepairable_extents"):
            return time.monotonic() - since
        await asyncio.sleep(0.2)
    return None


async def start_mount(addr: str, env: dict[str, str], mnt: Path, replicas: int,
                      write_behind: str | None = None) -> ServiceProcess:
    """``kvfs mount`` of the cluster at ``mnt`` (writing ``replicas`` copies; with
    ``write_behind``, its ``--write-behind``), once it reports ready (its reads are another
    node's: a layout cache and page cache of its own)."""
    mnt.mkdir()
    mounter = ServiceProcess("kvfs mount", [
        sys.executable, "-m", "kvfs", "mount", str(mnt), "--addr", addr, "--timeout", "3s",
        "--attr-timeout", f"{MOUNT_ATTR_S}s", "--replicas", str(replicas),
        *(["--write-behind", write_behind] if write_behind else [])], env)
    await mounter.start()
    return mounter


async def stop_mount(mounter: ServiceProcess, mnt: Path) -> None:
    """End the mount (SIGTERM unmounts; a mount left by a killed one is detached)."""
    await mounter.stop()
    if is_mounted(str(mnt)):
        umount = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvfs", "umount", "--lazy",
                                                      str(mnt))
        await umount.wait()


async def soak(root: Path, seconds: float, clients: int, replicas: int, mount: bool = False,
               write_behind: str | None = None, capacity: int | None = None) -> dict[str, Any]:
    """``capacity``: each chunkserver's (bytes), so that the cluster fills and the GC daemon
    evicts; chunk files of a 64th of it, so that the GC reserve (2 chunks) is within the 10 %
    over the high watermark."""
    full = ("--capacity", str(capacity), "--chunk-bytes", str(capacity // 64)) if capacity else ()
    cluster = ProcessCluster(
        root / "data", CHUNKSERVERS, listen="127.0.0.1:0",
        meta_args=("--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT_S}s", "--dead-after", f"{DEAD_AFTER_S}s"),
        chunkserver_args=("--heartbeat-interval", "250ms", *full),
        gc=True, gc_args=("--interval", "1s", "--grace", "2s"))
    procs: list[asyncio.subprocess.Process] = []
    mounter: ServiceProcess | None = None
    mending: asyncio.Future[float | None] | None = None
    mnt = root / "mnt"
    t_start = time.monotonic()
    try:
        addr = await cluster.start()
        env = {**os.environ, TOKEN_ENV[Role.CLIENT]: cluster.token, PARENT_ENV: str(os.getpid())}
        async with AsyncClient(addr, token=cluster.token, config=client_config(replicas)) as admin:
            await admin.put_many([(k, VALUES.of(k)) for k in seed_keys()])
            if mount:
                mounter = await start_mount(addr, env, mnt, replicas, write_behind)
            outs = [root / f"client{i}.json" for i in range(clients)]
            for i, out in enumerate(outs):
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "kvfs.bench.soak", "--client-of", addr, "--prefix", f"c{i}",
                    "--seconds", str(seconds), "--replicas", str(replicas), "--out", str(out),
                    *(["--mount-dir", str(mnt)] if mount else []),
                    *(["--evicting"] if capacity else []), env=env))
            await asyncio.sleep(seconds * 0.2)  # the workload runs; then the bit flip
            flipped = seed_keys()[SEED_KEYS // 2]
            flipped_on, holders, flipped_rep = await flip_bit(cluster, admin, flipped)
            mending = asyncio.ensure_future(mended(admin, flipped, flipped_rep, time.monotonic()))
            print(f"flipped one bit of {flipped.decode()} on cs{flipped_on}", flush=True)
            await asyncio.sleep(seconds * 0.1)
            # kill a server that holds no copy of the flipped key: its good copy stays readable
            victim = next((i for i in range(CHUNKSERVERS) if i not in holders), (flipped_on + 1) % CHUNKSERVERS)
            vsid = next(s for s, i in server_index(cluster).items() if i == victim)
            cluster.chunkservers[victim].kill()
            t_kill = time.monotonic()
            print(f"SIGKILLed cs{victim} (server id {vsid}; the GC daemon's log names servers by id) "
                  f"at {t_kill - t_start:.1f}s", flush=True)
            restore_s = await restored(admin, vsid, t_kill)
            print(f"replicas restored {restore_s if restore_s is None else round(restore_s, 2)}s after "
                  "the kill; restarting it", flush=True)
            await cluster.restart_chunkserver(victim)
            codes = [await p.wait() for p in procs]
            mended_s = await mending
            if any(codes):
                raise RuntimeError(f"a soak client failed (exit codes {codes})")
            rows = [json.loads(out.read_text()) for out in outs]
            keys = seed_keys() + [k.encode() for r in rows for k in r["keys"]]
            versions = {k.encode(): (lo, hi) for r in rows for k, (lo, hi) in r["versions"].items()}
            deleted = {k.encode() for r in rows for k in r["deleted_keys"]}
            maybe = {k.encode() for r in rows for k in r["maybe_deleted"]}
            expiry = {k.encode(): (lo, hi) for r in rows for k, (lo, hi) in r["expiry"].items()}
        async with AsyncClient(addr, token=cluster.token, config=client_config(replicas)) as fresh:
            missed: list[bytes] = []
            misses, wrong, failed = await verify_all(fresh, keys, VALUES, versions=versions,
                                                     deleted=deleted, maybe_deleted=maybe, expiry=expiry,
                                                     missed=missed)
            # full: a miss is eviction's where meta no longer has the key (nothing writes now)
            evicted = misses - sum(await fresh.exists_many(missed)) if capacity else 0
            gc_metrics = (await fresh.stats())["gc"]["metrics"]
    finally:
        if mending is not None:
            mending.cancel()
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        if mounter is not None:
            await stop_mount(mounter, mnt)
        await cluster.stop()
    total: dict[str, Any] = {f: sum(r[f] for r in rows) for f in SUM_FIELDS}
    errors: dict[str, int] = {}
    by_api: dict[str, int] = {}
    for r in rows:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
        for k, v in r["by_api"].items():
            by_api[k] = by_api.get(k, 0) + v
    return {"seconds": round(time.monotonic() - t_start, 1), "clients": clients, "replicas": replicas,
            **total, "longest_read_s": max(r["longest_read_s"] for r in rows), "errors": errors,
            "by_api": by_api,
            "keys_committed": len(keys), "final_misses": misses, "final_wrong": wrong,
            "final_failed": failed, "wrong_total": total["wrong"] + wrong,
            "final_evicted": evicted, "values_lost": misses - evicted + failed,
            "gc_keys_evicted": int(gc_metrics.get("keys_evicted", 0)),
            # keys meta dropped as lost (every replica corrupt or gone): a miss of one is no eviction's
            "gc_keys_lost": int(gc_metrics.get("keys_lost", 0)),
            "restore_s": None if restore_s is None else round(restore_s, 2),
            # the flipped replica, from the flip until meta's layout named a good copy instead
            "flip_mended_s": None if mended_s is None else round(mended_s, 2),
            "gc_replicas_reported_bad": int(gc_metrics.get("replicas_reported_bad", 0)),
            "gc_replicas_scrubbed_bad": int(gc_metrics.get("replicas_scrubbed_bad", 0))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfs.bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=180.0, help="how long the clients run")
    p.add_argument("--clients", type=int, default=3, help="client processes")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--mount", action="store_true",
                   help="the clients also read their keys' files through a kvfs mount (FUSE; root)")
    p.add_argument("--write-behind", default=None, metavar="SIZE",
                   help="with --mount: the mount's --write-behind (files written through it are "
                        "committed after their close; the writer fsyncs their directory)")
    p.add_argument("--capacity", type=parse_size, default=None, metavar="SIZE",
                   help="each chunkserver's capacity (e.g. 24MiB): the cluster fills and the GC daemon "
                        "evicts; a committed key may then miss, but not while a lease holds it, nor while "
                        "meta still has it")
    p.add_argument("--dir", type=Path, default=None, help="where the cluster's data goes (a temp dir in it)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--client-of", default=None, help=argparse.SUPPRESS)  # one client process
    p.add_argument("--prefix", default="c", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--mount-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--evicting", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.seconds <= 0 or ns.clients < 1 or ns.replicas < 1:
        p.error("--seconds must be positive, --clients and --replicas at least 1")
    if ns.write_behind and not ns.mount:
        p.error("--write-behind is the mount's: give --mount too")
    if ns.client_of:
        die_with_parent()
        asyncio.run(client_main(ns.client_of, ns.prefix, ns.seconds, ns.replicas, ns.out, ns.mount_dir,
                                ns.evicting))
        return 0
    with tempfile.TemporaryDirectory(dir=ns.dir, prefix="kvfs-soak-") as d:
        fig = asyncio.run(soak(Path(d), ns.seconds, ns.clients, ns.replicas, ns.mount, ns.write_behind,
                               ns.capacity))
    print(f"operations: {fig['puts_ok']} put_many calls ok ({fig['puts_failed']} failed), "
          f"{fig['reads']} values read and checked ({fig['read_errors']} reads failed; per API "
          f"{fig['by_api']}); "
          f"{fig['keys_committed']} keys committed, {fig['overwritten']} overwrites, {fig['deleted']} deleted, "
          f"{fig['expiring']} put with a TTL, {fig['files_written']} written as files through the mount, "
          f"{fig['leased']} leased; {fig['gc_keys_evicted']} evicted by GC, found so by {fig['evicted']} "
          f"reads and {fig['final_evicted']} of the final check; {fig['rewritten']} puts and deletes "
          f"written again after meta refused their COMMIT for a reclaimed chunk")
    print(f"wrong values: {fig['wrong_total']}  committed values lost: {fig['values_lost']}  "
          f"longest read: {fig['longest_read_s']}s  replicas restored {fig['restore_s']}s after the kill  "
          f"flipped replica mended {fig['flip_mended_s']}s after the flip")
    line = json.dumps(fig, sort_keys=True)
    print(line)
    if ns.json:
        ns.json.write_text(line + "\n")
    # wrong bytes are never allowed; with 2 replicas, no committed value may be lost or missed
    # either (but for eviction's, with --capacity: not of a leased key, nor of one meta had,
    # nor more than GC evicted, and none that meta dropped as lost)
    kept = (fig["values_lost"] == fig["misses"] == fig["gc_keys_lost"] == 0
            and fig["final_evicted"] <= fig["gc_keys_evicted"])
    return 0 if fig["wrong_total"] == 0 and (ns.replicas < 2 or kept) else 1


if __name__ == "__main__":
    raise SystemExit(main())
