"""The meta store benches run end to end, small (figures: bench/RESULTS.md)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from kvfs import rpc
from kvfs.bench import commit_cost, metas, metastore, redis_reads

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _redis_installed() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")


@pytest.mark.parametrize("store", ["redis", "sqlite", "rocksdb"])
async def test_metastore_bench_reports_every_op(store: str) -> None:
    res = await metastore.run(store, None, 2000, [1, 16], 0.01, 16)
    assert res["keys"] == 2000
    if store == "redis":  # Redis's used_memory grows with every key
        assert res["bytes_per_key"] > 0
    else:  # in-process RSS growth may be 0 where earlier tests warmed the heap, or below 0
        # where their garbage is freed during the fill (seen after test_redis_index.py); the
        # store on disk grows
        assert isinstance(res["bytes_per_key"], float)
        assert res["sqlite_file_bytes" if store == "sqlite" else "rocksdb_bytes"] > 0
    assert [(o["op"], o["batch"]) for o in res["ops"]] == [
        (op, b) for b in (1, 16) for op in ("commit", "lookup", "match_prefix", "overwrite")]
    assert all(o["keys_per_s"] > 0 for o in res["ops"])


async def test_sqlite_bench_commits_the_packed_form_the_client_sends(tmp_path: Path) -> None:
    """The SQLite half drives meta's COMMIT handler with the request a client sends
    (WritePath.commit: layouts packed in columns), not the nested items form."""
    store = metastore.LocalMeta(tmp_path)
    seen: list[rpc.Commit] = []
    handler = store.meta.rpc_commit

    async def spy(req: rpc.Commit, payload: memoryview) -> Any:
        seen.append(req)
        return await handler(req, payload)

    store.meta.rpc_commit = spy  # type: ignore[method-assign]
    await store.open()
    try:
        await metastore.fill(store, 10, 4, "p")
        assert [(r.items, r.packed is not None) for r in seen] == [([], True)] * 3
        got, _ = await store.lookup([metastore.key(i, "p") for i in range(10)], metastore.NOW)
        assert [lay.size for lay in got.layouts] == [metastore.layout(i).size for i in range(10)]
    finally:
        await store.close()


async def test_metas_bench_runs_one_and_two_metas() -> None:
    res = await metas.run([1, 2], keys=500, clients=2, batch=16, seconds=0.3)
    assert [n for n, _ in res] == [1, 2]
    assert all(rate > 0 for _, rate in res)


async def test_commit_cost_bench_times_new_keys_and_overwrites() -> None:
    res = await commit_cost.run(2000, [1, 16], 0.01, 64)
    assert res["keys"] == 2000 and res["bytes_per_key"] > 0
    assert [(o["op"], o["batch"]) for o in res["ops"]] == [
        (op, b) for b in (1, 16) for op in ("new", "overwrite")]
    assert all(o["wall_us_per_key"] > 0 and o["redis_cpu_us_per_key"] >= 0 for o in res["ops"])


async def test_redis_reads_bench_reads_what_each_read_names() -> None:
    res = await redis_reads.run([1000, 3000], 1)
    small, big = res["rows"]
    assert (small["scan_every_key"]["result"], big["scan_every_key"]["result"]) == (1000, 3000)
    assert big["key_stats"]["result"] == [3000, 3000, 300_000]
    assert small["refs_one_chunk"]["result"] == big["refs_one_chunk"]["result"] == 1000
    assert big["refs_one_server"]["result"] == 1000  # chunk 1 on server 2; chunks 2, 3 elsewhere
