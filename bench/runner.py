"""fio-style workload runner, independent of the store it drives.

A workload is fio's job in key/value terms: ``bs`` is the value size, one io
is one key, ``batch`` keys go in one call (``put_many``/``get_many``), and
``iodepth`` calls are in flight at once. ``nkeys`` keys make the key space
(fio's ``size`` = ``nkeys * bs``).

Every loop here stops by itself: the measured phase ends at ``runtime_s``
(after ``ramp_time_s``) or after ``max_ios`` keys (one pass over the key space
when not ``time_based``), whichever comes first; the prefill is bounded by
``nkeys`` and ``prefill_timeout_s``; the whole run sits under one
``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import errno
import operator
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import repeat
from typing import Any, Final, Literal, TextIO

import numpy as np

from .cpu import CpuProbe
from .stats import LatencyRecorder, job_json
from .store import Store

__all__ = [
    "API",
    "APIS",
    "KEY_NAMESPACE",
    "RW",
    "RWS",
    "BenchError",
    "JobResult",
    "Workload",
    "format_eta",
    "make_keys",
    "progress_text",
    "run_workload",
    "workload_dict",
]

RW = Literal["read", "randread", "write", "randwrite", "randrw"]
API = Literal["get_many", "get_into", "exists_many", "match_prefix"]
#: how a read workload reads: values as bytes, into caller buffers, or only asks which keys exist
APIS: Final = ("get_many", "get_into", "exists_many", "match_prefix")
#: read APIs that move no value bytes (their jobs report keys/s; bandwidth 0)
LOOKUP_APIS: Final = ("exists_many", "match_prefix")
RWS: Final = ("read", "randread", "write", "randwrite", "randrw")
PROGRESS_INTERVAL_S: Final = 0.5
# the prefill's calls carry at most this many bytes (or one batch): see _prefill
PREFILL_CALL_BYTES: Final = 512 * 1024
#: every bench key starts with this (the bench's own namespace: ``--reclaim`` deletes it)
KEY_NAMESPACE: Final = b"kvfs-bench/"


class BenchError(Exception):
    """A run could not complete (prefill too slow, store failed, ...)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One fio-style job. Sizes in bytes, durations in seconds."""

    name: str
    rw: RW = "randread"
    bs: int = 4096
    batch: int = 1
    iodepth: int = 1
    nkeys: int = 4096
    runtime_s: float = 5.0
    time_based: bool = True
    ramp_time_s: float = 0.0
    rwmixread: int = 50
    max_ios: int = 1 << 40
    seed: int = 1
    key_prefix: bytes = KEY_NAMESPACE
    verify: bool = False
    prefill: bool | None = None
    prefill_timeout_s: float = 600.0
    grace_s: float = 60.0
    api: API = "get_many"
    # rand* jobs' key choice (fio's --random_distribution): "random", every key once a pass in
    # a fresh order; or "zipf:THETA", keys drawn by popularity (parse_distribution)
    random_distribution: str = "random"

    def __post_init__(self) -> None:
        if self.rw not in RWS:
            raise ValueError(f"rw must be one of {RWS}, got {self.rw!r}")
        for name in ("bs", "batch", "iodepth", "nkeys", "max_ios"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch > self.nkeys:
            raise ValueError(f"batch ({self.batch}) must be <= nkeys ({self.nkeys})")
        if not self.runtime_s > 0:
            raise ValueError(f"runtime_s must be > 0, got {self.runtime_s}")
        if self.ramp_time_s < 0:
            raise ValueError(f"ramp_time_s must be >= 0, got {self.ramp_time_s}")
        if not 0 <= self.rwmixread <= 100:
            raise ValueError(f"rwmixread must be in 0..100, got {self.rwmixread}")
        if self.api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {self.api!r}")
        if self.verify and self.bs < 8:
            raise ValueError("verify needs bs >= 8 (an 8-byte key tag starts each value)")
        parse_distribution(self.random_distribution)

    @property
    def size_bytes(self) -> int:
        return self.nkeys * self.bs

    @property
    def reads(self) -> bool:
        return self.rw in ("read", "randread", "randrw")

    @property
    def writes(self) -> bool:
        return self.rw in ("write", "randwrite", "randrw")

    @property
    def needs_prefill(self) -> bool:
        return self.reads if self.prefill is None else self.prefill

    def job_options(self) -> dict[str, str]:
        """fio's ``job options`` (strings), plus our ``batch`` and ``nkeys``."""
        opts = {
            "name": self.name,
            "rw": self.rw,
            "bs": str(self.bs),
            "batch": str(self.batch),
            "iodepth": str(self.iodepth),
            "nkeys": str(self.nkeys),
            "size": str(self.size_bytes),
            "runtime": f"{self.runtime_s:g}",
        }
        if self.time_based:
            opts["time_based"] = ""
        if self.ramp_time_s:
            opts["ramp_time"] = f"{self.ramp_time_s:g}"
        if self.rw == "randrw":
            opts["rwmixread"] = str(self.rwmixread)
        if self.api != "get_many":
            opts["api"] = self.api
        if self.random_distribution != "random":
            opts["random_distribution"] = self.random_distribution
        return opts


@dataclass
class JobResult:
    """What one run measured; ``to_json()`` is fio's job object."""

    workload: Workload
    store_name: str
    read: LatencyRecorder
    write: LatencyRecorder
    runtime_ns: int
    job_start_ms: int
    missing: int = 0
    mismatched: int = 0
    prefill_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_ios(self) -> int:
        return self.read.total_ios + self.write.total_ios

    @property
    def io_bytes(self) -> int:
        return self.read.io_bytes + self.write.io_bytes

    @property
    def ios_per_s(self) -> float:
        """Keys per second, both directions."""
        return self.total_ios * 1e9 / self.runtime_ns if self.runtime_ns else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.io_bytes * 1e9 / self.runtime_ns if self.runtime_ns else 0.0

    @property
    def error(self) -> int:
        return errno.EIO if self.mismatched else errno.ENODATA if self.missing else 0

    def to_json(self) -> dict[str, Any]:
        wl = self.workload
        extra = {
            "kvfs": {
                "store": self.store_name,
                "batch": wl.batch,
                "iodepth": wl.iodepth,
                "missing": self.missing,
                "mismatched": self.mismatched,
                "prefill_s": self.prefill_s,
                "note": "one io = one key; each key of a batched call gets the call's latency",
                **self.extra,
            }
        }
        return job_json(
            wl.name,
            read=self.read if wl.reads else None,
            write=self.write if wl.writes else None,
            runtime_ns=self.runtime_ns,
            options=wl.job_options(),
            error=self.error,
            job_start_ms=self.job_start_ms,
            extra=extra,
        )


def make_keys(prefix: bytes, n: int) -> list[bytes]:
    """``prefix`` + 16 hex digits of the index: stable, sortable, distinct."""
    return [prefix + b"%016x" % i for i in range(n)]


def parse_distribution(text: str) -> float | None:
    """fio's ``random_distribution`` as this bench takes it: ``random`` (None) or
    ``zipf:THETA`` (THETA > 0: the key of popularity rank i drawn with weight 1/i^THETA)."""
    if text == "random":
        return None
    kind, _, arg = text.partition(":")
    if kind != "zipf" or not arg:
        raise ValueError(f"random_distribution must be random or zipf:THETA (e.g. zipf:1.2), got {text!r}")
    try:
        theta = float(arg)
    except ValueError:
        raise ValueError(f"random_distribution zipf:THETA needs a number, got {arg!r}") from None
    if not theta > 0 or theta == float("inf"):
        raise ValueError(f"random_distribution zipf:THETA needs 0 < THETA, got {arg!r}")
    return theta


class _KeyStream:
    """Batches of key indices in fio order: sequential, or a fresh permutation per pass; or,
    with ``zipf`` (a rand* job's ``zipf:THETA``), drawn by popularity, as a cache's keys are
    asked for: the key of rank i (ranks spread over the keys by one permutation) with weight
    1/i^THETA, each batch's keys distinct (a call names a key once)."""

    def __init__(self, nkeys: int, batch: int, rand: bool, seed: int, zipf: float | None = None) -> None:
        self._n = nkeys
        self._batch = batch
        self._rand = rand
        self._rng = np.random.default_rng(seed)
        self._order: np.ndarray[Any, np.dtype[np.int64]] = (
            self._rng.permutation(nkeys) if rand else np.arange(nkeys)
        )
        self._pos = 0
        self._cdf: np.ndarray[Any, np.dtype[np.float64]] | None = None
        if rand and zipf is not None:
            weights = np.arange(1, nkeys + 1, dtype=np.float64) ** -zipf
            cdf = np.cumsum(weights)
            self._cdf = cdf / cdf[-1]

    def _drawn(self) -> list[int]:
        """A batch of distinct keys by popularity (past 8 draws short of distinct keys, the
        most popular keys not drawn yet fill the batch)."""
        assert self._cdf is not None
        got: dict[int, None] = {}
        for _ in range(8):
            ranks = np.searchsorted(self._cdf, self._rng.random(2 * self._batch), side="right")
            got.update(dict.fromkeys(np.minimum(ranks, self._n - 1).tolist()))
            if len(got) >= self._batch:
                break
        rank = 0
        while len(got) < self._batch:
            got.setdefault(rank)
            rank += 1
        return self._order[list(got)[: self._batch]].tolist()

    def next(self) -> list[int]:
        if self._cdf is not None:
            return self._drawn()
        end = self._pos + self._batch
        if end <= self._n:
            idx = self._order[self._pos : end]
            self._pos = end % self._n
            if self._pos == 0 and self._rand:
                self._order = self._rng.permutation(self._n)
            return idx.tolist()
        head = self._order[self._pos :].tolist()
        if self._rand:
            self._order = self._rng.permutation(self._n)
        self._pos = end - self._n
        return head + self._order[: self._pos].tolist()


def _value_for(filler: bytes, i: int, verify: bool) -> bytes:
    return i.to_bytes(8, "big") + filler[8:] if verify else filler


def format_eta(seconds: float) -> str:
    """``1m52s``, ``45s``, ``1h03m``: the ETA of a progress line."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def progress_text(label: str, phase: str, done: float, eta_s: float) -> str:
    """``[3/24] redis randread 4k: 41%  ETA 1m52s`` (``prefill 41%`` while prefilling)."""
    pct = int(max(0.0, min(1.0, done)) * 100)
    return f"{label}: {'prefill ' if phase == 'prefill' else ''}{pct}%  ETA {format_eta(eta_s)}"


class _Progress:
    """One ``\r`` line: ``label: pct%  ETA``; the ETA adds ``after_s`` (work queued after this job)."""

    def __init__(self, stream: TextIO, label: str, total_s: float, after_s: float) -> None:
        self._stream = stream
        self._label = label
        self._total_s = total_s
        self._after_s = after_s

    def show(self, elapsed_s: float, phase: str, done: float) -> None:
        if phase == "prefill":  # the run itself is still ahead
            eta = self._total_s + self._after_s + (elapsed_s / done - elapsed_s if done > 0 else 0.0)
        else:
            eta = max(0.0, self._total_s - elapsed_s) + self._after_s
        self._stream.write("\r" + progress_text(self._label, phase, done, eta) + "\x1b[K")
        self._stream.flush()

    def clear(self) -> None:
        self._stream.write("\r\x1b[K")
        self._stream.flush()


async def _tick_until(done: asyncio.Event, deadline: float, fn: Callable[[], None]) -> None:
    """Call ``fn`` every PROGRESS_INTERVAL_S until ``done`` or ``deadline`` (monotonic)."""
    while not done.is_set() and time.monotonic() < deadline:
        try:
            await asyncio.wait_for(done.wait(), PROGRESS_INTERVAL_S)
        except TimeoutError:
            fn()


async def _run_all(worker: Callable[[], Coroutine[Any, Any, None]], n: int) -> None:
    """Run ``n`` copies of ``worker``; the first failure cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as tg:
            for _ in range(n):
                tg.create_task(worker())
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None


async def _prefill(
    store: Store, keys: Sequence[bytes], filler: bytes, wl: Workload, progress: _Progress | None
) -> float:
    """Write every key once, ``iodepth`` calls in flight, at most ``prefill_timeout_s``.

    Calls of at most ``PREFILL_CALL_BYTES`` (or one batch): kvfs keeps a put_many's small
    values on one server (``put_group_bytes``), a server drawn per call, so a few large
    calls leave the keys unevenly spread, and differently for each job of one run (e.g. the
    get_many and get_into jobs compared): 8192 x 4 KiB in 4 MiB calls put 38-62 % of the
    keys on the busiest of three chunkservers (12 trials), in 512 KiB calls 34-45 %
    (bench/RESULTS.md, "get_into / get_many at 4 KiB")."""
    per_call = max(wl.batch, min(4096, PREFILL_CALL_BYTES // wl.bs))
    starts = list(range(0, len(keys), per_call))
    cursor = iter(starts)
    written = 0
    t0 = time.monotonic()
    deadline = t0 + wl.prefill_timeout_s

    async def worker() -> None:
        nonlocal written
        for start in cursor:  # bounded: shared iterator over len(keys)/per_call starts
            if time.monotonic() > deadline:
                raise BenchError(
                    f"prefill of {len(keys)} keys did not finish in {wl.prefill_timeout_s:g}s"
                )
            stop = min(start + per_call, len(keys))
            await store.put_many(
                [(keys[i], _value_for(filler, i, wl.verify)) for i in range(start, stop)]
            )
            written += stop - start

    done = asyncio.Event()
    ticker = None
    if progress is not None:
        p = progress

        def show() -> None:
            p.show(time.monotonic() - t0, "prefill", written / max(1, len(keys)))

        ticker = asyncio.create_task(_tick_until(done, deadline, show))
    try:
        async with asyncio.timeout(wl.prefill_timeout_s + wl.grace_s):
            await _run_all(worker, min(wl.iodepth, len(starts)))
    except TimeoutError:
        raise BenchError(
            f"prefill of {len(keys)} keys did not finish in {wl.prefill_timeout_s:g}s"
        ) from None
    finally:
        done.set()
        if ticker is not None:
            await ticker
    return time.monotonic() - t0


async def run_workload(
    store: Store,
    wl: Workload,
    *,
    progress: bool | None = None,
    progress_stream: TextIO | None = None,
    label: str | None = None,
    eta_after_s: float = 0.0,
    cpu: CpuProbe | None = None,
) -> JobResult:
    """Run ``wl`` against ``store`` and return what was measured.

    Reads are served by a prefill (all ``nkeys`` keys written first, not timed).
    A call that starts during ramp-up is not recorded. ``progress=None`` shows
    a ``\\r`` progress line on stderr only when stderr is a tty:
    ``<label>: 41%  ETA 1m52s`` (label defaults to the job name; the ETA adds
    ``eta_after_s``, the time the caller expects its later jobs to take).
    With ``cpu``, the processes' CPU time over the run (after the prefill) is
    charged to its keys and bytes, in ``to_json()["kvfs"]["cpu"]``, and the machine's free
    memory at both ends in ``["kvfs"]["mem_free_mib"]`` (MiB, ``[start, end]``), and of it the
    part in small blocks (:func:`kvfs.bench.cpu.small_free_mib`) in ``["kvfs"]["small_free_mib"]``.

    Reads call ``wl.api`` (``get_many``, ``get_into``, ``exists_many`` or
    ``match_prefix``; a key ``exists_many`` denies, or past ``match_prefix``'s
    count, is counted missing). A store with a ``blocking`` attribute (an object
    with the same methods, blocking: kvfs's ``Client``) has its measured calls
    made from ``iodepth`` threads, as a blocking client's users make them; the
    prefill still goes through the store's async methods.
    """
    stream = progress_stream if progress_stream is not None else sys.stderr
    show = stream.isatty() if progress is None else progress
    total_s = wl.ramp_time_s + wl.runtime_s
    prog = _Progress(stream, label or wl.name, total_s, eta_after_s) if show else None
    keys = make_keys(wl.key_prefix, wl.nkeys)
    filler = os.urandom(wl.bs)
    job_start_ms = int(time.time() * 1000)

    read_api = wl.api if wl.reads else "get_many"
    if read_api != "get_many" and getattr(store, read_api, None) is None:
        raise BenchError(f"{getattr(store, 'name', store)!r} has no {read_api}")
    prefill_s = 0.0
    if wl.needs_prefill:
        prefill_s = await _prefill(store, keys, filler, wl, prog)

    rand = wl.rw in ("randread", "randwrite", "randrw")
    stream_keys = _KeyStream(wl.nkeys, wl.batch, rand, wl.seed, parse_distribution(wl.random_distribution))
    mix = random.Random(wl.seed)
    read_rec = LatencyRecorder()
    write_rec = LatencyRecorder()
    count_limit = wl.max_ios if wl.time_based else min(wl.max_ios, wl.nkeys)
    bs = wl.bs
    issued = 0
    missing = 0
    mismatched = 0
    clock = time.perf_counter_ns
    t_start = clock()
    measure_start = t_start + int(wl.ramp_time_s * 1e9)
    t_end = measure_start + int(wl.runtime_s * 1e9)

    def pick(n: int) -> tuple[bool, list[bytes], list[int]]:
        idx = stream_keys.next()[:n]
        if wl.rw in ("read", "randread"):
            is_read = True
        elif wl.rw in ("write", "randwrite"):
            is_read = False
        else:
            is_read = mix.random() * 100 < wl.rwmixread
        batch_keys = list(operator.itemgetter(*idx)(keys)) if len(idx) > 1 else [keys[idx[0]]]
        return is_read, batch_keys, idx

    # a blocking client: the measured calls are made from iodepth threads, as its users make them
    blocking: Any = getattr(store, "blocking", None)
    calls: Any = blocking if blocking is not None else store
    value_bytes = 0 if read_api in LOOKUP_APIS else bs
    make_buffer = getattr(store, "buffer", None) or (lambda n: memoryview(bytearray(n)))
    lock = threading.Lock()  # the bookkeeping below is shared by every worker (threads too)
    failed = threading.Event()

    def begin() -> tuple[bool, list[bytes], list[int]] | None:
        """The next call's keys, or None once the run is over."""
        nonlocal issued
        with lock:
            if failed.is_set() or clock() >= t_end or issued >= count_limit:
                return None
            n = min(wl.batch, count_limit - issued)
            issued += n
            return pick(n)

    def request(is_read: bool, batch_keys: list[bytes], idx: list[int],
                bufs: list[memoryview]) -> tuple[str, tuple[Any, ...]]:
        if not is_read:
            if not wl.verify:  # one value for every key: the pairs made in C (this process's
                # CPU is the client's in --cpu: the harness's own work kept small)
                return "put_many", (list(zip(batch_keys, repeat(filler))),)
            items = [(k, _value_for(filler, i, True)) for k, i in zip(batch_keys, idx, strict=True)]
            return "put_many", (items,)
        if read_api == "get_into":
            return read_api, (batch_keys, bufs[: len(batch_keys)])
        return read_api, (batch_keys,)

    def settle(is_read: bool, idx: list[int], bufs: list[memoryview], res: Any, t0: int, t1: int) -> None:
        nonlocal missing, mismatched
        n = len(idx)
        with lock:
            if t0 >= measure_start:
                rec = read_rec if is_read else write_rec
                rec.record(t1 - t0, n, n * (value_bytes if is_read else bs), t1 - measure_start)
            if not is_read:
                return
            if read_api == "get_many":
                missing += res.count(None)
                if wl.verify:
                    mismatched += _check(res, idx, bs)
            elif read_api == "get_into":
                missing += sum(1 for s in res if s < 0)
                if wl.verify:
                    mismatched += _check([bytes(b) if s >= 0 else None
                                          for b, s in zip(bufs, res, strict=False)], idx, bs)
            elif read_api == "exists_many":
                missing += n - sum(1 for e in res if e)
            else:  # match_prefix: how many leading keys are present
                missing += n - int(res)

    def buffers() -> list[memoryview]:
        # get_into: each worker reads into its own buffers, allocated (registered) once
        if read_api != "get_into":
            return []
        region = make_buffer(wl.batch * bs)
        return [region[i * bs : (i + 1) * bs] for i in range(wl.batch)]

    async def worker() -> None:
        bufs = buffers()
        for _ in range(count_limit):  # bounded by count; begin() checks the clock
            nxt = begin()
            if nxt is None:
                return
            is_read, batch_keys, idx = nxt
            op, args = request(is_read, batch_keys, idx, bufs)
            fn = getattr(calls, op)
            t0 = clock()
            res = await fn(*args)
            t1 = clock()
            settle(is_read, idx, bufs, res, t0, t1)

    # (duplicates: worker() above for the blocking client: the same loop without await)
    def thread_worker() -> None:
        try:
            bufs = buffers()
            for _ in range(count_limit):  # bounded by count; begin() checks the clock
                nxt = begin()
                if nxt is None:
                    return
                is_read, batch_keys, idx = nxt
                op, args = request(is_read, batch_keys, idx, bufs)
                fn = getattr(calls, op)
                t0 = clock()
                res = fn(*args)
                t1 = clock()
                settle(is_read, idx, bufs, res, t0, t1)
        except BaseException:
            failed.set()  # the other threads stop at their next call
            raise

    async def run_threads() -> None:
        pool = ThreadPoolExecutor(max_workers=wl.iodepth, thread_name_prefix="kvfs-bench")
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(pool, thread_worker) for _ in range(wl.iodepth)))
        finally:
            failed.set()
            pool.shutdown(wait=False)

    done = asyncio.Event()
    ticker = None
    if prog is not None:
        p = prog

        def tick() -> None:
            elapsed = (clock() - t_start) / 1e9
            if wl.time_based:
                done = elapsed / total_s
            else:  # a pass over the key space may end before the runtime
                done = max(elapsed / total_s, (read_rec.total_ios + write_rec.total_ios) / count_limit)
            p.show(elapsed, "run", done)

        ticker = asyncio.create_task(
            _tick_until(done, time.monotonic() + wl.ramp_time_s + wl.runtime_s + wl.grace_s, tick)
        )
    if cpu is not None:
        cpu.start()
    try:
        async with asyncio.timeout(wl.ramp_time_s + wl.runtime_s + wl.grace_s):
            if blocking is not None:
                await run_threads()
            else:
                await _run_all(worker, wl.iodepth)
        t_finish = clock()
        if cpu is not None:
            cpu.stop()
    except TimeoutError:
        raise BenchError(
            f"{wl.name}: calls still in flight {wl.grace_s:g}s after the end of the run"
        ) from None
    finally:
        done.set()
        if ticker is not None:
            await ticker
        if prog is not None:
            prog.clear()
    extra: dict[str, Any] = {}
    if cpu is not None:
        extra["cpu"] = cpu.report(read_rec.total_ios + write_rec.total_ios,
                                  read_rec.io_bytes + write_rec.io_bytes)
        extra["mem_free_mib"] = cpu.mem_free()
        if any(m is not None for m in cpu.small_free()):
            extra["small_free_mib"] = cpu.small_free()
    return JobResult(
        extra=extra,
        workload=wl,
        store_name=getattr(store, "name", type(store).__name__),
        read=read_rec,
        write=write_rec,
        runtime_ns=max(0, t_finish - measure_start),
        job_start_ms=job_start_ms,
        missing=missing,
        mismatched=mismatched,
        prefill_s=prefill_s,
    )


def _check(values: list[bytes | None], idx: list[int], bs: int) -> int:
    bad = 0
    for v, i in zip(values, idx, strict=True):
        if v is not None and (len(v) != bs or v[:8] != i.to_bytes(8, "big")):
            bad += 1
    return bad


def workload_dict(wl: Workload) -> dict[str, Any]:
    """The workload as plain JSON-able values."""
    d = asdict(wl)
    d["key_prefix"] = wl.key_prefix.decode("latin-1")
    return d
