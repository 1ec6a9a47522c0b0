"""Page files through the FUSE mount vs the async API, the way SGLang's HiCacheFile does it.

    python -m kvfs.bench.mount_pages [--pages-128k N] [--pages-2m N] [--threads 8]
                                     [--writer tofile|hicache|write] [--write-behind SIZE]
                                     [--rounds N] [--mount-arg=ARG ...]
                                     [--floor [--floor-arg=ARG ...]]

Starts ``kvfs up`` (3 chunkservers, no GC) in a temp dir and two ``kvfs mount`` of it (needs
root and /dev/fuse; the second stands for another node), then per page size, in one sitting:

- mount write: each of ``--threads`` threads writes its pages with numpy ``tofile``
  (``--writer hicache``: as SGLang 0.5.23's ``HiCacheFile.set`` does, a stat of the page's
  name, ``tofile`` to ``.<uuid>.tmp`` in the same directory, then ``os.replace`` onto the
  name; ``--writer write``: Python's ``open(path, "wb").write(page)`` instead; numpy closes
  its ``FILE*``, the close that commits, holding the GIL, so with ``tofile`` the threads'
  commits go one at a time); then an ``fsync`` of the directory, which waits for the files
  the mount still holds (``--write-behind``; without it there are none), so the rate counts
  committed files; "closes" is the rate until the last close returned;
- mount read: each thread reads its pages back with ``readinto`` (unbuffered), bytes checked;
  (a value written through this mount: the kernel's pages it was written through are kept,
  ``--page-cache-files``); then "mount re-read", the same again (a value read before,
  unchanged since: the kernel's cached pages are kept); then "2nd mount read", the same
  through the second mount, which never saw these files (another node's first read);
- mount CPU/file: the first ``kvfs mount`` process's CPU time (user + system,
  ``/proc/PID/stat``) over the write phase, per file written; mount wait/file: the time its
  threads were runnable but waited for a CPU over that phase (``schedstat``), per file (the
  mount's loop is one thread: when its CPU + wait per file is about the write phase's time
  per file, the mount is the bottleneck and the machine's other load sets its rate);
  2nd mount CPU/file: the second mount's CPU time over its cold reads, per file read;
  MemFree at 2nd mount read: the machine's free memory (``/proc/meminfo``) as they begin, and
  of it the part in small blocks (:func:`kvfs.bench.cpu.small_free_mib`, where the kernel has
  free page reporting).  The kernel copies a cold read's answer into page-cache pages it has
  just allocated (without ``--direct-first-open``), so the second mount's CPU is where memory
  the machine touches for the first time is paid for: on the 2-vCPU KVM guest of
  bench/RESULTS.md a first touch cost about 4x once the small blocks were used up (2026-12-03,
  a process touching memory alone), and the second mount's CPU per cold 2 MiB file 3-4x with it;
- API write / read: as many coroutines on one ``AsyncClient``, ``put_many`` / ``get_into`` in
  batches of 64;
- ``--floor``: after each round's API phase, the same writes and reads (bytes checked) through
  ``python -m kvfs.bench.memfs`` (:mod:`kvfs.bench.memfs`: files in a dict, run as ``kvfs
  mount`` runs with its defaults, each open dropping the kernel's pages, no FLUSH unless
  ``--floor-arg=--flush``), the files deleted after: a second table has its files/s, their
  ratios to the API's and the mount's, and its CPU per file; then the machine's CPU (every
  process's and the kernel's, ``/proc/stat``) per file written through the floor, per page
  written through the API and per file written through the mount.  (The floor keeps every
  file's bytes until the round ends; on a machine whose first touch of memory is dear, as the
  KVM guest of bench/RESULTS.md, that is part of its cost, which a mount that frees each file
  after its commit does not pay: the floor's cost is no lower bound on the mount's.)

Both sides read into buffers made and written once before the reads are timed (a thread's
one page, a coroutine's batch of 64), as an engine reads into its own long-lived buffers:
``get_into`` into 64 fresh 2 MiB arrays per coroutine took a page fault per 4 KiB in the
client's one thread (512 MiB a round), which the mount's threads, each reusing one page,
did not, and whether glibc handed those arrays out fresh or reused moved the API's 2 MiB
read 238-873 pages/s between rounds (2026-12-02 17:26 UTC, bench/RESULTS.md).

``--rounds N`` repeats both, alternating (mount, API, mount, API, ...) in the same cluster and
mounts, one row per round, then a row of the ratios' medians: a ratio taken from two phases a
few seconds apart on a shared machine moves with the machine's other load, so one round is
one noisy sample.

Prints a markdown table (pages/s) and the ratios mount/API (issue 12's targets: >= 0.5 at
128 KiB, >= 0.8 at 2 MiB, writes and reads).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvfs.chunkserver.durability import fsync_dir
from kvfs.client import AsyncClient
from kvfs.mount import is_mounted

from .cpu import cpu_seconds, free_text, machine_cpu_seconds, run_queue_wait_s

BATCH = 64


def _wait(pred: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _mount(mnt: Path, addr: str, args: list[str], procs: list[subprocess.Popen[bytes]]) -> None:
    """``kvfs mount`` at ``mnt`` (its process added to ``procs``), once it is mounted."""
    _mounted(mnt, ["kvfs", "mount", str(mnt), "--addr", addr, *args], procs)


def _mounted(mnt: Path, module_args: list[str], procs: list[subprocess.Popen[bytes]]
             ) -> subprocess.Popen[bytes]:
    """``python -m MODULE ARGS...`` started (its process added to ``procs``, and returned)
    once ``mnt`` is mounted."""
    p = subprocess.Popen([sys.executable, "-m", *module_args], stdout=subprocess.DEVNULL)
    procs.append(p)
    _wait(lambda: is_mounted(str(mnt)) or p.poll() is not None, 30, "the mount")
    if p.poll() is not None:
        raise SystemExit(f"python -m {' '.join(module_args)} exited with {p.returncode}")
    return p


def kvfs_up(root: Path, procs: list[subprocess.Popen[bytes]]) -> str:
    """``kvfs up`` (3 chunkservers, no GC) with its data in ``root``, its process added to
    ``procs`` (the caller ends it): its address, once it serves."""
    # its output goes to a file: a pipe nobody reads once the address is found could fill and
    # block the cluster
    log = root / "up.log"
    with log.open("wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "kvfs", "up", "--data", str(root / "data"),
                              "--listen", "127.0.0.1:0", "--no-gc"], stdout=out, stderr=subprocess.STDOUT)
    procs.append(p)
    found: list[str] = []

    def started() -> bool:
        found[:] = re.findall(r"^kvfs://\S+", log.read_text(errors="replace"), re.M)[:1]
        return bool(found) or p.poll() is not None

    _wait(started, 60, "kvfs up")
    if not found:
        raise SystemExit(f"kvfs up did not start: {log.read_text(errors='replace')[-2000:]}")
    return found[0]


def _pages(n: int, size: int) -> list[np.ndarray]:
    base = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = []
    for i in range(n):
        p = base.copy()
        p[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
        out.append(p)
    return out


def _buffers(n: int, like: np.ndarray) -> list[np.ndarray]:
    """``n`` arrays shaped as ``like``, written once (their pages faulted in already)."""
    return [np.ones_like(like) for _ in range(n)]


def _machine_s() -> float:
    """The machine's busy CPU seconds so far (every process and the kernel; NaN where there is
    no reading)."""
    busy = machine_cpu_seconds()
    return float("nan") if busy is None else busy


def _cpu_wait_s(pid: int | None) -> tuple[float, float]:
    """The CPU time process ``pid`` has used so far, and its threads' run-queue wait (NaN
    where there is no process or no reading)."""
    if pid is None:
        return float("nan"), float("nan")
    cpu, wait = cpu_seconds(pid), run_queue_wait_s(pid)
    return (float("nan") if cpu is None else cpu), (float("nan") if wait is None else wait)


def _write_pages(d: Path, names: list[Path], pages: list[np.ndarray], ids: range, writer: str) -> None:
    """Pages ``ids`` written to ``names`` in directory ``d``, the ``--writer`` way."""
    for i in ids:
        if writer == "tofile":
            pages[i].tofile(names[i])
        elif writer == "hicache":
            if os.path.exists(names[i]):
                continue
            tmp = d / f".{uuid.uuid4().hex}.tmp"
            pages[i].tofile(tmp)
            os.replace(tmp, names[i])
        else:
            with open(names[i], "wb") as f:
                f.write(pages[i].data)


def _read_pages(where: list[Path], pages: list[np.ndarray], ids: range, buf: np.ndarray) -> int:
    """Pages ``ids`` read from ``where`` into ``buf`` (unbuffered ``readinto``); how many
    came back wrong."""
    bad = 0
    for i in ids:
        with open(where[i], "rb", buffering=0) as f:
            n = f.readinto(buf.data)
        bad += n != buf.nbytes or not np.array_equal(buf, pages[i])
    return bad


def mount_round(mnt: Path, other: Path, pages: list[np.ndarray], threads: int, tag: str,
                writer: str = "tofile", mount_pid: int | None = None, other_pid: int | None = None
                ) -> tuple[float, float, float, float, float, float, float, float, str, float]:
    d = mnt / tag
    d.mkdir()
    names = [d / f"{i:08d}.bin" for i in range(len(pages))]
    share = [range(t, len(pages), threads) for t in range(threads)]
    elsewhere = [other / tag / n.name for n in names]  # the same files through the other mount
    bufs = _buffers(threads, pages[0])  # a thread's page, made before the reads are timed

    def write(ids: range) -> None:
        _write_pages(d, names, pages, ids, writer)

    def read(ids: range, where: list[Path] = names) -> int:
        return _read_pages(where, pages, ids, bufs[ids.start])

    with ThreadPoolExecutor(threads) as ex:
        cpu0, wait0 = _cpu_wait_s(mount_pid)
        busy0 = _machine_s()
        t0 = time.perf_counter()
        list(ex.map(write, share))
        tc = time.perf_counter() - t0
        fsync_dir(d)  # write-behind: every file held under it committed
        tw = time.perf_counter() - t0
        cpu1, wait1 = _cpu_wait_s(mount_pid)
        busy1 = _machine_s()
        t0 = time.perf_counter()
        bad = sum(ex.map(read, share))
        tr = time.perf_counter() - t0
        t0 = time.perf_counter()
        bad += sum(ex.map(read, share))
        trr = time.perf_counter() - t0
        free = free_text()
        ocpu0 = _cpu_wait_s(other_pid)[0]
        t0 = time.perf_counter()
        bad += sum(ex.map(read, share, [elsewhere] * threads))
        tcold = time.perf_counter() - t0
        ocpu1 = _cpu_wait_s(other_pid)[0]
    if bad:
        raise SystemExit(f"{bad} pages read back wrong through the mount")
    n = len(pages)
    return (n / tc, n / tw, n / tr, n / trr, n / tcold, (cpu1 - cpu0) / n, (wait1 - wait0) / n,
            (ocpu1 - ocpu0) / n, free, (busy1 - busy0) / n)


def floor_round(mnt: Path, pages: list[np.ndarray], threads: int, tag: str, writer: str,
                pid: int) -> tuple[float, float, float, float, float]:
    """The same writes and reads through ``python -m kvfs.bench.memfs`` at ``mnt`` (process
    ``pid``): files/s written, files/s read, its CPU per file written and per file read, and
    the machine's CPU per file written (the writers', the kernel's and the floor's).  The
    files are deleted after (the floor holds them in its memory)."""
    names = [mnt / f"{tag}-{i:08d}.bin" for i in range(len(pages))]
    share = [range(t, len(pages), threads) for t in range(threads)]
    bufs = _buffers(threads, pages[0])

    def write(ids: range) -> None:
        _write_pages(mnt, names, pages, ids, writer)

    def read(ids: range) -> int:
        return _read_pages(names, pages, ids, bufs[ids.start])

    with ThreadPoolExecutor(threads) as ex:
        cpu0, busy0 = _cpu_wait_s(pid)[0], _machine_s()
        t0 = time.perf_counter()
        list(ex.map(write, share))
        tw = time.perf_counter() - t0
        cpu1, busy1 = _cpu_wait_s(pid)[0], _machine_s()
        t0 = time.perf_counter()
        bad = sum(ex.map(read, share))
        tr = time.perf_counter() - t0
        cpu2 = _cpu_wait_s(pid)[0]
    for name in names:
        name.unlink()
    if bad:
        raise SystemExit(f"{bad} pages read back wrong through the floor filesystem")
    n = len(pages)
    return n / tw, n / tr, (cpu1 - cpu0) / n, (cpu2 - cpu1) / n, (busy1 - busy0) / n


async def api_round(addr: str, pages: list[np.ndarray], threads: int, tag: str
                    ) -> tuple[float, float, float]:
    """Pages/s written and read through the API, and the machine's CPU per page written (the
    client's, the cluster's and the kernel's)."""
    keys = [f"{tag}/{i:08d}" for i in range(len(pages))]
    batches = [range(s, min(s + BATCH, len(pages))) for s in range(0, len(pages), BATCH)]
    async with AsyncClient(addr) as kv:
        async def writer(t: int) -> None:
            for b in batches[t::threads]:
                await kv.put_many([(keys[i], pages[i]) for i in b])

        # a coroutine's batch of pages, made before the reads are timed (as the mount's)
        bufs = {t: _buffers(BATCH, pages[0]) for t in range(min(threads, len(batches)))}

        async def reader(t: int) -> int:
            bad = 0
            for b in batches[t::threads]:
                got = await kv.get_into([keys[i] for i in b], bufs[t][: len(b)])
                bad += sum(n != pages[0].nbytes or not np.array_equal(bufs[t][j], pages[i])
                           for j, (i, n) in enumerate(zip(b, got, strict=True)))
            return bad

        busy0 = _machine_s()
        t0 = time.perf_counter()
        await asyncio.gather(*(writer(t) for t in range(threads)))
        tw = time.perf_counter() - t0
        busy1 = _machine_s()
        t0 = time.perf_counter()
        bad = sum(await asyncio.gather(*(reader(t) for t in range(threads))))
        tr = time.perf_counter() - t0
    if bad:
        raise SystemExit(f"{bad} pages read back wrong through the API")
    return len(pages) / tw, len(pages) / tr, (busy1 - busy0) / len(pages)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfs.bench.mount_pages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages-128k", type=int, default=2048,
                    help="128 KiB pages (default 2048; 0 skips this size)")
    ap.add_argument("--pages-2m", type=int, default=256,
                    help="2 MiB pages (default 256; 0 skips this size)")
    ap.add_argument("--threads", type=int, default=8, help="threads / coroutines (default 8)")
    ap.add_argument("--writer", choices=("tofile", "hicache", "write"), default="tofile",
                    help="how the mount's pages are written: numpy tofile to the page's name (the "
                    "default), HiCacheFile.set's stat + tofile to a tmp name + os.replace, or "
                    "Python's file write")
    ap.add_argument("--rounds", type=int, default=1,
                    help="mount and API rounds per size, alternating, in one cluster (default 1); "
                    "over 1, a last row has the ratios' medians")
    ap.add_argument("--write-behind", default=None, metavar="SIZE",
                    help="mount with --write-behind SIZE (closes return once held; default off)")
    ap.add_argument("--mount-arg", action="append", default=[], metavar="ARG",
                    help="an argument for `kvfs mount` (repeat), e.g. --mount-arg=--negative-timeout=1s")
    ap.add_argument("--floor", action="store_true",
                    help="in each round, the same writes and reads through an in-memory Python "
                    "filesystem as well (python -m kvfs.bench.memfs, run as kvfs mount runs with "
                    "its defaults: what a Python filesystem pays for these requests here); a "
                    "second table has its rates and ratios")
    ap.add_argument("--floor-arg", action="append", default=[], metavar="ARG",
                    help="an argument for the floor (repeat), e.g. --floor-arg=--flush")
    ns = ap.parse_args(argv)
    if min(ns.pages_128k, ns.pages_2m) < 0 or ns.threads < 1 or ns.rounds < 1:
        ap.error("--pages-128k and --pages-2m must not be negative, --threads and --rounds at "
                 "least 1")
    if ns.write_behind is not None:
        ns.mount_arg.append(f"--write-behind={ns.write_behind}")
    root = Path(tempfile.mkdtemp(prefix="kvfs-mount-pages-"))
    ups: list[subprocess.Popen[bytes]] = []
    mounts: list[subprocess.Popen[bytes]] = []
    mnt, mnt2, fmnt = root / "mnt", root / "mnt2", root / "floor"
    for m in (mnt, mnt2, fmnt):
        m.mkdir()
    try:
        addr = kvfs_up(root, ups)
        for m in (mnt, mnt2):
            _mount(m, addr, ns.mount_arg, mounts)
        floor = _mounted(fmnt, ["kvfs.bench.memfs", str(fmnt), *ns.floor_arg], mounts) if ns.floor else None
        rows = []
        medians = []
        floor_rows: list[tuple[str, int, float, float, float, float, float, float, float, float,
                               float, float, float]] = []
        floor_medians = []
        for label, n, size in (("128 KiB", ns.pages_128k, 128 * 1024), ("2 MiB", ns.pages_2m, 2 << 20)):
            if not n:  # skipped (there is no page to time)
                continue
            pages = _pages(n, size)
            ratios = []
            floor_ratios = []
            for r in range(ns.rounds):
                tag = label.replace(" ", "") + (f"r{r}" if r else "")
                mc, mw, mr, mrr, cold, mcpu, mwait, ocpu, free, mbusy = mount_round(
                    mnt, mnt2, pages, ns.threads, "m" + tag, ns.writer, mounts[0].pid, mounts[1].pid)
                aw, ar, abusy = asyncio.run(api_round(addr, pages, ns.threads, "a" + tag))
                rows.append((label, n, mc, mw, aw, mr, ar, mrr, cold, mcpu, mwait, ocpu, free))
                ratios.append((mw / aw, mr / ar, mrr / ar, cold / ar))
                if floor is not None:
                    fw, fr, fwcpu, frcpu, fbusy = floor_round(fmnt, pages, ns.threads, "f" + tag,
                                                              ns.writer, floor.pid)
                    floor_rows.append((label, n, fw, aw, mw, fr, ar, cold, fwcpu, frcpu, fbusy, abusy,
                                       mbusy))
                    floor_ratios.append((fw / aw, mw / fw, fr / ar, cold / fr))
            if ns.rounds > 1:
                medians.append((label, ns.rounds,
                                *(statistics.median(x) for x in zip(*ratios, strict=True))))
                if floor_ratios:
                    floor_medians.append((label, ns.rounds, *(statistics.median(x) for x in
                                                              zip(*floor_ratios, strict=True))))
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"| page | pages | mount closes | mount write | API write | mount/API | mount read | "
              f"API read | "
              f"mount/API | mount re-read | re-read/API | 2nd mount read | 2nd/API | mount CPU/file | "
              f"mount wait/file | 2nd mount CPU/file | MemFree at 2nd mount read |  "
              f"({ns.threads} threads, --writer {ns.writer}, "
              f"{' '.join(ns.mount_arg) or 'default mount'}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load})")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for label, n, mc, mw, aw, mr, ar, mrr, cold, mcpu, mwait, ocpu, free in rows:
            print(f"| {label} | {n} | {mc:,.0f} files/s | {mw:,.0f} files/s | {aw:,.0f} pages/s | "
                  f"{mw / aw:.2f} | "
                  f"{mr:,.0f} files/s | {ar:,.0f} pages/s | {mr / ar:.2f} | "
                  f"{mrr:,.0f} files/s | {mrr / ar:.2f} | {cold:,.0f} files/s | {cold / ar:.2f} | "
                  f"{mcpu * 1e6:,.0f} µs | {mwait * 1e6:,.0f} µs | {ocpu * 1e6:,.0f} µs | "
                  f"{free} |")
        for label, rounds, w, r, rr, c in medians:
            print(f"| {label}, median of {rounds} | | | | | {w:.2f} | | | {r:.2f} | | {rr:.2f} | | "
                  f"{c:.2f} | | | | |")
        if floor is not None:
            print()
            print("| page | pages | floor write | floor/API write | mount write/floor | floor read | "
                  "floor/API read | 2nd mount read/floor | floor CPU/file written | "
                  "floor CPU/file read | machine CPU/file written: floor | API | mount |  "
                  "(the floor: python -m kvfs.bench.memfs "
                  f"{' '.join(ns.floor_arg)}{' ' if ns.floor_arg else ''}MOUNTPOINT, the same "
                  "threads and files, after each round's API phase)")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for label, n, fw, aw, mw, fr, ar, cold, fwcpu, frcpu, fbusy, abusy, mbusy in floor_rows:
                print(f"| {label} | {n} | {fw:,.0f} files/s | {fw / aw:.2f} | {mw / fw:.2f} | "
                      f"{fr:,.0f} files/s | {fr / ar:.2f} | {cold / fr:.2f} | {fwcpu * 1e6:,.0f} µs | "
                      f"{frcpu * 1e6:,.0f} µs | {fbusy * 1e6:,.0f} µs | {abusy * 1e6:,.0f} µs | "
                      f"{mbusy * 1e6:,.0f} µs |")
            for label, rounds, fwa, mwf, fra, cf in floor_medians:
                print(f"| {label}, median of {rounds} | | | {fwa:.2f} | {mwf:.2f} | | {fra:.2f} | "
                      f"{cf:.2f} | | | | | |")
    finally:
        for p in mounts:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in mounts:
            p.wait(30)
        for p in ups:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
