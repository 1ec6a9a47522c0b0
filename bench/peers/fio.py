"""The real ``fio`` binary on a file: the raw-disk row of a comparison."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from ..store import PeerUnavailable

__all__ = ["run_fio_file"]


def run_fio_file(
    bs: int | str,
    size: int | str,
    rw: str,
    runtime_s: float,
    directory: str | os.PathLike[str],
    *,
    name: str | None = None,
    iodepth: int = 1,
    ioengine: str = "psync",
    direct: bool = False,
    ramp_time_s: float = 0.0,
    time_based: bool = True,
    fio: str = "fio",
    extra_args: Sequence[str] = (),
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run the real fio on a file in ``directory``; return its parsed JSON.

    Blocking (call it through ``asyncio.to_thread`` from a loop). The file is
    laid out by fio and removed afterwards (``--unlink=1``). Without
    ``direct=True`` reads come from the page cache, as the other peers' do.
    """
    exe = shutil.which(fio)
    if exe is None:
        raise PeerUnavailable(f"{fio} not installed")
    job = name or f"fio-{rw}-{bs}"
    args = [
        exe,
        f"--name={job}",
        f"--directory={os.fspath(directory)}",
        f"--ioengine={ioengine}",
        f"--bs={bs}",
        f"--size={size}",
        f"--rw={rw}",
        f"--iodepth={iodepth}",
        f"--direct={int(direct)}",
        f"--runtime={max(1, round(runtime_s * 1000))}ms",
        "--unlink=1",
        "--output-format=json",
    ]
    if time_based:
        args.append("--time_based")
    if ramp_time_s > 0:
        args.append(f"--ramp_time={round(ramp_time_s * 1000)}ms")
    args.extend(extra_args)
    limit = timeout_s if timeout_s is not None else runtime_s + ramp_time_s + 120.0
    try:
        # cwd: fio drops ``local-<job>-<n>-verify.state`` files in its working dir
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=limit, check=False, cwd=directory
        )
    except subprocess.TimeoutExpired as e:
        raise PeerUnavailable(f"fio did not finish within {limit:g}s") from e
    start = proc.stdout.find("{")
    if proc.returncode != 0 or start < 0:
        msg = (proc.stderr or proc.stdout).strip()[-500:]
        raise PeerUnavailable(f"fio failed (exit {proc.returncode}): {msg}")
    result: dict[str, Any] = json.loads(proc.stdout[start:])
    return result
