"""The mount table: is a directory mounted (``/proc/mounts``)?"""

from __future__ import annotations

import os

__all__ = ["is_mounted", "unescape"]


def unescape(field: str) -> str:
    """/proc/mounts escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        octal = field[i + 1 : i + 4]
        if field[i] == "\\" and len(octal) == 3 and octal.isdigit():
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def is_mounted(mountpoint: str, *, fstype: str | None = None, mounts: str = "/proc/mounts") -> bool:
    """Whether ``mountpoint`` is in the mount table (optionally with that filesystem type)."""
    target = os.path.abspath(mountpoint)
    try:
        with open(mounts) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and unescape(parts[1]) == target and (fstype is None or parts[2] == fstype):
            return True
    return False
