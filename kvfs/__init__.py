"""kvfs: a distributed, file-system-backed KV cache for LLM inference."""

from kvfs.client import AsyncClient, KeyInfo, connect
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
    Unavailable,
    VersionMismatch,
)
from kvfs.layout import Layout
from kvfs.sync import Client

__all__ = [
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
    "Unavailable",
    "VersionMismatch",
    "connect",
]
