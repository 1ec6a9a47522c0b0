"""``kvfs mount --write-behind``: a close returns once the file is held by the mount, which
commits held files in batches.

A real ``kvfs mount`` child process over a cluster on this process's own loop thread; meta's
COMMIT is held (fault injection, :class:`conftest.Hold`) to show what a close no longer waits
for, what this mount answers meanwhile, and what a failed or late commit becomes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Hold, ThreadCluster, readv_calls
from fuse_mount import Mount, needs_fuse, wait_until

from kvfs.chunkserver.durability import fsync_dir
from kvfs.errors import ServerError
from kvfs.fs import KVFileSystem
from kvfs.mount import is_mounted
from kvfs.rpc import RPCS, Op, Service

pytestmark = [pytest.mark.fuse, needs_fuse]

SYS_CLOSE = 3  # x86_64; /proc/<tid>/syscall shows a thread blocked in it


@pytest.fixture(scope="module")
def fs(tcluster: ThreadCluster) -> Iterator[KVFileSystem]:
    """The same cluster through fsspec: what other clients (other nodes) see."""
    with tcluster.fsspec() as f:
        yield f


@contextlib.contextmanager
def mounted(tcluster: ThreadCluster, tmp_path: Path, *args: str) -> Iterator[Mount]:
    # held files are sent as soon as a batch can go, as these tests expect (the delay that
    # gathers closes into fuller batches has its own test)
    m = Mount(tmp_path / "mnt", tcluster, tmp_path / "logs", "--timeout", "30s",
              "--write-behind-delay", "0", *args)
    try:
        yield m
    finally:
        m.cleanup()


@contextlib.contextmanager
def op_held(tcluster: ThreadCluster, op: Op, when: Callable[[Any], bool] | None = None
            ) -> Iterator[tuple[list[Hold], Callable[[BaseException | None], None]]]:
    """Every server that answers ``op`` (meta, or each chunkserver) holds its requests (those
    ``when`` accepts) until the yielded ``release(error=None)`` (with an error each fails
    with it); afterwards they answer it as before."""
    if RPCS[op].service == Service.META:
        assert tcluster.cluster.meta is not None
        rpcs = [tcluster.cluster.meta.rpc]
    else:
        rpcs = [cs.rpc for cs in tcluster.cluster.chunkservers if cs is not None]
    saved = [rpc.handlers[int(op)] for rpc in rpcs]

    async def install() -> list[Hold]:
        return [Hold(rpc, op, when) for rpc in rpcs]

    holds = tcluster.call(install())
    released: list[bool] = []

    def release(error: BaseException | None = None) -> None:
        if not released:
            released.append(True)
            for h in holds:
                tcluster.loop.call_soon_threadsafe(h.release, error)

    try:
        yield holds, release
    finally:
        release()

        async def restore() -> None:
            for rpc, handler in zip(rpcs, saved, strict=True):
                rpc.handlers[int(op)] = handler

        tcluster.call(restore())


@contextlib.contextmanager
def commits_held(tcluster: ThreadCluster) -> Iterator[Callable[[BaseException | None], None]]:
    """Meta holds every COMMIT until the yielded ``release(error=None)``."""
    with op_held(tcluster, Op.COMMIT) as (_, release):
        yield release


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _in_close(tid: int) -> bool:
    """Whether thread ``tid`` of this process is blocked in close(2)."""
    try:
        return Path(f"/proc/self/task/{tid}/syscall").read_text().split()[0] == str(SYS_CLOSE)
    except (OSError, IndexError):
        return False


def _missing(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            f.read()
    except FileNotFoundError:
        return True
    return False


def test_close_returns_before_the_commit_and_this_mount_sees_the_file(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """With meta's COMMIT held, closes return (numpy tofile, as SGLang's HiCacheFile writes
    pages, from 8 threads); the files are visible and byte-exact on this mount (lookup,
    listing, read), not elsewhere; fsync of one, and of the directory, waits for the commit,
    after which another client reads the same bytes."""
    pages = {f"p{i:03d}.bin": np.frombuffer(os.urandom(200_000 + i), dtype=np.uint8)
             for i in range(40)}
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB") as m:
        d = m.mnt / "wb"
        d.mkdir()
        with commits_held(tcluster) as release, ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda kv: kv[1].tofile(d / kv[0]), pages.items()))  # all closed
            assert sorted(os.listdir(d)) == sorted(pages)
            for name, page in pages.items():
                assert os.stat(d / name).st_size == page.nbytes
                with open(d / name, "rb", buffering=0) as f:
                    assert f.read() == page.tobytes()
            assert not fs.exists("wb/p000.bin")  # nobody else sees them yet
            fd = os.open(d / "p000.bin", os.O_RDONLY)
            try:
                synced = ex.submit(os.fsync, fd)
                release(None)
                synced.result(30)
            finally:
                os.close(fd)
            assert fs.cat_file("wb/p000.bin") == pages["p000.bin"].tobytes()
            fsync_dir(d)  # every file held under it committed
        got = fs.cat([f"wb/{n}" for n in pages])
        assert all(got[f"wb/{n}"] == p.tobytes() for n, p in pages.items())
        assert "Traceback" not in m.stderr() and "not committed" not in m.stderr()


def test_overwrite_unlink_and_rename_of_held_files(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """While commits are held: a file closed twice keeps its last bytes (never the older
    version written last); an unlinked held file never reappears; a held file renamed
    (HiCacheFile's tmp + os.replace) moves with its bytes, and its old name stays gone."""
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB") as m:
        d = m.mnt / "ow"
        d.mkdir()
        (m.mnt / "ow-e").mkdir()
        fs.pipe_file("ow/old.bin", b"committed before")
        with commits_held(tcluster) as release, ThreadPoolExecutor(4) as ex:
            _write(m.mnt / "ow-e" / "x.bin", b"x")
            with pytest.raises(OSError) as ei:
                os.rmdir(m.mnt / "ow-e")  # holds a file
            assert ei.value.errno == errno.ENOTEMPTY
            _write(d / "f.bin", b"one" * 1000)  # sent at once: its COMMIT is held
            _write(d / "f.bin", b"two" * 1000)  # waits for it, then goes
            _write(d / "f.bin", b"three" * 1000)  # replaces "two" before it is sent
            assert (d / "f.bin").read_bytes() == b"three" * 1000
            _write(d / "old.bin", b"replaced here")
            assert (d / "old.bin").read_bytes() == b"replaced here"
            for i in range(6):
                _write(d / f"g{i}.bin", b"doomed %d" % i)
            _write(d / ".tmp", b"page bytes" * 100)
            os.replace(d / ".tmp", d / "page.bin")
            assert (d / "page.bin").read_bytes() == b"page bytes" * 100
            assert _missing(d / ".tmp")
            unlinks = [ex.submit(os.unlink, d / f"g{i}.bin") for i in range(6)]
            release(None)  # the unlinks of files being committed waited for their commit
            for u in unlinks:
                u.result(30)
            assert all(_missing(d / f"g{i}.bin") for i in range(6))
        fsync_dir(d)
        assert fs.cat_file("ow/f.bin") == b"three" * 1000
        assert fs.cat_file("ow/old.bin") == b"replaced here"
        assert fs.cat_file("ow/page.bin") == b"page bytes" * 100
        assert not fs.exists("ow/.tmp")
        assert not [n for n in fs.ls("ow", detail=False) if "/g" in n]
        assert sorted(os.listdir(d)) == ["f.bin", "old.bin", "page.bin"]
        assert "Traceback" not in m.stderr() and "not committed" not in m.stderr()


def test_a_full_buffer_makes_a_close_wait(tcluster: ThreadCluster, fs: KVFileSystem,
                                          tmp_path: Path) -> None:
    """--write-behind bounds what is held: with 1 MiB held and its COMMIT held, the next
    close waits (blocked in close(2)) until that commit frees room; nothing is lost."""
    a, b = os.urandom(700_000), os.urandom(700_000)
    with mounted(tcluster, tmp_path, "--write-behind", "1MiB") as m:
        (m.mnt / "full").mkdir()
        with commits_held(tcluster) as release, ThreadPoolExecutor(1) as ex:
            _write(m.mnt / "full" / "a.bin", a)  # held
            tid: Future[int] = Future()

            def second() -> None:
                tid.set_result(threading.get_native_id())
                _write(m.mnt / "full" / "b.bin", b)

            closing = ex.submit(second)
            t = tid.result(30)
            wait_until(lambda: _in_close(t) or closing.done(), 30, "the second close")
            assert not closing.done()  # waiting for room
            release(None)
            closing.result(30)
        fsync_dir(m.mnt / "full")
        assert fs.cat_file("full/a.bin") == a and fs.cat_file("full/b.bin") == b


def test_a_failed_commit_is_a_miss_not_other_bytes(tcluster: ThreadCluster, fs: KVFileSystem,
                                                   tmp_path: Path) -> None:
    """A commit failing after the close: fsync reports EIO, the file becomes a miss on this
    mount (never other bytes) and elsewhere, counted and logged; the mount goes on."""
    data = os.urandom(300_000)
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB") as m:
        d = m.mnt / "fail"
        d.mkdir()
        with commits_held(tcluster) as release, ThreadPoolExecutor(1) as ex:
            _write(d / "lost.bin", data)
            assert (d / "lost.bin").read_bytes() == data
            fd = os.open(d / "lost.bin", os.O_RDONLY)
            try:
                synced = ex.submit(os.fsync, fd)
                release(ServerError("injected: meta refuses the commit"))
                with pytest.raises(OSError) as ei:
                    synced.result(30)
                assert ei.value.errno == errno.EIO
            finally:
                os.close(fd)
        wait_until(lambda: _missing(d / "lost.bin"), 30, "the failed file to be a miss")
        assert not fs.exists("fail/lost.bin")
        assert "were not committed after their close" in m.stderr()
        assert "'fail/lost.bin'" in m.stderr()
        _write(d / "after.bin", b"fine")  # commits work again
        fsync_dir(d)
        assert fs.cat_file("fail/after.bin") == b"fine"


def test_unmount_waits_for_held_files(tcluster: ThreadCluster, fs: KVFileSystem,
                                      tmp_path: Path) -> None:
    """SIGTERM unmounts at once, and the mount process commits what it holds before it
    exits; past --write-behind-drain what is still held is lost, and logged."""
    files = {f"um/{i}.bin": os.urandom(50_000) for i in range(20)}
    with mounted(tcluster, tmp_path / "a", "--write-behind", "64MiB") as m:
        (m.mnt / "um").mkdir()
        with commits_held(tcluster) as release:
            for k, v in files.items():
                _write(m.mnt / k, v)
            m.proc.send_signal(15)
            wait_until(lambda: not is_mounted(str(m.mnt)), 30, "the unmount")
            assert m.proc.poll() is None  # still committing
            release(None)
            assert m.proc.wait(30) == 0
    assert fs.cat(list(files)) == files
    with mounted(tcluster, tmp_path / "b", "--write-behind", "64MiB",
                 "--write-behind-drain", "200ms") as m:
        (m.mnt / "um2").mkdir()
        with commits_held(tcluster) as release:
            _write(m.mnt / "um2" / "late.bin", b"never committed")
            assert m.stop() == 0  # gave up after the drain time, COMMIT still held
            release(ServerError("injected: the COMMIT sent before the unmount fails"))
        assert not fs.exists("um2/late.bin")
        assert "not committed within 0.2s of unmount are lost" in m.stderr()


def test_negative_timeout_sees_a_file_committed_after_a_listing(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """--negative-timeout with --write-behind: a file held while the mount lists its
    directory anew (so meta's listing lacks it) and committed after that is still found
    here, with its bytes, once it is no longer held (it was ENOENT until the listing aged)."""
    data = os.urandom(150_000)
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--negative-timeout", "3s",
                 "--attr-timeout", "0") as m:
        d = m.mnt / "nl"
        d.mkdir()
        with commits_held(tcluster) as release:
            _write(d / "x.bin", data)  # held, its COMMIT held at meta
            with op_held(tcluster, Op.LIST, lambda r: r.prefix == b"nl/") as ([lists], release_lists):
                # lookups in nl/ until its listing (made at x.bin's lookup) is too old and a
                # new one goes to meta
                lists.reached_from_thread(lambda: not (d / "missing").exists(),
                                          "a new listing of nl/")
                release_lists(None)
                tcluster.call(lists.drained())  # meta answered it: no x.bin in it
            release(None)
        fsync_dir(d)  # x.bin committed: no longer held
        assert fs.cat_file("nl/x.bin") == data
        assert (d / "x.bin").read_bytes() == data


def _committed(p: Path) -> None:
    """fsync of ``p``: its held version committed."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_file_renamed_after_its_commit_moves_without_a_read_back(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """HiCacheFile's tmp + os.replace when the tmp's commit came first: the mount moves the
    bytes it committed (meta's layout of the tmp: same size and CRC) instead of reading them
    back, so with every chunkserver's READV held the rename still returns; the new name has
    the bytes, here and elsewhere, and the tmp is gone."""
    page = np.frombuffer(os.urandom(128 * 1024), dtype=np.uint8)
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--timeout", "5s") as m:
        d = m.mnt / "rn"
        d.mkdir()
        page.tofile(d / ".p.tmp")
        _committed(d / ".p.tmp")
        assert fs.cat_file("rn/.p.tmp") == page.tobytes()
        with op_held(tcluster, Op.READV) as (_, release):
            os.replace(d / ".p.tmp", d / "p.bin")  # a read back: EIO after --timeout
            release(None)
        fsync_dir(d)
        assert fs.cat_file("rn/p.bin") == page.tobytes()
        assert not fs.exists("rn/.p.tmp") and _missing(d / ".p.tmp")
        assert (d / "p.bin").read_bytes() == page.tobytes()
        assert sorted(os.listdir(d)) == ["p.bin"]


def test_a_file_replaced_elsewhere_after_its_commit_is_renamed_with_the_new_bytes(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """The bytes a mount keeps after a commit are never moved by a rename once another
    client has replaced the file (same size, other bytes: meta's CRC differs): the rename
    moves what is there now."""
    ours, theirs = os.urandom(100_000), os.urandom(100_000)
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--attr-timeout", "0") as m:
        d = m.mnt / "rs"
        d.mkdir()
        _write(d / ".q.tmp", ours)
        _committed(d / ".q.tmp")
        fs.pipe_file("rs/.q.tmp", theirs)  # another node replaces it
        os.replace(d / ".q.tmp", d / "q.bin")
        fsync_dir(d)
        assert fs.cat_file("rs/q.bin") == theirs
        assert (d / "q.bin").read_bytes() == theirs
        assert not fs.exists("rs/.q.tmp")


def test_held_files_wait_for_a_batch_until_an_fsync_asks(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """--write-behind-delay: files closed one after another wait to go out together (one
    COMMIT for all five, where without the delay the first goes alone at its close), and
    go at once when an fsync waits for them (the delay is longer than --timeout: an fsync
    that did not hurry them would fail with EIO)."""
    files = {f"dl/{i}.bin": os.urandom(70_000 + i) for i in range(5)}
    commits: list[Any] = []
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--write-behind-delay", "60s",
                 "--timeout", "5s") as m:
        (m.mnt / "dl").mkdir()
        with op_held(tcluster, Op.COMMIT, lambda r: commits.append(r) is not None):  # counted
            for k, v in files.items():
                _write(m.mnt / k, v)
            fsync_dir(m.mnt / "dl")
        assert fs.cat(list(files)) == files
        assert len(commits) == 1


def test_a_held_file_renamed_before_it_was_sent_deletes_nothing_of_its_old_name(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """HiCacheFile's tmp + os.replace while the tmp still waits for its batch: nothing of the
    tmp's name ever reached the cluster, so the rename holds no delete of it: no DELETE (and
    no tombstones) is sent, and another client's file of that name, committed after the
    rename, stays (a held delete of a name never committed would remove it)."""
    deletes: list[Any] = []
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--write-behind-delay", "60s",
                 "--attr-timeout", "0") as m:
        d = m.mnt / "nt"
        d.mkdir()
        with op_held(tcluster, Op.DELETE, lambda r: deletes.append(r) is not None):  # counted
            _write(d / ".p.tmp", b"page bytes" * 100)  # held, waiting for a batch
            os.replace(d / ".p.tmp", d / "p.bin")
            assert _missing(d / ".p.tmp")
            fs.pipe_file("nt/.p.tmp", b"another client's file")
            fsync_dir(d)  # the held files go now
            assert fs.cat_file("nt/p.bin") == b"page bytes" * 100
            assert fs.cat_file("nt/.p.tmp") == b"another client's file"
            assert (d / ".p.tmp").read_bytes() == b"another client's file"
            _write(d / ".r.tmp", b"r bytes")  # held, never sent: its unlink sends nothing
            os.unlink(d / ".r.tmp")
            assert _missing(d / ".r.tmp")
            # a held file that was sent (here: committed) is another matter: the rename
            # holds a delete of its old name, or the old name would keep its bytes; so does
            # a file made anew under that name while that delete waits, then renamed too
            _write(d / ".q.tmp", b"q bytes")
            _committed(d / ".q.tmp")
            os.replace(d / ".q.tmp", d / "q.bin")
            _write(d / ".q.tmp", b"q2 bytes")  # replaces the held delete
            os.replace(d / ".q.tmp", d / "q2.bin")
            fsync_dir(d)
        assert [r.keys for r in deletes] == [[b"nt/.q.tmp"]]
        assert not fs.exists("nt/.q.tmp") and not fs.exists("nt/.r.tmp")
        assert fs.cat_file("nt/q.bin") == b"q bytes" and fs.cat_file("nt/q2.bin") == b"q2 bytes"
        assert "Traceback" not in m.stderr()


def test_fsync_of_a_held_file_returns_once_it_is_committed(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """fsync with files held (a 60 s --write-behind-delay, longer than --timeout: an fsync
    that did not send them at once fails with EIO): on the descriptor still open for writing,
    on one opened after the close, on a file renamed while held, and on the mount's root
    (syncfs(2) never reaches a FUSE daemon; fsync of the root is the mount-wide sync): once
    each returns, another client reads the bytes."""
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--write-behind-delay", "60s",
                 "--timeout", "5s") as m:
        d = m.mnt / "fs"
        d.mkdir()
        with open(d / "open.bin", "wb") as f:  # fsync before the close
            f.write(b"open bytes")
            f.flush()
            os.fsync(f.fileno())
            assert fs.cat_file("fs/open.bin") == b"open bytes"
        _write(d / "closed.bin", b"closed bytes")
        _committed(d / "closed.bin")
        assert fs.cat_file("fs/closed.bin") == b"closed bytes"
        _write(d / ".moved.tmp", b"moved bytes")
        os.replace(d / ".moved.tmp", d / "moved.bin")
        _committed(d / "moved.bin")
        assert fs.cat_file("fs/moved.bin") == b"moved bytes"
        _write(d / "sub.bin", b"sub bytes")
        (m.mnt / "other").mkdir()
        _write(m.mnt / "other" / "x.bin", b"x bytes")
        fsync_dir(m.mnt)  # every held file, in any directory
        assert fs.cat_file("fs/sub.bin") == b"sub bytes"
        assert fs.cat_file("other/x.bin") == b"x bytes"


def test_a_newer_close_not_held_wins_over_an_older_held_version(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A held version waiting for its batch (a 60 s --write-behind-delay), then a newer close
    of the same path that does not go through the queue: streamed (over --write-buffer), too
    large to hold (over --write-behind), or a streamed file renamed onto it.  The newer bytes
    win, here and elsewhere, also after the held files go (fsync of the directory): the older
    held version is never sent after them."""
    old = b"older held bytes" * 100
    big, mid, moved = os.urandom(3 << 20), os.urandom(600_000), os.urandom(3 << 20)
    with mounted(tcluster, tmp_path, "--write-behind", "512KiB", "--write-buffer", "1MiB",
                 "--write-behind-delay", "60s", "--timeout", "10s") as m:
        d = m.mnt / "nw"
        d.mkdir()
        for name in ("streamed.bin", "unheld.bin", "renamed.bin"):
            _write(d / name, old)  # held, waiting for a batch
            assert (d / name).read_bytes() == old
        _write(d / "streamed.bin", big)  # streamed: committed at its close
        _write(d / "unheld.bin", mid)  # over --write-behind: one put at its close
        _write(d / ".moved.tmp", moved)  # streamed, then renamed over a held version
        os.replace(d / ".moved.tmp", d / "renamed.bin")
        want = {"nw/streamed.bin": big, "nw/unheld.bin": mid, "nw/renamed.bin": moved}
        for k, v in want.items():
            assert (m.mnt / k).read_bytes() == v
        fsync_dir(d)  # what is still held goes now
        assert fs.cat(list(want)) == want
        for k, v in want.items():
            assert (m.mnt / k).read_bytes() == v
        assert "Traceback" not in m.stderr()


def test_a_streamed_close_waits_for_the_held_version_being_committed(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A held version whose COMMIT meta holds, then a newer close of the same path that
    streams: once its stripe units are all appended, that close still waits (blocked in
    close(2)) for the older commit to end, so its own COMMIT comes after it and its bytes
    win, here and elsewhere."""
    old, big = b"older held bytes" * 100, os.urandom(3 << 20)  # 3 stripe units
    commits: list[Any] = []
    units: list[Any] = []  # the stream's units appended (stream records: total size 0)

    def appended(r: Any) -> bool:
        units.extend(h for h in r.records if h.key == b"sw/f.bin" and h.total_size == 0)
        return False  # counted, not held

    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--write-buffer", "1MiB") as m:
        d = m.mnt / "sw"
        d.mkdir()
        # only the first COMMIT (the held version's) is held
        with op_held(tcluster, Op.COMMIT, lambda r: not commits and commits.append(r) is None
                     ) as ([hold], release), op_held(tcluster, Op.APPEND, appended), \
                ThreadPoolExecutor(1) as ex:
            _write(d / "f.bin", old)  # held, sent at once: its COMMIT held at meta
            hold.reached_from_thread(what="the held version's COMMIT")
            tid: Future[int] = Future()

            def newer() -> None:
                tid.set_result(threading.get_native_id())
                _write(d / "f.bin", big)

            closing = ex.submit(newer)
            t = tid.result(30)
            wait_until(lambda: (_in_close(t) and len(units) == 3) or closing.done(), 30,
                       "the streamed close's units")
            assert not closing.done()  # waits for the older version's commit
            release(None)
            closing.result(30)
        fsync_dir(d)
        assert fs.cat_file("sw/f.bin") == big
        assert (d / "f.bin").read_bytes() == big


# the kernel's pages of a file written here, across its delayed commit --------------------
def _read_fetched(p: Path, want: bytes, tcluster: ThreadCluster) -> bool:
    """``p`` read whole through a new open (bytes checked): whether any READV reached a
    chunkserver meanwhile (False: answered from the kernel's cached pages)."""
    before = readv_calls(tcluster.cluster)
    with open(p, "rb", buffering=0) as f:
        got = f.read()
    assert got == want, f"{p.name}: other bytes than its value"
    return readv_calls(tcluster.cluster) > before


def test_a_file_written_here_is_read_back_from_its_pages_after_its_delayed_commit(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A file written and closed here, committed after its close (meta's COMMIT held
    meanwhile) with nothing done to it in between, is read back as on the default mount:
    from the kernel's pages it was written through, so no READV reaches a chunkserver, soon
    after the commit and after the attribute time; its mtime stays the one the kernel was
    told while it was written, while held and once committed (a new one would make the
    kernel drop the pages)."""
    attr_s = 0.3
    values = {f"p{i}.bin": os.urandom(128 * 1024) for i in range(3)}
    values["big.bin"] = os.urandom(2 << 20)
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB",
                 "--attr-timeout", f"{attr_s}s") as m:
        d = m.mnt / "wk"
        d.mkdir()
        mtimes = {}
        with commits_held(tcluster) as release:
            for name, v in values.items():
                with open(d / name, "wb") as f:
                    f.write(v)
                    f.flush()
                    mtimes[name] = os.fstat(f.fileno()).st_mtime_ns  # while written
            assert not fs.exists("wk/p0.bin")  # held: none committed yet
            for name in values:
                assert os.stat(d / name).st_mtime_ns == mtimes[name]
            release(None)
        fsync_dir(d)  # all committed now
        assert fs.cat([f"wk/{n}" for n in values]) == {f"wk/{n}": v for n, v in values.items()}
        until = time.monotonic() + 3 * attr_s  # soon after the commit, then looked up again
        reads = fetched = 0
        while time.monotonic() < until or reads < 4:
            for name, v in values.items():
                fetched += _read_fetched(d / name, v, tcluster)
                assert os.stat(d / name).st_mtime_ns == mtimes[name]
            reads += 1
        # as on the default mount, the kernel may leave a written page out of its cache now
        # and then (that page alone is read, from the same value: twice in one run of the
        # full suite under load); with the pages dropped at the commit, every file's first
        # read here is fetched (4 at least)
        assert fetched <= 2, f"{fetched} of {reads * len(values)} reads went to the cluster"
        assert "Traceback" not in m.stderr()


def test_pages_written_before_a_delayed_commit_are_dropped_if_the_file_changed_meanwhile(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """Between a file's close and its delayed commit (meta's COMMIT held), anything done to
    it here that could make the kernel's pages of it differ from the committed value makes
    the next open drop them (its reads go to the cluster), as an open on the default mount
    would: an open for writing (even with nothing written), a read-only open (the pages are
    dropped at that open, then taken from the held bytes: not trusted afterwards either),
    a truncate(2), a rename away and back, another file renamed over it.  Every read answers
    the file's value then, never the pages' bytes: also for a file written anew here, one
    unlinked and made again, and one another client replaced while its commit was held (the
    last commit wins; once the attribute time has passed the mount reads it)."""
    n = 128 * 1024
    v = {name: os.urandom(n) for name in (
        "kept.bin", "wopen.bin", "ropen.bin", "trunc.bin", "moved.bin", "over.bin",
        "rewritten.bin", "unlinked.bin", "elsewhere.bin")}
    newer = {name: os.urandom(n) for name in ("over.bin", "rewritten.bin", "unlinked.bin",
                                              "elsewhere.bin")}
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--attr-timeout", "0.3s") as m:
        d = m.mnt / "ch"
        d.mkdir()
        with commits_held(tcluster) as release, ThreadPoolExecutor(2) as ex:
            for name, data in v.items():
                _write(d / name, data)  # held; the first batch's COMMIT held at meta
            os.close(os.open(d / "wopen.bin", os.O_WRONLY))
            assert (d / "ropen.bin").read_bytes() == v["ropen.bin"]
            truncated = ex.submit(os.truncate, d / "trunc.bin", n)  # waits for the commit
            os.rename(d / "moved.bin", d / "moved.tmp")
            os.rename(d / "moved.tmp", d / "moved.bin")
            _write(d / ".over.tmp", newer["over.bin"])
            os.replace(d / ".over.tmp", d / "over.bin")
            _write(d / "rewritten.bin", newer["rewritten.bin"])
            os.unlink(d / "unlinked.bin")
            _write(d / "unlinked.bin", newer["unlinked.bin"])
            put = ex.submit(fs.pipe_file, "ch/elsewhere.bin", newer["elsewhere.bin"])
            release(None)
            truncated.result(30)
            put.result(30)
        fsync_dir(d)
        want = {**v, **newer}
        for name in ("wopen.bin", "ropen.bin", "trunc.bin", "moved.bin", "over.bin"):
            assert _read_fetched(d / name, want[name], tcluster), f"{name}: pages kept"
        for name in ("kept.bin", "rewritten.bin", "unlinked.bin"):
            _read_fetched(d / name, want[name], tcluster)
        # whichever COMMIT meta applied last is the value: this mount reads it (its own
        # commit counts as a lookup for the attribute time), never a mix
        last = fs.cat_file("ch/elsewhere.bin")
        assert last in (v["elsewhere.bin"], newer["elsewhere.bin"])

        def reads_last() -> bool:
            got = (d / "elsewhere.bin").read_bytes()
            assert got in (v["elsewhere.bin"], newer["elsewhere.bin"])
            return got == last

        wait_until(reads_last, 10, "the value meta committed last")
        assert "Traceback" not in m.stderr()


def test_a_commit_that_failed_before_the_fsync_is_still_reported_once(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A held file's commit fails before any fsync asks for it: the next fsync of the file,
    or of a directory above it, still reports it (EIO), once, as the kernel does a
    writeback error.  A newer version committed since clears a path's failure."""
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB") as m:
        for sub in ("a", "b", "c"):
            (m.mnt / sub).mkdir()
        _write(m.mnt / "b" / "f.bin", b"older")
        fsync_dir(m.mnt / "b")
        for sub in ("a", "b", "c"):  # each f.bin's commit fails after its close
            with op_held(tcluster, Op.COMMIT) as ([held], release):
                _write(m.mnt / sub / "f.bin", sub.encode() * 1000)
                held.reached_from_thread(what=f"{sub}/f.bin's COMMIT")
                release(ServerError(f"injected: meta refuses {sub}/f.bin"))
            wait_until(lambda sub=sub: f"'{sub}/f.bin'" in m.stderr(),  # type: ignore[misc]
                       30, f"{sub}/f.bin's failure to be logged")
        _write(m.mnt / "c" / "f.bin", b"newer")  # committed: c's failure is its state no more
        fsync_dir(m.mnt / "c")
        assert fs.cat_file("c/f.bin") == b"newer"
        with pytest.raises(OSError) as ei:  # a's, by its directory's fsync
            fsync_dir(m.mnt / "a")
        assert ei.value.errno == errno.EIO
        fsync_dir(m.mnt / "a")  # once
        assert _missing(m.mnt / "a" / "f.bin")
        fd = os.open(m.mnt / "b" / "f.bin", os.O_RDONLY)  # the older value stays
        try:
            with pytest.raises(OSError) as ei:
                os.fsync(fd)
            assert ei.value.errno == errno.EIO
            os.fsync(fd)  # reported once: not again by this fd, its directory or the root
        finally:
            os.close(fd)
        fsync_dir(m.mnt / "b")
        fsync_dir(m.mnt)
        assert fs.cat_file("b/f.bin") == b"older"


def test_a_newer_version_whose_commit_fails_leaves_no_pages_of_it(
        tcluster: ThreadCluster, fs: KVFileSystem, tmp_path: Path) -> None:
    """A file written and closed, its COMMIT held at meta, then written again (the same
    size, other bytes) and closed: the newer version waits for the older one, whose commit
    lands (the kernel's pages still hold the newer bytes), then its own commit fails.  The
    file's value is the older version, and this mount reads that, never the newer bytes in
    the kernel's pages: the older commit keeps no pages (they are not its bytes), and the
    newer version's record goes with its failure."""
    n = 256 * 1024
    v1, v2 = os.urandom(n), os.urandom(n)
    commits: list[Any] = []
    with mounted(tcluster, tmp_path, "--write-behind", "64MiB", "--attr-timeout", "0.3s") as m:
        d = m.mnt / "nf"
        d.mkdir()
        # the first COMMIT is held (outer), the later ones fail (inner, asked first)
        with op_held(tcluster, Op.COMMIT) as ([first], release_first), op_held(
                tcluster, Op.COMMIT, lambda r: commits.append(r) is None and len(commits) > 1
        ) as (_, release_later):
            release_later(ServerError("injected: meta refuses the newer version's commit"))
            _write(d / "f.bin", v1)  # held, sent at once: its COMMIT held at meta
            first.reached_from_thread(what="the older version's COMMIT")
            _write(d / "f.bin", v2)  # written through the pages; waits for the older commit
            release_first(None)
            with pytest.raises(OSError) as ei:
                fsync_dir(d)
            assert ei.value.errno == errno.EIO
        assert fs.cat_file("nf/f.bin") == v1
        assert len(commits) == 2
        for _ in range(3):
            _read_fetched(d / "f.bin", v1, tcluster)
        assert "were not committed after their close" in m.stderr()
