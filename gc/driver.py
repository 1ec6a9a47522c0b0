"""One GC pass, driven from outside meta and the chunkservers.

A pass: refresh chunk usage -> expire -> evict over the high watermark ->
compact chunks whose garbage ratio passes the threshold -> delete chunks no
layout references (after a grace period).  Each destructive step is a
compare-and-swap in meta (see :mod:`kvfs.meta.gc`), so a GC killed at any
point leaves every committed key readable and its leftovers reclaimable by
the next pass, and several GCs may run at once without harm.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvfs.address import lookup_token, parse_addr
from kvfs.config import GcConfig
from kvfs.errors import KVFSError, Unavailable
from kvfs.handshake import Role
from kvfs.rpc import Op
from kvfs.transport import Connection

log = logging.getLogger("kvfs.gc")

COMPACT_BATCH_BYTES = 64 * 1024 * 1024
VERIFY_BATCH_BYTES = 64 * 1024 * 1024

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class PassOptions:
    apply: bool = False
    expire: bool = True
    evict: bool = True
    compact: bool = True
    threshold: float = 0.3
    high: float = 0.9
    low: float = 0.8
    grace_s: float = 30.0
    rate_bytes: int | None = None
    expire_batch: int = 10_000

    @classmethod
    def from_config(cls, config: GcConfig) -> PassOptions:
        """The daemon's pass (``kvfs gc daemon``, ``kvfs up``): every phase, applied."""
        return cls(apply=True, threshold=config.compact_threshold, high=config.high_watermark,
                   low=config.low_watermark, grace_s=config.grace_s, rate_bytes=config.rate_bytes,
                   expire_batch=config.expire_batch)


@dataclass(kw_only=True)
class PassReport:
    apply: bool
    started: float = field(default_factory=time.time)
    duration_s: float = 0.0
    expired_keys: int = 0
    expired_bytes: int = 0
    evicted_keys: int = 0
    evicted_bytes: int = 0
    leased_skipped: int = 0
    chunks_compacted: int = 0
    bytes_copied: int = 0
    keys_relocated: int = 0
    relocations_lost: int = 0  # a concurrent overwrite/delete won the compare-and-swap
    chunks_deleted: int = 0
    bytes_reclaimed: int = 0
    compact_candidates: int = 0
    delete_candidates: int = 0
    reclaimable_bytes: int = 0  # dry run: what compaction + deletion would free
    waiting_grace: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class FsckReport:
    apply: bool
    cutoff_s: float
    orphan_chunks: list[list[int]] = field(default_factory=list)  # [server_id, chunk_id, bytes]
    garbage_chunks: list[list[int]] = field(default_factory=list)  # [server_id, chunk_id, garbage]
    missing_refs: list[list[Any]] = field(default_factory=list)  # [key, server_id, chunk_id, offset]
    corrupt_refs: list[list[Any]] = field(default_factory=list)
    ranges_checked: int = 0
    repaired: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("missing_refs", "corrupt_refs"):
            d[name] = [[k.decode(errors="backslashreplace"), *rest] for k, *rest in d[name]]
        return d

    @property
    def problems(self) -> int:
        return (len(self.orphan_chunks) + len(self.garbage_chunks) + len(self.missing_refs)
                + len(self.corrupt_refs))


class GarbageCollector:
    """``async with GarbageCollector(addr) as gc: await gc.run_pass(PassOptions(apply=True))``"""

    def __init__(self, addr: str | None = None, *, token: str | None = None,
                 progress: Progress | None = None, request_timeout_s: float = 300.0) -> None:
        self.addr = addr
        self._host, self._port = parse_addr(addr)
        self.token = lookup_token(token, addr=addr, role=Role.ADMIN)
        self.progress = progress
        self.request_timeout_s = request_timeout_s
        self._meta: Connection | None = None
        self._conns: dict[int, Connection] = {}
        self._addrs: dict[int, str] = {}
        self._usage: dict[int, dict[str, Any]] = {}
        self.cluster_id: str | None = None  # meta's, sent with every chunk deletion

    async def __aenter__(self) -> GarbageCollector:
        await self.meta(Op.PING, {})
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for c in [self._meta, *self._conns.values()]:
            if c is not None:
                c.close()
        self._meta = None
        self._conns.clear()

    def _progress(self, phase: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)

    # connections -----------------------------------------------------------------
    async def meta(self, op: Op, header: dict[str, Any]) -> dict[str, Any]:
        if self._meta is None or self._meta.is_closed:
            self._meta = await Connection.open(self._host, self._port, self.token,
                                               request_timeout_s=self.request_timeout_s)
        return (await self._meta.call(op, header)).header

    async def chunkserver(self, sid: int, op: Op, header: dict[str, Any]) -> dict[str, Any]:
        conn = self._conns.get(sid)
        if conn is None or conn.is_closed:
            if sid not in self._addrs:
                await self.servers()
            if sid not in self._addrs:
                raise Unavailable(f"chunkserver {sid} is not known to meta")
            host, port = parse_addr(self._addrs[sid], what="chunkserver address")
            conn = await Connection.open(host, port, self.token, request_timeout_s=self.request_timeout_s)
            self._conns[sid] = conn
        return (await conn.call(op, header)).header

    async def servers(self) -> list[tuple[int, str, bool]]:
        h = await self.meta(Op.SERVERS, {})
        self.cluster_id = h.get("cluster_id")
        out = [(int(s[0]), str(s[1]), bool(s[4])) for s in h["servers"]]
        for sid, addr, _ in out:
            if self._addrs.get(sid) not in (None, addr) and sid in self._conns:
                self._conns.pop(sid).close()
            self._addrs[sid] = addr
        return out

    async def sync_usage(self, *, mtimes: bool = False) -> dict[int, dict[str, Any]]:
        """Fresh chunk tables from every live chunkserver, forwarded to meta as a heartbeat."""
        out: dict[int, dict[str, Any]] = {}
        for sid, addr, alive in await self.servers():
            if not alive:
                continue
            try:
                st = await self.chunkserver(sid, Op.CHUNK_STATS, {"mtimes": mtimes})
            except Unavailable as exc:
                log.warning("chunkserver %d (%s) unavailable: %s", sid, addr, exc)
                continue
            out[sid] = self._usage[sid] = st
            await self.meta(Op.HEARTBEAT, {"server_id": sid, "addr": addr, "capacity": st["capacity"],
                                           "free": st["free"], "used": st["used"],
                                           "chunks": st["chunks"], "open": st.get("open"),
                                           "wanted": st.get("wanted", 0)})
        return out

    # admin ---------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        return await self.meta(Op.GC_STATUS, {})

    async def set_paused(self, paused: bool | None) -> bool:
        return bool((await self.meta(Op.GC_CONTROL, {"paused": paused}))["paused"])

    # one pass --------------------------------------------------------------------
    async def run_pass(self, opts: PassOptions) -> PassReport:
        t0 = time.perf_counter()
        report = PassReport(apply=opts.apply)
        await self.sync_usage()
        if opts.expire:
            await self.expire(opts, report)
        if opts.evict:
            await self.evict(opts, report)
        if opts.compact:
            await self.compact(opts, report)
        report.duration_s = time.perf_counter() - t0
        if opts.apply:
            await self.meta(Op.GC_REPORT, {"run": report.to_dict()})
        return report

    async def expire(self, opts: PassOptions, report: PassReport) -> None:
        if not opts.apply:
            h = await self.meta(Op.GC_EXPIRE, {"apply": False})
            report.expired_keys, report.expired_bytes = int(h["keys"]), int(h["bytes"])
            return
        total = int((await self.meta(Op.GC_EXPIRE, {"apply": False}))["keys"])
        while True:
            h = await self.meta(Op.GC_EXPIRE, {"apply": True, "limit": opts.expire_batch})
            report.expired_keys += int(h["keys"])
            report.expired_bytes += int(h["bytes"])
            self._progress("expire", report.expired_keys, max(total, report.expired_keys))
            if not h["more"] or not h["keys"]:
                break

    async def evict(self, opts: PassOptions, report: PassReport) -> None:
        # a dry run skipped the expire phase: pick as if it had run, as --apply would
        h = await self.meta(Op.GC_EVICT, {"high": opts.high, "low": opts.low, "apply": opts.apply,
                                          "after_expire": not opts.apply and opts.expire})
        report.evicted_keys += int(h["keys"])
        report.evicted_bytes += int(h["bytes"])
        report.leased_skipped += int(h["leased"])
        if h["keys"]:
            self._progress("evict", int(h["keys"]), int(h["keys"]))

    async def _plan(self, opts: PassOptions, threshold: float | None = None, *,
                    dry: bool = False) -> dict[str, Any]:
        """Meta's compaction plan; ``dry``: as if this pass's expire and evict phases had run."""
        h: dict[str, Any] = {"threshold": opts.threshold if threshold is None else threshold,
                             "grace_s": opts.grace_s, "high": opts.high,
                             "after_expire": dry and opts.expire}
        if dry and opts.evict:
            h["after_evict"] = [opts.high, opts.low]
        return await self.meta(Op.GC_PLAN, h)

    async def _would_seal(self, plan: dict[str, Any], opts: PassOptions) -> None:
        """Dry run: count the open chunks ``--apply`` would seal as what they then become
        (meta plans them as compact candidates if they hold live bytes, else as deletes)."""
        for sid, cid, written, live in plan["seal"]:
            try:
                h = await self.chunkserver(int(sid), Op.CHUNK_SEAL, {
                    "chunk_id": cid, "idle_s": opts.grace_s, "apply": False})
            except Unavailable:
                continue  # --apply could not seal it either
            if h["sealed"]:
                if live > 0:
                    plan["compact"].append([sid, cid, written, live])
                else:
                    plan["delete"].append([sid, cid, written])

    async def compact(self, opts: PassOptions, report: PassReport) -> None:
        # a dry run skipped the expire and evict phases: plan as if they had run, as --apply would
        plan = await self._plan(opts, dry=not opts.apply)
        if not opts.apply and plan["seal"]:
            await self._would_seal(plan, opts)
        if opts.apply and plan["seal"]:
            sealed = 0
            for sid, cid, _written, _live in plan["seal"]:
                try:
                    h = await self.chunkserver(int(sid), Op.CHUNK_SEAL, {"chunk_id": cid,
                                                                      "idle_s": opts.grace_s})
                    sealed += bool(h["sealed"])
                except Unavailable as exc:
                    log.warning("cannot seal chunk %016x on server %d: %s", cid, sid, exc)
            if sealed:
                await self.sync_usage()
                plan = await self._plan(opts)
        report.compact_candidates = len(plan["compact"])
        report.delete_candidates = len(plan["delete"])
        report.waiting_grace = int(plan["waiting"])
        if not opts.apply:
            report.reclaimable_bytes = (sum(w - live for _, _, w, live in plan["compact"])
                                        + sum(w for _, _, w in plan["delete"]))
            return
        by_server: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for sid, cid, _written, live in plan["compact"]:
            by_server[int(sid)].append((int(cid), int(live)))
        await self.compact_chunks(by_server, opts, report)
        plan = await self._plan(opts)
        report.waiting_grace = int(plan["waiting"])
        await self.delete_chunks(plan["delete"], report)

    async def compact_chunks(self, by_server: dict[int, list[tuple[int, int]]], opts: PassOptions,
                             report: PassReport) -> None:
        """Copy live records of each chunk into new chunks, then switch layouts (CAS)."""
        todo = sum(len(v) for v in by_server.values())
        t0 = time.monotonic()
        for sid, chunks in by_server.items():
            # under space pressure copy a little at a time: each batch needs its live bytes free
            free = int(self._usage.get(sid, {}).get("free", COMPACT_BATCH_BYTES))
            cap = max(1, min(COMPACT_BATCH_BYTES, free // 2))
            batches: list[list[int]] = [[]]
            size = 0
            for cid, live in chunks:
                if batches[-1] and size + live > cap:
                    batches.append([])
                    size = 0
                batches[-1].append(cid)
                size += live
            for batch in batches:
                try:
                    await self._compact_batch(sid, batch, report)
                    if opts.grace_s <= 0:  # no grace: free the space before the next batch
                        await self.delete_chunks([[sid, c] for c in batch], report)
                except KVFSError as exc:
                    log.warning("compaction of %d chunks on server %d failed: %s", len(batch), sid, exc)
                    continue
                self._progress("compact", report.chunks_compacted, todo)
                if opts.rate_bytes:
                    ahead = report.bytes_copied / opts.rate_bytes - (time.monotonic() - t0)
                    if ahead > 0:
                        await asyncio.sleep(ahead)

    async def _compact_batch(self, sid: int, chunks: list[int], report: PassReport) -> None:
        refs = (await self.meta(Op.GC_CHUNK_REFS, {"chunks": chunks}))["refs"]
        sources: list[tuple[int, list[list[int]]]] = []
        keys: list[list[bytes]] = []
        for cid in chunks:
            rs = sorted(refs.get(cid, []), key=lambda r: r[1])
            sources.append((cid, [[off, ln] for _, off, ln, _ in rs]))
            keys.append([k for k, _, _, _ in rs])
        res = await self.chunkserver(sid, Op.CHUNK_COMPACT, {"sources": [list(x) for x in sources]})
        new = res["chunk_id"]
        if new is None:
            return
        moves = []
        for (cid, wanted), ks, locs in zip(sources, keys, res["locations"], strict=True):
            for k, (off, _), loc in zip(ks, wanted, locs, strict=True):
                if loc is not None:
                    moves.append([k, cid, off, loc])
        rel = await self.meta(Op.GC_RELOCATE, {"server_id": sid, "new_chunk": new,
                                               "new_size": res["size"], "moves": moves})
        report.chunks_compacted += len(chunks)
        report.bytes_copied += int(res["size"])
        report.keys_relocated += int(rel["moved"])
        report.relocations_lost += int(rel["skipped"])
        await self.meta(Op.GC_DELETED, {"server_id": sid, "deleted": {}, "compacted": len(chunks),
                                         "copied": int(res["size"])})

    async def delete_chunks(self, items: list[list[int]], report: PassReport) -> None:
        """Retire chunks no layout references (CAS in meta), then unlink their files."""
        by_server: dict[int, list[int]] = defaultdict(list)
        for sid, cid, *_ in items:
            by_server[int(sid)].append(int(cid))
        for sid, cids in by_server.items():
            retired = (await self.meta(Op.GC_RETIRE, {"server_id": sid, "chunks": cids}))["retired"]
            if not retired:
                continue
            try:
                deleted = (await self.chunkserver(sid, Op.CHUNK_DELETE, {
                    "chunks": retired, "cluster_id": self.cluster_id}))["deleted"]
            except Unavailable as exc:
                log.warning("cannot delete %d chunks on server %d now: %s", len(retired), sid, exc)
                continue
            await self.meta(Op.GC_DELETED, {"server_id": sid, "deleted": deleted})
            report.chunks_deleted += len(deleted)
            report.bytes_reclaimed += sum(int(n) for n in deleted.values())
            self._progress("delete", report.chunks_deleted, len(items))

    # fsck ------------------------------------------------------------------------
    async def fsck(self, *, cutoff_s: float = 3600.0, apply: bool = False,
                   verify: bool = True) -> FsckReport:
        """Orphan chunks, unreferenced bytes older than ``cutoff_s``, layouts pointing at missing
        or corrupt bytes.  With ``apply``: delete orphans, compact garbage, drop bad replicas."""
        rep = FsckReport(apply=apply, cutoff_s=cutoff_s)
        stats = await self.sync_usage(mtimes=True)
        now = time.time()
        old = {(sid, int(c)) for sid, st in stats.items()
               for c, t in st.get("mtimes", {}).items() if now - float(t) >= cutoff_s}
        plan = await self.meta(Op.GC_PLAN, {"threshold": 0.0, "grace_s": 0.0, "high": 1.0})
        rep.orphan_chunks = [[int(s), int(c), int(w)] for s, c, w in plan["delete"] if (int(s), int(c)) in old]
        rep.garbage_chunks = [[int(s), int(c), int(w) - int(live)] for s, c, w, live in plan["compact"]
                              if (int(s), int(c)) in old]
        if verify:
            for sid in stats:
                refs = (await self.meta(Op.GC_CHUNK_REFS, {"server_id": sid}))["refs"]
                flat = [(k, int(c), int(off), int(ln), int(crc))
                        for c, rs in refs.items() for k, off, ln, crc in rs]
                i = 0
                while i < len(flat):
                    j, size = i, 0
                    while j < len(flat) and (j == i or size + flat[j][3] <= VERIFY_BATCH_BYTES):
                        size += flat[j][3]
                        j += 1
                    batch = flat[i:j]
                    h = await self.chunkserver(sid, Op.CHUNK_VERIFY, {
                        "ranges": [[c, off, ln, crc] for _, c, off, ln, crc in batch]})
                    for idx in h["missing"]:
                        k, c, off, _, _ = batch[idx]
                        rep.missing_refs.append([k, sid, c, off])
                    for idx in h["bad"]:
                        k, c, off, _, _ = batch[idx]
                        rep.corrupt_refs.append([k, sid, c, off])
                    rep.ranges_checked += len(batch)
                    self._progress(f"verify server {sid}", j, len(flat))
                    i = j
        if apply:
            pr = PassReport(apply=True)
            bad = rep.missing_refs + rep.corrupt_refs
            if bad:
                h = await self.meta(Op.GC_DROP_REPLICAS, {"items": bad})
                rep.repaired["replicas_dropped"] = int(h["dropped"])
                rep.repaired["keys_deleted"] = int(h["deleted_keys"])
            by_server: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for sid, cid, _ in rep.garbage_chunks:
                by_server[sid].append((cid, 0))
            await self.compact_chunks(by_server, PassOptions(apply=True), pr)
            await self.delete_chunks(rep.orphan_chunks, pr)
            rep.repaired["chunks_compacted"] = pr.chunks_compacted
            rep.repaired["chunks_deleted"] = pr.chunks_deleted
            rep.repaired["bytes_reclaimed"] = pr.bytes_reclaimed
        return rep


async def run_daemon(addr: str | None, token: str | None, opts: PassOptions, interval_s: float,
                     stop: asyncio.Event, *, on_pass: Callable[[PassReport], None] | None = None) -> None:
    """Run a pass every ``interval_s`` until ``stop`` is set; skips passes while GC is paused."""
    gc = GarbageCollector(addr, token=token)
    try:
        while not stop.is_set():
            try:
                paused = await gc.set_paused(None)
                if not paused:
                    report = await gc.run_pass(opts)
                    if report.expired_keys or report.evicted_keys or report.chunks_deleted:
                        log.info("gc pass: expired %d, evicted %d, compacted %d chunks, reclaimed %d bytes",
                                 report.expired_keys, report.evicted_keys, report.chunks_compacted,
                                 report.bytes_reclaimed)
                    if on_pass is not None:
                        on_pass(report)
            except KVFSError as exc:
                log.warning("gc pass failed: %s", exc)
                gc.close()
            try:
                async with asyncio.timeout(interval_s):
                    await stop.wait()
            except TimeoutError:
                pass
    finally:
        gc.close()
