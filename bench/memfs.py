"""The floor of a FUSE filesystem in Python on this machine: files in a dict, nothing else.

    python -m kvfs.bench.memfs MOUNTPOINT     (SIGTERM / SIGINT unmounts)

One directory, regular files only, held in this process's memory; no kvfs, no network, no
copy beyond the one pyfuse3 makes of each WRITE.  It runs as ``kvfs mount`` runs: pyfuse3
on uvloop through the same asyncio shim (:func:`kvfs.mount._fuse.enable_asyncio`), the same
idle workers, entry and attribute timeouts and kernel read-ahead (``MountConfig``'s and
``kvfs mount``'s defaults).  Every open drops the kernel's pages of the file (as a first
read on another node), so each read reaches this process.  ``python -m
kvfs.bench.mount_pages --floor`` writes and reads its page files through it too, in the
same sitting: what any Python filesystem pays for the same requests, beside the mount's
and the API's rates.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import stat
import sys
from collections.abc import Sequence

from kvfs.config import MountConfig
from kvfs.mount._fuse import IMPORT_ERROR, Operations, enable_asyncio, pyfuse3, stop_watching
from kvfs.mount.mtab import set_read_ahead

TIMEOUT_S = 1.0  # entry and attribute timeouts: kvfs mount's default --attr-timeout


class MemFS(Operations):
    """Regular files in the mount's root directory, in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[bytes, int] = {}
        self.data: dict[int, bytearray] = {}
        self.next_ino = pyfuse3.ROOT_INODE + 1

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = TIMEOUT_S
        if ino == pyfuse3.ROOT_INODE:
            a.st_mode, a.st_size = stat.S_IFDIR | 0o755, 0
        else:
            a.st_mode, a.st_size = stat.S_IFREG | 0o644, len(self.data[ino])
        a.st_nlink = 1
        a.st_blksize = 4096
        return a

    def _ino(self, parent_inode: int, name: bytes) -> int:
        ino = self.names.get(name) if parent_inode == pyfuse3.ROOT_INODE else None
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return ino

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        return self._attrs(self._ino(parent_inode, name))

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode != pyfuse3.ROOT_INODE and inode not in self.data:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(inode)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        ino = self.names.get(name)
        if ino is None:
            ino = self.names[name] = self.next_ino
            self.next_ino += 1
        self.data[ino] = bytearray()
        return pyfuse3.FileInfo(fh=ino), self._attrs(ino)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & os.O_TRUNC:
            self.data[inode] = bytearray()
        return pyfuse3.FileInfo(fh=inode, keep_cache=False)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        return memoryview(self.data[fh])[off:off + size]  # (not copied)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        d = self.data[fh]
        if off == len(d):
            d += buf
        else:
            d[off:off + len(buf)] = buf
        return len(buf)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        ino = self._ino(parent_inode_old, name_old)
        if parent_inode_new != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        old = self.names.pop(name_new, None)
        if old is not None:
            del self.data[old]
        self.names[name_new] = self.names.pop(name_old)
        assert self.names[name_new] == ino

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        del self.data[self._ino(parent_inode, name)]
        del self.names[name]

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        pass

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        pass


async def serve(mnt: str) -> int:
    if IMPORT_ERROR:
        print(f"python -m kvfs.bench.memfs: {IMPORT_ERROR}", file=sys.stderr)
        return 1
    config = MountConfig()
    enable_asyncio()
    pyfuse3.init(MemFS(), mnt, {"fsname=memfs", "subtype=memfs"})
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, pyfuse3.terminate)

    async def tune() -> None:  # as kvfs mount's: once the kernel has the mount
        await asyncio.to_thread(os.stat, mnt)
        set_read_ahead(mnt, config.kernel_read_ahead_bytes)
        print(f"memfs ready {mnt}", flush=True)

    tuned = loop.create_task(tune())
    try:
        await pyfuse3.main(min_tasks=config.idle_workers)
    finally:
        stop_watching()
        tuned.cancel()
        pyfuse3.close(unmount=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    from kvfs._loop import run

    return run(serve(os.path.abspath(args[0])))


if __name__ == "__main__":
    sys.exit(main())
