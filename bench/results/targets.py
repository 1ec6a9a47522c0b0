"""Issue 11's targets, judged on the JSON that run.sh wrote (python bench/results/targets.py [DIR]).

Prints one markdown row per target: the figures of this run it rests on and
"met" / "missed" (or "not measured" when a row is absent or was skipped, with
the reason). Every ratio is taken inside one ``kvfs bench --compare`` run.

The put targets name a durability setting, and each is judged on the run made with it:
put_many vs Mooncake on ``cmp-<size>.json``, whose embedded cluster ran ``--fsync never``
(Mooncake keeps values in DRAM); put_many vs fio on ``cmp-<size>-durable.json``, run with the
default ``--fsync batch`` against fio's sequential writes with an fdatasync per batch (the
disk's rate). A file made with another setting is "not measured", with the setting it had.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfs.bench.stats import format_mem_free

HERE = Path(__file__).parent
LARGE = (("1m", 32), ("8m", 8), ("32m", 2))


class Run:
    """One cmp-<size><suffix>.json: every store's jobs by name, what was skipped, its --fsync."""

    def __init__(self, size: str, batch: int, suffix: str = "", root: Path | None = None) -> None:
        self.size, self.batch = size, batch
        self.file = f"cmp-{size}{suffix}.json"
        path = (root or (Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)) / self.file
        report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.peers: dict[str, Any] = report["kvfs compare"]["peers"] if report else {}
        # runs before the bench had --fsync used the default: batch
        self.fsync: str = report.get("global options", {}).get("fsync", "batch")

    def job(self, store: str, suffix: str = "", rw: str = "randread") -> dict[str, Any] | None:
        st = self.peers.get("stores", {}).get(store)
        if st is None:
            return None
        name = f"{rw}-{self.size}-b{self.batch}{suffix}"
        return next((j for j in st["report"]["jobs"] if j["jobname"] == name), None)

    def skipped(self, store: str, suffix: str = "", rw: str = "randread") -> str:
        st = self.peers.get("stores", {}).get(store)
        if st is None:
            return "not in the run" if self.peers else f"no {self.file}"
        return str(st["skipped"].get(f"{rw}-{self.size}-b{self.batch}{suffix}", "no row"))


def _rate(job: dict[str, Any] | None, d: str, what: str) -> float | None:
    if job is None or int(job[d]["total_ios"]) == 0:
        return None
    return float(job[d]["iops"]) if what == "keys" else float(job[d]["bw_bytes"]) / 1e6


def _fmt(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def ratio_row(run: Run, a: tuple[str, str, str], b: tuple[str, str, str], goal: float,
              what: str = "MB/s", fsync: str | None = None) -> tuple[str, bool | None]:
    """a / b for (store, name suffix, rw) pairs: the figures and whether a/b >= goal.

    ``fsync``: the embedded cluster's setting the target names; a run made with another is
    not judged.
    """
    if fsync is not None and run.peers and run.fsync != fsync:
        return f"{run.file} ran --fsync {run.fsync}; this target needs --fsync {fsync}", None
    d = {"randread": "read", "write": "write"}
    ja, jb = run.job(a[0], a[1], a[2]), run.job(b[0], b[1], b[2])
    ra = _rate(ja, d[a[2]], "keys" if what == "keys/s" else "mb")
    rb = _rate(jb, d[b[2]], "keys" if what == "keys/s" else "mb")
    if ra is None:
        return f"{a[0]}: {run.skipped(*a)}", None
    if rb is None or rb <= 0:
        return f"{b[0]}: {run.skipped(*b)}", None
    r = ra / rb
    return f"{_fmt(ra)} vs {_fmt(rb)} {what}: {r:.2f}x", r >= goal


def cpu(run: Run, store: str, suffix: str, rw: str) -> dict[str, float] | None:
    job = run.job(store, suffix, rw)
    c = job.get("kvfs", {}).get("cpu") if job is not None else None
    if not c:
        return None
    out = {p: float(v["us_per_key"]) for p, v in c.items()}
    out["cs"] = sum(v for p, v in out.items() if p.startswith("cs"))
    return out


def with_memory(run: Run, row: tuple[str, bool | None], store: str = "kvfs", rw: str = "write"
                ) -> tuple[str, bool | None]:
    """A row's text with the small free blocks (bench/cpu.py's small_free_mib) at the start
    and end of ``store``'s job, where its JSON has them: on a VM with free page reporting a
    put job that finds them used up pays several times the CPU per GB (bench/RESULTS.md)."""
    job = run.job(store, "", rw)
    small = job.get("kvfs", {}).get("small_free_mib") if job is not None else None
    if not small or row[1] is None:  # (a row not judged says why, alone)
        return row
    return f"{row[0]} ({store}'s small free blocks {format_mem_free(small)} MiB)", row[1]


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "met" if ok else "missed"


def rows(root: Path | None = None) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    small = Run("4k", 128, root=root)
    large = [Run(s, b, root=root) for s, b in LARGE]
    durable = [Run(s, b, "-durable", root=root) for s, b in LARGE]

    def each(label: str, fn: Callable[[Run], tuple[str, bool | None]], runs: list[Run] = large) -> None:
        for run in runs:
            text, ok = fn(run)
            out.append((f"{label}, {run.size} x {run.batch}", text, verdict(ok)))

    each("put_many (--fsync never) >= 1.0x Mooncake put", lambda r: with_memory(r, ratio_row(
        r, ("kvfs", "", "write"), ("mooncake", "", "write"), 1.0, fsync="never")))
    each("put_many (--fsync batch, the default) >= 80 % of the disk's sequential write (fio, "
         "fdatasync per batch)", lambda r: ratio_row(
        r, ("kvfs", "", "write"), ("fio", "", "write"), 0.8, fsync="batch"), durable)
    each("get_into >= 1.5x Mooncake batch_get_into", lambda r: ratio_row(
        r, ("kvfs", "-into", "randread"), ("mooncake", "-into", "randread"), 1.5))
    each("get_into >= 60 % of the loopback limit", lambda r: ratio_row(
        r, ("kvfs", "-into", "randread"), ("loopback", "-into", "randread"), 0.6))
    for label, a, b, what in (
        ("4 KiB x 128 get_many >= 1.0x Redis MGET", ("kvfs", "", "randread"), ("redis", "", "randread"), "keys/s"),
        ("4 KiB x 128 put_many >= 1.0x Redis MSET", ("kvfs", "", "write"), ("redis", "", "write"), "keys/s"),
        ("exists_many of 128 keys >= 1.0x pipelined Redis EXISTS", ("kvfs", "-exists", "randread"),
         ("redis", "-exists", "randread"), "keys/s"),
        ("match_prefix of 128 keys >= 1.0x pipelined Redis EXISTS", ("kvfs", "-match", "randread"),
         ("redis", "-exists", "randread"), "keys/s"),
    ):
        text, ok = ratio_row(small, a, b, 1.0, what)
        out.append((label, text, verdict(ok)))
    for run in [small, *large]:
        text, ok = ratio_row(run, ("kvfs", "-into", "randread"), ("kvfs", "", "randread"), 1.0)
        out.append((f"get_into >= 1.0x get_many, {run.size}", text, verdict(ok)))
    for run in [small, *large]:
        names = [("", "randread"), ("-into", "randread"), ("", "write")]
        if run is small:
            names[2:2] = [("-exists", "randread"), ("-match", "randread")]
        for suffix, rw in names:
            text, ok = ratio_row(run, ("kvfs-sync", suffix, rw), ("kvfs", suffix, rw), 0.9,
                                 "keys/s")
            what = {"": "get_many" if rw == "randread" else "put_many", "-into": "get_into",
                    "-exists": "exists_many", "-match": "match_prefix"}[suffix]
            out.append((f"blocking Client >= 0.9x async, {what} {run.size}", text, verdict(ok)))
    rd, wr = cpu(small, "kvfs", "", "randread"), cpu(small, "kvfs", "", "write")
    ex = cpu(small, "kvfs", "-exists", "randread")
    for label, src, proc, goal in (
        ("CPU 4 KiB x 128: client <= 3 us/key (get_many)", rd, "client", 3.0),
        ("CPU 4 KiB x 128: client <= 3 us/key (put_many)", wr, "client", 3.0),
        ("CPU 4 KiB x 128: chunkservers together <= 2 us/key (get_many)", rd, "cs", 2.0),
        ("CPU 4 KiB x 128: chunkservers together <= 2 us/key (put_many)", wr, "cs", 2.0),
        ("CPU 4 KiB x 128: meta <= 4 us per committed key", wr, "meta", 4.0),
        ("CPU 4 KiB x 128: meta <= 1 us per looked-up key (exists_many: every key looked up "
         "in meta's index, no client cache in the way)", ex, "meta", 1.0),
        ("CPU 4 KiB x 128: meta <= 1 us per key read (get_many; the client's layout cache "
         "answers the lookups, meta sees its TOUCH batches)", rd, "meta", 1.0),
    ):
        if src is None or proc not in src:
            out.append((label, "no --cpu figures", "not measured"))
        else:
            out.append((label, f"{src[proc]:.1f} us/key", verdict(src[proc] <= goal)))
    return out


def main() -> None:
    print("| target | figure (same run) | verdict |")
    print("|---|---|---|")
    for label, text, v in rows():
        print(f"| {label} | {text} | {v} |")


if __name__ == "__main__":
    main()
