"""Files read back into the page cache before a test asks about cached pages.

Just-written pages are usually still cached, but a loaded machine (CI) may have pushed them
out, and a test that counts reads answered from the page cache would then fail for that
alone (stop 35's CI: tests/test_sendfile.py).  Reading a file brings its pages back."""

from __future__ import annotations

import os
from pathlib import Path


def warm(*paths: str | Path) -> None:
    """Each file read whole (its pages in the page cache afterwards); a missing one skipped."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            while os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)
