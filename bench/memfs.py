"""The floor of a FUSE filesystem in Python on this machine: files in a dict, nothing else.

    python -m kvfs.bench.memfs [--flush] MOUNTPOINT     (SIGTERM / SIGINT unmounts)

One directory, regular files only, held in this process's memory; no kvfs, no network. A
WRITE at the start of an empty file keeps the ``bytes`` pyfuse3 made of it (no second
copy); a READ is answered from a view of the file's bytes. It runs as ``kvfs mount`` runs with
its defaults: pyfuse3 on uvloop through the same asyncio shim
(:func:`kvfs.mount._fuse.enable_asyncio`), the same idle workers, entry and attribute timeouts
and kernel read-ahead (``MountConfig``'s and ``kvfs mount``'s defaults; a ``kvfs mount``
given other values for these no longer matches it).  Every open drops the kernel's pages of
the file (as a first read on another node), so each read reaches this process.

It has no FLUSH: pyfuse3 answers it ENOSYS, and the kernel then sends no more FLUSHes on the
mount, as it would for any filesystem with no use for them.  ``--flush`` answers FLUSH (doing
nothing), as a filesystem that commits a file when it is closed must (``kvfs mount``: a close's
FLUSH commits, so ``close`` returns its errors), and the kernel sends one per ``close`` of each
file descriptor.

``python -m kvfs.bench.mount_pages --floor`` writes and reads its page files through it too, in
the same sitting: what a Python filesystem pays for the same requests, beside the mount's and
the API's rates.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import errno
import os
import signal
import stat
import sys
from collections.abc import Sequence

from kvfs.config import MountConfig
from kvfs.mount._fuse import IMPORT_ERROR, Operations, enable_asyncio, pyfuse3, stop_watching
from kvfs.mount.cli import ATTR_TIMEOUT_S, tune_read_ahead


class MemFS(Operations):
    """Regular files in the mount's root directory, in a dict.  A file unlinked or renamed
    over while open keeps its bytes until its last release."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[bytes, int] = {}
        self.data: dict[int, bytes | bytearray] = {}
        self.opens: collections.Counter[int] = collections.Counter()
        self.orphans: set[int] = set()  # unlinked or renamed over while open
        self.next_ino = pyfuse3.ROOT_INODE + 1

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = ATTR_TIMEOUT_S
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

    def _unname(self, name: bytes) -> None:
        """``name`` gone from the directory; its bytes too, unless the file is open."""
        ino = self.names.pop(name, None)
        if ino is None:
            return
        if self.opens[ino]:
            self.orphans.add(ino)
        else:
            del self.data[ino]

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
        self._unname(name)
        ino = self.names[name] = self.next_ino
        self.next_ino += 1
        self.data[ino] = b""
        self.opens[ino] += 1
        return pyfuse3.FileInfo(fh=ino), self._attrs(ino)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode not in self.data:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & os.O_TRUNC:
            self.data[inode] = b""
        self.opens[inode] += 1
        return pyfuse3.FileInfo(fh=inode, keep_cache=False)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        return memoryview(self.data[fh])[off:off + size]  # (not copied)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        d = self.data[fh]
        if not d and not off:
            self.data[fh] = buf  # a file's first write: its bytes as they are
            return len(buf)
        if not isinstance(d, bytearray):
            d = self.data[fh] = bytearray(d)
        if off > len(d):
            d.extend(bytes(off - len(d)))
        d[off:off + len(buf)] = buf
        return len(buf)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        ino = self._ino(parent_inode_old, name_old)
        if parent_inode_new != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name_new != name_old:
            self._unname(name_new)
            self.names[name_new] = self.names.pop(name_old)
        assert self.names[name_new] == ino

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._ino(parent_inode, name)
        self._unname(name)

    async def release(self, fh: int) -> None:
        self.opens[fh] -= 1
        if not self.opens[fh]:
            del self.opens[fh]
            if fh in self.orphans:
                self.orphans.discard(fh)
                del self.data[fh]

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        pass


class MemFSFlush(MemFS):
    """:class:`MemFS` answering FLUSH (``--flush``)."""

    async def flush(self, fh: int) -> None:
        pass


async def serve(mnt: str, *, flush: bool = False) -> int:
    if IMPORT_ERROR:
        print(f"python -m kvfs.bench.memfs: {IMPORT_ERROR}", file=sys.stderr)
        return 1
    config = MountConfig()
    enable_asyncio()
    pyfuse3.init(MemFSFlush() if flush else MemFS(), mnt, {"fsname=memfs", "subtype=memfs"})
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, pyfuse3.terminate)

    async def ready() -> None:
        why = await tune_read_ahead(mnt, config)  # as kvfs mount's
        if why is not None:
            print(f"memfs: kernel read-ahead left as it is: {why}", file=sys.stderr, flush=True)
        print(f"memfs ready {mnt}", flush=True)

    tuned = loop.create_task(ready())
    try:
        await pyfuse3.main(min_tasks=config.idle_workers)
    finally:
        stop_watching()
        tuned.cancel()
        pyfuse3.close(unmount=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.memfs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mountpoint")
    ap.add_argument("--flush", action="store_true",
                    help="answer FLUSH, as a filesystem that commits at close must (default: "
                    "none, so the kernel stops sending it)")
    ns = ap.parse_args(argv)
    from kvfs._loop import run

    return run(serve(os.path.abspath(ns.mountpoint), flush=ns.flush))


if __name__ == "__main__":
    sys.exit(main())
