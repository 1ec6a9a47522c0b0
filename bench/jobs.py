"""The jobs ``kvfs bench`` runs: ``--rw`` x ``--bs``, or the default job set; their names."""

from __future__ import annotations

import argparse
from typing import Final

from .options import DEFAULT_RUNTIME_S
from .runner import KEY_NAMESPACE, RW, Workload

__all__ = ["API_SUFFIX", "CHAIN_BLOCKS", "CHAIN_BS", "DEFAULT_JOBS", "build_workloads", "describe", "human_bs"]

# (rw, bs, batch, iodepth, key-space bytes): the README's main job set.
DEFAULT_JOBS: Final[tuple[tuple[RW, int, int, int, int], ...]] = (
    ("randread", 4 << 10, 128, 4, 32 << 20),
    ("randread", 64 << 10, 32, 4, 64 << 20),
    ("read", 1 << 20, 4, 2, 64 << 20),
    ("read", 16 << 20, 1, 2, 128 << 20),
    ("write", 4 << 10, 128, 4, 32 << 20),
    ("write", 64 << 10, 128, 2, 64 << 20),
)
#: a read job's name says the API it reads with (get_many: nothing)
API_SUFFIX: Final = {"get_many": "", "get_into": "-into", "exists_many": "-exists", "match_prefix": "-match"}
CHAIN_BLOCKS: Final = 64
CHAIN_BS: Final = 64 << 10


def human_bs(nbytes: int, *, iec: bool = False) -> str:
    """fio-style block size: 4096 -> ``4k`` (``4KiB`` with ``iec``), 1048576 -> ``1m``."""
    for shift, short, long in ((30, "g", "GiB"), (20, "m", "MiB"), (10, "k", "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{long if iec else short}"
    return f"{nbytes}B" if iec else str(nbytes)


def describe(wl: Workload) -> str:
    return f"{wl.rw} bs={human_bs(wl.bs, iec=True)} batch={wl.batch} qd={wl.iodepth}"


def _default_batch(bs: int) -> int:
    if bs <= 4 << 10:
        return 128
    if bs <= 64 << 10:
        return 32
    if bs < 16 << 20:
        return 4
    return 1


def _default_size(bs: int) -> int:
    return 128 << 20 if bs >= 16 << 20 else 32 << 20 if bs <= 4 << 10 else 64 << 20


def _job(
    rw: str, bs: int, batch: int, iodepth: int, size: int, ns: argparse.Namespace, time_based: bool,
    api: str = "get_many",
) -> Workload:
    rw_t: RW = rw  # type: ignore[assignment]
    runtime = ns.runtime if ns.runtime is not None else DEFAULT_RUNTIME_S
    chain = ns.prefix_chain if rw in ("read", "randread") else None
    if chain is not None:
        batch = chain
    nkeys = max(batch, size // bs)
    if chain is not None:
        nkeys = max(chain, nkeys // chain * chain)
    name = f"{rw}-{human_bs(bs)}-b{batch}" + (f"-chain{chain}" if chain else "") + API_SUFFIX[api]
    return Workload(
        name=name,
        rw="read" if chain is not None else rw_t,
        bs=bs,
        batch=batch,
        iodepth=iodepth,
        nkeys=nkeys,
        runtime_s=runtime,
        time_based=time_based,
        ramp_time_s=ns.ramp_time,
        rwmixread=ns.rwmixread,
        random_distribution=ns.random_distribution,
        key_prefix=KEY_NAMESPACE + f"{name}/".encode(),
        prefill_timeout_s=max(120.0, 4 * runtime),
        grace_s=30.0,
        api=api,  # type: ignore[arg-type]
    )


def build_workloads(ns: argparse.Namespace) -> list[Workload]:
    """``--rw`` x ``--bs`` (or the default job set), each read once per ``--api``."""
    apis = getattr(ns, "api", None) or ["get_many"]
    return [
        _job(wl.rw, wl.bs, wl.batch, wl.iodepth, wl.size_bytes, ns, wl.time_based, api)
        if api != "get_many" else wl
        for wl in _base_workloads(ns)
        for api in (apis if wl.reads and wl.rw != "randrw" else ["get_many"])
    ]


def _base_workloads(ns: argparse.Namespace) -> list[Workload]:
    if ns.rw is None and ns.bs is None:
        # the default job set is time based unless --size alone bounds it
        tb = ns.time_based or ns.size is None
        return [
            _job(rw, bs, ns.batch or batch, ns.iodepth or qd, ns.size or size, ns, tb)
            for rw, bs, batch, qd, size in DEFAULT_JOBS
        ]
    rws = ns.rw or ["randread"]
    bss = ns.bs or [4 << 10]
    return [
        _job(
            rw,
            bs,
            ns.batch or _default_batch(bs),
            ns.iodepth or (2 if bs >= 1 << 20 else 4),
            ns.size or _default_size(bs),
            ns,
            ns.time_based,
        )
        for rw in rws
        for bs in bss
    ]
