"""The mount's state: inode numbers of paths, the kernel's lookup counts, open handles.

Pure bookkeeping, no FUSE and no I/O: errors are ``OSError`` with the errno
the request answers (``ESTALE`` for an inode the kernel should not know any
more, ``EBADF`` for a closed handle).
"""

from __future__ import annotations

import asyncio
import errno
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kvfs.mount.writebehind import Held
    from kvfs.stream import StreamPut, ValueReader

__all__ = ["ROOT_INODE", "SETTLE_S", "Handle", "Info", "InodeTable"]

ROOT_INODE = 1
# how long after an answer to a LOOKUP or GETATTR (or a WRITE) the kernel has applied it (its
# waiting task ran): a request it sent sooner may have its answer dropped.  Requests are
# dated by when the mount last found none queued (kvfs.mount._fuse.quiet_at), a bound on
# when the kernel sent them however long they waited; the kernel's own delay is this bound,
# not a guarantee (a task descheduled longer breaks it: InodeTable.tell)
SETTLE_S = 0.05
Info = dict[str, Any]
V = TypeVar("V")


def _known(table: dict[int, V], number: int, err: int, what: str) -> V:
    """``table[number]``, or the ``OSError(err)`` a request for a stale number answers."""
    try:
        return table[number]
    except KeyError:
        raise OSError(err, f"{what} {number} is not known (any more)") from None


@dataclass(eq=False)
class Handle:
    """One open file (its bytes are handled by :class:`kvfs.mount.files.FileIO`)."""

    ino: int
    writable: bool
    # writing: the file's bytes from `base` on (None until the old value is read); those
    # before `base` went to `stream`, or were committed (the first `prefix` bytes)
    data: bytearray | None = None
    # bytes written in order after `data`, kept as the kernel's buffers came (not copied)
    tail: list[bytes] = field(default_factory=list)
    tail_bytes: int = 0
    base: int = 0
    prefix: int = 0
    stream: StreamPut | None = None
    failed: BaseException | None = None  # a write or commit failed: the data is lost
    dirty: bool = False  # has writes (or a truncation) not yet committed
    orphan: bool = False  # unlinked, or renamed over, while open: never committed
    # made by create() where the name was missing, and not committed since: nothing of its
    # path is in the cluster as far as this mount knows (a rename or unlink before its
    # first commit deletes nothing there)
    new: bool = False
    # reading: the value pinned at the first read, and its last few stripe units by offset
    reader: ValueReader | None = None
    held: Held | None = None  # or the held (write-behind) version pinned at the first read
    # (a writer: the one it held last, read and written on from then on)
    units: OrderedDict[int, asyncio.Future[bytes | bytearray | memoryview]] = field(
        default_factory=OrderedDict)
    next_read: int = 0  # where a sequential read goes on (read-ahead)
    # `reader` was pinned at open from a LOOKUP's layout, and no read has answered from it yet
    pinned_at_open: bool = False
    # opened with the kernel's cached pages kept (they hold bytes of `reader`'s value only)
    kept_cache: bool = False
    # opened with direct_io: reads bypass the kernel's pages (another open of the file here
    # reads another version through them; FileIO.opened)
    direct: bool = False
    # writing: opened with no other open of the file here, and none made since (the kernel's
    # pages of the file hold only what this handle wrote or read; FileIO.writing)
    sole: bool = False
    # writing: the file's mtime while it is written here, and of the value it commits
    mtime: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one writer or first read at a time

    @property
    def size(self) -> int | None:
        """The size written so far (None: not loaded)."""
        return None if self.data is None else self.base + len(self.data) + self.tail_bytes


class InodeTable:
    """Paths <-> inode numbers, lookup counts, and the open file and directory handles.

    An inode lives while the kernel holds a lookup of it or a handle is open
    on it; a path that is unlinked or replaced is detached from its inode
    (which stays readable through open handles).
    """

    def __init__(self) -> None:
        self._paths: dict[int, str] = {ROOT_INODE: ""}
        self._inos: dict[str, int] = {"": ROOT_INODE}
        # how many known paths lie under each "dir/": a rename of a file (nothing under it)
        # moves one entry instead of scanning every known path
        self._under: dict[str, int] = {}
        self._lookups: dict[int, int] = {}
        self._unlinked: set[int] = set()
        self._next_ino = ROOT_INODE + 1
        self._handles: dict[int, Handle] = {}
        self._of_ino: dict[int, list[Handle]] = {}  # the open handles by inode
        self._dirs: dict[int, tuple[str, list[tuple[str, Info]]]] = {}
        self._next_fh = 1
        # a file's size in the last attributes the kernel was sent, and when (InodeTable.tell)
        self._told: dict[int, tuple[int, float]] = {}

    # inodes --------------------------------------------------------------------
    def path(self, ino: int) -> str:
        return _known(self._paths, ino, errno.ESTALE, "inode")

    def path_or_none(self, ino: int) -> str | None:
        return self._paths.get(ino)

    def ino_of(self, path: str) -> int | None:
        return self._inos.get(path)

    def is_unlinked(self, ino: int) -> bool:
        return ino in self._unlinked

    def ino_for(self, path: str) -> int:
        """The inode for ``path``, numbered now if it has none."""
        ino = self._inos.get(path)
        if ino is None:
            ino = self._next_ino
            self._next_ino += 1
            self._link(path, ino)
            self._paths[ino] = path
        return ino

    def _link(self, path: str, ino: int) -> None:
        self._inos[path] = ino
        self._count_under(path, 1)

    def _unlink_path(self, path: str) -> int | None:
        ino = self._inos.pop(path, None)
        if ino is not None:
            self._count_under(path, -1)
        return ino

    def _count_under(self, path: str, n: int) -> None:
        under = self._under
        i = path.find("/")
        while i >= 0:
            d = path[: i + 1]
            left = under.get(d, 0) + n
            if left:
                under[d] = left
            else:
                del under[d]
            i = path.find("/", i + 1)

    def _tree(self, path: str) -> list[str]:
        """``path`` and the known paths under it."""
        out = [path] if path in self._inos else []
        if self._under.get(path + "/"):
            out += [p for p in self._inos if p.startswith(path + "/")]
        return out

    def remember(self, path: str) -> int:
        """The inode for ``path``, its lookup count raised: the kernel now knows it."""
        ino = self.ino_for(path)
        self._lookups[ino] = self._lookups.get(ino, 0) + 1
        return ino

    def relink(self, path: str) -> int:
        """``path`` created anew: a fresh inode if its old one was unlinked; remembered."""
        if path in self._inos and self._inos[path] in self._unlinked:
            self._unlink_path(path)
        ino = self.remember(path)
        self._unlinked.discard(ino)
        return ino

    def forget(self, ino: int, n: int) -> None:
        """The kernel dropped ``n`` lookups of ``ino``."""
        left = self._lookups.get(ino, 0) - n
        if left > 0:
            self._lookups[ino] = left
        else:
            self._lookups.pop(ino, None)
            self.maybe_drop(ino)

    def tell(self, ino: int, size: int, asked: float, now: float, *, force: bool = False,
             keep: bool = False) -> int:
        """The size to send the kernel at ``now`` in attributes of file ``ino`` (``size``: its
        value's), for a request the kernel sent after ``asked``; recorded as told: the size the
        kernel's cached pages are cut at, and its reads through them end at.  The kernel
        applies such an answer only if no attribute change landed after it sent the request
        (its ``attr_version``), so a size other than the last one sent goes only for a
        request sent ``SETTLE_S`` after that last answer (or change) was sent; until
        then the last size is sent again.  ``force``: at once (a SETATTR's answer, a file
        being written here, the kernel's own change); ``keep``: never another than one sent
        (a listing's entries).  A file looked up or listed more often than every
        ``SETTLE_S`` keeps its last size meanwhile (its opens of another size read past the
        pages: slower, never cut)."""
        prev = self._told.get(ino)
        if prev is not None and not force and prev[0] != size and (keep or asked - prev[1] < SETTLE_S):
            size = prev[0]
        self._told[ino] = (size, now)
        return size

    def wrote(self, ino: int, end: int, now: float) -> None:
        """A WRITE to file ``ino`` ending at ``end`` answered at ``now``: the kernel's size
        grew to it, if smaller (and its attributes changed: a request sent before lands
        after)."""
        self._told[ino] = (max(end, self.told_size(ino) or 0), now)

    def told_size(self, ino: int) -> int | None:
        """The size the kernel has for file ``ino`` (None: none was sent)."""
        told = self._told.get(ino)
        return None if told is None else told[0]

    def maybe_drop(self, ino: int) -> None:
        """Forget ``ino`` unless the kernel or an open handle still refers to it."""
        if ino == ROOT_INODE or self._lookups.get(ino, 0) > 0:
            return
        if ino in self._of_ino:
            return
        self._told.pop(ino, None)
        path = self._paths.pop(ino, None)
        self._unlinked.discard(ino)
        if path is not None and self._inos.get(path) == ino:
            self._unlink_path(path)

    def detach(self, path: str) -> None:
        """``path`` no longer names its inode (unlinked or replaced)."""
        ino = self._unlink_path(path)
        if ino is not None:
            self._unlinked.add(ino)
            self.maybe_drop(ino)

    def renamed(self, src: str, dst: str) -> None:
        """``src`` (a file, or a directory and everything under it) is now ``dst``."""
        for path in self._tree(dst):
            self.detach(path)
        moved = [(p, self._inos[p]) for p in self._tree(src)]
        for p, _ in moved:
            self._unlink_path(p)
        for p, i in moved:
            q = dst + p[len(src):]
            self._link(q, i)
            self._paths[i] = q

    def children(self, prefix: str) -> list[tuple[str, int]]:
        """``(name, ino)`` of the known paths directly under ``prefix`` (``""`` or ``"dir/"``)."""
        return [(p[len(prefix):], i) for p, i in self._inos.items()
                if p.startswith(prefix) and p != prefix and "/" not in p[len(prefix):]]

    def has_pending_under(self, prefix: str) -> bool:
        """Whether a file under ``prefix`` is open with uncommitted data."""
        return any(p.startswith(prefix) and self.pending_size(i) is not None
                   for p, i in self._inos.items())

    # file handles --------------------------------------------------------------
    def open(self, h: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = h
        self._of_ino.setdefault(h.ino, []).append(h)
        return fh

    def handle(self, fh: int) -> Handle:
        return _known(self._handles, fh, errno.EBADF, "file handle")

    def handle_or_none(self, fh: int) -> Handle | None:
        return self._handles.get(fh)

    def close(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is not None:
            same = self._of_ino[h.ino]
            same.remove(h)
            if not same:
                del self._of_ino[h.ino]
            self.maybe_drop(h.ino)

    def handles_of(self, ino: int) -> Sequence[Handle]:
        """The handles open on ``ino`` (not to be kept: a view of the table)."""
        return self._of_ino.get(ino, ())

    def writers(self, ino: int) -> list[Handle]:
        return [h for h in self._of_ino.get(ino, ()) if h.writable]

    def pending_size(self, ino: int) -> int | None:
        """The size an open, written file has in this mount (None: no writer, or not loaded)."""
        h = self.pending(ino)
        return None if h is None else h.size

    def pending(self, ino: int) -> Handle | None:
        """The handle whose written bytes an open file shows in this mount (None: no writer,
        or not loaded)."""
        for h in self.writers(ino):
            if h.size is not None and not h.orphan:
                return h
        return None

    def discard_open_writes(self) -> int:
        """At unmount: files still open for writing are not committed; how many."""
        n = sum(1 for h in self._handles.values() if h.writable and h.dirty and not h.orphan)
        for h in self._handles.values():
            if h.stream is not None:
                h.stream.cancel()
        self._handles.clear()
        self._of_ino.clear()
        return n

    # directory handles ---------------------------------------------------------
    def opendir(self, prefix: str, entries: list[tuple[str, Info]]) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = (prefix, entries)
        return fh

    def dir(self, fh: int) -> tuple[str, list[tuple[str, Info]]]:
        return _known(self._dirs, fh, errno.EBADF, "directory handle")

    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    def readdir_reply(self, ino: int) -> None:
        """The kernel was handed ``ino`` in a readdir reply: it counts as a lookup."""
        self._lookups[ino] = self._lookups.get(ino, 0) + 1
