"""Latency recording and fio-compatible reporting (JSON and the human text block).

One *io* in this bench is one key (one value) read or written, the way one fio
io is one block. A batched call that carries B keys is recorded once, with its
latency and ``ios=B``; ``total_ios``/``iops`` count keys, not calls. Two
latency figures come out of that, each labelled:

* per io (``clat_ns``, ``lat_ns``; text ``clat``): each key of a call is one
  io whose latency is the call's latency divided by the keys it carried, i.e.
  the time the call spent per key. Percentiles are over keys. This is the
  figure to hold against fio's per-io ``clat`` at ``iodepth=1``.
* per call (``call_lat_ns``, a kvfs addition; text ``call lat``): the latency
  of one whole call of B keys, percentiles over calls. With ``iodepth`` calls
  in flight, Little's law links the two: call latency ~ iodepth x B / iops.

Field names and the shapes of the JSON follow fio 3.x ``--output-format=json``
(``stat.c``: ``add_ddir_status_json``, ``show_thread_status_json``); the text
follows ``show_thread_status_normal``. Differences from fio, on purpose:

* ``clat_ns``: measured with ``time.perf_counter_ns`` from issuing a call to
  its completion, divided per key as above. There is no separate submission
  stage, so ``slat_ns`` is all zeros (N=0) and ``lat_ns`` equals ``clat_ns``.
* Percentiles are exact (nearest rank over the recorded values) instead of
  fio's log-linear histogram approximation.
* ``bw_bytes`` and ``iops`` are computed from the runtime in nanoseconds;
  ``runtime`` itself is reported in whole milliseconds, as fio does.
* Jobs that ran one after another have their own ``groupid``; only jobs that
  ran at the same time (``--numjobs``) share one and are summed in one
  ``Run status group``.
"""

from __future__ import annotations

import math
import os
import time
from array import array
from collections.abc import Mapping, Sequence
from decimal import ROUND_CEILING, Decimal
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "FIO_VERSION",
    "LAT_MS_LABELS",
    "LAT_US_LABELS",
    "PERCENTILES",
    "SAMPLE_INTERVAL_NS",
    "LatencyRecorder",
    "direction_json",
    "empty_direction_json",
    "format_job_text",
    "format_mem_free",
    "format_report_text",
    "job_json",
    "lat_summary",
    "latency_buckets",
    "num2str",
    "percentile_key",
    "report_json",
    "weighted_percentiles",
]

FIO_VERSION: Final = "kvfs-bench-0.1"

#: fio's default ``percentile_list``.
PERCENTILES: Final[tuple[float, ...]] = (
    1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0,
    95.0, 99.0, 99.5, 99.9, 99.95, 99.99,
)  # fmt: skip

#: fio's ``bw_avg_time`` / ``iops_avg_time`` default: one bw/iops sample per 500 ms.
SAMPLE_INTERVAL_NS: Final = 500_000_000

# fio io_u_mark_lat_{nsec,usec,msec}: label "L" holds values in [previous label, L).
LAT_NS_LABELS: Final = ("2", "4", "10", "20", "50", "100", "250", "500", "750", "1000")
LAT_US_LABELS: Final = LAT_NS_LABELS
LAT_MS_LABELS: Final = (*LAT_NS_LABELS, "2000", ">=2000")
_LAT_EDGES: Final = np.array([2, 4, 10, 20, 50, 100, 250, 500, 750, 1000, 2000], dtype=np.int64)

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


class LatencyRecorder:
    """Per-call latencies (ns), with the ios (keys) and bytes each call carried.

    ``record`` is the hot path: three ``array('q')`` appends, no numpy work. The
    arrays are turned into numpy views only when a report is made.
    """

    __slots__ = ("_bytes", "_done", "_ios", "_lat", "_total_bytes", "_total_ios")

    def __init__(self) -> None:
        self._lat = array("q")
        self._ios = array("q")
        self._bytes = array("q")
        self._done = array("q")
        self._total_ios = 0
        self._total_bytes = 0

    def record(self, latency_ns: int, ios: int = 1, nbytes: int = 0, done_ns: int = 0) -> None:
        """One call: its latency, keys carried, bytes moved, completion time since start."""
        self._lat.append(latency_ns)
        self._ios.append(ios)
        self._bytes.append(nbytes)
        self._done.append(done_ns)
        self._total_ios += ios
        self._total_bytes += nbytes

    def reset(self) -> None:
        for buf in (self._lat, self._ios, self._bytes, self._done):
            del buf[:]
        self._total_ios = 0
        self._total_bytes = 0

    @property
    def calls(self) -> int:
        return len(self._lat)

    @property
    def total_ios(self) -> int:
        return self._total_ios

    @property
    def io_bytes(self) -> int:
        return self._total_bytes

    def latencies_ns(self) -> I64:
        """Per call."""
        return np.frombuffer(self._lat, dtype=np.int64) if self._lat else _EMPTY

    def per_key_ns(self) -> I64:
        """Per call, the call's latency divided by the keys it carried (at least 1 ns)."""
        if not self._lat:
            return _EMPTY
        return np.maximum(self.latencies_ns() // np.maximum(self.ios(), 1), 1)

    def ios(self) -> I64:
        return np.frombuffer(self._ios, dtype=np.int64) if self._ios else _EMPTY

    def bytes_per_call(self) -> I64:
        return np.frombuffer(self._bytes, dtype=np.int64) if self._bytes else _EMPTY

    def done_ns(self) -> I64:
        return np.frombuffer(self._done, dtype=np.int64) if self._done else _EMPTY


_EMPTY: Final[I64] = np.zeros(0, dtype=np.int64)


def percentile_key(p: float) -> str:
    """fio's JSON key for a percentile: ``"%f"`` formatting, e.g. ``"99.900000"``."""
    return f"{p:f}"


def weighted_percentiles(
    values: I64, weights: I64 | None = None, percentiles: Sequence[float] = PERCENTILES
) -> list[int]:
    """For each p, the smallest value v with (ios at or below v) >= p% of all ios.

    That is fio's rule (``calc_clat_percentiles``) applied to exact values; with
    unit weights it is the nearest-rank percentile. Exact decimal arithmetic, so
    ``99.9`` of 1000 is rank 999 and not 1000 by float rounding.
    """
    if len(values) == 0:
        return [0 for _ in percentiles]
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    if weights is None:
        cum = np.arange(1, len(values) + 1, dtype=np.int64)
    else:
        cum = np.cumsum(weights[order], dtype=np.int64)
    total = int(cum[-1])
    out: list[int] = []
    for p in percentiles:
        rank = (Decimal(repr(float(p))) * total / 100).to_integral_value(rounding=ROUND_CEILING)
        rank_i = min(max(int(rank), 1), total)
        idx = int(np.searchsorted(cum, rank_i, side="left"))
        out.append(int(sorted_values[idx]))
    return out


def lat_summary(
    values: I64, weights: I64 | None = None, percentiles: Sequence[float] | None = PERCENTILES
) -> dict[str, Any]:
    """fio's ``clat_ns``/``lat_ns`` object: min, max, mean, stddev, N, percentile."""
    if len(values) == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0}
    x = values.astype(np.float64)
    w = np.ones_like(x) if weights is None else weights.astype(np.float64)
    n = float(w.sum())
    mean = float((x * w).sum() / n)
    var = float((w * (x - mean) ** 2).sum() / (n - 1.0)) if n > 1.0 else 0.0
    out: dict[str, Any] = {
        "min": int(values.min()),
        "max": int(values.max()),
        "mean": mean,
        "stddev": math.sqrt(var),
        "N": int(n),
    }
    if percentiles:
        vals = weighted_percentiles(values, weights, percentiles)
        out["percentile"] = {percentile_key(p): v for p, v in zip(percentiles, vals, strict=True)}
    return out


def latency_buckets(values: I64, weights: I64 | None = None) -> dict[str, dict[str, float]]:
    """fio's ``latency_ns``/``latency_us``/``latency_ms``: percent of all ios per bucket.

    As ``io_u_mark_latency``: below 1 us counts in ns buckets, below 1 ms in us
    buckets, the rest in ms buckets; each value is truncated to its unit first.
    """
    w = np.ones(len(values), dtype=np.int64) if weights is None else weights
    total = int(w.sum())
    n_counts = np.zeros(len(LAT_NS_LABELS), dtype=np.int64)
    u_counts = np.zeros(len(LAT_US_LABELS), dtype=np.int64)
    m_counts = np.zeros(len(LAT_MS_LABELS), dtype=np.int64)
    if total:
        for counts, lo, hi, div in (
            (n_counts, 0, 1_000, 1),
            (u_counts, 1_000, 1_000_000, 1_000),
            (m_counts, 1_000_000, None, 1_000_000),
        ):
            sel = values >= lo if hi is None else (values >= lo) & (values < hi)
            if not sel.any():
                continue
            unit = values[sel] // div
            edges = _LAT_EDGES if hi is None else _LAT_EDGES[:-1]
            idx = np.searchsorted(edges, unit, side="right")
            counts += np.bincount(idx, weights=w[sel], minlength=len(counts)).astype(np.int64)

    def pct(counts: I64, labels: Sequence[str]) -> dict[str, float]:
        return {
            lab: (100.0 * int(c) / total if total else 0.0)
            for lab, c in zip(labels, counts, strict=True)
        }

    return {
        "latency_ns": pct(n_counts, LAT_NS_LABELS),
        "latency_us": pct(u_counts, LAT_US_LABELS),
        "latency_ms": pct(m_counts, LAT_MS_LABELS),
    }


def _sample_stats(per_window: F64) -> tuple[int, int, float, float, int]:
    n = len(per_window)
    if n == 0:
        return 0, 0, 0.0, 0.0, 0
    mean = float(per_window.mean())
    dev = float(per_window.std(ddof=1)) if n > 1 else 0.0
    return int(per_window.min()), int(per_window.max()), mean, dev, n


def empty_direction_json() -> dict[str, Any]:
    """What fio prints for a direction the job did not use."""
    return direction_json(LatencyRecorder(), 0)


def direction_json(
    rec: LatencyRecorder,
    runtime_ns: int,
    percentiles: Sequence[float] = PERCENTILES,
    sample_interval_ns: int = SAMPLE_INTERVAL_NS,
) -> dict[str, Any]:
    """fio's ``read``/``write`` object for one direction of one job.

    ``runtime_ns`` is the measured time of the job (after ramp). bw/iops samples
    are taken per full ``sample_interval_ns`` window of completion times.
    """
    io_bytes = rec.io_bytes
    total_ios = rec.total_ios
    if runtime_ns > 0 and total_ios:
        bw_bytes = int(io_bytes * 1e9 / runtime_ns)
        iops = total_ios * 1e9 / runtime_ns
    else:
        bw_bytes, iops = 0, 0.0
    lat = rec.latencies_ns()
    ios = rec.ios()
    summary = lat_summary(rec.per_key_ns(), ios, percentiles)
    # bw / iops samples per full window, as fio's add_bw_samples / add_iops_samples.
    nwin = runtime_ns // sample_interval_ns if sample_interval_ns > 0 else 0
    if nwin and len(lat):
        win = rec.done_ns() // sample_interval_ns
        keep = win < nwin
        secs = sample_interval_ns / 1e9
        ios_w: F64 = np.bincount(win[keep], weights=ios[keep], minlength=nwin) / secs
        nbytes_w = np.bincount(win[keep], weights=rec.bytes_per_call()[keep], minlength=nwin)
        kib_w: F64 = nbytes_w.astype(np.float64) / 1024.0 / secs
    else:
        ios_w = np.zeros(0, dtype=np.float64)
        kib_w = np.zeros(0, dtype=np.float64)
    bw_min, bw_max, bw_mean, bw_dev, bw_n = _sample_stats(kib_w)
    io_min, io_max, io_mean, io_dev, io_n = _sample_stats(ios_w)
    bw_kib = bw_bytes // 1024
    agg = min(100.0, bw_mean * 100.0 / bw_kib) if bw_kib and bw_n else 0.0
    return {
        "io_bytes": io_bytes,
        "io_kbytes": io_bytes >> 10,
        "bw_bytes": bw_bytes,
        "bw": bw_kib,
        "iops": iops,
        "runtime": runtime_ns // 1_000_000 if total_ios else 0,
        "total_ios": total_ios,
        "short_ios": 0,
        "drop_ios": 0,
        "slat_ns": lat_summary(_EMPTY, None, None),
        "clat_ns": summary,
        "lat_ns": dict(summary),
        "call_lat_ns": {**lat_summary(lat, None, percentiles),
                        "keys_per_call": total_ios / len(lat) if len(lat) else 0.0},
        "bw_min": bw_min,
        "bw_max": bw_max,
        "bw_agg": agg,
        "bw_mean": bw_mean,
        "bw_dev": bw_dev,
        "bw_samples": bw_n,
        "iops_min": io_min,
        "iops_max": io_max,
        "iops_mean": io_mean,
        "iops_stddev": io_dev,
        "iops_samples": io_n,
    }


def job_json(
    name: str,
    *,
    read: LatencyRecorder | None = None,
    write: LatencyRecorder | None = None,
    runtime_ns: int,
    options: Mapping[str, str] | None = None,
    error: int = 0,
    groupid: int = 0,
    job_start_ms: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One entry of fio's ``jobs`` array."""
    rd = direction_json(read, runtime_ns) if read is not None else empty_direction_json()
    wr = direction_json(write, runtime_ns) if write is not None else empty_direction_json()
    recs = [r for r in (read, write) if r is not None and r.calls]
    if recs:
        all_lat = np.concatenate([r.per_key_ns() for r in recs])
        all_ios = np.concatenate([r.ios() for r in recs])
    else:
        all_lat, all_ios = _EMPTY, _EMPTY
    job: dict[str, Any] = {
        "jobname": name,
        "groupid": groupid,
        "job_start": int(time.time() * 1000) if job_start_ms is None else job_start_ms,
        "error": error,
        "job options": dict(options or {}),
        "read": rd,
        "write": wr,
        "trim": empty_direction_json(),
        "job_runtime": runtime_ns // 1_000_000,
    }
    job.update(latency_buckets(all_lat, all_ios))
    if extra:
        job.update(extra)
    return job


def report_json(
    jobs: Sequence[Mapping[str, Any]],
    *,
    timestamp: int | None = None,
    global_options: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """fio's top level: ``{"fio version", "timestamp", "time", "jobs": [...]}``."""
    now = time.time()
    ts = int(now) if timestamp is None else timestamp
    return {
        "fio version": FIO_VERSION,
        "timestamp": ts,
        "timestamp_ms": int(now * 1000) if timestamp is None else ts * 1000,
        "time": time.ctime(ts),
        "global options": dict(global_options or {}),
        "jobs": [dict(j) for j in jobs],
    }


# ---------------------------------------------------------------------------
# Human text, as fio's show_thread_status_normal prints it.

_SI = ("", "k", "M", "G", "T", "P", "E")
_IEC = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def num2str(num: int, maxlen: int = 4, base: int = 1, pow2: bool = False, unit: str = "") -> str:
    """Port of fio's ``lib/num2str.c``: at most ``maxlen`` digits, then a prefix.

    >>> num2str(170000)
    '170k'
    >>> num2str(638000, pow2=True, unit="B/s")
    '623KiB/s'
    """
    prefixes = _IEC if pow2 else _SI
    thousand = 1024 if pow2 else 1000
    post = 0
    while base > 1:
        base //= thousand
        post += 1
    num = int(num)
    modulo: int | None = None
    carry = False
    while post < len(_SI):
        if len(str(num)) <= maxlen:
            break
        modulo = num % thousand
        num //= thousand
        carry = modulo >= thousand // 2
        post += 1
    if post >= len(_SI):
        post = 0
    if modulo is None:
        return f"{num}{prefixes[post]}{unit}"
    room = maxlen - len(str(num))
    if room <= 1:
        if carry:
            num += 1
        return f"{num}{prefixes[post]}{unit}"
    frac = f"{modulo / thousand:.{room - 1}f}"
    if frac[0] == "1":
        num += 1
    return f"{num}.{frac[2:]}{prefixes[post]}{unit}"


def _scale_lat(mn: int, mx: int, mean: float, dev: float) -> tuple[str, int, int, float, float]:
    # stat.h nsec_to_msec / nsec_to_usec
    if mn > 2_000_000 and mx > 99_999_999 and dev > 1_000_000.0:
        return "msec", mn // 1_000_000, mx // 1_000_000, mean / 1e6, dev / 1e6
    if mn > 2000 and mx > 99_999 and dev > 1000.0:
        return "usec", mn // 1000, mx // 1000, mean / 1e3, dev / 1e3
    return "nsec", mn, mx, mean, dev


def _display_lat(name: str, lat: Mapping[str, Any]) -> str:
    base, mn, mx, mean, dev = _scale_lat(
        int(lat["min"]), int(lat["max"]), float(lat["mean"]), float(lat["stddev"])
    )
    return (
        f"    {name} ({base}): min={num2str(mn, 6)}, max={num2str(mx, 6)}, "
        f"avg={mean:5.02f}, stdev={dev:5.02f}\n"
    )


def _show_percentiles(pre: str, pct: Mapping[str, int], precision: int = 2) -> str:
    items = sorted(((float(k), int(v)) for k, v in pct.items()), key=lambda kv: kv[0])
    if not items:
        return ""
    vals = [v for _, v in items]
    minv, maxv = min(vals), max(vals)
    if minv > 2_000_000 and maxv > 99_999_999:
        scale, divisor, unit = 2, 1_000_000, "msec"
    elif minv > 2000 and maxv > 99_999:
        scale, divisor, unit = 1, 1000, "usec"
    else:
        scale, divisor, unit = 0, 1, "nsec"
    q = maxv // divisor
    width = max(5, int(math.log10(q)) + 1) if q > 0 else 5
    per_line = (80 - 7) // (precision + 10 + width)
    out = [f"    {pre} percentiles ({unit}):\n     |"]
    for j, (p, v) in enumerate(items):
        if j and j % per_line == 0:
            out.append("     |")
        for _ in range(scale):
            v = (v + 999) // 1000
        last = j == len(items) - 1
        out.append(f" {p:{precision + 3}.{precision}f}th=[{v:{width}d}]{'' if last else ','}")
        if last or j % per_line == per_line - 1:
            out.append("\n")
    return "".join(out)


def _show_lat_buckets(buckets: Mapping[str, float], unit: str) -> str:
    lines: list[str] = []
    cur: list[str] = []
    for label, value in buckets.items():
        if value <= 0.0:
            continue
        cur.append(f"{label}={value:3.2f}%")
        if len(cur) == 5:
            lines.append(f"  lat ({unit})   : " + ", ".join(cur))
            cur = []
    if cur:
        lines.append(f"  lat ({unit})   : " + ", ".join(cur))
    return "".join(line + "\n" for line in lines)


def _ddir_text(ddir: str, d: Mapping[str, Any]) -> str:
    runtime = int(d.get("runtime", 0))
    if not runtime or not int(d.get("io_bytes", 0)):
        return ""
    io_bytes = int(d["io_bytes"])
    bw = 1000 * io_bytes // runtime
    iops = 1000 * int(d["total_ios"]) // runtime
    out = [
        f"  {ddir}: IOPS={num2str(iops)}, BW={num2str(bw, pow2=True, unit='B/s')} "
        f"({num2str(bw, unit='B/s')})({num2str(io_bytes, pow2=True, unit='B')}/{runtime}msec)\n"
    ]
    for key, name in (("slat_ns", "slat"), ("clat_ns", "clat"), ("lat_ns", " lat")):
        lat = d.get(key)
        if isinstance(lat, Mapping) and int(lat.get("N", 0)):
            out.append(_display_lat(name, lat))
    clat = d.get("clat_ns")
    if isinstance(clat, Mapping) and isinstance(clat.get("percentile"), Mapping):
        out.append(_show_percentiles("clat", clat["percentile"]))
    call = d.get("call_lat_ns")
    if isinstance(call, Mapping) and int(call.get("N", 0)):
        per = float(call.get("keys_per_call", 0.0))
        out.append(f"    (one io = one key: clat = the call's latency / its keys; "
                   f"call lat = one call of {per:.4g} keys)\n")
        out.append(_display_lat("call lat", call))
        if isinstance(call.get("percentile"), Mapping):
            out.append(_show_percentiles("call lat", call["percentile"]))
    if int(d.get("bw_samples", 0)):
        mn, mx = int(d["bw_min"]), int(d["bw_max"])
        mean, dev = float(d["bw_mean"]), float(d["bw_dev"])
        unit = "KiB"
        if mean > 1024 * 1024:
            mn, mx, mean, dev, unit = mn // 1024, mx // 1024, mean / 1024, dev / 1024, "MiB"
        out.append(
            f"   bw ({unit:>5}/s): min={mn:5d}, max={mx:5d}, per={float(d.get('bw_agg', 100.0)):3.2f}%, "
            f"avg={mean:5.02f}, stdev={dev:5.02f}, samples={int(d['bw_samples'])}\n"
        )
    if int(d.get("iops_samples", 0)):
        out.append(
            f"   iops        : min={int(d['iops_min']):5d}, max={int(d['iops_max']):5d}, "
            f"avg={float(d['iops_mean']):5.02f}, stdev={float(d['iops_stddev']):5.02f}, "
            f"samples={int(d['iops_samples'])}\n"
        )
    return "".join(out)


def format_job_text(job: Mapping[str, Any], pid: int | None = None) -> str:
    """fio's human block for one job, made from its JSON (ours or real fio's)."""
    start_ms = job.get("job_start")
    when = time.ctime(int(start_ms) / 1000) if start_ms else time.ctime()
    err = int(job.get("error", 0))
    head = (
        f"{job['jobname']}: (groupid={int(job.get('groupid', 0))}, jobs=1): "
        f"err={err:2d}: pid={os.getpid() if pid is None else pid}: {when}\n"
    )
    out = [head]
    for ddir in ("read", "write", "trim"):
        d = job.get(ddir)
        if isinstance(d, Mapping):
            out.append(_ddir_text(ddir, d))
    for key, unit in (("latency_ns", "nsec"), ("latency_us", "usec"), ("latency_ms", "msec")):
        b = job.get(key)
        if isinstance(b, Mapping):
            out.append(_show_lat_buckets(b, unit))
    kv = job.get("kvfs")
    if not isinstance(kv, Mapping):
        kv = {}
    if kv.get("cpu"):
        out.append(format_cpu(kv["cpu"]))
    if kv.get("mem_free_mib"):
        small = kv.get("small_free_mib")
        out.append(f"  memory: MemFree {format_mem_free(kv['mem_free_mib'])} MiB"
                   + (f", of it in small blocks {format_mem_free(small)} MiB" if small else "")
                   + " (measured phase)\n")
    return "".join(out)


def format_mem_free(mem: Sequence[int | None]) -> str:
    """``19234->16201``: the machine's free memory (MiB) at the start and end of a job."""
    return "->".join("-" if m is None else str(m) for m in mem)


def format_cpu(cpu: Mapping[str, Mapping[str, Any]]) -> str:
    """``  cpu: client=2.9us/key 0.71s/GB, cs0=...`` (``--cpu``: each process's own counters)."""
    parts = []
    for name, c in cpu.items():
        per_key = c.get("us_per_key")
        per_gb = c.get("s_per_gb")
        cpus, wait = c.get("cpus"), c.get("wait_cpus")
        parts.append(f"{name}={'-' if per_key is None else f'{per_key:.3g}us/key'}"
                     + ("" if per_gb is None else f" {per_gb:.3g}s/GB")
                     + ("" if cpus is None or wait is None else f" {cpus:.2f}/{wait:.2f}CPU"))
    return ("  cpu (per process, measured phase; a/bCPU: CPUs used / CPUs waited for, runnable): "
            + ", ".join(parts) + "\n")


def format_report_text(report: Mapping[str, Any]) -> str:
    """All jobs, then one ``Run status group N`` summary per group of concurrent jobs.

    As fio: jobs that share a ``groupid`` ran at the same time and are summed;
    jobs that ran one after another are in groups of their own.
    """
    jobs: Sequence[Mapping[str, Any]] = report.get("jobs", [])
    out = [format_job_text(j) for j in jobs]
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for j in jobs:
        groups.setdefault(int(j.get("groupid", 0)), []).append(j)
    for gid, members in groups.items():
        lines = _group_lines(members)
        if lines:
            out.append(f"\nRun status group {gid} (all jobs):\n")
            out.extend(lines)
    return "".join(out)


def _group_lines(jobs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines: list[str] = []
    for ddir, label in (("read", "READ"), ("write", "WRITE")):
        used = [
            j[ddir]
            for j in jobs
            if isinstance(j.get(ddir), Mapping)
            and int(j[ddir].get("runtime", 0))
            and int(j[ddir].get("io_bytes", 0))
        ]
        if not used:
            continue
        io = sum(int(d["io_bytes"]) for d in used)
        runs = [int(d["runtime"]) for d in used]
        per_job = [1000 * int(d["io_bytes"]) // int(d["runtime"]) for d in used]
        bw = 1000 * io // max(runs)

        def b(n: int, pow2: bool) -> str:
            return num2str(n, pow2=pow2, unit="B/s")

        lines.append(
            f"  {label:>5}: bw={b(bw, True)} ({b(bw, False)}), "
            f"{b(min(per_job), True)}-{b(max(per_job), True)} "
            f"({b(min(per_job), False)}-{b(max(per_job), False)}), "
            f"io={num2str(io, pow2=True, unit='B')} ({num2str(io, unit='B')}), "
            f"run={min(runs)}-{max(runs)}msec\n"
        )
    return lines
