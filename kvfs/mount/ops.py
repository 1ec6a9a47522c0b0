"""The FUSE request handlers: :class:`KVFSOperations` over :class:`~kvfs.fs.KVFileSystem`."""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar, cast

from kvfs._batch import split_batches
from kvfs.config import MountConfig
from kvfs.fs import KVFileSystem, check_path
from kvfs.layout import MAX_KEY_BYTES, MAX_VALUE_BYTES
from kvfs.mount._fuse import Operations, pyfuse3, quiet_at, reading
from kvfs.mount.files import FileIO
from kvfs.mount.inodes import ROOT_INODE, Handle, Info, InodeTable
from kvfs.oserrors import errno_of

__all__ = ["KVFSOperations"]

log = logging.getLogger("kvfs.mount")

P = ParamSpec("P")
T = TypeVar("T")

MOVE_BATCH_KEYS = 512
MOVE_BATCH_BYTES = 64 * 1024 * 1024
BLKSIZE = 128 * 1024


def _fuse_error(fn: Callable[..., Any], args: tuple[Any, ...], exc: Exception, timeout_s: float
                ) -> pyfuse3.FUSEError:
    """The errno a handler's failure answers (logged unless it is an everyday one)."""
    code = errno_of(exc)
    if code == errno.EIO:
        log.warning("%s%r: %s", fn.__name__, args[1:3], _failure(exc, timeout_s))
    elif code not in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
        log.info("%s%r: %s", fn.__name__, args[1:3], exc)
    return pyfuse3.FUSEError(code)


def _failure(exc: Exception, timeout_s: float) -> str:
    """A failure as a log line says it: its type and what happened (a request's timeout, which
    says nothing of itself, as the time it ran)."""
    what = f"timed out after {timeout_s}s" if isinstance(exc, TimeoutError) and not str(exc) else exc
    return f"{type(exc).__name__}: {what}"


class _Deadline:
    """One request's deadline (:class:`_Deadlines`)."""

    __slots__ = ("at", "fired", "task")

    def __init__(self, at: float, task: asyncio.Task[Any] | None) -> None:
        self.at = at
        self.task = task  # None once the request ended
        self.fired = False


class _Deadlines:
    """The deadlines of a mount's requests under way.  Every request gets the same
    ``timeout_s``, so they come due in the order they began: a queue in that order, and one
    loop timer, for the oldest one when it was armed, where a timer per request cost ~1.5 µs
    of the mount's CPU (uvloop's ``call_later`` + ``cancel`` + the handle's close) against
    ~0.2 µs here.  At a request past its deadline, its task is cancelled (``fired``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self._queue: collections.deque[_Deadline] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def start(self, task: asyncio.Task[Any]) -> _Deadline:
        d = _Deadline(self.loop.time() + self.timeout_s, task)
        self._queue.append(d)
        if self._timer is None:
            self._timer = self.loop.call_at(d.at, self._due)
        return d

    def end(self, d: _Deadline) -> None:
        d.task = None
        q = self._queue
        while q and q[0].task is None:  # the ended ones at the front go (the rest when due)
            q.popleft()

    def _due(self) -> None:
        self._timer = None
        q = self._queue
        now = self.loop.time() + 0.001  # (the loop's timers may fire up to 1 ms early)
        while q and (q[0].task is None or q[0].at <= now):
            d = q.popleft()
            if d.task is not None:
                d.fired = True
                d.task.cancel()
        if q:
            self._timer = self.loop.call_at(q[0].at, self._due)


def _deadlines(ops: Any) -> _Deadlines:
    """``ops``'s deadlines on the running loop, for its ``timeout_s`` now."""
    loop = asyncio.get_running_loop()
    dl: _Deadlines | None = getattr(ops, "_deadlines", None)
    if dl is None or dl.loop is not loop or dl.timeout_s != ops.timeout_s:
        dl = ops._deadlines = _Deadlines(loop, ops.timeout_s)
    return dl


def _op(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A FUSE handler that may wait on the cluster: bounded by the mount's timeout; every
    failure becomes an errno.

    pyfuse3 answers only ``FUSEError``; anything else would leave the request
    unanswered and stop the mount.  At the deadline (:class:`_Deadlines`) the request's
    task is cancelled, as ``asyncio.timeout`` does, and the cancellation becomes EIO.
    """

    @functools.wraps(fn)
    async def handler(*args: P.args, **kwargs: P.kwargs) -> T:
        ops: KVFSOperations = args[0]  # type: ignore[assignment]
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        deadlines = _deadlines(ops)
        d = deadlines.start(task)
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except asyncio.CancelledError:
            if d.fired:
                d.fired = False
                if task.uncancel() <= cancelling:  # ours, not the loop's or the unmount's
                    raise _fuse_error(fn, args, TimeoutError(), ops.timeout_s) from None
            raise
        except Exception as exc:
            raise _fuse_error(fn, args, exc, ops.timeout_s) from None
        finally:
            deadlines.end(d)
            if d.fired:  # fired as the handler ended: its cancellation is not for anyone else
                task.uncancel()

    return handler


def _local(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A FUSE handler that answers from the mount's own state (no wait on the cluster, so
    no deadline): every failure becomes an errno."""

    @functools.wraps(fn)
    async def handler(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            raise _fuse_error(fn, args, exc, 0.0) from None

    return handler


class KVFSOperations(Operations):
    """FUSE request handlers over :class:`~kvfs.fs.KVFileSystem` (``asynchronous=True``)."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, fs: KVFileSystem, *, timeout_s: float = 10.0, attr_timeout_s: float = 1.0,
                 uid: int | None = None, gid: int | None = None,
                 config: MountConfig | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.timeout_s = timeout_s
        self.attr_timeout_s = attr_timeout_s
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self._started_ns = time.time_ns()
        self.table = InodeTable()
        # lookups and reads wait for the requests the kernel queued (--batch-hold): the
        # mount calls self.io.send_held() once it has read them (kvfs.mount.cli)
        self.io = FileIO(fs, self.table, config or MountConfig(), fresh_s=attr_timeout_s,
                         hold=reading)

    def _child(self, parent: int, name: bytes, *, limit: int = MAX_KEY_BYTES) -> str:
        pp = self.table.path(parent)
        n = os.fsdecode(name)
        path = f"{pp}/{n}" if pp else n
        check_path(path, limit=limit)
        return path

    # attributes ----------------------------------------------------------------
    def _attrs(self, ino: int, info: Info, *, asked: float | None = None, force: bool = False,
               keep: bool = False) -> pyfuse3.EntryAttributes:
        """The attributes sent for ``ino``: a file's size as ``InodeTable.tell`` says for a
        request the kernel sent after ``asked`` (None: now), ``force`` or ``keep`` (a file being
        written here: as it is, the kernel has that size from its writes; but a listing's
        entry for it keeps the size the writes made)."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        # (a layout looked up ahead is valid for less: FileIO.info)
        a.entry_timeout = a.attr_timeout = min(self.attr_timeout_s,
                                               info.get("valid_s", self.attr_timeout_s))
        if info["type"] == "directory":
            a.st_mode = stat.S_IFDIR | 0o755
            a.st_nlink = 2
            a.st_size = 0
            t = self._started_ns
        else:
            a.st_mode = stat.S_IFREG | 0o644
            a.st_nlink = 1
            now = time.monotonic()
            a.st_size = self.table.tell(ino, int(info["size"]), now if asked is None else asked, now,
                                        force=force or (not keep and self.table.pending(ino) is not None),
                                        keep=keep)
            t = int(float(info.get("created") or 0) * 1e9) or self._started_ns
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_blksize = BLKSIZE
        a.st_blocks = (a.st_size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        return a

    async def _info(self, ino: int, path: str) -> Info:
        writer = self.table.pending(ino)
        if writer is not None:
            return {"name": path, "size": writer.size, "type": "file", "created": writer.mtime}
        if self.table.is_unlinked(ino):
            raise FileNotFoundError(errno.ENOENT, "unlinked", path)
        if ino == ROOT_INODE:
            return {"name": "", "size": 0, "type": "directory"}
        held = self.io.held(path)  # closed here, not committed yet (write-behind)
        if held is not None:
            return {"name": path, "size": held.nbytes, "type": "file", "created": held.created}
        try:
            return await self.io.info(ino, path)
        except FileNotFoundError:
            if self.io.wb.has_under(path + "/"):  # a directory only held files make yet
                return {"name": path, "size": 0, "type": "directory"}
            raise

    @_op
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        if self.table.ino_of(path) is None and self.io.listed_missing(path):
            # a name new here (a create's LOOKUP, mostly) that the listing lacks: ENOENT at
            # once, without numbering an inode for it and raising through the handlers
            raise pyfuse3.FUSEError(errno.ENOENT)
        ino = self.table.ino_for(path)
        asked = quiet_at()  # (the kernel sent it after: a bound however long it waited)
        try:
            info = await self._info(ino, path)
        except BaseException:
            self.table.maybe_drop(ino)  # numbered for nothing: the kernel does not know it
            raise
        return self._attrs(self.table.remember(path), info, asked=asked)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.table.forget(ino, n)

    @_op
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        asked = quiet_at()
        return self._attrs(inode, await self._info(inode, self.table.path(inode)), asked=asked)

    @_op
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = self.table.path(inode)
        if fields.update_size:
            size = attr.st_size
            if size > MAX_VALUE_BYTES:
                raise pyfuse3.FUSEError(errno.EFBIG)
            writers = self.table.writers(inode)
            for h in writers:
                await self.io.truncate(h, size)
            if not writers:  # truncate(2) on a file nobody here has open: a new value now
                await self.io.resize(path, size)
        # mode, owner and times are not stored: a value has only its creation time
        return self._attrs(inode, await self._info(inode, path), force=True)

    # files -------------------------------------------------------------------
    @_local
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self.table.path(inode)
        keep = False
        if flags & os.O_TRUNC:  # (the kernel's size is 0 from now: atomic O_TRUNC)
            now = time.monotonic()
            self.table.tell(inode, 0, now, now, force=True)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            h = Handle(inode, writable=False)
            sure = self.io.opened(h)  # the kernel's cached pages kept: the same value's
            if sure is None:  # no recent lookup says so: look it up, then decide
                await self._look_again(inode)
                sure = self.io.opened(h, looked=True)
            keep = bool(sure)
        elif flags & os.O_APPEND:
            raise OSError(errno.EOPNOTSUPP, "kvfs values are immutable: append to an existing file")
        elif flags & os.O_TRUNC:
            h = Handle(inode, writable=True, data=bytearray(), dirty=True, mtime=time.time())
        else:
            h = Handle(inode, writable=True, mtime=time.time())
        if h.writable:
            h.sole = self.io.writing(inode)
        return pyfuse3.FileInfo(fh=self.table.open(h), keep_cache=keep, direct_io=h.direct)

    @_local
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._child(parent_inode, name)
        found = None
        if (self.io.config.negative_timeout_s > 0 and flags & (os.O_EXCL | os.O_TRUNC) != os.O_TRUNC
                and self.io.wb.get(path) is None):
            # the kernel's LOOKUP may have been answered from a listing (--negative-timeout),
            # which may miss another node's new file: where that matters (O_EXCL, or keeping
            # the bytes of an existing file) meta says
            found = await self._info_at_meta(path)
        if found is not None:
            if flags & os.O_EXCL:
                raise pyfuse3.FUSEError(errno.EEXIST)
            if found["type"] == "directory":
                raise pyfuse3.FUSEError(errno.EISDIR)
            if flags & os.O_APPEND:
                raise OSError(errno.EOPNOTSUPP, "kvfs values are immutable: append to an existing file")
        ino = self.table.relink(path)
        self.io.made(path)
        sole = self.io.writing(ino)
        now = time.time()
        if found is not None:  # opened as the existing file it is (read when first written)
            fh = self.table.open(Handle(ino, writable=True, sole=sole, mtime=now))
            return pyfuse3.FileInfo(fh=fh, keep_cache=False), self._attrs(ino, found)
        fh = self.table.open(Handle(ino, writable=True, data=bytearray(), dirty=True, new=True,
                                    sole=sole, mtime=now))
        info = {"name": path, "size": 0, "type": "file", "created": now}
        return pyfuse3.FileInfo(fh=fh, keep_cache=False), self._attrs(ino, info)

    async def _look_again(self, ino: int) -> None:
        """A LOOKUP of ``ino`` for its open (the kernel sent none lately): a failure leaves
        the open as it was without it (pages dropped, the first read looks it up)."""
        try:
            await self._io_info(ino)
        except pyfuse3.FUSEError:
            pass

    @_op
    async def _io_info(self, ino: int) -> Info:
        return await self.io.info(ino, self.table.path(ino))

    @_op
    async def _info_at_meta(self, path: str) -> Info | None:
        """``path``'s info from meta itself (no listing), None when it has none."""
        return await self._info_or_none(path)

    @_op
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        return await self.io.read(self.table.handle(fh), off, size)

    @_op
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.table.handle(fh)
        if not h.writable:
            raise pyfuse3.FUSEError(errno.EBADF)
        await self.io.write(h, off, buf)
        self.table.wrote(h.ino, off + len(buf), time.monotonic())
        return len(buf)

    @_local
    async def flush(self, fh: int) -> None:
        h = self.table.handle(fh)
        if h.dirty and not h.orphan:  # most closes: nothing to commit (a reader, a 2nd close)
            await self._commit(fh)

    @_op
    async def _commit(self, fh: int) -> None:
        await self.io.commit(self.table.handle(fh))

    @_op
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self.table.handle(fh)
        await self.io.commit(h)
        if not h.orphan:  # held (write-behind): wait for its commit
            await self.io.wb.sync(self.table.path(h.ino))

    @_op
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        """fsync of a directory: every file held under it (write-behind) committed."""
        prefix, _ = self.table.dir(fh)
        await self.io.wb.sync_under(prefix)

    async def release(self, fh: int) -> None:
        h = self.table.handle_or_none(fh)
        if h is None:
            return
        try:
            if h.dirty and not h.orphan:  # normally committed by flush already
                async with asyncio.timeout(self.timeout_s):
                    await self.io.commit(h)
        except Exception as exc:
            log.error("release: %s: the written data is lost: %s", self.table.path_or_none(h.ino),
                      _failure(exc, self.timeout_s))
        finally:
            self.table.close(fh)
            await self.io.release(h)
            self.io.closed(h)

    def discard_open_writes(self) -> int:
        """At unmount: files still open for writing are not committed; how many."""
        return self.table.discard_open_writes()

    async def drain(self, timeout_s: float) -> int:
        """At unmount: held files (write-behind) committed, waiting at most ``timeout_s``;
        how many were lost."""
        return await self.io.wb.drain(timeout_s)

    # directories ---------------------------------------------------------------
    @_op
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
                    ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name, limit=MAX_KEY_BYTES - 1)
        await self.fs._put_markers(path)
        self.io.made(path)
        return self._attrs(self.table.remember(path), {"name": path, "size": 0, "type": "directory"})

    @_op
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = self._child(parent_inode, name)
        if self.table.has_pending_under(path + "/") or self.io.wb.has_under(path + "/"):
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        await self.io.wb.sync_under(path + "/", check=False)  # held deletes of old names
        try:
            await self.fs._rmdir(path)
        except FileNotFoundError:
            pass  # an implicit directory whose last file went: nothing left to remove
        self.io.changed(self.table.ino_of(path))  # (not one looked up ahead any more)
        self.table.detach(path)

    @_op
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = self._child(parent_inode, name)
        self.io.changed(self.table.ino_of(path))
        writers = await self._orphan_writers(path)
        pending = any(h.dirty for h in writers)
        for h in writers:
            await self.io.release(h)
        held = self.io.wb.get(path)
        pending = pending or (held is not None and held.pieces is not None)
        if await self.io.wb.drop(path):  # never committed after this delete
            self.table.detach(path)  # held, never sent, nothing there before: none to send
            return
        try:
            await self.fs._rm_file(path)
        except FileNotFoundError:
            if not pending:
                raise
        finally:
            self.io.changed(self.table.ino_of(path))  # (landed, or maybe: as at its start)
        self.table.detach(path)

    @_op
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        src = self._child(parent_inode_old, name_old)
        dst = self._child(parent_inode_new, name_new)
        if src == dst:
            return
        ino = self.table.ino_of(src)
        if ino is not None:
            for h in self.table.writers(ino):
                await self.io.commit(h)
        # dst's file is replaced: a handle still open for writing on it commits nothing from
        # now on (the kernel holds dst's inode lock, so no write of it runs meanwhile)
        replaced = await self._orphan_writers(dst)
        try:
            await self._rename(src, dst, flags, ino)
        except BaseException:
            for h in replaced:  # dst not replaced: its writers commit to it as before (one
                # closed during the failed rename committed nothing)
                h.orphan = False
            raise
        for h in replaced:
            await self.io.release(h)

    async def _orphan_writers(self, path: str) -> list[Handle]:
        """``path``'s file is being unlinked or replaced: the handles open for writing on it
        (not orphaned yet) marked so that their writes, fsyncs and closes commit nothing (as on
        a local filesystem, they write to a file no name leads to), once a commit of theirs
        under way has ended (so none lands after this).  Returned: their streams are the
        caller's to drop once the name is gone."""
        ino = self.table.ino_of(path)
        writers = [] if ino is None else [h for h in self.table.writers(ino) if not h.orphan]
        for h in writers:
            h.orphan = True
        for h in writers:
            async with h.lock:  # a commit under way holds it
                pass
        return writers

    async def _rename(self, src: str, dst: str, flags: int, ino: int | None) -> None:
        if not flags & pyfuse3.RENAME_NOREPLACE and await self.io.wb.rename(src, dst):
            # held (write-behind): the held bytes move; the kernel checked dst is no directory
            self.io.changed(ino)
            self.io.changed(self.table.ino_of(dst))
            self.io.made(dst)
            self.table.renamed(src, dst)
            return
        self.io.held(src)  # ENOENT for a name renamed or removed here, not committed yet
        await self.io.wb.sync(src)  # held but not moved (RENAME_NOREPLACE): committed first
        await self.io.wb.drop(dst)  # replaced: a held version of it is never committed
        # a file (the common case: tmp + rename) is looked up while the target is looked at
        reader, dst_info = await asyncio.gather(self.io.reader(src), self._info_or_none(dst))
        if dst_info is not None and flags & pyfuse3.RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EEXIST)
        if reader is not None:
            if dst_info is not None and dst_info["type"] == "directory":
                raise pyfuse3.FUSEError(errno.EISDIR)
            # committed from here lately (write-behind) and still those bytes: moved as held
            kept = self.io.wb.kept(src, reader.size, reader.layout.crc)
            if kept is not None and await self.io.wb.rename(src, dst, kept):
                self.io.changed(ino)
                self.io.changed(self.table.ino_of(dst))
                self.io.made(dst)
                self.table.renamed(src, dst)
                return
            await self.io.copy(reader, dst)
            await self.fs._rm_file(src)
            self.io.changed(ino)
        else:
            # held files (write-behind) under either name: in the cluster first
            await self.io.wb.sync_under(src + "/", check=False)
            if self.io.wb.has_under(dst + "/"):
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            await self.io.wb.sync_under(dst + "/", check=False)
            await self.fs._info(src)  # ENOENT unless a directory
            if dst_info is not None and dst_info["type"] == "file":
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            if dst_info is not None and await self.fs._ls(dst, detail=False):
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            await self._move_tree(src, dst)
            self.io.forget_layouts()  # every key under it moved
            self.io.forget_listings()
        self.io.made(dst)
        self.table.renamed(src, dst)

    async def _info_or_none(self, path: str) -> Info | None:
        try:
            info: Info = await self.fs._info(path)
        except FileNotFoundError:
            return None
        return info

    async def _move_tree(self, src: str, dst: str) -> None:
        """Every key under ``src/`` to ``dst/``: batched get_many, put_many, delete_many."""
        c = self.fs.client
        infos = await c.list(os.fsencode(src + "/"))
        n = len(src)
        check_path(dst + "/", limit=MAX_KEY_BYTES)
        for run in split_batches([ki.size for ki in infos], max_items=MOVE_BATCH_KEYS,
                                 max_bytes=MOVE_BATCH_BYTES):
            keys = [infos[i].key for i in run]
            new = [os.fsencode(dst) + k[n:] for k in keys]
            for k in new:
                check_path(os.fsdecode(k))
            values = await c.get_many(keys)
            await c.put_many([(k, v) for k, v in zip(new, values, strict=True) if v is not None])
            await c.delete_many(keys)
        if not infos:  # an empty implicit directory: keep it as an empty one
            await self.fs._put_markers(dst)

    @_op
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        path = self.table.path(inode)
        listing = cast(list[Info], await self.fs._ls(path, detail=True))
        if len(listing) == 1 and listing[0]["name"] == path and listing[0]["type"] == "file":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        n = len(path) + 1 if path else 0
        entries = [(str(e["name"])[n:], e) for e in listing]
        prefix = path + "/" if path else ""
        entries = self._with_held(prefix, entries)
        seen = {name for name, _ in entries}
        for name, ino in self.table.children(prefix):  # files created here, not yet committed
            if name not in seen:
                size = self.table.pending_size(ino)
                if size is not None:
                    entries.append((name, {"name": prefix + name, "size": size, "type": "file"}))
        return self.table.opendir(prefix, entries)

    def _with_held(self, prefix: str, entries: list[tuple[str, Info]]) -> list[tuple[str, Info]]:
        """A directory's listing with the files held under it (write-behind): held files
        shown (and the directories they make), held deletes hidden."""
        held = self.io.wb.under(prefix)
        if not held:
            return entries
        out = dict(entries)
        for e in held:
            head, sep, _ = e.path[len(prefix):].partition("/")
            if sep:
                if e.pieces is not None and head not in out:
                    out[head] = {"name": prefix + head, "size": 0, "type": "directory"}
            elif e.pieces is None:
                if out.get(head, {}).get("type") == "file":
                    del out[head]
            else:
                out[head] = {"name": prefix + head, "size": e.nbytes, "type": "file",
                             "created": e.created}
        return sorted(out.items())

    @_local
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        prefix, entries = self.table.dir(fh)
        for i in range(start_id, len(entries)):
            name, info = entries[i]
            ino = self.table.ino_for(prefix + name)
            # (a listing's sizes may be older than one sent, or another than an open reads)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attrs(ino, info, keep=True),
                                         i + 1):
                self.table.maybe_drop(ino)
                break
            self.table.readdir_reply(ino)

    async def releasedir(self, fh: int) -> None:
        self.table.releasedir(fh)

    @_op
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = await self.fs.client.stats()
        bs = 4096
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = bs
        s.f_blocks = sum(int(x["capacity"]) for x in st["servers"]) // bs
        s.f_bfree = s.f_bavail = sum(int(x["free"]) for x in st["servers"] if x["alive"]) // bs
        s.f_files = int(st["keys"])
        s.f_ffree = s.f_favail = 1 << 32
        s.f_namemax = 255
        return s
