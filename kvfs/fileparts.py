"""A reply payload that is bytes of files: :class:`FileParts`, sent into a plain TCP socket
with ``sendfile(2)`` (page cache -> socket, no copy through a user buffer), or read into one
buffer where it cannot be (a connection without a plain socket)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence


class ShortFile(OSError):
    """A file ended before the bytes a :class:`FileParts` promised (truncated since)."""


class FileParts:
    """The payload ``segments``, in order: ``(fd, offset, length)``, each fd one this object
    owns (a ``dup`` of the caller's, closed by :meth:`close`, so the caller may close or
    replace its own meanwhile).  :meth:`send` writes as much as a non-blocking socket takes
    and remembers where it stopped."""

    __slots__ = ("_close_fds", "_fds", "_i", "_pos", "nbytes", "segments", "sent")

    def __init__(self, segments: Sequence[tuple[int, int, int]], fds: Sequence[int],
                 close_fds: Callable[[list[int]], None] | None = None) -> None:
        """``close_fds(fds)``: called once by :meth:`close`, closes the fds in its own way
        (a chunkserver's: a deleted chunk's in an IO thread); None: each closed here."""
        self._fds = list(fds)
        self._close_fds = close_fds
        self.segments = [s for s in segments if s[2]]
        self.nbytes = sum([s[2] for s in self.segments])
        self.sent = 0  # bytes sent so far
        self._i = 0  # the segment being sent ...
        self._pos = 0  # ... and its bytes sent so far

    @property
    def done(self) -> bool:
        return self.sent == self.nbytes

    def send(self, sock_fd: int) -> int:
        """``sendfile`` the next bytes into ``sock_fd`` (non-blocking) until all are sent or
        the socket is full (BlockingIOError, caught); returns the bytes sent by this call.
        A file shorter than its segment raises :class:`ShortFile`; the socket's errors
        (the peer gone) pass through."""
        segs, sendfile = self.segments, os.sendfile
        start = self.sent
        while self._i < len(segs):
            fd, off, ln = segs[self._i]
            pos = self._pos
            try:
                n = sendfile(sock_fd, fd, off + pos, ln - pos)
            except BlockingIOError:
                break
            if n == 0:
                raise ShortFile(f"file ended at {off + pos}, expected {ln - pos} more bytes")
            self.sent += n
            if pos + n == ln:
                self._i += 1
                self._pos = 0
            else:
                self._pos = pos + n
        return self.sent - start

    def read(self) -> memoryview:
        """Every byte in one buffer (for a connection ``sendfile`` cannot serve)."""
        out = memoryview(bytearray(self.nbytes))
        pos = 0
        for fd, off, ln in self.segments:
            got = 0
            while got < ln:
                n = os.preadv(fd, [out[pos + got : pos + ln]], off + got)
                if n == 0:
                    raise ShortFile(f"file ended at {off + got}, expected {ln - got} more bytes")
                got += n
            pos += ln
        return out

    def close(self) -> None:
        fds, self._fds = self._fds, []
        close_fds, self._close_fds = self._close_fds, None
        if close_fds is not None:
            close_fds(fds)
            return
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> FileParts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a reply dropped unsent (its task cancelled early) leaks no fd
        self.close()
