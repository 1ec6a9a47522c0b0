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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from .jobs import describe
from .peers import FilePerKeyStore, LoopbackLimit, RedisStore, run_fio_file
from .runner import BenchError, JobResult, Workload, run_workload
from .stats import format_job_text, num2str, percentile_key, report_json
from .store import PeerUnavailable, Store

__all__ = [
    "Cell",
    "Comparison",
    "StoreFactory",
    "compare",
    "peer_factories",
]

StoreFactory = Callable[[], Awaitable[Store]]
FIO_COLUMN = "fio-psync"


def peer_factories(
    workdir: str | Path,
    *,
    redis_transport: Literal["tcp", "unix"] = "tcp",
    file_threads: int = 4,
    loopback_copy_out: bool = False,
) -> dict[str, StoreFactory]:
    """Factories for the baseline stores; each call makes a fresh, empty store.

    ``file`` stores its keys under ``workdir/file-per-key-<n>`` (a new dir per
    call). Add ``"kvfs": <factory>`` in front of these to make kvfs the subject.
    """
    root = Path(workdir)
    counter = itertools.count()

    async def file_store() -> Store:
        return FilePerKeyStore(root / f"file-per-key-{next(counter)}", threads=file_threads)

    async def redis_store() -> Store:
        return await RedisStore.open(transport=redis_transport)

    async def loopback() -> Store:
        return await LoopbackLimit.open(copy_out=loopback_copy_out)

    return {"file": file_store, "redis": redis_store, "loopback": loopback}


@dataclass
class Cell:
    """One workload against one store."""

    store: str
    result: JobResult | None = None
    fio: dict[str, Any] | None = None
    skipped: str | None = None

    @property
    def ios_per_s(self) -> float | None:
        if self.result is not None:
            return self.result.ios_per_s
        if self.fio is not None:
            job = self.fio["jobs"][0]
            return float(job["read"]["iops"]) + float(job["write"]["iops"])
        return None

    @property
    def bytes_per_s(self) -> float | None:
        if self.result is not None:
            return self.result.bytes_per_s
        if self.fio is not None:
            job = self.fio["jobs"][0]
            return float(job["read"]["bw_bytes"]) + float(job["write"]["bw_bytes"])
        return None

    def p99_ns(self) -> int | None:
        key = percentile_key(99.0)
        if self.result is not None:
            job = self.result.to_json()
        elif self.fio is not None:
            job = self.fio["jobs"][0]
        else:
            return None
        vals = [
            int(job[d]["clat_ns"]["percentile"][key])
            for d in ("read", "write")
            if int(job[d].get("total_ios", 0)) and "percentile" in job[d]["clat_ns"]
        ]
        return max(vals) if vals else None

    def text(self) -> str:
        if self.skipped is not None:
            return f"skipped: {self.skipped}"
        ios, bw, p99 = self.ios_per_s, self.bytes_per_s, self.p99_ns()
        if ios is None or bw is None:
            return "-"
        s = f"{num2str(int(ios))}/s {num2str(int(bw), pow2=True, unit='B/s')}"
        if p99 is not None:
            s += f" p99={_fmt_ns(p99)}"
        return s


def _fmt_ns(ns: int) -> str:
    if ns >= 10_000_000:
        return f"{ns / 1e6:.0f}ms"
    if ns >= 1_000_000:
        return f"{ns / 1e6:.1f}ms"
    if ns >= 10_000:
        return f"{ns / 1e3:.0f}us"
    return f"{ns / 1e3:.1f}us"


@dataclass
class Comparison:
    """Every (workload, store) cell of one comparison run."""

    stores: list[str]
    workloads: list[Workload]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)

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
        """workload | subject | peer | subject/peer | peer | subject/peer ..."""
        head = ["workload", self.subject]
        for peer in self.stores[1:]:
            head += [peer, f"{self.subject}/{peer}"]
        rows = [head]
        for wl in self.workloads:
            row = [describe(wl), self.cell(wl, self.subject).text()]
            for peer in self.stores[1:]:
                r = self.ratio(wl, peer)
                row += [self.cell(wl, peer).text(), "-" if r is None else f"{r:.2f}x"]
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines) + "\n"

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
        return {"subject": self.subject, "stores": stores, "ratios": ratios}


async def compare(
    factories: Mapping[str, StoreFactory],
    workloads: Sequence[Workload],
    *,
    fio_dir: str | Path | None = None,
    progress: bool | None = None,
    out: TextIO | None = None,
    text_out: TextIO | None = None,
) -> Comparison:
    """Run every workload against every store (a fresh store per workload).

    The first factory is the subject. A factory raising ``PeerUnavailable`` is
    skipped, once, for all workloads; a run that fails is shown as
    ``skipped: failed: ...``. With ``fio_dir`` a ``fio-psync`` column runs the
    real fio on a file of the same size there (``bs`` = value size, no
    batching). The table is printed to ``out`` if given; fio's text blocks of
    each job to ``text_out`` if given.
    """
    if not factories:
        raise ValueError("compare needs at least one store factory")
    names = list(factories)
    if fio_dir is not None:
        names.append(FIO_COLUMN)
    comp = Comparison(stores=names, workloads=list(workloads))
    unavailable: dict[str, str] = {}
    for wl in workloads:
        for name, factory in factories.items():
            if name in unavailable:
                comp.cells[(wl.name, name)] = Cell(name, skipped=unavailable[name])
                continue
            comp.cells[(wl.name, name)] = cell = await _run_cell(name, factory, wl, progress)
            if cell.skipped is not None and not cell.skipped.startswith("failed"):
                unavailable[name] = cell.skipped
            if text_out is not None and cell.result is not None:
                text_out.write(f"[{name}] " + format_job_text(cell.result.to_json()) + "\n")
        if fio_dir is not None:
            comp.cells[(wl.name, FIO_COLUMN)] = await _fio_cell(wl, Path(fio_dir), unavailable)
    if out is not None:
        out.write(comp.table())
        out.flush()
    return comp


async def _run_cell(name: str, factory: StoreFactory, wl: Workload, progress: bool | None) -> Cell:
    try:
        store = await factory()
    except PeerUnavailable as e:
        return Cell(name, skipped=e.reason)
    try:
        result = await run_workload(store, wl, progress=progress)
        return Cell(name, result=result)
    except (BenchError, OSError, RuntimeError, ValueError) as e:
        return Cell(name, skipped=f"failed: {type(e).__name__}: {e}")
    finally:
        await store.close()


async def _fio_cell(wl: Workload, fio_dir: Path, unavailable: dict[str, str]) -> Cell:
    if FIO_COLUMN in unavailable:
        return Cell(FIO_COLUMN, skipped=unavailable[FIO_COLUMN])
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
            extra_args=[f"--rwmixread={wl.rwmixread}"] if wl.rw == "randrw" else (),
        )
    except PeerUnavailable as e:
        if "not installed" in e.reason:
            unavailable[FIO_COLUMN] = e.reason
        return Cell(FIO_COLUMN, skipped=e.reason)
    return Cell(FIO_COLUMN, fio=res)
