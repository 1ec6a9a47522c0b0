"""A byte-rate budget for the GC's background copies and reads (compaction, repair, scrub)."""

from __future__ import annotations

import asyncio
import time


class Pacer:
    """``await pacer.spent(n)`` after each batch of ``n`` bytes: sleeps while the work so far
    is ahead of ``rate_bytes`` per second (None or 0: never sleeps)."""

    def __init__(self, rate_bytes: int | None) -> None:
        self.rate_bytes = rate_bytes
        self.t0 = time.monotonic()
        self.bytes = 0

    async def spent(self, nbytes: int) -> None:
        self.bytes += nbytes
        if self.rate_bytes:
            ahead = self.bytes / self.rate_bytes - (time.monotonic() - self.t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
