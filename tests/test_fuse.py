"""The FUSE mount (``kvfs mount``): shell tools, real fio, a KV-page workload, signals, outages.

The cluster runs in this process on a loop of its own thread; the mount is a
real ``python -m kvfs mount`` child process; the test thread uses the mount
with plain system calls, as any program would.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import ThreadCluster, readv_calls
from fuse_mount import Mount, needs_fuse, wait_until

from kvfs._batch import Batcher
from kvfs.chunkserver.durability import fsync_dir
from kvfs.client import AsyncClient
from kvfs.fs import KVFileSystem
from kvfs.mount import is_mounted

pytestmark = pytest.mark.fuse


@pytest.fixture
def mnt(mount: Mount) -> Path:
    return mount.mnt


@pytest.fixture(scope="module")
def fs(tcluster: ThreadCluster) -> Iterator[KVFileSystem]:
    """The same cluster through fsspec: what other clients see."""
    with tcluster.fsspec() as f:
        yield f


# everyday use -------------------------------------------------------------------
@needs_fuse
def test_shell_session(mnt: Path, fs: KVFileSystem, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    script = f"""
    set -eu
    cd {mnt}
    mkdir -p sh/d
    cp {src} sh/d/a.bin
    cmp {src} sh/d/a.bin
    echo hello > sh/hello.txt
    test "$(cat sh/hello.txt)" = hello
    test "$(stat -c %s sh/d/a.bin)" = {src.stat().st_size}
    ls sh
    mv sh/d/a.bin sh/b.bin
    test ! -e sh/d/a.bin
    cmp {src} sh/b.bin
    cp sh/b.bin sh/c.bin
    rm sh/b.bin
    rmdir sh/d
    ls sh
    """
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["d", "hello.txt", "c.bin", "hello.txt"]
    assert fs.cat_file("sh/c.bin") == src.read_bytes()  # another client sees the committed files
    assert fs.cat_file("sh/hello.txt") == b"hello\n"
    assert not fs.exists("sh/d") and not fs.exists("sh/b.bin")
    info = fs.info("sh/c.bin")
    assert info["size"] == src.stat().st_size and info["extents"] == 4
    fs.pipe_file("sh/from-fsspec", b"made elsewhere")
    assert (mnt / "sh" / "from-fsspec").read_bytes() == b"made elsewhere"


@needs_fuse
def test_write_is_invisible_until_close(mnt: Path, fs: KVFileSystem) -> None:
    (mnt / "vis").mkdir()
    fd = os.open(mnt / "vis" / "f.bin", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, b"a" * 100_000)
        os.write(fd, b"b" * 100_000)
        assert os.stat(mnt / "vis" / "f.bin").st_size == 200_000  # this mount shows it
        assert not fs.exists("vis/f.bin")  # nobody else does
    finally:
        os.close(fd)  # the commit point
    assert fs.cat_file("vis/f.bin") == b"a" * 100_000 + b"b" * 100_000


@needs_fuse
def test_overwrite_in_place_and_truncate(mnt: Path, fs: KVFileSystem) -> None:
    fs.pipe_file("ow/f", b"0123456789")
    p = mnt / "ow" / "f"
    with open(p, "r+b") as f:  # no O_TRUNC: the old value is read, patched, written whole
        f.seek(3)
        f.write(b"abc")
    assert fs.cat_file("ow/f") == b"012abc6789"
    os.truncate(p, 4)
    assert fs.cat_file("ow/f") == b"012a"
    p.write_bytes(b"new")  # O_TRUNC
    assert fs.cat_file("ow/f") == b"new" and p.read_bytes() == b"new"
    fs.pipe_file("ow/f", b"changed by someone else")
    wait_until(lambda: p.read_bytes() == b"changed by someone else", 10, "the new value")


def _gone(p: Path) -> bool:
    try:
        p.read_bytes()
    except FileNotFoundError:
        return True
    return False


@needs_fuse
def test_looked_up_files_changed_here_or_elsewhere_are_not_read_stale(
        mnt: Path, fs: KVFileSystem) -> None:
    """The mount keeps the layout a LOOKUP saw for a first read soon after: this mount's own
    changes are read at once, another client's once the attribute time has passed."""
    p, q = mnt / "st" / "f", mnt / "st" / "g"
    fs.pipe_file("st/f", b"first")
    assert p.stat().st_size == 5 and p.read_bytes() == b"first"  # looked up, then read
    p.write_bytes(b"second, longer")  # this mount's commit
    assert p.read_bytes() == b"second, longer"
    os.rename(p, q)
    assert q.read_bytes() == b"second, longer" and _gone(p)
    fs.pipe_file("st/f", b"third")
    wait_until(lambda: p.exists() and p.read_bytes() == b"third", 10, "another client's file")
    p.unlink()  # this mount's delete
    assert _gone(p)
    assert q.stat().st_size == 14
    fs.rm_file("st/g")  # another client's delete
    wait_until(lambda: _gone(q), 10, "another client's delete")


# bad input ------------------------------------------------------------------------
def _hidden_new_file(m: Mount, fs: KVFileSystem, d: str) -> Path:
    """A file another client writes (b"elsewhere") into ``d`` that the mount does not see yet
    (--negative-timeout): new names are made until the mount has a listing of ``d`` older
    than one of them."""
    made: list[Path] = []

    def hidden() -> bool:
        made.append(m.mnt / d / f"other{len(made)}")
        fs.pipe_file(str(made[-1].relative_to(m.mnt)), b"elsewhere")
        return not made[-1].exists()

    wait_until(hidden, 30, f"a listing of {d}/ to hide a file made after it")
    return made[-1]


@needs_fuse
def test_negative_timeout_hides_others_new_files_at_most_that_long(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """With --negative-timeout a new file written by another client into a directory this
    mount listed lately is missing here until the listing is older than the bound; files
    made through the mount are seen at once."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--negative-timeout", "3s",
              "--attr-timeout", "0")
    try:
        d = m.mnt / "nt"
        d.mkdir()
        late = _hidden_new_file(m, fs, "nt")
        (d / "mine.bin").write_bytes(b"here")
        assert (d / "mine.bin").read_bytes() == b"here" and not late.exists()
        wait_until(late.exists, 30, "the hidden file once the listing is older than the bound")
        assert late.read_bytes() == b"elsewhere"
    finally:
        m.cleanup()


@needs_fuse
def test_negative_timeout_still_sees_others_files_for_o_excl_and_writes_in_place(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """With --negative-timeout another node's new file can look missing here, but a create
    that depends on it asks meta: O_EXCL fails with EEXIST (and leaves it as it is), and a
    create without O_TRUNC writes into its bytes, as an open of it would."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--negative-timeout", "60s",
              "--attr-timeout", "0")
    try:
        d = m.mnt / "ex"
        d.mkdir()
        late = _hidden_new_file(m, fs, "ex")
        fs.pipe_file("ex/kept.bin", b"elsewhere")
        assert not (d / "kept.bin").exists()  # hidden too
        with pytest.raises(FileExistsError):
            os.open(late, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        fd = os.open(d / "kept.bin", os.O_CREAT | os.O_WRONLY)
        try:
            os.write(fd, b"E")
        finally:
            os.close(fd)
        assert fs.cat_file("ex/kept.bin") == b"Elsewhere"
        assert (d / "kept.bin").read_bytes() == b"Elsewhere"
        assert fs.cat_file(str(late.relative_to(m.mnt))) == b"elsewhere"
    finally:
        m.cleanup()


@needs_fuse
def test_append_to_existing_file_is_eopnotsupp(mnt: Path, fs: KVFileSystem) -> None:
    (mnt / "app").mkdir()
    with open(mnt / "app" / "new", "ab") as f:  # a new file may be opened for append
        f.write(b"one")
    with pytest.raises(OSError) as ei:
        open(mnt / "app" / "new", "ab")  # noqa: SIM115
    assert ei.value.errno == errno.EOPNOTSUPP
    assert fs.cat_file("app/new") == b"one"


@needs_fuse
def test_path_over_key_limit_is_enametoolong(mnt: Path) -> None:
    deep = mnt / "long"
    with pytest.raises(OSError) as ei:
        for _ in range(6):  # 6 x 201 bytes > 1 KiB
            deep = deep / ("x" * 200)
            deep.mkdir(parents=True)
    assert ei.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as ei:
        (deep.parent / ("y" * 250)).write_bytes(b"v")
    assert ei.value.errno == errno.ENAMETOOLONG


@needs_fuse
def test_missing_file_and_nonempty_rmdir(mnt: Path) -> None:
    with pytest.raises(FileNotFoundError):
        (mnt / "nope" / "x").read_bytes()
    (mnt / "ne").mkdir()
    (mnt / "ne" / "f").write_bytes(b"1")
    with pytest.raises(OSError) as ei:
        (mnt / "ne").rmdir()
    assert ei.value.errno == errno.ENOTEMPTY


# a KV-page directory (SGLang HiCacheFile style) ------------------------------------------
@needs_fuse
def test_kernel_read_ahead_of_the_mount(mnt: Path) -> None:
    """The mount sets the kernel's read-ahead for itself to --kernel-read-ahead (1 MiB), so
    large files reach it as 1 MiB reads."""
    dev = [line.split()[2] for line in Path("/proc/self/mountinfo").read_text().splitlines()
           if line.split()[4] == str(mnt)][-1]
    ra = Path("/sys/class/bdi") / dev / "read_ahead_kb"
    if not os.access(ra, os.W_OK):
        pytest.skip(f"{ra} is not writable here (a read-only /sys): the mount leaves it")
    wait_until(lambda: ra.read_text().strip() == "1024", 10, "the mount's read-ahead")


@needs_fuse
def test_lost_file_reads_as_a_miss(mnt: Path, fs: KVFileSystem, tcluster: ThreadCluster) -> None:
    """A file whose every replica is lost behaves as a miss (the client's on_lost="miss"):
    ENOENT from its read, never EIO or wrong bytes; meta forgets it, so it is gone from the
    mount's listing and lookups too; its neighbours read fine."""
    from kvfs.bench.reliability import flip_byte

    good, doomed = os.urandom(50_000), os.urandom(70_000)
    fs.pipe({"lost/good.bin": good, "lost/doomed.bin": doomed})

    async def layout() -> Any:
        async with tcluster.cluster.client() as kv:
            return await kv.layout(b"lost/doomed.bin")

    flip_byte(tcluster.cluster, tcluster.call(layout()).extents[0].replicas[0], 4321)
    with pytest.raises(FileNotFoundError), open(mnt / "lost" / "doomed.bin", "rb", buffering=0) as f:
        f.read()
    assert (mnt / "lost" / "good.bin").read_bytes() == good
    assert not fs.exists("lost/doomed.bin")
    assert os.listdir(mnt / "lost") == ["good.bin"]
    wait_until(lambda: not (mnt / "lost" / "doomed.bin").exists(), 10, "the kernel to drop the name")


@needs_fuse
def test_files_written_through_a_mount_with_replicas_survive_a_bad_copy(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """``kvfs mount --replicas 2``: every extent of a file written through it (a small one,
    and one striped over servers) has two copies on distinct servers, so a file whose first
    copies are damaged is still read whole through another mount and through fsspec."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--replicas", "2")
    other = Mount(tmp_path / "mnt2", tcluster, tmp_path / "logs")
    try:
        small, striped = os.urandom(50_000), os.urandom(3 * 1024 * 1024 + 5000)
        (m.mnt / "rep").mkdir()
        (m.mnt / "rep" / "small.bin").write_bytes(small)
        (m.mnt / "rep" / "striped.bin").write_bytes(striped)

        async def layout(key: bytes) -> Any:
            async with tcluster.cluster.client() as kv:
                return await kv.layout(key)

        for key in (b"rep/small.bin", b"rep/striped.bin"):
            lay = tcluster.call(layout(key))
            assert [len({r.server_id for r in e.replicas}) for e in lay.extents] == [2] * len(lay.extents)
        _damage_first_replicas(tcluster, b"rep/small.bin", b"rep/striped.bin")
        assert (other.mnt / "rep" / "small.bin").read_bytes() == small
        assert (other.mnt / "rep" / "striped.bin").read_bytes() == striped
        assert fs.cat_file("rep/small.bin") == small
    finally:
        other.cleanup()
        m.cleanup()


def _damage_first_replicas(tcluster: ThreadCluster, *keys: bytes) -> None:
    """Fault injection: a byte of each extent's first replica of ``keys`` flipped (with one
    replica, a read of them from the cluster fails its CRC: a miss)."""
    from kvfs.bench.reliability import flip_byte

    async def layout(key: bytes) -> Any:
        async with tcluster.cluster.client() as kv:
            return await kv.layout(key)

    for key in keys:
        for e in tcluster.call(layout(key)).extents:
            flip_byte(tcluster.cluster, e.replicas[0], 1234)


@needs_fuse
def test_a_file_read_again_is_answered_from_the_kernels_pages(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A file opened again, its LOOKUP finding the value its cached pages were read from,
    keeps them: the read needs no chunkserver (its only replica, damaged after the first
    read, is not read again).  A file this mount writes is read back as written."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--attr-timeout", "60s")
    try:
        page, big = os.urandom(128 * 1024), os.urandom((2 << 20) + 4321)
        fs.pipe({"pc/page.bin": page, "pc/big.bin": big})
        buf = bytearray(len(big))
        for name, want in (("page.bin", page), ("big.bin", big)):
            with open(m.mnt / "pc" / name, "rb", buffering=0) as f:
                assert f.readinto(buf) == len(want) and buf[:len(want)] == want
        _damage_first_replicas(tcluster, b"pc/page.bin", b"pc/big.bin")
        for _ in range(2):
            for name, want in (("page.bin", page), ("big.bin", big)):
                with open(m.mnt / "pc" / name, "rb", buffering=0) as f:
                    assert f.readinto(buf) == len(want) and buf[:len(want)] == want
        mine = os.urandom(200_000)
        (m.mnt / "pc" / "page.bin").write_bytes(mine)  # this mount's own new value
        assert (m.mnt / "pc" / "page.bin").read_bytes() == mine == fs.cat_file("pc/page.bin")
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


@needs_fuse
def test_direct_first_open_reads_past_the_kernels_pages_then_keeps_them(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """--direct-first-open, through the kernel: a value's first open here is a direct_io one
    (a shared mmap of it fails with ENODEV, the kernel's rule) and reads the right bytes into
    a buffer at any alignment (READs that split stripe units); the next open reads through
    the kernel's pages (a shared mmap of it is made), and the one after is answered from them
    (its only replica, damaged after that read, is not read again)."""
    import mmap

    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--attr-timeout", "60s",
              "--direct-first-open")
    try:
        page, big = os.urandom(128 * 1024), os.urandom((2 << 20) + 4321)
        fs.pipe({"dfo/page.bin": page, "dfo/big.bin": big})
        for name, want in (("page.bin", page), ("big.bin", big)):
            path = m.mnt / "dfo" / name
            with open(path, "rb", buffering=0) as f:
                with pytest.raises(OSError) as err:
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                assert err.value.errno == errno.ENODEV  # direct_io
                buf = bytearray(len(want) + 1000)
                view = memoryview(buf)[1000 - 7:]  # not page aligned: READs split units
                assert f.readinto(view) == len(want) and view[:len(want)] == want
            with open(path, "rb", buffering=0) as f:
                # through the pages: a shared mmap is allowed (not read here: a fault holds
                # the GIL, which this process's chunkservers need to answer it)
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ).close()
                assert f.readinto(view) == len(want) and view[:len(want)] == want
        _damage_first_replicas(tcluster, b"dfo/page.bin", b"dfo/big.bin")
        for name, want in (("page.bin", page), ("big.bin", big)):
            assert (m.mnt / "dfo" / name).read_bytes() == want  # the kept pages
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


@needs_fuse
def test_a_file_written_here_is_read_back_from_the_kernels_pages(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A file this mount wrote and committed, unchanged since, is read back (by a later open,
    soon after or after the attribute time) from the kernel's pages it was written through:
    no READV reaches a chunkserver.  Its mtime stays the one the kernel was told while it was
    written (a new one would make the kernel drop those pages); another mount shows meta's."""
    attr_s = 0.3
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--attr-timeout", f"{attr_s}s")
    try:
        values = {"page.bin": os.urandom(128 * 1024), "big.bin": os.urandom(2 << 20)}
        d = m.mnt / "wk"
        d.mkdir()
        mtimes = {}
        for name, v in values.items():
            with open(d / name, "wb") as f:
                f.write(v)
                f.flush()
                mtimes[name] = os.fstat(f.fileno()).st_mtime_ns  # while written
        buf = bytearray(2 << 20)
        until = time.monotonic() + 3 * attr_s  # soon after the close, then looked up again
        reads = fetched = 0
        while time.monotonic() < until or reads < 4:
            for name, v in values.items():
                before = readv_calls(tcluster.cluster)
                with open(d / name, "rb", buffering=0) as f:
                    assert f.readinto(buf) == len(v) and buf[:len(v)] == v
                fetched += readv_calls(tcluster.cluster) > before
                assert os.stat(d / name).st_mtime_ns == mtimes[name]
            reads += 1
        # the kernel may leave a written page out of its cache now and then (one its copy of
        # the caller's buffer did not fill whole): that page alone is read, from the same
        # value.  Without the pages kept, every file's first read here is fetched.
        assert fetched <= 1, f"{fetched} of {reads * len(values)} reads went to the cluster"
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


@needs_fuse
def test_a_file_written_here_and_replaced_elsewhere_is_read_anew(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A file this mount wrote (its pages kept for a later open), then replaced by the same
    size of other bytes through the API or through another mount, is read as the new value
    once the attribute time has passed; every read is one whole value, never a mix."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--attr-timeout", "0.2s")
    other = Mount(tmp_path / "mnt2", tcluster, tmp_path / "logs")
    try:
        n = 256 * 1024
        v1, v2, v3 = os.urandom(n), os.urandom(n), os.urandom(n)
        (m.mnt / "wr").mkdir()
        p = m.mnt / "wr" / "f"
        p.write_bytes(v1)
        assert p.read_bytes() == v1

        def reads(want: bytes) -> bool:
            got = p.read_bytes()
            assert got in (v1, v2, v3)
            return got == want

        fs.pipe_file("wr/f", v2)  # the API
        wait_until(lambda: reads(v2), 10, "the API's new value")
        (other.mnt / "wr" / "f").write_bytes(v3)  # another mount (node)
        wait_until(lambda: reads(v3), 10, "the other mount's new value")
        p.write_bytes(v1)  # written here again, then replaced at once elsewhere
        fs.pipe_file("wr/f", v2)
        wait_until(lambda: reads(v2), 10, "the API's new value")
        assert "Traceback" not in m.stderr() + other.stderr()
    finally:
        other.cleanup()
        m.cleanup()


def _reads_back_as(p: Path, value: bytes, *strays: bytes) -> None:
    """Two new opens of ``p`` each read exactly ``value`` (the cluster's); a mismatch names
    where each of ``strays`` (bytes of another version) first shows."""
    for _ in range(2):
        with open(p, "rb", buffering=0) as f:
            got = f.read()
        assert got == value, ", ".join(f"{x!r} at {got.find(x)}" for x in strays)


@needs_fuse
@pytest.mark.parametrize("earlier", [False, True], ids=["read", "write-fsync-read"])
@pytest.mark.parametrize("flags", [(), ("--write-behind", "64MiB", "--write-behind-delay", "0")],
                         ids=["default", "write-behind"])
def test_a_file_read_then_replaced_elsewhere_then_written_here_reads_as_committed(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path, flags: tuple[str, ...],
        earlier: bool) -> None:
    """A file opened read-write and read through the kernel's pages (value A; or A written a
    little and committed by ``fsync`` first: its pages then read after that commit), then
    replaced by another client (value B, the same size), then written a little here and
    committed: every later read here is exactly what the cluster holds, never the bytes read
    before mixed into the kernel's pages with the value committed.  (Read only: the write
    starts from B, and the kernel drops A's pages once it sees the handle's new mtime.
    Written and fsynced first: the write starts from the version that handle committed and
    read, whose mtime the kernel keeps; with ``--write-behind`` it once started from B.)"""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--attr-timeout", "60s",
              "--timeout", "30s", *flags)
    try:
        n = 16 * 4096  # several pages
        a, b = b"A" * n, b"B" * n
        fs.pipe_file("rw/f", a)
        p = m.mnt / "rw" / "f"
        fd = os.open(p, os.O_RDWR)
        try:
            if earlier:
                os.pwrite(fd, b"v" * 100, 20_000)
                os.fsync(fd)
            seen = os.pread(fd, n, 0)  # the kernel's pages now hold these bytes
            assert seen == fs.cat_file("rw/f")
            fs.pipe_file("rw/f", b)  # another client commits B
            os.pwrite(fd, b"w" * 100, 5000)
            os.fsync(fd)  # committed (write-behind: held, then committed)
            assert os.pread(fd, n, 0) == fs.cat_file("rw/f")  # this handle reads it too
        finally:
            os.close(fd)
        value = fs.cat_file("rw/f")
        assert value[5000:5100] == b"w" * 100 and len(value) == n
        _reads_back_as(p, value, b"A", b"v")
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


@needs_fuse
@pytest.mark.parametrize("flags", [(), ("--write-behind", "64MiB", "--write-behind-delay", "0")],
                         ids=["default", "write-behind"])
def test_a_read_only_open_beside_a_writer_never_leaves_another_version_in_its_pages(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path, flags: tuple[str, ...]) -> None:
    """A file opened read-write here and written a little (value A), replaced by another
    client (value B, the same size), then opened read-only here beside the writer and read
    whole: that open reads B, through the kernel's pages of the file, which the writer shares.
    The writer then commits A and its write (the last commit wins).  Every later read here is
    exactly what the cluster holds: the writer's pages are not recorded as its value's, since
    B's bytes filled them meanwhile (an open beside a writer makes it ``sole`` no more:
    ``FileIO._alone`` in ``opened``; without that call the next open keeps B's pages).  Also
    with ``--write-behind``, whose held commit records a sole writer's pages the same way."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--attr-timeout", "0.3s",
              "--timeout", "30s", *flags)
    try:
        n = 16 * 4096  # several pages
        a, b = b"A" * n, b"B" * n
        fs.pipe_file("rwb/f", a)
        p = m.mnt / "rwb" / "f"
        fd = os.open(p, os.O_RDWR)
        try:
            os.pwrite(fd, b"w" * 100, 5000)  # starts from A
            fs.pipe_file("rwb/f", b)  # another client commits B

            def reads_b() -> bool:  # once the mount's lookup of A is no longer recent
                with open(p, "rb", buffering=0) as f:
                    return f.read() == b

            wait_until(reads_b, 10, "a read-only open to read B")
            os.fsync(fd)  # A and the write committed (write-behind: held, then committed)
        finally:
            os.close(fd)
        value = fs.cat_file("rwb/f")
        assert value == a[:5000] + b"w" * 100 + a[5100:]
        _reads_back_as(p, value, b"B")
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


@needs_fuse
@pytest.mark.parametrize("writer_first", [True, False])
def test_an_open_beside_a_writer_never_reads_its_uncommitted_bytes(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path, writer_first: bool) -> None:
    """A read-only open and an open for writing of one file on one mount, in either order:
    the reader reads the committed value whole while the writer writes on, never the
    writer's uncommitted bytes, though the kernel's pages are per file and take the
    writes: a written file reports the writer's mtime, so the kernel (auto_inval_data)
    drops its pages at the reader's next read, which reads its own value from the mount."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs")
    try:
        n = 16 * 4096
        a = os.urandom(n)
        fs.pipe_file("rw2/f", a)
        p = m.mnt / "rw2" / "f"
        first, second = (os.O_RDWR, os.O_RDONLY) if writer_first else (os.O_RDONLY, os.O_RDWR)
        fd1 = os.open(p, first)
        try:
            fd2 = os.open(p, second)
            w, r = (fd1, fd2) if writer_first else (fd2, fd1)
            try:
                assert os.pread(r, n, 0) == a
                os.pwrite(w, b"x" * 8192, 8192)  # uncommitted, in the middle of a page run
                assert os.pread(r, n, 0) == a
            finally:
                os.close(fd2)
        finally:
            os.close(fd1)
        value = a[:8192] + b"x" * 8192 + a[16384:]
        assert fs.cat_file("rw2/f") == value  # the writer's close committed it
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


@needs_fuse
def test_open_handles_of_two_versions_never_share_pages(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A handle reads the value it was opened on, and a later open of the replaced file reads
    the new one, even when both stay open and read in turns: the kernel's page cache is per
    file, not per handle, so neither is ever answered with the other's cached pages (the
    same size, so no short read hides it)."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--attr-timeout", "0.2s")
    try:
        n = 256 * 1024
        v1, v2 = os.urandom(n), os.urandom(n)
        fs.pipe_file("pv/a", v1)
        p = m.mnt / "pv" / "a"
        fd1 = os.open(p, os.O_RDONLY)
        fds = [fd1]
        try:
            assert os.pread(fd1, n, 0) == v1
            fs.pipe_file("pv/a", v2)  # another client replaces it
            seen: list[int] = []

            def opens_v2() -> bool:  # once the attribute time has passed: the new value
                fd = os.open(p, os.O_RDONLY)
                fds.append(fd)
                if os.pread(fd, 4096, 0) == v2[:4096]:
                    seen.append(fd)
                    return True
                return False

            wait_until(opens_v2, 30, "an open of the new value")
            fd2 = seen[0]
            for _ in range(3):  # in turns, each whole
                assert os.pread(fd1, n, 0) == v1
                assert os.pread(fd2, n, 0) == v2
            for fd in fds[1:]:
                if fd != fd2:
                    os.close(fd)
            os.close(fd1)
            fds = [fd2]
            with open(p, "rb", buffering=0) as f:  # a new open once the old one is closed
                assert f.read() == v2
            assert os.pread(fd2, n, 0) == v2
        finally:
            for fd in fds:
                os.close(fd)
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


@needs_fuse
@pytest.mark.parametrize("new_size", [24 * 1024, 160 * 1024])
def test_a_replaced_files_new_size_never_cuts_the_version_an_open_reads(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path, new_size: int) -> None:
    """A file replaced by another client at another size, smaller or larger.  While an open
    reads the old value through the kernel's pages, the mount's lookups and stats give the
    kernel the old value's size, and a new open reads the new value whole past the pages.
    Told the new size, the kernel would cut the old value's pages there: a smaller one ends
    the old open's reads inside it.  And once the old open has closed, a new open within the
    attribute time reads past the pages while the kernel still has the old size: read
    through them, a larger value would end there."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--attr-timeout", "2s")
    try:
        n = 64 * 1024
        v1, v2 = os.urandom(n), os.urandom(new_size)
        fs.pipe_file("sz/a", v1)
        p = m.mnt / "sz" / "a"
        fd1 = os.open(p, os.O_RDONLY)
        try:
            assert os.pread(fd1, 2 * n, 0) == v1
            fs.pipe_file("sz/a", v2)  # another client replaces it

            def reads_v2() -> bool:  # once the attribute time has passed: the new value
                with open(p, "rb", buffering=0) as f:
                    return f.readall() == v2

            wait_until(reads_v2, 30, "an open of the new value")
            assert os.pread(fd1, 2 * n, 0) == v1  # whole, as it was
            assert os.fstat(fd1).st_size == n
        finally:
            os.close(fd1)
        with open(p, "rb", buffering=0) as f:  # at once, the kernel's size still the old one's
            assert f.readall() == v2
        wait_until(lambda: p.stat().st_size == new_size, 30, "the new size")
        with open(p, "rb", buffering=0) as f:
            assert f.readall() == v2
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


@needs_fuse
def test_hicache_style_pages(mnt: Path, fs: KVFileSystem) -> None:
    """Thousands of page files, each written to a tmp name and renamed; every byte read back."""
    n, page = 2000, 4096
    d = mnt / "hicache"
    d.mkdir()

    def page_bytes(i: int) -> bytes:
        return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=64).digest() * (page // 64)

    def name(i: int) -> str:
        return hashlib.sha256(f"block{i}".encode()).hexdigest() + ".bin"

    def write(i: int) -> None:
        tmp = d / (name(i) + ".tmp")
        with open(tmp, "wb") as f:
            f.write(page_bytes(i))
        os.replace(tmp, d / name(i))

    def check(i: int) -> bool:
        with open(d / name(i), "rb") as f:
            return f.read() == page_bytes(i)

    with ThreadPoolExecutor(4) as ex:  # four writers (tensor-parallel ranks)
        list(ex.map(write, range(n)))
    listing = os.listdir(d)
    assert len(listing) == n and not [x for x in listing if x.endswith(".tmp")]
    with ThreadPoolExecutor(16) as ex:  # parallel small reads: batched by the mount
        assert all(ex.map(check, range(n)))
    got = fs.cat([f"hicache/{name(i)}" for i in range(n)])  # and another client agrees
    assert all(got[f"hicache/{name(i)}"] == page_bytes(i) for i in range(n))
    shutil.rmtree(d)
    assert not fs.exists("hicache")


@needs_fuse
@pytest.mark.parametrize(("sizes", "rows"), [
    (["--pages-128k", "24", "--pages-2m", "0"], ["128 KiB"]),
    (["--pages-128k", "0", "--pages-2m", "6"], ["2 MiB"]),
    (["--pages-128k", "12", "--pages-2m", "0", "--rounds", "2"],
     ["128 KiB", "128 KiB", "128 KiB, median of 2"]),
])
def test_mount_pages_bench_runs_each_size_asked_for(capsys: pytest.CaptureFixture[str],
                                                    sizes: list[str], rows: list[str]) -> None:
    """bench/mount_pages.py on its own cluster and mount: page files written and read back
    through the mount (every byte checked, or it exits) and through the API; a size of 0
    pages is skipped (it raised IndexError), a negative one refused; ``--rounds`` gives a row
    per round and one of the ratios' medians, every row as many cells as the header, a
    round's last the free memory as its cold reads began."""
    from kvfs.bench import mount_pages

    assert mount_pages.main([*sizes, "--threads", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line.split(" | ")[0].strip("| ") for line in lines[2:]] == rows
    header = lines[0][: lines[0].rindex("|") + 1]  # the settings follow the last cell
    assert {line.count("|") for line in lines[1:]} == {header.count("|")}
    # each round says how much memory was free as its cold reads began (the last cell)
    assert all(line.split("|")[-2].strip().endswith(" MiB") for line in lines[2:] if "median" not in line)
    for bad in (["--pages-2m", "-1"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            mount_pages.main(bad)


def test_memfs_floor_keeps_what_a_filesystem_must() -> None:
    """bench/memfs.py (the floor), driven directly, no mount: a first write kept, a write past
    the end leaves zeros; a rename over an open file keeps that file's bytes for its handle until
    its last release; O_TRUNC empties; unlink frees; FLUSH is left to pyfuse3 (ENOSYS, so the
    kernel stops sending it) unless ``--flush``."""
    pyfuse3 = pytest.importorskip("pyfuse3")
    from kvfs.bench.memfs import MemFS, MemFSFlush

    assert MemFS.flush is pyfuse3.Operations.flush and MemFSFlush.flush is not MemFS.flush
    fs, root, ctx = MemFS(), pyfuse3.ROOT_INODE, None

    async def go() -> None:
        a, _ = await fs.create(root, b"a", 0o644, os.O_WRONLY, ctx)
        first = b"hello"
        assert await fs.write(a.fh, 0, first) == 5
        assert fs.data[a.fh] is first  # a first write kept as pyfuse3 made it, not copied
        assert await fs.write(a.fh, 7, b"!") == 1
        assert bytes(await fs.read(a.fh, 0, 100)) == b"hello\0\0!"
        assert (await fs.getattr(a.fh, ctx)).st_size == 8
        await fs.release(a.fh)
        b, _ = await fs.create(root, b"b", 0o644, os.O_WRONLY, ctx)
        await fs.write(b.fh, 0, b"bee")
        await fs.rename(root, b"a", root, b"b", 0, ctx)  # over b, still open
        assert (await fs.lookup(root, b"b", ctx)).st_ino == a.fh
        with pytest.raises(pyfuse3.FUSEError):
            await fs.lookup(root, b"a", ctx)
        assert bytes(await fs.read(b.fh, 0, 10)) == b"bee"
        await fs.release(b.fh)
        assert b.fh not in fs.data
        t = await fs.open(a.fh, os.O_WRONLY | os.O_TRUNC, ctx)
        assert (await fs.getattr(a.fh, ctx)).st_size == 0
        await fs.release(t.fh)
        await fs.unlink(root, b"b", ctx)
        assert not fs.data and not fs.names and not fs.opens and not fs.orphans

    asyncio.run(go())


@needs_fuse
def test_mount_pages_floor_writes_and_reads_through_memfs(capsys: pytest.CaptureFixture[str]) -> None:
    """``--floor``: the same page files (HiCacheFile's way: a stat, ``tofile`` to a tmp name,
    ``os.replace``) written and read back, bytes checked, through ``python -m
    kvfs.bench.memfs`` too, and deleted after each round (its files are its memory); a second
    table has a row per round and one of the medians, as many cells as its header."""
    from kvfs.bench import mount_pages

    assert mount_pages.main(["--pages-128k", "10", "--pages-2m", "0", "--rounds", "2",
                             "--threads", "3", "--writer", "hicache", "--floor",
                             "--floor-arg=--flush"]) == 0
    tables = capsys.readouterr().out.split("\n\n")
    assert len(tables) == 2
    lines = tables[1].splitlines()
    assert "floor write" in lines[0] and "memfs --flush MOUNTPOINT" in lines[0]
    assert [line.split(" | ")[0].strip("| ") for line in lines[2:]] == [
        "128 KiB", "128 KiB", "128 KiB, median of 2"]
    header = lines[0][: lines[0].rindex("|") + 1]
    assert {line.count("|") for line in lines[1:]} == {header.count("|")}
    assert all(line.split("|")[3].strip().endswith("files/s") for line in lines[2:4])


# fio ------------------------------------------------------------------------------
def _fio(directory: Path, out: Path, *args: str) -> dict[str, Any]:
    res = subprocess.run(["fio", "--ioengine=psync", "--iodepth=1", f"--directory={directory}",
                          "--output-format=json", f"--output={out}", *args],
                         capture_output=True, text=True, timeout=120,
                         cwd=out.parent)  # fio writes its *-verify.state files in its cwd
    report = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {}
    report["rc"] = res.returncode
    report["stderr"] = res.stderr
    return report


@needs_fuse
def test_fio_on_the_mount(mnt: Path, tmp_path: Path) -> None:
    assert shutil.which("fio"), "fio is not installed (apt-get install fio)"
    d = mnt / "fio"
    d.mkdir()
    for bs, size in (("1m", "8m"), ("4k", "4m")):
        f = f"--filename=data-{bs}"
        runs = [("write", ["--rw=write", "--do_verify=1"]), ("read", ["--rw=read"]),
                ("randread", ["--rw=randread"])]
        for rw, extra in runs:
            r = _fio(d, tmp_path / f"{rw}-{bs}.json", f"--name={rw}-{bs}", f, f"--bs={bs}",
                     f"--size={size}", "--verify=crc32c", *extra)
            assert r["rc"] == 0, r["stderr"]
            (job,) = r["jobs"]
            assert job["error"] == 0
            io = job["write" if rw == "write" else "read"]["io_bytes"]
            assert io == int(size[:-1]) * 1024 * 1024
        assert os.path.getsize(d / f"data-{bs}") == int(size[:-1]) * 1024 * 1024
    assert list(tmp_path.glob("*-verify.state"))  # fio's state files went to the temp dir
    # the read jobs really verify: bytes fio did not write fail
    (d / "random").write_bytes(os.urandom(1024 * 1024))
    r = _fio(d, tmp_path / "bad.json", "--name=bad", "--filename=random", "--rw=read", "--bs=1m",
             "--size=1m", "--verify=crc32c")
    assert r["rc"] != 0


# lifecycle ----------------------------------------------------------------------------
@needs_fuse
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_unmounts_cleanly(tcluster: ThreadCluster, tmp_path: Path, sig: int) -> None:
    """A signal unmounts while requests keep arriving (two readers in a loop): exit 0 and
    nothing logged by asyncio (pyfuse3's asyncio shim woke its /dev/fuse reader a second
    time once the session closed: an InvalidStateError traceback at most unmounts)."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs")
    try:
        (m.mnt / "sig.txt").write_bytes(b"x")
        done = threading.Event()
        served = threading.Semaphore(0)

        def busy() -> None:
            while not done.is_set():
                try:
                    (m.mnt / "sig.txt").read_bytes()
                    os.listdir(m.mnt)
                except OSError:  # unmounted (the directory underneath is empty)
                    return
                served.release()

        with ThreadPoolExecutor(2) as ex:
            readers = [ex.submit(busy) for _ in range(2)]
            assert served.acquire(timeout=30)  # the readers are being answered
            try:
                assert m.stop(sig) == 0, m.stderr()
            finally:
                done.set()
            for r in readers:
                r.result(30)
        assert not is_mounted(str(m.mnt))
        assert "Traceback" not in m.stderr() and "InvalidStateError" not in m.stderr(), m.stderr()
    finally:
        m.cleanup()


@needs_fuse
def test_killed_mount_is_cleared_by_umount(tcluster: ThreadCluster, tmp_path: Path) -> None:
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs")
    try:
        m.stop(signal.SIGKILL)
        assert is_mounted(str(m.mnt))  # a dead endpoint, not a hang
        with pytest.raises(OSError) as ei:
            os.listdir(m.mnt)
        assert ei.value.errno == errno.ENOTCONN
        res = subprocess.run([sys.executable, "-m", "kvfs", "umount", str(m.mnt)],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(str(m.mnt))
    finally:
        m.cleanup()


@needs_fuse
def test_cluster_gone_gives_eio_then_recovers(tmp_path: Path) -> None:
    c = ThreadCluster(tmp_path / "cluster")
    m: Mount | None = None
    try:
        m = Mount(tmp_path / "mnt", c, tmp_path / "logs", "--timeout", "2s")
        (m.mnt / "before.bin").write_bytes(b"before")
        c.stop_services()
        t0 = time.monotonic()
        with pytest.raises(OSError) as ei:
            (m.mnt / "during.bin").write_bytes(b"during")
        assert ei.value.errno == errno.EIO
        with pytest.raises(OSError) as ei:
            os.stat(m.mnt / "other.bin")
        assert ei.value.errno == errno.EIO
        assert time.monotonic() - t0 < 15  # bounded, no hang
        c.start_services()

        def works() -> bool:
            try:
                (m.mnt / "after.bin").write_bytes(b"after")
                return (m.mnt / "after.bin").read_bytes() == b"after"
            except OSError:
                return False

        wait_until(works, 30, "the mount to work again")
        assert (m.mnt / "before.bin").read_bytes() == b"before"
        assert m.proc.poll() is None
    finally:
        if m is not None:
            m.cleanup()
        c.close()


async def test_overlapping_reads_are_batched(kv: AsyncClient) -> None:
    """The mount's read batcher: while reads are outstanding, new ones queue and go out together."""
    fs = KVFileSystem(client=kv, asynchronous=True)
    await kv.put_many({f"rb/{i}": str(i).encode() for i in range(300)})
    rb: Batcher[bytes, bytes | None] = Batcher(fs.client.get_many, max_items=128,
                                               max_bytes=1 << 30, max_inflight=2)
    got = await asyncio.gather(*(rb.submit(f"rb/{i}".encode()) for i in range(300)),
                               rb.submit(b"rb/none"))
    assert got == [str(i).encode() for i in range(300)] + [None]
    assert rb.batches == 5  # 1 + 1 alone while idle, then 128 + 128 + 45 queued
    assert await rb.submit(b"rb/7") == b"7"


def test_mount_without_pyfuse3_says_what_to_install(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['pyfuse3'] = None; from kvfs.cli import main; "
            f"sys.exit(main(['mount', {str(tmp_path)!r}, '--addr', 'kvfs://127.0.0.1:9']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "pyfuse3" in res.stderr and "pip install" in res.stderr


def test_umount_of_something_not_mounted(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "kvfs", "umount", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "not mounted" in res.stderr


# a 1 GiB file through the mount in bounded memory ----------------------------------------
def _vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def mount_round_trip(m: Mount, size_mib: int) -> tuple[int, int, int]:
    """``dd`` size_mib MiB into the mount from a pipe, then ``cat`` it back, checked by hash;
    returns the mount process's peak RSS (VmHWM, KiB) when it started, after the write, after
    the read."""
    start = _vm_kib(m.proc.pid, "VmHWM")
    path = m.mnt / "big.bin"
    seed = os.urandom(1024 * 1024)
    want = hashlib.sha256()
    dd = subprocess.Popen(["dd", f"of={path}", "bs=1M", "iflag=fullblock", "status=none"],
                          stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert dd.stdin is not None and dd.stderr is not None
    for i in range(size_mib):
        block = i.to_bytes(8, "big") + seed[8:]
        want.update(block)
        dd.stdin.write(block)
    dd.stdin.close()
    assert dd.wait(600) == 0, dd.stderr.read()
    dd.stderr.close()
    written = _vm_kib(m.proc.pid, "VmHWM")
    assert path.stat().st_size == size_mib * 1024 * 1024
    cat = subprocess.Popen(["cat", str(path)], stdout=subprocess.PIPE)
    assert cat.stdout is not None
    got, n = hashlib.sha256(), 0
    for part in iter(lambda: cat.stdout.read(1024 * 1024), b""):  # type: ignore[union-attr]
        got.update(part)
        n += len(part)
    assert cat.wait(600) == 0
    cat.stdout.close()
    assert n == size_mib * 1024 * 1024 and got.digest() == want.digest()
    read = _vm_kib(m.proc.pid, "VmHWM")
    path.unlink()
    return start, written, read


def _bounded_round_trip(tcluster: ThreadCluster, tmp_path: Path, size_mib: int) -> None:
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs")
    try:
        start, written, read = mount_round_trip(m, size_mib)
        print(f"mount peak RSS, {size_mib} MiB: at start {start} KiB, after dd {written} KiB, "
              f"after cat {read} KiB")
        assert written - start < 64 * 1024, (start, written)
        assert read - start < 64 * 1024, (start, read)
    finally:
        m.cleanup()


@needs_fuse
def test_mount_128mib_file_in_bounded_memory(tcluster: ThreadCluster, tmp_path: Path) -> None:
    """A mount holding the file would need > 128 MiB over its start; a streaming one a few
    stripe units per open file."""
    _bounded_round_trip(tcluster, tmp_path, 128)


@needs_fuse
@pytest.mark.big
@pytest.mark.timeout(1200)
def test_mount_1gib_file_in_bounded_memory(tcluster: ThreadCluster, tmp_path: Path) -> None:
    _bounded_round_trip(tcluster, tmp_path, 1024)


@needs_fuse
def test_streamed_writes_in_order_fsync_and_out_of_order(tcluster: ThreadCluster, tmp_path: Path,
                                                         fs: KVFileSystem) -> None:
    """With a 1 MiB write buffer: a 6 MiB file streams; fsync in the middle commits what was
    written and writing on still yields every byte; a write behind what was streamed fails
    with EOPNOTSUPP (and changes nothing, as a failed write does); small files keep any write
    pattern."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--write-buffer", "1MiB")
    try:
        d = m.mnt / "st"
        d.mkdir()
        data = os.urandom(6 * 1024 * 1024 + 5)
        fd = os.open(d / "a.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data[: 3 * 1024 * 1024])
            os.fsync(fd)  # commits the first 3 MiB
            assert fs.cat_file("st/a.bin") == data[: 3 * 1024 * 1024]
            for i in range(3 * 1024 * 1024, len(data), 128 * 1024):
                os.write(fd, data[i : i + 128 * 1024])
            assert os.stat(d / "a.bin").st_size == len(data)
        finally:
            os.close(fd)
        assert fs.cat_file("st/a.bin") == data
        assert (d / "a.bin").read_bytes() == data
        with open(d / "a.bin", "rb") as f:  # ranged reads of a pinned layout
            f.seek(5 * 1024 * 1024 - 3)
            assert f.read(10) == data[5 * 1024 * 1024 - 3 : 5 * 1024 * 1024 + 7]

        fd = os.open(d / "b.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data[: 4 * 1024 * 1024])
            with pytest.raises(OSError) as ei:
                os.pwrite(fd, b"header", 0)  # 4 MiB behind, past the 1 MiB buffer
            assert ei.value.errno == errno.EOPNOTSUPP
            os.pwrite(fd, b"recent", 4 * 1024 * 1024 - 100)  # within the buffer: fine
        finally:
            os.close(fd)  # the failed write changed nothing; the others are committed
        want = bytearray(data[: 4 * 1024 * 1024])
        want[-100:-94] = b"recent"
        assert fs.cat_file("st/b.bin") == want

        with open(d / "c.bin", "wb") as f:  # under the buffer: seeks back work
            f.write(b"x" * 1000)
            f.seek(0)
            f.write(b"HEAD")
        assert fs.cat_file("st/c.bin") == b"HEAD" + b"x" * 996
        os.rename(d / "a.bin", d / "moved.bin")  # a large file moves by streaming
        assert fs.cat_file("st/moved.bin") == data and not fs.exists("st/a.bin")
        os.truncate(d / "moved.bin", 2 * 1024 * 1024 + 1)
        assert fs.cat_file("st/moved.bin") == data[: 2 * 1024 * 1024 + 1]
        # in place in a file over the buffer
        with pytest.raises(OSError) as ei, open(d / "moved.bin", "r+b") as f:
            f.write(b"patch")
        assert ei.value.errno == errno.EOPNOTSUPP
        assert "Traceback" not in m.stderr()
    finally:
        m.cleanup()


def _open_w(p: Path) -> int:
    return os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)


@needs_fuse
@pytest.mark.parametrize("args", [(), ("--write-behind", "64MiB")], ids=["commit", "write-behind"])
def test_a_handle_open_for_writing_keeps_to_its_file_across_rename_and_unlink(
        tcluster: ThreadCluster, tmp_path: Path, fs: KVFileSystem, args: tuple[str, ...]) -> None:
    """As on a local filesystem, a handle open for writing belongs to its file, not its name:
    once another file is renamed over that name, or the name is unlinked, the handle's writes
    and close change nothing any reader sees (the replaced file's bytes are discarded); once
    the file itself is renamed, its close commits under the new name; a rename that fails
    replaces nothing. Two handles open for writing on one path: each writes its own copy and
    the last close wins. With a 1 MiB write
    buffer, so that the large files stream while open."""
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--write-buffer", "1MiB", *args)
    big = os.urandom(3 * 1024 * 1024 + 11)
    try:
        top = "ro-wb" if args else "ro"  # one cluster for both runs
        d = m.mnt / top
        d.mkdir()
        for old in (b"old handle's bytes", big):  # small (one put), large (streamed)
            fs.pipe_file(f"{top}/a", b"committed before")
            # a file renamed over a name open for writing
            fd = _open_w(d / "a")
            try:
                os.write(fd, old)
                (d / "b").write_bytes(b"b's bytes")
                os.replace(d / "b", d / "a")
                os.write(fd, b" and more")
                os.fsync(fd)  # commits nothing either
            finally:
                os.close(fd)
            fsync_dir(d)  # --write-behind: every file held under it committed
            assert (d / "a").read_bytes() == b"b's bytes"
            assert fs.cat_file(f"{top}/a") == b"b's bytes" and not fs.exists(f"{top}/b")
            # a name unlinked while open for writing
            fd = _open_w(d / "u")
            try:
                os.write(fd, old)
                os.unlink(d / "u")
                os.write(fd, b" and more")
            finally:
                os.close(fd)
            fsync_dir(d)  # --write-behind: every file held under it committed
            assert _gone(d / "u") and not fs.exists(f"{top}/u")
            # the file itself renamed while open for writing: its bytes end up at the new name
            fd = _open_w(d / "c")
            try:
                os.write(fd, old)
                os.rename(d / "c", d / "moved")
                os.write(fd, b" and more")
            finally:
                os.close(fd)
            fsync_dir(d)  # --write-behind: every file held under it committed
            assert (d / "moved").read_bytes() == old + b" and more"
            assert fs.cat_file(f"{top}/moved") == old + b" and more"
            assert _gone(d / "c") and not fs.exists(f"{top}/c")
            assert sorted(os.listdir(d)) == ["a", "moved"]
            fs.rm([f"{top}/a", f"{top}/moved"])
        # a rename that fails (its source deleted by another client, the kernel not told yet)
        # replaces nothing: a handle open for writing on the target commits to it as before
        fs.pipe_file(f"{top}/gone", b"deleted elsewhere")
        assert (d / "gone").stat().st_size == 17  # the kernel keeps the name for --attr-timeout
        fd = _open_w(d / "kept")
        try:
            os.write(fd, b"kept's bytes")
            fs.rm_file(f"{top}/gone")
            with pytest.raises(FileNotFoundError):
                os.rename(d / "gone", d / "kept")
        finally:
            os.close(fd)
        fsync_dir(d)  # --write-behind: every file held under it committed
        assert fs.cat_file(f"{top}/kept") == b"kept's bytes"
        # two handles open for writing on one path: each has its own copy, the last close wins
        fd1, fd2 = _open_w(d / "two"), _open_w(d / "two")
        try:
            os.write(fd1, b"first")
            os.write(fd2, b"second!")
        finally:
            os.close(fd2)
            os.close(fd1)
        fsync_dir(d)  # --write-behind: every file held under it committed
        assert (d / "two").read_bytes() == b"first" and fs.cat_file(f"{top}/two") == b"first"
        assert sorted(os.listdir(d)) == ["kept", "two"]
        assert "Traceback" not in m.stderr() and "not committed" not in m.stderr()
    finally:
        m.cleanup()


@pytest.mark.parametrize(("limits", "batches"), [
    ({}, 5),  # 1 + 1 alone while idle, then 128 + 128 + 43 queued
    ({"max_batch_items": 50}, 8),  # 1 + 1, then 6 x 50 - 1
    ({"max_batch_items": 50, "batches_in_flight": 1}, 7),  # 1, then 6 x 50
])
async def test_closes_share_commits(kv: AsyncClient, limits: dict[str, int], batches: int) -> None:
    """The mount's small-file commits: while commits are outstanding, new closes queue and go
    out together as one put_many (one APPEND per server, one COMMIT), within the mount's
    --max-batch-items and --batches-in-flight."""
    from kvfs.config import MountConfig
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import InodeTable

    io = FileIO(KVFileSystem(client=kv, asynchronous=True), InodeTable(), MountConfig(**limits))
    await asyncio.gather(*(io.put(f"cc/{i}", str(i).encode()) for i in range(300)),
                         io.put("cc/7", b"seven"))
    assert io.puts.batches == batches
    assert await kv.get_many([f"cc/{i}" for i in range(300)]) == [
        b"seven" if i == 7 else str(i).encode() for i in range(300)]


async def test_held_closes_share_commits(kv: AsyncClient) -> None:
    """--write-behind: holding returns at once; the held files go out as the closes' commits
    do, two batches at once and the backlog together, each path's last version last."""
    from kvfs.config import MountConfig
    from kvfs.mount.writebehind import WriteBehind

    wb = WriteBehind(kv, MountConfig(write_behind_bytes=1 << 20, write_behind_delay_s=0))
    for i in range(300):
        assert await wb.hold(f"hb/{i}", str(i).encode(), len(str(i)))
    assert await wb.hold("hb/7", b"seven", 5)  # replaces the queued version of hb/7
    assert await wb.hold("hb/0", b"zero", 4)  # waits for the one being committed
    assert wb.get("hb/7").read(0, 100) == b"seven"  # type: ignore[union-attr]
    assert await wb.rename("hb/5", "hb/five")
    assert wb.has_under("hb/") and not wb.has_under("h/") and not wb.has_under("hb/7/")
    await wb.sync_under("")
    assert wb.batches == 5 and wb.held_files == 0 and wb.held_bytes == 0
    assert not wb.has_under("hb/") and not wb._dirs
    got = await kv.get_many(["hb/0", "hb/5", "hb/five", "hb/7", "hb/8"])
    assert got == [b"zero", None, b"5", b"seven", b"8"]
    assert not await wb.hold("hb/big", bytes(2 << 20), 2 << 20)  # over the bound: not held


async def test_replaced_held_versions_end_with_their_successor(kv: AsyncClient) -> None:
    """--write-behind: versions of a path replaced before they were sent end as the last one
    does, with its very outcome (here a failure), each once through the ``ended`` hook, however
    many there were (no recursion per version); a failure nobody awaits is not logged by
    asyncio as never retrieved (the committer reports it)."""
    import gc

    from kvfs.config import MountConfig
    from kvfs.errors import ServerError
    from kvfs.mount.writebehind import Held, WriteBehind

    ended: list[Held] = []
    wb = WriteBehind(kv, MountConfig(write_behind_bytes=1 << 20, write_behind_delay_s=60),
                     ended=ended.append)
    versions = []
    for i in range(3000):  # more than the interpreter's recursion limit
        v = await wb.hold("rv/a", b"%d" % i, len(b"%d" % i))
        assert isinstance(v, Held)
        versions.append(v)

    async def refused(batch: Any) -> None:
        raise ServerError("injected: meta refuses the commit")

    wb._send = refused  # type: ignore[method-assign]
    with pytest.raises(OSError, match="injected"):
        await wb.sync("rv/a")
    assert len({id(v.done.exception()) for v in versions}) == 1
    assert sorted(map(id, ended)) == sorted(map(id, versions))
    loop = asyncio.get_running_loop()
    logged: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: logged.append(context))
    try:
        v = await wb.hold("rv/b", b"b", 1)
        assert isinstance(v, Held)
        done = v.done
        del v, versions
        async with wb._hurried():  # sent now, as an fsync would ask
            await asyncio.wait([done])  # (waits without taking its exception)
        assert ended[-1].path == "rv/b"
        del done, ended[:]
        gc.collect()
        assert not logged
    finally:
        loop.set_exception_handler(None)


async def test_in_order_writes_keep_the_kernels_buffers(kv: AsyncClient) -> None:
    """Writes of at least 64 KiB in order are kept as the kernel's buffers came and committed
    from them, not copied into one buffer; a write elsewhere, a read or a truncation copies
    them into one first.  The committed bytes are the same either way."""
    from kvfs.config import MountConfig
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable

    table = InodeTable()
    io = FileIO(KVFileSystem(client=kv, asynchronous=True), table, MountConfig())
    h = Handle(table.remember("tb/f"), writable=True, data=bytearray(), dirty=True)
    table.open(h)
    a, b, c = os.urandom(100_000), os.urandom(70_000), os.urandom(80_000)
    await io.write(h, 0, a)
    await io.write(h, len(a), b)
    assert h.tail[0] is a and h.tail[1] is b and not h.data and h.size == 170_000
    await io.commit(h)
    assert await kv.get("tb/f") == a + b
    await io.write(h, 10, b"xyz")  # behind the end: one buffer from here on
    assert not h.tail and h.size == 170_000
    assert bytes(await io.read(h, 8, 7)) == a[8:10] + b"xyz" + a[13:15]
    await io.write(h, 170_000, c)
    assert h.tail == [c]
    await io.truncate(h, 200_000)
    assert not h.tail and h.size == 200_000
    await io.commit(h)
    assert await kv.get("tb/f") == (a[:10] + b"xyz" + a[13:] + b + c)[:200_000]


async def test_lookups_are_one_shared_round_trip(kv: AsyncClient, clock: Any) -> None:
    """The mount's lookups (the kernel's LOOKUP/GETATTR): concurrent ones share one LOOKUP,
    and a miss says in it whether it is a directory (no LIST after it), expired keys under
    a name not counting."""
    from kvfs.config import MountConfig
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import InodeTable

    io = FileIO(KVFileSystem(client=kv, asynchronous=True), InodeTable(), MountConfig())
    await kv.put_many({"lu/f": b"file", "lu/d/x": b"under"})
    await kv.put("lu/old/x", b"expiring", ttl=5)
    clock.advance(10)
    before = dict(kv.rpc_counts)
    got = await asyncio.gather(*(io.info(i + 2, p) for i, p in enumerate(
        ["lu/f", "lu/d", "lu/none", "lu/old", "lu/f/x"])), return_exceptions=True)
    assert [g["type"] if isinstance(g, dict) else type(g) for g in got] == [
        "file", "directory", FileNotFoundError, FileNotFoundError, FileNotFoundError]
    assert {op: n - before.get(op, 0) for op, n in kv.rpc_counts.items() if n != before.get(op, 0)} \
        == {"LOOKUP": 3}  # two go at once (--batches-in-flight 2), the other three together


async def test_misses_from_a_recent_listing_need_no_lookup(kv: AsyncClient, clock: Any) -> None:
    """--negative-timeout: a name missing from its directory's listing made at most that long
    ago is a miss without a LOOKUP, so another client's new file there stays hidden at most
    that long; names this mount makes are seen at once; a directory over
    --negative-listing-keys is not trusted (its lookups ask meta); off by default."""
    from kvfs.config import MountConfig
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import InodeTable

    await kv.put_many({"neg/a": b"a", **{f"big/{i}": b"%d" % i for i in range(4)}})
    fs = KVFileSystem(client=kv, asynchronous=True)
    io = FileIO(fs, InodeTable(), MountConfig(negative_timeout_s=5.0, negative_listing_keys=3),
                clock=clock)

    async def lookups(*paths: str) -> tuple[list[int | None], int]:
        """Each path's size (None: a miss), and the LOOKUPs they took."""
        before = kv.rpc_counts.get("LOOKUP", 0)
        sizes: list[int | None] = []
        for i, p in enumerate(paths):
            try:
                sizes.append((await io.info(100 + i, p))["size"])
            except FileNotFoundError:
                sizes.append(None)
        await asyncio.gather(*io._tasks)  # the listings they started
        return sizes, kv.rpc_counts.get("LOOKUP", 0) - before

    assert await lookups("neg/x") == ([None], 1)  # no listing yet: meta, and a listing
    assert await lookups("big/x") == ([None], 1)
    await kv.put("neg/other", b"by another client")
    assert await lookups("neg/y", "neg/other", "neg/a") == ([None, None, 1], 1)  # only neg/a asks
    await io.put("neg/mine", b"made here")
    assert await lookups("neg/mine") == ([9], 1)
    assert await lookups("big/y") == ([None], 1)  # 4 keys > 3: not trusted
    clock.advance(6)  # past the bound: meta again, and a new listing
    assert await lookups("neg/other") == ([17], 1)
    assert await lookups("neg/z", "neg/other") == ([None, 17], 1)
    off = FileIO(fs, InodeTable(), MountConfig(), clock=clock)
    before = kv.rpc_counts.get("LOOKUP", 0)
    for p in ("neg/z", "neg/z"):
        with pytest.raises(FileNotFoundError):
            await off.info(2, p)
    assert kv.rpc_counts.get("LOOKUP", 0) - before == 2 and not off._tasks


async def test_a_walk_through_a_listed_directory_looks_names_up_ahead(
        kv: AsyncClient, clock: Any) -> None:
    """--negative-timeout: lookups that walk a listed directory in its order (as threads
    reading its files one after another do) get the next --max-batch-items names' layouts
    in one LOOKUP ahead of them: a name's LOOKUP then answers from there, right, while
    fresh (within --attr-timeout of when it was asked for, for what is left of that) and
    nothing was made or changed through the mount since; random lookups ask meta each."""
    from kvfs.config import MountConfig
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import InodeTable

    n = 200
    await kv.put_many({f"walk/f{i:03d}": b"x" * i for i in range(n)})

    def mount_io() -> FileIO:
        return FileIO(KVFileSystem(client=kv, asynchronous=True), InodeTable(),
                      MountConfig(negative_timeout_s=60.0, max_batch_items=32), fresh_s=60.0,
                      clock=clock)

    async def sizes(io: FileIO, names: range | list[int]) -> tuple[list[int], int]:
        """Each file's size by a lookup in turn, and the LOOKUPs they took."""
        before = kv.rpc_counts.get("LOOKUP", 0)
        got = []
        for i in names:
            info = await io.info(1000 + i, f"walk/f{i:03d}")
            assert 0 < info.get("valid_s", 60.0) <= 60.0
            got.append(info["size"])
            await asyncio.gather(*io._tasks)  # the listing, the look-ahead they started
        return got, kv.rpc_counts.get("LOOKUP", 0) - before

    io = mount_io()
    got, lookups = await sizes(io, range(n))
    assert got == list(range(n))
    assert lookups <= 2 + n // 16  # one per name without
    # a look-ahead older than the lookup's freshness is not used
    io = mount_io()
    await sizes(io, [0, 1])
    assert "walk/f005" in io._ahead
    for e in io._ahead.values():
        e.at -= 61
    assert await sizes(io, range(2, 10)) == (list(range(2, 10)), 2)  # meta, then ahead again
    # a value written through the mount is seen at once, not as looked up ahead before
    assert "walk/f020" in io._ahead
    await io.put("walk/f020", b"new")
    assert await sizes(io, [10, 20]) == ([10, 3], 2)
    # a change through the mount voids only that name's: the others still answer ahead
    assert "walk/f030" in io._ahead and "walk/f031" in io._ahead
    io.table.remember("walk/f030")
    io.changed(io.table.ino_of("walk/f030"))
    assert await sizes(io, [30, 31]) == ([30, 31], 1)

    # a change that lands while a LOOKUP waits on its look-ahead: meta answers that LOOKUP
    class Gate(asyncio.Future[list[Any]]):
        """A look-ahead's answer, held; ``awaited`` is set once a LOOKUP waits on it."""

        def __init__(self) -> None:
            super().__init__()
            self.awaited = asyncio.Event()

        def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
            self.awaited.set()
            super().add_done_callback(fn, context=context)

    ahead = io._ahead["walk/f032"]
    answer, gate = await ahead.task, Gate()
    ahead.task = gate  # type: ignore[assignment]
    lookup = asyncio.ensure_future(sizes(io, [32]))
    await asyncio.wait_for(gate.awaited.wait(), 30)
    await io.put("walk/f032", b"new32")
    gate.set_result(answer)
    assert await lookup == ([5], 1)
    # random lookups: none ahead
    io = mount_io()
    order = [0, 100, 50, 150, 25, 175, 75, 125]
    assert await sizes(io, order) == (order, len(order))
    assert not io._ahead
    # a directory's answer from ahead is kept by the kernel no longer either
    await kv.put_many({"walk2/a0": b"a", "walk2/a1": b"b", "walk2/d/x": b"c"})
    io = mount_io()
    for i, name in enumerate(["a0", "a1", "a1"]):
        await io.info(3000 + i, f"walk2/{name}")
        await asyncio.gather(*io._tasks)
    info = await io.info(3010, "walk2/d")
    assert info["type"] == "directory" and 0 < info["valid_s"] <= 60.0


async def test_first_read_uses_the_layout_its_lookup_saw(kv: AsyncClient) -> None:
    """A read soon after the kernel's LOOKUP reads the layout that lookup fetched (no second
    lookup); once this mount changes the file, or after the attribute time, it looks up again."""
    from kvfs.config import MountConfig
    from kvfs.errors import StaleLayout
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable
    from kvfs.stream import ValueReader

    table = InodeTable()
    io = FileIO(KVFileSystem(client=kv, asynchronous=True), table, MountConfig(), fresh_s=60)
    sent: list[object] = []
    run = io.reads._run

    async def spy(wants: list[tuple[ValueReader | bytes, int]]) -> list[Any]:
        sent.extend(w for w, _ in wants)
        return await run(wants)

    io.reads._run = spy  # type: ignore[method-assign]
    await kv.put("lk/f", b"one")
    ino = table.remember("lk/f")  # the kernel knows it

    async def read_once() -> bytes:
        fh = table.open(Handle(ino, writable=False))
        try:
            return await io.read(table.handle(fh), 0, 100)
        finally:
            table.close(fh)

    assert (await io.info(ino, "lk/f"))["size"] == 3
    assert await read_once() == b"one" and isinstance(sent[-1], ValueReader)
    await io.put("lk/f", b"two!")  # this mount's commit: the looked-up layout is stale
    io.changed(ino)
    assert await read_once() == b"two!" and sent[-1] == b"lk/f"
    io.fresh_s = 0.0  # past the attribute time: looked up again
    await io.info(ino, "lk/f")
    assert await read_once() == b"two!" and sent[-1] == b"lk/f"
    io.fresh_s = 60.0
    await io.info(ino, "lk/f")  # another client replaces the value after this lookup and
    await kv.put("lk/f", b"three")  # its old bytes are gone: the first read reads the new one

    async def stale(wants: list[tuple[ValueReader | bytes, int]]) -> list[Any]:
        if any(isinstance(w, ValueReader) for w, _ in wants):
            raise StaleLayout("the bytes this layout names are gone")  # injected
        return await spy(wants)

    io.reads._run = stale  # type: ignore[method-assign]
    assert await read_once() == b"three" and sent[-1] == b"lk/f"
    io.reads._run = spy  # type: ignore[method-assign]
    await io.info(ino, "lk/f")
    assert await read_once() == b"three" and isinstance(sent[-1], ValueReader)
    await io.info(ino, "lk/f")
    io.fresh_s = 0.0  # a window of 0 s holds nothing, even at once: in the loop's same tick
    assert io._fresh(ino) is None  # (uvloop's clock moves by the millisecond)
    io.fresh_s = 60.0
    await kv.delete("lk/f")  # another client's delete, seen once the attribute time is past
    io.fresh_s = 0.0
    with pytest.raises(FileNotFoundError):
        await read_once()
    with pytest.raises(FileNotFoundError):
        await io.info(ino, "lk/f")
    with pytest.raises(FileNotFoundError):
        await io.info(ino, "lk/missing")
    await kv.put("lk/d/x", b"")
    assert (await io.info(table.ino_for("lk/d"), "lk/d"))["type"] == "directory"


async def test_a_closed_files_units_are_reused_never_while_viewed(kv: AsyncClient) -> None:
    """--unit-pool: the whole-MiB stripe units a closed file read are received into again by
    the next files' reads (no fresh buffer to zero and fault in), each file still reading
    its own bytes; a unit some view still reads (a read's answer kept) is never received
    over, and a pool of 0 keeps nothing."""
    from kvfs.config import MountConfig
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable

    unit = kv.config.stripe_bytes
    assert unit >= 1 << 20  # whole-MiB units: the ones kept
    values = {f"up/{i}": os.urandom(2 * unit) for i in range(4)}
    for k, v in values.items():
        await kv.put(k, v)

    async def read_whole(io: FileIO, table: InodeTable, path: str
                         ) -> tuple[bytes, bytes | memoryview]:
        fh = table.open(Handle(table.remember(path), writable=False))
        h = table.handle(fh)
        first = await io.read(h, 0, unit)
        out = bytes(first) + bytes(await io.read(h, unit, unit))
        table.close(fh)
        await io.release(h)
        io.closed(h)
        return out, first

    table = InodeTable()
    io = FileIO(KVFileSystem(client=kv, asynchronous=True), table, MountConfig(read_ahead_units=1))
    got, kept = await read_whole(io, table, "up/0")  # its first unit stays viewed (kept)
    assert got == values["up/0"]
    assert io._unit_pool.buffers == 1  # the other unit: no view of it alive
    for i in (1, 2, 3):
        got, _ = await read_whole(io, table, f"up/{i}")
        assert got == values[f"up/{i}"]
    assert io._unit_pool.reused >= 2
    assert bytes(kept) == values["up/0"][:unit]  # never received over while viewed

    table = InodeTable()
    io = FileIO(KVFileSystem(client=kv, asynchronous=True), table,
                MountConfig(read_ahead_units=1, unit_pool_bytes=0))
    for i in (0, 1):
        got, _ = await read_whole(io, table, f"up/{i}")
        assert got == values[f"up/{i}"]
    assert io._unit_pool.buffers == 0 and io._unit_pool.reused == 0


async def test_a_failed_read_ahead_nobody_reads_is_a_quiet_miss(kv: AsyncClient) -> None:
    """Read-ahead units a reader never reads: one whose fetch failed (a server gone, its bytes
    reclaimed) is a miss, not an asyncio "exception was never retrieved" error once the file
    is closed and its fetches dropped."""
    import gc

    from kvfs.config import MountConfig
    from kvfs.errors import Unavailable
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable
    from kvfs.stream import ValueReader

    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    old_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        table = InodeTable()
        io = FileIO(KVFileSystem(client=kv, asynchronous=True), table, MountConfig(read_ahead_units=3))
        await kv.put("ra/f", os.urandom(5 * kv.config.stripe_bytes))
        run = io.reads._run

        async def unreachable(wants: list[tuple[ValueReader | bytes, int]]) -> list[Any]:
            if any(off for _, off in wants):  # the first unit is read; the rest are not there
                raise Unavailable("injected: the servers holding the later units are down")
            return await run(wants)

        io.reads._run = unreachable  # type: ignore[method-assign]
        fh = table.open(Handle(table.remember("ra/f"), writable=False))
        h = table.handle(fh)
        assert len(await io.read(h, 0, 4096)) == 4096  # in order from 0: reads ahead
        assert len(h.units) == 4
        while io._tasks:  # the read-ahead fetches end (failed); nobody reads them
            await asyncio.wait(set(io._tasks))
        table.close(fh)
        del h
        gc.collect()  # the dropped fetches' finalizers run now
        assert not [e for e in errors if "never retrieved" in str(e.get("message"))], errors
    finally:
        loop.set_exception_handler(old_handler)


async def test_an_open_keeps_the_kernels_pages_only_of_the_same_value(kv: AsyncClient) -> None:
    """--page-cache-files: a read-only open keeps the kernel's cached pages of a file only
    when its LOOKUP found the very value (layout) they were read from, recorded at the last
    open that dropped them, and no other open of the file here reads another version or
    writes it; a value replaced (even by the same bytes), written here or read from another
    version meanwhile drops them.  The handle reads the value it was opened on; if that
    value's bytes are reclaimed before its first read, a kept handle fails (ESTALE) rather
    than mix two values, a dropped one reads the new value."""
    from kvfs.config import MountConfig
    from kvfs.errors import StaleLayout
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable
    from kvfs.stream import ValueReader

    table = InodeTable()
    fs = KVFileSystem(client=kv, asynchronous=True)
    io = FileIO(fs, table, MountConfig(), fresh_s=60)
    await kv.put_many({"pk/a": b"one", "pk/b": b"bee"})
    a, b = table.remember("pk/a"), table.remember("pk/b")

    async def open_(ino: int, path: str, cfg: FileIO = io) -> tuple[int, bool]:
        await cfg.info(ino, path)  # the kernel's LOOKUP
        h = Handle(ino, writable=False)
        keep = cfg.opened(h)
        return table.open(h), keep

    async def read_(fh: int, cfg: FileIO = io) -> bytes:
        return bytes(await cfg.read(table.handle(fh), 0, 100))

    async def once(ino: int, path: str, cfg: FileIO = io) -> tuple[bool, bytes]:
        fh, keep = await open_(ino, path, cfg)
        assert not table.handle(fh).direct  # no other open of it here: through the pages
        try:
            return keep, await read_(fh, cfg)
        finally:
            table.close(fh)

    assert await once(a, "pk/a") == (False, b"one")  # pages dropped, then read from "one"
    assert await once(a, "pk/a") == (True, b"one")  # the same value: kept
    await kv.put("pk/a", b"one")  # replaced by another client, same bytes: a new value
    assert await once(a, "pk/a") == (False, b"one")
    assert await once(a, "pk/a") == (True, b"one")
    fh1, keep = await open_(a, "pk/a")  # open on "one" while another client replaces it
    await kv.put("pk/a", b"two")
    fh2, keep2 = await open_(a, "pk/a")  # a second open reads "two": pages could mix
    assert (keep, keep2) == (True, False)
    # the pages are per file: the later open reads past them (direct_io), the first through
    assert table.handle(fh2).direct and not table.handle(fh1).direct
    fh3, keep3 = await open_(a, "pk/a")  # "two" again: the other version is still open
    assert not keep3 and table.handle(fh3).direct
    assert await read_(fh3) == b"two"
    table.close(fh3)
    assert (await read_(fh1), await read_(fh2)) == (b"one", b"two")
    table.close(fh1)
    table.close(fh2)
    assert await once(a, "pk/a") == (False, b"two")  # not trusted since
    assert await once(a, "pk/a") == (True, b"two")
    io.writing(a)  # opened for writing here
    assert await once(a, "pk/a") == (False, b"two")
    io.changed(a)  # this mount committed, renamed or removed it
    assert await once(a, "pk/a") == (False, b"two")
    w = Handle(a, writable=True)
    fw = table.open(w)  # a writer still open: not kept
    assert (await once(a, "pk/a"))[0] is False and (await once(a, "pk/a"))[0] is False
    table.close(fw)
    assert await once(a, "pk/a") == (False, b"two")
    assert await once(a, "pk/a") == (True, b"two")

    # the value's bytes reclaimed (injected) before the first read: never two values mixed
    real = io.reads._run

    async def stale(wants: list[tuple[ValueReader | bytes, int]]) -> list[Any]:
        if any(isinstance(w, ValueReader) for w, _ in wants):
            raise StaleLayout("the bytes this layout names are gone")  # injected
        return await real(wants)

    fh, keep = await open_(a, "pk/a")
    await kv.put("pk/a", b"three")
    io.reads._run = stale  # type: ignore[method-assign]
    with pytest.raises(OSError) as err:
        await read_(fh)
    assert keep and err.value.errno == errno.ESTALE
    table.close(fh)
    assert await once(a, "pk/a") == (False, b"three")  # dropped: reads what is there now
    io.changed(a)
    fa, keep_a = await open_(a, "pk/a")  # dropped, pinned to "three"
    fb, _ = await open_(a, "pk/a")  # the same value: both read through the pages
    await kv.put("pk/a", b"four")
    with pytest.raises(OSError) as err:  # so neither may move on to "four" alone
        await read_(fa)
    assert (keep_a, err.value.errno) == (False, errno.ESTALE)
    assert not table.handle(fa).direct and not table.handle(fb).direct
    table.close(fa)
    table.close(fb)
    io.reads._run = real  # type: ignore[method-assign]

    # bounded: --page-cache-files 1 remembers one file; 0 keeps nothing
    one = FileIO(fs, table, MountConfig(page_cache_files=1), fresh_s=60)
    assert [(await once(i, p, one))[0] for i, p in ((a, "pk/a"), (a, "pk/a"), (b, "pk/b"),
                                                    (a, "pk/a"), (a, "pk/a"))] == [
        False, True, False, False, True]
    off = FileIO(fs, table, MountConfig(page_cache_files=0), fresh_s=60)
    assert [(await once(a, "pk/a", off))[0] for _ in range(2)] == [False, False]
    # no recent lookup: dropped, and the first read pins the value as before
    io.fresh_s = 0.0
    h = Handle(a, writable=False)
    assert not io.opened(h) and h.reader is None
    fh = table.open(h)
    assert await read_(fh) == b"four"
    table.close(fh)


async def test_an_open_reads_through_the_kernels_pages_only_the_size_it_was_told(kv: AsyncClient) -> None:
    """The kernel ends reads through its pages of a file at the size it was last told (its
    attributes: ``InodeTable.tell``), and a smaller value's short read need not shrink it.
    So a read-only open reads through them only a value of that size: one that finds
    another (the mount looked the file up without the kernel) is ``direct``, an open with
    no recent lookup looks the file up first, and a handle whose first read finds another
    size (its pinned bytes reclaimed) fails (ESTALE) rather than be cut there."""
    from kvfs.config import MountConfig
    from kvfs.errors import StaleLayout
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable
    from kvfs.stream import ValueReader

    table = InodeTable()
    fs = KVFileSystem(client=kv, asynchronous=True)
    io = FileIO(fs, table, MountConfig(), fresh_s=60)
    real = io.reads._run
    fhs: list[int] = []

    async def stale(wants: list[tuple[ValueReader | bytes, int]]) -> list[Any]:
        if any(isinstance(w, ValueReader) for w, _ in wants):
            raise StaleLayout("the bytes this layout names are gone")  # injected
        return await real(wants)

    async def open_(*, direct: bool) -> Handle:
        """A read-only open after a lookup (the handles opened before it closed)."""
        while fhs:
            table.close(fhs.pop())
        await io.info(a, "ts/a")  # a lookup (the kernel's, or the mount's own)
        h = Handle(a, writable=False)
        assert io.opened(h) is not None and h.direct is direct
        fhs.append(table.open(h))
        return h

    def told(size: int) -> None:  # the kernel's LOOKUP answered with ``size``
        table.tell(a, size, 0.0, 0.0, force=True)

    await kv.put("ts/a", b"one")
    a = table.remember("ts/a")
    told(3)
    await kv.put("ts/a", b"longer value")
    h = await open_(direct=True)  # the mount's own lookup: past the pages, which end at 3 bytes
    assert bytes(await io.read(h, 0, 100)) == b"longer value"
    told(12)  # the kernel's next LOOKUP
    await kv.put("ts/a", b"two")
    h = await open_(direct=True)  # smaller: the kernel may keep 12 past a short read
    assert bytes(await io.read(h, 0, 100)) == b"two"
    told(3)
    h = await open_(direct=False)  # pinned to "two" ...
    await kv.put("ts/a", b"longer value")  # ... replaced by a larger value, its bytes gone
    io.reads._run = stale  # type: ignore[method-assign]
    with pytest.raises(OSError) as err:  # "longer value" through pages that end at 3 bytes: never
        await io.read(h, 0, 100)
    assert err.value.errno == errno.ESTALE
    io.reads._run = real  # type: ignore[method-assign]
    while fhs:
        table.close(fhs.pop())
    io._looked_up.clear()  # no recent lookup: looked up first, then past the pages
    h = Handle(a, writable=False)
    assert io.opened(h) is None and h.reader is None
    await io.info(a, "ts/a")
    assert io.opened(h, looked=True) is False and h.direct
    told(12)  # the kernel's next LOOKUP
    h = await open_(direct=False)
    assert bytes(await io.read(h, 0, 100)) == b"longer value"


def test_another_size_is_told_the_kernel_only_for_a_request_after_the_last_answer_landed() -> None:
    """``InodeTable.tell``: the kernel applies an attribute answer only if no attribute
    change landed after it sent the request, so a new size goes only for a request that
    came ``SETTLE_S`` after the last answer (or WRITE) was sent; until then the last size is
    sent again (and recorded).  ``force`` (a SETATTR's answer, an atomic O_TRUNC) changes it
    at once, ``keep`` (a listing's entries) never."""
    from kvfs.mount.inodes import SETTLE_S, InodeTable

    t = InodeTable()
    ino = t.remember("x")
    assert t.told_size(ino) is None
    assert t.tell(ino, 10, 100.0, 100.0) == 10  # the first: nothing to race with
    # asked before that answer, answered well after it: the kernel drops it if that landed first
    assert t.tell(ino, 20, 99.9, 100.2) == 10
    assert t.tell(ino, 20, 100.2 + SETTLE_S / 2, 100.3) == 10  # asked too soon after the last
    assert t.told_size(ino) == 10
    assert t.tell(ino, 20, 100.3 + 2 * SETTLE_S, 100.4) == 20
    assert t.tell(ino, 30, 200.0, 200.0, keep=True) == 20  # a listing: the size sent stays
    assert t.tell(ino, 5, 201.0, 201.0, force=True) == 5  # a SETATTR's answer
    t.wrote(ino, 30, 202.0)
    assert t.told_size(ino) == 30
    assert t.tell(ino, 40, 202.0 + SETTLE_S / 2, 202.1) == 30  # asked too soon after the WRITE
    assert t.tell(ino, 40, 202.1 + 2 * SETTLE_S, 202.3) == 40
    t.wrote(ino, 5, 203.0)  # a write inside the file grows nothing
    assert t.told_size(ino) == 40


async def test_the_kernels_size_follows_writes_and_o_trunc_not_a_listing(kv: AsyncClient) -> None:
    """What the mount records as the kernel's size of a file: a WRITE grows it, an open with
    O_TRUNC makes it 0 (the kernel truncates at the open: atomic O_TRUNC), and a directory
    listing's entry, taken before, never changes it, not even for a file being written here
    (whose size the kernel has from the writes)."""
    import pyfuse3

    from kvfs.mount.inodes import ROOT_INODE
    from kvfs.mount.ops import KVFSOperations

    ops = KVFSOperations(KVFileSystem(client=kv, asynchronous=True), attr_timeout_s=60)
    ctx = pyfuse3.RequestContext()
    fi, made = await ops.create(ROOT_INODE, b"ks", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, ctx)
    ino = made.st_ino
    await ops.write(fi.fh, 0, b"x" * 4096)
    assert ops.table.told_size(ino) == 4096
    listed = {"name": "ks", "size": 10, "type": "file", "created": 1.0}  # (taken at opendir)
    assert ops._attrs(ino, listed, keep=True).st_size == 4096
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    assert ops._attrs(ino, listed, keep=True).st_size == 4096
    for flags in (os.O_WRONLY | os.O_TRUNC, os.O_RDONLY | os.O_TRUNC):
        fi = await ops.open(ino, flags, ctx)
        assert ops.table.told_size(ino) == 0, flags
        await ops.release(fi.fh)
        ops.table.tell(ino, 4096, 0.0, 0.0, force=True)


async def test_a_commit_that_fails_at_release_is_logged_with_what_happened(
        kv: AsyncClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A written file whose commit still fails at release (its close's failed before) is lost,
    and the error log says why: a timeout, whose exception says nothing of itself, as the
    time it ran (the soak on a full cluster logged "the written data is lost: " and nothing)."""
    import pyfuse3

    from kvfs.mount.inodes import ROOT_INODE
    from kvfs.mount.ops import KVFSOperations

    ops = KVFSOperations(KVFileSystem(client=kv, asynchronous=True), timeout_s=0.25, attr_timeout_s=60)
    fi, _ = await ops.create(ROOT_INODE, b"lost", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                             pyfuse3.RequestContext())
    await ops.write(fi.fh, 0, b"x" * 4096)

    async def stuck(h: Any) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(ops.io, "commit", stuck)
    with caplog.at_level(logging.ERROR, logger="kvfs.mount"):
        await ops.release(fi.fh)
    assert [r.getMessage() for r in caplog.records] == [
        "release: lost: the written data is lost: TimeoutError: timed out after 0.25s"]
    assert not await kv.exists("lost")


async def test_direct_first_open_reads_a_values_first_open_past_the_kernels_pages(
        kv: AsyncClient) -> None:
    """--direct-first-open: the first open here of a value (a layout) reads past the kernel's
    pages (direct_io) and records nothing about them; the next open of that value reads
    through them, and the one after keeps them.  A new value's first open is direct again;
    remembered for --page-cache-files files (0: every open is direct)."""
    from kvfs.config import MountConfig
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable

    table = InodeTable()
    fs = KVFileSystem(client=kv, asynchronous=True)
    io = FileIO(fs, table, MountConfig(direct_first_open=True), fresh_s=60)
    await kv.put_many({"df/a": b"one", "df/b": b"bee"})
    a, b = table.remember("df/a"), table.remember("df/b")

    async def once(ino: int, path: str, cfg: FileIO = io) -> tuple[bool, bool, bytes]:
        """An open (after the kernel's LOOKUP) and its read: kept, direct, the bytes."""
        await cfg.info(ino, path)
        h = Handle(ino, writable=False)
        keep = cfg.opened(h)
        fh = table.open(h)
        try:
            return bool(keep), h.direct, bytes(await cfg.read(h, 0, 100))
        finally:
            table.close(fh)

    assert await once(a, "df/a") == (False, True, b"one")  # first: past the pages
    assert await once(a, "df/a") == (False, False, b"one")  # through them (dropped first)
    assert await once(a, "df/a") == (True, False, b"one")  # kept
    assert await once(a, "df/a") == (True, False, b"one")
    await kv.put("df/a", b"two")  # another client's new value: its first open here is direct
    assert await once(a, "df/a") == (False, True, b"two")
    assert await once(a, "df/a") == (False, False, b"two")
    assert await once(a, "df/a") == (True, False, b"two")
    assert await once(b, "df/b") == (False, True, b"bee")

    # bounded: --page-cache-files 1 remembers one file's direct open; 0: every open direct
    one = FileIO(fs, table, MountConfig(direct_first_open=True, page_cache_files=1), fresh_s=60)
    assert [(await once(i, p, one))[1] for i, p in ((a, "df/a"), (b, "df/b"), (a, "df/a"),
                                                    (a, "df/a"))] == [True, True, True, False]
    off = FileIO(fs, table, MountConfig(direct_first_open=True, page_cache_files=0), fresh_s=60)
    assert [(await once(a, "df/a", off))[:2] for _ in range(3)] == [(False, True)] * 3
    # without the flag the first open reads through the pages, as before
    plain = FileIO(fs, table, MountConfig(), fresh_s=60)
    assert (await once(b, "df/b", plain))[:2] == (False, False)


async def _open_and_read(io: Any, ino: int, path: str) -> tuple[bool, bytes]:
    """A read-only open of ``ino`` through ``io`` (a :class:`FileIO`), looked up first where
    the open asks for it, and its first 100 bytes: whether the kernel's pages were kept."""
    from kvfs.mount.inodes import Handle

    h = Handle(ino, writable=False)
    keep = io.opened(h)
    if keep is None:  # unsure: the open's own lookup
        await io.info(ino, path)
        keep = io.opened(h, looked=True)
    fh = io.table.open(h)
    try:
        return bool(keep), bytes(await io.read(h, 0, 100))
    finally:
        io.table.close(fh)


async def test_a_value_committed_here_keeps_the_pages_it_was_written_through(kv: AsyncClient) -> None:
    """--page-cache-files: a handle that wrote a file and committed it, with no other open of
    the file here meanwhile (``sole``), leaves the kernel's pages of it as that value's: a
    read-only open keeps them while the value is unchanged (soon after the commit with no
    lookup, the commit counts as one; later, or unsure, after one), and lookups report the
    mtime the kernel was told while it was written.  Another open during the write, a write
    after the commit, or another client's value since: dropped, and meta's creation time."""
    from kvfs.config import MountConfig
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable

    table = InodeTable()
    fs = KVFileSystem(client=kv, asynchronous=True)
    io = FileIO(fs, table, MountConfig(), fresh_s=60)
    ino = table.remember("wc/a")
    lookups = kv.rpc_counts.get("LOOKUP", 0)

    async def write(data: bytes, *, meanwhile: bool = False, after: bytes = b"",
                    cfg: FileIO = io) -> None:
        h = Handle(ino, writable=True, data=bytearray(), dirty=True, mtime=1234.5)
        h.sole = cfg.writing(ino)
        fh = table.open(h)
        if meanwhile:  # another open of the file here while it is written
            r = Handle(ino, writable=False)
            cfg.opened(r)
            table.close(table.open(r))
        await cfg.write(h, 0, data)
        await cfg.commit(h)
        if after:  # written on after a commit (fsync), then closed with nothing committed
            await cfg.write(h, len(data), after)
        table.close(fh)

    async def once(cfg: FileIO = io) -> tuple[bool, bytes]:
        return await _open_and_read(cfg, ino, "wc/a")

    await write(b"one")
    assert await once() == (True, b"one")  # soon after the commit: no lookup
    assert kv.rpc_counts.get("LOOKUP", 0) == lookups
    assert (await io.info(ino, "wc/a"))["created"] == 1234.5  # as the kernel was told
    assert await once() == (True, b"one")
    io._looked_up.clear()  # no lookup lately: the open asks meta, the pages still kept
    assert io.opened(Handle(ino, writable=False)) is None and await once() == (True, b"one")
    await kv.put("wc/a", b"one")  # another client's value, the same bytes
    assert (await io.info(ino, "wc/a"))["created"] != 1234.5
    assert await once() == (False, b"one")
    await write(b"two", meanwhile=True)
    assert await once() == (False, b"two")
    await write(b"three", after=b"!")
    assert await once() == (False, b"three")
    await write(b"four")
    assert await once() == (True, b"four")
    off = FileIO(fs, table, MountConfig(page_cache_files=0), fresh_s=60)
    await write(b"five", cfg=off)
    off._looked_up.clear()  # nothing kept: an open never looks it up for that
    assert off.opened(Handle(ino, writable=False)) is False and await once(off) == (False, b"five")


async def test_a_held_files_pages_are_its_values_once_committed_and_never_after_a_failure(
        kv: AsyncClient) -> None:
    """--write-behind: the close of a file written with no other open of it here holds it;
    once that version's commit lands, the kernel's pages it was written through are its
    value's (an open keeps them, a lookup reports the mtime the kernel was told), as after a
    close that commits.  What the mount remembers of a held version ends with it, whatever
    its outcome: committed, failed (nothing kept: the older value is read anew), replaced by
    a newer close before it was sent (the newer one's pages kept), dropped by an unlink."""
    from kvfs.config import MountConfig
    from kvfs.errors import ServerError
    from kvfs.mount.files import FileIO
    from kvfs.mount.inodes import Handle, InodeTable

    table = InodeTable()
    fs = KVFileSystem(client=kv, asynchronous=True)
    io = FileIO(fs, table, MountConfig(write_behind_bytes=1 << 20, write_behind_delay_s=0),
                fresh_s=60)
    ino = table.remember("hk/a")

    async def close(data: bytes, mtime: float) -> None:
        h = Handle(ino, writable=True, data=bytearray(), dirty=True, mtime=mtime)
        h.sole = io.writing(ino)
        fh = table.open(h)
        await io.write(h, 0, data)
        await io.commit(h)  # held
        table.close(fh)
        assert list(io._held_pages) == [ino]

    async def once() -> tuple[bool, bytes]:
        return await _open_and_read(io, ino, "hk/a")

    await close(b"one", 1234.5)
    await io.wb.sync("hk/a")
    assert not io._held_pages
    assert await once() == (True, b"one")  # no READ: the pages it was written through
    assert (await io.info(ino, "hk/a"))["created"] == 1234.5
    send = io.wb._send

    async def refused(batch: Any) -> None:
        raise ServerError("injected: meta refuses the commit")

    io.wb._send = refused  # type: ignore[method-assign]
    await close(b"two", 99.0)
    with pytest.raises(OSError):
        await io.wb.sync("hk/a")
    assert not io._held_pages
    assert await once() == (False, b"one")  # the older value, read anew
    assert (await io.info(ino, "hk/a"))["created"] != 99.0
    io.wb._send = send  # type: ignore[method-assign]
    io.wb.delay_s = 60  # held files wait for a batch (until a sync hurries them)
    await close(b"three", 3.0)
    await close(b"four", 4.0)  # replaces the held "three" before it was sent
    await io.wb.sync("hk/a")
    assert not io._held_pages
    assert await once() == (True, b"four")
    assert (await io.info(ino, "hk/a"))["created"] == 4.0
    await close(b"five", 5.0)
    io.changed(ino)  # unlinked, as KVFSOperations.unlink does
    await io.wb.drop("hk/a")
    assert not io._held_pages


async def test_an_open_as_its_lookups_time_ends_keeps_a_written_files_pages_and_mtime(
        kv: AsyncClient) -> None:
    """A read-only open decides on one reading of whether the file's last lookup is recent:
    the lookup's time ending during the open (the mount's thread preempted between two
    readings) neither drops the kernel's pages of a file written here, with nothing changed,
    nor the mtime the kernel was told while it was written (a new one: FUSE drops the pages
    at the next lookup).  Found by a flake of
    test_a_file_written_here_is_read_back_from_the_kernels_pages under load."""
    import pyfuse3

    from kvfs.mount.inodes import ROOT_INODE
    from kvfs.mount.ops import KVFSOperations

    fs = KVFileSystem(client=kv, asynchronous=True)
    ops = KVFSOperations(fs, attr_timeout_s=60)
    ctx = pyfuse3.RequestContext()
    fi, made = await ops.create(ROOT_INODE, b"lt", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, ctx)
    await ops.write(fi.fh, 0, b"x" * 4096)
    await ops.flush(fi.fh)  # the close: committed, its layout counts as a lookup
    await ops.release(fi.fh)
    ino, io = made.st_ino, ops.io
    fresh = io._fresh

    def ends_at_once(i: int) -> Any:  # the lookup's time ends right after this reading
        seen = fresh(i)
        reader, at = io._looked_up[i]
        io._looked_up[i] = (reader, at - 2 * io.fresh_s)
        io._fresh = fresh  # type: ignore[method-assign]
        return seen

    io._fresh = ends_at_once  # type: ignore[method-assign]
    opened = await ops.open(ino, os.O_RDONLY, ctx)
    assert io._fresh == fresh  # the open read it
    assert opened.keep_cache
    assert (await ops.getattr(ino, ctx)).st_mtime_ns == made.st_mtime_ns
    await ops.release(opened.fh)
    again = await ops.open(ino, os.O_RDONLY, ctx)  # not recent now: looked up, still kept
    assert again.keep_cache
    assert (await ops.getattr(ino, ctx)).st_mtime_ns == made.st_mtime_ns
    await ops.release(again.fh)


@pytest.mark.parametrize(("bad", "flag"), [
    ({"max_batch_items": 0}, "--max-batch-items"), ({"batches_in_flight": 0}, "--batches-in-flight"),
    ({"max_batch_bytes": 0}, "--max-batch"), ({"looked_up_layouts": -1}, "--looked-up-layouts"),
    ({"negative_timeout_s": -1}, "--negative-timeout"),
    ({"negative_listing_keys": 0}, "--negative-listing-keys"),
    ({"negative_listing_dirs": 0}, "--negative-listing-dirs"),
    ({"write_behind_bytes": -1}, "--write-behind"), ({"write_behind_files": 0}, "--write-behind-files"),
    ({"write_behind_drain_s": -1}, "--write-behind-drain")])
def test_mount_limits_refuse_nonsense(bad: dict[str, float], flag: str) -> None:
    from kvfs.config import MountConfig

    with pytest.raises(ValueError, match=flag):
        MountConfig(**bad)
