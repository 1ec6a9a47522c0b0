"""Baseline stores the bench compares kvfs with, one module per peer, behind ``Store``.

* ``FilePerKeyStore`` (``file_per_key``): one file per key, write = tmp file +
  rename (SGLang HiCacheFile / LMCache local-disk style).
* ``RedisStore`` (``redis_server``): its own ``redis-server`` subprocess;
  MSET / MGET per batch.
* ``LoopbackLimit`` (``loopback``): not a store but the ceiling: the same bytes
  per batch moved over one loopback TCP connection with no storage behind it.
* ``MooncakeStore`` (``mooncake``): Mooncake Store over TCP: a
  ``mooncake_master`` and one ``mooncake_client`` segment process;
  ``batch_put_from`` / ``batch_get_into`` with registered buffers.
* ``run_fio_file`` (``fio``): the real ``fio`` binary on a file, for the
  raw-disk row.

A peer that cannot run here raises ``PeerUnavailable(reason)``; callers print
``skipped: <reason>``.
"""

from ..store import PeerUnavailable, Store
from .file_per_key import FilePerKeyStore
from .fio import run_fio_file
from .loopback import LoopbackLimit
from .mooncake import MooncakeStore
from .redis_server import RedisStore

__all__ = [
    "FilePerKeyStore",
    "LoopbackLimit",
    "MooncakeStore",
    "PeerUnavailable",
    "RedisStore",
    "Store",
    "run_fio_file",
]
