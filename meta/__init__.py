"""kvfs metadata service: key -> layout, chunk table, chunkserver registry."""

from kvfs.meta.service import MetaService
from kvfs.meta.store import MetaStore

__all__ = ["MetaService", "MetaStore"]
