"""The cluster under test: a running one (``--addr``) or an embedded one started for the run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

__all__ = ["BenchTarget", "open_target"]


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

    def server_reads(self) -> list[tuple[int, int]] | None:
        """(spans_read, readv_calls) per chunkserver, for an in-process cluster."""
        css = getattr(self.cluster, "chunkservers", None)
        if self.embedded != "inproc" or not css:
            return None
        return [(cs.store.spans_read, cs.readv_calls) for cs in css if cs is not None]


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
                            meta_args=args, chunkserver_args=args)
        await pc.start()
        try:
            yield BenchTarget(pc.addr, pc.token, pc, "processes", pc.admin_token, tls)
        finally:
            await pc.stop()
        return
    from kvfs.launcher import LocalCluster

    lc = LocalCluster(workdir / "cluster", ns.chunkservers,
                      tls=tls if tls.tls_cert is not None else None)
    lc.meta_config = replace(lc.meta_config, fsync=ns.fsync)
    lc.cs_template = replace(lc.cs_template, fsync=ns.fsync)
    await lc.start()
    try:
        yield BenchTarget(lc.addr, lc.token, lc, "inproc", lc.admin_token, tls)
    finally:
        await lc.stop()
