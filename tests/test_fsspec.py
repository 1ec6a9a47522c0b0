"""kvfs:// through fsspec: fsspec's own conformance suite, then kvfs-specific behaviour.

The abstract suite is synchronous (fsspec runs the coroutines on its IO
thread), so the cluster runs in-process on a loop of its own thread.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import posixpath
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import pytest
from conftest import ThreadCluster
from fsspec.tests import abstract

from kvfs.client import AsyncClient
from kvfs.fs import InvalidPathError, KVFileSystem
from kvfs.launcher import LocalCluster


@pytest.fixture
def kvfs_sync(tcluster: ThreadCluster) -> Iterator[KVFileSystem]:
    with tcluster.fsspec() as fs:
        yield fs


# fsspec's conformance suite ---------------------------------------------------------
class KVFSFixtures(abstract.AbstractFixtures):  # type: ignore[misc]
    @pytest.fixture(scope="class")
    def fs(self, tcluster: ThreadCluster) -> Iterator[KVFileSystem]:
        fs = KVFileSystem(tcluster.addr, token=tcluster.token, skip_instance_cache=True)
        try:
            yield fs
        finally:
            fs.close()

    @pytest.fixture
    def fs_join(self) -> Callable[..., str]:
        return posixpath.join

    @pytest.fixture
    def fs_path(self, request: pytest.FixtureRequest) -> str:
        return f"abstract/{request.node.cls.__name__}"

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return True  # mkdir records a marker key (see kvfs/fs.py)


class TestKVFSCopy(abstract.AbstractCopyTests, KVFSFixtures):  # type: ignore[misc]
    pass


class TestKVFSGet(abstract.AbstractGetTests, KVFSFixtures):  # type: ignore[misc]
    pass


class TestKVFSPut(abstract.AbstractPutTests, KVFSFixtures):  # type: ignore[misc]
    pass


class TestKVFSPipe(abstract.AbstractPipeTests, KVFSFixtures):  # type: ignore[misc]
    pass


class TestKVFSOpen(abstract.AbstractOpenTests, KVFSFixtures):  # type: ignore[misc]
    pass


# registration and URLs -----------------------------------------------------------
def test_registered_through_entry_point(tcluster: ThreadCluster,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFS_TOKEN", tcluster.token)
    fs = fsspec.filesystem("kvfs", addr=tcluster.addr, skip_instance_cache=True)
    try:
        assert isinstance(fs, KVFileSystem)
        url = f"{tcluster.addr}/reg/a.bin"
        with fsspec.open(url, "wb") as f:
            f.write(b"hello")
        with fsspec.open(url, "rb") as f:
            assert f.read() == b"hello"
        files = fsspec.open_files(f"{tcluster.addr}/reg/*.bin", "rb")
        assert [f.path for f in files] == ["reg/a.bin"]
        assert fs.unstrip_protocol("reg/a.bin") == url
    finally:
        fs.close()


def test_url_parsing() -> None:
    strip = KVFileSystem._strip_protocol
    assert strip("kvfs://127.0.0.1:7070/a/b/") == "a/b"
    assert strip("kvfs://a/b") == "a/b"  # no port: a path, not a host
    assert strip("/a/b") == "a/b"
    assert KVFileSystem._get_kwargs_from_urls("kvfs://h:1/x") == {"addr": "kvfs://h:1"}
    assert KVFileSystem._get_kwargs_from_urls("kvfs://x/y") == {}


# semantics -----------------------------------------------------------------------
def test_info_reports_size_created_expiry_extents(kvfs_sync: KVFileSystem) -> None:
    fs = kvfs_sync
    data = bytes(range(256)) * (3 * 4096 + 1)  # 3 MiB + 256 B: 4 stripe units of 1 MiB
    with fs.open("info/big.bin", "wb") as f:
        for i in range(0, len(data), 100_000):
            f.write(data[i : i + 100_000])
    fs.pipe_file("info/ttl.bin", b"x", ttl=3600)
    info = fs.info("info/big.bin")
    assert info["type"] == "file" and info["size"] == len(data)
    assert info["extents"] == 4 and info["expires_at"] is None and info["created"] > 0
    ttl = fs.info("info/ttl.bin")
    assert ttl["expires_at"] == pytest.approx(ttl["created"] + 3600)
    assert fs.info("info") == {"name": "info", "size": 0, "type": "directory"}
    assert fs.cat_file("info/big.bin", 1_000_000, 2_100_000) == data[1_000_000:2_100_000]
    assert fs.cat_file("info/big.bin", -10) == data[-10:]
    with fs.open("info/big.bin", "rb") as f:
        f.seek(2_500_000)
        assert f.read(10) == data[2_500_000:2_500_010]
        assert f.read() == data[2_500_010:]
    assert fs.modified("info/big.bin").timestamp() == pytest.approx(info["created"])


def test_missing_paths_raise_file_not_found(kvfs_sync: KVFileSystem) -> None:
    fs = kvfs_sync
    for call in (lambda: fs.cat_file("nope/x"), lambda: fs.info("nope/x"), lambda: fs.ls("nope"),
                 lambda: fs.open("nope/x", "rb"), lambda: fs.rm("nope/x"),
                 lambda: fs.get_file("nope/x", "/dev/null"), lambda: fs.cp("nope/x", "nope/y")):
        with pytest.raises(FileNotFoundError):
            call()
    assert not fs.exists("nope/x")
    assert fs.cat(["nope/x"], on_error="omit") == {}


@pytest.mark.parametrize("path", ["a/../b", "../x", "a/b/..", "a/\x00b", "x" * 1025, "d/" + "é" * 512],
                         ids=["dotdot", "dotdot-first", "dotdot-last", "nul", "long", "long-utf8"])
def test_bad_paths_are_refused(kvfs_sync: KVFileSystem, path: str) -> None:
    fs = kvfs_sync
    for call in (lambda: fs.pipe_file(path, b"v"), lambda: fs.cat_file(path), lambda: fs.info(path),
                 lambda: fs.open(path, "wb"), lambda: fs.mkdir(path), lambda: fs.rm(path)):
        with pytest.raises(InvalidPathError) as ei:
            call()
        assert isinstance(ei.value, ValueError)
        assert ("NUL" in str(ei.value) or "'..'" in str(ei.value)
                or "-byte key limit" in str(ei.value))


def test_long_path_is_named_too_long(kvfs_sync: KVFileSystem) -> None:
    with pytest.raises(InvalidPathError) as ei:
        kvfs_sync.pipe_file("x" * 2000, b"v")
    assert ei.value.errno == errno.ENAMETOOLONG
    kvfs_sync.pipe_file("y" * 1024, b"v")  # exactly the limit is fine
    assert kvfs_sync.cat_file("y" * 1024) == b"v"


def test_append_to_existing_file_is_refused(kvfs_sync: KVFileSystem) -> None:
    fs = kvfs_sync
    with fs.open("app/new.bin", "ab") as f:  # a new file: like "wb"
        f.write(b"one")
    with pytest.raises(OSError) as ei:
        fs.open("app/new.bin", "ab")
    assert ei.value.errno == errno.EOPNOTSUPP
    assert fs.cat_file("app/new.bin") == b"one"
    with pytest.raises(FileExistsError):
        fs.open("app/new.bin", "xb")


def test_write_is_invisible_until_close(kvfs_sync: KVFileSystem) -> None:
    fs = kvfs_sync
    f = fs.open("vis/f.bin", "wb", block_size=1024)
    f.write(b"x" * 10_000)  # past the block size: still buffered, not a partial value
    f.flush()
    assert not fs.exists("vis/f.bin")
    f.close()
    assert fs.cat_file("vis/f.bin") == b"x" * 10_000


def test_transaction_commits_on_exit(kvfs_sync: KVFileSystem) -> None:
    fs = kvfs_sync
    with fs.transaction:
        with fs.open("tx/a", "wb") as f:
            f.write(b"a")
        assert not fs.exists("tx/a")
    assert fs.cat_file("tx/a") == b"a"


def test_directories_are_prefixes_with_markers(kvfs_sync: KVFileSystem) -> None:
    fs = kvfs_sync
    fs.mkdir("dirs/empty")
    assert fs.isdir("dirs/empty") and fs.ls("dirs/empty") == []
    assert fs.ls("dirs", detail=False) == ["dirs/empty"]
    with pytest.raises(FileExistsError):
        fs.mkdir("dirs/empty")
    fs.makedirs("dirs/empty", exist_ok=True)
    fs.rmdir("dirs/empty")
    assert not fs.exists("dirs/empty") and fs.ls("dirs") == []  # mkdir made "dirs" too
    with pytest.raises(FileNotFoundError):
        fs.rmdir("dirs/empty")
    fs.pipe_file("dirs/implicit/f", b"1")  # no mkdir: the directory exists through its file
    assert fs.isdir("dirs/implicit")
    fs.rm("dirs/implicit/f")
    assert not fs.exists("dirs/implicit")
    fs.pipe_file("dirs/file", b"1")
    with pytest.raises(OSError) as ei:
        fs.rmdir("dirs")
    assert ei.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        fs.makedirs("dirs/file/sub")
    with pytest.raises(FileExistsError):
        fs.makedirs("dirs/file", exist_ok=True)
    assert fs.find("dirs", withdirs=True) == ["dirs", "dirs/file"]
    assert fs.find("", maxdepth=1, withdirs=True, detail=False)  # the root lists
    fs.rm("dirs", recursive=True)
    assert not fs.exists("dirs")


# batching: many paths -> one call ---------------------------------------------------
async def test_cat_and_cat_ranges_are_one_lookup(cluster: LocalCluster, kv: AsyncClient) -> None:
    items = {f"batch/{i:04d}.bin": hashlib.sha256(str(i).encode()).digest() * 128 for i in range(200)}
    writer = KVFileSystem(client=kv, asynchronous=True)
    before = kv.rpc_counts["COMMIT"]
    await writer._pipe(items)
    assert kv.rpc_counts["COMMIT"] - before == 1
    async with cluster.client() as fresh:  # an empty layout cache: every key needs a lookup
        fs = KVFileSystem(client=fresh, asynchronous=True)
        got = await fs._cat(list(items))
        assert got == items
        assert fresh.rpc_counts["LOOKUP"] == 1
    async with cluster.client() as fresh:
        fs = KVFileSystem(client=fresh, asynchronous=True)
        paths = list(items)[:50]
        out = await fs._cat_ranges(paths, [i for i in range(50)], [100 + i for i in range(50)])
        assert out == [items[p][i : 100 + i] for i, p in enumerate(paths)]
        assert fresh.rpc_counts["LOOKUP"] == 1
    async with cluster.client() as fresh:  # concurrent single-file reads share the batcher
        fs = KVFileSystem(client=fresh, asynchronous=True)
        got_list = await asyncio.gather(*(fs._cat_file(p) for p in items))
        assert got_list == list(items.values())
        assert fresh.rpc_counts["LOOKUP"] <= 2


async def test_concurrent_pipe_files_share_one_commit(kv: AsyncClient) -> None:
    fs = KVFileSystem(client=kv, asynchronous=True)
    before = kv.rpc_counts["COMMIT"]
    await asyncio.gather(*(fs._pipe_file(f"pf/{i}", str(i).encode()) for i in range(100)))
    assert kv.rpc_counts["COMMIT"] - before == 1
    assert await fs._cat([f"pf/{i}" for i in range(100)]) == {f"pf/{i}": str(i).encode()
                                                              for i in range(100)}


async def test_one_bad_value_does_not_fail_its_batch(kv: AsyncClient) -> None:
    fs = KVFileSystem(client=kv, asynchronous=True)
    res = await asyncio.gather(fs._pipe_file("good/a", b"a"), fs._pipe_file("good/b", b"b", ttl=-1),
                               return_exceptions=True)
    assert res[0] is None and isinstance(res[1], ValueError)


# expiry ----------------------------------------------------------------------------
async def test_key_expiring_mid_read(kv: AsyncClient, clock: Any) -> None:
    fs = KVFileSystem(client=kv, asynchronous=True)
    await fs._pipe_file("ttl/page", b"abcdef" * 1000, ttl=10)
    f = await fs.open_async("ttl/page", "rb")
    assert await f.read(3) == b"abc"  # the first read takes a snapshot of the value
    clock.advance(11)
    assert await f.read(3) == b"def"
    await f.close()
    with pytest.raises(FileNotFoundError):
        await fs._cat_file("ttl/page")

    await fs._pipe_file("ttl/page2", b"x" * 100, ttl=10)
    g = await fs.open_async("ttl/page2", "rb")  # opened, nothing read yet
    clock.advance(11)
    with pytest.raises(FileNotFoundError, match="expired"):
        await g.read()
    await g.close()


@pytest.mark.parametrize("new_size", [40, 300])
async def test_a_value_replaced_between_open_and_first_read_is_read_whole(
        kv: AsyncClient, new_size: int) -> None:
    """An open file takes its snapshot of the value at the first read, and that snapshot's
    size is the file's: a value replaced at another size after the open (whose lookup gave
    the old size) is read whole, never cut at the old size, through ``read()``, ``read(n)``
    past it, and the blocking ``fs.open`` (below)."""
    fs = KVFileSystem(client=kv, asynchronous=True)
    new = b"b" * new_size
    for how in ("read()", "read(n)"):
        await fs._pipe_file("rs/a", b"a" * 100)
        f = await fs.open_async("rs/a", "rb")
        await fs._pipe_file("rs/a", new)
        assert await (f.read() if how == "read()" else f.read(1000)) == new, how
        assert f.size == new_size
        await f.close()


@pytest.mark.parametrize("new_size", [40, 300])
def test_a_value_replaced_between_open_and_first_read_is_read_whole_blocking(
        kvfs_sync: KVFileSystem, new_size: int) -> None:
    new = b"b" * new_size
    for how in ("read()", "read(n)", "readinto", "seek to the end"):
        kvfs_sync.pipe_file("rs/b", b"a" * 100)
        with kvfs_sync.open("rs/b", "rb") as g:
            kvfs_sync.pipe_file("rs/b", new)
            if how == "seek to the end":
                assert g.seek(-10, 2) == new_size - 10
                got = new[:-10] + g.read()
            elif how == "readinto":
                buf = bytearray(1000)
                got = bytes(buf[:g.readinto(buf)])
            else:
                got = g.read() if how == "read()" else g.read(1000)
            assert got == new, how
            assert g.size == new_size


async def test_open_async_write_and_create(kv: AsyncClient) -> None:
    fs = KVFileSystem(client=kv, asynchronous=True)
    async with await fs.open_async("oa/f", "wb") as f:
        await f.write(b"12")
        await f.write(b"34")
    async with await fs.open_async("oa/f", "rb") as f:
        assert await f.read() == b"1234"
    with pytest.raises(FileExistsError):
        await fs.open_async("oa/f", "xb")


# a KV-page directory workload (SGLang HiCacheFile style) ------------------------------------
def test_hicache_style_pages(kvfs_sync: KVFileSystem) -> None:
    """One file per page, written as tmp + rename, probed, then read back in batches."""
    fs = kvfs_sync
    n, page = 2000, 4096
    root = "hicache/model-a"
    fs.makedirs(root, exist_ok=True)

    def page_bytes(i: int) -> bytes:
        return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=64).digest() * (page // 64)

    keys = [hashlib.sha256(f"block{i}".encode()).hexdigest() for i in range(n)]
    for i, k in enumerate(keys):
        tmp = f"{root}/{k}.bin.tmp"
        with fs.open(tmp, "wb") as f:
            f.write(page_bytes(i))
        fs.mv(tmp, f"{root}/{k}.bin")
    assert len(fs.ls(root)) == n
    assert not fs.glob(f"{root}/*.tmp")
    paths = [f"{root}/{k}.bin" for k in keys]
    for lo in range(0, n, 128):  # 128 pages per batch, as HiCache reads
        got = fs.cat(paths[lo : lo + 128])
        for i in range(lo, min(lo + 128, n)):
            assert got[paths[i]] == page_bytes(i)
    fs.rm(root, recursive=True)
    assert not fs.exists(root)
