"""`LocalRedisCluster`'s nodes die with the process that started them, even a node that
refuses SIGTERM (a Redis replica writing its first append-only file does:
"Writing initial AOF, can't exit")."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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


@pytest.mark.subprocess
def test_a_port_another_redis_answers_on_is_never_taken_for_a_new_nodes(tmp_path: Path) -> None:
    """A node started on a port another Redis already serves exits, but that other server
    answers PING meanwhile: it must not be taken for the new node (a cluster made with it
    failed "node is not empty", a default run's flake). Every port of the range is the
    stranger's, so the start fails naming the tries, and the stranger is left as it was."""
    from kvfs.errors import Unavailable
    from kvfs.meta.redis_local import REDIS_SERVER, LocalRedisCluster, _command

    with socket.socket() as s:  # a free port for the stranger
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stranger = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while _command(port, b"PING") != b"+PONG":
            assert time.monotonic() < deadline and stranger.poll() is None
            time.sleep(0.02)
        rc = LocalRedisCluster(tmp_path / "c", port_range=(port, port + 1), start_tries=3)
        with pytest.raises(Unavailable, match=r"would not start .* after 3 ports"):
            rc.start()
        assert rc.nodes == [] and stranger.poll() is None
        assert b"cluster_enabled:0" in (_command(port, b"INFO", b"cluster") or b"")
    finally:
        stranger.kill()
        stranger.wait()
