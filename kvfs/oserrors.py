"""kvfs errors at the file-system surfaces: builtin exceptions (fsspec) and errno codes (FUSE).

fsspec callers get builtins (``FileNotFoundError(path)``), as fsspec's own
implementations raise them; the FUSE mount answers each failed request with
an errno. Both come from here, so an error means the same through either.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from kvfs.errors import KVFSError, NotFound

__all__ = ["builtin_errors", "errno_of", "to_builtin"]


def to_builtin(exc: KVFSError, path: str) -> BaseException:
    """The builtin error for ``exc`` at ``path``: ``NotFound`` -> ``FileNotFoundError``;
    errors that already are ``OSError``/``ValueError`` (``Unavailable``, ``Timeout``,
    ``NoSpace``, ``AuthError``, ``InvalidArgument``) stay; the rest -> ``OSError(EIO)``."""
    if isinstance(exc, NotFound):
        return FileNotFoundError(errno.ENOENT, str(exc), path)
    if isinstance(exc, (OSError, ValueError)):
        return exc
    return OSError(errno.EIO, f"{type(exc).__name__}: {exc}", path)


@contextlib.contextmanager
def builtin_errors(path: str) -> Iterator[None]:
    """``with builtin_errors(path): ...`` re-raises a kvfs error as :func:`to_builtin` says."""
    try:
        yield
    except KVFSError as exc:
        new = to_builtin(exc, path)
        if new is exc:
            raise
        raise new from exc


def errno_of(exc: BaseException) -> int:
    """The errno a FUSE request answers ``exc`` with.

    Timeouts and lost connections (kvfs ``Timeout``/``Unavailable``, the
    mount's own deadline) -> ``EIO``; an ``OSError`` (or a ``ValueError``
    such as ``kvfs.fs.InvalidPathError``) carrying an errno -> that errno;
    another ``ValueError`` -> ``EINVAL``; anything else -> ``EIO``.
    """
    if isinstance(exc, TimeoutError | ConnectionError):
        return errno.EIO
    code = getattr(exc, "errno", None)
    if isinstance(exc, OSError | ValueError) and isinstance(code, int) and code:
        return code
    if isinstance(exc, ValueError):
        return errno.EINVAL
    return errno.EIO
