"""The FUSE mount as a test fixture: ``python -m kvfs mount`` as a child process, shared by
tests/test_fuse.py, tests/test_tls.py and tests/engines/test_mount_backends.py.

The mount runs under ``KVFS_MOUNT_PYTHON`` when set (default: this interpreter): the engine
venvs hold no pyfuse3, so their tests mount with a Python that has it, as an operator's
engine host would run ``kvfs mount`` apart from the engine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

import pytest

from kvfs.mount import is_mounted

if TYPE_CHECKING:
    from conftest import ThreadCluster

    from kvfs.launcher import ProcessCluster

def _skip_reason() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing: this kernel or container has no FUSE"
    if os.geteuid() != 0:
        return "FUSE mount tests run as root (they mount and unmount)"
    return None


needs_fuse = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``pred`` until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


class Mount:
    """``python -m kvfs mount`` as a child process; ``cleanup()`` always leaves nothing mounted."""

    def __init__(self, mnt: Path, cluster: ThreadCluster | ProcessCluster, logs: Path,
                 *args: str) -> None:
        self.mnt = mnt
        mnt.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        self.err_path = logs / f"mount-{mnt.name}.err"
        self._out: IO[bytes] = open(logs / f"mount-{mnt.name}.out", "wb")  # noqa: SIM115
        self._err: IO[bytes] = open(self.err_path, "wb")  # noqa: SIM115
        env = {**os.environ, "KVFS_TOKEN": cluster.token}
        self.proc = subprocess.Popen(
            [os.environ.get("KVFS_MOUNT_PYTHON", sys.executable), "-m", "kvfs", "mount", str(mnt),
             "--addr", cluster.addr,
             "--timeout", "3s", *args], stdout=self._out, stderr=self._err, env=env)
        try:
            wait_until(lambda: is_mounted(str(mnt)) or self.proc.poll() is not None, 30, "the mount")
            if not is_mounted(str(mnt)):
                raise AssertionError(f"kvfs mount exited with {self.proc.returncode}: {self.stderr()}")
        except BaseException:
            self.cleanup()
            raise

    def stderr(self) -> str:
        self._err.flush()
        return self.err_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def cleanup(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        finally:
            if is_mounted(str(self.mnt)):
                tool = shutil.which("fusermount3") or shutil.which("fusermount")
                argv = [tool, "-u", "-z", str(self.mnt)] if tool else ["umount", "-l", str(self.mnt)]
                subprocess.run(argv, check=False, capture_output=True, timeout=30)
            self._out.close()
            self._err.close()

