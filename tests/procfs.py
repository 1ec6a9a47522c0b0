"""What this test process holds open and mapped, read from /proc/self (tests/test_store.py,
test_mapped_reads.py: files closed or unmapped when they should be)."""

from __future__ import annotations

import os


def open_paths() -> list[str]:
    """What this process's open file descriptors point at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return out


def mapped_paths() -> set[str]:
    """The files this process has mapped (a deleted one's name ends with " (deleted)")."""
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[-1].strip() for line in f if line.count(" ") >= 5}
