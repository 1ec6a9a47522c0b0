"""One error hierarchy for client, servers and the wire.

Every error has a stable wire ``code``; a server answers a failed request with
an error frame carrying ``code`` and ``message`` and the client raises the
same class again (:func:`from_wire`).
"""

from __future__ import annotations

from typing import Any, ClassVar


class KVFSError(Exception):
    """Base of every kvfs error."""

    code: ClassVar[int] = 1

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def __str__(self) -> str:
        return self.message

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


class ProtocolError(KVFSError):
    code = 2


class LocalProtocolError(ProtocolError):
    """The caller misused the protocol (a bug or bad arguments on this side)."""

    code = 3


# (duplicates: the classes below pair up by shape; each is one wire error code, declared once)
class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol."""

    code = 4


class VersionMismatch(RemoteProtocolError):
    code = 5


class AuthError(KVFSError, PermissionError):
    """Wrong or missing cluster token."""

    code = 6


class InvalidArgument(KVFSError, ValueError):
    """A request names something malformed: key too long, bad size, ..."""

    code = 7


class FrameTooLarge(RemoteProtocolError):
    code = 8


class NotFound(KVFSError, KeyError):
    code = 9

    def __str__(self) -> str:  # KeyError quotes its argument; we want the message
        return self.message


class StaleLayout(KVFSError):
    """A chunkserver does not hold the range a layout names (moved or reclaimed)."""

    code = 10


class Unavailable(KVFSError, ConnectionError):
    """A server could not be reached or went away mid-request."""

    code = 11


class ChecksumMismatch(KVFSError):
    """Bytes read back do not match their CRC-32C; they are never returned."""

    code = 12


class NoSpace(KVFSError, OSError):
    code = 13


# code 14 was QuotaExceeded (never raised, removed): wire codes are never reused.


class Timeout(Unavailable, TimeoutError):
    code = 15


class ServerError(KVFSError):
    """An unexpected failure inside a server; the server keeps serving."""

    code = 16


class WrongCluster(KVFSError):
    """A chunkserver and a meta (or a GC) that belong to different clusters: a meta whose
    database was lost or replaced must never direct a chunkserver it does not know."""

    code = 24


class TlsError(AuthError):
    """TLS could not be set up: a certificate that failed verification, a peer that does
    not speak TLS (or speaks it when this side does not), a missing client certificate.
    Raised on this side only; never retried."""

    code = 25


def _all_subclasses(cls: type[KVFSError]) -> list[type[KVFSError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[int, type[KVFSError]] = {c.code: c for c in _all_subclasses(KVFSError)}
assert len(_BY_CODE) == len(_all_subclasses(KVFSError)), "duplicate wire error codes"


def from_wire(header: dict[str, Any]) -> KVFSError:
    cls = _BY_CODE.get(int(header.get("code", 1)), KVFSError)
    return cls(str(header.get("message", "unknown error")))
