"""The CLI as a new user runs it: `kvfs up` in the background, then put/get/ls/stat/rm."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import first_line


def kvfs(*args: str, env: dict[str, str], stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "kvfs", *args], env=env, input=stdin,
                          capture_output=True, timeout=60)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[str, dict[str, str], subprocess.Popen[bytes]]]:
    env = {**os.environ, "KVFS_CONFIG_DIR": str(tmp_path / "config")}
    env.pop("KVFS_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfs", "up", "--data", str(tmp_path / "data"), "--chunkservers", "3",
         "--listen", "127.0.0.1:0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        # the launcher prints it once all are ready
        addr = first_line(proc, "address from `kvfs up`").strip()
        assert addr.startswith("kvfs://127.0.0.1:"), addr
        yield addr, {**env, "KVFS_ADDR": addr}, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.subprocess
def test_up_put_get_ls_stat_rm(up: tuple[str, dict[str, str], subprocess.Popen[bytes]],
                               tmp_path: Path) -> None:
    addr, env, proc = up
    token_file = tmp_path / "config" / "tokens" / f"127.0.0.1_{addr.rsplit(':', 1)[1]}"
    assert token_file.stat().st_mode & 0o777 == 0o600
    data = os.urandom(3 << 20)
    (tmp_path / "file.bin").write_bytes(data)
    r = kvfs("put", "mykey", str(tmp_path / "file.bin"), env=env)
    assert r.returncode == 0, r.stderr
    assert kvfs("put", "other/key", "-", env=env, stdin=b"hello").returncode == 0
    r = kvfs("get", "mykey", env=env)
    assert r.returncode == 0 and r.stdout == data
    r = kvfs("ls", env=env)
    assert r.stdout.decode().split() == ["mykey", "other/key"]
    r = kvfs("ls", "-l", env=env)
    header, *rows = r.stdout.decode().splitlines()
    assert header.split() == ["size", "created", "expires", "extents", "key"]
    assert rows[0].split()[0] == str(len(data)) and rows[0].endswith("mykey")
    # durations take units everywhere
    assert kvfs("put", "ttl/key", "-", "--ttl", "1h", env=env, stdin=b"t").returncode == 0
    r = kvfs("ls", "ttl/", "--json", env=env)
    (info,) = json.loads(r.stdout)
    assert 3590 < info["expires_at"] - info["created"] <= 3600
    r = kvfs("put", "ttl/key", "-", "--ttl", "soon", env=env, stdin=b"t")
    assert r.returncode == 2 and b"argument --ttl: not a duration: 'soon'" in r.stderr
    assert kvfs("rm", "ttl/key", env=env).returncode == 0
    # a reader that went away (`kvfs stat | head -1`): a quiet exit, as with SIGPIPE
    p = subprocess.Popen([sys.executable, "-m", "kvfs", "stat"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    assert p.wait(60) == 141
    assert p.stderr.read() == b""
    p.stderr.close()
    r = kvfs("ls", "other/", "--json", env=env)
    assert [e["key"] for e in json.loads(r.stdout)] == ["other/key"]
    r = kvfs("stat", "--json", env=env)
    st = json.loads(r.stdout)
    assert st["keys"] == 2 and len(st["servers"]) == 3 and st["leases_overflowed"] == 0
    assert st["store"] == "rocksdb" and st["store_bytes"] > 0 and st["store_free"] > 0
    assert st["refusing"] == ""
    out = kvfs("stat", env=env).stdout.decode()
    assert "garbage" in out and "overflow leases: 0" in out
    assert re.search(r"   meta: rocksdb, [\d.]+ [KMG]iB on disk \([\d.]+ [KMGT]iB free there\)\n", out), out
    assert "refuses" not in out
    r = kvfs("get", "nope", env=env)
    assert r.returncode == 1 and b"not found" in r.stderr
    assert kvfs("rm", "mykey", env=env).returncode == 0
    assert kvfs("get", "mykey", env=env).returncode == 1
    # a wrong token is refused with a clear, one-line error
    (tmp_path / "wrong").write_text("wrong\n")
    r = kvfs("get", "other/key", "--token-file", str(tmp_path / "wrong"), env=env)
    assert r.returncode == 1 and b"wrong cluster token" in r.stderr
    # Ctrl-C stops every service cleanly
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    r = kvfs("stat", env=env)
    assert r.returncode == 1 and b"Unavailable" in r.stderr


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    env = {**os.environ, "KVFS_CONFIG_DIR": str(tmp_path)}
    env.pop("KVFS_TOKEN", None)
    r = kvfs("get", "k", "--addr", "kvfs://127.0.0.1:1", env=env)
    assert r.returncode == 1 and b"no token for kvfs://127.0.0.1:1" in r.stderr
    r = kvfs("get", "k", "--addr", "nonsense", env={**env, "KVFS_TOKEN": "t"})
    assert r.returncode == 1 and b"bad address" in r.stderr


def test_version() -> None:
    import kvfs as pkg

    r = kvfs("--version", env=dict(os.environ))
    assert r.returncode == 0 and r.stdout.decode().strip() == f"kvfs {pkg.__version__}"
    assert pkg.__version__.count(".") >= 2


_HEAVY = ("kvfs.bench", "kvfs.commands", "kvfs.gc", "kvfs.mount", "numpy", "pyfuse3")


def _imported(code: str) -> list[str]:
    """Which of ``_HEAVY`` a fresh interpreter running ``code`` imported."""
    code += f"\nimport json; print(json.dumps(sorted(m for m in {_HEAVY!r} if m in sys.modules)), file=sys.__stdout__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


_FUSE = ["pyfuse3"] if importlib.util.find_spec("pyfuse3") is not None else []


@pytest.mark.parametrize(("argv", "imported"), [
    (["chunkserver", "--data", "d"], ["kvfs.commands"]), (["meta", "--data", "d"], ["kvfs.commands"]),
    (["up"], ["kvfs.commands"]), (["put", "k", "f"], ["kvfs.commands"]),
    (["stat"], ["kvfs.commands"]), (["gc", "daemon"], ["kvfs.gc"]),
    (["mount", "m"], ["kvfs.mount", *_FUSE]), (["bench"], ["kvfs.bench", "numpy"])])
def test_a_command_imports_only_its_own_parts(argv: list[str], imported: list[str]) -> None:
    """A command line, parsed and its function imported, brings in only that command's
    parts: the processes ``kvfs up`` starts neither the bench (numpy and its BLAS threads
    in every server) nor the mount (pyfuse3), a mount not the GC or the bench, the bench
    not the mount."""
    code = f"import sys; from kvfs.cli import build_parser, command_of; command_of(build_parser().parse_args({argv!r}))"
    assert _imported(code) == imported


@pytest.mark.parametrize("argv", [["--help"], ["chunkserver", "--help"], ["up", "--help"]])
def test_help_imports_no_command_module(argv: list[str]) -> None:
    """``python -m kvfs --help`` (and a service's) lists every command without importing one."""
    code = ("import os, runpy, sys\n"
            f"sys.argv = ['kvfs', *{argv!r}]\nsys.stdout = open(os.devnull, 'w')\n"
            "try:\n    runpy.run_module('kvfs', run_name='__main__')\n"
            "except SystemExit as exc:\n    assert exc.code == 0, exc.code")
    assert _imported(code) == []


def test_a_command_whose_module_cannot_be_imported_is_a_usage_error() -> None:
    """Without numpy (no bench extra), ``kvfs bench`` says what is missing; the rest work."""
    code = ("import sys; sys.modules['numpy'] = None; from kvfs.cli import main; "
            "sys.exit(main(['bench']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "kvfs bench is not available" in res.stderr, res.stderr
    assert "numpy" in res.stderr


def test_a_broken_kvfs_import_is_raised_not_called_a_missing_extra() -> None:
    """Only a third-party module missing is a usage error; kvfs's own import failing (a
    renamed name, a cycle) is a bug and is raised with its traceback."""
    code = ("import sys; sys.modules['kvfs.bench.cli'] = None; from kvfs.cli import main; "
            "sys.exit(main(['bench']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "ModuleNotFoundError" in res.stderr, res.stderr
    assert "not available" not in res.stderr


def test_help_lists_every_command() -> None:
    usage = subprocess.run([sys.executable, "-m", "kvfs", "--help"], capture_output=True,
                           timeout=60, check=True).stdout.decode()
    for command in ("up", "meta", "chunkserver", "gc", "bench", "mount"):
        assert command in usage, command


def test_a_signal_as_soon_as_a_service_is_ready_stops_it_cleanly() -> None:
    """A launcher may signal a service the moment its ready line is out (``kvfs up`` does
    with --no-restart's children): the handler is in before the line, so the service closes
    and exits 0 instead of dying by SIGTERM's default action."""
    code = """if True:
        import asyncio, os, signal
        from kvfs.commands import _serve

        class Svc:
            async def start(self):
                os.kill(os.getpid(), signal.SIGTERM)  # as soon as start-up ends
                return "127.0.0.1:1"

            async def close(self):
                print("closed", flush=True)

        raise SystemExit(asyncio.run(_serve(Svc(), lambda addr: f"ready {addr}")))
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr.decode())
    assert p.stdout.decode().split() == ["ready", "127.0.0.1:1", "closed"]
