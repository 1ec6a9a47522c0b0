"""`kvfs bench`: option parsing, a tiny job against an in-process cluster, fio JSON fields."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvfs.bench import cli as bench_cli
from kvfs.bench import internal, jobs, render
from kvfs.bench.plot import plot
from kvfs.bench.stats import format_job_text
from kvfs.bench.target import BenchTarget
from kvfs.cli import build_parser
from kvfs.launcher import LocalCluster

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False

TINY = ["--size", "256k", "--runtime", "1", "--no-progress"]


def _ns(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_fio_option_names_parse() -> None:
    ns = _ns("--rw=randread,write", "--bs=4k,64k,1m,16m", "--iodepth=8", "--numjobs=2",
             "--size=1m", "--runtime=2", "--time_based", "--ramp_time=1", "--batch=16",
             "--prefix-chain=4", "--output-format=json", "--compare", "--plot", "x.png",
             "--addr", "kvfs://127.0.0.1:1", "--token-file", "t")
    assert ns.rw == ["randread", "write"]
    assert ns.bs == [4096, 65536, 1 << 20, 16 << 20]
    assert (ns.iodepth, ns.numjobs, ns.size, ns.runtime) == (8, 2, 1 << 20, 2.0)
    assert ns.time_based and ns.ramp_time == 1.0 and ns.batch == 16 and ns.prefix_chain == 4
    assert ns.output_format == "json" and ns.compare and ns.plot == Path("x.png")
    wls = jobs.build_workloads(ns)
    assert len(wls) == 8
    reads = [w for w in wls if w.reads]
    assert all(w.batch == 4 and w.rw == "read" and w.nkeys % 4 == 0 for w in reads)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--rw=sideways"])
    assert {w.random_distribution for w in wls} == {"random"}
    (w,) = jobs.build_workloads(_ns("--rw=randrw", "--bs=4k", "--random_distribution=zipf:1.1"))
    assert w.random_distribution == "zipf:1.1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--random_distribution=zipf:x"])


def test_default_job_set() -> None:
    wls = jobs.build_workloads(_ns())
    got = [(w.rw, w.bs, w.batch) for w in wls]
    assert got == [(rw, bs, b) for rw, bs, b, _, _ in jobs.DEFAULT_JOBS]
    assert all(w.time_based for w in wls)


async def test_tiny_json_run_has_fio_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = _ns("--rw=randread,write", "--bs=4k", "--batch=8", "--output-format=json",
             "--dir", str(tmp_path), *TINY)
    assert await bench_cli.cmd_bench(ns) == 0
    report = json.loads(capsys.readouterr().out)
    assert "fio version" in report
    jobs = report["jobs"]
    assert [j["job options"]["rw"] for j in jobs] == ["randread", "write"]
    for job, ddir in zip(jobs, ("read", "write"), strict=True):
        d = job[ddir]
        assert d["total_ios"] == 64  # one pass over 256k / 4k keys
        assert d["io_bytes"] == 64 * 4096
        assert d["iops"] > 0 and d["bw_bytes"] > 0 and d["runtime"] >= 0
        pct = d["clat_ns"]["percentile"]
        assert {"1.000000", "50.000000", "99.000000", "99.990000"} <= set(pct)
        assert job["error"] == 0 and job["kvfs"]["missing"] == 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    plot(jobs, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


async def test_text_output_against_running_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with LocalCluster(tmp_path / "c", 3) as cluster:
        ns = _ns("--rw=read", "--bs=64k", "--prefix-chain=4", "--addr", cluster.addr,
                 "--token-file", str(tmp_path / "c" / "token"), "--size", "256k", "--time_based",
                 "--runtime", "0.3", "--no-progress")
        assert await bench_cli.cmd_bench(ns) == 0
    out = capsys.readouterr().out
    assert "read-64k-b4-chain4: (groupid=0, jobs=1)" in out
    assert "read: IOPS=" in out and "clat percentiles (usec)" in out
    assert "Run status group 0 (all jobs):" in out


async def test_plot_without_matplotlib_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    ns = _ns("--plot", str(tmp_path / "p.png"), *TINY)
    assert await bench_cli.cmd_bench(ns) == 2
    assert "matplotlib" in capsys.readouterr().err


async def test_internal_comparisons_count_server_reads(tmp_path: Path) -> None:
    async with LocalCluster(tmp_path / "c", 3) as cluster:
        target = BenchTarget(cluster.addr, cluster.token, cluster, "inproc")
        result = await internal.run_internal(target, runtime_s=0.2, progress=False, nchains=2,
                                             get_keys=256)
    assert result.batcher is not None and result.chains is not None
    assert result.batcher.cell("get128", "batcher on").result is not None
    per_chain = result.chain_reads["chain put_many"].per_chain()
    assert per_chain is not None and len(per_chain) == 3
    text = render.render_internal(result)
    assert "chain put_many" in text


def test_unknown_peer_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _ns("--compare", "--peers", "nosuch")
    assert "unknown peer 'nosuch'" in capsys.readouterr().err


async def test_tiny_comparison_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ns = _ns("--compare", "--cluster", "inproc", "--peers", "file,loopback", "--no-internal",
             "--bs", "4k", "--batch", "4", "--size", "64k", "--runtime", "0.2",
             "--rw", "randread,write",
             "--dir", str(tmp_path), "--output-format", "json", "--no-progress",
             *(["--plot", str(tmp_path / "c.png")] if HAVE_MPL else []))
    assert await bench_cli.cmd_bench(ns) == 0
    if HAVE_MPL:  # the run's plot, and one bar chart per workload family
        for name in ("c.png", "c-reads.png", "c-writes.png"):
            assert (tmp_path / name).stat().st_size > 0
    report = json.loads(capsys.readouterr().out)
    peers = report["kvfs compare"]["peers"]
    assert peers["subject"] == "kvfs" and list(peers["stores"]) == ["kvfs", "file", "loopback"]
    assert peers["stores"]["file"]["report"]["jobs"][0]["jobname"] == "randread-4k-b4"
    assert peers["ratios"]["randread-4k-b4"]["file"] is not None


def test_cpu_seconds_reads_a_process_own_counters() -> None:
    from kvfs.bench.cpu import CpuProbe, cpu_seconds

    assert cpu_seconds(os.getpid()) is not None
    assert cpu_seconds(-1) is None
    probe = CpuProbe({"me": os.getpid(), "gone": -1})
    probe.start()
    sum(i * i for i in range(3_000_000))  # burn some CPU (bounded by count)
    probe.stop()
    rep = probe.report(keys=1000, nbytes=10**9)
    assert set(rep) == {"me"}  # a process that cannot be read is left out, not guessed
    assert rep["me"]["cpu_s"] > 0
    assert rep["me"]["us_per_key"] == pytest.approx(rep["me"]["cpu_s"] * 1e6 / 1000)
    assert rep["me"]["s_per_gb"] == pytest.approx(rep["me"]["cpu_s"])
    # per second of the phase: the CPU it used, and how long it waited for one
    assert rep["me"]["cpus"] > 0
    assert rep["me"]["wait_cpus"] is not None and rep["me"]["wait_cpus"] >= 0


def test_machine_cpu_counts_at_least_this_process_busy() -> None:
    """The machine's busy CPU seconds (``/proc/stat``) grow by at least what this process
    spent meanwhile: every process's time is in them."""
    from kvfs.bench.cpu import cpu_seconds, machine_cpu_seconds

    t0, busy0, mine0 = time.monotonic(), machine_cpu_seconds(), cpu_seconds(os.getpid())
    sum(i * i for i in range(3_000_000))  # burn some CPU (bounded by count)
    busy1, mine1, t1 = machine_cpu_seconds(), cpu_seconds(os.getpid()), time.monotonic()
    assert None not in (busy0, busy1, mine0, mine1)
    assert mine1 > mine0  # type: ignore[operator]
    tick = 1 / os.sysconf("SC_CLK_TCK")  # both count clock ticks: one of slack per reading
    assert busy1 - busy0 >= mine1 - mine0 - 2 * tick  # type: ignore[operator]
    # and no idle time: at most every CPU busy for the whole while
    assert busy1 - busy0 <= ((t1 - t0) + 2 * tick) * (os.cpu_count() or 1)  # type: ignore[operator]


def test_small_free_counts_the_free_blocks_under_the_reporting_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The free memory in blocks smaller than free page reporting hands back (orders below
    ``page_reporting_order``, every zone summed); None without free page reporting."""
    from kvfs.bench import cpu

    order, buddy = tmp_path / "order", tmp_path / "buddyinfo"
    order.write_text("9\n")
    # 11 orders a zone; only orders 0-8 count: 256 order-0 pages, 256 order-1 blocks of 2 pages,
    # and order-8 blocks of 256 pages (3 in Normal, 1 in DMA)
    buddy.write_text("Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3\n"
                     "Node 0, zone   Normal    256    256      0      0      0      0      0      0      3    999    999\n")
    monkeypatch.setattr(cpu, "_REPORTING_ORDER", str(order))
    monkeypatch.setattr(cpu, "_BUDDYINFO", str(buddy))
    pages = 256 + 256 * 2 + 3 * 256 + 1 * 256  # the DMA zone's order-8 block too
    assert cpu.small_free_mib() == pages * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    order.write_text("3\n")  # a lower reporting order counts fewer orders
    small = (256 + 512) * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    assert cpu.small_free_mib() == small
    assert cpu.free_text().endswith(f" MiB, small blocks {small:,} MiB")
    monkeypatch.setattr(cpu, "_REPORTING_ORDER", str(tmp_path / "none"))  # no free page reporting
    assert cpu.small_free_mib() is None
    monkeypatch.setattr(cpu, "_REPORTING_ORDER", str(order))
    order.write_text("4294967295\n")  # built in, no driver registered: the kernel's -1
    assert cpu.small_free_mib() is None
    assert cpu.free_text().endswith(" MiB") and "small blocks" not in cpu.free_text()


def test_job_text_says_the_small_free_blocks_when_measured() -> None:
    with_small = format_job_text({"jobname": "j", "kvfs": {"mem_free_mib": [20000, 19000],
                                                          "small_free_mib": [5000, 4100]}})
    assert "  memory: MemFree 20000->19000 MiB, of it in small blocks 5000->4100 MiB (measured phase)" \
        in with_small
    without = format_job_text({"jobname": "j", "kvfs": {"mem_free_mib": [20000, 19000]}})
    assert "  memory: MemFree 20000->19000 MiB (measured phase)" in without


@contextlib.contextmanager
def _spinners(n: int = 2) -> Iterator[tuple[list[int], Callable[[], None]]]:
    """``n`` processes pinned to one CPU: their pids, and ``run()``, which has them all spin
    (a bounded count) at once and returns when each has finished; they exit with the block."""
    cpu = min(os.sched_getaffinity(0))
    spin = (f"import os, sys; os.sched_setaffinity(0, {{{cpu}}}); sys.stdin.readline(); "
            "sum(i * i for i in range(3_000_000)); print('done', flush=True); sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]

    def run() -> None:
        for p in procs:  # every one starts spinning now, on the same CPU
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "done\n"

    try:
        yield [p.pid for p in procs], run
    finally:
        for p in procs:
            p.communicate("", timeout=30)


def test_cpu_probe_reports_the_cpus_a_process_waited_for() -> None:
    """Two processes spinning on one CPU during the phase: between them they use at most that
    CPU, and each waits while the other runs; the probe reports both per second of the phase."""
    from kvfs.bench.cpu import CpuProbe

    with _spinners() as (pids, run):
        probe = CpuProbe({f"p{i}": pid for i, pid in enumerate(pids)})
        probe.start()
        run()
        probe.stop()
    rep = probe.report(keys=1, nbytes=1)
    # one CPU between them (two unpinned would use ~2): /proc's tick-sampled CPU times over a
    # phase of ~0.6 s read up to 1.11 under load here
    assert sum(r["cpus"] for r in rep.values()) <= 1.3
    assert all(r["cpus"] > 0 for r in rep.values())
    assert sum(r["wait_cpus"] for r in rep.values()) > 0.2  # one waited while the other ran


def test_run_queue_wait_counts_time_runnable_without_a_cpu() -> None:
    """Two processes spinning on one CPU each wait while the other runs: that wait is read
    from their threads' schedstat; a process that cannot be read gives None."""
    from kvfs.bench.cpu import run_queue_wait_s

    assert run_queue_wait_s(-1) is None
    with _spinners() as (pids, run):
        run()
        waits = [run_queue_wait_s(pid) for pid in pids]
    assert all(w is not None for w in waits)
    assert sum(w for w in waits if w is not None) > 0


@pytest.mark.subprocess
async def test_cpu_per_process_of_a_process_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = _ns("--cpu", "--rw=write", "--bs=64k", "--batch=8", "--size=2m", "--runtime=0.5",
             "--dir", str(tmp_path), "--no-progress")
    assert await bench_cli.cmd_bench(ns) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("  cpu (per process")]
    for name in ("client", "meta", "cs0", "cs1", "cs2"):  # each with its CPUs used / waited
        assert re.search(rf"\b{name}=[^,]*us/key [^,]*s/GB \d+\.\d\d/\d+\.\d\dCPU", line), name


@pytest.mark.subprocess
async def test_lookups_and_blocking_client_against_a_process_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--api exists_many,match_prefix and --client async,sync: every kvfs row has numbers."""
    ns = _ns("--compare", "--peers", "redis,loopback", "--no-internal", "--rw", "randread",
             "--bs", "4k", "--batch", "8", "--size", "64k", "--runtime", "0.3",
             "--api", "get_many,exists_many,match_prefix", "--client", "async,sync",
             "--dir", str(tmp_path), "--output-format", "json", "--no-progress",
             *(["--plot", str(tmp_path / "c.png")] if HAVE_MPL else []))
    assert await bench_cli.cmd_bench(ns) == 0
    if HAVE_MPL:  # lookups get a bar chart of their own (keys/s: they move no value bytes)
        assert (tmp_path / "c-lookups.png").stat().st_size > 0
    peers = json.loads(capsys.readouterr().out)["kvfs compare"]["peers"]
    assert list(peers["stores"]) == ["kvfs", "kvfs-sync", "redis", "loopback"]
    names = ["randread-4k-b8", "randread-4k-b8-exists", "randread-4k-b8-match"]
    for store in ("kvfs", "kvfs-sync"):
        jobs = {j["jobname"]: j for j in peers["stores"][store]["report"]["jobs"]}
        assert list(jobs) == names
        for name in names:
            read = jobs[name]["read"]
            assert read["total_ios"] == 16 and read["iops"] > 0  # one pass over 64k / 4k keys
            assert jobs[name]["error"] == 0 and jobs[name]["kvfs"]["missing"] == 0
        assert jobs["randread-4k-b8-exists"]["read"]["io_bytes"] == 0  # lookups move no values
        assert jobs["randread-4k-b8-exists"]["job options"]["api"] == "exists_many"
    assert peers["ratios"]["randread-4k-b8-match"]["kvfs-sync"] is not None
    # the loopback limit has no lookups: skipped for those rows only, with the reason
    assert peers["stores"]["loopback"]["skipped"] == {
        "randread-4k-b8-exists": "no exists_many API", "randread-4k-b8-match": "no match_prefix API"}
    redis = peers["stores"]["redis"]
    if "randread-4k-b8" not in redis["skipped"]:  # redis-server installed: pipelined EXISTS ran
        assert [j["jobname"] for j in redis["report"]["jobs"]] == names


@pytest.mark.subprocess
async def test_blocking_client_plain_run_names_its_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = _ns("--rw", "randread,write", "--bs", "4k", "--batch", "8", "--size", "64k",
             "--api", "match_prefix", "--client", "sync", "--output-format", "json",
             "--dir", str(tmp_path), "--runtime", "0.3", "--no-progress")
    assert await bench_cli.cmd_bench(ns) == 0
    report = json.loads(capsys.readouterr().out)
    assert [j["jobname"] for j in report["jobs"]] == ["randread-4k-b8-match-sync", "write-4k-b8-sync"]
    assert report["global options"]["client"] == "sync"
    assert all(j["error"] == 0 and j["read" if j["jobname"].startswith("randread") else "write"][
        "total_ios"] == 16 for j in report["jobs"])


async def test_reclaim_deletes_the_bench_keys_and_their_chunks(tmp_path: Path) -> None:
    """--reclaim's step: every key of the bench's namespace goes, and with it the chunks it
    leaves without live bytes (their files unlinked); a key outside the namespace stays readable."""
    from kvfs import AsyncClient
    from kvfs.bench.runner import KEY_NAMESPACE, make_keys

    async with LocalCluster(tmp_path / "c", 3) as cluster:
        target = BenchTarget(cluster.addr, cluster.token, cluster, "inproc", cluster.admin_token)
        keys = make_keys(KEY_NAMESPACE + b"w/", 16)
        value = b"x" * (64 << 10)
        async with AsyncClient(cluster.addr, token=cluster.token) as kv:
            for _ in range(3):  # overwritten: older records are garbage already
                await kv.put_many([(k, value) for k in keys])
            await kv.put(b"user/k", b"kept")

            def on_disk() -> int:
                return sum(f.stat().st_size for f in (tmp_path / "c").rglob("*") if f.is_file()
                           and "meta" not in f.parts[-2:])

            before = on_disk()
            got = await target.reclaim()
            assert got.keys == len(keys) and got.chunks >= 1 and got.bytes >= 3 * len(keys) * len(value)
            assert before > got.bytes // 2 and on_disk() < 64 << 10  # left: "kept", the tombstones
            assert not any(await kv.exists_many(keys))
            assert await kv.get(b"user/k") == b"kept"
        assert (await target.reclaim()).keys == 0  # nothing left to delete
    with pytest.raises(ValueError, match="embedded"):
        await BenchTarget("kvfs://127.0.0.1:1", None).reclaim()


async def test_reclaim_is_refused_against_a_running_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    ns = _ns("--reclaim", "--addr", "kvfs://127.0.0.1:1", *TINY)
    assert await bench_cli.cmd_bench(ns) == 2
    assert "--reclaim" in capsys.readouterr().err
    assert _ns(*TINY).reclaim is None  # default: on for an embedded cluster (cmd_bench decides)


async def test_cpu_jobs_carry_the_small_free_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With --cpu each job's JSON has the small free blocks at both ends of its measured phase
    (bench.cpu.small_free_mib, here read from a fixed /proc/buddyinfo), and its text says them."""
    from kvfs.bench import cpu

    (tmp_path / "order").write_text("1\n")  # only order-0 blocks count: 512 pages
    (tmp_path / "buddyinfo").write_text("Node 0, zone   Normal    512      7      7\n")
    monkeypatch.setattr(cpu, "_REPORTING_ORDER", str(tmp_path / "order"))
    monkeypatch.setattr(cpu, "_BUDDYINFO", str(tmp_path / "buddyinfo"))
    mib = 512 * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    ns = _ns("--cluster", "inproc", "--rw=write", "--bs=4k", "--batch=8", "--cpu",
             "--output-format=json", "--dir", str(tmp_path / "d"), *TINY)
    assert await bench_cli.cmd_bench(ns) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    assert job["kvfs"]["small_free_mib"] == [mib, mib]
    assert f", of it in small blocks {mib}->{mib} MiB (measured phase)" in format_job_text(job)


async def test_plain_run_reclaims_before_each_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ns = _ns("--cluster", "inproc", "--rw=write,randread", "--bs=4k", "--batch=8", "--cpu",
             "--dir", str(tmp_path), *TINY)
    assert await bench_cli.cmd_bench(ns) == 0
    out = capsys.readouterr()
    assert out.err.count("  reclaimed ") == 2  # before each job
    assert out.err.count("reclaimed 64 keys") == 1  # the first job's 256k / 4k keys, before the second
    assert out.out.count("  memory: MemFree ") == 2  # each job's free memory, with --cpu
