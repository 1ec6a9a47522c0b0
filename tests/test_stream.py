"""Streaming values: put_stream / open_read, and `kvfs put`/`kvfs get` in bounded memory."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import crc32c
import pytest
from conftest import ThreadCluster

from kvfs.client import AsyncClient
from kvfs.errors import InvalidArgument

MiB = 1 << 20


async def pieces(data: bytes, n: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), n):
        yield data[i:i + n]


async def test_put_stream_round_trip(kv: AsyncClient) -> None:
    data = os.urandom(3 * MiB + 12345)
    assert await kv.put_stream("s", pieces(data, 100_000), size=len(data)) == len(data)
    assert await kv.get("s") == data
    lay = await kv.layout("s")
    assert lay is not None and len(lay.extents) == 4
    assert lay.crc == crc32c.crc32c(data)  # combined from the units' CRCs
    assert all(e.length <= kv.config.stripe_bytes for e in lay.extents)
    assert len({e.replicas[0].server_id for e in lay.extents}) > 1  # spread over the servers
    # a plain iterable, one piece larger than a stripe unit, no size given
    assert await kv.put_stream("s2", [data[:5], data[5:]]) == len(data)
    assert await kv.get("s2") == data
    assert await kv.put_stream("empty", pieces(b"", 1)) == 0
    assert await kv.get("empty") == b""


async def test_put_stream_wrong_size_commits_nothing(kv: AsyncClient) -> None:
    data = os.urandom(2 * MiB)
    with pytest.raises(InvalidArgument, match="ended after"):
        await kv.put_stream("short", pieces(data, MiB), size=len(data) + 1)
    with pytest.raises(InvalidArgument, match="longer than"):
        await kv.put_stream("long", pieces(data, MiB), size=len(data) - 1)
    assert await kv.get_many(["short", "long"]) == [None, None]


async def test_put_stream_failing_source_commits_nothing(kv: AsyncClient) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield os.urandom(3 * MiB)
        raise OSError("the source went away")

    with pytest.raises(OSError, match="went away"):
        await kv.put_stream("broken", broken())
    assert await kv.get("broken") is None


async def test_open_read_ranges_and_chunks(kv: AsyncClient) -> None:
    data = os.urandom(5 * MiB + 7)
    await kv.put("r", data)
    assert await kv.open_read("missing") is None
    r = await kv.open_read("r")
    assert r is not None and r.size == len(data)
    for lo, hi in ((0, 10), (MiB - 3, MiB + 3), (4 * MiB, None), (len(data) - 1, len(data)),
                   (-100, None), (10, 5)):
        assert await r.read(lo, hi) == data[lo:hi]
    assert b"".join([p async for p in r.chunks()]) == data


# the CLI, in a child process whose peak RSS (VmHWM) we read from /proc --------------
_MEASURED = """\
import sys
from kvfs.cli import main
rc = main(sys.argv[1:])
with open("/proc/self/status") as f:
    hwm = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
print(f"peak_rss_kib={hwm}", file=sys.stderr)
sys.exit(rc)
"""


def _block(i: int, seed: bytes) -> bytes:
    return i.to_bytes(8, "big") + seed[8:]


def _peak_kib(stderr: bytes) -> int:
    line = next(x for x in stderr.decode().splitlines() if x.startswith("peak_rss_kib="))
    return int(line.split("=")[1])


def cli_round_trip(tcluster: ThreadCluster, size_mib: int) -> tuple[int, int]:
    """`kvfs put big -` fed size_mib MiB on stdin, then `kvfs get big` to stdout, checked by
    hash; returns the peak RSS (KiB) of each."""
    env = {**os.environ, "KVFS_ADDR": tcluster.addr, "KVFS_TOKEN": tcluster.token}
    seed = os.urandom(MiB)
    want = hashlib.sha256()
    put = subprocess.Popen([sys.executable, "-c", _MEASURED, "put", "big", "-"], env=env,
                           stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert put.stdin is not None and put.stderr is not None
    err: list[bytes] = []
    drain = threading.Thread(target=lambda: err.append(put.stderr.read()))  # type: ignore[union-attr]
    drain.start()
    for i in range(size_mib):
        b = _block(i, seed)
        want.update(b)
        put.stdin.write(b)
    put.stdin.close()
    assert put.wait(600) == 0, err
    drain.join()
    put.stderr.close()
    put_kib = _peak_kib(err[0])

    get = subprocess.Popen([sys.executable, "-c", _MEASURED, "get", "big"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert get.stdout is not None and get.stderr is not None
    err.clear()
    drain = threading.Thread(target=lambda: err.append(get.stderr.read()))  # type: ignore[union-attr]
    drain.start()
    got, n = hashlib.sha256(), 0
    for part in iter(lambda: get.stdout.read(MiB), b""):  # type: ignore[union-attr]
        got.update(part)
        n += len(part)
    assert get.wait(600) == 0, err
    drain.join()
    get.stdout.close()
    get.stderr.close()
    assert n == size_mib * MiB and got.digest() == want.digest()
    return put_kib, _peak_kib(err[0])


def _baseline_kib(tcluster: ThreadCluster, tmp_path: Path) -> int:
    env = {**os.environ, "KVFS_ADDR": tcluster.addr, "KVFS_TOKEN": tcluster.token}
    r = subprocess.run([sys.executable, "-c", _MEASURED, "put", "tiny", "-"], env=env,
                       input=b"x", capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return _peak_kib(r.stderr)


@pytest.fixture
def rss_report() -> Iterator[list[str]]:
    lines: list[str] = []
    yield lines
    for line in lines:
        print(line)


@pytest.mark.subprocess
def test_cli_put_get_128mib_in_bounded_memory(tcluster: ThreadCluster, tmp_path: Path,
                                              rss_report: list[str]) -> None:
    """A whole-value CLI needs > 128 MiB over its baseline for this; a streaming one a few
    stripe units (4 x 1 MiB in flight) plus buffers."""
    base = _baseline_kib(tcluster, tmp_path)
    put_kib, get_kib = cli_round_trip(tcluster, 128)
    rss_report.append(f"peak RSS, 128 MiB: baseline {base} KiB, put {put_kib} KiB, get {get_kib} KiB")
    assert put_kib - base < 48 * 1024, (base, put_kib)
    assert get_kib - base < 48 * 1024, (base, get_kib)


@pytest.mark.big
@pytest.mark.timeout(1200)
def test_cli_put_get_1gib_in_bounded_memory(tcluster: ThreadCluster, tmp_path: Path,
                                            rss_report: list[str]) -> None:
    base = _baseline_kib(tcluster, tmp_path)
    put_kib, get_kib = cli_round_trip(tcluster, 1024)
    rss_report.append(f"peak RSS, 1 GiB: baseline {base} KiB, put {put_kib} KiB, get {get_kib} KiB")
    assert put_kib - base < 48 * 1024, (base, put_kib)
    assert get_kib - base < 48 * 1024, (base, get_kib)
