"""``--cpu``: CPU time of each process of a run, from the processes' own counters.

``/proc/PID/stat`` fields 14 and 15 (utime, stime; every thread of the
process) are read when the measured phase starts and when it ends; the
difference is charged to the keys and bytes the job moved: CPU microseconds
per key, and CPU seconds per GB (10^9 B) for large values. Linux only; on a
system without ``/proc`` the probe reports nothing.  The probe also reads the guest's free
memory (``MemFree``, :func:`mem_free_mib`) at both ends: on this VM a put job's CPU per GB
depends on which free memory it draws on (bench/RESULTS.md, "Issue 11, large puts: ... a kvfs
put job that draws on memory the guest left free a long while"), so every figure says the
memory state it ran in; and how much of it is in blocks too small for the guest to have handed
back to its host (:func:`small_free_mib`): the part a first touch finds cheap there
(bench/RESULTS.md, 2026-12-03, "this guest's first touch").  :func:`run_queue_wait_s` reads how
long a process's threads waited for a CPU while runnable (``schedstat``), for a process
that may be CPU-bound on a shared machine; the probe reads it too, and reports each process's
CPUs used and CPUs waited for (seconds per second of the phase): a pipeline whose processes
wait for a CPU as long as they run is short of CPU (on a shared machine, of its share), one
whose processes neither run nor wait is waiting on something else (bench/RESULTS.md, "Issue
11, large puts: where a 1 MiB x 32 put waits").
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["CpuProbe", "cpu_seconds", "free_text", "machine_cpu_seconds", "mem_free_mib", "run_queue_wait_s",
           "small_free_mib"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds, or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of the whole line


def machine_cpu_seconds() -> float | None:
    """The CPU time every CPU of the machine has spent busy so far (``/proc/stat``'s ``cpu``
    line: user, nice, system, irq and softirq; guest time is in user; not steal, the time a
    hypervisor ran something else), in seconds, or None if it cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        if fields[0] != b"cpu":
            return None
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    except (OSError, IndexError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / _TICK


def mem_free_mib() -> int | None:
    """The machine's free memory (``MemFree`` of ``/proc/meminfo``) in MiB, or None if it cannot
    be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemFree:"):
                    return int(line.split()[1]) // 1024  # kB
    except (OSError, IndexError, ValueError):
        return None
    return None


_REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"
_BUDDYINFO = "/proc/buddyinfo"


def small_free_mib() -> int | None:
    """The machine's free memory (MiB) in blocks smaller than free page reporting hands back to
    a VM's host (``/proc/buddyinfo``, blocks under ``2**page_reporting_order`` pages), or None
    where the kernel has no free page reporting (not built in, or no driver registered, when
    the order reads as the kernel's -1, past every order there is) or it cannot be read.  A
    guest whose balloon reports free pages (``virtio_balloon``) gives its host the larger free
    blocks, and touching them again costs it several times as much (on the guest of
    bench/RESULTS.md about 4x, once these small blocks were used up)."""
    try:
        with open(_REPORTING_ORDER, "rb") as f:
            order = int(f.read())
        pages = 0
        with open(_BUDDYINFO, "rb") as f:
            for line in f:  # b"Node 0, zone   Normal  23397  19116 ...": free blocks per order
                counts = line.split()[4:]
                if order >= len(counts):  # (unregistered: the kernel's -1 as an unsigned int)
                    return None
                pages += sum(int(n) << o for o, n in enumerate(counts[:order]))
    except (OSError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") // (1 << 20)


def free_text() -> str:
    """``21,286 MiB, small blocks 5,758 MiB``: MemFree now, and the part of it in small blocks
    where it is read (``?`` for MemFree unread)."""
    free, small = mem_free_mib(), small_free_mib()
    return ("?" if free is None else f"{free:,} MiB") + ("" if small is None else f", small blocks {small:,} MiB")


def run_queue_wait_s(pid: int) -> float | None:
    """Seconds the threads of ``pid`` have spent runnable but waiting for a CPU (the second
    field of each ``/proc/PID/task/TID/schedstat``, summed), or None if it cannot be read."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    ns = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                ns += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return ns / 1e9


class CpuProbe:
    """Snapshots the CPU time and run-queue wait of named processes; ``report`` charges the CPU
    to keys and bytes, and gives both per second of the measured phase."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self._start: dict[str, tuple[float, float | None]] = {}
        self._end: dict[str, tuple[float, float | None]] = {}
        self._wall = [0.0, 0.0]  # monotonic time at start and at stop
        self._mem: list[int | None] = [None, None]  # MemFree MiB at start and at stop
        self._small: list[int | None] = [None, None]  # small_free_mib at start and at stop

    def _snap(self) -> dict[str, tuple[float, float | None]]:
        out = {}
        for name, pid in self.pids.items():
            t = cpu_seconds(pid)
            if t is not None:
                out[name] = (t, run_queue_wait_s(pid))
        return out

    def start(self) -> None:
        self._mem[0], self._small[0] = mem_free_mib(), small_free_mib()
        self._start = self._snap()
        self._wall[0] = time.monotonic()

    def stop(self) -> None:
        self._wall[1] = time.monotonic()
        self._end = self._snap()
        self._mem[1], self._small[1] = mem_free_mib(), small_free_mib()

    def mem_free(self) -> list[int | None]:
        """MemFree in MiB when the measured phase started and when it ended (None: unread)."""
        return list(self._mem)

    def small_free(self) -> list[int | None]:
        """:func:`small_free_mib` when the measured phase started and when it ended."""
        return list(self._small)

    def report(self, keys: int, nbytes: int) -> dict[str, Any]:
        """Per process: ``cpu_s``, ``us_per_key``, ``s_per_gb`` over the measured phase, and per
        second of it ``cpus`` (CPU used) and ``wait_cpus`` (runnable, waiting for a CPU; None
        where ``schedstat`` could not be read)."""
        out: dict[str, Any] = {}
        wall = self._wall[1] - self._wall[0]
        for name, (t1, w1) in self._end.items():
            start = self._start.get(name)
            if start is None:
                continue
            t0, w0 = start
            cpu = t1 - t0
            # summed over the threads alive at each end: one that ended in the phase takes
            # its wait with it, so the difference is floored at 0
            wait = None if w0 is None or w1 is None else max(0.0, w1 - w0)
            out[name] = {
                "pid": self.pids[name],
                "cpu_s": cpu,
                "us_per_key": cpu * 1e6 / keys if keys else None,
                "s_per_gb": cpu / (nbytes / 1e9) if nbytes else None,
                "cpus": cpu / wall if wall > 0 else None,
                "wait_cpus": wait / wall if wall > 0 and wait is not None else None,
            }
        return out
