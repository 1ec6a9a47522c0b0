"""Stopping a peer's server process: the one helper the peers share."""

from __future__ import annotations

import asyncio


async def wait_or_kill(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Give ``proc`` ``timeout_s`` to exit (it was asked to); then SIGKILL it and reap it."""
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
