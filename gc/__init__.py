"""kvfs garbage collector: TTL expiry, capacity eviction, compaction, orphan check; admin CLI."""

from kvfs.gc.driver import FsckReport, GarbageCollector, PassOptions, PassReport, run_daemon

__all__ = ["FsckReport", "GarbageCollector", "PassOptions", "PassReport", "run_daemon"]
