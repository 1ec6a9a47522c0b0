"""vLLM KV-offload tiering on kvfs: a ``SecondaryTierManager`` loaded by module path.

In ``--kv-transfer-config`` (``OffloadingConnector`` with ``spec_name:
TieringOffloadingSpec``), as one of ``kv_connector_extra_config.secondary_tiers``::

    {"type": "KvfsTier", "module_path": "kvfs.integrations.vllm",
     "addr": "kvfs://10.0.0.1:7070", "timeout_s": 5}

The other keys are :class:`kvfs.config.EngineConfig` fields (``addr``, ``token``,
``namespace``, ``timeout_s``, ``connect_timeout_s``, ``lease_s``, ``ttl_s``), plus vLLM's own
``locality`` and ``backpressure``.

One kvfs key per offloaded chunk: ``namespace/`` + the hex of vLLM's offload key (block hash
and KV-cache group).  The default namespace is vLLM's own fingerprint of the layout (model,
dtype, tokens per hash, blocks per chunk, parallelism, KV-cache groups: the name its ``fs``
tier gives the folder), so engines that would produce the same bytes share keys and others
never do.  A chunk's value is its row of the primary (CPU) tier, read and written in place.

Nothing blocks the scheduler: a store is one ``put_many`` and a load one ``get_into``
submitted to kvfs's IO thread and collected by ``get_finished_jobs``; a load reports which
keys arrived (``successful_keys``) when only some did.  Lookups go through vLLM's
``AsyncLookupManager``: the keys looked up in a step are checked with one ``exists_many`` per
request (leasing the hits for ``lease_s``, so eviction leaves them until they are loaded),
off the scheduler thread (in vLLM's lookup thread, on the client's own meta sockets: no hop
to kvfs's IO thread), and answer ``RETRY`` until then.  A dead or slow cluster
turns into misses and failed jobs within a few ``timeout_s``, never an exception into vLLM.
"""

from __future__ import annotations

import concurrent.futures
import time
from binascii import hexlify
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from kvfs.config import EngineConfig, from_mapping
from kvfs.integrations._common import SOFT_ERRORS, log, open_client
from kvfs.prefix import namespaced


def default_namespace(offloading_spec: Any) -> str:
    """``vllm/<model>_<digest>_r<rank>``: vLLM's own name for this layout (``FileMapper``,
    as its ``fs`` tier uses it), so only engines storing identical bytes share keys."""
    mapper = FileMapper.from_offloading_spec(
        root_dir="vllm", offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True)
    return f"{mapper.base_path}_r{mapper.rank}"


@dataclass
class _Job:
    future: concurrent.futures.Future[Any]
    keys: list[OffloadKey]
    is_load: bool
    submitted: float


class _Lookups(AsyncLookupManager):
    """vLLM's lookup state machine; the probe of a step's keys is one ``exists_many``."""

    def __init__(self, tier: KvfsTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        try:  # vLLM's lookup thread waits for it: asked in that thread (no hop to kvfs's)
            return tier.client.exists_many(tier.kvfs_keys(keys),  # hits leased
                                           lease_s=tier.config.lease_s)  # until loaded
        except SOFT_ERRORS as exc:
            log.warning("kvfs vLLM tier: lookup of %d chunks failed (misses): %s", len(keys), exc)
            return [False] * len(keys)


class KvfsTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, locality: str | None = None,
                 **settings: Any) -> None:
        """``settings``: the tier config's other keys, each an :class:`EngineConfig` field
        (an unknown one is refused by name)."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.config = from_mapping(EngineConfig, settings)
        self.namespace = self.config.namespace or default_namespace(offloading_spec)
        self._prefix = namespaced(self.namespace, "")  # what comes before each key's hex
        self.client = open_client(self.config)
        # the primary tier as flat bytes: chunk c is [c * block_size_bytes, +block_size_bytes)
        self._flat = primary_kv_view.cast("B")
        self._jobs: dict[JobId, _Job] = {}
        self._lookups = _Lookups(self)

    def kvfs_key(self, key: OffloadKey) -> bytes:
        return self._prefix + hexlify(key)

    def kvfs_keys(self, keys: Iterable[OffloadKey]) -> list[bytes]:
        """:meth:`kvfs_key` of each key, in C (no Python call per key)."""
        return list(map(self._prefix.__add__, map(hexlify, keys)))

    def _row(self, chunk_id: Any) -> memoryview:
        start = int(chunk_id) * self.block_size_bytes
        if not 0 <= start < len(self._flat):
            raise ValueError(f"chunk id {chunk_id} is outside the primary tier")
        return self._flat[start : start + self.block_size_bytes]

    # lookups -----------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # transfers -----------------------------------------------------------------------
    def _submit(self, job: TransferJob, is_load: bool) -> None:
        keys = list(job.keys)
        rows = [self._row(c) for c in job.chunk_ids]
        if len(rows) != len(keys):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(rows)} chunk ids")
        kv = self.kvfs_keys(keys)
        try:
            if is_load:
                fut: concurrent.futures.Future[Any] = self.client.submit_get_into(kv, rows)
            else:
                # block keys name their content: one stored already (another engine) is skipped
                fut = self.client.submit_put_many(zip(kv, rows, strict=True),
                                                  ttl=self.config.ttl_s, if_absent=True)
        except SOFT_ERRORS as exc:  # a closed client: the job fails, reported as usual
            fut = concurrent.futures.Future()
            fut.set_exception(exc)
        self._jobs[job.job_id] = _Job(fut, keys, is_load, time.monotonic())

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = [(jid, job) for jid, job in self._jobs.items() if job.future.done()]
        results = []
        for jid, job in done:
            del self._jobs[jid]
            results.append(self._result(jid, job))
        return results

    def _result(self, job_id: JobId, job: _Job) -> JobResult:
        took = time.monotonic() - job.submitted
        size = self.block_size_bytes
        exc = job.future.exception()
        if exc is not None:
            if not isinstance(exc, SOFT_ERRORS):
                raise exc
            log.warning("kvfs vLLM tier: %s of %d chunks failed: %s",
                        "load" if job.is_load else "store", len(job.keys), exc)
            if job.is_load:
                self._lookups.mark_miss(job.keys)
            return JobResult(job_id=job_id, success=False, transfer_time=took)
        if not job.is_load:  # bytes sent: the blocks not stored already
            written: list[bool] = job.future.result()
            return JobResult(job_id=job_id, success=True, transfer_time=took,
                             transfer_bytes=size * sum(written))
        sizes: list[int] = job.future.result()
        ok = [k for k, n in zip(job.keys, sizes, strict=True) if n == size]
        if len(ok) == len(job.keys):
            return JobResult(job_id=job_id, success=True, transfer_time=took,
                             transfer_bytes=size * len(ok))
        okset = set(ok)
        self._lookups.mark_miss([k for k in job.keys if k not in okset])
        return JobResult(job_id=job_id, success=False, successful_keys=tuple(ok) or None,
                         transfer_time=took, transfer_bytes=size * len(ok) or None)

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        """Wait for every submitted job; none is cut short (kvfs's RPC timeouts bound each)."""
        concurrent.futures.wait([job.future for job in self._jobs.values()])

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self.drain_jobs()
        self.client.close()
        self._flat.release()  # vLLM closes the primary tier's mmap next
