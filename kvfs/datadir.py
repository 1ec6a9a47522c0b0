"""A service's data directory: private (0700 / 0600) and held by one process (flock); a
file in it synced by path."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
from pathlib import Path

from kvfs.errors import KVFSError

DIR_MODE = 0o700
FILE_MODE = 0o600


class DataDirInUse(KVFSError):
    """Another process holds this data directory."""


def private_dir(path: Path) -> Path:
    """``mkdir -p`` with mode 0700 (other local users cannot list or read it)."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if path.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def create_private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if it does not exist (before a library such as
    SQLite creates it with the umask's mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    os.close(fd)
    if path.stat().st_mode & 0o777 != FILE_MODE:
        os.chmod(path, FILE_MODE)


def sync_file(path: Path | str) -> None:
    """``fdatasync`` of the file at ``path``, through a descriptor of its own (one no lock is
    taken on); none there: nothing to sync."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


class DirLock:
    """``DIR/lock`` held with ``flock`` for as long as the service runs; it names the pid.

    A second process on the same directory gets :class:`DataDirInUse` naming the holder.
    The kernel drops the lock when the holder dies, however it dies.
    """

    def __init__(self, directory: Path, what: str, *, name: str = "lock",
                 hint: str = "two processes cannot share one") -> None:
        self.path = directory / name
        self.what = what
        self.hint = hint
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(f"data directory {self.path.parent} is in use by another "
                               f"{self.what} (pid {holder}); {self.hint}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def raise_nofile_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns the new soft
    limit (a server's connections and cached chunk files are file descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
