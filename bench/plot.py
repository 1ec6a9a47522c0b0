"""``--plot``: PNGs of a run (needs matplotlib).

* ``plot``: throughput against value size per rw, and latency percentiles per
  job on a log-scaled tail axis (50, 90, 99, 99.9, 99.99 equally spaced), per
  key and per call.
* ``plot_families``: for a ``--compare`` run, one bar chart per workload
  family (reads, writes, lookups): throughput per store for each workload, with the
  loopback limit drawn as a line over each group of bars.

Every figure has a title naming the run and units on its axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compare import Comparison, short_name
from .runner import LOOKUP_APIS, Workload

__all__ = ["family_paths", "plot", "plot_families", "tail_x"]

TAIL_TICKS = (50.0, 90.0, 99.0, 99.9, 99.99)
LIMIT_STORE = "loopback"


def tail_x(percentile: float) -> float:
    """The tail axis: -log10(1 - p/100), so 90 -> 1, 99 -> 2, 99.9 -> 3."""
    return -math.log10(max(1e-6, 1.0 - percentile / 100.0))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(jobs: Sequence[dict[str, Any]], path: Path, title: str = "kvfs bench") -> None:
    """Throughput vs value size (per rw) and latency percentiles per job, on a tail axis."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    by_rw: dict[str, list[tuple[int, float]]] = {}
    for job in jobs:
        opts = job.get("job options", {})
        bs = int(opts.get("bs", 0))
        bw = sum(float(job[d]["bw_bytes"]) for d in ("read", "write"))
        if bw > 0:  # lookups (exists_many, match_prefix) move no value bytes
            by_rw.setdefault(opts.get("rw", "?"), []).append((bs, bw / 1e6))
        for d in ("read", "write"):
            if not int(job[d].get("total_ios", 0)):
                continue
            for field, style, what in (("clat_ns", "-", "per key"), ("call_lat_ns", "--", "per call")):
                pct = job[d].get(field, {}).get("percentile")
                if not pct:
                    continue
                tail = sorted((float(k), v / 1e3) for k, v in pct.items() if float(k) >= 50.0)
                ax2.plot([tail_x(p) for p, _ in tail], [v for _, v in tail], style, marker=".",
                         label=f"{job['jobname']} {d} {what}")
    for rw, pts in sorted(by_rw.items()):
        pts.sort()
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=rw)
    ax1.set(xscale="log", yscale="log", xlabel="value size (bytes, log)", ylabel="throughput (MB/s, 10^6 B/s, log)",
            title="throughput vs value size")
    ax2.set(yscale="log", xlabel="percentile (tail axis)", ylabel="latency (usec, log)",
            title="latency percentiles: per key (solid), per call (dashed)")
    ax2.set_xticks([tail_x(p) for p in TAIL_TICKS], [f"{p:g}" for p in TAIL_TICKS])
    ax1.legend()
    ax2.legend(fontsize="xx-small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _family(wl: Workload) -> str:
    if wl.reads and wl.api in LOOKUP_APIS:
        return "lookups"
    rw = wl.rw
    return "reads" if rw in ("read", "randread") else "writes" if rw in ("write", "randwrite") else rw


def family_paths(path: Path, comp: Comparison) -> dict[str, Path]:
    """``out.png`` -> ``out-reads.png``, ``out-writes.png``, ``out-lookups.png``: one per family."""
    fams = dict.fromkeys(_family(wl) for wl in comp.workloads)
    return {f: path.with_name(f"{path.stem}-{f}{path.suffix or '.png'}") for f in fams}


def plot_families(comp: Comparison, path: Path, title: str = "kvfs bench --compare") -> list[Path]:
    """One bar chart per family: MB/s per store and workload, the loopback limit as a line.

    Lookups (exists_many, match_prefix) move no value bytes: their bars are keys/s.
    """
    plt = _pyplot()
    written = []
    stores = [s for s in comp.stores if s != LIMIT_STORE]
    for fam, out in family_paths(path, comp).items():
        wls = [wl for wl in comp.workloads if _family(wl) == fam]
        keys = fam == "lookups"
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(wls) * len(stores) / 3), 4.8))
        width = 0.8 / max(1, len(stores))
        for i, store in enumerate(stores):
            xs, ys = [], []
            for j, wl in enumerate(wls):
                got = comp.cell(wl, store)
                bw = got.ios_per_s if keys else got.bytes_per_s
                if bw:
                    xs.append(j - 0.4 + (i + 0.5) * width)
                    ys.append(bw / 1e3 if keys else bw / 1e6)
            ax.bar(xs, ys, width, label=store)
        labelled = False
        for j, wl in enumerate(wls):
            cell = comp.cells.get((wl.name, LIMIT_STORE))
            limit = cell.bytes_per_s if cell is not None and not keys else None
            if limit:
                ax.hlines(limit / 1e6, j - 0.45, j + 0.45, colors="black", linestyles="--",
                          label=None if labelled else "loopback limit")
                labelled = True
        ax.set_xticks(range(len(wls)), [short_name(wl) for wl in wls], fontsize="small")
        ax.set(yscale="log", ylabel="keys/s (thousands, log)" if keys else "throughput (MB/s, 10^6 B/s, log)",
               title=f"{title}: {fam}, throughput per store")
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out)
        plt.close(fig)
        written.append(out)
    return written
