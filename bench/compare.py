"""Run the same workloads against several stores in one run and print one table.

The first store is the *subject* (kvfs, once its adapter is plugged in); every
other store is a peer and gets a ``subject/peer`` ratio column. A peer that
cannot run here shows ``skipped: <reason>``.

    python -m kvfs.bench --stores file,redis,loopback --rw randread,randwrite \\
        --bs 4k,64k --batch 128 --iodepth 4 --runtime 5 --fio

Each cell is keys/s (one key = one io), bandwidth, and the p99 of per-key
latency (= the latency of the call that carried the key).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

from kvfs.units import parse_duration, parse_size

from .peers import FilePerKeyStore, LoopbackLimit, PeerUnavailable, RedisStore, Store, run_fio_file
from .runner import RW, BenchError, JobResult, Workload, run_workload
from .stats import format_job_text, num2str, percentile_key, report_json

__all__ = [
    "Cell",
    "Comparison",
    "KvfsClientLike",
    "KvfsStore",
    "StoreFactory",
    "compare",
    "human_bs",
    "kvfs_store",
    "main",
    "peer_factories",
]

StoreFactory = Callable[[], Awaitable[Store]]
FIO_COLUMN = "fio-psync"


class KvfsClientLike(Protocol):
    """The part of the kvfs client API the bench needs."""

    async def put_many(self, items: dict[bytes, bytes], /) -> Any: ...

    async def get_many(self, keys: list[bytes], /) -> Sequence[bytes | None]: ...


class KvfsStore:
    """Adapts a kvfs client (``put_many(dict)``, ``get_many(list)``) to ``Store``.

    ``close()`` leaves the client open unless ``close_client=True``: the caller
    that made the client usually owns it.
    """

    def __init__(self, client: KvfsClientLike, *, name: str = "kvfs", close_client: bool = False):
        self.name = name
        self.client = client
        self._close_client = close_client

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        await self.client.put_many(dict(items))

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return list(await self.client.get_many(keys))

    async def close(self) -> None:
        if self._close_client:
            closer = getattr(self.client, "close", None) or getattr(self.client, "aclose", None)
            if closer is not None:
                res = closer()
                if asyncio.iscoroutine(res):
                    await res


def kvfs_store(
    client: KvfsClientLike, *, name: str = "kvfs", close_client: bool = False
) -> KvfsStore:
    """Wrap a kvfs client as a bench ``Store``."""
    return KvfsStore(client, name=name, close_client=close_client)


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


def human_bs(nbytes: int, *, iec: bool = False) -> str:
    """fio-style block size: 4096 -> ``4k`` (``4KiB`` with ``iec``), 1048576 -> ``1m``."""
    for shift, short, long in ((30, "g", "GiB"), (20, "m", "MiB"), (10, "k", "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{long if iec else short}"
    return f"{nbytes}B" if iec else str(nbytes)


def describe(wl: Workload) -> str:
    return f"{wl.rw} bs={human_bs(wl.bs, iec=True)} batch={wl.batch} qd={wl.iodepth}"


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


# ---------------------------------------------------------------------------
# CLI

def _csv(conv: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        return [conv(t) for t in text.split(",") if t.strip()]

    return parse


def _rw(text: str) -> str:
    if text not in ("read", "randread", "write", "randwrite", "randrw"):
        raise argparse.ArgumentTypeError(f"unknown rw {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvfs.bench",
        description="fio-style comparison of kvfs with baseline stores (one key = one io).",
    )
    p.add_argument(
        "--stores",
        type=_csv(str),
        default=["file", "redis", "loopback"],
        help="comma list; the first is the subject (default: file,redis,loopback)",
    )
    p.add_argument("--rw", type=_csv(_rw), default=["randread", "randwrite"])
    p.add_argument("--bs", type=_csv(parse_size), default=[4096, 65536], help="value sizes, e.g. 4k,64k")
    p.add_argument("--batch", type=_csv(int), default=[128], help="keys per call")
    p.add_argument("--iodepth", type=_csv(int), default=[4], help="calls in flight")
    p.add_argument("--size", type=parse_size, default=64 << 20, help="key space bytes per job (64MiB)")
    p.add_argument("--runtime", type=parse_duration, default=5.0, help="seconds per job")
    p.add_argument("--ramp", type=parse_duration, default=0.0, help="ramp-up seconds (not measured)")
    p.add_argument("--dir", type=Path, default=None, help="work dir for file stores and fio")
    p.add_argument("--fio", action="store_true", help="add a column: real fio, psync, on a file")
    p.add_argument("--redis-transport", choices=("tcp", "unix"), default="tcp")
    p.add_argument("--json", type=Path, default=None, help="write all results as JSON here")
    p.add_argument("--text", action="store_true", help="print fio's text block for each job")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    return p  # fmt: skip


def workloads_from_args(args: argparse.Namespace) -> list[Workload]:
    out: list[Workload] = []
    for rw, bs, batch, qd in itertools.product(args.rw, args.bs, args.batch, args.iodepth):
        rw_t: RW = rw
        nkeys = max(batch, args.size // bs)
        out.append(
            Workload(
                name=f"{rw}-{human_bs(bs)}-b{batch}-qd{qd}",
                rw=rw_t,
                bs=bs,
                batch=batch,
                iodepth=qd,
                nkeys=nkeys,
                runtime_s=args.runtime,
                ramp_time_s=args.ramp,
            )
        )
    return out


async def _amain(args: argparse.Namespace, extra: Mapping[str, StoreFactory]) -> Comparison:
    with contextlib.ExitStack() as stack:
        workdir = args.dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfs-bench-"))
        )
        available = {**extra, **peer_factories(workdir, redis_transport=args.redis_transport)}
        unknown = [s for s in args.stores if s not in available]
        if unknown:
            raise BenchError(f"unknown store(s) {unknown}; available: {sorted(available)}")
        factories = {s: available[s] for s in args.stores}
        return await compare(
            factories,
            workloads_from_args(args),
            fio_dir=(workdir / "fio") if args.fio else None,
            progress=args.progress,
            out=sys.stdout,
            text_out=sys.stdout if args.text else None,
        )


def main(argv: Sequence[str] | None = None, extra: Mapping[str, StoreFactory] | None = None) -> int:
    """CLI entry. ``extra`` adds store factories by name (e.g. ``{"kvfs": ...}``)."""
    args = build_parser().parse_args(argv)
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            comp = asyncio.run(_amain(args, extra or {}))
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                comp = runner.run(_amain(args, extra or {}))
    except (BenchError, ValueError) as e:
        print(f"kvfs-bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json is not None:
        args.json.write_text(json.dumps(comp.to_json(), indent=2))
    return 0
