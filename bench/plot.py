"""``--plot``: throughput vs value size and latency percentiles, as a PNG (needs matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot"]


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
