"""The cluster under test: a running one (``--addr``) or an embedded one started for the run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvfs.address import token_from_file
from kvfs.config import (
    ClusterFsyncConfig,
    TlsConfig,
    from_options,
    fsync_argv,
    tls_argv,
    tls_fields,
)

__all__ = ["RECLAIM_DELETE_BATCH", "BenchTarget", "Reclaimed", "open_target"]

#: keys per ``delete_many`` of :meth:`BenchTarget.reclaim`
RECLAIM_DELETE_BATCH = 4096


@dataclass(frozen=True)
class Reclaimed:
    """What one :meth:`BenchTarget.reclaim` freed, and how long it took."""

    keys: int
    chunks: int
    bytes: int
    seconds: float
    mem_free_mib: int | None  # MemFree after it

    def text(self) -> str:
        return (f"reclaimed {self.keys} keys, {self.chunks} chunks, {self.bytes / 1e6:.0f} MB "
                f"in {self.seconds:.2f} s; MemFree {self.mem_free_mib} MiB")


@dataclass
class BenchTarget:
    """Where the kvfs clients connect; server read counters when the cluster is ours."""

    addr: str
    token: str | None
    cluster: Any = None
    embedded: str = ""
    admin_token: str | None = None  # the GC bench's (None: $KVFS_ADMIN_TOKEN or its file)
    tls: TlsConfig | None = None  # --tls-* (None: none, or $KVFS_TLS_*)

    def client(self, **config: Any) -> Any:
        from kvfs import AsyncClient

        return AsyncClient(self.addr, token=self.token, config=self._config(**config))

    async def blocking_client(self, **config: Any) -> Any:
        """The blocking ``kvfs.Client`` (its IO thread), connected off this event loop."""
        from kvfs import Client

        return await asyncio.to_thread(Client, self.addr, token=self.token, config=self._config(**config))

    def _config(self, **config: Any) -> Any:
        from kvfs.config import ClientConfig

        tls = tls_fields(self.tls) if self.tls is not None else {}
        return ClientConfig(**tls, **config)

    def server_pids(self) -> dict[str, int]:
        """meta and each chunkserver by pid, for ``--cpu``; {} unless they are our child processes."""
        if self.embedded != "processes":
            return {}
        out = {"meta": self.cluster.meta.pid}
        out.update((f"cs{i}", cs.pid) for i, cs in enumerate(self.cluster.chunkservers))
        return out

    async def reclaim(self) -> Reclaimed:
        """Delete every key of the bench's namespace (``KEY_NAMESPACE``), then the chunks left
        with no live bytes, at once: one GC pass with no grace (``grace_s=0``: no write is in
        flight between two jobs; no expiry, eviction or repair), whose chunk deletes free
        the chunks' page-cache pages; then the cluster's directories are synced (the unlinks
        committed, their blocks discarded).  ``kvfs bench --reclaim`` runs it before each kvfs job,
        so the job draws on memory freed moments before, as a cache in steady state reuses what
        it evicts, rather than on the machine's free memory, walked down job by job; and it is
        that job, not a peer's that follows, that runs while the disk still works off the
        deletes (on this VM a synced write job right after 2 GiB were deleted ran about a
        quarter slower: bench/RESULTS.md).
        Only for an embedded cluster (``admin_token``)."""
        from kvfs.gc.driver import GarbageCollector, PassOptions

        from .cpu import mem_free_mib
        from .runner import KEY_NAMESPACE

        if not self.embedded:
            raise ValueError("reclaim runs a GC pass on the embedded cluster only")
        t0 = time.perf_counter()
        kv = self.client()
        deleted = 0
        try:
            keys = [k.key for k in await kv.list(KEY_NAMESPACE)]
            for i in range(0, len(keys), RECLAIM_DELETE_BATCH):
                deleted += await kv.delete_many(keys[i:i + RECLAIM_DELETE_BATCH])
        finally:
            await kv.close()
        async with GarbageCollector(self.addr, token=self.admin_token, tls=self.tls) as gc:
            rep = await gc.run_pass(PassOptions(apply=True, grace_s=0.0, expire=False, evict=False,
                                                repair=False))
        await asyncio.to_thread(_sync_dirs, self.data_dir())
        return Reclaimed(deleted, rep.chunks_deleted, rep.bytes_reclaimed, time.perf_counter() - t0,
                         mem_free_mib())

    def data_dir(self) -> Path | None:
        """The embedded cluster's directory (meta's and each chunkserver's below it), or None."""
        c = self.cluster
        return getattr(c, "data", None) or getattr(c, "root", None)

    def server_reads(self) -> list[tuple[int, int]] | None:
        """(spans_read, readv_calls) per chunkserver, for an in-process cluster."""
        css = getattr(self.cluster, "chunkservers", None)
        if self.embedded != "inproc" or not css:
            return None
        return [(cs.store.spans_read, cs.readv_calls) for cs in css if cs is not None]


def _sync_dirs(root: Path | None) -> None:
    """fsync each chunkserver's chunk directory (``root/csN/chunks``): the journal commit of
    the chunks just unlinked there, with the discards of their blocks (ext4 ``-o discard``),
    ends here, not in the next job."""
    from kvfs.chunkserver.durability import fsync_dir

    for d in root.glob("cs*/chunks") if root is not None else ():
        fsync_dir(d)


@contextlib.asynccontextmanager
async def open_target(ns: argparse.Namespace, workdir: Path) -> AsyncIterator[BenchTarget]:
    """``--addr``'s cluster, or an embedded one (``--cluster``, ``--fsync``) in ``workdir``,
    stopped on exit."""
    tls = from_options(TlsConfig, ns)
    if ns.addr is not None:
        yield BenchTarget(ns.addr, token_from_file(ns.token_file), tls=tls)
        return
    if ns.cluster == "processes":
        from kvfs.launcher import ProcessCluster

        args = (*tls_argv(tls), *fsync_argv(from_options(ClusterFsyncConfig, ns)))
        pc = ProcessCluster(workdir / "cluster", ns.chunkservers, listen="127.0.0.1:0",
                            meta_args=(*args, "--store", ns.meta_store), chunkserver_args=args)
        await pc.start()
        try:
            yield BenchTarget(pc.addr, pc.token, pc, "processes", pc.admin_token, tls)
        finally:
            await pc.stop()
        return
    from kvfs.launcher import LocalCluster

    lc = LocalCluster(workdir / "cluster", ns.chunkservers,
                      tls=tls if tls.tls_cert is not None else None)
    lc.meta_config = replace(lc.meta_config, fsync=ns.fsync,
                             store=ns.meta_store)
    lc.cs_template = replace(lc.cs_template, fsync=ns.fsync)
    await lc.start()
    try:
        yield BenchTarget(lc.addr, lc.token, lc, "inproc", lc.admin_token, tls)
    finally:
        await lc.stop()
