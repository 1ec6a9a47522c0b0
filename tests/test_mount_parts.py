"""The mount's parts that need no FUSE: inode table, load-driven batching, errno mapping, mtab."""

from __future__ import annotations

import asyncio
import errno
import random
from pathlib import Path

import pytest

from kvfs._batch import Batcher, run_end, split_batches
from kvfs.errors import InvalidArgument, NoSpace, NotFound, Timeout, Unavailable
from kvfs.fs import InvalidPathError
from kvfs.mount.inodes import ROOT_INODE, Handle, InodeTable
from kvfs.mount.mtab import is_mounted, set_read_ahead, unescape
from kvfs.oserrors import builtin_errors, errno_of


def test_inodes_live_while_looked_up_or_open() -> None:
    t = InodeTable()
    ino = t.remember("a/b")
    assert t.path(ino) == "a/b" and t.ino_of("a/b") == ino and t.remember("a/b") == ino
    fh = t.open(Handle(ino, writable=True, data=bytearray(b"xyz")))
    assert t.pending_size(ino) == 3 and t.children("a/") == [("b", ino)]
    t.forget(ino, 2)
    assert t.path(ino) == "a/b"  # an open handle keeps it
    t.detach("a/b")
    assert t.is_unlinked(ino) and t.ino_of("a/b") is None
    t.close(fh)
    with pytest.raises(OSError) as err:
        t.path(ino)
    assert err.value.errno == errno.ESTALE
    with pytest.raises(OSError) as err:
        t.handle(fh)
    assert err.value.errno == errno.EBADF
    assert t.path(ROOT_INODE) == ""


def test_rename_moves_a_tree_and_replaces_the_target() -> None:
    t = InodeTable()
    a, ab, old = t.remember("a"), t.remember("a/b"), t.remember("z/b")
    t.renamed("a", "z")
    assert (t.ino_of("z"), t.ino_of("z/b")) == (a, ab) and t.path(ab) == "z/b"
    assert t.ino_of("a/b") is None and t.is_unlinked(old)


def test_rename_of_a_file_moves_it_alone_and_trees_move_whole_after_forgets() -> None:
    """The per-directory counts that spare a file's rename the scan of every known path
    stay right through renames, forgets and unlinks (a name may be a file and a prefix)."""
    t = InodeTable()
    f, sib, other = t.remember("d/f"), t.remember("d/f2"), t.remember("df")
    t.renamed("d/f", "d/g")
    assert (t.ino_of("d/g"), t.ino_of("d/f2"), t.ino_of("df")) == (f, sib, other)
    assert t.ino_of("d/f") is None
    x = t.remember("d/g/x")
    t.forget(sib, 1)
    t.detach("df")
    t.renamed("d", "e")
    assert (t.ino_of("e/g"), t.ino_of("e/g/x"), t.path(x)) == (f, x, "e/g/x")
    assert t.children("e/") == [("g", f)] and t.ino_of("d/g/x") is None
    t.renamed("e/g", "e/h")
    assert (t.ino_of("e/h"), t.ino_of("e/h/x")) == (f, x)
    y = t.remember("e/y")
    t.renamed("e/y", "e/h")  # over a name with a path under it: both replaced
    assert t.ino_of("e/h") == y and t.ino_of("e/h/x") is None
    assert t.is_unlinked(f) and t.is_unlinked(x)


def test_split_batches() -> None:
    assert split_batches([], max_items=3, max_bytes=10) == []
    runs = split_batches([4, 4, 4, 20, 1, 1, 1, 1], max_items=3, max_bytes=10)
    assert [list(r) for r in runs] == [[0, 1], [2], [3], [4, 5, 6], [7]]
    assert split_batches([1, 1, 1], max_bytes=10) == [range(3)]  # all fit: one batch
    # the same key twice never shares a batch (a chunkserver refuses overlapping ranges)
    assert split_batches([1, 1, 1], max_bytes=10, keys=["a", "b", "a"]) == [range(0, 2), range(2, 3)]


def test_split_batches_whole_request_shortcut_matches_item_by_item() -> None:
    rng = random.Random(8)
    for _ in range(2000):
        n = rng.randint(0, 10)
        sizes = [rng.randint(0, 9) for _ in range(n)]
        keys = [rng.randint(0, 12) for _ in range(n)] if rng.random() < 0.5 else None
        max_items, max_bytes = rng.choice([None, 1, 3, 10]), rng.randint(1, 60)
        want, start = [], 0
        while start < n:
            end = run_end(sizes, start, max_bytes=max_bytes, max_items=max_items, keys=keys)
            want.append(range(start, end))
            start = end
        got = split_batches(sizes, max_bytes=max_bytes, max_items=max_items, keys=keys)
        assert got == want, (sizes, keys, max_items, max_bytes)


async def test_batching_by_load_sends_at_once_when_idle_and_the_backlog_when_busy() -> None:
    seen: list[list[int]] = []
    gate, started = asyncio.Event(), asyncio.Event()

    async def run(items: list[int]) -> list[int]:
        seen.append(items)
        started.set()
        await gate.wait()
        return [i * 10 for i in items]

    b: Batcher[int, int] = Batcher(run, max_items=4, max_bytes=100, max_inflight=1)
    first = asyncio.ensure_future(b.submit(0))
    await started.wait()
    assert seen == [[0]]  # idle: out at once, alone
    rest = [asyncio.ensure_future(b.submit(i, nbytes=30)) for i in range(1, 7)]
    for _ in range(3):  # loop turns (no timing): every submit runs, none is sent
        await asyncio.sleep(0)
    assert seen == [[0]] and b.inflight == 1  # busy: they queue
    gate.set()
    assert await first == 0 and await asyncio.gather(*rest) == [10, 20, 30, 40, 50, 60]
    assert seen == [[0], [1, 2, 3], [4, 5, 6]]  # 3 x 30 bytes fit in 100, the 4th does not


@pytest.mark.parametrize(("exc", "code"), [
    (InvalidPathError("a/../b", "no .."), errno.EINVAL),
    (InvalidPathError("x" * 2000, "too long", errno.ENAMETOOLONG), errno.ENAMETOOLONG),
    (FileNotFoundError(errno.ENOENT, "gone"), errno.ENOENT),
    (Timeout("slow"), errno.EIO), (Unavailable("down"), errno.EIO), (TimeoutError(), errno.EIO),
    (NoSpace("full"), errno.EIO), (InvalidArgument("bad"), errno.EINVAL), (RuntimeError(), errno.EIO),
])
def test_errno_of(exc: BaseException, code: int) -> None:
    assert errno_of(exc) == code


def test_builtin_errors() -> None:
    with pytest.raises(FileNotFoundError) as err, builtin_errors("k"):
        raise NotFound("no such key")
    assert err.value.filename == "k"
    with pytest.raises(Unavailable), builtin_errors("k"):
        raise Unavailable("down")  # already a builtin (ConnectionError): unchanged


def test_mtab(tmp_path: Path) -> None:
    assert unescape(r"/mnt/with\040space\134x") == "/mnt/with space\\x"
    mounts = tmp_path / "mounts"
    mounts.write_text("kvfs /mnt/with\\040space fuse.kvfs rw 0 0\nproc /proc proc rw 0 0\n")
    assert is_mounted("/mnt/with space", mounts=str(mounts))
    assert is_mounted("/mnt/with space", fstype="fuse.kvfs", mounts=str(mounts))
    assert not is_mounted("/mnt/with space", fstype="ext4", mounts=str(mounts))
    assert not is_mounted("/mnt", mounts=str(mounts))
    assert not is_mounted("/x", mounts=str(tmp_path / "missing"))


def test_set_read_ahead(tmp_path: Path) -> None:
    """The mount's read-ahead is written to its device's bdi, found in mountinfo (the last
    mount on a point wins); a point not mounted or a bdi not writable says why."""
    info = tmp_path / "mountinfo"
    info.write_text("22 1 0:21 / /mnt/kv rw - tmpfs tmpfs rw\n"
                    "40 22 0:55 / /mnt/kv rw,nosuid - fuse.kvfs kvfs rw,user_id=0\n"
                    "41 1 0:56 / /mnt/with\\040space rw - fuse.kvfs kvfs rw\n")
    bdi = tmp_path / "bdi"
    for dev in ("0:21", "0:55", "0:56"):
        (bdi / dev).mkdir(parents=True)
        (bdi / dev / "read_ahead_kb").write_text("128\n")
    assert set_read_ahead("/mnt/kv", 1 << 20, mountinfo=str(info), bdi=str(bdi)) is None
    assert (bdi / "0:55" / "read_ahead_kb").read_text() == "1024"
    assert (bdi / "0:21" / "read_ahead_kb").read_text() == "128\n"
    assert set_read_ahead("/mnt/with space", 256 * 1024, mountinfo=str(info), bdi=str(bdi)) is None
    assert (bdi / "0:56" / "read_ahead_kb").read_text() == "256"
    assert "not in" in (set_read_ahead("/mnt/other", 1 << 20, mountinfo=str(info), bdi=str(bdi)) or "")
    (bdi / "0:55" / "read_ahead_kb").unlink()
    (bdi / "0:55").rmdir()
    assert "cannot write" in (set_read_ahead("/mnt/kv", 1 << 20, mountinfo=str(info), bdi=str(bdi)) or "")


async def test_a_request_past_the_timeout_answers_eio_and_its_task_goes_on() -> None:
    """The mount's per-request deadline: a handler still waiting after --timeout answers EIO,
    and the request's task (pyfuse3's worker, which goes on to the next request) is not left
    cancelled; a cancellation from elsewhere stays a cancellation; a handler's own error, or
    that of a handler with no deadline, becomes its errno."""
    pyfuse3 = pytest.importorskip("pyfuse3")
    from kvfs.mount.ops import _local, _op

    class Ops:
        timeout_s = 0.05

        @_op
        async def hang(self, gate: asyncio.Event) -> None:
            await gate.wait()

        @_op
        async def missing(self) -> None:
            raise FileNotFoundError(errno.ENOENT, "no such key")

        @_local
        async def closed(self) -> None:
            raise OSError(errno.EBADF, "no such handle")

    ops = Ops()
    for call, code in ((ops.hang(asyncio.Event()), errno.EIO), (ops.missing(), errno.ENOENT),
                       (ops.closed(), errno.EBADF)):
        with pytest.raises(pyfuse3.FUSEError) as ei:
            await call
        assert ei.value.errno == code
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # and no cancellation is left pending for this task
    other = asyncio.ensure_future(ops.hang(asyncio.Event()))
    await asyncio.sleep(0)
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other


async def test_requests_deadlines_share_one_timer_and_each_still_comes_due() -> None:
    """The requests' deadlines are one queue with one loop timer, not a timer each: many
    requests that end in time arm one timer, and a request that hangs after others that
    ended (or with others still under way) still answers EIO at its own deadline, not at an
    earlier one's, and not never."""
    pyfuse3 = pytest.importorskip("pyfuse3")
    from kvfs.mount.ops import _op

    class Ops:
        timeout_s = 0.2

        @_op
        async def quick(self) -> None:
            await asyncio.sleep(0)

        @_op
        async def hang(self, gate: asyncio.Event) -> None:
            await gate.wait()

    ops = Ops()
    loop = asyncio.get_running_loop()
    armed = 0
    call_at = loop.call_at

    def counting_call_at(*args: object) -> asyncio.TimerHandle:
        nonlocal armed
        armed += 1
        return call_at(*args)  # type: ignore[arg-type]

    loop.call_at = counting_call_at  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(ops.quick() for _ in range(100)))
        assert armed == 1
        await asyncio.sleep(0.1)  # the first deadline is half gone
        began = loop.time()
        hung = [asyncio.ensure_future(ops.hang(asyncio.Event())) for _ in range(3)]
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(ops.hang(asyncio.Event()))
        for t in [*hung, late]:
            with pytest.raises(pyfuse3.FUSEError) as ei:
                await t
            assert ei.value.errno == errno.EIO
            assert loop.time() - began >= 0.2 - 0.002  # at its own deadline, not before
        assert loop.time() - began >= 0.25 - 0.002  # the late one: its own, not the others'
    finally:
        del loop.call_at
