"""`kvfs gc ...`: status, run, fsck, scrub, decommission, pause/resume, daemon.

Anything that deletes is a dry run unless ``--apply``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time
from typing import Any

from kvfs import rpc
from kvfs.address import token_from_file
from kvfs.config import GcConfig, TlsConfig, add_cluster_options, add_options, from_options
from kvfs.gc.driver import GarbageCollector, PassOptions, PassReport, run_daemon
from kvfs.gc.repair import repair_step
from kvfs.gc.scrub import ScrubReport, scrub
from kvfs.units import format_size, parse_duration, parse_size


def parse_fraction(text: str) -> float:
    """``80%`` or ``0.8`` -> 0.8."""
    t = text.strip()
    v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"not a fraction between 0 and 1 (or 0%..100%): {text!r}")
    return v


def parse_rate(text: str) -> int:
    """``200MiB/s`` (or ``200MiB``) -> bytes per second."""
    return parse_size(text.strip().removesuffix("/s"))


def _options(p: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    add_cluster_options(p, token_help="file holding the admin token (default: $KVFS_ADMIN_TOKEN, "
                        "else the file kvfs up wrote); tokens never go on a command line")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _collector(ns: argparse.Namespace, progress: Any = None) -> GarbageCollector:
    return GarbageCollector(ns.addr, token=token_from_file(ns.token_file), progress=progress,
                            tls=from_options(TlsConfig, ns))


def _progress(phase: str, done: int, total: int) -> None:
    if sys.stderr.isatty():
        width = 30
        filled = width * done // max(total, 1)
        print(f"\r{phase:<10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
              end="", file=sys.stderr, flush=True)


def _ts(t: float | None) -> str:
    return "never" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def format_status(st: dict[str, Any]) -> str:
    lines = []
    last = st.get("last_run")
    m = st["metrics"]
    lines.append(f"gc: {'PAUSED' if st['paused'] else 'active'}   expired keys not yet swept: "
                 f"{st['expired_keys']}   chunks retired: {st['dead_chunks']}")
    if last:
        n = {k: int(last.get(k, 0)) for k in  # (GC_REPORT carries them as floats: RunCounters)
             ("expired_keys", "evicted_keys", "chunks_compacted", "chunks_deleted", "bytes_reclaimed")}
        lines.append(f"last run: {_ts(last.get('started'))} took {last.get('duration_s', 0):.2f}s: "
                     f"expired {n['expired_keys']} keys, evicted {n['evicted_keys']}, "
                     f"compacted {n['chunks_compacted']} chunks, deleted "
                     f"{n['chunks_deleted']}, freed {format_size(n['bytes_reclaimed'])}")
    else:
        lines.append("last run: never")
    lines.append(f"totals: expired {int(m['keys_expired'])} keys, evicted {int(m['keys_evicted'])}, "
                 f"compacted {int(m['chunks_compacted'])} chunks, deleted {int(m['chunks_deleted'])}, "
                 f"reclaimed {format_size(m['bytes_reclaimed'])} in {int(m['passes'])} passes")
    asked = int(m.get("room_requests", 0))  # (absent from an older meta's answer)
    waited = float(m.get("room_wait_s", 0.0))
    lines.append(f"writers on a full cluster: asked for room {asked} times, waited {waited:.2f}s in all"
                 + (f" ({waited / asked:.2f}s each)" if asked else "")
                 + f"; {int(m.get('room_passes', 0))} passes ran for them; "
                 f"{int(m.get('room_refused', 0))} told none was made (NoSpace)")
    lines.append(format_repair(st.get("repair"), m))
    lines.append(f"bad replicas: {int(m.get('replicas_reported_bad', 0))} found where readers reported them, "
                 f"{int(m.get('replicas_scrubbed_bad', 0))} by the background scrub "
                 f"({format_size(m.get('bytes_scrubbed', 0))} verified so far)")
    lines.append(f"{'id':>3} {'addr':<21} {'alive':<5} {'capacity':>10} {'used':>10} {'fill':>5} "
                 f"{'live':>10} {'garbage':>10} {'ratio':>5} {'expired':>7} {'chunks':>6}")
    for s in st["servers"]:
        lines.append(
            f"{s['server_id']:>3} {s['addr']:<21} {'yes' if s['alive'] else 'NO':<5} "
            f"{format_size(s['capacity']):>10} {format_size(s['used']):>10} {s['fill']:>5.0%} "
            f"{format_size(s['live']):>10} {format_size(s['garbage']):>10} {s['ratio']:>5.2f} "
            f"{s['expired_keys']:>7} {s['chunks']:>6}")
    return "\n".join(lines)


def format_repair(rep: dict[str, Any] | None, metrics: dict[str, Any]) -> str:
    """One line: what is under-replicated now, and what repair copied so far."""
    rep = rep or {}
    return (f"repair: {rep.get('under_replicated_extents', 0)} extents under-replicated "
            f"({format_size(rep.get('under_replicated_bytes', 0))}), "
            f"{rep.get('unrepairable_extents', 0)} with no live copy; repaired so far "
            f"{int(metrics.get('extents_repaired', 0))} extents "
            f"({format_size(metrics.get('bytes_repaired', 0))})")


def format_pass(r: PassReport) -> str:
    verb = "freed" if r.apply else "would free"
    out = [f"{'applied' if r.apply else 'dry run (add --apply to act)'}, {r.duration_s:.2f}s",
           f"expire:  {r.expired_keys} keys ({format_size(r.expired_bytes)} become garbage)",
           f"evict:   {r.evicted_keys} keys ({format_size(r.evicted_bytes)}); {r.leased_skipped} leased keys kept"
           + (f"; {r.chunks_emptied} chunks emptied whole (no room on their server to copy their "
              "live bytes)" if r.chunks_emptied else ""),
           f"compact: {r.compact_candidates} chunks over the threshold or on a server under pressure"
           + (f" ({r.compact_deferred} more left for a later pass: the server is at its low watermark "
              "without them)" if r.compact_deferred else "")
           + f", {r.delete_candidates} with no live bytes, {r.waiting_grace} waiting out the grace period"]
    if r.repair is not None:
        rp = r.repair
        out.append(f"repair:  {rp.under_replicated_extents} extents under-replicated "
                   f"({format_size(rp.under_replicated_bytes)}), {rp.unrepairable_extents} with no "
                   f"live copy; copied {rp.extents_repaired} ({format_size(rp.bytes_copied)})")
    if r.apply:
        out.append(f"done:    compacted {r.chunks_compacted} chunks ({format_size(r.bytes_copied)} copied, "
                   f"{r.keys_relocated} keys moved, {r.relocations_lost} lost to newer writes), deleted "
                   f"{r.chunks_deleted} chunks: {verb} {format_size(r.bytes_reclaimed)}, "
                   f"{format_size(r.bytes_reclaimed - r.bytes_copied)} net of the copies")
    else:
        out.append(f"total:   {verb} {format_size(r.reclaimable_bytes)} net of the copies "
                   "(after the expire and evict phases above; chunks compacted under a grace "
                   "period are deleted by a later pass)")
    return "\n".join(out)


async def cmd_status(ns: argparse.Namespace) -> int:
    async with _collector(ns) as gc:
        await gc.sync_usage()
        st = await gc.status()
    print(json.dumps(st, default=str) if ns.json else format_status(st))
    return 0


async def cmd_run(ns: argparse.Namespace) -> int:
    phases = ns.expire or ns.compact or ns.repair or ns.evict_to is not None
    opts = PassOptions(
        apply=ns.apply, expire=ns.expire or not phases, compact=ns.compact or not phases,
        evict=ns.evict_to is not None or not phases, threshold=ns.threshold,
        high=ns.high, low=ns.evict_to if ns.evict_to is not None else min(0.8, ns.high),
        grace_s=ns.grace, rate_bytes=ns.rate, expire_batch=ns.batch,
        repair=ns.repair or not phases, repair_rate_bytes=ns.repair_rate)
    if opts.low > opts.high:
        opts = dataclasses.replace(opts, high=opts.low)
    async with _collector(ns, _progress) as gc:
        if ns.apply and await gc.set_paused(None) and not ns.force:
            print("kvfs gc run: GC is paused (kvfs gc resume, or --force)", file=sys.stderr)
            return 1
        report = await gc.run_pass(opts)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(json.dumps(report.to_dict()) if ns.json else format_pass(report))
    return 0


async def cmd_fsck(ns: argparse.Namespace) -> int:
    async with _collector(ns, _progress) as gc:
        rep = await gc.fsck(cutoff_s=ns.cutoff, apply=ns.apply, verify=not ns.no_verify)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if ns.json:
        print(json.dumps(rep.to_dict()))
    else:
        print(f"{'repairing' if rep.apply else 'dry run (add --apply to repair)'}; "
              f"checked {rep.ranges_checked} referenced ranges")
        print(f"orphan chunks (no layout references them, older than {rep.cutoff_s:g}s): "
              f"{len(rep.orphan_chunks)} ({format_size(sum(c[2] for c in rep.orphan_chunks))})")
        print(f"chunks with unreferenced bytes older than the cutoff: {len(rep.garbage_chunks)} "
              f"({format_size(sum(c[2] for c in rep.garbage_chunks))})")
        print(f"layouts pointing at missing bytes: {len(rep.missing_refs)}; failing checksum: "
              f"{len(rep.corrupt_refs)}")
        for k, sid, cid, off in (rep.missing_refs + rep.corrupt_refs)[:20]:
            print(f"  {k.decode(errors='backslashreplace')}: server {sid} chunk {cid:016x} offset {off}")
        if rep.repaired:
            print("repaired: " + ", ".join(f"{k} {v}" for k, v in rep.repaired.items()))
    return 0 if rep.apply or not rep.problems else 2


def format_scrub(r: ScrubReport) -> str:
    out = [f"{'applied' if r.apply else 'dry run (add --apply to repair and drop)'}, {r.seconds:.2f}s",
           f"verified: {r.ranges_checked} replicas ({format_size(r.bytes_verified)}) on "
           f"{r.servers_verified} servers"
           + (f"; not verified (not alive): servers {', '.join(map(str, r.servers_skipped))}"
              if r.servers_skipped else "")
           + (f"; not verified (its check failed, logged above): servers "
              f"{', '.join(map(str, r.servers_failed))}" if r.servers_failed else ""),
           f"bad:      {r.corrupt} failing their checksum, {r.missing} missing"]
    if r.apply:
        out.append(f"repaired: {r.repaired} of {r.repairable} from a good copy "
                   f"({format_size(r.bytes_copied)} copied; {r.repair_skipped} left for the next scrub)")
        out.append(f"dropped:  {r.replicas_dropped} replicas with no good copy on a live server; "
                   f"{r.keys_dropped} keys deleted")
    else:
        out.append(f"would repair {r.repairable} from a good copy; would drop {len(r.lost_keys)} "
                   "keys with no good copy")
    for k in r.lost_keys[:100]:
        out.append(f"  {'dropped' if r.apply else 'would drop'}: {k.decode(errors='backslashreplace')}")
    if len(r.lost_keys) > 100:
        out.append(f"  ... and {len(r.lost_keys) - 100} more (--json lists them all)")
    return "\n".join(out)


async def cmd_scrub(ns: argparse.Namespace) -> int:
    async with _collector(ns, _progress) as gc:
        rep = await scrub(gc, apply=ns.apply, rate_bytes=ns.rate)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(json.dumps(rep.to_dict()) if ns.json else format_scrub(rep))
    return 1 if rep.servers_failed else 0 if rep.apply or not (rep.missing or rep.corrupt) else 2


def format_drain(st: rpc.DrainState) -> str:
    if st.forgotten:
        return f"chunkserver {st.server_id}: drained and forgotten (stop it; its chunk files are garbage)"
    what = "draining" if st.draining else "not draining"
    return (f"chunkserver {st.server_id}: {what}, {st.extents_left} extents "
            f"({format_size(st.bytes_left)}) still on it")


async def cmd_decommission(ns: argparse.Namespace) -> int:
    async with _collector(ns, _progress) as gc:
        st = await gc.meta(rpc.GcDecommission(server_id=ns.server_id, start=not ns.status,
                                              cancel=ns.cancel))
        while ns.wait and not st.forgotten and st.draining:
            print(format_drain(st), flush=True)
            await gc.sync_usage()
            rep = await repair_step(gc, apply=True, rate_bytes=ns.repair_rate)
            st = await gc.meta(rpc.GcDecommission(server_id=ns.server_id, start=False))
            if not rep.extents_repaired and not st.forgotten:
                print(f"{format_drain(st)}: nothing more can be copied now (no live source or no "
                      "room); the GC daemon's repair step keeps trying", file=sys.stderr)
                return 1
    print(json.dumps(rpc.to_dict(st)) if ns.json else format_drain(st))
    return 0


async def cmd_pause(ns: argparse.Namespace) -> int:
    async with _collector(ns) as gc:
        paused = await gc.set_paused(ns.paused)
    print("gc paused" if paused else "gc active")
    return 0


async def cmd_daemon(ns: argparse.Namespace) -> int:
    cfg = from_options(GcConfig, ns, compact_threshold=float(ns.compact_threshold),
                       high_watermark=float(ns.high_watermark), low_watermark=float(ns.low_watermark))
    opts = PassOptions.from_config(cfg)
    async with GarbageCollector(cfg.meta, token=None, tls=cfg):
        pass  # fail fast on a wrong address or token
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"kvfs gc ready {cfg.meta}", flush=True)
    await run_daemon(cfg.meta, None, opts, cfg.interval_s, stop, tls=cfg)
    return 0


def add_arguments(gc: argparse.ArgumentParser) -> None:
    """``kvfs gc``'s subcommands and their arguments (its line in ``kvfs --help``: kvfs.cli)."""
    gsub = gc.add_subparsers(dest="gc_command", required=True)

    p = gsub.add_parser("status", help="per chunkserver: capacity, used, live, garbage, expired keys")
    _options(p)
    p.set_defaults(func=cmd_status)

    p = gsub.add_parser("run", help="one GC pass (dry run unless --apply); no phase flag = all phases")
    p.add_argument("--expire", action="store_true", help="remove expired keys")
    p.add_argument("--compact", action="store_true", help="compact chunks over --threshold, delete empty ones")
    p.add_argument("--threshold", type=parse_fraction, default=0.3, help="garbage ratio (default 0.3)")
    p.add_argument("--evict-to", type=parse_fraction, default=None, metavar="PCT",
                   help="evict LRU keys of servers over --high down to PCT (e.g. 80%%)")
    p.add_argument("--high", type=parse_fraction, default=0.9, help="high watermark (default 90%%)")
    p.add_argument("--grace", type=parse_duration, default=30.0,
                   help="keep unreferenced chunks this long first (default 30s)")
    p.add_argument("--rate", type=parse_rate, default=None, help="compaction copy limit, e.g. 200MiB/s")
    p.add_argument("--repair", action="store_true",
                   help="copy extents that lost a replica (server dead) to live servers")
    p.add_argument("--repair-rate", type=parse_rate, default=None,
                   help="repair copy limit, e.g. 100MiB/s (default: unlimited)")
    p.add_argument("--batch", type=int, default=10_000, help="expired keys per meta transaction")
    p.add_argument("--apply", action="store_true", help="act (default: dry run)")
    p.add_argument("--force", action="store_true", help="run even while GC is paused")
    _options(p)
    p.set_defaults(func=cmd_run)

    p = gsub.add_parser("fsck", help="orphan chunks, unreferenced bytes, missing/corrupt layouts")
    p.add_argument("--cutoff", type=parse_duration, default=3600.0,
                   help="only chunk files older than this (default 1h)")
    p.add_argument("--no-verify", action="store_true", help="skip reading back every referenced range")
    p.add_argument("--apply", action="store_true", help="repair (default: report)")
    _options(p)
    p.set_defaults(func=cmd_fsck)

    p = gsub.add_parser("scrub", help="verify every replica's checksum; repair bad ones, drop keys "
                                      "with no good copy (dry run unless --apply)")
    p.add_argument("--rate", type=parse_rate, default=parse_rate("100MiB/s"),
                   help="read and copy limit, e.g. 100MiB/s (the default), 0 for unlimited")
    p.add_argument("--apply", action="store_true", help="repair and drop (default: report)")
    _options(p)
    p.set_defaults(func=cmd_scrub)

    p = gsub.add_parser("decommission", help="drain a chunkserver (no new placements; repair "
                                             "copies its extents away), then forget it")
    p.add_argument("server_id", type=int, metavar="ID", help="the chunkserver's id (kvfs stat)")
    p.add_argument("--wait", action="store_true",
                   help="run repair steps here until it is drained and forgotten (else the GC "
                        "daemon's passes drain it)")
    p.add_argument("--repair-rate", type=parse_rate, default=None,
                   help="with --wait: copy limit, e.g. 100MiB/s (default: unlimited)")
    p.add_argument("--status", action="store_true", help="only show the drain's progress")
    p.add_argument("--cancel", action="store_true", help="stop draining; it takes writes again")
    _options(p)
    p.set_defaults(func=cmd_decommission)

    p = gsub.add_parser("pause", help="stop background GC passes (maintenance)")
    _options(p, json_flag=False)
    p.set_defaults(func=cmd_pause, paused=True)

    p = gsub.add_parser("resume", help="resume background GC passes")
    _options(p, json_flag=False)
    p.set_defaults(func=cmd_pause, paused=False)

    p = gsub.add_parser("daemon", help="run GC passes in the background (what kvfs up starts)")
    add_options(p, GcConfig)
    p.add_argument("--addr", dest="meta", default=argparse.SUPPRESS, help="same as --meta")
    p.set_defaults(func=cmd_daemon)
