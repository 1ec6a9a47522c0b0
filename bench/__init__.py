"""fio-style benchmark harness for kvfs and the stores it is compared with.

One io = one key (one value) read or written; a batched call of B keys records
B ios, each with the call's latency. Reports use fio's JSON field names.
"""

from .adapters import KvfsStore, kvfs_store
from .compare import Comparison, StoreFactory, compare, peer_factories
from .peers import FilePerKeyStore, LoopbackLimit, RedisStore, run_fio_file
from .runner import BenchError, JobResult, Workload, run_workload
from .stats import (
    FIO_VERSION,
    LatencyRecorder,
    format_job_text,
    format_report_text,
    job_json,
    report_json,
)
from .store import PeerUnavailable, Store

__all__ = [
    "FIO_VERSION",
    "BenchError",
    "Comparison",
    "FilePerKeyStore",
    "JobResult",
    "KvfsStore",
    "LatencyRecorder",
    "LoopbackLimit",
    "PeerUnavailable",
    "RedisStore",
    "Store",
    "StoreFactory",
    "Workload",
    "compare",
    "format_job_text",
    "format_report_text",
    "job_json",
    "kvfs_store",
    "peer_factories",
    "report_json",
    "run_fio_file",
    "run_workload",
]
