"""The implementations of the core ``kvfs`` commands (services, the launcher, the everyday
client commands): ``kvfs.cli`` parses a command line and imports this module only for them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import signal
import stat as stat_mod
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import BinaryIO, Protocol

from kvfs.address import lookup_token, token_from_file
from kvfs.client import AsyncClient
from kvfs.config import (
    ChunkServerConfig,
    ClientConfig,
    MetaConfig,
    TlsConfig,
    UpConfig,
    from_options,
    fsync_argv,
    tls_argv,
    tls_fields,
)
from kvfs.handshake import Role
from kvfs.tls import server_context
from kvfs.units import format_size


def _stop_event() -> asyncio.Event:
    """Set on SIGINT, SIGTERM or SIGHUP (a closed terminal stops a service too)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    return stop


class _Service(Protocol):
    async def start(self) -> str: ...
    async def close(self) -> None: ...


async def _serve(svc: _Service, ready_line: Callable[[str], str], *,
                 started: Callable[[], None] | None = None) -> int:
    """Start ``svc``, print its ready line (launchers wait for it), serve until a signal.
    The signal handlers go in first: a signal as soon as the ready line is out (or during
    start-up) stops the service cleanly, not by the signal's default action.  ``started``
    runs once it listens, before the ready line."""
    stop = _stop_event()
    addr = await svc.start()
    if started is not None:
        started()
    print(ready_line(addr), flush=True)
    try:
        await stop.wait()
    finally:
        await svc.close()
    return 0


# services ------------------------------------------------------------------------
async def cmd_meta(ns: argparse.Namespace) -> int:
    from kvfs.meta import MetaService

    if ns.data is None:
        raise ValueError("--data is required")
    os.umask(0o077)  # what meta's store creates is its own: RocksDB's files take the umask's mode
    svc = MetaService(from_options(MetaConfig, ns))
    # frozen once it has loaded its keys, as a chunkserver (cmd_chunkserver): start-up's
    # objects are never garbage, and every full collection walked them, some 25 ms a time
    # on the 2-vCPU guest (bench/RESULTS.md, "Meta's walks of every key")
    return await _serve(svc, lambda addr: f"kvfs meta ready {addr}",
                        started=gc.freeze)  # type: ignore[attr-defined]


async def cmd_meta_rebuild(ns: argparse.Namespace) -> int:
    from kvfs.meta.localstore import store_path
    from kvfs.meta.rebuild import rebuild

    addrs = [a.strip() for a in ns.from_chunkservers.split(",") if a.strip()]
    # reading every chunk's records (CHUNK_SCAN) is an admin operation
    token = lookup_token(token_from_file(ns.token_file), data_dir=ns.data, role=Role.ADMIN)
    rep = await rebuild(ns.data, addrs, token, tls=from_options(TlsConfig, ns), kind=ns.store)
    print(f"rebuilt {store_path(ns.data, ns.store)} from {rep.servers} chunkservers, {rep.chunks} chunks, "
          f"{rep.records} records: {rep.keys} keys ({format_size(rep.value_bytes)}); skipped "
          f"{rep.deleted} deleted, {rep.expired} expired, {rep.incomplete} incomplete "
          f"(no good copy of an extent), {rep.bad_records} records failing their CRC")
    for key in rep.dropped_keys[:20]:
        print(f"  dropped {key[:80].decode(errors='backslashreplace')}")
    return 0


async def cmd_meta_backup(ns: argparse.Namespace) -> int:
    from kvfs.meta.rebuild import backup

    done = backup(ns.data, ns.file)
    print(f"backed up {done.source} to {ns.file} ({done.size})")
    return 0


async def cmd_meta_migrate(ns: argparse.Namespace) -> int:
    from kvfs.meta.migrate import MigrateReport, migrate

    def progress(rep: MigrateReport) -> None:
        print(f"kvfs meta migrate: {rep.keys} keys in {rep.seconds:.0f} s", file=sys.stderr, flush=True)

    rep = await migrate(ns.src, ns.dst, from_namespace=ns.from_namespace, to_namespace=ns.to_namespace,
                        batch=ns.batch, progress=progress)
    resumed = "" if rep.resumed_after is None else f" (resumed after {rep.resumed_after[:60]!r})"
    print(f"migrated cluster {rep.cluster_id} from {rep.source} to {rep.target}{resumed}: "
          f"{rep.keys} keys ({rep.expired} expired, not moved), {rep.servers} chunkservers, "
          f"{rep.retired_chunks} retired chunks, {rep.state} GC state entries"
          + (f", {rep.kept} tombstones and older or dropped records" if rep.kept else "")
          + f" in {rep.seconds:.1f} s "
          f"({rep.keys / max(rep.seconds, 1e-9):.0f} keys/s)")
    return 0


async def cmd_chunkserver(ns: argparse.Namespace) -> int:
    from kvfs.chunkserver import ChunkServer

    svc = ChunkServer(from_options(ChunkServerConfig, ns))
    # What start-up made (modules, classes, the config: some 46,000 objects) is never garbage.
    # Frozen, the cyclic GC's full collections no longer walk it: they come every few hundred
    # APPENDs (each holds its records across the write) and cost a put about 0.3 us per key
    # on the chunkserver at 4 KiB x 128 (bench/RESULTS.md, "Chunkserver CPU per key").
    return await _serve(svc, lambda addr: f"kvfs chunkserver ready id={svc.server_id} {addr}",
                        # (mypy takes ``gc`` for this repository's gc/ folder, kvfs.gc: the stdlib's here)
                        started=gc.freeze)  # type: ignore[attr-defined]


async def cmd_up(ns: argparse.Namespace) -> int:
    from kvfs.launcher import ProcessCluster

    cfg = from_options(UpConfig, ns)  # every argument checked before anything starts
    server_context(cfg, "TLS")  # the TLS files load (the children load them again)
    meta_args: list[str] = []
    if cfg.default_ttl_s is not None:
        meta_args += ["--default-ttl", repr(cfg.default_ttl_s)]
    cs_args: list[str] = []
    if cfg.capacity_bytes is not None:
        cs_args += ["--capacity", str(cfg.capacity_bytes)]
    gc_args: list[str] = []
    if cfg.gc_interval_s is not None:
        gc_args += ["--interval", repr(cfg.gc_interval_s)]
    if cfg.gc_scrub_rate_bytes is not None:
        gc_args += ["--scrub-rate", str(cfg.gc_scrub_rate_bytes)]
    tls_args = tls_argv(cfg)  # every child: its server certificate, and its client one
    meta_args, cs_args, gc_args = meta_args + tls_args, cs_args + tls_args, gc_args + tls_args
    meta_args, cs_args = meta_args + fsync_argv(cfg), cs_args + fsync_argv(cfg)
    redis_args: tuple[str, ...] | None = None
    kind = cfg.meta_store
    if kind != "redis-cluster":
        from kvfs.meta.localstore import chosen_kind
        from kvfs.meta.rocks import HAVE_ROCKSDICT, MISSING

        # settled once, here: each restart opens the same kind, even if the store went away
        kind = chosen_kind(cfg.data / "meta", None if cfg.meta_store == "auto" else cfg.meta_store)
        if kind == "rocksdb" and not HAVE_ROCKSDICT:  # (checked here: meta would fail at every restart)
            raise ValueError(MISSING)
        meta_args += ["--store", kind]
    else:
        from kvfs.meta.redis_local import REDIS_SERVER

        if shutil.which(REDIS_SERVER) is None:
            raise ValueError(f"--meta-store redis-cluster needs {REDIS_SERVER} (Debian: apt-get "
                             "install redis-server) and the redis extra (pip install 'kvfs[redis]')")
        redis_args = ("--replicas", "1" if cfg.redis_replicas else "0")
        if cfg.redis_maxmemory_bytes is not None:
            redis_args += ("--maxmemory", str(cfg.redis_maxmemory_bytes))
    cluster = ProcessCluster(cfg.data, cfg.chunkservers, listen=cfg.listen,
                             meta_args=tuple(meta_args), chunkserver_args=tuple(cs_args),
                             gc=cfg.gc, gc_args=tuple(gc_args), redis_args=redis_args)

    def report(msg: str) -> None:
        print(f"kvfs up: {msg}", file=sys.stderr, flush=True)

    stop = _stop_event()  # before anything starts: a signal during start-up stops it cleanly
    addr = await cluster.start()
    supervisor: asyncio.Task[None] | None = None
    try:
        token_path = cluster.write_user_token()
        print(addr, flush=True)
        pids = ", ".join(f"{p.name} {p.pid}" for p in cluster.services())
        tls = ("no TLS" if cfg.tls_cert is None else
               f"TLS with {cfg.tls_cert} (clients: --tls-ca or $KVFS_TLS_CA"
               + (f" {cfg.tls_ca}, and a client certificate it signed: mutual TLS)"
                  if cfg.tls_ca else ")"))
        store = ({"rocksdb": ", meta on RocksDB", "sqlite": ", meta on SQLite"}.get(kind) or
                 f", meta on a {'3+3' if cfg.redis_replicas else '3'}-node Redis Cluster "
                 f"{cluster.store_url}")
        report(f"{cfg.chunkservers} chunkservers{' + gc daemon' if cfg.gc else ''}{store}, data in "
               f"{cluster.data}; token in {token_path} (mode 0600); {tls}; pid {os.getpid()} "
               f"({pids}). Ctrl-C stops all.")
        supervisor = asyncio.create_task(cluster.supervise(
            report, restart=cfg.restart, backoff_s=cfg.restart_backoff_s,
            backoff_max_s=cfg.restart_backoff_max_s, stable_s=cfg.restart_stable_s))
        await stop.wait()
        report("stopping")
    finally:
        if supervisor is not None:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        await cluster.stop()
    return 0


# client commands ------------------------------------------------------------------
def _client(ns: argparse.Namespace) -> AsyncClient:
    return AsyncClient(ns.addr, token=token_from_file(ns.token_file),
                       config=ClientConfig(**tls_fields(from_options(TlsConfig, ns))))


async def _read_chunks(f: BinaryIO, n: int) -> AsyncIterator[bytes]:
    """``f`` in pieces of ``n`` bytes, each read in a thread while the loop keeps writing."""
    while True:
        piece = await asyncio.to_thread(f.read, n)
        if not piece:
            return
        yield piece


async def cmd_put(ns: argparse.Namespace) -> int:
    """Streams: memory stays a few stripe units, whatever the file's size."""
    async with _client(ns) as kv:
        stripe = kv.config.stripe_bytes
        if ns.file == "-":
            await kv.put_stream(ns.key, _read_chunks(sys.stdin.buffer, stripe), ttl=ns.ttl,
                                replicas=ns.replicas)
            return 0
        with open(ns.file, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size if stat_mod.S_ISREG(st.st_mode) else None
            await kv.put_stream(ns.key, _read_chunks(f, stripe), size=size, ttl=ns.ttl,
                                replicas=ns.replicas)
    return 0


async def cmd_get(ns: argparse.Namespace) -> int:
    """Streams: one stripe unit at a time (a few read ahead) to the file or stdout."""
    async with _client(ns) as kv:
        reader = await kv.open_read(ns.key)
        if reader is None:
            print(f"kvfs: {ns.key}: not found", file=sys.stderr)
            return 1
        to_file = bool(ns.output and ns.output != "-")
        out = open(ns.output, "wb") if to_file else sys.stdout.buffer  # noqa: SIM115
        try:
            async for part in reader.chunks():
                out.write(part)
            out.flush()
        finally:
            if to_file:
                out.close()
    return 0


async def cmd_rm(ns: argparse.Namespace) -> int:
    async with _client(ns) as kv:
        n = await kv.delete_many(ns.keys)
    print(f"deleted {n} of {len(ns.keys)}")
    return 0 if n == len(ns.keys) else 1


def _ts(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


async def cmd_ls(ns: argparse.Namespace) -> int:
    async with _client(ns) as kv:
        infos = await kv.list(ns.prefix or b"", limit=ns.limit)
    if ns.json:
        print(json.dumps([{"key": i.key.decode(errors="backslashreplace"), "size": i.size,
                           "created": i.created, "expires_at": i.expires_at, "extents": i.extents}
                          for i in infos]))
        return 0
    if ns.long:
        print(f"{'size':>12}  {'created':<19}  {'expires':<19}  {'extents':>7}  key")
    for i in infos:
        key = i.key.decode(errors="backslashreplace")
        if ns.long:
            print(f"{i.size:>12}  {_ts(i.created):<19}  {_ts(i.expires_at):<19}  {i.extents:>7}  {key}")
        else:
            print(key)
    return 0


async def cmd_stat(ns: argparse.Namespace) -> int:
    async with _client(ns) as kv:
        st = await kv.stats()
    if ns.json:
        print(json.dumps(st, default=str))
        return 0
    store = st.get("store") or "?"
    on_disk = f", {format_size(st['store_bytes'])} on disk" if st.get("store_bytes") else ""
    free = f" ({format_size(st['store_free'])} free there)" if st.get("store_free") else ""
    print(f"keys: {st['keys']}   bytes: {format_size(st['bytes'])}   "
          f"overflow leases: {st.get('leases_overflowed', 0)}   meta: {store}{on_disk}{free}")
    if st.get("refusing"):
        print(f"# meta refuses every change (puts, deletes, GC): {st['refusing']}")
    from kvfs.gc.cli import format_repair

    print(format_repair(st.get("gc", {}).get("repair"), st.get("gc", {}).get("metrics", {})))
    print(f"{'id':>3} {'addr':<22} {'alive':<5} {'capacity':>11} {'free':>11} {'chunks':>6} "
          f"{'written':>11} {'live':>11} {'garbage':>11}")
    for s in st["servers"]:
        alive = ("drain" if s.get("draining") else "yes") if s["alive"] else "NO"
        print(f"{s['server_id']:>3} {s['addr']:<22} {alive:<5} "
              f"{format_size(s['capacity']):>11} {format_size(s['free']):>11} {s['chunks']:>6} "
              f"{format_size(s['written']):>11} {format_size(s['live']):>11} "
              f"{format_size(s['garbage']):>11}")
    for s in st["servers"]:
        if s.get("draining"):
            print(f"# server {s['server_id']} is draining (kvfs gc decommission): {format_size(s['live'])} "
                  "live left to copy away; then meta forgets it")
    shared = max((int(s.get("shared_by", 1)) for s in st["servers"]), default=1)
    if shared > 1:
        print(f"# chunkservers sharing a disk each show their share of its capacity and free "
              f"space (up to {shared} share one); totals count each disk once")
    return 0
