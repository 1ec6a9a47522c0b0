"""Tables and PNGs of the cost curves from the JSON that run.sh wrote (python bench/results/summarize.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def _load(name: str) -> dict[str, Any] | None:
    p = HERE / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _bw(job: dict[str, Any], d: str) -> float:
    return float(job[d]["bw_bytes"]) / 1e6


def _curve(prefix: str, xs: list[int], label: str) -> list[tuple[int, float, float]]:
    rows = []
    for x in xs:
        rep = _load(f"{prefix}{x}")
        if rep is None:
            continue
        rd = sum(_bw(j, "read") for j in rep["jobs"] if j["job options"]["rw"] in ("read", "randread"))
        wr = sum(_bw(j, "write") for j in rep["jobs"] if j["job options"]["rw"] == "write")
        rows.append((x, rd, wr))
    print(f"\n{label}\n| {label.split(' vs ')[-1]} | read MB/s | write MB/s |\n|---|---|---|")
    for x, rd, wr in rows:
        print(f"| {x} | {rd:.0f} | {wr:.0f} |")
    return rows


def _batch_curve() -> list[tuple[int, float, float, float, float]]:
    rows = []
    for b in (1, 8, 64, 256, 1024):
        rep = _load(f"curve-batch{b}")
        if rep is None:
            continue
        by = {j["job options"]["rw"]: j for j in rep["jobs"]}
        w, r = by.get("write"), by.get("randread")
        meta_w = w["kvfs"]["cpu"].get("meta", {}).get("us_per_key") if w else None
        meta_r = r["kvfs"]["cpu"].get("meta", {}).get("us_per_key") if r else None
        rows.append((b, r["read"]["iops"] if r else 0.0, w["write"]["iops"] if w else 0.0,
                     meta_r or 0.0, meta_w or 0.0))
    print("\nmeta CPU per key vs batch size (4 KiB values, iodepth 4)\n"
          "| batch | get keys/s | put keys/s | meta us/key (get) | meta us/key (put: commit) |\n|---|---|---|---|---|")
    for b, rk, wk, mr, mw in rows:
        print(f"| {b} | {rk:,.0f} | {wk:,.0f} | {mr:.2f} | {mw:.2f} |")
    return rows


def _metastore_curve() -> list[tuple[int, dict[str, float]]]:
    """curve-metastore.json: meta's handlers in one process, wall us per key per op and batch."""
    rep = _load("curve-metastore")
    if rep is None:
        return []
    by: dict[int, dict[str, float]] = {}
    for r in rep["ops"]:
        by.setdefault(int(r["batch"]), {})[r["op"]] = float(r["us_per_key"])
    rows = sorted(by.items())
    store = rep.get("store", "sqlite")
    print("\nmeta cost per key vs batch size, its handlers called in one process (python -m "
          f"kvfs.bench.metastore --store {store}; wall us per key, each write synced)\n"
          "| batch | commit us/key | lookup us/key | match_prefix us/key |\n|---|---|---|---|")
    for b, ops in rows:
        print(f"| {b} | {ops.get('commit', 0):.1f} | {ops.get('lookup', 0):.2f} | {ops.get('match_prefix', 0):.2f} |")
    return rows


def _meta_scale() -> list[tuple[str, int, float, float, float]]:
    """metastore-{rocksdb,sqlite,redis}-{N}.json (``kvfs.bench.metastore --restart``): per
    store and key count, the memory per key a meta needs (RocksDB, SQLite: the restarted
    meta's RSS per key; Redis: used_memory per key, one copy, the meta itself holds no keys),
    the restarted meta's start-up seconds, and its RSS in MB."""
    rows = []
    for store in ("rocksdb", "sqlite", "redis"):
        for n in (1_000_000, 10_000_000):
            rep = _load(f"metastore-{store}-{n}")
            if rep is None or "restart" not in rep:
                continue
            r = rep["restart"]
            per_key = rep["bytes_per_key"] if store == "redis" else r["rss_per_key"]
            rows.append((store, n, float(per_key), float(r["ready_s"]), r["rss"] / 1e6))
    print("\nmeta memory per key and start-up vs keys (python -m kvfs.bench.metastore --restart)\n"
          "| store | keys | bytes per key | meta start-up (s) | meta RSS after start-up (MB) |\n"
          "|---|---|---|---|---|")
    for store, n, per_key, ready, rss in rows:
        print(f"| {store} | {n:,} | {per_key:.0f} | {ready:.1f} | {rss:,.1f} |")
    return rows


def _save(fig: Any, name: str) -> None:
    """Write a curve's figure as ``bench/results/<name>.png``."""
    fig.tight_layout()
    fig.savefig(HERE / f"{name}.png")
    import matplotlib.pyplot as plt

    plt.close(fig)


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = _curve("curve-cs", [1, 2, 3, 4], "1 MiB values, batch 32, iodepth 2: throughput vs chunkservers")
    jobs = _curve("curve-jobs", [1, 2, 4], "1 MiB values, batch 32, iodepth 2: throughput vs client processes")
    batch = _batch_curve()
    meta = _metastore_curve()
    if meta:
        fig, ax = plt.subplots(figsize=(6, 4))
        for op in ("commit", "lookup", "match_prefix"):
            ax.plot([b for b, _ in meta], [ops.get(op, float("nan")) for _, ops in meta], marker="o", label=op)
        ax.set(xscale="log", yscale="log", xlabel="keys per call (log)", ylabel="wall us per key (log)",
               title="meta's handlers in one process: cost per key vs batch size\nSQLite synchronous=FULL, "
                     "2 vCPUs shared")
        ax.legend()
        _save(fig, "curve-metastore")
    for rows, name, xl in ((cs, "curve-chunkservers", "chunkservers"), (jobs, "curve-numjobs", "client processes (--numjobs)")):
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label="read 1m")
        ax.plot([r[0] for r in rows], [r[2] for r in rows], marker="o", label="write 1m")
        ax.set(xlabel=xl, ylabel="throughput (MB/s, 10^6 B/s)", xticks=[r[0] for r in rows],
               title=f"kvfs bench: throughput vs {xl}\n2 vCPUs shared with 7 other sessions", ylim=(0, None))
        ax.legend()
        _save(fig, name)
    if batch:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r[0] for r in batch], [r[4] for r in batch], marker="o", label="commit (put)")
        ax.plot([r[0] for r in batch], [r[3] for r in batch], marker="o", label="get (layouts cached)")
        ax.set(xscale="log", yscale="log", xlabel="keys per call (log)", ylabel="meta CPU per key (us, log)",
               title="kvfs bench --cpu: meta cost per key vs batch size\n4 KiB values, 2 vCPUs shared")
        ax.legend()
        _save(fig, "curve-meta-batch")
    scale = _meta_scale()
    if scale:
        fig, (mem, start) = plt.subplots(1, 2, figsize=(10, 4))
        for store, label, started in (
                ("rocksdb", "RocksDB meta, the default (restarted meta's RSS)", "RocksDB meta (reads every key)"),
                ("sqlite", "SQLite meta (restarted meta's RSS)", "SQLite meta (reads every key)"),
                ("redis", "Redis Cluster store (used_memory, one copy)", "meta on Redis (holds no keys)")):
            pts = [r for r in scale if r[0] == store]
            if pts:
                mem.plot([r[1] for r in pts], [r[2] for r in pts], marker="o", label=label)
                start.plot([r[1] for r in pts], [r[3] for r in pts], marker="o", label=started)
        mem.set(xscale="log", xlabel="keys (log)", ylabel="bytes per key", ylim=(0, None),
                title="memory per key")
        start.set(xscale="log", yscale="log", xlabel="keys (log)", ylabel="seconds (log)",
                  title="meta start-up, exec to ready")
        mem.legend(fontsize="small")
        start.legend(fontsize="small")
        fig.suptitle("meta memory and start-up vs keys (kvfs.bench.metastore --restart), "
                     "2 vCPUs shared")
        _save(fig, "curve-meta-memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
