"""`kvfs bench --gc`: a tiny run against an in-process cluster; JSON fields, bytes reclaimed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfs.bench import cli as bench_cli
from kvfs.bench import gcbench
from kvfs.cli import build_parser
from kvfs.gc.driver import GarbageCollector
from kvfs.launcher import LocalCluster


def test_gc_options_parse() -> None:
    ns = build_parser().parse_args(["bench", "--gc", "--gc-ttl", "500ms", "--gc-churn-rate", "4m"])
    assert ns.gc and ns.gc_ttl == 0.5 and ns.gc_churn_rate == 4 << 20


async def test_tiny_gc_bench_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcbench, "FG_KEYS", 256)
    ns = build_parser().parse_args([
        "bench", "--gc", "--cluster", "inproc", "--bs", "4k,64k", "--size", "512k",
        "--gc-ttl", "0.2", "--gc-churn-rate", "2m", "--runtime", "0.3", "--no-progress",
        "--output-format", "json", "--dir", str(tmp_path)])
    assert await bench_cli.cmd_bench(ns) == 0
    report = json.loads(capsys.readouterr().out)
    g = report["kvfs gc bench"]
    assert [r["bs"] for r in g["reclaim"]] == [4096, 65536]
    for r in g["reclaim"]:
        assert r["expired_keys"] == r["keys"] == (512 << 10) // r["bs"]
        assert r["bytes_reclaimed"] > 0 and r["chunks_deleted"] >= 1
        assert r["du_after"] < r["du_before"]
        for k in ("keys_per_s", "mb_per_s", "logical_mb_per_s", "pass_s", "expire_wait_s"):
            assert r[k] >= 0
    assert [p["phase"] for p in g["foreground"]] == ["idle", "churn, gc off", "churn + gc"]
    for p in g["foreground"]:
        assert p["p99_us"] >= p["p50_us"] > 0
        assert p["missing"] == 0
    assert g["foreground"][0]["background"] is None
    assert g["foreground"][1]["background"]["gc_passes"] == 0
    assert g["foreground"][2]["background"]["gc_passes"] >= 1
    assert g["p99_ratio_gc_vs_idle"] > 0 and g["p99_ratio_gc_vs_churn"] > 0
    assert len(report["jobs"]) == 3
    text = gcbench.render(report)
    assert "GC reclaim" in text and "churn + gc" in text


async def test_gc_bench_reclaims_overwritten_keys_with_tombstones(tmp_path: Path) -> None:
    """``--gc-overwrite``: each key put without a TTL, then overwritten with one; the pass
    expires every one, with a tombstone (its first value would outlive it)."""
    assert build_parser().parse_args(["bench", "--gc", "--gc-overwrite"]).gc_overwrite
    async with LocalCluster(tmp_path / "c", 3) as cluster:
        r = await gcbench.reclaim(cluster.addr, cluster.admin_token, tmp_path / "c", 4096, 64, 0.2,
                                  overwrite=True)
        assert r["overwrite"] and r["expired_keys"] == 64
        meta = cluster.meta
        assert meta is not None
        async with GarbageCollector(cluster.addr, token=cluster.admin_token) as gc:
            dropped = (await gc.status())["metrics"]["tombstones_dropped"]  # (all older records gone)
        assert len(meta.index.tombstones) + dropped == 64  # type: ignore[union-attr]


async def test_wait_expired_has_a_deadline(tmp_path: Path) -> None:
    async with LocalCluster(tmp_path / "c", 3) as cluster:
        kv = cluster.client()
        async with kv:
            await kv.put_many([(b"k0", b"v"), (b"k1", b"v")])
            with pytest.raises(gcbench.BenchError):
                await gcbench.wait_expired(kv, [b"k0", b"k1"], deadline_s=0.1)
