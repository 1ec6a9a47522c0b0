"""Warnings a loop would repeat, logged at most once per interval for each subject.

A server meets the same trouble from one peer on every frame, and a GC pass meets a full or
unreachable chunkserver on every pass (meta's MAKE_ROOM passes on a full cluster run back to
back: a soak logged some 58 warnings a second so).  :class:`RateLimitedLog` logs the first,
holds back the rest for ``interval_s``, and the next one it logs says how many it held back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable


class RateLimitedLog:
    """``warning(subject, msg, *args)`` through ``logger``, at most once per ``interval_s``
    for each subject (``per_message``: each subject and ``msg``, the format string), never
    once per frame or pass.  At most ``max_subjects`` are remembered: past that, those whose
    interval ended are forgotten, and if that is not enough the oldest quarter (an
    unauthenticated peer's hosts cost bounded memory and bounded work)."""

    def __init__(self, logger: logging.Logger, interval_s: float, *, held: str = "like it",
                 per_message: bool = False, max_subjects: int = 10_000) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.held = held  # the held-back count's words: " (N more {held} since the last message)"
        self.per_message = per_message
        self.max_subjects = max_subjects
        self._last: dict[Hashable, tuple[float, int]] = {}  # subject -> (logged at, held back since)

    def forget(self) -> None:
        """Hold nothing back from now on (tests: each starts as a fresh process would)."""
        self._last.clear()

    def warning(self, subject: Hashable, msg: str, *args: object) -> bool:
        """Log it unless one for ``subject`` was logged within ``interval_s``; True if logged."""
        key = (subject, msg) if self.per_message else subject
        now = time.monotonic()
        last, held = self._last.get(key, (-1e18, 0))
        if now - last < self.interval_s:
            self._last[key] = (last, held + 1)
            return False
        if key not in self._last and len(self._last) >= self.max_subjects:
            kept = [(k, v) for k, v in self._last.items() if now - v[0] < self.interval_s]
            # still full: the oldest quarter goes, so a flood of new subjects prunes once per
            # quarter of them, not once each
            if len(kept) >= self.max_subjects:
                kept = kept[len(kept) - self.max_subjects * 3 // 4:]
            self._last = dict(kept)
        self._last[key] = (now, 0)
        if held:
            msg += f" (%d more {self.held} since the last message)"
            args = (*args, held)
        self.logger.warning(msg, *args)
        return True
