"""``kvfs bench`` options: fio's names (``--rw``, ``--bs``, ``--iodepth``, ...) and their parsers.

Sizes and durations use the one parser in ``kvfs.units`` (fio's rule:
``4k`` = 4096).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Final

from kvfs.config import LOCAL_STORES, ClusterFsyncConfig, add_cluster_options
from kvfs.config import add_options as add_config_options
from kvfs.units import parse_duration, parse_size

from .runner import APIS, RWS, parse_distribution

__all__ = ["CLIENTS", "DEFAULT_RUNTIME_S", "MAX_REPEAT", "PEERS", "add_options", "size_arg"]

DEFAULT_RUNTIME_S: Final = 4.0
#: ``--compare`` peers, in column order.
PEERS: Final = ("file", "redis", "mooncake", "loopback", "fio")


def size_arg(text: str) -> int:
    """A positive size, ``4k`` = 4096 (``kvfs.units.parse_size``), as an argparse type."""
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _size_list(text: str) -> list[int]:
    return [size_arg(t) for t in text.split(",") if t.strip()]


def _choice_list(what: str, known: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list whose every item is one of ``known`` (argparse names the flag)."""

    def parse(text: str) -> list[str]:
        out = [t.strip() for t in text.split(",") if t.strip()]
        for item in out:
            if item not in known:
                raise argparse.ArgumentTypeError(f"unknown {what} {item!r} (known: {','.join(known)})")
        return out

    return parse


_rw_list = _choice_list("workload", RWS)
_peer_list = _choice_list("peer", PEERS)
_api_list = _choice_list("api", APIS)


#: ``--repeat``: the most passes of a comparison's cells
MAX_REPEAT: Final = 20

#: ``--client``: kvfs's async client (``AsyncClient``) and/or the blocking one (``kvfs.Client``)
CLIENTS: Final = ("async", "sync")


def _client_list(text: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    for c in out:
        if c not in CLIENTS:
            raise argparse.ArgumentTypeError(f"--client must be one of {'|'.join(CLIENTS)}, got {c!r}")
    if not out:
        raise argparse.ArgumentTypeError("--client needs at least one of async,sync")
    return list(dict.fromkeys(out))


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return v


def _distribution(text: str) -> str:
    try:
        parse_distribution(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _repeat(text: str) -> int:
    v = _positive_int(text)
    if v > MAX_REPEAT:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_REPEAT}: {text!r}")
    return v


def _seconds(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_options(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--rw", type=_rw_list, default=None, help="read|randread|write|randwrite|randrw (comma list)")
    a("--bs", type=_size_list, default=None, help="value size(s), e.g. 4k,64k,1m,16m")
    a("--iodepth", type=_positive_int, default=None, help="calls in flight per job (default 4, 2 for >=1m)")
    a("--numjobs", type=_positive_int, default=1, help="client processes per job (default 1)")
    a("--size", type=size_arg, default=None, help="key space per job in bytes (default 32-128MiB)")
    a("--runtime", type=_seconds, default=None, help=f"seconds per job (default {DEFAULT_RUNTIME_S:g})")
    a("--time_based", "--time-based", dest="time_based", action="store_true",
      help="run for --runtime even after one pass over the key space (default job set: on)")
    a("--ramp_time", "--ramp-time", dest="ramp_time", type=_seconds, default=0.0,
      help="seconds run before measuring")
    a("--rwmixread", type=int, default=50, help="randrw: percent of calls that read")
    a("--random_distribution", "--random-distribution", dest="random_distribution", type=_distribution,
      default="random",
      help="rand* jobs' keys: random (fio's default: every key once a pass, in a fresh order) or "
           "zipf:THETA (keys drawn by popularity, the i-th most popular with weight 1/i^THETA, as a "
           "cache's keys are asked for; e.g. zipf:1.2)")
    a("--batch", type=_positive_int, default=None, help="keys per call (default 128 <=4k, 32 <=64k, ...)")
    a("--api", type=_api_list, default=None,
      help="reads: get_many (values returned as bytes, default), get_into (into "
           "preallocated buffers; Mooncake's registered ones), exists_many (which keys exist; "
           "Redis: pipelined EXISTS) and/or match_prefix (how many leading keys exist), comma list")
    a("--client", type=_client_list, default=["async"], metavar="LIST",
      help="kvfs client(s): async (AsyncClient, default) and/or sync (the blocking kvfs.Client, "
           "called from --iodepth threads); with --compare, sync is the column kvfs-sync")
    a("--prefix-chain", "--prefix_chain", dest="prefix_chain", type=_positive_int, default=None,
      metavar="N", help="reads: chains of N blocks written by one put_many, read one chain per call")
    a("--output-format", "--output_format", dest="output_format", choices=("normal", "json"),
      default="normal")
    a("--json-out", "--json_out", dest="json_out", type=Path, default=None, metavar="FILE",
      help="also write the JSON report to FILE (the text still goes to stdout)")
    a("--compare", action="store_true",
      help="run the same jobs against redis, a file-per-key store, the loopback limit and fio")
    a("--peers", type=_peer_list, default=list(PEERS), metavar="LIST",
      help=f"--compare: the peers to run, comma list of {','.join(PEERS)} (default: all)")
    a("--repeat", type=_repeat, default=1, metavar="N",
      help=f"--compare: run every cell N times (1..{MAX_REPEAT}), every other pass in the reverse "
           "order of workloads and stores, and show the median pass of each (default 1)")
    a("--internal", action=argparse.BooleanOptionalAction, default=True,
      help="--compare: also the kvfs-internal comparisons (batcher on/off, prefix chains)")
    a("--cpu", action="store_true",
      help="CPU per key (us) and per GB (s) of the client, each chunkserver and meta (and of each "
           "peer's processes with --compare), from /proc/PID/stat over each job's measured phase, "
           "and the CPUs each used and waited for while runnable (schedstat), per second of it")
    a("--plot", type=Path, default=None, metavar="FILE.png",
      help="draw throughput vs value size and latency percentiles (needs matplotlib)")
    a("--progress", action=argparse.BooleanOptionalAction, default=None,
      help="progress line on stderr (default: when stderr is a terminal)")
    a("--reclaim", action=argparse.BooleanOptionalAction, default=None,
      help="embedded cluster: before each kvfs job (each kvfs cell of --compare) delete the "
           "bench's keys and the chunks they leave, at once (a GC pass with no grace), so each job "
           "draws on the memory the last one used, freed moments before, as a cache in steady state "
           "reuses what it evicts, not further down the machine's free memory, and pays for its "
           "own deletes (default: on with an embedded cluster; --addr: refused)")
    a("--cluster", choices=("inproc", "processes"), default="processes",
      help="embedded cluster: meta+chunkservers as child processes, as deployed (default), "
           "or in this process and event loop")
    a("--chunkservers", type=_positive_int, default=3,
      help="chunkservers of the embedded cluster (default 3)")
    a("--meta-store", dest="meta_store", choices=LOCAL_STORES, default=LOCAL_STORES[0],
      help=f"embedded cluster: where its meta keeps the index (meta's --store; default {LOCAL_STORES[0]})")
    add_config_options(p, ClusterFsyncConfig)  # --fsync: the embedded cluster's, as kvfs up's
    a("--dir", type=Path, default=None, help="work dir for the embedded cluster and peers")
    # --tls-*: the embedded cluster's too
    add_cluster_options(p, addr_help="cluster address (default: start an embedded cluster)")
    a("--gc", action="store_true",
      help="GC bench: reclaim rate after keys expire (--bs, --size per run), and randread 4k p99 "
           "with GC idle vs running against a churn (see bench/gcbench.py)")
    a("--gc-ttl", dest="gc_ttl", type=_seconds, default=1.0, help="--gc: ttl of the expiring keys")
    a("--gc-overwrite", dest="gc_overwrite", action="store_true",
      help="--gc: each reclaim key is first put without a ttl, then overwritten with --gc-ttl: the "
           "GC drops every one with a tombstone (its first value would outlive it)")
    a("--gc-churn-rate", dest="gc_churn_rate", type=size_arg, default=16 << 20,
      help="--gc: bytes/s the background churn writes (default 16MiB)")
    a("--job-spec", dest="job_spec", default=None, help=argparse.SUPPRESS)  # numjobs child
