"""``kvfs mount MOUNTPOINT`` / ``kvfs umount MOUNTPOINT``: a kvfs cluster as a FUSE filesystem.

Built on pyfuse3 (libfuse3) in asyncio mode: FUSE requests are coroutines on
the same event loop as the kvfs client, many in flight at once, so parallel
reads of small files coalesce in the client's batcher.  Paths map to keys as
in :mod:`kvfs.fs` (``/mnt/kv/a/b.bin`` is key ``a/b.bin``; directories are
prefixes, ``mkdir`` records a marker key).

What differs from a local disk:

- **close() is the commit point.**  A file opened for writing is buffered in
  this process and committed as one value on ``close()`` (FUSE flush) or
  ``fsync()``; until then other clients, and other mounts, do not see it
  (this mount shows it with its buffered size).  Errors of the commit are
  returned by ``close()``/``fsync()``.  A file still open when the mount stops
  is not committed.
- Opening an existing file for writing without ``O_TRUNC`` reads its value
  first (read-modify-write of the whole value); ``O_APPEND`` on an existing
  file fails with ``EOPNOTSUPP``.
- ``mv`` is read + put + delete (not atomic: for a moment both names exist,
  never neither); renaming a directory moves every key under it.
- A read-only open fetches the value on its first read and serves the rest of
  that open from this snapshot.  No hard links, symlinks, devices or xattrs.
- Every request is bounded by ``--timeout``: with the cluster gone a call
  fails with ``EIO`` instead of hanging, and works again once it is back.

SIGINT/SIGTERM unmount cleanly.  A mount whose process was killed (-9) leaves
a dead mount point ("Transport endpoint is not connected"): remove it with
``kvfs umount MOUNTPOINT`` (``fusermount3 -u``).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import logging
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from kvfs.address import TOKEN_FILE_HELP, token_from_file
from kvfs.config import ClientConfig
from kvfs.errors import KVFSError
from kvfs.fs import InvalidPathError, KVFileSystem, _errors, check_path
from kvfs.layout import MAX_KEY_BYTES, MAX_VALUE_BYTES
from kvfs.units import parse_duration

if TYPE_CHECKING:
    import pyfuse3
    import pyfuse3.asyncio

    _Operations = pyfuse3.Operations
    _IMPORT_ERROR = ""
else:
    try:
        import pyfuse3
        import pyfuse3.asyncio

        _Operations = pyfuse3.Operations
        _IMPORT_ERROR = ""
    except ImportError as exc:  # the mount needs the `fuse` extra; the rest of kvfs does not
        pyfuse3 = None
        _Operations = object
        _IMPORT_ERROR = str(exc)

__all__ = ["KVFSOperations", "add_commands", "is_mounted"]

log = logging.getLogger("kvfs.mount")

P = ParamSpec("P")
T = TypeVar("T")
Info = dict[str, Any]

ROOT_INODE = 1
MOVE_BATCH_KEYS = 512
MOVE_BATCH_BYTES = 64 * 1024 * 1024
BLKSIZE = 128 * 1024


@dataclass(eq=False)
class _Handle:
    """One open file."""

    ino: int
    writable: bool
    data: bytearray | None = None  # writable: the whole new value (None until the old one is read)
    value: bytes | None = None  # read-only: the value, fetched on the first read
    dirty: bool = False  # has writes (or a truncation) not yet committed
    orphan: bool = False  # unlinked while open: never committed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one fetch of the old value


class _ReadBatcher:
    """Adaptive batching of whole-value reads, for FUSE's one-request-at-a-time arrivals.

    FUSE requests reach the loop one by one, so reads that overlap in time
    rarely start in the same loop tick (what the client's batcher joins).
    Here a read goes out at once while fewer than ``max_inflight`` are
    outstanding; otherwise it waits, and everything that queued up goes out
    as one ``get_many`` when a slot frees.  Idle: no added latency; busy:
    batches as large as the backlog (one lookup + one readv per server).
    """

    def __init__(self, fs: KVFileSystem, *, max_inflight: int = 2, max_keys: int = 128) -> None:
        self._fs = fs
        self._max_inflight = max_inflight
        self._max_keys = max_keys
        self._inflight = 0
        self._queue: list[tuple[bytes, asyncio.Future[bytes | None]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0

    async def get(self, key: bytes) -> bytes | None:
        fut: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._queue.append((key, fut))
        self._pump()
        return await fut

    def _pump(self) -> None:
        while self._queue and self._inflight < self._max_inflight:
            batch, self._queue = self._queue[: self._max_keys], self._queue[self._max_keys :]
            self._inflight += 1
            self.batches += 1
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[bytes, asyncio.Future[bytes | None]]]) -> None:
        try:
            client = self._fs.client
            try:
                values = await client.get_many([k for k, _ in batch])
            except Exception as exc:
                if len(batch) == 1:
                    _settle(batch[0][1], exc)
                    return
                results = await asyncio.gather(*(client.get_many([k]) for k, _ in batch),
                                               return_exceptions=True)
                for (_, fut), res in zip(batch, results, strict=True):
                    _settle(fut, res if isinstance(res, BaseException) else res[0])
                return
            for (_, fut), v in zip(batch, values, strict=True):
                _settle(fut, v)
        finally:
            self._inflight -= 1
            self._pump()


def _settle(fut: asyncio.Future[bytes | None], res: bytes | BaseException | None) -> None:
    if fut.done():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, InvalidPathError):
        return exc.errno
    if isinstance(exc, TimeoutError | ConnectionError):  # kvfs Unavailable / Timeout, our deadline
        return errno.EIO
    if isinstance(exc, OSError):
        return exc.errno or errno.EIO
    if isinstance(exc, ValueError):
        return errno.EINVAL
    return errno.EIO


def _op(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A FUSE handler: bounded by the mount's timeout; every failure becomes an errno.

    pyfuse3 answers only ``FUSEError``; anything else would leave the request
    unanswered and stop the mount.
    """

    @functools.wraps(fn)
    async def handler(*args: P.args, **kwargs: P.kwargs) -> T:
        ops: KVFSOperations = args[0]  # type: ignore[assignment]
        try:
            async with asyncio.timeout(ops.timeout_s):
                return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            code = _errno_of(exc)
            if code == errno.EIO:
                what = f"timed out after {ops.timeout_s}s" if isinstance(exc, TimeoutError) else exc
                log.warning("%s%r: %s: %s", fn.__name__, args[1:3], type(exc).__name__, what)
            elif code not in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
                log.info("%s%r: %s", fn.__name__, args[1:3], exc)
            raise pyfuse3.FUSEError(code) from None

    return handler


class KVFSOperations(_Operations):
    """FUSE request handlers over :class:`~kvfs.fs.KVFileSystem` (``asynchronous=True``)."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, fs: KVFileSystem, *, timeout_s: float = 10.0, attr_timeout_s: float = 1.0,
                 uid: int | None = None, gid: int | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.timeout_s = timeout_s
        self.attr_timeout_s = attr_timeout_s
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self._started_ns = time.time_ns()
        self._paths: dict[int, str] = {ROOT_INODE: ""}
        self._inos: dict[str, int] = {"": ROOT_INODE}
        self._lookups: dict[int, int] = {}
        self._unlinked: set[int] = set()
        self._next_ino = ROOT_INODE + 1
        self._handles: dict[int, _Handle] = {}
        self._dirs: dict[int, tuple[str, list[tuple[str, Info]]]] = {}
        self._next_fh = 1
        self._reads = _ReadBatcher(fs)

    # inodes ------------------------------------------------------------------
    def _path(self, ino: int) -> str:
        try:
            return self._paths[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    def _child(self, parent: int, name: bytes, *, limit: int = MAX_KEY_BYTES) -> str:
        pp = self._path(parent)
        n = os.fsdecode(name)
        path = f"{pp}/{n}" if pp else n
        check_path(path, limit=limit)
        return path

    def _ino_for(self, path: str) -> int:
        ino = self._inos.get(path)
        if ino is None:
            ino = self._next_ino
            self._next_ino += 1
            self._inos[path] = ino
            self._paths[ino] = path
        return ino

    def _remember(self, path: str) -> int:
        """The inode for ``path``, its lookup count raised: the kernel now knows it."""
        ino = self._ino_for(path)
        self._lookups[ino] = self._lookups.get(ino, 0) + 1
        return ino

    def _maybe_drop(self, ino: int) -> None:
        if ino == ROOT_INODE or self._lookups.get(ino, 0) > 0:
            return
        if any(h.ino == ino for h in self._handles.values()):
            return
        path = self._paths.pop(ino, None)
        self._unlinked.discard(ino)
        if path is not None and self._inos.get(path) == ino:
            del self._inos[path]

    def _detach(self, path: str) -> None:
        """``path`` no longer names its inode (unlinked or replaced)."""
        ino = self._inos.pop(path, None)
        if ino is not None:
            self._unlinked.add(ino)
            self._maybe_drop(ino)

    def _writers(self, ino: int) -> list[_Handle]:
        return [h for h in self._handles.values() if h.ino == ino and h.writable]

    def _pending_size(self, ino: int) -> int | None:
        """The size an open, written file has in this mount (None: no writer, or not loaded)."""
        for h in self._writers(ino):
            if h.data is not None and not h.orphan:
                return len(h.data)
        return None

    # attributes ----------------------------------------------------------------
    def _attrs(self, ino: int, info: Info) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = self.attr_timeout_s
        a.attr_timeout = self.attr_timeout_s
        if info["type"] == "directory":
            a.st_mode = stat.S_IFDIR | 0o755
            a.st_nlink = 2
            a.st_size = 0
            t = self._started_ns
        else:
            a.st_mode = stat.S_IFREG | 0o644
            a.st_nlink = 1
            a.st_size = int(info["size"])
            t = int(float(info.get("created") or 0) * 1e9) or self._started_ns
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_blksize = BLKSIZE
        a.st_blocks = (a.st_size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        return a

    async def _info(self, ino: int, path: str) -> Info:
        size = self._pending_size(ino)
        if size is not None:
            return {"name": path, "size": size, "type": "file", "created": time.time()}
        if ino in self._unlinked:
            raise FileNotFoundError(errno.ENOENT, "unlinked", path)
        if ino == ROOT_INODE:
            return {"name": "", "size": 0, "type": "directory"}
        info: Info = await self.fs._info(path)
        return info

    @_op
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        ino = self._inos.get(path)
        info = await self._info(ino, path) if ino is not None else await self.fs._info(path)
        return self._attrs(self._remember(path), info)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            left = self._lookups.get(ino, 0) - n
            if left > 0:
                self._lookups[ino] = left
            else:
                self._lookups.pop(ino, None)
                self._maybe_drop(ino)

    @_op
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(inode, await self._info(inode, self._path(inode)))

    @_op
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = self._path(inode)
        if fields.update_size:
            size = attr.st_size
            if size > MAX_VALUE_BYTES:
                raise pyfuse3.FUSEError(errno.EFBIG)
            writers = self._writers(inode)
            if writers:
                for h in writers:
                    if h.data is None and size == 0:
                        h.data = bytearray()
                    await self._load(h)
                    assert h.data is not None
                    _resize(h.data, size)
                    h.dirty = True
            else:  # truncate(2) on a file nobody here has open: a new value now
                value = b"" if size == 0 else await self.fs._get_value(path)
                if len(value) != size:
                    buf = bytearray(value)
                    _resize(buf, size)
                    value = bytes(buf)
                await self.fs._put_value(path, value)
        # mode, owner and times are not stored: a value has only its creation time
        return self._attrs(inode, await self._info(inode, path))

    # files -------------------------------------------------------------------
    def _new_fh(self, h: _Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = h
        return fh

    def _handle(self, fh: int) -> _Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None

    async def _load(self, h: _Handle) -> None:
        """A writable handle opened without O_TRUNC starts from the committed value."""
        if h.data is not None:
            return
        async with h.lock:
            if h.data is not None:
                return
            for other in self._writers(h.ino):  # unflushed data of another open wins
                if other is not h and other.data is not None and not other.orphan:
                    h.data = bytearray(other.data)
                    return
            h.data = bytearray(await self.fs._get_value(self._path(h.ino)))

    async def _commit(self, h: _Handle) -> None:
        if not h.dirty or h.orphan:
            return
        await self._load(h)
        assert h.data is not None
        await self.fs._put_value(self._path(h.ino), bytes(h.data))
        h.dirty = False

    @_op
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        self._path(inode)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            h = _Handle(inode, writable=False)
        elif flags & os.O_APPEND:
            raise OSError(errno.EOPNOTSUPP, "kvfs values are immutable: append to an existing file")
        elif flags & os.O_TRUNC:
            h = _Handle(inode, writable=True, data=bytearray(), dirty=True)
        else:
            h = _Handle(inode, writable=True)
        return pyfuse3.FileInfo(fh=self._new_fh(h), keep_cache=False)

    @_op
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._child(parent_inode, name)
        if path in self._inos and self._inos[path] in self._unlinked:
            self._inos.pop(path)
        ino = self._remember(path)
        self._unlinked.discard(ino)
        fh = self._new_fh(_Handle(ino, writable=True, data=bytearray(), dirty=True))
        info = {"name": path, "size": 0, "type": "file", "created": time.time()}
        return pyfuse3.FileInfo(fh=fh, keep_cache=False), self._attrs(ino, info)

    @_op
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handle(fh)
        if h.writable:
            await self._load(h)
            assert h.data is not None
            return bytes(h.data[off : off + size])
        if h.value is None:
            async with h.lock:
                if h.value is None:
                    with _errors(self._path(h.ino)):
                        value = await self._reads.get(os.fsencode(self._path(h.ino)))
                    if value is None:
                        raise OSError(errno.ENOENT, "deleted or expired since it was opened")
                    h.value = value
        return h.value[off : off + size]

    @_op
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handle(fh)
        if not h.writable:
            raise pyfuse3.FUSEError(errno.EBADF)
        end = off + len(buf)
        if end > MAX_VALUE_BYTES:
            raise pyfuse3.FUSEError(errno.EFBIG)
        await self._load(h)
        d = h.data
        assert d is not None
        if off > len(d):
            d.extend(bytes(off - len(d)))
        d[off:end] = buf
        h.dirty = True
        return len(buf)

    @_op
    async def flush(self, fh: int) -> None:
        await self._commit(self._handle(fh))

    @_op
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._commit(self._handle(fh))

    async def release(self, fh: int) -> None:
        h = self._handles.get(fh)
        if h is None:
            return
        try:
            if h.dirty and not h.orphan:  # normally committed by flush already
                async with asyncio.timeout(self.timeout_s):
                    await self._commit(h)
        except Exception as exc:
            log.error("release: %s: the written data is lost: %s", self._paths.get(h.ino), exc)
        finally:
            del self._handles[fh]
            self._maybe_drop(h.ino)

    def discard_open_writes(self) -> int:
        """At unmount: files still open for writing are not committed; how many."""
        n = sum(1 for h in self._handles.values() if h.writable and h.dirty and not h.orphan)
        self._handles.clear()
        return n

    # directories ---------------------------------------------------------------
    @_op
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
                    ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name, limit=MAX_KEY_BYTES - 1)
        await self.fs._put_markers(path)
        return self._attrs(self._remember(path), {"name": path, "size": 0, "type": "directory"})

    @_op
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = self._child(parent_inode, name)
        prefix = path + "/"
        if any(p.startswith(prefix) and self._pending_size(i) is not None
               for p, i in self._inos.items()):
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        try:
            await self.fs._rmdir(path)
        except FileNotFoundError:
            pass  # an implicit directory whose last file went: nothing left to remove
        self._detach(path)

    @_op
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = self._child(parent_inode, name)
        ino = self._inos.get(path)
        pending = False
        if ino is not None:
            for h in self._writers(ino):
                pending = pending or h.dirty
                h.orphan = True
        try:
            await self.fs._rm_file(path)
        except FileNotFoundError:
            if not pending:
                raise
        self._detach(path)

    @_op
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        src = self._child(parent_inode_old, name_old)
        dst = self._child(parent_inode_new, name_new)
        if src == dst:
            return
        ino = self._inos.get(src)
        if ino is not None:
            for h in self._writers(ino):
                await self._commit(h)
        # a file (the common case: tmp + rename) is read while the target is looked at
        value, dst_info = await asyncio.gather(self._value_or_none(src), self._info_or_none(dst))
        if dst_info is not None and flags & pyfuse3.RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EEXIST)
        if value is not None:
            if dst_info is not None and dst_info["type"] == "directory":
                raise pyfuse3.FUSEError(errno.EISDIR)
            await self.fs._put_value(dst, value)
            await self.fs._rm_file(src)
        else:
            await self.fs._info(src)  # ENOENT unless a directory
            if dst_info is not None and dst_info["type"] == "file":
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            if dst_info is not None and await self.fs._ls(dst, detail=False):
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            await self._move_tree(src, dst)
        self._renamed(src, dst)

    async def _value_or_none(self, path: str) -> bytes | None:
        try:
            v: bytes = await self.fs._get_value(path)
        except (FileNotFoundError, IsADirectoryError):
            return None
        return v

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
        i = 0
        while i < len(infos):
            j, size = i, 0
            while j < len(infos) and j - i < MOVE_BATCH_KEYS and (j == i or size < MOVE_BATCH_BYTES):
                size += infos[j].size
                j += 1
            keys = [ki.key for ki in infos[i:j]]
            new = [os.fsencode(dst) + k[n:] for k in keys]
            for k in new:
                check_path(os.fsdecode(k))
            values = await c.get_many(keys)
            await c.put_many([(k, v) for k, v in zip(new, values, strict=True) if v is not None])
            await c.delete_many(keys)
            i = j
        if not infos:  # an empty implicit directory: keep it as an empty one
            await self.fs._put_markers(dst)

    def _renamed(self, src: str, dst: str) -> None:
        for path in [p for p in self._inos if p == dst or p.startswith(dst + "/")]:
            self._detach(path)
        moved = [(p, i) for p, i in self._inos.items() if p == src or p.startswith(src + "/")]
        for p, _ in moved:
            del self._inos[p]
        for p, i in moved:
            q = dst + p[len(src):]
            self._inos[q] = i
            self._paths[i] = q

    @_op
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        path = self._path(inode)
        listing = cast(list[Info], await self.fs._ls(path, detail=True))
        if len(listing) == 1 and listing[0]["name"] == path and listing[0]["type"] == "file":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        n = len(path) + 1 if path else 0
        entries = [(str(e["name"])[n:], e) for e in listing]
        seen = {name for name, _ in entries}
        prefix = path + "/" if path else ""
        for p, ino in list(self._inos.items()):  # files created here, not yet committed
            if p.startswith(prefix) and "/" not in p[len(prefix):] and p[len(prefix):] not in seen:
                size = self._pending_size(ino)
                if size is not None:
                    entries.append((p[len(prefix):], {"name": p, "size": size, "type": "file"}))
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = (prefix, entries)
        return fh

    @_op
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        prefix, entries = self._dirs[fh]
        for i in range(start_id, len(entries)):
            name, info = entries[i]
            path = prefix + name
            ino = self._ino_for(path)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attrs(ino, info), i + 1):
                self._maybe_drop(ino)
                break
            self._lookups[ino] = self._lookups.get(ino, 0) + 1

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

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


def _resize(d: bytearray, size: int) -> None:
    if size < len(d):
        del d[size:]
    else:
        d.extend(bytes(size - len(d)))


# mount table ---------------------------------------------------------------------
def _unescape(field: str) -> str:
    """/proc/mounts escapes space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(field):
        octal = field[i + 1 : i + 4]
        if field[i] == "\\" and len(octal) == 3 and octal.isdigit():
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def is_mounted(mountpoint: str, *, fstype: str | None = None) -> bool:
    """Whether ``mountpoint`` is in /proc/mounts (optionally with that filesystem type)."""
    target = os.path.abspath(mountpoint)
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and _unescape(parts[1]) == target and (fstype is None or parts[2] == fstype):
            return True
    return False


# commands ------------------------------------------------------------------------
def add_commands(sub: Any) -> None:
    p = sub.add_parser("mount", help="mount the cluster as a filesystem (FUSE; runs until unmounted)",
                       description="Mount a kvfs cluster at MOUNTPOINT. Runs in the foreground; "
                       "Ctrl-C, SIGTERM or `kvfs umount MOUNTPOINT` unmounts. A file is committed "
                       "when it is closed.")
    p.add_argument("mountpoint")
    p.add_argument("--addr", default=None, help="cluster address (default: $KVFS_ADDR or kvfs://127.0.0.1:7070)")
    p.add_argument("--token-file", default=None, help=TOKEN_FILE_HELP)
    p.add_argument("--timeout", type=parse_duration, default=10.0, metavar="DURATION",
                   help="fail a request with EIO after this long (default 10s)")
    p.add_argument("--attr-timeout", type=parse_duration, default=1.0, metavar="DURATION",
                   help="how long the kernel may cache names and sizes (default 1s)")
    p.add_argument("--ttl", type=parse_duration, default=None, metavar="DURATION",
                   help="expiry of files written through the mount (default: the cluster's)")
    p.add_argument("--allow-other", action="store_true", help="let other users use the mount")
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser("umount", help="unmount a kvfs mount (also one whose process died)")
    p.add_argument("mountpoint")
    p.add_argument("-z", "--lazy", action="store_true", help="detach now even if busy")
    p.set_defaults(func=cmd_umount)


async def cmd_mount(ns: argparse.Namespace) -> int:
    if pyfuse3 is None:
        print(f"kvfs mount: the FUSE mount needs pyfuse3 and libfuse3 ({_IMPORT_ERROR}); install them "
              "with `apt-get install fuse3 libfuse3-dev pkg-config` and `pip install 'kvfs[fuse]'`",
              file=sys.stderr)
        return 2
    mnt = os.path.abspath(ns.mountpoint)
    if not os.path.isdir(mnt):
        print(f"kvfs mount: {mnt} is not a directory", file=sys.stderr)
        return 2
    if not os.path.exists("/dev/fuse"):
        print("kvfs mount: /dev/fuse is missing (load the fuse module, or run the container with "
              "--device /dev/fuse)", file=sys.stderr)
        return 2
    timeout_s = float(ns.timeout)
    cfg = ClientConfig(connect_timeout_s=min(5.0, timeout_s), request_timeout_s=timeout_s,
                       layout_cache_entries=0)  # files are overwritten: always look keys up
    fs = KVFileSystem(ns.addr, token=token_from_file(ns.token_file), config=cfg, ttl=ns.ttl, asynchronous=True,
                      skip_instance_cache=True)
    try:
        async with asyncio.timeout(timeout_s):
            await fs.client.stats()
    except (KVFSError, OSError, TimeoutError) as exc:
        await fs._close()
        print(f"kvfs mount: cannot reach the cluster at {fs.addr}: {exc}", file=sys.stderr)
        return 1
    ops = KVFSOperations(fs, timeout_s=timeout_s, attr_timeout_s=float(ns.attr_timeout))
    options = set(pyfuse3.default_options) | {"fsname=kvfs", "subtype=kvfs"}
    if ns.allow_other:
        options.add("allow_other")
    pyfuse3.asyncio.enable()
    try:
        pyfuse3.init(ops, mnt, options)
    except RuntimeError as exc:
        await fs._close()
        print(f"kvfs mount: cannot mount at {mnt}: {exc} (already mounted? not permitted?)",
              file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    sigs = (signal.SIGINT, signal.SIGTERM)

    stopping = False

    def stop(sig: signal.Signals) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        log.info("%s: unmounting %s", sig.name, mnt)
        try:
            pyfuse3.terminate()
        except asyncio.InvalidStateError:
            # pyfuse3's asyncio shim wakes the one task waiting on /dev/fuse; it was already
            # woken and sees the session's exit flag on its own
            pass

    for sig in sigs:
        loop.add_signal_handler(sig, stop, sig)
    print(f"kvfs mount ready {mnt} {fs.addr}", flush=True)
    try:
        await pyfuse3.main()
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
        lost = ops.discard_open_writes()
        if lost:
            log.warning("%d file(s) still open for writing were not committed", lost)
        pyfuse3.close(unmount=True)
        await fs._close()
    return 0


async def cmd_umount(ns: argparse.Namespace) -> int:
    mnt = os.path.abspath(ns.mountpoint)
    if not is_mounted(mnt):
        print(f"kvfs umount: {mnt} is not mounted", file=sys.stderr)
        return 1
    lazy = ["-z"] if ns.lazy else []
    commands = [[tool, "-u", *lazy, mnt] for tool in ("fusermount3", "fusermount") if shutil.which(tool)]
    if os.geteuid() == 0 or not commands:
        commands.append(["umount", *(["-l"] if ns.lazy else []), mnt])
    err = ""
    for argv in commands:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, stderr = await proc.communicate()
        if proc.returncode == 0 or not is_mounted(mnt):
            return 0
        err = stderr.decode(errors="replace").strip()
    print(f"kvfs umount: {mnt}: {err or 'failed'}", file=sys.stderr)
    return 1
