"""kvfs: a distributed, file-system-backed KV cache for LLM inference."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("kvfs")  # one place: pyproject.toml's [project] version
except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
    __version__ = "0+unknown"

from kvfs.client import FAILED, MISS, TOO_SMALL, AsyncClient, KeyInfo, connect
from kvfs.config import ChunkServerConfig, ClientConfig, MetaConfig
from kvfs.errors import (
    AuthError,
    ChecksumMismatch,
    InvalidArgument,
    KVFSError,
    LocalProtocolError,
    NoSpace,
    NotFound,
    ProtocolError,
    RemoteProtocolError,
    StaleLayout,
    Timeout,
    TlsError,
    Unavailable,
    VersionMismatch,
)
from kvfs.layout import Layout
from kvfs.sync import Client

__all__ = [
    "FAILED",
    "MISS",
    "TOO_SMALL",
    "AsyncClient",
    "AuthError",
    "ChecksumMismatch",
    "ChunkServerConfig",
    "Client",
    "ClientConfig",
    "InvalidArgument",
    "KVFSError",
    "KeyInfo",
    "Layout",
    "LocalProtocolError",
    "MetaConfig",
    "NoSpace",
    "NotFound",
    "ProtocolError",
    "RemoteProtocolError",
    "StaleLayout",
    "Timeout",
    "TlsError",
    "Unavailable",
    "VersionMismatch",
    "__version__",
    "connect",
]
