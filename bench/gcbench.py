"""``kvfs bench --gc``: GC reclaim rate, and foreground read latency with GC running vs idle.

1. Reclaim: for each ``--bs`` (default 4k,64k) put ``--size`` bytes of keys
   (default 200MiB) with ``ttl=--gc-ttl`` (1s), poll until they are misses,
   then time one ``run_pass(PassOptions(apply=True, grace_s=0))``: keys/s and
   MB/s reclaimed, and ``du`` of the chunk files before and after.  With
   ``--gc-overwrite`` each key is first put without a ttl and then overwritten
   with it: the pass drops each with a tombstone (its first value outlives it).
2. Foreground: a randread 4k batch-128 job for ``--runtime`` seconds three
   times: GC idle; a churn of expiring and overwritten keys without GC; the
   same churn with GC passes back to back (``grace_s=0``, so compaction copies
   live records out of chunks the overwrites left half garbage). Churn and GC
   run in a child process for the process cluster (their client CPU does not
   share the reader's event loop), as a task for the in-process cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .jobs import human_bs
from .runner import KEY_NAMESPACE, BenchError, Workload, make_keys, run_workload
from .stats import report_json

__all__ = ["ChurnOptions", "ChurnStats", "churn", "reclaim", "render", "run_gc_bench"]

DEFAULT_SIZE: Final = 200 << 20
DEFAULT_BS: Final = (4 << 10, 64 << 10)
FG_BS: Final = 4 << 10
FG_BATCH: Final = 128
FG_KEYS: Final = 8192  # 32 MiB of 4 KiB values
EXPIRE_DEADLINE_S: Final = 120.0
POLL_S: Final = 0.05


def du(root: Path | None) -> int | None:
    """Bytes the chunk files of the data dirs take on disk (``du``); None without a local cluster."""
    if root is None:
        return None
    return sum(os.stat(p).st_blocks * 512 for p in root.glob("cs*/chunks/*") if p.is_file())


def _client(addr: str, token: str | None) -> Any:
    from kvfs.client import AsyncClient

    return AsyncClient(addr, token=token)


async def wait_expired(client: Any, keys: list[bytes], deadline_s: float = EXPIRE_DEADLINE_S) -> float:
    """Poll until the first and last key put are misses; seconds waited. Raises past the deadline."""
    t0 = time.monotonic()
    probe = [keys[0], keys[-1]]
    while any(await client.exists_many(probe)):
        if time.monotonic() - t0 > deadline_s:
            raise BenchError(f"keys still present {deadline_s:g}s after their ttl")
        await asyncio.sleep(POLL_S)
    return time.monotonic() - t0


async def reclaim(addr: str, token: str | None, data: Path | None, bs: int, nkeys: int,
                  ttl: float, *, batch: int = 256, overwrite: bool = False) -> dict[str, Any]:
    """Put ``nkeys`` x ``bs`` with ``ttl``, wait until expired, time one applied GC pass.
    ``overwrite``: each key put without a ttl first (the put then overwrites it)."""
    from kvfs.gc.driver import GarbageCollector, PassOptions

    keys = make_keys(KEY_NAMESPACE + b"gc-reclaim/%d/" % bs, nkeys)
    value = os.urandom(bs)
    client = _client(addr, token)
    try:
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(4)

        async def put(chunk: list[bytes], ttl: float | None) -> None:
            async with sem:
                await client.put_many([(k, value) for k in chunk], ttl=ttl)

        for t in ((None, ttl) if overwrite else (ttl,)):
            await asyncio.gather(*(put(keys[i:i + batch], t) for i in range(0, nkeys, batch)))
        put_s = time.perf_counter() - t0
        du_before = du(data)
        waited = await wait_expired(client, keys)
    finally:
        await client.close()
    async with GarbageCollector(addr, token=token) as gc:
        rep = await gc.run_pass(PassOptions(apply=True, grace_s=0))
    du_after = du(data)
    d = max(rep.duration_s, 1e-9)
    return {
        "bs": bs, "keys": nkeys, "ttl_s": ttl, "overwrite": overwrite, "put_s": put_s,
        "expire_wait_s": waited,
        "pass_s": rep.duration_s,
        "expired_keys": rep.expired_keys, "expired_bytes": rep.expired_bytes,
        "chunks_deleted": rep.chunks_deleted, "chunks_compacted": rep.chunks_compacted,
        "bytes_reclaimed": rep.bytes_reclaimed,
        "keys_per_s": rep.expired_keys / d,
        "mb_per_s": rep.bytes_reclaimed / d / 1e6,
        "logical_mb_per_s": rep.expired_bytes / d / 1e6,
        "du_before": du_before, "du_after": du_after,
    }


# ---------------------------------------------------------------------------
# churn (+ GC) in the background


@dataclass(frozen=True)
class ChurnOptions:
    gc: bool = True
    rate_bytes: int = 16 << 20  # bytes/s written by the churn
    bs: int = 16 << 10
    batch: int = 32
    hot_keys: int = 2048  # overwritten over and over: their old versions become garbage
    ttl: float = 1.0  # every other batch is new keys with this ttl


PASS_TOTALS = ("expired_keys", "chunks_compacted", "chunks_deleted", "bytes_copied",
               "keys_relocated", "relocations_lost", "bytes_reclaimed")


@dataclass
class ChurnStats:
    written_bytes: int = 0
    puts: int = 0
    passes: int = 0
    pass_s: list[float] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PASS_TOTALS, 0))  # PassReport's

    def to_json(self) -> dict[str, Any]:
        ps = sorted(self.pass_s)
        return {
            "written_bytes": self.written_bytes, "puts": self.puts, "gc_passes": self.passes,
            "pass_s_median": ps[len(ps) // 2] if ps else None, "pass_s_max": ps[-1] if ps else None,
            **self.totals,
        }


async def churn(addr: str, token: str | None, opts: ChurnOptions, stop: asyncio.Event,
                started: asyncio.Event | None = None) -> ChurnStats:
    """Rate-limited overwrites + expiring puts, and (``opts.gc``) GC passes back to back, until ``stop``."""
    from kvfs.gc.driver import GarbageCollector, PassOptions

    st = ChurnStats()
    value = os.urandom(opts.bs)
    hot = make_keys(KEY_NAMESPACE + b"gc-churn/hot/", opts.hot_keys)
    client = _client(addr, token)

    async def writer() -> None:
        t0 = time.monotonic()
        n = 0
        while not stop.is_set():
            if n % 2 == 0:
                i = (n // 2 * opts.batch) % opts.hot_keys
                items = [(k, value) for k in hot[i:i + opts.batch]]
                await client.put_many(items)
            else:
                items = [(KEY_NAMESPACE + b"gc-churn/ttl/%d/%d" % (n, j), value) for j in range(opts.batch)]
                await client.put_many(items, ttl=opts.ttl)
            n += 1
            st.puts += len(items)
            st.written_bytes += len(items) * opts.bs
            ahead = st.written_bytes / opts.rate_bytes - (time.monotonic() - t0)
            if ahead > 0:
                try:
                    async with asyncio.timeout(ahead):
                        await stop.wait()
                except TimeoutError:
                    pass

    async def collector() -> None:
        async with GarbageCollector(addr, token=token) as gc:
            while not stop.is_set():
                r = await gc.run_pass(PassOptions(apply=True, grace_s=0))
                st.passes += 1
                st.pass_s.append(r.duration_s)
                for name in PASS_TOTALS:  # the PassReport counters this bench sums
                    st.totals[name] += getattr(r, name)
                await asyncio.sleep(0)

    try:
        # one pass over the hot set first, so overwrites make garbage from the start
        for i in range(0, opts.hot_keys, opts.batch):
            await client.put_many([(k, value) for k in hot[i:i + opts.batch]])
        if started is not None:
            started.set()
        tasks = [writer()] + ([collector()] if opts.gc else [])
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return st


class _Background:
    """Churn (+ GC) while the foreground job runs: a child process, or a task in this loop."""

    def __init__(self, addr: str, token: str | None, opts: ChurnOptions, child: bool) -> None:
        self.addr, self.token, self.opts, self.child = addr, token, opts, child
        self._stop = asyncio.Event()
        self._task: asyncio.Task[ChurnStats] | None = None
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        if not self.child:
            started = asyncio.Event()
            self._task = asyncio.create_task(churn(self.addr, self.token, self.opts, self._stop, started))
            async with asyncio.timeout(120):
                await asyncio.wait([asyncio.create_task(started.wait()), self._task],
                                   return_when=asyncio.FIRST_COMPLETED)
            if self._task.done():
                self._task.result()  # raises what went wrong
            return
        spec = json.dumps({"addr": self.addr, **self.opts.__dict__})
        env = {**os.environ, "KVFS_ADMIN_TOKEN": self.token} if self.token else None
        self._proc = await asyncio.create_subprocess_exec(  # the token in env, never on argv
            sys.executable, "-m", "kvfs.bench.gcbench", spec, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        assert self._proc.stdout is not None
        async with asyncio.timeout(120):
            line = await self._proc.stdout.readline()
        if line.strip() != b"ready":
            err = await self._proc.stderr.read() if self._proc.stderr else b""
            raise BenchError(f"gc churn process failed: {err.decode()[-2000:]}")

    async def stop(self) -> ChurnStats:
        if self._task is not None:
            self._stop.set()
            async with asyncio.timeout(300):
                return await self._task
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        async with asyncio.timeout(300):
            out, err = await self._proc.communicate()
        if self._proc.returncode != 0:
            raise BenchError(f"gc churn process exited {self._proc.returncode}: {err.decode()[-2000:]}")
        return ChurnStats(**json.loads(out))


def _child_main(spec_json: str) -> int:
    from kvfs._loop import new_event_loop

    spec = json.loads(spec_json)
    addr, token = spec.pop("addr"), os.environ.get("KVFS_ADMIN_TOKEN")
    opts = ChurnOptions(**spec)

    async def main() -> ChurnStats:
        stop = asyncio.Event()
        started = asyncio.Event()
        task = asyncio.create_task(churn(addr, token, opts, stop, started))
        await asyncio.wait([asyncio.create_task(started.wait()), task], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
        stop.set()
        return await task

    loop = new_event_loop()
    try:
        st = loop.run_until_complete(main())
    finally:
        loop.close()
    sys.stdout.write(json.dumps(st.__dict__) + "\n")
    return 0


# ---------------------------------------------------------------------------
# the whole run


async def foreground(addr: str, token: str | None, runtime_s: float, child: bool,
                     churn_opts: ChurnOptions, fg_keys: int | None = None,
                     progress: bool | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The randread 4k b128 job: GC idle, churn without GC, churn + GC. (phases, fio jobs)."""
    from .adapters import KvfsStore

    fg_keys = fg_keys or FG_KEYS
    phases: list[dict[str, Any]] = []
    jobs: list[dict[str, Any]] = []
    for i, (phase, opts) in enumerate((
        ("idle", None),
        ("churn, gc off", ChurnOptions(**{**churn_opts.__dict__, "gc": False})),
        ("churn + gc", ChurnOptions(**{**churn_opts.__dict__, "gc": True})),
    )):
        wl = Workload(name=f"gc-fg-{phase.replace(' ', '').replace(',', '-').replace('+', '-')}",
                      rw="randread", bs=FG_BS, batch=FG_BATCH, iodepth=4, nkeys=fg_keys,
                      runtime_s=runtime_s, key_prefix=KEY_NAMESPACE + b"gc-fg/", prefill=i == 0,
                      prefill_timeout_s=300.0, grace_s=60.0)
        bg = _Background(addr, token, opts, child) if opts is not None else None
        if bg is not None:
            await bg.start()
        store = KvfsStore(_client(addr, token))
        try:
            res = await run_workload(store, wl, progress=progress)
        finally:
            await store.close()
            churn_stats = await bg.stop() if bg is not None else None
        job = res.to_json()
        jobs.append(job)
        pct = job["read"]["call_lat_ns"]["percentile"]  # per call of 128 keys
        phases.append({
            "phase": phase, "keys_per_s": res.ios_per_s, "calls": res.read.total_ios // FG_BATCH,
            "p50_us": pct["50.000000"] / 1e3, "p99_us": pct["99.000000"] / 1e3,
            "missing": res.missing,
            "background": churn_stats.to_json() if churn_stats is not None else None,
        })
    return phases, jobs


async def run_gc_bench(ns: argparse.Namespace, addr: str, token: str | None, data: Path | None,
                       child: bool, *, fg_keys: int | None = None) -> dict[str, Any]:
    """Both parts; the JSON ``--output-format=json`` prints (fio jobs under ``jobs``).
    ``token``: an admin token (the bench both runs GC and reads/writes keys)."""
    size = ns.size or DEFAULT_SIZE
    ttl = ns.gc_ttl
    runtime = ns.runtime if ns.runtime is not None else 4.0
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if ns.output_format == "normal" else (
        lambda m: None)
    recl = []
    for bs in ns.bs or DEFAULT_BS:
        nkeys = max(1, size // bs)
        say(f"gc reclaim: {nkeys} x {human_bs(bs)} ttl={ttl:g}s{', overwritten' if ns.gc_overwrite else ''}, "
            "one pass after they expire")
        recl.append(await reclaim(addr, token, data, bs, nkeys, ttl, overwrite=ns.gc_overwrite))
    opts = ChurnOptions(rate_bytes=ns.gc_churn_rate, ttl=ttl)
    say(f"gc foreground: randread 4k b128 for {runtime:g}s each: idle, churn "
        f"{human_bs(opts.rate_bytes)}/s without gc, churn + gc passes back to back")
    phases, jobs = await foreground(addr, token, runtime, child, opts, fg_keys, ns.progress)
    idle, no_gc, with_gc = (p["p99_us"] for p in phases)
    report = report_json(jobs, global_options={"gc": "1", "cluster": "embedded processes"
                                               if child else "in-process or --addr"})
    report["kvfs gc bench"] = {
        "reclaim": recl,
        "foreground": phases,
        "p99_ratio_gc_vs_idle": with_gc / idle if idle else None,
        "p99_ratio_gc_vs_churn": with_gc / no_gc if no_gc else None,
        "cpus": os.cpu_count(),
    }
    return report


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def render(report: dict[str, Any]) -> str:
    g = report["kvfs gc bench"]
    over = any(r.get("overwrite") for r in g["reclaim"])
    lines = ["", "GC reclaim: one run_pass(apply, grace_s=0) after every key expired"
             + (" (each overwritten once: dropped with a tombstone)" if over else ""),
             f"{'bs':>5} {'keys':>7} {'pass s':>7} {'keys/s':>9} {'MB/s':>8} {'logical MB/s':>12} "
             f"{'chunks del':>10} {'du before':>10} {'du after':>10}"]
    for r in g["reclaim"]:
        lines.append(f"{human_bs(r['bs']):>5} {r['expired_keys']:>7} {r['pass_s']:>7.2f} "
                     f"{r['keys_per_s']:>9,.0f} {r['mb_per_s']:>8.1f} {r['logical_mb_per_s']:>12.1f} "
                     f"{r['chunks_deleted']:>10} {_mb(r['du_before']):>10} {_mb(r['du_after']):>10}")
    lines += ["", "Foreground randread 4k batch=128 iodepth=4 (latency per call of 128 keys)",
              f"{'phase':<14} {'keys/s':>9} {'p50 us':>9} {'p99 us':>9} {'miss':>5}  background"]
    for p in g["foreground"]:
        b = p["background"]
        bg = "-" if b is None else (
            f"wrote {b['written_bytes'] / 1e6:.0f} MB; {b['gc_passes']} passes, "
            f"{b['expired_keys']} expired, {b['chunks_compacted']} chunks compacted "
            f"({b['bytes_copied'] / 1e6:.1f} MB copied), {b['bytes_reclaimed'] / 1e6:.1f} MB reclaimed")
        lines.append(f"{p['phase']:<14} {p['keys_per_s']:>9,.0f} {p['p50_us']:>9,.0f} "
                     f"{p['p99_us']:>9,.0f} {p['missing']:>5}  {bg}")

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    lines.append(f"p99 ratio: churn+gc / idle = {ratio(g['p99_ratio_gc_vs_idle'])}, "
                 f"churn+gc / churn without gc = {ratio(g['p99_ratio_gc_vs_churn'])}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
