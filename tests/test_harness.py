"""The suite's own guard: the event loop every async test runs on (conftest's
:func:`guarded_loop`) turns a child process left running into an error at close, where plain
uvloop waited for it forever."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from conftest import _running, guarded_loop

from kvfs.launcher import ServiceProcess

SLEEPER = [sys.executable, "-c", "import time; print(' ready sleeper', flush=True); time.sleep(600)"]


def test_a_child_left_running_is_killed_and_named_at_close() -> None:
    loop = guarded_loop()
    svc = ServiceProcess("sleeper", SLEEPER, dict(os.environ))
    loop.run_until_complete(svc.start())
    assert _running(svc.pid)
    with pytest.raises(RuntimeError, match=rf"left child processes running .*pid {svc.pid} \("):
        loop.close()  # plain uvloop: blocked here until the child's sleep(600) ended
    assert not _running(svc.pid)


def test_a_child_that_exited_unawaited_is_no_error() -> None:
    loop = guarded_loop()
    svc = ServiceProcess("sleeper", SLEEPER, dict(os.environ))
    loop.run_until_complete(svc.start())
    os.kill(svc.pid, signal.SIGKILL)  # not awaited: the loop has not seen it exit
    deadline = time.monotonic() + 30
    while _running(svc.pid):
        assert time.monotonic() < deadline, "the killed child never exited"
        time.sleep(0.01)
    loop.close()
