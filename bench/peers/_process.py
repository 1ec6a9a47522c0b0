"""A peer's server processes: stopping one, and the TCP ports one listens on (Linux ``/proc``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Final

_TCP_TABLES: Final = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN: Final = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


async def wait_or_kill(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Give ``proc`` ``timeout_s`` to exit (it was asked to); then SIGKILL it and reap it."""
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def _tcp_sockets() -> list[tuple[int, str, int]]:
    """Every TCP socket of this network namespace: (local port, state, inode)."""
    out = []
    for table in _TCP_TABLES:
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split()
                if len(fields) < 10:
                    continue
                out.append((int(fields[1].rpartition(":")[2], 16), fields[3], int(fields[9])))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                link = os.readlink(f"{fd_dir}/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
    return inodes


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` itself listens on (not whoever else holds them)."""
    mine = _socket_inodes(pid)
    return {port for port, state, inode in _tcp_sockets() if state == _LISTEN and inode in mine}


def ports_in_use() -> set[int]:
    """Local ports of every TCP socket here, in any state (a socket on a port can fail a bind to it)."""
    return {port for port, _, _ in _tcp_sockets()}
