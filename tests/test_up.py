"""`kvfs up` as a supervisor, with real processes: children die with it, a dead child is
reported and restarted, a data dir in use is refused, bad arguments stop it before it starts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import alive, first_line

from kvfs.cli import build_parser
from kvfs.config import ChunkServerConfig, FsyncMode, MetaConfig

DEADLINE_S = 60.0


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)




@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    stderr_path: Path
    env: dict[str, str]

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def children(self) -> dict[str, int]:
        """``{"meta": pid, "chunkserver 0": pid, ...}`` from the line `kvfs up` prints once ready."""
        line = next(ln for ln in self.stderr().splitlines() if "Ctrl-C stops all" in ln)
        inner = re.search(r"\(meta .*?\)\.", line)
        assert inner, line
        return {m[1]: int(m[2]) for m in re.finditer(r"([a-z]+(?: \d+)?) (\d+)", inner[0])}


def start_up(tmp_path: Path, data: Path, *args: str, deadline_s: float = DEADLINE_S) -> Up:
    """`kvfs up` on ``data``, once it has printed its address and said it is ready."""
    env = {**os.environ, "KVFS_CONFIG_DIR": str(tmp_path / "config")}
    env.pop("KVFS_TOKEN", None)
    err = tmp_path / f"up-{time.monotonic_ns()}.err"
    with err.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvfs", "up", "--data", str(data),
                                 "--listen", "127.0.0.1:0", *args],
                                env=env, stdout=subprocess.PIPE, stderr=f)
    up = Up(proc, err, env)
    addr = first_line(proc, "address from `kvfs up`", deadline_s, up.stderr).strip()
    assert addr.startswith("kvfs://"), up.stderr()
    up.env["KVFS_ADDR"] = addr
    wait_for(lambda: "Ctrl-C stops all" in up.stderr(), "the ready line")
    return up


@pytest.fixture
def ups(tmp_path: Path) -> Iterator[list[Up]]:
    started: list[Up] = []
    try:
        yield started
    finally:
        for up in started:
            pids = up.children().values() if "Ctrl-C" in up.stderr() else []
            if up.proc.poll() is None:
                up.proc.send_signal(signal.SIGTERM)
                try:
                    up.proc.wait(30)
                except subprocess.TimeoutExpired:
                    up.proc.kill()
                    up.proc.wait()
            for pid in pids:  # never leave a service behind, even when a test failed
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            assert up.proc.stdout is not None
            up.proc.stdout.close()


def kvfs(up: Up, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "kvfs", *args], env=up.env, input=stdin,
                          capture_output=True, timeout=60)


def test_a_start_up_that_never_prints_its_address_fails_at_its_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault: a `kvfs up` that hangs before its address.  start_up fails at its own
    deadline naming what it waited for, and kills it (it once waited on the pipe until
    pytest's timeout stopped the whole test)."""
    hung = tmp_path / "hung-python"
    hung.write_text(f"#!{sys.executable}\nimport time\n"
                    "time.sleep(60)  # the fault: never an address (gone by itself if left)\n")
    hung.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(hung))
    with pytest.raises(AssertionError, match=r"no address from `kvfs up` within 0.5s") as err:
        start_up(tmp_path, tmp_path / "data", deadline_s=0.5)
    pid = int(re.search(r"pid (\d+), killed now", str(err.value))[1])  # type: ignore[index]
    assert not alive(pid)


@pytest.mark.subprocess
def test_killed_chunkserver_is_reported_and_restarted(tmp_path: Path, ups: list[Up]) -> None:
    up = start_up(tmp_path, tmp_path / "data", "--chunkservers", "2", "--no-gc")
    ups.append(up)
    assert kvfs(up, "put", "k", "-", stdin=b"v" * 3_000_000).returncode == 0
    victim = up.children()["chunkserver 1"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: "chunkserver 1 restarted" in up.stderr(), "the restart")
    err = up.stderr()
    assert f"chunkserver 1 (pid {victim}) killed by SIGKILL; restarting in" in err
    new_pid = int(re.search(r"chunkserver 1 restarted \(pid (\d+)\)", err)[1])  # type: ignore[index]
    assert new_pid != victim and alive(new_pid) and not alive(victim)
    # the same data dir: the value written before the kill reads back
    wait_for(lambda: kvfs(up, "get", "k").stdout == b"v" * 3_000_000, "the value after restart")


@pytest.mark.subprocess
def test_no_restart_only_reports(tmp_path: Path, ups: list[Up]) -> None:
    up = start_up(tmp_path, tmp_path / "data", "--chunkservers", "1", "--no-gc", "--no-restart")
    ups.append(up)
    victim = up.children()["chunkserver 0"]
    os.kill(victim, signal.SIGTERM)
    wait_for(lambda: "not restarted" in up.stderr(), "the report")
    assert f"chunkserver 0 (pid {victim}) exited with status 0; not restarted (--no-restart)" \
        in up.stderr()
    assert up.proc.poll() is None  # the rest keeps running


@pytest.mark.subprocess
def test_kill_9_of_up_leaves_no_child(tmp_path: Path, ups: list[Up]) -> None:
    up = start_up(tmp_path, tmp_path / "data", "--chunkservers", "2")
    ups.append(up)
    pids = up.children()
    assert set(pids) == {"meta", "chunkserver 0", "chunkserver 1", "gc"}
    assert all(alive(p) for p in pids.values())
    up.proc.kill()
    up.proc.wait()
    wait_for(lambda: not any(alive(p) for p in pids.values()), "the children to exit")
    # the lock died with it: a new `kvfs up` on the same dir starts
    again = start_up(tmp_path, tmp_path / "data", "--chunkservers", "2")
    ups.append(again)
    assert again.proc.poll() is None


@pytest.mark.subprocess
def test_sighup_stops_everything(tmp_path: Path, ups: list[Up]) -> None:
    up = start_up(tmp_path, tmp_path / "data", "--chunkservers", "1")
    ups.append(up)
    pids = up.children()
    up.proc.send_signal(signal.SIGHUP)  # the terminal closed
    assert up.proc.wait(30) == 0
    assert not any(alive(p) for p in pids.values())


@pytest.mark.subprocess
def test_second_up_on_same_dir_is_refused_with_pid(tmp_path: Path, ups: list[Up]) -> None:
    up = start_up(tmp_path, tmp_path / "data", "--chunkservers", "1", "--no-gc")
    ups.append(up)
    r = subprocess.run([sys.executable, "-m", "kvfs", "up", "--data", str(tmp_path / "data"),
                        "--listen", "127.0.0.1:0"], env=up.env, capture_output=True, timeout=60)
    assert r.returncode == 1
    assert f"is in use by another kvfs up (pid {up.proc.pid})" in r.stderr.decode()
    assert len(r.stderr.decode().splitlines()) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--capacity", "lots"], "argument --capacity: not a size: 'lots'"),
    (["--chunkservers", "0"], "argument --chunkservers: must be at least 1, got 0"),
    (["--chunkservers", "many"], "argument --chunkservers: not a whole number: 'many'"),
    (["--default-ttl", "soon"], "argument --default-ttl: not a duration: 'soon'"),
    (["--listen", "nowhere"], "bad listen address 'nowhere'"),
    (["--fsync", "sometimes"], "argument --fsync: must be one of always, batch, never, got 'sometimes'"),
])
def test_up_checks_every_argument_before_starting(tmp_path: Path, args: list[str],
                                                   message: str) -> None:
    data = tmp_path / "data"
    r = subprocess.run([sys.executable, "-m", "kvfs", "up", "--data", str(data), *args],
                       capture_output=True, timeout=60)
    err = r.stderr.decode()
    assert r.returncode != 0 and message in err, err
    assert "parse_" not in err and "usage:" not in err.replace("usage: kvfs up", "", 1)
    assert not data.exists()  # nothing was started


@pytest.mark.subprocess
def test_up_fsync_reaches_meta_and_every_chunkserver(tmp_path: Path, ups: list[Up]) -> None:
    up = start_up(tmp_path, tmp_path / "data", "--chunkservers", "2", "--no-gc", "--fsync", "never")
    ups.append(up)
    pids = up.children()
    assert set(pids) == {"meta", "chunkserver 0", "chunkserver 1"}
    for name, pid in pids.items():  # each child's own command line, as the kernel holds it
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv.count(b"--fsync") == 1, (name, argv)
        assert argv[argv.index(b"--fsync") + 1] == b"never", (name, argv)
    assert kvfs(up, "put", "k", "-", stdin=b"v" * 1000).returncode == 0


@pytest.mark.subprocess
def test_up_keeps_the_store_a_data_dir_holds_and_gives_a_new_one_rocksdb(tmp_path: Path, ups: list[Up]) -> None:
    """``--meta-store auto`` (the default): a data dir made with SQLite (an earlier kvfs's
    default) goes on with SQLite, its keys read back; a new one gets RocksDB.  The kind is
    printed and given to meta (its ``--store``)."""
    old = start_up(tmp_path, tmp_path / "old", "--chunkservers", "1", "--no-gc", "--meta-store", "sqlite")
    ups.append(old)
    assert kvfs(old, "put", "k", "-", stdin=b"v" * 1000).returncode == 0
    old.proc.send_signal(signal.SIGTERM)
    assert old.proc.wait(30) == 0
    for data, kind, name in ((tmp_path / "old", b"sqlite", "SQLite"), (tmp_path / "new", b"rocksdb", "RocksDB")):
        up = start_up(tmp_path, data, "--chunkservers", "1", "--no-gc")
        ups.append(up)
        assert f", meta on {name}, data in " in up.stderr()
        argv = Path(f"/proc/{up.children()['meta']}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--store") + 1] == kind, argv
    assert kvfs(ups[1], "get", "k").stdout == b"v" * 1000
    assert not (tmp_path / "old" / "meta" / "meta.rocksdb").exists()


@pytest.mark.subprocess
def test_up_gc_options_reach_the_gc_daemon(tmp_path: Path, ups: list[Up]) -> None:
    up = start_up(tmp_path, tmp_path / "data", "--chunkservers", "1", "--gc-interval", "2s",
                  "--gc-scrub-rate", "0")
    ups.append(up)
    argv = Path(f"/proc/{up.children()['gc']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--interval") + 1] == b"2.0", argv
    assert argv[argv.index(b"--scrub-rate") + 1] == b"0", argv


def test_up_fsync_defaults_to_the_servers_default() -> None:
    assert build_parser().parse_args(["up"]).fsync is FsyncMode.BATCH
    assert ChunkServerConfig.fsync is MetaConfig.fsync is FsyncMode.BATCH


def test_up_help_shows_chunkservers_default() -> None:
    r = subprocess.run([sys.executable, "-m", "kvfs", "up", "--help"], capture_output=True,
                       timeout=60)
    out = " ".join(r.stdout.decode().split())
    assert "--chunkservers CHUNKSERVERS number of chunkserver processes (default: 3)" in out


def redis_nodes(redis_pid: int) -> list[int]:
    """The redis-server processes of `kvfs up`'s Redis child (its children)."""
    path = Path(f"/proc/{redis_pid}/task/{redis_pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def master_pid(nodes: list[int]) -> int:
    for pid in nodes:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().decode()  # "redis-server 127.0.0.1:PORT [cluster]"
        port = re.search(r"127\.0\.0\.1:(\d+)", title)[1]  # type: ignore[index]
        r = subprocess.run(["redis-cli", "-p", port, "role"], capture_output=True, timeout=10)
        if r.stdout.startswith(b"master"):
            return pid
    raise AssertionError(f"no master among {nodes}")


@pytest.mark.redis
@pytest.mark.subprocess
def test_up_with_meta_on_redis_cluster_supervises_it(tmp_path: Path, ups: list[Up]) -> None:
    """`kvfs up --meta-store redis-cluster --redis-replicas`: 3 masters + 3 replicas under
    DATA/redis; a killed master is started again, a killed Redis child is restarted (its
    nodes died with it) on the same ports with its keys, stopping leaves no redis-server, and
    a second `kvfs up` on the data dir finds the keys."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    data = tmp_path / "data"
    up = start_up(tmp_path, data, "--chunkservers", "1", "--no-gc", "--meta-store", "redis-cluster",
                  "--redis-replicas")
    ups.append(up)
    assert "meta on a 3+3-node Redis Cluster redis-cluster://127.0.0.1:" in up.stderr()
    assert kvfs(up, "put", "k", "-", stdin=b"v" * 100_000).returncode == 0
    nodes = redis_nodes(up.children()["redis"])
    assert len(nodes) == 6
    victim = master_pid(nodes)
    os.kill(victim, signal.SIGKILL)  # its replica takes over; the node is started again
    wait_for(lambda: len([p for p in redis_nodes(up.children()["redis"]) if p != victim]) == 6,
             "the killed node to be started again")
    wait_for(lambda: kvfs(up, "get", "k").stdout == b"v" * 100_000, "the value after a failover")

    redis = up.children()["redis"]
    nodes = redis_nodes(redis)
    os.kill(redis, signal.SIGKILL)  # its nodes die with it; kvfs up starts it again
    wait_for(lambda: "redis restarted" in up.stderr(), "the Redis child's restart")
    assert f"redis (pid {redis}) killed by SIGKILL; restarting in" in up.stderr()
    wait_for(lambda: not any(alive(p) for p in nodes), "the old nodes to die with their parent")
    wait_for(lambda: kvfs(up, "get", "k").stdout == b"v" * 100_000, "the value after the restart")
    assert kvfs(up, "put", "k2", "-", stdin=b"w" * 1000).returncode == 0

    new = int(re.search(r"redis restarted \(pid (\d+)\)", up.stderr())[1])  # type: ignore[index]
    nodes = redis_nodes(new)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0
    assert nodes and not any(alive(p) for p in nodes)  # stopped with it, cleanly

    again = start_up(tmp_path, data, "--chunkservers", "1", "--no-gc", "--meta-store",
                     "redis-cluster", "--redis-replicas")
    ups.append(again)
    wait_for(lambda: kvfs(again, "get", "k2").stdout == b"w" * 1000, "the keys after kvfs up again")
    assert kvfs(again, "get", "k").stdout == b"v" * 100_000
    # the same nodes must be started: another shape is refused, naming what the dir holds
    r = subprocess.run([sys.executable, "-m", "kvfs.meta.redis_local", str(data / "redis"),
                        "--persistent"], capture_output=True, timeout=60)
    assert r.returncode != 0 and b"3 masters with 1 replicas each, not 3 with 0" in r.stderr


def test_up_redis_options_need_the_redis_store(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvfs", "up", "--data", str(tmp_path / "d"),
                        "--redis-replicas"], capture_output=True, timeout=60)
    assert r.returncode == 1
    assert b"--redis-replicas and --redis-maxmemory need --meta-store redis-cluster" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvfs", "up", "--data", str(tmp_path / "d"),
                        "--meta-store", "etcd"], capture_output=True, timeout=60)
    assert r.returncode == 1 and b"--meta-store must be auto, rocksdb, sqlite or redis-cluster, got 'etcd'" in r.stderr
