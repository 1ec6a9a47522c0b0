"""kvfs.bench.stats: exact percentiles, fio buckets, fio JSON field names, fio text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvfs.bench.stats import (
    FIO_VERSION,
    PERCENTILES,
    LatencyRecorder,
    format_job_text,
    format_report_text,
    job_json,
    lat_summary,
    latency_buckets,
    num2str,
    percentile_key,
    report_json,
    weighted_percentiles,
)

FIO_PERCENTILE_KEYS = [
    "1.000000", "5.000000", "10.000000", "20.000000", "30.000000", "40.000000",
    "50.000000", "60.000000", "70.000000", "80.000000", "90.000000", "95.000000",
    "99.000000", "99.500000", "99.900000", "99.950000", "99.990000",
]  # fmt: skip


def _recorder(latencies_ns: list[int], ios: int = 1, bs: int = 4096) -> LatencyRecorder:
    rec = LatencyRecorder()
    for i, lat in enumerate(latencies_ns):
        rec.record(lat, ios, ios * bs, done_ns=i * 1_000_000)
    return rec


def test_percentile_keys_are_fios() -> None:
    assert [percentile_key(p) for p in PERCENTILES] == FIO_PERCENTILE_KEYS


def test_percentiles_of_1_to_1000() -> None:
    values = np.arange(1, 1001, dtype=np.int64)
    rng = np.random.default_rng(7)
    shuffled = rng.permutation(values)
    got = dict(zip(PERCENTILES, weighted_percentiles(shuffled), strict=True))
    assert got[1.0] == 10
    assert got[5.0] == 50
    assert got[50.0] == 500
    assert got[90.0] == 900
    assert got[99.0] == 990
    assert got[99.5] == 995
    assert got[99.9] == 999  # exact decimal rank, not float 999.0000000000001
    assert got[99.95] == 1000
    assert got[99.99] == 1000


def test_weighted_percentiles_count_every_key_of_a_batch() -> None:
    # 99 keys at 100 ns carried by one call, 1 key at 10_000 ns in another call.
    values = np.array([10_000, 100], dtype=np.int64)
    weights = np.array([1, 99], dtype=np.int64)
    got = dict(zip(PERCENTILES, weighted_percentiles(values, weights), strict=True))
    assert got[1.0] == 100
    assert got[99.0] == 100
    assert got[99.5] == 10_000
    assert got[99.99] == 10_000


def test_lat_summary_min_max_mean_stddev() -> None:
    values = np.array([2, 4, 4, 4, 5, 5, 7, 9], dtype=np.int64)
    s = lat_summary(values)
    assert (s["min"], s["max"], s["N"]) == (2, 9, 8)
    assert s["mean"] == pytest.approx(5.0)
    assert s["stddev"] == pytest.approx(np.std(values, ddof=1))
    # Weighted equals expanded.
    w = lat_summary(np.array([2, 4, 5, 7, 9]), np.array([1, 3, 2, 1, 1]))
    assert w["mean"] == pytest.approx(s["mean"])
    assert w["stddev"] == pytest.approx(s["stddev"])
    assert w["percentile"] == s["percentile"]


def test_empty_summary() -> None:
    s = lat_summary(np.zeros(0, dtype=np.int64))
    assert s == {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0}


def test_latency_buckets_follow_fio_edges() -> None:
    values = np.array(
        [
            500,  # ns: [500, 750) -> "750"
            1_500,  # 1 us -> us "2"
            45_000,  # 45 us -> "50"
            999_999,  # 999 us -> "1000"
            3_000_000,  # 3 ms -> ms "4"
            1_500_000_000,  # 1500 ms -> "2000"
            2_500_000_000,  # -> ">=2000"
            100,  # ns "250"
        ],
        dtype=np.int64,
    )
    b = latency_buckets(values)
    assert list(b["latency_ms"]) == [
        "2", "4", "10", "20", "50", "100", "250", "500", "750", "1000", "2000", ">=2000",
    ]  # fmt: skip
    assert list(b["latency_us"]) == ["2", "4", "10", "20", "50", "100", "250", "500", "750", "1000"]
    pct = 100.0 / len(values)
    assert b["latency_ns"]["750"] == pytest.approx(pct)
    assert b["latency_ns"]["250"] == pytest.approx(pct)
    assert b["latency_us"]["2"] == pytest.approx(pct)
    assert b["latency_us"]["50"] == pytest.approx(pct)
    assert b["latency_us"]["1000"] == pytest.approx(pct)
    assert b["latency_ms"]["4"] == pytest.approx(pct)
    assert b["latency_ms"]["2000"] == pytest.approx(pct)
    assert b["latency_ms"][">=2000"] == pytest.approx(pct)
    total = sum(sum(d.values()) for d in b.values())
    assert total == pytest.approx(100.0)


def test_latency_buckets_weighted() -> None:
    b = latency_buckets(np.array([30_000, 300_000]), np.array([3, 1]))
    assert b["latency_us"]["50"] == pytest.approx(75.0)
    assert b["latency_us"]["500"] == pytest.approx(25.0)


def test_job_json_carries_fio_field_names() -> None:
    rec = _recorder(list(range(10_000, 20_000, 10)), ios=128)  # 1000 calls of 128 keys
    runtime_ns = 2_000_000_000
    job = job_json("randread-4k", read=rec, runtime_ns=runtime_ns, options={"rw": "randread"})
    report = json.loads(json.dumps(report_json([job])))
    assert report["fio version"] == FIO_VERSION
    assert isinstance(report["timestamp"], int)
    (j,) = report["jobs"]
    assert j["jobname"] == "randread-4k"
    assert (j["groupid"], j["error"]) == (0, 0)
    assert j["job options"] == {"rw": "randread"}
    rd = j["read"]
    assert rd["total_ios"] == 128_000
    assert rd["io_bytes"] == 128_000 * 4096
    assert rd["runtime"] == 2000
    assert rd["iops"] == pytest.approx(64_000.0)
    assert rd["bw_bytes"] == 128_000 * 4096 // 2
    assert rd["bw"] == rd["bw_bytes"] // 1024
    for key in ("clat_ns", "lat_ns"):  # per io = per key: the call's latency / its 128 keys
        lat = rd[key]
        assert list(lat["percentile"]) == FIO_PERCENTILE_KEYS
        assert lat["N"] == 128_000
        assert (lat["min"], lat["max"]) == (10_000 // 128, 19_990 // 128)
        assert lat["percentile"]["50.000000"] == 14_990 // 128
    call = rd["call_lat_ns"]  # per call, over calls
    assert (call["N"], call["min"], call["max"]) == (1000, 10_000, 19_990)
    assert call["percentile"]["50.000000"] == 14_990 and call["keys_per_call"] == 128
    assert rd["slat_ns"]["N"] == 0
    # 1000 calls done 1 ms apart: 2 full 500 ms windows hold 500 calls each, rest none.
    assert rd["iops_samples"] == 4
    assert rd["iops_max"] == 500 * 128 * 2
    assert rd["bw_samples"] == 4
    wr = j["write"]
    assert (wr["total_ios"], wr["io_bytes"], wr["iops"], wr["runtime"]) == (0, 0, 0.0, 0)
    assert j["latency_ns"]["100"] + j["latency_ns"]["250"] == pytest.approx(100.0)
    assert set(j["latency_ms"]) >= {"2000", ">=2000"}


def test_num2str_matches_fio() -> None:
    # fio HOWTO example: "read: IOPS=88, BW=623KiB/s (638kB/s)(30.4MiB/50032msec)"
    assert num2str(88) == "88"
    assert num2str(638_000, pow2=True, unit="B/s") == "623KiB/s"
    assert num2str(638_000, unit="B/s") == "638kB/s"
    assert num2str(31_876_710, pow2=True, unit="B") == "30.4MiB"
    assert num2str(170_123) == "170k"
    assert num2str(25_612) == "25.6k"
    assert num2str(1234, 6) == "1234"


def test_text_block_looks_like_fio() -> None:
    rec = _recorder([45_000] * 800 + [80_000] * 190 + [200_000] * 10)
    job = job_json("randread-4k", read=rec, runtime_ns=1_000_000_000, job_start_ms=0)
    text = format_job_text(job, pid=123)
    lines = text.splitlines()
    assert lines[0].startswith("randread-4k: (groupid=0, jobs=1): err= 0: pid=123: ")
    assert lines[1] == "  read: IOPS=1000, BW=4000KiB/s (4096kB/s)(4000KiB/1000msec)"
    assert lines[2].startswith("    clat (usec): min=45, max=200, avg=")
    assert lines[3].startswith("     lat (usec): min=45, max=200, avg=")
    assert lines[4] == "    clat percentiles (usec):"
    assert lines[5] == "     |  1.00th=[   45],  5.00th=[   45], 10.00th=[   45], 20.00th=[   45],"
    assert "| 99.99th=[  200]" in text
    assert "  lat (usec)   : 50=80.00%, 100=19.00%, 250=1.00%" in lines
    assert "write:" not in text
    assert "    call lat percentiles (usec):" in lines
    assert any(line.startswith("    call lat (usec): min=45, max=200") for line in lines)
    summary = format_report_text(report_json([job]))
    assert "Run status group 0 (all jobs):" in summary
    assert "READ: bw=4000KiB/s (4096kB/s)" in summary


def test_only_concurrent_jobs_share_a_status_group() -> None:
    def job(name: str, group: int) -> dict[str, object]:
        j = job_json(name, read=_recorder([50_000] * 100), runtime_ns=1_000_000_000)
        j["groupid"] = group
        return j

    # two jobs that ran one after another, then two that ran at once (numjobs=2)
    text = format_report_text(report_json([job("a", 0), job("b", 1), job("c.0", 2), job("c.1", 2)]))
    groups = [line for line in text.splitlines() if line.startswith("Run status group")]
    assert groups == [f"Run status group {g} (all jobs):" for g in (0, 1, 2)]
    reads = [line.strip() for line in text.splitlines() if line.strip().startswith("READ:")]
    assert reads[0].startswith("READ: bw=400KiB/s") and reads[1].startswith("READ: bw=400KiB/s")
    assert reads[2].startswith("READ: bw=800KiB/s")  # the concurrent pair is summed


def test_recorder_reset_and_totals() -> None:
    rec = LatencyRecorder()
    rec.record(100, 4, 4 * 4096, 1)
    rec.record(300, 2, 2 * 4096, 2)
    assert (rec.calls, rec.total_ios, rec.io_bytes) == (2, 6, 6 * 4096)
    assert rec.latencies_ns().tolist() == [100, 300]
    rec.reset()
    assert (rec.calls, rec.total_ios, rec.io_bytes) == (0, 0, 0)
    assert len(rec.latencies_ns()) == 0
