"""``kvfs bench``: fio-style load generator for kvfs (and, with ``--compare``, its peers).

One io = one key (one value). Options carry fio's names: ``--rw``, ``--bs``
(value size, comma list allowed), ``--iodepth`` (calls in flight per job),
``--numjobs`` (client processes), ``--size``, ``--runtime``, ``--time_based``,
``--ramp_time``, plus ``--batch`` (keys per call) and ``--prefix-chain=N``.

With no ``--addr`` an embedded cluster (meta + 3 chunkservers) is started in a
temp dir and torn down at the end. With neither ``--rw`` nor ``--bs`` the
default job set runs (see ``DEFAULT_JOBS``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, TextIO

from kvfs.address import TOKEN_FILE_HELP, token_from_file

from .compare import Cell, Comparison, StoreFactory, compare, describe, human_bs, peer_factories
from .peers import Store
from .runner import RW, BenchError, JobResult, Workload, run_workload, workload_dict
from .stats import format_report_text, report_json

__all__ = [
    "DEFAULT_JOBS",
    "BenchTarget",
    "ChainStore",
    "SingleGetStore",
    "add_commands",
    "build_workloads",
    "cmd_bench",
]

_RWS: Final = ("read", "randread", "write", "randwrite", "randrw")

# (rw, bs, batch, iodepth, key-space bytes): the README's main job set.
DEFAULT_JOBS: Final[tuple[tuple[RW, int, int, int, int], ...]] = (
    ("randread", 4 << 10, 128, 4, 32 << 20),
    ("randread", 64 << 10, 32, 4, 64 << 20),
    ("read", 1 << 20, 4, 2, 64 << 20),
    ("read", 16 << 20, 1, 2, 128 << 20),
    ("write", 4 << 10, 128, 4, 32 << 20),
    ("write", 64 << 10, 128, 2, 64 << 20),
)
DEFAULT_RUNTIME_S: Final = 4.0
CHAIN_BLOCKS: Final = 64
CHAIN_BS: Final = 64 << 10


# ---------------------------------------------------------------------------
# argument parsing


def parse_size(text: str) -> int:
    """fio sizes: ``4k`` = 4096, ``1m``, ``16MiB``, ``512`` (k, m, g = powers of 1024)."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = 1
    for suffix, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4k, 64KiB, 1m)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _size_list(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def _rw_list(text: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    for rw in out:
        if rw not in _RWS:
            raise argparse.ArgumentTypeError(f"--rw must be one of {'|'.join(_RWS)}, got {rw!r}")
    return out


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return v


def _seconds(text: str) -> float:
    t = text.strip().lower()
    mult = 1.0
    for suffix, m in (("ms", 1e-3), ("s", 1.0), ("m", 60.0)):
        if t.endswith(suffix):
            t, mult = t[: -len(suffix)], m
            break
    try:
        return float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 5, 5s, 500ms)") from None


def add_commands(sub: Any) -> None:
    """Add ``kvfs bench`` to the ``kvfs`` subcommands."""
    p = sub.add_parser(
        "bench",
        help="fio-style load generator (no --addr: runs an embedded 3-chunkserver cluster)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p)
    p.set_defaults(func=cmd_bench)


def add_options(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--rw", type=_rw_list, default=None, help="read|randread|write|randwrite|randrw (comma list)")
    a("--bs", type=_size_list, default=None, help="value size(s), e.g. 4k,64k,1m,16m")
    a("--iodepth", type=_positive_int, default=None, help="calls in flight per job (default 4, 2 for >=1m)")
    a("--numjobs", type=_positive_int, default=1, help="client processes per job (default 1)")
    a("--size", type=parse_size, default=None, help="key space per job in bytes (default 32-128MiB)")
    a("--runtime", type=_seconds, default=None, help=f"seconds per job (default {DEFAULT_RUNTIME_S:g})")
    a("--time_based", "--time-based", dest="time_based", action="store_true",
      help="run for --runtime even after one pass over the key space (default job set: on)")
    a("--ramp_time", "--ramp-time", dest="ramp_time", type=_seconds, default=0.0,
      help="seconds run before measuring")
    a("--rwmixread", type=int, default=50, help="randrw: percent of calls that read")
    a("--batch", type=_positive_int, default=None, help="keys per call (default 128 <=4k, 32 <=64k, ...)")
    a("--prefix-chain", "--prefix_chain", dest="prefix_chain", type=_positive_int, default=None,
      metavar="N", help="reads: chains of N blocks written by one put_many, read one chain per call")
    a("--output-format", "--output_format", dest="output_format", choices=("normal", "json"),
      default="normal")
    a("--compare", action="store_true",
      help="run the same jobs against redis, a file-per-key store, the loopback limit and fio")
    a("--plot", type=Path, default=None, metavar="FILE.png",
      help="draw throughput vs value size and latency percentiles (needs matplotlib)")
    a("--progress", action=argparse.BooleanOptionalAction, default=None,
      help="progress line on stderr (default: when stderr is a terminal)")
    a("--cluster", choices=("inproc", "processes"), default="processes",
      help="embedded cluster: meta+chunkservers as child processes, as deployed (default), "
           "or in this process and event loop")
    a("--dir", type=Path, default=None, help="work dir for the embedded cluster and peers")
    a("--addr", default=None, help="cluster address (default: start an embedded cluster)")
    a("--token-file", default=None, help=TOKEN_FILE_HELP)
    a("--gc", action="store_true",
      help="GC bench: reclaim rate after keys expire (--bs, --size per run), and randread 4k p99 "
           "with GC idle vs running against a churn (see bench/gcbench.py)")
    a("--gc-ttl", dest="gc_ttl", type=_seconds, default=1.0, help="--gc: ttl of the expiring keys")
    a("--gc-churn-rate", dest="gc_churn_rate", type=parse_size, default=16 << 20,
      help="--gc: bytes/s the background churn writes (default 16MiB)")
    a("--job-spec", dest="job_spec", default=None, help=argparse.SUPPRESS)  # numjobs child


# ---------------------------------------------------------------------------
# workloads


def _default_batch(bs: int) -> int:
    if bs <= 4 << 10:
        return 128
    if bs <= 64 << 10:
        return 32
    if bs < 16 << 20:
        return 4
    return 1


def _default_size(bs: int) -> int:
    return 128 << 20 if bs >= 16 << 20 else 32 << 20 if bs <= 4 << 10 else 64 << 20


def _job(
    rw: str, bs: int, batch: int, iodepth: int, size: int, ns: argparse.Namespace, time_based: bool
) -> Workload:
    rw_t: RW = rw  # type: ignore[assignment]
    runtime = ns.runtime if ns.runtime is not None else DEFAULT_RUNTIME_S
    chain = ns.prefix_chain if rw in ("read", "randread") else None
    if chain is not None:
        batch = chain
    nkeys = max(batch, size // bs)
    if chain is not None:
        nkeys = max(chain, nkeys // chain * chain)
    name = f"{rw}-{human_bs(bs)}-b{batch}" + (f"-chain{chain}" if chain else "")
    return Workload(
        name=name,
        rw="read" if chain is not None else rw_t,
        bs=bs,
        batch=batch,
        iodepth=iodepth,
        nkeys=nkeys,
        runtime_s=runtime,
        time_based=time_based,
        ramp_time_s=ns.ramp_time,
        rwmixread=ns.rwmixread,
        key_prefix=f"kvfs-bench/{name}/".encode(),
        prefill_timeout_s=max(120.0, 4 * runtime),
        grace_s=30.0,
    )


def build_workloads(ns: argparse.Namespace) -> list[Workload]:
    """The jobs to run: ``--rw`` x ``--bs``, or the default job set when neither is given."""
    if ns.rw is None and ns.bs is None:
        # the default job set is time based unless --size alone bounds it
        tb = ns.time_based or ns.size is None
        return [
            _job(
                rw,
                bs,
                ns.batch or batch,
                ns.iodepth or qd,
                ns.size or size,
                ns,
                tb,
            )
            for rw, bs, batch, qd, size in DEFAULT_JOBS
        ]
    rws = ns.rw or ["randread"]
    bss = ns.bs or [4 << 10]
    return [
        _job(
            rw,
            bs,
            ns.batch or _default_batch(bs),
            ns.iodepth or (2 if bs >= 1 << 20 else 4),
            ns.size or _default_size(bs),
            ns,
            ns.time_based,
        )
        for rw in rws
        for bs in bss
    ]


# ---------------------------------------------------------------------------
# store adapters for kvfs


class KvfsBenchStore:
    """A kvfs client as a bench ``Store``: ``put_many``/``get_many`` per call."""

    def __init__(self, client: Any, name: str = "kvfs") -> None:
        self.name = name
        self.client = client

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        await self.client.put_many(items)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return list(await self.client.get_many(keys))

    async def close(self) -> None:
        await self.client.close()


class SingleGetStore(KvfsBenchStore):
    """A batch of B keys is read as B concurrent single-key ``get()`` calls."""

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self.client.get(k) for k in keys)))


class SeparatePutStore(KvfsBenchStore):
    """Writes every key with its own ``put()`` (one call per block)."""

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        for k, v in items:
            await self.client.put(k, v)


class ChainStore(KvfsBenchStore):
    """Writes each chain of ``n`` keys (by key index // n) with one ``put_many``."""

    def __init__(self, client: Any, n: int, name: str = "kvfs") -> None:
        super().__init__(client, name)
        self.n = n

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        chains: dict[int, list[tuple[bytes, bytes]]] = {}
        for k, v in items:
            chains.setdefault(int(k[-16:], 16) // self.n, []).append((k, v))
        await asyncio.gather(*(self.client.put_many(c) for c in chains.values()))


# ---------------------------------------------------------------------------
# the cluster under test


@dataclass
class BenchTarget:
    """Where the kvfs clients connect; server read counters when the cluster is ours."""

    addr: str
    token: str | None
    cluster: Any = None
    embedded: str = ""

    def client(self, **config: Any) -> Any:
        from kvfs.client import AsyncClient
        from kvfs.config import ClientConfig

        return AsyncClient(self.addr, token=self.token, config=ClientConfig(**config))

    def server_reads(self) -> list[tuple[int, int]] | None:
        """(spans_read, readv_calls) per chunkserver, for an in-process cluster."""
        css = getattr(self.cluster, "chunkservers", None)
        if self.embedded != "inproc" or not css:
            return None
        return [(cs.store.spans_read, cs.readv_calls) for cs in css if cs is not None]


@contextlib.asynccontextmanager
async def open_target(ns: argparse.Namespace, workdir: Path) -> AsyncIterator[BenchTarget]:
    if ns.addr is not None:
        yield BenchTarget(ns.addr, token_from_file(ns.token_file))
        return
    if ns.cluster == "processes":
        from kvfs.launcher import ProcessCluster

        pc = ProcessCluster(workdir / "cluster", 3, listen="127.0.0.1:0")
        await pc.start()
        try:
            yield BenchTarget(pc.addr, pc.token, pc, "processes")
        finally:
            await pc.stop()
        return
    from kvfs.launcher import LocalCluster

    lc = LocalCluster(workdir / "cluster", 3)
    await lc.start()
    try:
        yield BenchTarget(lc.addr, lc.token, lc, "inproc")
    finally:
        await lc.stop()


def _store_for(target: BenchTarget, wl: Workload, ns: argparse.Namespace) -> Store:
    client = target.client()
    if ns.prefix_chain and wl.reads:
        return ChainStore(client, ns.prefix_chain)
    return KvfsBenchStore(client)


# ---------------------------------------------------------------------------
# running


def _say(ns: argparse.Namespace, msg: str) -> None:
    if ns.output_format == "normal":
        print(msg, file=sys.stderr, flush=True)


async def _run_one(target: BenchTarget, wl: Workload, ns: argparse.Namespace) -> JobResult:
    store = _store_for(target, wl, ns)
    try:
        return await run_workload(store, wl, progress=ns.progress)
    finally:
        await store.close()


def _child_argv(target: BenchTarget, wl: Workload, ns: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "kvfs", "bench", "--addr", target.addr,
            "--output-format", "json", "--no-progress", "--job-spec", json.dumps(workload_dict(wl))]
    if ns.prefix_chain:
        argv += ["--prefix-chain", str(ns.prefix_chain)]
    return argv


async def _run_numjobs(target: BenchTarget, wl: Workload, ns: argparse.Namespace) -> list[dict[str, Any]]:
    """``numjobs`` client processes, each its own key space; their fio jobs, in order."""
    procs = []
    for i in range(ns.numjobs):
        job = replace(wl, name=f"{wl.name}.{i}", key_prefix=wl.key_prefix + b"%d/" % i, seed=wl.seed + i)
        env = {**os.environ, "KVFS_TOKEN": target.token} if target.token else None
        procs.append(await asyncio.create_subprocess_exec(  # the token in env, never on argv
            *_child_argv(target, job, ns), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env))
    jobs: list[dict[str, Any]] = []
    limit = wl.prefill_timeout_s + wl.ramp_time_s + wl.runtime_s + wl.grace_s
    for i, proc in enumerate(procs):
        out, err = await asyncio.wait_for(proc.communicate(), limit)
        if proc.returncode != 0:
            raise BenchError(f"job {wl.name}.{i} exited {proc.returncode}: {err.decode()[-2000:]}")
        jobs.extend(json.loads(out)["jobs"])
    for n, fio_job in enumerate(jobs):
        fio_job["groupid"] = 0
        fio_job["job"] = n
    return jobs


async def _child(ns: argparse.Namespace) -> int:
    d = json.loads(ns.job_spec)
    d["key_prefix"] = d["key_prefix"].encode("latin-1")
    wl = Workload(**d)
    target = BenchTarget(ns.addr, token_from_file(ns.token_file))
    res = await _run_one(target, wl, ns)
    print(json.dumps(report_json([res.to_json()])))
    return 0


def _options_of(ns: argparse.Namespace) -> dict[str, str]:
    out = {"numjobs": str(ns.numjobs)}
    if ns.addr is None:
        out["cluster"] = f"embedded {ns.cluster}, 3 chunkservers"
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
    if ns.gc:
        return await _gc_bench(ns)
    if ns.compare and ns.numjobs != 1:
        print("kvfs bench: --compare runs 1 client process (numjobs=1)", file=sys.stderr)
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
                where = f"embedded {target.embedded} cluster, 3 chunkservers" if target.embedded else target.addr
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
                c = target.cluster
                data = getattr(c, "data", None) or getattr(c, "root", None)
                report = await run_gc_bench(ns, target.addr, target.token, data,
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
    for i, wl in enumerate(workloads, 1):
        _say(ns, f"[{i}/{len(workloads)}] {describe(wl)} size={human_bs(wl.size_bytes)} "
                 f"runtime={wl.runtime_s:g}s")
        if ns.numjobs == 1:
            jobs.append((await _run_one(target, wl, ns)).to_json())
        else:
            jobs.extend(await _run_numjobs(target, wl, ns))
    report = report_json(jobs, global_options=_options_of(ns))
    _emit(ns, report, sys.stdout)
    if ns.plot is not None:
        plot(report["jobs"], ns.plot)
        _say(ns, f"plot written to {ns.plot}")
    return 0


def _emit(ns: argparse.Namespace, report: dict[str, Any], out: TextIO) -> None:
    if ns.output_format == "json":
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        out.write(format_report_text(report))
    out.flush()


# ---------------------------------------------------------------------------
# --compare


@dataclass
class ChainReads:
    """Server reads while a chain workload read: per server (spans, readv calls)."""

    calls: int = 0
    before: list[tuple[int, int]] | None = None
    after: list[tuple[int, int]] | None = None

    def per_chain(self) -> list[tuple[float, float]] | None:
        if not self.calls or self.before is None or self.after is None:
            return None
        return [((a[0] - b[0]) / self.calls, (a[1] - b[1]) / self.calls)
                for a, b in zip(self.after, self.before, strict=True)]


class _CountingStore:
    """Wraps a store; snapshots server read counters at the first read and on close."""

    def __init__(self, inner: KvfsBenchStore, snap: Callable[[], list[tuple[int, int]] | None],
                 reads: ChainReads) -> None:
        self.name = inner.name
        self._inner = inner
        self._snap = snap
        self._reads = reads

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        await self._inner.put_many(items)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if self._reads.before is None:
            self._reads.before = self._snap()
        self._reads.calls += 1
        return await self._inner.get_many(keys)

    async def close(self) -> None:
        self._reads.after = self._snap()
        await self._inner.close()


@dataclass
class Internal:
    """The kvfs-internal comparisons of ``--compare``."""

    batcher: Comparison | None = None
    chains: Comparison | None = None
    chain_reads: dict[str, ChainReads] = field(default_factory=dict)


async def _compare(
    ns: argparse.Namespace, target: BenchTarget, workloads: list[Workload], workdir: Path
) -> int:
    def kvfs_factory() -> StoreFactory:
        async def make() -> Store:
            return KvfsBenchStore(target.client())

        return make

    factories: dict[str, StoreFactory] = {"kvfs": kvfs_factory(), **peer_factories(workdir)}
    import shutil

    fio_dir = workdir / "fio" if shutil.which("fio") else None
    text_out = sys.stderr if ns.output_format == "normal" else None
    _say(ns, "peers: redis (TCP, MSET/MGET), file-per-key, loopback socket limit, fio psync"
             + ("" if fio_dir else " (fio not installed: skipped)"))
    comp = await compare(factories, workloads, fio_dir=fio_dir, progress=ns.progress,
                         text_out=text_out)
    if fio_dir is None:  # show fio as skipped rather than leaving the column out
        comp.stores.append("fio-psync")
        for wl in workloads:
            comp.cells[(wl.name, "fio-psync")] = Cell("fio-psync", skipped="fio not installed")
    internal = await _internal(ns, target)
    if ns.output_format == "json":
        jobs = [comp.cell(wl, "kvfs").result.to_json() for wl in workloads  # type: ignore[union-attr]
                if comp.cell(wl, "kvfs").result is not None]
        report = report_json(jobs, global_options=_options_of(ns))
        report["kvfs compare"] = {
            "peers": comp.to_json(),
            "batcher": internal.batcher.to_json() if internal.batcher else None,
            "prefix_chains": internal.chains.to_json() if internal.chains else None,
            "server_reads_per_chain": {k: v.per_chain() for k, v in internal.chain_reads.items()},
        }
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(render_compare(comp, internal))
    sys.stdout.flush()
    if ns.plot is not None:
        jobs = [c.result.to_json() for (_, s), c in comp.cells.items() if s == "kvfs" and c.result]
        plot(jobs, ns.plot)
        _say(ns, f"plot written to {ns.plot}")
    return 0


async def _internal(
    ns: argparse.Namespace, target: BenchTarget, *, nchains: int = 32, get_keys: int = 8192
) -> Internal:
    runtime = ns.runtime if ns.runtime is not None else DEFAULT_RUNTIME_S
    out = Internal()
    # 1. 128 concurrent single-key get(): batcher on vs off
    wl = Workload(name="get128", rw="randread", bs=4 << 10, batch=128, iodepth=1, nkeys=max(128, get_keys),
                  runtime_s=runtime, key_prefix=b"kvfs-bench/get128/", prefill_timeout_s=120.0)

    def single(batch: bool) -> StoreFactory:
        async def make() -> Store:
            return SingleGetStore(target.client(batch=batch))

        return make

    _say(ns, "kvfs internal: 128 concurrent get(), batcher on vs ClientConfig(batch=False)")
    out.batcher = await compare({"batcher on": single(True), "batch=False": single(False)}, [wl],
                                progress=ns.progress)
    # 2. prefix chains of 64 x 64 KiB: one put_many per chain, read per chain,
    #    vs the same blocks by separate puts, read at random
    n = CHAIN_BLOCKS
    nkeys = n * nchains
    chain_wl = Workload(name=f"chains-{n}x64k", rw="read", bs=CHAIN_BS, batch=n, iodepth=1,
                        nkeys=nkeys, runtime_s=runtime, key_prefix=b"kvfs-bench/chain/",
                        prefill_timeout_s=300.0)
    sep_wl = replace(chain_wl, rw="randread", key_prefix=b"kvfs-bench/sep/")
    comp = Comparison(stores=["chain put_many", "separate puts"], workloads=[chain_wl])
    _say(ns, f"kvfs internal: prefix chains {n} x 64KiB, per-chain put_many+read vs separate puts+random reads")
    for label, w, inner in (
        ("chain put_many", chain_wl, ChainStore(target.client(), n)),
        ("separate puts", sep_wl, SeparatePutStore(target.client())),
    ):
        reads = out.chain_reads[label] = ChainReads()
        store = _CountingStore(inner, target.server_reads, reads)
        try:
            res = await run_workload(store, w, progress=ns.progress)
            comp.cells[(chain_wl.name, label)] = Cell(label, result=res)
        except (BenchError, OSError) as e:
            comp.cells[(chain_wl.name, label)] = Cell(label, skipped=f"failed: {e}")
        finally:
            await store.close()
    out.chains = comp
    return out


def render_compare(comp: Comparison, internal: Internal) -> str:
    """One table kvfs / each peer / ratio per workload, then the kvfs-internal ones."""
    lines = ["", "kvfs vs peers (cells: keys/s, bandwidth, p99 per-key latency; ratio = kvfs keys/s / peer keys/s)",
             comp.table()]
    lines.append("MB/s ratios (kvfs MB/s / peer MB/s):")
    for wl in comp.workloads:
        kv = comp.cell(wl, "kvfs").bytes_per_s
        parts = []
        for peer in comp.stores[1:]:
            pb = comp.cell(wl, peer).bytes_per_s
            parts.append(f"{peer}={'-' if not kv or not pb else f'{kv / pb:.2f}x'}")
        lines.append(f"  {describe(wl)}: " + " ".join(parts))
    return "\n".join(lines) + "\n" + render_internal(internal)


def render_internal(internal: Internal) -> str:
    """The kvfs-internal comparisons: batcher on/off, prefix chains, server reads per chain."""
    lines: list[str] = []
    if internal.batcher is not None:
        lines += ["", "kvfs: 128 concurrent single-key get() (ratio = batcher on / batch=False keys/s)",
                  internal.batcher.table()]
    if internal.chains is not None:
        lines += ["", "kvfs: prefix chains of 64 x 64KiB (ratio = per-chain keys/s / separate-puts keys/s)",
                  internal.chains.table()]
        for label, reads in internal.chain_reads.items():
            pc = reads.per_chain()
            if pc is None:
                lines.append(f"  {label}: server reads per chain: n/a (needs the embedded in-process cluster)")
            else:
                cells = ", ".join(f"cs{i}: {s:.2f} spans / {r:.2f} readv" for i, (s, r) in enumerate(pc))
                lines.append(f"  {label}: server reads per read call of 64 blocks, per server: {cells}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# --plot


def plot(jobs: Sequence[dict[str, Any]], path: Path) -> None:
    """Throughput vs value size (per rw) and clat percentiles per job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_rw: dict[str, list[tuple[int, float]]] = {}
    for job in jobs:
        opts = job.get("job options", {})
        bs = int(opts.get("bs", 0))
        bw = sum(float(job[d]["bw_bytes"]) for d in ("read", "write"))
        by_rw.setdefault(opts.get("rw", "?"), []).append((bs, bw / 1e6))
        for d in ("read", "write"):
            pct = job[d].get("clat_ns", {}).get("percentile")
            if int(job[d].get("total_ios", 0)) and pct:
                xs = [float(k) for k in pct]
                ys = [v / 1e3 for v in pct.values()]
                ax2.plot(xs, ys, marker=".", label=f"{job['jobname']} {d}")
    for rw, pts in sorted(by_rw.items()):
        pts.sort()
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=rw)
    ax1.set(xscale="log", xlabel="value size (bytes)", ylabel="MB/s", title="throughput vs value size")
    ax2.set(yscale="log", xlabel="percentile", ylabel="clat (usec)", title="latency percentiles")
    ax1.legend()
    ax2.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
