"""kvfs chunkserver: append-only chunk files on local disk, vectored aligned reads."""

from kvfs.chunkserver.service import ChunkServer
from kvfs.chunkserver.store import ChunkStore, plan_spans

__all__ = ["ChunkServer", "ChunkStore", "plan_spans"]
