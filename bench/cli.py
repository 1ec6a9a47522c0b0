"""``kvfs bench``: fio-style load generator for kvfs (and, with ``--compare``, its peers).

One io = one key (one value). Options carry fio's names: ``--rw``, ``--bs``
(value size, comma list allowed), ``--iodepth`` (calls in flight per job),
``--numjobs`` (client processes), ``--size``, ``--runtime``, ``--time_based``,
``--ramp_time``, plus ``--batch`` (keys per call) and ``--prefix-chain=N``.

With no ``--addr`` an embedded cluster (meta + 3 chunkservers) is started in a
temp dir and torn down at the end. With neither ``--rw`` nor ``--bs`` the
default job set runs (see ``bench/jobs.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from kvfs.address import token_from_file
from kvfs.config import ChunkServerConfig, TlsConfig, from_options, tls_argv

from .adapters import ChainStore, KvfsStore
from .compare import FIO_COLUMN, Cell, StoreFactory, compare, peer_factories, store_cpu_probe
from .internal import run_internal
from .jobs import build_workloads, describe, human_bs
from .options import add_options
from .plot import plot, plot_families
from .render import render_compare
from .runner import BenchError, JobResult, Workload, run_workload, workload_dict
from .stats import format_report_text, report_json
from .store import Store
from .target import BenchTarget, open_target

__all__ = ["add_arguments", "cmd_bench"]


#: the store (and --compare column) name of each --client
STORE_NAMES = {"async": "kvfs", "sync": "kvfs-sync"}

_PEER_TEXT = {
    "file": "file-per-key",
    "redis": "redis (TCP, MSET/MGET)",
    "mooncake": "mooncake (TCP, batch_put_from/batch_get_into)",
    "loopback": "loopback socket limit",
    "fio": "fio (psync on one file; writes fdatasync once per batch)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``kvfs bench``'s arguments (its line in ``kvfs --help``: kvfs.cli)."""
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_options(p)
    p.set_defaults(func=cmd_bench)


def _say(ns: argparse.Namespace, msg: str) -> None:
    if ns.output_format == "normal":
        print(msg, file=sys.stderr, flush=True)


async def _store_for(target: BenchTarget, wl: Workload, ns: argparse.Namespace, client: str) -> Store:
    """A fresh kvfs store for one job: ``client`` is ``async`` or ``sync`` (the blocking one)."""
    kv = await target.blocking_client() if client == "sync" else target.client()
    if ns.prefix_chain and wl.reads:
        return ChainStore(kv, ns.prefix_chain, name=STORE_NAMES[client])
    return KvfsStore(kv, name=STORE_NAMES[client], server_pids=target.server_pids())


async def _run_one(target: BenchTarget, wl: Workload, ns: argparse.Namespace, client: str = "async",
                   label: str | None = None, eta_after_s: float = 0.0) -> JobResult:
    store = await _store_for(target, wl, ns, client)
    try:
        return await run_workload(store, wl, progress=ns.progress, label=label, eta_after_s=eta_after_s,
                                  cpu=store_cpu_probe(store) if ns.cpu else None)
    finally:
        await store.close()


def _for_client(wl: Workload, client: str) -> Workload:
    """The job as run with ``client``: the blocking client's is ``<name>-sync``, its own keys."""
    if client == "async":
        return wl
    return replace(wl, name=f"{wl.name}-{client}", key_prefix=wl.key_prefix + f"{client}/".encode())


def _child_argv(target: BenchTarget, wl: Workload, ns: argparse.Namespace, client: str) -> list[str]:
    argv = [sys.executable, "-m", "kvfs", "bench", "--addr", target.addr,
            "--output-format", "json", "--no-progress", "--job-spec", json.dumps(workload_dict(wl))]
    if ns.prefix_chain:
        argv += ["--prefix-chain", str(ns.prefix_chain)]
    argv += ["--client", client]
    if target.tls is not None:
        argv += tls_argv(target.tls)
    return argv


async def _run_numjobs(target: BenchTarget, wl: Workload, ns: argparse.Namespace,
                       group: int, client: str) -> list[dict[str, Any]]:
    """``numjobs`` client processes, each its own key space, run at once: one fio group."""
    procs = []
    for i in range(ns.numjobs):
        job = replace(wl, name=f"{wl.name}.{i}", key_prefix=wl.key_prefix + b"%d/" % i, seed=wl.seed + i)
        env = {**os.environ, "KVFS_TOKEN": target.token} if target.token else None
        procs.append(await asyncio.create_subprocess_exec(  # the token in env, never on argv
            *_child_argv(target, job, ns, client), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env))
    jobs: list[dict[str, Any]] = []
    limit = wl.prefill_timeout_s + wl.ramp_time_s + wl.runtime_s + wl.grace_s
    for i, proc in enumerate(procs):
        out, err = await asyncio.wait_for(proc.communicate(), limit)
        if proc.returncode != 0:
            raise BenchError(f"job {wl.name}.{i} exited {proc.returncode}: {err.decode()[-2000:]}")
        jobs.extend(json.loads(out)["jobs"])
    for n, fio_job in enumerate(jobs):
        fio_job["groupid"] = group
        fio_job["job"] = n
    return jobs


async def _child(ns: argparse.Namespace) -> int:
    d = json.loads(ns.job_spec)
    d["key_prefix"] = d["key_prefix"].encode("latin-1")
    wl = Workload(**d)
    target = BenchTarget(ns.addr, token_from_file(ns.token_file), tls=from_options(TlsConfig, ns))
    res = await _run_one(target, wl, ns, ns.client[0])
    print(json.dumps(report_json([res.to_json()])))
    return 0


def _options_of(ns: argparse.Namespace) -> dict[str, str]:
    out = {"numjobs": str(ns.numjobs), "client": ",".join(ns.client)}
    if ns.addr is None:
        out["cluster"] = f"embedded {ns.cluster}, {ns.chunkservers} chunkservers, meta on {ns.meta_store}"
        out["fsync"] = str(ns.fsync)  # the embedded cluster's (targets.py judges by it)
    return out


async def cmd_bench(ns: argparse.Namespace) -> int:
    if ns.job_spec is not None:
        return await _child(ns)
    if ns.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvfs bench: --plot needs matplotlib (pip install 'kvfs[bench]' or "
                  "pip install matplotlib)", file=sys.stderr)
            return 2
    if ns.addr is not None and ns.fsync != ChunkServerConfig.fsync:
        print(f"kvfs bench: --fsync sets the embedded cluster's; the cluster at --addr keeps its "
              f"own (drop --fsync {ns.fsync}, or drop --addr)", file=sys.stderr)
        return 2
    if ns.reclaim and ns.addr is not None:
        print("kvfs bench: --reclaim deletes keys and runs a GC pass on the embedded cluster only "
              "(drop --reclaim, or drop --addr)", file=sys.stderr)
        return 2
    if ns.reclaim is None:
        ns.reclaim = ns.addr is None
    if ns.gc:
        return await _gc_bench(ns)
    if ns.compare and ns.numjobs != 1:
        print("kvfs bench: --compare runs 1 client process (numjobs=1)", file=sys.stderr)
        return 2
    if ns.repeat != 1 and not ns.compare:
        print("kvfs bench: --repeat repeats the cells of --compare", file=sys.stderr)
        return 2
    try:
        workloads = build_workloads(ns)
    except ValueError as e:
        print(f"kvfs bench: {e}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        workdir = ns.dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfs-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            async with open_target(ns, workdir) as target:
                where = (f"embedded {target.embedded} cluster, {ns.chunkservers} chunkservers, "
                         f"--fsync {ns.fsync}" if target.embedded else target.addr)
                _say(ns, f"kvfs bench: {len(workloads)} job(s) x numjobs={ns.numjobs} against {where}")
                if ns.compare:
                    return await _compare(ns, target, workloads, workdir)
                return await _plain(ns, target, workloads)
        except BenchError as e:
            print(f"kvfs bench: {e}", file=sys.stderr)
            return 1


async def _gc_bench(ns: argparse.Namespace) -> int:
    from .gcbench import render, run_gc_bench

    with contextlib.ExitStack() as stack:
        workdir = ns.dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfs-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            async with open_target(ns, workdir) as target:
                report = await run_gc_bench(ns, target.addr, target.admin_token, target.data_dir(),
                                            child=target.embedded != "inproc")
        except BenchError as e:
            print(f"kvfs bench: {e}", file=sys.stderr)
            return 1
    if ns.output_format == "json":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render(report))
    sys.stdout.flush()
    return 0


async def _plain(ns: argparse.Namespace, target: BenchTarget, workloads: list[Workload]) -> int:
    jobs: list[dict[str, Any]] = []
    runs = [(_for_client(wl, c), c) for wl in workloads for c in ns.client]
    for i, (wl, client) in enumerate(runs, 1):
        _say(ns, f"[{i}/{len(runs)}] {describe(wl)} size={human_bs(wl.size_bytes)} "
                 f"runtime={wl.runtime_s:g}s" + ("" if client == "async" else f" client={client}"))
        await _reclaim(ns, target)  # the earlier jobs' keys and chunks (--reclaim)
        # jobs that run one after another are groups of their own (fio sums a group)
        if ns.numjobs == 1:
            label = f"[{i}/{len(runs)}] {STORE_NAMES[client]} {wl.rw} {human_bs(wl.bs)}"
            after = sum(w.ramp_time_s + w.runtime_s for w, _ in runs[i:])
            job = (await _run_one(target, wl, ns, client, label, after)).to_json()
            job["groupid"] = i - 1
            jobs.append(job)
        else:
            jobs.extend(await _run_numjobs(target, wl, ns, i - 1, client))
    report = report_json(jobs, global_options=_options_of(ns))
    if ns.json_out is not None:
        ns.json_out.write_text(json.dumps(report, indent=2) + "\n")
    _emit(ns, report, sys.stdout)
    if ns.plot is not None:
        plot(report["jobs"], ns.plot, _title(ns, target))
        _say(ns, f"plot written to {ns.plot}")
    return 0


def _emit(ns: argparse.Namespace, report: dict[str, Any], out: TextIO) -> None:
    if ns.output_format == "json":
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        out.write(format_report_text(report))
    out.flush()


async def _reclaim(ns: argparse.Namespace, target: BenchTarget) -> None:
    """``--reclaim``: the bench's keys and the chunks they leave deleted before a kvfs job."""
    if ns.reclaim:
        _say(ns, f"  {(await target.reclaim()).text()}")


async def _compare(
    ns: argparse.Namespace, target: BenchTarget, workloads: list[Workload], workdir: Path
) -> int:
    def kvfs_factory(client: str) -> StoreFactory:
        async def make() -> Store:
            kv = await target.blocking_client() if client == "sync" else target.client()
            return KvfsStore(kv, name=STORE_NAMES[client], server_pids=target.server_pids())

        return make

    peers = peer_factories(workdir)
    # the first kvfs client is the subject; the other (kvfs-sync) is a column like a peer
    factories: dict[str, StoreFactory] = {STORE_NAMES[c]: kvfs_factory(c) for c in ns.client}
    factories.update((p, peers[p]) for p in ns.peers if p in peers)
    want_fio = "fio" in ns.peers
    fio_dir = workdir / "fio" if want_fio and shutil.which("fio") else None
    text_out = sys.stderr if ns.output_format == "normal" else None
    _say(ns, "peers: " + ", ".join(_PEER_TEXT[p] for p in ns.peers)
             + ("" if fio_dir or not want_fio else " (fio not installed: skipped)"))
    async def before_cell(store: str) -> None:
        if store in STORE_NAMES.values():
            await _reclaim(ns, target)

    comp = await compare(factories, workloads, fio_dir=fio_dir, progress=ns.progress,
                         text_out=text_out, cpu=ns.cpu, repeat=ns.repeat, before_cell=before_cell)
    if want_fio and fio_dir is None:  # show fio as skipped rather than leaving the column out
        comp.stores.append(FIO_COLUMN)
        for wl in workloads:
            comp.cells[(wl.name, FIO_COLUMN)] = Cell(FIO_COLUMN, skipped="fio not installed")
    internal = None
    if ns.internal:
        await _reclaim(ns, target)  # the compare cells' keys and chunks (--reclaim)
        internal = await run_internal(target, runtime_s=ns.runtime, progress=ns.progress,
                                      say=lambda m: _say(ns, m))
    jobs = [comp.cell(wl, comp.subject).result.to_json()  # type: ignore[union-attr]
            for wl in workloads if comp.cell(wl, comp.subject).result is not None]
    report = report_json(jobs, global_options=_options_of(ns))
    report["kvfs compare"] = {"peers": comp.to_json(), **(internal.to_json() if internal else {})}
    if ns.json_out is not None:
        ns.json_out.write_text(json.dumps(report, indent=2) + "\n")
    if ns.output_format == "json":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_compare(comp, internal))
    sys.stdout.flush()
    if ns.plot is not None:
        jobs = [c.result.to_json() for (_, s), c in comp.cells.items() if s == comp.subject and c.result]
        title = _title(ns, target)
        plot(jobs, ns.plot, title)
        more = plot_families(comp, ns.plot, title)
        _say(ns, f"plots written to {', '.join(str(p) for p in [ns.plot, *more])}")
    return 0


def _title(ns: argparse.Namespace, target: BenchTarget) -> str:
    """Names the run on every plot: command, cluster, host cores, date."""
    what = "kvfs bench --compare" if ns.compare else "kvfs bench"
    where = (f"embedded {target.embedded} cluster, {ns.chunkservers} chunkservers, fsync {ns.fsync}"
             if target.embedded else target.addr)
    return f"{what}: {where}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
