"""``kvfs mount MOUNTPOINT`` / ``kvfs umount MOUNTPOINT``: a kvfs cluster as a FUSE filesystem.

Built on pyfuse3 (libfuse3) in asyncio mode: FUSE requests are coroutines on
the same event loop as the kvfs client, many in flight at once, so parallel
reads of small files coalesce in the client's batcher.  Paths map to keys as
in :mod:`kvfs.fs` (``/mnt/kv/a/b.bin`` is key ``a/b.bin``; directories are
prefixes, ``mkdir`` records a marker key).

What differs from a local disk:

- **close() is the commit point.**  A file opened for writing is committed as
  one value on ``close()`` (FUSE flush) or ``fsync()``; until then other
  clients, and other mounts, do not see it (this mount shows it with its size
  so far).  Errors of the commit are returned by ``close()``/``fsync()``.  A
  file still open when the mount stops is not committed.  With
  ``--write-behind`` a close returns once the file is held by the mount, and
  ``fsync()`` is the commit point (:mod:`kvfs.mount.writebehind`).
- **Memory is bounded per open file** (:mod:`kvfs.mount.files`): a file is
  buffered up to ``--write-buffer``, then streamed in stripe units as written;
  large files must be written in order (a write far behind the end fails with
  ``EOPNOTSUPP``).  Reads fetch stripe units of the layout pinned at open (the
  one the kernel's LOOKUP just fetched; else at the first read), batched across
  files, with read-ahead for sequential readers.
- **The kernel's cached pages of a file** are kept by a read-only open only when
  its LOOKUP found the value they were read from (the same layout, recorded at
  the last open that dropped them), or the value whose bytes a handle with no
  other open of the file here wrote through them and committed, and no other
  open of the file here writes it or reads another version; otherwise the open
  drops them.  A value written here keeps, on this mount, the mtime the kernel
  was told while it was written (a new one would make the kernel drop them).
- Opening an existing file for writing without ``O_TRUNC`` reads its value
  first (read-modify-write; ``EOPNOTSUPP`` over ``--write-buffer``);
  ``O_APPEND`` on an existing file fails with ``EOPNOTSUPP``.
- ``mv`` is read + put + delete (not atomic: for a moment both names exist,
  never neither); renaming a directory moves every key under it.
- A read-only open pins the value's layout (at open, or at its first read): a
  file replaced meanwhile keeps reading the old bytes (until the GC reclaims
  them: then a first read reads the new value, and a later read, or the first
  of a handle that kept cached pages, fails; never a mix of two values).  No hard
  links, symlinks, devices or xattrs.
- A file whose every replica is lost behaves as a miss (the client's
  ``on_lost="miss"``): its read fails with ``ENOENT``, and meta forgets it.
- Without ``--allow-other`` the kernel does not check modes (only the mounting
  user may enter the mount); with it, ``default_permissions`` applies.
- Every request is bounded by ``--timeout``: with the cluster gone a call
  fails with ``EIO`` instead of hanging, and works again once it is back.

SIGINT/SIGTERM unmount cleanly.  A mount whose process was killed (-9) leaves
a dead mount point ("Transport endpoint is not connected"): remove it with
``kvfs umount MOUNTPOINT`` (``fusermount3 -u``).
"""

from kvfs.mount.mtab import is_mounted
from kvfs.mount.ops import KVFSOperations

__all__ = ["KVFSOperations", "is_mounted"]
