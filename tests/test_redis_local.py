"""`LocalRedisCluster`'s nodes die with the process that started them, even a node that
refuses SIGTERM (a Redis replica writing its first append-only file does:
"Writing initial AOF, can't exit")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import alive

# a parent that starts a node the way LocalRedisCluster does (its preexec_fn) and prints its
# pid; the "node" ignores SIGTERM, as Redis does while it writes its first append-only file
PARENT = textwrap.dedent("""
    import subprocess, sys
    from kvfs.meta.redis_local import _pdeathsig
    node = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, preexec_fn=_pdeathsig)
    assert node.stdout is not None and node.stdout.readline() == b"ready\\n"
    print(node.pid, flush=True)
    node.wait()
""")




@pytest.mark.subprocess
def test_a_node_that_refuses_sigterm_dies_with_its_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    node = int(parent.stdout.readline())
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while alive(node) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(node), "the node outlived its parent (an orphan holding its port)"
    finally:
        parent.stdout.close()
        if alive(node):
            os.kill(node, signal.SIGKILL)
