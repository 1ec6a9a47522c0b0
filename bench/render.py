"""Human text of a ``--compare`` run: the peer table, then the kvfs-internal comparisons."""

from __future__ import annotations

from typing import Any

from .compare import FIO_COLUMN, Comparison, short_name
from .internal import Internal
from .stats import format_mem_free

__all__ = ["render_compare", "render_internal", "sync_lines"]


def render_compare(comp: Comparison, internal: Internal | None) -> str:
    """The narrow table (a row per workload and store), the ratio table, the kvfs-internal ones."""
    lines = ["", "kvfs vs peers: one row per workload and store (one io = one key; MB/s = 10^6 B/s;",
             "p99/key = p99 of a call's latency / its keys, p99/call = p99 of one call's latency;",
             f"{comp.subject}/x = kvfs keys/s / that store's keys/s)", *_fio_legend(comp), "",
             comp.table(),
             f"ratios: {comp.subject} keys/s / peer keys/s (the same as the MB/s ratio)", "",
             comp.ratio_table()]
    lines += sync_lines(comp)
    passes = comp.passes_table()
    if passes:
        lines += [f"each cell above is the median of {comp.repeat} passes; keys/s of every pass in the",
                  "order they ran (every other pass in reverse order; * = the median)", "", passes]
    passes_cpu = comp.passes_table("cpu")
    if passes_cpu:
        lines += ["the client's CPU us per key of every pass (steadier than keys/s on a shared machine)",
                  "", passes_cpu]
    passes_mem = comp.passes_table("mem")
    if passes_mem:
        lines += ["the machine's free memory (MemFree, MiB) at the start->end of every pass's measured",
                  "phase (a put's CPU per GB depends on the free memory it draws on)", "", passes_mem]
    cpu = cpu_table(comp)
    if cpu:
        lines += ["CPU per key (us) and per GB moved (s), each process's own counters "
                  "(/proc/PID/stat) over the measured phase; client = the bench process;",
                  "CPUs: CPU seconds per second of the phase; waited: seconds per second its threads "
                  "were runnable without a CPU (schedstat);",
                  "MemFree: the machine's free memory (MiB, /proc/meminfo) at its start->end", "", cpu]
    return "\n".join(lines) + "\n" + (render_internal(internal) if internal is not None else "")


def _fio_legend(comp: Comparison) -> list[str]:
    if FIO_COLUMN not in comp.stores:
        return []
    return [f"{FIO_COLUMN}: psync on one file, bs = the value size; reads from the page cache; writes "
            "fdatasync after each batch of values (the disk's rate, synced as kvfs's --fsync batch)"]


def sync_lines(comp: Comparison, sync: str = "kvfs-sync", aio: str = "kvfs") -> list[str]:
    """The blocking client against the async one, per workload (issue 11: >= 0.9x)."""
    if sync not in comp.stores or aio not in comp.stores:
        return []
    out = [f"blocking client vs async: {sync} keys/s / {aio} keys/s", ""]
    rows = []
    for wl in comp.workloads:
        a, b = comp.cell(wl, aio).ios_per_s, comp.cell(wl, sync).ios_per_s
        rows.append([short_name(wl), "-" if not a or b is None else f"{b / a:.2f}x"])
    width = max(len(r[0]) for r in rows)
    return out + [f"{r[0].ljust(width)}  {r[1]}" for r in rows] + [""]


def cpu_table(comp: Comparison) -> str:
    """workload, store, process: us/key, s/GB, CPUs used and waited for (per second of the
    phase) and MemFree; "" when the run had no ``--cpu``."""
    rows: list[list[str]] = []
    for wl in comp.workloads:
        first = True
        for store in comp.stores:
            res = comp.cell(wl, store).result
            cpu = res.extra.get("cpu") if res is not None else None
            if not cpu:
                continue
            procs = dict(cpu)
            cs = [v for k, v in cpu.items() if k.startswith("cs")]
            if len(cs) > 1:
                procs["all cs"] = {k: _sum(c.get(k) for c in cs)
                                   for k in ("us_per_key", "s_per_gb", "cpus", "wait_cpus")}
            mem = comp.cell(wl, store).mem_free_mib
            for j, (proc, c) in enumerate(procs.items()):
                rows.append([short_name(wl) if first else "", store, proc, _num(c.get("us_per_key")),
                             _num(c.get("s_per_gb")), _cpus(c.get("cpus")), _cpus(c.get("wait_cpus")),
                             format_mem_free(mem) if mem and j == 0 else ""])
                first = False
    if not rows:
        return ""
    head = ["workload", "store", "process", "us/key", "s/GB", "CPUs", "waited", "MemFree"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i >= 3 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                     for r in [head, *rows]) + "\n"


def _sum(xs: Any) -> float | None:
    vals = list(xs)
    return None if any(v is None for v in vals) else float(sum(vals))


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


def _cpus(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_internal(internal: Internal) -> str:
    """The kvfs-internal comparisons: batcher on/off, prefix chains, server reads per chain."""
    lines: list[str] = []
    if internal.batcher is not None:
        lines += ["", "kvfs: 128 concurrent single-key get() (batcher on/x = batcher on / batch=False keys/s)",
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
