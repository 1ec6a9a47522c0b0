"""The GC's warnings about one chunkserver, logged once a minute per server and message.

A pass meets a full or unreachable chunkserver again on every pass, and meta's MAKE_ROOM
passes on a full cluster run back to back: a 3-minute soak of a full cluster, one server
killed, logged 10,579 such warnings (58 a second).  Now the first is logged, the rest are
held back for :data:`REPEAT_S`, and the next logged says how many were.  `kvfs gc status`
shows each server's state at any time.
"""

from __future__ import annotations

import logging

from kvfs.ratelog import RateLimitedLog

REPEAT_S = 60.0


def server_warnings(logger: logging.Logger) -> RateLimitedLog:
    """``.warning(server_id, msg, *args)`` through ``logger``, rate-limited as above."""
    return RateLimitedLog(logger, REPEAT_S, per_message=True)
