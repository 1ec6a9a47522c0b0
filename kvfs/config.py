"""Configuration, written once: a frozen dataclass per service.

CLI options are derived from the fields (:func:`add_options` /
:func:`from_options`): ``heartbeat_interval_s`` becomes
``--heartbeat-interval`` and accepts ``500ms``/``5min``; ``*_bytes`` fields
accept ``64MiB``.  Each field's ``help`` lives in its metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from kvfs.address import parse_addr
from kvfs.units import parse_duration, parse_size


def opt(help: str, default: Any = dataclasses.MISSING, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True, kw_only=True)
class MetaConfig:
    data: Path = opt("data directory (SQLite store, token)")
    listen: str = opt("HOST:PORT to listen on (port 0 picks a free one)", "127.0.0.1:7070")
    token: str | None = opt("cluster token (default: $KVFS_TOKEN, else DATA/token)", None)
    heartbeat_timeout_s: float = opt("a chunkserver silent this long is dead", 10.0)
    default_ttl_s: float | None = opt("TTL for puts that give none (default: no expiry)", None)
    access_flush_interval_s: float = opt("how often last-access times are written", 5.0)


@dataclass(frozen=True, kw_only=True)
class ChunkServerConfig:
    data: Path = opt("data directory (chunk files)")
    meta: str = opt("address of the meta service", "kvfs://127.0.0.1:7070")
    listen: str = opt("HOST:PORT to listen on (port 0 picks a free one)", "127.0.0.1:0")
    advertise: str | None = opt("HOST:PORT clients should use (default: the listen address)", None)
    token: str | None = opt("cluster token (default: $KVFS_TOKEN, else the token file)", None)
    chunk_bytes: int = opt("seal a chunk file at this size", 64 * 1024 * 1024)
    capacity_bytes: int | None = opt("capacity to report (default: the disk's size)", None)
    heartbeat_interval_s: float = opt("how often to report to meta", 1.0)
    io_threads: int = opt("threads doing preadv/pwritev", 4)
    merge_gap_bytes: int = opt("read ranges closer than this as one span", 64 * 1024)
    fsync: bool = opt("fsync chunk files after each append", False)


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    stripe_bytes: int = opt("values larger than this are striped across servers", 1024 * 1024)
    replicas: int = opt("copies of each extent, on distinct servers", 1)
    connect_timeout_s: float = opt("give up connecting after this long", 5.0)
    request_timeout_s: float = opt("give up on an RPC after this long", 60.0)
    layout_cache_entries: int = opt("immutable layouts kept to skip meta lookups", 100_000)
    put_group_bytes: int = opt("small values of one put_many stay together on one server in "
                               "runs up to this size; further runs go to the next servers",
                               16 * 1024 * 1024)
    max_rpc_bytes: int = opt("split appends larger than this", 256 * 1024 * 1024)
    max_read_rpc_bytes: int = opt("split reads from one server larger than this", 16 * 1024 * 1024)
    servers_refresh_s: float = opt("re-read the chunkserver list this often", 2.0)
    evict_on_full: bool = opt("when a write finds the cluster full, ask meta for a GC pass and retry once", True)
    batch: bool = opt("coalesce concurrent single-key get()/exists() calls into batches", True)
    batch_window_s: float = opt("wait this long for more keys (0: those issued this loop tick)", 0.0)
    batch_max_keys: int = opt("flush a batch at this many keys, without waiting", 128)
    batch_max_bytes: int = opt("flush a batch when its known value sizes reach this", 64 * 1024 * 1024)


T = TypeVar("T")


def _flag(name: str) -> str:
    for suffix in ("_s",):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith("_bytes") and name != "chunk_bytes" and name != "stripe_bytes":
        name = name[: -len("_bytes")]
    return "--" + name.replace("_", "-")


def arg_type(parse: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type``: its ValueError becomes the option's one-line message
    (argparse would otherwise print ``invalid <function name> value``)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = what
    return convert


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise ValueError(f"must be at least 1, got {n}")
    return n


SIZE = arg_type(parse_size, "size")
DURATION = arg_type(parse_duration, "duration")
POSITIVE_INT = arg_type(_positive_int, "count")


def add_options(parser: argparse.ArgumentParser, cls: type[Any], *, skip: tuple[str, ...] = ()) -> None:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        typ = hints[f.name]
        required = f.default is dataclasses.MISSING
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help", "")}
        if typ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = f.default
            kwargs["help"] += f" (default: {'yes' if f.default else 'no'})"
        else:
            kwargs["required"] = required
            kwargs["default"] = None if required else f.default
            if f.name.endswith("_s"):
                kwargs["type"] = DURATION
                kwargs["metavar"] = "DURATION"
            elif f.name.endswith("_bytes"):
                kwargs["type"] = SIZE
                kwargs["metavar"] = "SIZE"
            elif typ in (int, int | None):
                kwargs["type"] = POSITIVE_INT if f.metadata.get("positive") else int
            elif typ in (Path, Path | None):
                kwargs["type"] = Path
            if not required and f.default is not None:
                kwargs["help"] += f" (default: {f.default})"
        parser.add_argument(_flag(f.name), **kwargs)


def from_options(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if hasattr(ns, f.name)}
    values.update(overrides)
    return cls(**values)


@dataclass(frozen=True, kw_only=True)
class GcConfig:
    meta: str = opt("address of the meta service", "kvfs://127.0.0.1:7070")
    token: str | None = opt("cluster token (default: $KVFS_TOKEN, else the token file)", None)
    interval_s: float = opt("time between background GC passes", 10.0)
    expire_batch: int = opt("expired keys removed per meta transaction", 10_000)
    compact_threshold: float = opt("compact a sealed chunk whose garbage ratio passes this", 0.3)
    high_watermark: float = opt("evict when a chunkserver's used/capacity passes this", 0.9)
    low_watermark: float = opt("evict least recently used keys down to this used/capacity", 0.8)
    grace_s: float = opt("keep an unreferenced chunk this long so in-flight reads finish", 30.0)
    rate_bytes: int | None = opt("compaction copy rate limit in bytes/s (default: unlimited)", None)


@dataclass(frozen=True, kw_only=True)
class UpConfig:
    """`kvfs up`: meta, N chunkservers and the GC daemon as supervised child processes."""

    data: Path = opt("data directory (one sub-directory per service)", Path("kvfs-data"))
    chunkservers: int = opt("number of chunkserver processes", 3, positive=True)
    listen: str = opt("HOST:PORT for meta (port 0 picks a free one)", "127.0.0.1:7070")
    default_ttl_s: float | None = opt("TTL for puts that give none, e.g. 1h (default: no expiry)",
                                      None)
    capacity_bytes: int | None = opt("capacity per chunkserver, e.g. 10GiB (default: the disk's "
                                     "size)", None)
    gc: bool = opt("run the GC daemon", True)
    gc_interval_s: float | None = opt("time between GC passes, e.g. 10s (default: the daemon's)",
                                      None)
    restart: bool = opt("restart a service that exits, on the same data dir", True)
    restart_backoff_s: float = opt("wait before the first restart; doubled per quick failure", 0.5)
    restart_backoff_max_s: float = opt("longest wait between restarts", 30.0)
    restart_stable_s: float = opt("a service up this long counts as healthy (backoff resets)", 10.0)

    def __post_init__(self) -> None:
        if self.chunkservers < 1:
            raise ValueError(f"--chunkservers must be at least 1, got {self.chunkservers}")
        parse_addr(self.listen, what="listen address")
        for name in ("restart_backoff_s", "restart_backoff_max_s", "restart_stable_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must not be negative")
