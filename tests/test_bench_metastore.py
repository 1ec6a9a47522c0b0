"""The meta store benches run end to end, small (figures: bench/RESULTS.md)."""

from __future__ import annotations

import shutil

import pytest

from kvfs.bench import metas, metastore

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _redis_installed() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")


@pytest.mark.parametrize("store", ["redis", "sqlite"])
async def test_metastore_bench_reports_every_op(store: str) -> None:
    res = await metastore.run(store, None, 2000, [1, 16], 0.01, 16)
    assert res["keys"] == 2000
    if store == "redis":  # Redis's used_memory grows with every key
        assert res["bytes_per_key"] > 0
    else:  # in-process RSS growth may be 0 where earlier tests warmed the heap; the file grows
        assert res["bytes_per_key"] >= 0 and res["sqlite_file_bytes"] > 0
    assert [(o["op"], o["batch"]) for o in res["ops"]] == [
        (op, b) for b in (1, 16) for op in ("commit", "lookup", "match_prefix")]
    assert all(o["keys_per_s"] > 0 for o in res["ops"])


async def test_metas_bench_runs_one_and_two_metas() -> None:
    res = await metas.run([1, 2], keys=500, clients=2, batch=16, seconds=0.3)
    assert [n for n, _ in res] == [1, 2]
    assert all(rate > 0 for _, rate in res)
