"""Run the same workloads against several stores in one run and collect every cell.

The first store is the *subject* (kvfs); every other store is a peer and gets
a ``subject/peer`` ratio. A peer that cannot run here shows
``skipped: <reason>``. ``kvfs bench --compare`` drives this.

Each cell is keys/s (one key = one io), bandwidth, and the p99 of per-key
latency (= the latency of the call that carried the key).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TextIO

from .cpu import CpuProbe
from .jobs import API_SUFFIX, human_bs
from .options import MAX_REPEAT
from .peers import FilePerKeyStore, LoopbackLimit, MooncakeStore, RedisStore, run_fio_file
from .runner import LOOKUP_APIS, BenchError, JobResult, Workload, run_workload
from .stats import format_job_text, format_mem_free, num2str, percentile_key, report_json
from .store import PeerUnavailable, Store

__all__ = [
    "FIO_COLUMN",
    "Cell",
    "Comparison",
    "StoreFactory",
    "compare",
    "fio_write_args",
    "median_cell",
    "peer_factories",
    "short_name",
]

StoreFactory = Callable[[], Awaitable[Store]]
PASSES_PER_TABLE = 6  # pass columns per block of Comparison.passes_table (100 columns)
#: passes_table's figures: the Cell field that holds each pass's
_PASS_FIGURES = {"keys": "passes", "cpu": "passes_cpu", "mem": "passes_mem"}
#: the real fio on one file (psync, bs = the value size): reads from the page cache, as the other
#: stores' do; writes fdatasync once per batch of values (``fio_write_args``)
FIO_COLUMN = "fio"


def peer_factories(
    workdir: str | Path,
    *,
    redis_transport: Literal["tcp", "unix"] = "tcp",
    file_threads: int = 4,
    loopback_copy_out: bool = False,
) -> dict[str, StoreFactory]:
    """Factories for the baseline stores; each call makes a fresh, empty store.

    ``file`` stores its keys under ``workdir/file-per-key-<n>``, a new dir per call; the
    dirs of the calls before (their cells over, their stores closed) are removed first, so
    their unlinks cost the file cell's set-up, not the timed cell of the peer after it (as
    kvfs's ``--reclaim`` runs before its own cell). Add ``"kvfs": <factory>`` in front of
    these to make kvfs the subject.
    """
    root = Path(workdir)
    counter = itertools.count()
    made: list[Path] = []

    async def file_store() -> Store:
        while made:
            await asyncio.to_thread(shutil.rmtree, made.pop(), ignore_errors=True)
        made.append(root / f"file-per-key-{next(counter)}")
        return FilePerKeyStore(made[-1], threads=file_threads)

    async def redis_store() -> Store:
        return await RedisStore.open(transport=redis_transport)

    async def loopback() -> Store:
        return await LoopbackLimit.open(copy_out=loopback_copy_out)

    async def mooncake_store() -> Store:
        return await MooncakeStore.open()

    return {"file": file_store, "redis": redis_store, "mooncake": mooncake_store, "loopback": loopback}


@dataclass
class Cell:
    """One workload against one store."""

    store: str
    result: JobResult | None = None
    fio: dict[str, Any] | None = None
    skipped: str | None = None
    unavailable: bool = False  # skipped because the store cannot run here (not this workload)
    # with ``compare(repeat=N)``: keys/s of every pass, in the order they ran (None: that pass
    # did not run it), and (``--cpu``) the client's CPU us per key; the cell is the median pass
    passes: list[float | None] = field(default_factory=list)
    passes_cpu: list[float | None] = field(default_factory=list)
    passes_mem: list[list[int | None] | None] = field(default_factory=list)  # mem_free_mib's

    @property
    def client_us_per_key(self) -> float | None:
        """The bench process's CPU per key over the measured phase (``--cpu``), or None."""
        cpu = self.result.extra.get("cpu") if self.result is not None else None
        client = cpu.get("client") if cpu else None
        return None if not client else client.get("us_per_key")

    @property
    def mem_free_mib(self) -> list[int | None] | None:
        """MemFree (MiB) at the start and end of the measured phase (``--cpu``), or None."""
        return self.result.extra.get("mem_free_mib") if self.result is not None else None

    @property
    def ios_per_s(self) -> float | None:
        return self.result.ios_per_s if self.result is not None else self._fio_sum("iops")

    @property
    def bytes_per_s(self) -> float | None:
        return self.result.bytes_per_s if self.result is not None else self._fio_sum("bw_bytes")

    def _fio_sum(self, field: str) -> float | None:
        """fio's read + write figure of ``field`` (fio measures both sides of a randrw)."""
        if self.fio is None:
            return None
        job = self.fio["jobs"][0]
        return float(job["read"][field]) + float(job["write"][field])

    def _job(self) -> dict[str, Any] | None:
        if self.result is not None:
            return self.result.to_json()
        if self.fio is not None:
            job: dict[str, Any] = self.fio["jobs"][0]
            return job
        return None

    def p99_ns(self, field: str = "clat_ns") -> int | None:
        """p99 per key (``clat_ns``) or per call (``call_lat_ns``; fio's one-io calls: ``clat_ns``)."""
        job = self._job()
        if job is None:
            return None
        key = percentile_key(99.0)
        vals = []
        for d in ("read", "write"):
            if not int(job[d].get("total_ios", 0)):
                continue
            lat = job[d].get(field) or job[d]["clat_ns"]
            if "percentile" in lat:
                vals.append(int(lat["percentile"][key]))
        return max(vals) if vals else None

    def row(self) -> list[str]:
        """keys/s, MB/s, p99 per key, p99 per call; or the reason it was skipped."""
        if self.skipped is not None:
            return [f"skipped: {self.skipped}"]
        ios, bw = self.ios_per_s, self.bytes_per_s
        if ios is None or bw is None:
            return ["-"]
        mbs = "-" if bw == 0 and ios > 0 else f"{bw / 1e6:.0f}" if bw >= 1e8 else f"{bw / 1e6:.1f}"
        return [num2str(int(ios)), mbs,
                _fmt_opt(self.p99_ns("clat_ns")), _fmt_opt(self.p99_ns("call_lat_ns"))]


def _fmt_opt(ns: int | None) -> str:
    return "-" if ns is None else _fmt_ns(ns)


def _fmt_ns(ns: int) -> str:
    if ns >= 10_000_000:
        return f"{ns / 1e6:.0f}ms"
    if ns >= 1_000_000:
        return f"{ns / 1e6:.1f}ms"
    if ns >= 10_000:
        return f"{ns / 1e3:.0f}us"
    return f"{ns / 1e3:.1f}us"


def _grid(head: list[str], rows: list[list[str]], right: tuple[int, ...] = ()) -> str:
    """Columns two spaces apart; a short row's last cell runs on past the columns it lacks."""
    n = len(head)
    widths = [max([len(head[i])] + [len(r[i]) for r in rows if len(r) == n]) for i in range(n)]

    def line(r: list[str]) -> str:
        cells = [c.rjust(widths[i]) if i in right and len(r) == n else c.ljust(widths[i])
                 for i, c in enumerate(r)]
        if len(r) < n:
            cells[-1] = r[-1]
        return "  ".join(cells).rstrip()

    return "\n".join([line(head), *(line(r) for r in rows)]) + "\n"


def short_name(wl: Workload) -> str:
    """``randread 4k b128 qd4``: what a row or a progress line calls a workload."""
    api = API_SUFFIX[wl.api].replace("-", " ") if wl.reads else ""
    return f"{wl.rw} {human_bs(wl.bs)} b{wl.batch} qd{wl.iodepth}{api}"


@dataclass
class Comparison:
    """Every (workload, store) cell of one comparison run."""

    stores: list[str]
    workloads: list[Workload]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    repeat: int = 1  # passes per cell (each cell the median one)

    @property
    def subject(self) -> str:
        return self.stores[0]

    def cell(self, workload: Workload | str, store: str) -> Cell:
        name = workload if isinstance(workload, str) else workload.name
        return self.cells[(name, store)]

    def ratio(self, workload: Workload | str, peer: str) -> float | None:
        """subject keys/s divided by peer keys/s (None when either is missing)."""
        a = self.cell(workload, self.subject).ios_per_s
        b = self.cell(workload, peer).ios_per_s
        if a is None or b is None or b <= 0:
            return None
        return a / b

    def table(self) -> str:
        """One row per workload and store: keys/s, MB/s, p99 per key and per call, subject/store."""
        head = ["workload", "store", "keys/s", "MB/s", "p99/key", "p99/call", f"{self.subject}/x"]
        rows: list[list[str]] = []
        for wl in self.workloads:
            for i, store in enumerate(self.stores):
                cell = self.cell(wl, store)
                r = None if i == 0 else self.ratio(wl, store)
                cells = cell.row()
                if len(cells) == 1:  # skipped: the reason spans the figure columns
                    rows.append([short_name(wl) if i == 0 else "", store, cells[0]])
                    continue
                rows.append([short_name(wl) if i == 0 else "", store, *cells,
                             "" if i == 0 else "-" if r is None else f"{r:.2f}x"])
        return _grid(head, rows, right=(2, 3, 4, 5, 6))

    def ratio_table(self) -> str:
        """workload x peer: subject keys/s / peer keys/s (= the MB/s ratio: same value size)."""
        head = ["workload", *(f"/{p}" for p in self.stores[1:])]
        rows = []
        for wl in self.workloads:
            rs = [self.ratio(wl, p) for p in self.stores[1:]]
            rows.append([short_name(wl), *("-" if r is None else f"{r:.2f}x" for r in rs)])
        return _grid(head, rows, right=tuple(range(1, len(head))))

    def to_json(self) -> dict[str, Any]:
        """Per store, a fio-shaped report of its jobs; skipped cells listed apart."""
        stores: dict[str, Any] = {}
        for store in self.stores:
            jobs: list[dict[str, Any]] = []
            skipped: dict[str, str] = {}
            for wl in self.workloads:
                c = self.cell(wl, store)
                if c.result is not None:
                    jobs.append(c.result.to_json())
                elif c.fio is not None:
                    jobs.extend(c.fio.get("jobs", []))
                elif c.skipped is not None:
                    skipped[wl.name] = c.skipped
            stores[store] = {"report": report_json(jobs), "skipped": skipped}
        ratios = {wl.name: {p: self.ratio(wl, p) for p in self.stores[1:]} for wl in self.workloads}
        out: dict[str, Any] = {"subject": self.subject, "stores": stores, "ratios": ratios}
        if self.repeat > 1:
            out["repeat"] = self.repeat
            out["passes"] = {wl.name: {s: self.cell(wl, s).passes for s in self.stores}
                             for wl in self.workloads}
            out["passes_client_us_per_key"] = {
                wl.name: {s: self.cell(wl, s).passes_cpu for s in self.stores} for wl in self.workloads}
            out["passes_mem_free_mib"] = {
                wl.name: {s: self.cell(wl, s).passes_mem for s in self.stores} for wl in self.workloads}
        return out

    def passes_table(self, what: Literal["keys", "cpu", "mem"] = "keys") -> str:
        """With ``repeat`` > 1: each cell's keys/s in every pass, in the order they ran
        (``*``: the median one, shown in the tables), or the client's CPU us per key of every
        pass (``cpu``), or MemFree at its start and end (``mem``) (cells measured with
        ``--cpu`` only); "" otherwise."""
        if self.repeat < 2:
            return ""
        blocks = []
        for at in range(0, self.repeat, PASSES_PER_TABLE):  # within 100 columns
            cols = range(at, min(at + PASSES_PER_TABLE, self.repeat))
            head = ["workload", "store", *(f"pass {i + 1}" for i in cols)]
            rows: list[list[str]] = []
            for wl in self.workloads:
                first = True
                for store in self.stores:
                    cell = self.cell(wl, store)
                    xs: Sequence[Any] = getattr(cell, _PASS_FIGURES[what])
                    if not any(x is not None for x in xs):
                        continue
                    rows.append([short_name(wl) if first else "", store, *(
                        _pass_text(xs[i], what, cell.ios_per_s) for i in cols)])
                    first = False
            if rows:
                blocks.append(_grid(head, rows, right=tuple(range(2, len(head)))))
        return "\n".join(blocks)


async def compare(
    factories: Mapping[str, StoreFactory],
    workloads: Sequence[Workload],
    *,
    fio_dir: str | Path | None = None,
    progress: bool | None = None,
    out: TextIO | None = None,
    text_out: TextIO | None = None,
    cpu: bool = False,
    repeat: int = 1,
    before_cell: Callable[[str], Awaitable[None]] | None = None,
) -> Comparison:
    """Run every workload against every store (a fresh store per workload).

    The first factory is the subject. A factory raising ``PeerUnavailable`` is
    skipped, once, for all workloads; a run that fails is shown as
    ``skipped: failed: ...``. With ``fio_dir`` a ``fio`` column runs the
    real fio on a file of the same size there (``bs`` = value size, psync; a
    write job fdatasyncs after each ``batch`` writes: ``fio_write_args``). The
    table is printed to ``out`` if given; fio's text blocks of
    each job to ``text_out`` if given. With ``cpu`` each cell also records the
    CPU time of this process and of the store's processes (``--cpu``).

    ``before_cell(store)`` (if given) is awaited right before each cell of a store (not fio's,
    nor one found unavailable) (``kvfs bench --reclaim``: what the earlier kvfs cells wrote
    deleted before a kvfs cell, which so pays for its own reclaim).

    ``repeat``: every cell runs that many times, in passes; every other pass runs the
    workloads, and the stores of each, in the reverse order, so no store (e.g. the
    blocking kvfs client, listed after the async one) and no workload (e.g. ``get_into``,
    listed after ``get_many``) always runs after the other: jobs run one after another on
    one cluster are not alike (bench/RESULTS.md, "position").  A cell is then the pass
    with the median keys/s (of those that ran; for an even count the lower of the two
    middle ones), and :attr:`Cell.passes` keeps each pass's keys/s.
    """
    if not factories:
        raise ValueError("compare needs at least one store factory")
    if not 1 <= repeat <= MAX_REPEAT:
        raise ValueError(f"repeat must be 1..{MAX_REPEAT}, got {repeat}")
    names = list(factories)
    if fio_dir is not None:
        names.append(FIO_COLUMN)
    comp = Comparison(stores=names, workloads=list(workloads), repeat=repeat)
    unavailable: dict[str, str] = {}
    runs: dict[tuple[str, str], list[Cell]] = {}
    total = repeat * len(workloads) * len(names)
    n = 0
    t0 = time.monotonic()
    for p in range(repeat):
        forward = p % 2 == 0
        for wl in workloads if forward else workloads[::-1]:
            if fio_dir is not None and not forward:
                n += 1
                runs.setdefault((wl.name, FIO_COLUMN), []).append(
                    await _fio_cell(wl, Path(fio_dir), unavailable))
            for name in names[:len(factories)] if forward else names[len(factories) - 1::-1]:
                n += 1
                if name in unavailable:
                    runs.setdefault((wl.name, name), []).append(Cell(name, skipped=unavailable[name]))
                    continue
                # ETA: the cells still to run at the mean wall time of the cells run so far
                per_cell = (time.monotonic() - t0) / (n - 1) if n > 1 else wl.ramp_time_s + wl.runtime_s
                label = f"[{n}/{total}] {name} {wl.rw} {human_bs(wl.bs)}"
                if before_cell is not None:
                    await before_cell(name)
                cell = await _run_cell(name, factories[name], wl, progress, label,
                                       per_cell * (total - n), cpu)
                runs.setdefault((wl.name, name), []).append(cell)
                if cell.skipped is not None and cell.unavailable:  # the peer cannot run here at all
                    unavailable[name] = cell.skipped
                if text_out is not None and cell.result is not None:
                    text_out.write(f"[{name}] " + format_job_text(cell.result.to_json()) + "\n")
            if fio_dir is not None and forward:
                n += 1
                runs.setdefault((wl.name, FIO_COLUMN), []).append(
                    await _fio_cell(wl, Path(fio_dir), unavailable))
    for key, cells in runs.items():
        comp.cells[key] = median_cell(cells) if repeat > 1 else cells[0]
    if out is not None:
        out.write(comp.table())
        out.flush()
    return comp


def _pass_text(x: Any, what: str, median: float | None) -> str:
    """One pass's figure in :meth:`Comparison.passes_table`."""
    if x is None:
        return "-"
    if what == "cpu":
        return f"{x:.2f}"
    if what == "mem":
        return format_mem_free(x)
    return num2str(int(x)) + "*" * (x == median)


def median_cell(cells: Sequence[Cell]) -> Cell:
    """Of one cell's passes, the one with the median keys/s (the lower middle one of an even
    count), with every pass's keys/s in :attr:`Cell.passes`; the first pass if none ran."""
    ran = sorted((c for c in cells if c.ios_per_s is not None), key=lambda c: c.ios_per_s or 0.0)
    chosen = ran[(len(ran) - 1) // 2] if ran else cells[0]
    return replace(chosen, passes=[c.ios_per_s for c in cells],
                   passes_cpu=[c.client_us_per_key for c in cells],
                   passes_mem=[c.mem_free_mib for c in cells])


def store_cpu_probe(store: Store) -> CpuProbe:
    """This process as ``client`` plus the store's own processes (``pids()``), if it names any."""
    pids = getattr(store, "pids", None)
    return CpuProbe({"client": os.getpid(), **(pids() if pids is not None else {})})


async def _run_cell(name: str, factory: StoreFactory, wl: Workload, progress: bool | None,
                    label: str | None = None, eta_after_s: float = 0.0, cpu: bool = False) -> Cell:
    try:
        store = await factory()
    except PeerUnavailable as e:
        return Cell(name, skipped=e.reason, unavailable=True)
    if wl.reads and not hasattr(store, wl.api):
        await store.close()
        return Cell(name, skipped=f"no {wl.api} API")
    try:
        result = await run_workload(store, wl, progress=progress, label=label, eta_after_s=eta_after_s,
                                    cpu=store_cpu_probe(store) if cpu else None)
        return Cell(name, result=result)
    except (BenchError, OSError, RuntimeError, ValueError) as e:
        return Cell(name, skipped=f"failed: {type(e).__name__}: {e}")
    finally:
        await store.close()


def fio_write_args(wl: Workload) -> list[str]:
    """fio's extra options for ``wl``: a job that writes fdatasyncs after every ``batch`` writes.

    That is the disk's write rate under kvfs's default durability (``--fsync batch``): a
    put_many is answered once its values are on disk (one fdatasync per chunk file the
    call wrote), so the fio job, too, writes one batch of values and syncs them before it
    goes on. Without the sync fio's buffered writes land in the page cache and measure
    memory copies, not the disk.
    """
    args = [f"--rwmixread={wl.rwmixread}"] if wl.rw == "randrw" else []
    if wl.writes:
        args.append(f"--fdatasync={wl.batch}")
    return args


async def _fio_cell(wl: Workload, fio_dir: Path, unavailable: dict[str, str]) -> Cell:
    if FIO_COLUMN in unavailable:
        return Cell(FIO_COLUMN, skipped=unavailable[FIO_COLUMN])
    if wl.api == "get_into" and wl.reads:
        return Cell(FIO_COLUMN, skipped="see the get_many row (fio reads into its buffers)")
    if wl.api in LOOKUP_APIS and wl.reads:
        return Cell(FIO_COLUMN, skipped="no key lookups in fio")
    fio_dir.mkdir(parents=True, exist_ok=True)
    try:
        res = await asyncio.to_thread(
            run_fio_file,
            wl.bs,
            wl.size_bytes,
            wl.rw,
            wl.runtime_s,
            fio_dir,
            name=wl.name,
            ramp_time_s=wl.ramp_time_s,
            time_based=wl.time_based,
            extra_args=fio_write_args(wl),
        )
    except PeerUnavailable as e:
        if "not installed" in e.reason:
            unavailable[FIO_COLUMN] = e.reason
        return Cell(FIO_COLUMN, skipped=e.reason)
    return Cell(FIO_COLUMN, fio=res)
