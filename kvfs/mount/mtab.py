"""The kernel's side of a mount: is a directory mounted (``/proc/mounts``), and the read-ahead
of its backing device (``/sys/class/bdi``)."""

from __future__ import annotations

import os

__all__ = ["is_mounted", "set_read_ahead", "unescape"]


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


def set_read_ahead(mountpoint: str, nbytes: int, *, mountinfo: str = "/proc/self/mountinfo",
                   bdi: str = "/sys/class/bdi") -> str | None:
    """Set the read-ahead of the filesystem mounted at ``mountpoint`` to ``nbytes`` (its
    backing device's ``read_ahead_kb``); None when done, else why not (not permitted, say).

    It reads the device number from ``mountinfo``, so the mount itself is never touched
    (a FUSE mount asking itself would wait on its own answer)."""
    target = os.path.abspath(mountpoint)
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        return f"cannot read {mountinfo}: {exc}"
    dev = None
    for line in lines:
        parts = line.split()
        if len(parts) >= 5 and unescape(parts[4]) == target:
            dev = parts[2]  # the last mount on top wins
    if dev is None:
        return f"{target} is not in {mountinfo}"
    path = os.path.join(bdi, dev, "read_ahead_kb")
    try:
        with open(path, "w") as f:
            f.write(str(max(0, nbytes) // 1024))
    except OSError as exc:
        return f"cannot write {path}: {exc}"
    return None
