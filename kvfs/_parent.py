"""A service started by `kvfs up` dies with it.

The launcher puts its pid in ``$KVFS_PARENT_PID``; the child asks the kernel
for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux), then
checks the parent did not die before that call took effect. SIGTERM is the
services' normal, clean shutdown.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger("kvfs.parent")

ENV = "KVFS_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """If started by `kvfs up`, get SIGTERM when it dies, however it dies (kill -9 included)."""
    expected = os.environ.pop(ENV, None)  # popped: our own children are not the launcher's
    if expected is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        log.warning("cannot ask to die with the launcher: %s", os.strerror(ctypes.get_errno()))
        return
    if os.getppid() != int(expected):  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
