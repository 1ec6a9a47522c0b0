"""The bench's durability settings: the embedded cluster's ``--fsync``, fio's synced write row,
and targets.py judging each put target on the run made with the setting it names."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kvfs.bench
from kvfs.bench import cli as bench_cli
from kvfs.bench.compare import FIO_COLUMN, fio_write_args
from kvfs.bench.peers import run_fio_file
from kvfs.bench.runner import Workload
from kvfs.bench.target import open_target
from kvfs.cli import build_parser
from kvfs.config import FsyncMode

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")


def _ns(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_fsync_option_defaults_to_the_servers_default() -> None:
    assert _ns().fsync is FsyncMode.BATCH
    assert _ns("--fsync", "never").fsync is FsyncMode.NEVER
    with pytest.raises(SystemExit):
        _ns("--fsync", "sometimes")


async def test_fsync_with_addr_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    ns = _ns("--fsync", "never", "--addr", "kvfs://127.0.0.1:1", "--no-progress")
    assert await bench_cli.cmd_bench(ns) == 2
    assert "--fsync sets the embedded cluster's" in capsys.readouterr().err


async def test_inproc_cluster_runs_with_the_fsync_asked(tmp_path: Path) -> None:
    async with open_target(_ns("--cluster", "inproc", "--fsync", "never"), tmp_path) as target:
        c = target.cluster
        assert c.meta.config.fsync is FsyncMode.NEVER
        assert [cs.store.fsync for cs in c.chunkservers] == [FsyncMode.NEVER] * 3
    async with open_target(_ns("--cluster", "inproc"), tmp_path / "default") as target:
        assert [cs.store.fsync for cs in target.cluster.chunkservers] == [FsyncMode.BATCH] * 3


@pytest.mark.subprocess
async def test_process_cluster_children_get_the_fsync_asked(tmp_path: Path) -> None:
    async with open_target(_ns("--fsync", "never", "--chunkservers", "2"), tmp_path) as target:
        pids = target.server_pids()
        assert set(pids) == {"meta", "cs0", "cs1"}
        for pid in pids.values():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            i = argv.index(b"--fsync")
            assert argv[i + 1] == b"never"


async def test_report_names_the_clusters_fsync(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ns = _ns("--cluster", "inproc", "--fsync", "never", "--rw", "write", "--bs", "4k", "--batch", "4",
             "--size", "32k", "--runtime", "0.2", "--dir", str(tmp_path), "--output-format", "json",
             "--no-progress")
    assert await bench_cli.cmd_bench(ns) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["global options"]["fsync"] == "never"
    assert report["jobs"][0]["write"]["total_ios"] == 8


def test_fio_write_args_sync_once_per_batch() -> None:
    def wl(rw: Any, batch: int) -> Workload:
        return Workload(name="x", rw=rw, bs=1 << 20, batch=batch, nkeys=64)

    assert fio_write_args(wl("write", 32)) == ["--fdatasync=32"]
    assert fio_write_args(wl("randwrite", 8)) == ["--fdatasync=8"]
    assert fio_write_args(wl("randread", 32)) == []
    assert fio_write_args(wl("read", 32)) == []
    assert fio_write_args(wl("randrw", 2)) == ["--rwmixread=50", "--fdatasync=2"]


@needs_fio
def test_fio_write_row_really_syncs(tmp_path: Path) -> None:
    """fio's own counters: one fdatasync per batch of 4 writes, none without the option."""
    w = Workload(name="w", rw="write", bs=64 << 10, batch=4, nkeys=16)
    # not time based: each job ends after its 1 MiB; the runtime is only fio's cap (at 0.2 s a
    # loaded machine's synced job stopped after 4 of its 16 writes)
    synced = run_fio_file("64k", "1m", "write", 30.0, tmp_path, time_based=False,
                          extra_args=fio_write_args(w))["jobs"][0]
    plain = run_fio_file("64k", "1m", "write", 30.0, tmp_path, time_based=False)["jobs"][0]
    assert synced["write"]["total_ios"] == 16 == plain["write"]["total_ios"]
    assert synced["sync"]["lat_ns"]["N"] >= 16 // 4 - 1  # fio leaves the last one to close
    assert plain["sync"]["lat_ns"]["N"] == 0


# --- targets.py -----------------------------------------------------------------------------------

def _targets() -> ModuleType:
    path = Path(kvfs.bench.__file__).parent / "results" / "targets.py"
    spec = importlib.util.spec_from_file_location("bench_targets", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_run(root: Path, name: str, fsync: str | None, rates: dict[str, float]) -> None:
    """A cmp-*.json with one write job per store (MB/s given), as compare.to_json writes it."""
    def job(mbs: float) -> dict[str, Any]:
        return {"jobname": "write-1m-b32", "write": {"total_ios": 100, "iops": mbs / 1.048576,
                                                       "bw_bytes": mbs * 1e6}}

    stores = {s: {"report": {"jobs": [job(r)]}, "skipped": {}} for s, r in rates.items()}
    opts = {"numjobs": "1"} | ({"fsync": fsync} if fsync is not None else {})
    root.joinpath(name).write_text(json.dumps(
        {"global options": opts, "kvfs compare": {"peers": {"subject": "kvfs", "stores": stores}}}))


def _put_rows(rows: list[tuple[str, str, str]]) -> dict[str, tuple[str, str]]:
    return {label: (text, v) for label, text, v in rows if label.startswith("put_many") and "1m" in label}


def test_targets_judge_each_put_target_on_the_run_with_its_durability(tmp_path: Path) -> None:
    t = _targets()
    _write_run(tmp_path, "cmp-1m.json", "never", {"kvfs": 900.0, "mooncake": 600.0, FIO_COLUMN: 4000.0})
    _write_run(tmp_path, "cmp-1m-durable.json", "batch", {"kvfs": 500.0, FIO_COLUMN: 800.0})
    rows = _put_rows(t.rows(tmp_path))
    (moon,) = [v for k, v in rows.items() if "Mooncake" in k]
    (disk,) = [v for k, v in rows.items() if "fio" in k]
    assert moon == ("900 vs 600 MB/s: 1.50x", "met")
    assert disk == ("500 vs 800 MB/s: 0.62x", "missed")  # against the synced fio row, not 4000


def test_targets_say_the_small_free_blocks_of_the_kvfs_put_job(tmp_path: Path) -> None:
    """Where the kvfs put job's JSON has the small free blocks it ran with (bench --cpu), the
    put row against Mooncake says them beside its figures; the verdict is the ratio's alone."""
    t = _targets()
    _write_run(tmp_path, "cmp-1m.json", "never", {"kvfs": 500.0, "mooncake": 1000.0})
    path = tmp_path / "cmp-1m.json"
    report = json.loads(path.read_text())
    report["kvfs compare"]["peers"]["stores"]["kvfs"]["report"]["jobs"][0]["kvfs"] = {
        "small_free_mib": [620, 615]}
    path.write_text(json.dumps(report))
    (moon,) = [v for k, v in _put_rows(t.rows(tmp_path)).items() if "Mooncake" in k]
    assert moon == ("500 vs 1000 MB/s: 0.50x (kvfs's small free blocks 620->615 MiB)", "missed")
    # a row not judged (no Mooncake row) says why, and nothing else
    del report["kvfs compare"]["peers"]["stores"]["mooncake"]
    path.write_text(json.dumps(report))
    (moon,) = [v for k, v in _put_rows(t.rows(tmp_path)).items() if "Mooncake" in k]
    assert moon == ("mooncake: not in the run", "not measured")


def test_targets_refuse_a_run_with_the_wrong_durability(tmp_path: Path) -> None:
    t = _targets()
    # no "fsync" recorded: a run from before the option, whose cluster ran the default (batch)
    _write_run(tmp_path, "cmp-1m.json", None, {"kvfs": 900.0, "mooncake": 600.0})
    _write_run(tmp_path, "cmp-1m-durable.json", "never", {"kvfs": 900.0, FIO_COLUMN: 800.0})
    rows = _put_rows(t.rows(tmp_path))
    (moon,) = [v for k, v in rows.items() if "Mooncake" in k]
    (disk,) = [v for k, v in rows.items() if "fio" in k]
    assert moon == ("cmp-1m.json ran --fsync batch; this target needs --fsync never", "not measured")
    assert disk == ("cmp-1m-durable.json ran --fsync never; this target needs --fsync batch",
                    "not measured")
