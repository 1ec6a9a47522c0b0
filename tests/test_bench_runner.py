"""kvfs.bench.runner and kvfs.bench.compare against in-memory stores (no timing asserts)."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from typing import Any, cast

import pytest

from kvfs.bench.adapters import kvfs_store
from kvfs.bench.compare import Comparison, StoreFactory, compare
from kvfs.bench.peers import LoopbackLimit, PeerUnavailable, Store
from kvfs.bench.runner import (
    RW,
    BenchError,
    Workload,
    _KeyStream,
    format_eta,
    make_keys,
    progress_text,
    run_workload,
)


class MemStore:
    """A dict behind the Store interface; counts calls."""

    def __init__(self, name: str = "mem") -> None:
        self.name = name
        self.data: dict[bytes, bytes] = {}
        self.put_calls = 0
        self.get_calls = 0
        self.closed = False

    async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        self.put_calls += 1
        self.data.update(items)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        self.get_calls += 1
        return [self.data.get(k) for k in keys]

    async def close(self) -> None:
        self.closed = True


class FakeKvfsClient:
    """Shaped like the kvfs client API: put_many(dict), get_many(list)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    async def put_many(self, items: dict[bytes, bytes]) -> None:
        self.data.update(items)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.data.get(k) for k in keys]


def test_workload_validation() -> None:
    with pytest.raises(ValueError, match="rw"):
        Workload(name="x", rw=cast(Any, "trim"))
    with pytest.raises(ValueError, match="batch"):
        Workload(name="x", batch=10, nkeys=5)
    with pytest.raises(ValueError, match="runtime_s"):
        Workload(name="x", runtime_s=0)
    assert Workload(name="x", bs=4096, nkeys=10).size_bytes == 40960


def test_zipf_draws_keys_by_popularity_and_random_each_once_a_pass() -> None:
    """``random`` (fio's): every key once a pass, in a fresh order.  ``zipf:1.2``: a few keys
    asked for again and again, as a cache sees them, each call's keys distinct."""
    uniform = _KeyStream(1000, 8, True, seed=3)
    one_pass = [i for _ in range(125) for i in uniform.next()]
    assert sorted(one_pass) == list(range(1000))
    zipf = _KeyStream(1000, 8, True, seed=3, zipf=1.2)
    batches = [zipf.next() for _ in range(500)]
    assert all(len(set(b)) == 8 and all(0 <= i < 1000 for i in b) for b in batches)
    counts = sorted(Counter(i for b in batches for i in b).values(), reverse=True)
    assert sum(counts[:10]) > 0.25 * 4000, counts[:10]  # the top 1 % of keys: over a quarter
    assert len(counts) < 900  # many keys never asked for
    with pytest.raises(ValueError, match="THETA"):
        Workload(name="x", random_distribution="zipf:0")
    with pytest.raises(ValueError, match="random or zipf"):
        Workload(name="x", random_distribution="pareto:0.5")
    assert Workload(name="x", random_distribution="zipf:1.2").job_options()["random_distribution"] == "zipf:1.2"


def test_keys_are_distinct() -> None:
    keys = make_keys(b"p/", 1000)
    assert len(set(keys)) == 1000
    assert keys[0] == b"p/0000000000000000"


@pytest.mark.parametrize("rw", ["read", "randread"])
async def test_one_pass_read_counts_every_key(rw: RW) -> None:
    store = MemStore()
    wl = Workload(
        name=f"{rw}-one-pass",
        rw=rw,
        bs=64,
        batch=8,
        iodepth=3,
        nkeys=100,
        time_based=False,
        runtime_s=60,
        verify=True,
    )
    res = await run_workload(store, wl, progress=False)
    assert len(store.data) == 100  # prefilled
    assert res.read.total_ios == 100  # one pass: count-bounded, not time-bounded
    assert res.read.io_bytes == 100 * 64
    assert res.write.total_ios == 0
    assert (res.missing, res.mismatched, res.error) == (0, 0, 0)
    # 100 keys in batches of 8: 12 full calls + one of 4.
    assert res.read.calls == 13
    job = json.loads(json.dumps(res.to_json()))
    assert job["read"]["total_ios"] == 100
    assert job["job options"]["batch"] == "8"
    assert job["kvfs"]["store"] == "mem"


async def test_write_then_read_back_with_max_ios() -> None:
    store = MemStore()
    wl = Workload(
        name="randwrite", rw="randwrite", bs=16, batch=4, nkeys=64, max_ios=40, runtime_s=60
    )
    res = await run_workload(store, wl, progress=False)
    assert res.write.total_ios == 40
    assert res.read.total_ios == 0
    assert len(store.data) == 40  # a permutation: distinct keys in one pass
    assert all(len(v) == 16 for v in store.data.values())


async def test_randrw_mixes_directions() -> None:
    store = MemStore()
    wl = Workload(name="mix", rw="randrw", bs=8, batch=2, nkeys=50, max_ios=400, runtime_s=60)
    res = await run_workload(store, wl, progress=False)
    assert res.read.total_ios + res.write.total_ios == 400
    assert res.read.total_ios > 0
    assert res.write.total_ios > 0
    job = res.to_json()
    assert job["read"]["total_ios"] == res.read.total_ios
    assert job["write"]["total_ios"] == res.write.total_ios


async def test_missing_values_are_reported() -> None:
    store = MemStore()
    wl = Workload(name="cold", rw="read", bs=8, nkeys=10, time_based=False, prefill=False)
    res = await run_workload(store, wl, progress=False)
    assert res.missing == 10
    assert res.to_json()["error"] != 0


async def test_progress_line_goes_to_the_stream() -> None:
    out = io.StringIO()
    wl = Workload(name="prog", rw="read", bs=8, nkeys=10, time_based=False)
    await run_workload(MemStore(), wl, progress=True, progress_stream=out)
    assert out.getvalue().endswith("\r\x1b[K")  # line cleared at the end


def test_progress_line_names_the_store_and_counts_down() -> None:
    assert progress_text("[3/24] redis randread 4k", "run", 0.41, 112.4) == (
        "[3/24] redis randread 4k: 41%  ETA 1m52s")
    assert progress_text("[1/2] kvfs write 1m", "prefill", 0.5, 9) == (
        "[1/2] kvfs write 1m: prefill 50%  ETA 9s")
    assert [format_eta(s) for s in (0, 59.6, 60, 3725)] == ["0s", "1m00s", "1m00s", "1h02m"]


async def test_progress_line_shows_label_and_eta() -> None:
    out = io.StringIO()
    wl = Workload(name="prog", rw="read", bs=8, nkeys=10, runtime_s=0.6, time_based=True)
    await run_workload(MemStore(), wl, progress=True, progress_stream=out,
                       label="[2/5] mem read 8", eta_after_s=90)
    shown = [t.removesuffix("\x1b[K") for t in out.getvalue().split("\r") if t.strip("\x1b[K")]
    assert shown, "one tick at least (every 0.5 s)"
    assert all(re.fullmatch(r"\[2/5\] mem read 8: \d+%  ETA 1m3\ds", t) for t in shown), shown


async def test_failing_store_raises() -> None:
    class Broken(MemStore):
        async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
            raise OSError("disk on fire")

    wl = Workload(name="broken", rw="read", bs=8, nkeys=16, iodepth=4, time_based=False)
    with pytest.raises(OSError, match="fire"):
        await run_workload(Broken(), wl, progress=False)


async def test_kvfs_adapter() -> None:
    client = FakeKvfsClient()
    store = kvfs_store(client)
    assert isinstance(store, Store)
    assert store.name == "kvfs"
    await store.put_many([(b"a", b"1"), (b"b", b"2")])
    assert client.data == {b"a": b"1", b"b": b"2"}
    assert await store.get_many([b"b", b"zz"]) == [b"2", None]
    await store.close()


async def test_compare_table_with_subject_peer_and_skipped() -> None:
    made: list[MemStore] = []

    async def subject() -> Store:
        return kvfs_store(FakeKvfsClient())

    async def mem() -> Store:
        made.append(MemStore("mem"))
        return made[-1]

    async def loopback() -> Store:
        return await LoopbackLimit.open(server="inprocess")

    async def absent() -> Store:
        raise PeerUnavailable("redis-server not installed")

    factories: dict[str, StoreFactory] = {
        "kvfs": subject,
        "mem": mem,
        "loopback": loopback,
        "redis": absent,
    }
    workloads = [
        Workload(name="r", rw="randread", bs=32, batch=4, nkeys=64, time_based=False),
        Workload(name="w", rw="randwrite", bs=32, batch=4, nkeys=64, time_based=False),
    ]
    out = io.StringIO()
    comp = await compare(factories, workloads, out=out, progress=False)
    assert isinstance(comp, Comparison)
    assert comp.subject == "kvfs"
    assert len(made) == 2 and all(s.closed for s in made)  # a fresh store per workload
    table = out.getvalue()
    lines = table.splitlines()
    assert lines[0].split() == ["workload", "store", "keys/s", "MB/s", "p99/key", "p99/call", "kvfs/x"]
    assert len(lines) == 1 + len(workloads) * len(factories)  # a row per workload and store
    assert [line.split()[0] for line in lines[1:] if not line.startswith(" ")] == [
        "randread", "randwrite"]  # the workload is named once, on its first row
    assert all(len(line) <= 100 for line in lines)
    assert table.count("skipped: redis-server not installed") == 2
    assert lines[1].split()[:5] == ["randread", "32", "b4", "qd1", "kvfs"]
    mem_row = lines[2].split()
    assert mem_row[0] == "mem" and mem_row[-1].endswith("x")
    ratios = comp.ratio_table().splitlines()
    assert ratios[0].split() == ["workload", "/mem", "/loopback", "/redis"]
    assert ratios[1].split()[-1] == "-"  # redis was skipped
    assert comp.ratio("r", "mem") is not None
    assert comp.ratio("r", "redis") is None
    assert comp.cell("r", "mem").result is not None
    data = json.loads(json.dumps(comp.to_json()))
    assert data["stores"]["kvfs"]["report"]["jobs"][0]["read"]["total_ios"] == 64
    assert data["stores"]["redis"]["skipped"] == {
        "r": "redis-server not installed",
        "w": "redis-server not installed",
    }


async def test_compare_repeat_alternates_the_order_and_keeps_the_median_pass() -> None:
    ran: list[tuple[str, str]] = []  # (workload's key prefix, store), in the order run
    before: list[str] = []  # before_cell's calls (the first compare's)
    first = [True]

    class Logged(MemStore):
        async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
            if not self.data:  # the prefill's (or the writes') first call: the cell starts
                # before_cell ran right before this cell ("gone" never runs one)
                assert not first[0] or len([x for x in before if x != "gone"]) == len(ran) + 1
                ran.append((items[0][0].split(b"/")[0].decode(), self.name))
            await super().put_many(items)

    async def before_cell(store: str) -> None:
        before.append(store)

    def factory(name: str) -> StoreFactory:
        async def make() -> Store:
            return Logged(name)
        return make

    async def absent() -> Store:
        raise PeerUnavailable("not here")

    wls = [Workload(name=n, rw=rw, bs=32, batch=4, nkeys=32, time_based=False, key_prefix=f"{n}/".encode())
           for n, rw in (("r", "randread"), ("w", "randwrite"))]
    out = io.StringIO()
    comp = await compare({"a": factory("a"), "b": factory("b"), "gone": absent}, wls, out=out,
                         repeat=3, progress=False, before_cell=before_cell)
    assert before[:3] == ["a", "b", "gone"]  # "gone": tried once, then known unavailable
    assert [s for s in before if s != "gone"] == [store for _, store in ran]
    first[0] = False
    # every other pass runs the workloads, and the stores of each, in the reverse order
    assert ran == [("r", "a"), ("r", "b"), ("w", "a"), ("w", "b"),
                   ("w", "b"), ("w", "a"), ("r", "b"), ("r", "a"),
                   ("r", "a"), ("r", "b"), ("w", "a"), ("w", "b")]
    for wl in wls:
        for store in ("a", "b"):
            cell = comp.cell(wl, store)
            assert len(cell.passes) == 3 and all(x is not None for x in cell.passes)
            assert cell.ios_per_s == sorted(cast(list[float], cell.passes))[1]  # the median pass
        assert comp.cell(wl, "gone").skipped == "not here" and comp.cell(wl, "gone").passes == [None] * 3
    data = json.loads(json.dumps(comp.to_json()))
    assert data["repeat"] == 3 and len(data["passes"]["r"]["a"]) == 3
    rows = comp.passes_table().splitlines()
    assert rows[0].split() == ["workload", "store", "pass", "1", "pass", "2", "pass", "3"]
    assert len(rows) == 1 + 2 * 2 and all(r.count("*") >= 1 for r in rows[1:])
    assert comp.passes_table("cpu") == ""  # measured without --cpu
    timed = await compare({"a": factory("a")}, wls[:1], repeat=2, cpu=True, progress=False)
    cell = timed.cell(wls[0], "a")
    assert len(cell.passes_cpu) == 2 and all(isinstance(x, float) for x in cell.passes_cpu)
    assert cell.client_us_per_key in cell.passes_cpu  # the median pass's own figure
    assert len(timed.passes_table("cpu").splitlines()) == 2
    # the machine's free memory at both ends of every pass's measured phase (--cpu)
    assert len(cell.passes_mem) == 2 and all(
        m is not None and len(m) == 2 and all(isinstance(x, int) for x in m) for m in cell.passes_mem)
    assert cell.mem_free_mib in cell.passes_mem
    (row,) = timed.passes_table("mem").splitlines()[1:]
    assert row.count("->") == 2
    assert comp.passes_table("mem") == ""  # measured without --cpu
    with pytest.raises(ValueError, match="repeat"):
        await compare({"a": factory("a")}, wls, repeat=0)
    many = await compare({"a": factory("a")}, wls[:1], repeat=8, progress=False)
    text = many.passes_table()
    assert all(len(line) <= 100 for line in text.splitlines())  # passes 1-6, then 7-8
    assert "pass 6" in text and "pass 7" in text and len(text.split("\n\n")) == 2


async def test_compare_records_a_failed_run() -> None:
    class Broken(MemStore):
        async def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
            raise BenchError("nope")

    async def good() -> Store:
        return MemStore()

    async def bad() -> Store:
        return Broken()

    wl = Workload(name="w", rw="write", bs=8, nkeys=8, time_based=False)
    comp = await compare({"good": good, "bad": bad}, [wl])
    assert comp.cell("w", "bad").skipped == "failed: BenchError: nope"
    assert comp.cell("w", "good").result is not None


class IntoStore(MemStore):
    """MemStore with get_into; ``broken`` leaves the buffers untouched."""

    def __init__(self, broken: bool = False) -> None:
        super().__init__("into")
        self.broken = broken

    async def get_into(self, keys: list[bytes], buffers: list[memoryview]) -> list[int]:
        out = []
        for k, b in zip(keys, buffers, strict=True):
            v = self.data.get(k)
            if v is not None and not self.broken:
                b[: len(v)] = v
            out.append(-1 if v is None else len(v))
        return out


async def test_get_into_reads_into_buffers_and_is_verified() -> None:
    wl = Workload(name="into", rw="randread", bs=64, batch=8, nkeys=64, time_based=False,
                  verify=True, api="get_into")
    res = await run_workload(IntoStore(), wl, progress=False)
    assert (res.read.total_ios, res.missing, res.mismatched) == (64, 0, 0)
    assert res.to_json()["job options"]["api"] == "get_into"
    bad = await run_workload(IntoStore(broken=True), wl, progress=False)
    assert bad.mismatched >= 63  # buffers never written (key 0's 8-byte tag is zeros, as they are)


async def test_get_into_against_a_store_without_it_is_skipped() -> None:
    async def mem() -> Store:
        return MemStore()

    wl = Workload(name="into", rw="read", bs=8, nkeys=8, time_based=False, api="get_into")
    wr = Workload(name="w", rw="write", bs=8, nkeys=8, time_based=False)
    comp = await compare({"mem": mem}, [wl, wr])
    assert comp.cell("into", "mem").skipped == "no get_into API"
    assert comp.cell("w", "mem").result is not None  # the store still runs the other workloads
