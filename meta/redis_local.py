"""A local Redis Cluster from ``redis-server`` processes, for tests and for trying the Redis
meta store on one machine (``kvfs up --meta-store redis-cluster`` runs one, through
``python -m kvfs.meta.redis_local DIR --persistent``).

:class:`LocalRedisCluster` starts N masters (and R replicas per master) on 127.0.0.1,
each in its own folder of a data dir, joins them with ``redis-cli --cluster create``,
waits with a deadline until every node reports ``cluster_state:ok`` and agrees on the
slot map, and stops only the processes it started (by pid).

Redis cannot listen on port 0 in cluster mode (a node announces its port to the
others), so each node is started on a random port of ``port_range`` (and its cluster
bus on ``port + bus_offset``); a node that fails to bind is started again on another
port, up to ``start_tries`` times.  Nothing is picked, released and hoped for.

``persistent``: every node keeps an append-only file (``appendfsync everysec``) and its
``nodes.conf``, and ``DIR/cluster.json`` records the ports; starting again on that
directory restarts the same nodes on the same ports, which rejoin as the cluster they
were, with their keys (a node lost at most its last second of writes).  A node that
exits is started again the same way (:meth:`LocalRedisCluster.restart_dead`; the
command line does this, with a backoff).  ``die_with_parent``: each ``redis-server``
is killed when the process that started it dies (``PR_SET_PDEATHSIG``; only for a
cluster started from the main thread, as the command line does).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfs.errors import Unavailable

log = logging.getLogger("kvfs.meta.redis")

REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"


@dataclass
class RedisNode:
    port: int
    dir: Path
    proc: subprocess.Popen[bytes]

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class LocalRedisCluster:
    """``masters`` masters with ``replicas`` replicas each, under ``data``.

    ``start()`` returns once the cluster serves every slot; ``stop()`` ends the nodes it
    started.  ``kill(node)`` (SIGKILL) is for failover tests."""

    data: Path
    masters: int = 3
    replicas: int = 0
    port_range: tuple[int, int] = (20000, 40000)
    bus_offset: int = 10000
    start_tries: int = 20
    ready_timeout_s: float = 30.0
    maxmemory: str | None = None
    persistent: bool = False
    die_with_parent: bool = False
    nodes: list[RedisNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis-cluster://h:p,h:p,...``: the store address meta takes."""
        return "redis-cluster://" + ",".join(n.addr for n in self.nodes)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.nodes]

    # lifecycle ------------------------------------------------------------------------
    def start(self) -> LocalRedisCluster:
        if self.masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {self.masters}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        for exe in (REDIS_SERVER, REDIS_CLI):
            if shutil.which(exe) is None:
                raise Unavailable(f"{exe} is not installed (Debian: apt-get install redis-server)")
        self.data.mkdir(parents=True, exist_ok=True)
        saved = self._saved_ports()
        try:
            if saved is not None:  # the same nodes again: they rejoin by their nodes.conf
                for i, port in enumerate(saved):
                    self.nodes.append(self._start_node(self.data / f"node{i}", port))
            else:
                for i in range(self.masters * (1 + self.replicas)):
                    self.nodes.append(self._start_node(self.data / f"node{i}"))
                self._create()
                if self.persistent:
                    (self.data / "cluster.json").write_text(json.dumps(
                        {"masters": self.masters, "replicas": self.replicas,
                         "ports": [n.port for n in self.nodes]}))
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _saved_ports(self) -> list[int] | None:
        """The ports of a persistent cluster made earlier in ``data`` (None: make one)."""
        path = self.data / "cluster.json"
        if not self.persistent or not path.exists():
            return None
        saved = json.loads(path.read_text())
        if (saved["masters"], saved["replicas"]) != (self.masters, self.replicas):
            raise ValueError(f"{self.data} holds a Redis Cluster of {saved['masters']} masters with "
                             f"{saved['replicas']} replicas each, not {self.masters} with "
                             f"{self.replicas}: start it as it was made, or use another directory")
        return [int(p) for p in saved["ports"]]

    def restart_dead(self) -> list[RedisNode]:
        """Start every node that exited again, on its port and folder (its append-only file
        and nodes.conf: a persistent node comes back with its keys and its place in the
        cluster); returns the restarted ones."""
        out = []
        for i, n in enumerate(self.nodes):
            if n.proc.poll() is not None:
                self.nodes[i] = self._start_node(n.dir, n.port)
                out.append(self.nodes[i])
        return out

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for n in self.nodes:
            try:
                n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait()
        self.nodes.clear()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill(self, node: RedisNode) -> None:
        """SIGKILL one node (its replica, if any, takes over after cluster-node-timeout)."""
        node.proc.kill()
        node.proc.wait()

    # internals --------------------------------------------------------------------------
    def _start_node(self, d: Path, fixed_port: int | None = None) -> RedisNode:
        """A node in ``d``: on a random free port (a fresh node), or on ``fixed_port``
        (a node started again: tried until ``ready_timeout_s``, since the one before may
        still be shutting down)."""
        d.mkdir(parents=True, exist_ok=True)
        lo, hi = self.port_range
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        last = ""
        deadline = time.monotonic() + self.ready_timeout_s
        tries = 0

        def again() -> bool:
            if fixed_port is None:
                return tries < self.start_tries
            return tries == 0 or time.monotonic() < deadline

        while again():
            tries += 1
            if fixed_port is not None:
                port = fixed_port
                if tries > 1:
                    time.sleep(0.2)  # the port's previous owner is still closing it
            else:
                port = rng.randrange(lo, hi)
                for f in ("nodes.conf", "redis.log", "appendonlydir"):
                    with contextlib.suppress(FileNotFoundError):
                        if (d / f).is_dir():
                            shutil.rmtree(d / f)
                        else:
                            (d / f).unlink()
            args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-port", str(port + self.bus_offset),
                    "--cluster-node-timeout", "2000", "--dir", str(d), "--logfile", "redis.log",
                    "--save", "", "--daemonize", "no",
                    *(("--appendonly", "yes", "--appendfsync", "everysec") if self.persistent
                      else ("--appendonly", "no")),
                    "--repl-diskless-sync-delay", "0",
                    "--protected-mode", "no"]
            if self.maxmemory:
                args += ["--maxmemory", self.maxmemory]
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL,
                                    preexec_fn=_pdeathsig if self.die_with_parent else None)
            node = RedisNode(port, d, proc)
            if self._wait_listening(node):
                return node
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            last = _tail(d / "redis.log")
        where = f"on port {fixed_port}" if fixed_port is not None else f"after {self.start_tries} ports"
        raise Unavailable(f"redis-server would not start in {d} {where}: {last}")

    def _wait_listening(self, node: RedisNode) -> bool:
        """True once the node answers PING; False if it exited, or if the server answering on
        its port is another process (the port was in use: this one is about to exit on it,
        and a cluster made with the other would find it "not empty")."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                return False
            if _command(node.port, b"PING") in (b"+PONG", b"-LOADING Redis is loading the dataset in memory"):
                # listening (a persistent node may still be reading its file): but whose?
                info = _command(node.port, b"INFO", b"server") or b""
                return b"process_id:%d\r\n" % node.proc.pid in info
            time.sleep(0.02)
        raise Unavailable(f"redis-server on port {node.port} did not answer within "
                          f"{self.ready_timeout_s} s: {_tail(node.dir / 'redis.log')}")

    def _create(self) -> None:
        args = [REDIS_CLI, "--cluster", "create", *(n.addr for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        r = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=self.ready_timeout_s)
        if r.returncode != 0:
            raise Unavailable(f"redis-cli --cluster create failed ({r.returncode}): "
                              f"{(r.stdout + r.stderr).decode(errors='replace')[-2000:]}")

    def wait_ok(self, timeout_s: float | None = None) -> None:
        """Wait until every running node says ``cluster_state:ok`` and knows every node, and
        every replica has synced with its master (a replica that never synced cannot
        take over)."""
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        want = sum(1 for n in self.nodes if n.proc.poll() is None)
        info: dict[int, bytes] = {}
        while time.monotonic() < deadline:
            info = {n.port: _command(n.port, b"CLUSTER", b"INFO") or b""
                    for n in self.nodes if n.proc.poll() is None}
            if all(b"cluster_state:ok" in v and b"cluster_slots_assigned:16384" in v
                   and _field(v, b"cluster_known_nodes") >= want for v in info.values()):
                repl = [_command(n.port, b"INFO", b"replication") or b""
                        for n in self.nodes if n.proc.poll() is None]
                if all(b"role:master" in r or b"master_link_status:up" in r for r in repl):
                    return
            time.sleep(0.05)
        raise Unavailable(f"redis cluster not ok within the deadline: {info}")


def _pdeathsig() -> None:
    """In the forked child, before exec: SIGKILL when the parent dies (kept across exec).

    Not SIGTERM: a replica writing its first append-only file after a full sync refuses a
    SIGTERM ("Writing initial AOF, can't exit") and goes on running, an orphan holding its
    port, so the node could not be started again (seen in test_up's Redis Cluster test, 1
    run in 3).  A kill loses nothing a node answered: it writes its append-only file before
    it replies; :meth:`LocalRedisCluster.stop` still stops nodes with SIGTERM first."""
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _field(info: bytes, name: bytes) -> int:
    for line in info.splitlines():
        if line.startswith(name + b":"):
            return int(line.split(b":", 1)[1])
    return -1


def _command(port: int, *args: bytes) -> bytes | None:
    """One RESP command on a fresh socket (no client library needed to watch startup);
    the reply's first line for simple replies, the bulk body for bulk replies."""
    req = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
            s.sendall(req)
            buf = b""
            while b"\r\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    return None
                buf += chunk
            head, _, rest = buf.partition(b"\r\n")
            if not head.startswith(b"$"):
                return head
            n = int(head[1:])
            while len(rest) < n:
                chunk = s.recv(65536)
                if not chunk:
                    return None
                rest += chunk
            return rest[:n]
    except OSError:
        return None


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def supervise(rc: LocalRedisCluster, stopped: Callable[[], bool], report: Callable[[str], None], *,
              poll_s: float = 0.2, backoff_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
    """Until ``stopped()``: start each node that exits again (:meth:`restart_dead`), after
    a backoff that doubles while restarts keep failing."""
    delay = backoff_s
    while not stopped():
        time.sleep(poll_s)
        dead = [n for n in rc.nodes if n.proc.poll() is not None]
        if not dead or stopped():
            continue
        for n in dead:
            report(f"redis-server on port {n.port} (pid {n.proc.pid}) exited with {n.proc.returncode}; "
                   f"starting it again")
        try:
            for n in rc.restart_dead():
                report(f"redis-server on port {n.port} started again (pid {n.proc.pid})")
            delay = backoff_s
        except Unavailable as exc:
            report(f"restart failed: {exc}; next try in {delay:g} s")
            end = time.monotonic() + delay
            while time.monotonic() < end and not stopped():
                time.sleep(poll_s)
            delay = min(backoff_max_s, delay * 2)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfs.meta.redis_local DIR``: a local cluster until SIGINT/SIGTERM."""
    import argparse

    from kvfs._parent import die_with_parent

    die_with_parent()  # started by `kvfs up`: stop (and so stop the nodes) when it dies
    ap = argparse.ArgumentParser(prog="python -m kvfs.meta.redis_local",
                                 description="run a local Redis Cluster (redis-server from apt) "
                                 "until interrupted; prints 'redis cluster ready URL'; restarts "
                                 "a node that exits; the nodes die with it")
    ap.add_argument("dir", type=Path, help="data directory (one folder per node)")
    ap.add_argument("--masters", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=0, help="replicas per master")
    ap.add_argument("--persistent", action="store_true",
                    help="append-only files, and the same nodes on the same ports when started "
                    "again on DIR (what kvfs up uses)")
    ap.add_argument("--maxmemory", default=None,
                    help="each node's maxmemory (bytes, or 4gb); writes fail once a master is full")
    a = ap.parse_args(argv)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    def report(msg: str) -> None:
        print(f"redis_local: {msg}", file=sys.stderr, flush=True)

    with LocalRedisCluster(a.dir, masters=a.masters, replicas=a.replicas, persistent=a.persistent,
                           maxmemory=a.maxmemory, die_with_parent=True) as rc:
        print(f"redis cluster ready {rc.url}", flush=True)
        supervise(rc, lambda: stop, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
