"""Configuration, written once: a frozen dataclass per service.

CLI options are derived from the fields (:func:`add_options` /
:func:`from_options`): ``heartbeat_interval_s`` becomes
``--heartbeat-interval`` and accepts ``500ms``/``5min``; ``*_bytes`` fields
accept ``64MiB``.  Each field's ``help`` lives in its metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from kvfs.address import TOKEN_FILE_HELP, parse_addr
from kvfs.rpc import HOLDER_CHARS, MAX_HOLDER_CHARS
from kvfs.units import parse_duration, parse_size


def opt(help: str, default: Any = dataclasses.MISSING, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


MiB = 1024 * 1024


class FsyncMode(enum.StrEnum):
    """When written bytes reach the disk (README: what each setting risks)."""

    ALWAYS = "always"  # fdatasync each append before answering it
    BATCH = "batch"  # group commit: durable before answered, concurrent appends share one sync
    NEVER = "never"  # answered from the page cache: a power loss can lose acknowledged values


class OnLost(enum.StrEnum):
    """What a read does with a key whose value no replica can serve (gone, corrupt, or
    its servers dead or unreachable)."""

    MISS = "miss"  # a miss, like an absent key: the cache's answer (and meta is told)
    RAISE = "raise"  # the error (Unavailable, ChecksumMismatch, StaleLayout) naming the key


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """TLS on the wire, optional (:mod:`kvfs.tls`): the same three fields in every service's
    and client's config, so each is the same ``--tls-*`` flag everywhere."""

    tls_cert: Path | None = opt("PEM certificate (chain) to present: a server's own, a client's for "
                                "mutual TLS; a server given one speaks only TLS", None)
    tls_key: Path | None = opt("PEM private key of --tls-cert (default: read from the --tls-cert "
                               "file)", None)
    tls_ca: Path | None = opt("PEM CA certificates: a client (and a service calling another) "
                              "verifies the server against them; a server given them requires "
                              "client certificates they signed (mutual TLS)", None)


def tls_fields(cfg: TlsConfig) -> dict[str, Any]:
    """The TLS fields of any config, to carry into another (``dataclasses.replace``)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TlsConfig)}


@dataclass(frozen=True, kw_only=True)
class ClusterFsyncConfig:
    """The ``--fsync`` of a cluster a command starts (``kvfs up``'s, ``kvfs bench``'s embedded
    one): one mode for meta and every chunkserver, handed on as their own ``--fsync``."""

    fsync: FsyncMode = opt("the --fsync of the meta and chunkservers this command starts: always "
                           "or batch, a put is on disk before it is answered; never, page cache "
                           "only: a power loss can lose acknowledged puts (the durability of a "
                           "DRAM store such as Mooncake)", FsyncMode.BATCH)


def fsync_argv(cfg: ClusterFsyncConfig) -> list[str]:
    """``cfg``'s mode as the ``--fsync`` flag of a meta or chunkserver child process."""
    return [_flag("fsync"), str(cfg.fsync)]


def tls_argv(cfg: TlsConfig) -> list[str]:
    """The TLS fields of ``cfg`` as command-line flags (absolute paths), for a child process."""
    out: list[str] = []
    for name, path in tls_fields(cfg).items():
        if path is not None:
            out += [_flag(name), str(Path(path).resolve())]
    return out


@dataclass(frozen=True, kw_only=True)
class ServerConfig(TlsConfig):
    """What every RPC server (meta, chunkserver) limits, per connection unless stated."""

    max_connections: int = opt("connections per server; past it, new ones are closed at accept",
                               1024)
    handshake_timeout_s: float = opt("close a connection that has not authenticated by then", 5.0)
    idle_timeout_s: float = opt("close an authenticated connection idle this long", 300.0)
    send_timeout_s: float = opt("abort a connection whose peer has not read an answer for this "
                                "long (it stopped reading; its requests' memory is freed); a "
                                "connection the server closes flushes at most this long", 30.0)
    max_handshake_bytes: int = opt("largest frame accepted before a peer authenticated", 4096)
    max_header_bytes: int = opt("largest msgpack header of a request", 16 * MiB)
    max_payload_bytes: int = opt("largest raw payload of a request (an append)", 256 * MiB)
    max_inflight_requests: int = opt("requests being served per connection; past it, reading "
                                     "pauses until replies drain", 64)
    max_inflight_bytes: int = opt("request and reply bytes held per connection; past it, reading "
                                  "pauses until replies drain", 64 * MiB)
    receive_pool_bytes: int = opt("request payloads over 64 KiB (appends) are received into "
                                  "buffers kept for reuse (no fresh pages to zero and fault in per "
                                  "request); at most this many bytes of them are kept between "
                                  "requests, per server (0: a fresh buffer each)", 64 * MiB)
    bind_auth_to_addresses: bool = opt("refuse a handshake made for other addresses than this "
                                       "connection's (a relay); turn off behind NAT or a proxy",
                                       True)
    bad_request_log_interval_s: float = opt("log bad requests from one peer host at most this "
                                            "often", 60.0)


# the stores meta keeps in its own --data (kvfs.meta.localstore); a new directory gets the first
LOCAL_STORES = ("rocksdb", "sqlite")


@dataclass(frozen=True, kw_only=True)
class MetaConfig(ServerConfig):
    data: Path = opt("data directory (SQLite or RocksDB store; token files unless $KVFS_TOKEN, "
                     "$KVFS_ADMIN_TOKEN, $KVFS_SERVER_TOKEN are set)")
    listen: str = opt("HOST:PORT to listen on (port 0 picks a free one)", "127.0.0.1:7070")
    heartbeat_timeout_s: float = opt("a chunkserver silent this long is not written to or read "
                                     "from", 10.0)
    dead_after_s: float = opt("a chunkserver silent this long is declared dead: exists and "
                              "match_prefix stop counting keys held only there, and the GC's "
                              "repair step copies its extents to live servers (never before "
                              "--heartbeat-timeout; counted from meta's start for servers meta "
                              "knew before it)", 60.0)
    default_ttl_s: float | None = opt("TTL for puts that give none (default: no expiry)", None)
    max_key_meta_bytes: int = opt("largest metadata of one key (put's meta=, msgpack-encoded; "
                                  "at most 64KiB): a commit with more is refused naming the key",
                                  1024)
    max_lease_holders: int = opt("lease holders on one key (each client is one, unless it sets "
                                 "ClientConfig.lease_holder); past it, a lease goes to one shared "
                                 "overflow holder: it pins the key until it runs out, no release "
                                 "ends it", 32, positive=True)
    max_lease_holder_chars: int = opt("longest lease holder id (ClientConfig.lease_holder; at most "
                                      f"{MAX_HOLDER_CHARS}): a lookup or release naming a longer "
                                      "one is refused", 64, positive=True)
    access_flush_interval_s: float = opt("how often last-access times are written", 5.0)
    suspect_replicas: int = opt("replicas readers reported failing their CRC-32C (REPORT_BAD) held "
                                "for meta to check on their chunkservers and repair from a good "
                                "copy; reports past it are dropped until those are done (0: "
                                "reports are ignored; a scrub still finds them)", 4096)
    store: str | None = opt("where the index lives: default the store --data holds, and a "
                            "RocksDB directory under a new --data; rocksdb or sqlite (a SQLite "
                            "file under --data: rewrites a random page per key, where RocksDB "
                            "appends) ask for one; redis-cluster://HOST:PORT[,HOST:PORT...] keeps "
                            "it in a Redis Cluster, where several meta processes serve one index",
                            None)
    rocksdb_memtable_bytes: int = opt("--store rocksdb: the memtable RocksDB fills before it "
                                      "writes it out as a sorted file; meta holds at most two "
                                      "(one filling, one being written), plus RocksDB's 8 MiB "
                                      "block cache", 64 * MiB, positive=True)
    store_namespace: str = opt("--store redis-cluster: the prefix of this cluster's Redis keys "
                               "(several kvfs clusters can share one Redis Cluster)", "kvfs")
    store_timeout_s: float = opt("--store redis-cluster: the longest one network step to Redis "
                                 "may take (a pipeline to a node, a connect, a slot-map read); "
                                 "past it the call fails as unavailable, never waits on a hung "
                                 "master", 5.0)
    registry_refresh_s: float = opt("--store redis-cluster: how often the chunkservers other metas "
                                    "registered, and their heartbeats, are read again", 1.0)
    fsync: FsyncMode = opt("always/batch: a commit is on disk before it is answered (its "
                           "write, then an fdatasync of its store's WAL in a thread: "
                           "lookups are served meanwhile); never: synchronous=NORMAL, a power "
                           "loss can undo the last commits (GC transactions are FULL in every "
                           "mode)",
                           FsyncMode.BATCH)
    commit_group_max_keys: int = opt("group commit: most keys written by one write of meta's "
                                     "store, a transaction (SQLite) or write batch (RocksDB) "
                                     "(the COMMITs that arrive while one is synced share the "
                                     "next; a larger COMMIT is written in parts of this many keys, "
                                     "a write and a sync each, meta's loop free between them; "
                                     "--fsync always: one COMMIT per transaction)", 1024, positive=True)
    commit_group_max_bytes: int = opt("group commit: most bytes (keys + encoded layouts) written "
                                      "by one write of meta's store", 16 * MiB, positive=True)

    def __post_init__(self) -> None:
        for name in ("commit_group_max_keys", "commit_group_max_bytes", "max_lease_holders",
                     "max_lease_holder_chars", "rocksdb_memtable_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.suspect_replicas < 0:
            raise ValueError(f"--suspect-replicas must be at least 0, got {self.suspect_replicas}")
        if (self.store is not None and self.store not in LOCAL_STORES
                and not self.store.startswith("redis-cluster://")):
            raise ValueError("--store must be rocksdb, sqlite or redis-cluster://HOST:PORT[,...], "
                             f"got {self.store!r:.200}")
        if self.max_lease_holder_chars > MAX_HOLDER_CHARS:
            raise ValueError(f"--max-lease-holder-chars must be at most {MAX_HOLDER_CHARS} (the "
                             f"protocol's limit), got {self.max_lease_holder_chars}")


@dataclass(frozen=True, kw_only=True)
class ChunkServerConfig(ServerConfig):
    data: Path = opt("data directory (chunk files; token files unless $KVFS_TOKEN, "
                     "$KVFS_ADMIN_TOKEN, $KVFS_SERVER_TOKEN are set)")
    meta: str = opt("address of the meta service; several metas of one Redis-backed store as "
                    "HOST:PORT,HOST:PORT (one in use, the next when it cannot be reached)",
                    "kvfs://127.0.0.1:7070")
    listen: str = opt("HOST:PORT to listen on (port 0 picks a free one)", "127.0.0.1:0")
    advertise: str | None = opt("HOST:PORT clients should use (default: the listen address)", None)
    chunk_bytes: int = opt("seal a chunk file at this size", 64 * 1024 * 1024)
    capacity_bytes: int | None = opt("capacity to report (default: the disk's size, which meta "
                                     "splits between the chunkservers on that disk)", None)
    gc_reserve_bytes: int | None = opt("room only GC may fill: values are refused this much short of "
                                       "the capacity, and compaction's copies and tombstones may use it, "
                                       "so a full server can still compact what eviction freed "
                                       "(default: 2 chunks, at most a twentieth of the capacity)", None)
    heartbeat_interval_s: float = opt("how often to report to meta", 1.0)
    io_threads: int = opt("threads doing preadv/pwritev", 4)
    merge_gap_bytes: int = opt("read ranges closer than this from disk as one span (page-cache "
                               "hits merge only where their 4 KiB pages meet, and a small "
                               "read's only with the range asked just before)", 64 * 1024)
    fsync: FsyncMode = opt("when appended bytes reach the disk before the append is answered: "
                           "always (one fdatasync each), batch (group commit: concurrent appends "
                           "share one fdatasync), never (page cache only)", FsyncMode.BATCH)
    fsync_window_s: float = opt("batch: wait this long for more appends before a group sync "
                                "(0: the appends that arrive during a sync share the next)", 0.0)
    writeback_start_bytes: int = opt("batch: an append of at least this many bytes starts writing "
                                     "its pages to the disk as soon as it is written "
                                     "(sync_file_range), so the group fdatasync that covers it "
                                     "finds them written or on their way; 0: never", 1 * MiB)
    inline_write_bytes: int = opt("an append of at most this many bytes is written into the page "
                                  "cache by the event loop's own pwritev, not handed to an IO "
                                  "thread (the hop cost more CPU than the write); not a new "
                                  "chunk's first append when preallocating, none that starts "
                                  "its writeback, not under --fsync always; a write that held "
                                  "the loop over 5 ms (INLINE_STALL_S) sends appends to the IO "
                                  "threads for 1 s (INLINE_BACKOFF_S); 0: never", 1 * MiB)
    max_ranges: int = opt("most ranges one READV may name", 16384)
    max_open_chunks: int = opt("chunk files kept open (an LRU; at most half the process's "
                               "file limit, which is raised to its hard limit at start)", 4096)
    max_read_rpc_bytes: int = opt("most bytes one READV may ask for, in total", 64 * MiB)
    max_mapped_chunks: int = opt("chunk files kept mapped read-only (an LRU, each holding an fd "
                                 "of the max_open_chunks'; at most half of them): READV answers "
                                 "of smaller ranges all in the page cache are written into the "
                                 "socket from these, not read into a buffer (plain TCP); "
                                 "0: never", 1024)
    sendfile_min_bytes: int = opt("READV answers whose ranges average at least this many bytes "
                                  "and are all in the page cache go from the chunk files into "
                                  "the socket with sendfile, never copied through a buffer "
                                  "(plain TCP; over TLS every answer is read into a buffer); 0: never",
                                  128 * 1024)
    preallocate: bool = opt("reserve chunk_bytes of disk blocks when a chunk is opened for appends "
                            "(fallocate KEEP_SIZE; the rest is released when it is sealed), and the "
                            "next chunk's ahead, in an IO thread, once the open one is half full", True)
    close_timeout_s: float = opt("at shutdown, wait at most this long for appends, group syncs "
                                 "and disk reads still running; past it (a disk hanging) they "
                                 "are logged and abandoned, the chunk files left open and the "
                                 "data directory locked until the process exits", 30.0)


@dataclass(frozen=True, kw_only=True)
class ClientConfig(TlsConfig):
    stripe_bytes: int = opt("values larger than this are striped across servers", 1024 * 1024)
    replicas: int = opt("copies of each extent, on distinct servers", 1, positive=True)
    connect_timeout_s: float = opt("give up connecting after this long", 5.0)
    request_timeout_s: float = opt("give up on an RPC after this long", 60.0)
    layout_cache_entries: int = opt("immutable layouts kept to skip meta lookups", 100_000)
    put_group_bytes: int = opt("small values of one put_many stay together on one server in "
                               "runs up to this size; further runs go to the next servers "
                               "(as max_rpc_bytes: a run is one APPEND, so a large call's "
                               "runs are written by several servers at once)", 4 * MiB)
    max_rpc_bytes: int = opt("split appends larger than this (at most the servers' "
                             "--max-payload); the APPENDs of one server are sent together, "
                             "so it writes one while it receives the next", 4 * MiB)
    commit_group_bytes: int = opt("0 (the default): each put sends its COMMIT at once; > 0: "
                                  "puts whose COMMITs come while one of this client's is in "
                                  "flight wait for it and then go as one COMMIT (group commit), "
                                  "of at most this many bytes of packed layouts (at most meta's "
                                  "--max-header; a put's own larger COMMIT goes alone): less "
                                  "meta CPU per key, a little less put rate from one client "
                                  "(bench/RESULTS.md, \"client group commit\")", 0)
    max_read_rpc_bytes: int = opt("split reads from one server larger than this (at most the "
                                  "server's --max-read-rpc)", 16 * MiB)
    max_read_ranges: int = opt("split reads from one server naming more ranges than this (at "
                               "most the server's --max-ranges)", 4096)
    read_pool_bytes: int = opt("read answers whose values are copied out (get/get_many's "
                               "values, get_into destinations under 64 KiB on average) are "
                               "received into buffers kept for reuse (no fresh pages to zero and "
                               "fault in per read; a buffer is reused only once no view of it is "
                               "alive); at most this many bytes of them are kept between reads "
                               "(0: a fresh buffer each); the default holds 8 answers of "
                               "max_read_rpc_bytes", 128 * MiB)
    servers_refresh_s: float = opt("re-read the chunkserver list this often", 2.0)
    down_for_s: float = opt("a chunkserver a call could not reach (refused, lost, timed out) is "
                            "skipped by writes and reads for this long, whatever meta says "
                            "(a call to it that succeeds ends it sooner); reads still ask it "
                            "for values only it holds, unless it is confirmed hung: a call "
                            "timed out and so did the PING probe that starts at once (within "
                            "connect_timeout_s; answered, the mark ends); then those are "
                            "misses at once and the mark holds until a probe, one every "
                            "down_for_s, is answered", 5.0)
    evict_on_full: bool = opt("when a write finds the cluster full, ask meta for a GC pass and retry (again "
                              "while the passes free something; 3 tries in all)", True)
    batch: bool = opt("coalesce concurrent get()/exists() calls, and get_into()/put_many() calls "
                      "of fewer than batch_max_keys keys, into batches", True)
    batch_window_s: float = opt("wait this long for more keys (0: those issued this loop tick)", 0.0)
    batch_max_keys: int = opt("flush a batch at this many keys, without waiting (a call of this "
                              "many keys goes alone)", 128)
    batch_max_bytes: int = opt("flush a batch when its known value (or get_into buffer) sizes reach "
                               "this (a call of this many bytes goes alone)", 64 * 1024 * 1024)
    call_max_keys: int = opt("a batch call of more keys is made as several calls of at most "
                             "this many, one after another (each part stores, deletes or "
                             "leases on its own: a part that fails leaves the earlier ones "
                             "done); also bounds meta's answer to one part", 16384)
    call_max_bytes: int = opt("the same for a call whose request (its keys, and a put's or "
                              "delete's records and layouts) would pass this many bytes, or "
                              "half the smallest --max-header a server of the cluster takes, "
                              "whichever is less", 4 * MiB)
    stream_window_units: int = opt("stripe units a streaming put or read keeps in flight (its "
                                   "memory: this many stripe_bytes)", 4)
    on_lost: OnLost = opt("a key whose value no replica can serve (gone, corrupt, its servers "
                          "dead): miss (get/get_many return None, get_into MISS; the other keys "
                          "of the batch are unaffected) or raise (the error, naming the key; "
                          "get_into reports FAILED)", OnLost.MISS)
    hedge_after_s: float | None = opt("a chunkserver that has not begun to answer a read by then "
                                      "is given up for that read, and the extents it holds are "
                                      "asked of their next replica (replicas >= 2; its late "
                                      "answer is discarded); none: wait up to "
                                      "request_timeout_s", 2.0)
    lease_holder: str | None = opt("whose leases this client's lookups take and its release() "
                                   "ends (letters, digits and ._:@/+=-; meta refuses ids longer "
                                   "than its --max-lease-holder-chars): clients sharing one "
                                   "share their leases; \"\" is the holder of clients that name "
                                   "none; default: a random id per client and process", None)

    meta_sockets: int = opt("the blocking kvfs.Client's own connections to meta, opened as "
                            "needed: each carries one exists_many/match_prefix/release at a "
                            "time in the calling thread, skipping the hop to the client's IO "
                            "thread; calls finding none free take that hop (0: every call "
                            "does)", 4)
    server_sockets: int = opt("the blocking kvfs.Client's own connections to each chunkserver, "
                              "opened as needed: each carries one READV of a get_many/get_into "
                              "made in the calling thread (small values, cached layouts or one "
                              "LOOKUP), skipping the hop to the client's IO thread; calls finding "
                              "none free, and reads needing more (failover, striped or large "
                              "values), take that hop (0: every call does)", 4)

    def __post_init__(self) -> None:
        if self.meta_sockets < 0:
            raise ValueError(f"meta_sockets must be >= 0 (0: none), got {self.meta_sockets}")
        if self.server_sockets < 0:
            raise ValueError(f"server_sockets must be >= 0 (0: none), got {self.server_sockets}")
        if self.read_pool_bytes < 0:
            raise ValueError(f"read_pool_bytes must be >= 0 (0: none), got {self.read_pool_bytes}")
        if self.commit_group_bytes < 0:
            raise ValueError(f"commit_group_bytes must be >= 0 (0: none), got {self.commit_group_bytes}")
        if self.call_max_keys < 1:
            raise ValueError(f"call_max_keys must be >= 1, got {self.call_max_keys}")
        if self.call_max_bytes < 64 * 1024:
            raise ValueError(f"call_max_bytes must be >= 64 KiB (a request of one largest key), "
                             f"got {self.call_max_bytes}")
        h = self.lease_holder
        if h is not None and (len(h) > MAX_HOLDER_CHARS
                              or not re.fullmatch(f"[{HOLDER_CHARS}]*", h)):
            raise ValueError(f"lease_holder must be at most {MAX_HOLDER_CHARS} of the characters "
                             f"{HOLDER_CHARS}, got {h!r:.80}")
        if self.hedge_after_s is not None and not self.hedge_after_s > 0:
            raise ValueError(f"hedge_after_s must be positive or None, got {self.hedge_after_s}")
        try:
            object.__setattr__(self, "on_lost", OnLost(self.on_lost))
        except ValueError:
            raise ValueError(f"on_lost must be one of {', '.join(OnLost)}, got "
                             f"{self.on_lost!r}") from None


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


def _choice_arg(typ: type[enum.Enum]) -> Callable[[str], Any]:
    """An enum's value as an argparse ``type`` whose error names the choices (argparse would
    say only ``invalid FsyncMode value``)."""
    def parse(text: str) -> enum.Enum:
        try:
            return typ(text)
        except ValueError:
            raise ValueError(f"must be one of {', '.join(str(m.value) for m in typ)}, got "
                             f"{text!r}") from None
    return arg_type(parse, typ.__name__)


SIZE = arg_type(parse_size, "size")
DURATION = arg_type(parse_duration, "duration")
POSITIVE_INT = arg_type(_positive_int, "count")


def add_cluster_options(p: argparse.ArgumentParser, *, token_help: str = TOKEN_FILE_HELP,
                        addr_help: str = "cluster address (default: $KVFS_ADDR or "
                        "kvfs://127.0.0.1:7070); several metas of one Redis-backed store: "
                        "kvfs://H1:P1,H2:P2") -> None:
    """``--addr``, ``--token-file`` and the TLS options of a command that talks to a cluster
    (the client commands, ``kvfs mount``, ``kvfs gc``, ``kvfs bench``); ``token_help``:
    whose token; ``addr_help``: where it goes without one."""
    p.add_argument("--addr", default=None, help=addr_help)
    p.add_argument("--token-file", default=None, help=token_help)
    add_options(p, TlsConfig)


def add_options(parser: argparse.ArgumentParser, cls: type[Any], *, skip: tuple[str, ...] = (),
                only: tuple[str, ...] | None = None) -> None:
    """A flag for each field of ``cls`` (but ``skip``; or just ``only``), its help and default
    the field's."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
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
            elif isinstance(typ, type) and issubclass(typ, enum.Enum):
                kwargs["type"] = _choice_arg(typ)
                kwargs["choices"] = list(typ)
            if not required and f.default is not None:
                kwargs["help"] += f" (default: {f.default})"
        parser.add_argument(_flag(f.name), **kwargs)


def from_options(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if hasattr(ns, f.name)}
    values.update(overrides)
    return cls(**values)


@dataclass(frozen=True, kw_only=True)
class GcConfig(TlsConfig):
    meta: str = opt("address of the meta service; several metas of one Redis-backed store as "
                    "HOST:PORT,HOST:PORT (one in use, the next when it cannot be reached)",
                    "kvfs://127.0.0.1:7070")
    interval_s: float = opt("time between background GC passes", 10.0)
    expire_batch: int = opt("expired keys removed per meta transaction", 10_000)
    compact_threshold: float = opt("compact a sealed chunk whose garbage ratio passes this", 0.3)
    high_watermark: float = opt("evict when a chunkserver's used/capacity passes this (of the room "
                                "values have, where that is less)", 0.9)
    low_watermark: float = opt("evict least recently used keys down to this used/capacity (of "
                               "the room values have, where the high watermark is)", 0.8)
    grace_s: float = opt("keep an unreferenced chunk this long so in-flight reads finish", 30.0)
    rate_bytes: int | None = opt("compaction copy rate limit in bytes/s (default: unlimited)", None)
    repair_rate_bytes: int | None = opt("repair (re-replication) copy rate limit in bytes/s",
                                        100 * MiB)
    scrub_rate_bytes: int | None = opt("background scrub: bytes of replicas per second the "
                                       "daemon verifies on each chunkserver (each pass, in one "
                                       "burst: the replicas of the keys after where the last "
                                       "pass stopped, in key order, until one server's come to "
                                       "interval x this; the bad ones mended as kvfs gc scrub "
                                       "--apply does; 0: none)", 8 * MiB)


@dataclass(frozen=True, kw_only=True)
class MountConfig:
    """`kvfs mount`: how much of a file an open handle holds in memory."""

    write_buffer_bytes: int = opt("a file being written is held in memory up to this size (any "
                                  "write pattern works); past it, its bytes stream to the "
                                  "chunkservers as they come, and a write or read more than this "
                                  "far behind the file's end fails with EOPNOTSUPP", 8 * MiB)
    read_ahead_units: int = opt("stripe units a sequential read of a file fetches ahead (an open "
                                "file keeps at most this many + 2 in memory)", 4)
    max_batch_items: int = opt("most reads (stripe units) or small-file closes sent as one batch",
                           128, positive=True)
    max_batch_bytes: int = opt("most bytes in one batch of reads or of small-file closes", 64 * MiB,
                           positive=True)
    batches_in_flight: int = opt("batches of reads, and of closes, running at once; more wait in "
                                 "line (held in memory: about batches-in-flight x batch-bytes "
                                 "each)", 2, positive=True)
    batch_hold_s: float = opt("while the mount is still reading FUSE requests the kernel has "
                              "queued, a lookup or read that could go to the cluster at once "
                              "waits up to this long for theirs, to share its batch (it goes as "
                              "soon as none is left queued, or the batch is full; 0: at once)",
                              0.001)
    idle_workers: int = opt("request workers kept waiting for the kernel's next FUSE request "
                            "(each keeps libfuse's receive buffer, about 1 MiB); more start "
                            "while every one is busy (at most 99, pyfuse3's cap) and end as "
                            "they go idle past this many (1: one made and ended for about "
                            "every request that waits on the cluster)", 16, positive=True)
    unit_pool_bytes: int = opt("stripe units of 1 MiB or more read for open files are received "
                               "into buffers kept for reuse once their file is closed (no fresh "
                               "pages to zero and fault in per read; a buffer is reused only once "
                               "no view of it is alive); at most this many bytes of them are kept "
                               "(0: a fresh buffer each)", 32 * MiB)
    looked_up_layouts: int = opt("layouts of recently looked-up files kept for their open or first read "
                                 "(within --attr-timeout)", 4096)
    page_cache_files: int = opt("files whose pages the kernel may keep cached between opens: a "
                                "read-only open keeps them when its LOOKUP found the value those "
                                "pages were read from (the same layout) and no other open of the "
                                "file here reads another (0: every open drops them)", 4096)
    direct_first_open: bool = opt("a read-only open of a value this mount has not opened before "
                                  "(none of the kernel's pages of it known to be kept) reads past "
                                  "the kernel's page cache (direct_io: each answer copied straight "
                                  "into the reader's buffer, no cached pages made, less CPU per "
                                  "cold read); the next open of that value reads through the pages "
                                  "and the one after keeps them, as without this (remembered for "
                                  "--page-cache-files files); a shared mmap of such a first open "
                                  "fails with ENODEV (a private one works)", False)
    kernel_read_ahead_bytes: int = opt("the kernel's read-ahead for the mount (its "
                                       "/sys/class/bdi/*/read_ahead_kb, set when permitted; 0 "
                                       "leaves the kernel's 128 KiB): a large file's reads reach "
                                       "the mount as requests this big (the kernel caps them at "
                                       "1 MiB)", 1 * MiB)
    negative_timeout_s: float = opt("a name missing from its directory's listing made at most this "
                                    "long ago is answered as missing without asking meta (the "
                                    "listing is made in the background, at most once per directory "
                                    "and period); so another node's new file there can stay hidden "
                                    "from lookups this long (a create with O_EXCL, or without "
                                    "O_TRUNC, asks meta); lookups walking such a listing in its "
                                    "order get the next --max-batch-items names looked up ahead, "
                                    "in one LOOKUP (0: every lookup asks meta)", 0.0)
    negative_listing_keys: int = opt("--negative-timeout: most keys one directory's listing holds (a "
                                     "larger directory is not listed again for a minute, and its "
                                     "lookups ask meta)", 4096, positive=True)
    negative_listing_dirs: int = opt("--negative-timeout: most directories whose listing is kept "
                                     "(the least recently listed goes)", 16, positive=True)
    write_behind_bytes: int = opt("write-behind: a close returns once the file is held in memory "
                                  "here, and held files are committed in batches; at most this "
                                  "many bytes are held, a close waits for room when full (0: off, "
                                  "a close returns once its file is committed)", 0)
    write_behind_files: int = opt("--write-behind: most files (and held deletes of renamed files' "
                                  "old names) held at once", 4096, positive=True)
    write_behind_delay_s: float = opt("--write-behind: a held file waits up to this long to be "
                                      "committed with the files closed after it (one batch), "
                                      "and goes sooner once a full batch (--max-batch-items, "
                                      "--max-batch) is held, an fsync waits for it or a close "
                                      "waits for room (0: as soon as a batch can go)", 0.1)
    write_behind_drain_s: float = opt("--write-behind: at unmount, wait this long for held files to "
                                      "be committed; what is not committed by then is lost", 30.0)

    def __post_init__(self) -> None:
        for name in ("write_buffer_bytes", "read_ahead_units", "batch_hold_s", "unit_pool_bytes",
                     "looked_up_layouts",
                     "page_cache_files", "kernel_read_ahead_bytes", "negative_timeout_s", "write_behind_bytes",
                     "write_behind_drain_s", "write_behind_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must not be negative")
        for name in ("max_batch_items", "max_batch_bytes", "batches_in_flight", "idle_workers",
                     "negative_listing_keys", "negative_listing_dirs", "write_behind_files"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be at least 1")


@dataclass(frozen=True, kw_only=True)
class UpConfig(ClusterFsyncConfig, TlsConfig):
    """`kvfs up`: meta, N chunkservers and the GC daemon as supervised child processes."""

    data: Path = opt("data directory (one sub-directory per service)", Path("kvfs-data"))
    chunkservers: int = opt("number of chunkserver processes", 3, positive=True)
    listen: str = opt("HOST:PORT for meta (port 0 picks a free one)", "127.0.0.1:7070")
    default_ttl_s: float | None = opt("TTL for puts that give none, e.g. 1h (default: no expiry)",
                                      None)
    capacity_bytes: int | None = opt("capacity per chunkserver, e.g. 10GiB (default: an even "
                                     "share of the disk they are on)", None)
    gc: bool = opt("run the GC daemon", True)
    gc_interval_s: float | None = opt("time between GC passes, e.g. 10s (default: the daemon's)",
                                      None)
    gc_scrub_rate_bytes: int | None = opt("the GC daemon's background scrub rate (its --scrub-rate; "
                                          "0: none; default: the daemon's)", None)
    restart: bool = opt("restart a service that exits, on the same data dir", True)
    restart_backoff_s: float = opt("wait before the first restart; doubled per quick failure", 0.5)
    restart_backoff_max_s: float = opt("longest wait between restarts", 30.0)
    restart_stable_s: float = opt("a service up this long counts as healthy (backoff resets)", 10.0)
    meta_store: str = opt("where meta keeps its index: auto (the store DATA/meta holds; "
                          "rocksdb for a new DATA), rocksdb (a RocksDB directory under "
                          "DATA/meta), sqlite (a SQLite file under DATA/meta) or redis-cluster "
                          "(a local 3-master Redis Cluster under DATA/redis, redis-server from "
                          "apt, supervised like the other services)", "auto")
    redis_replicas: bool = opt("--meta-store redis-cluster: one replica per master (6 redis-server "
                               "processes), so a master that dies fails over to its replica", False)
    redis_maxmemory_bytes: int | None = opt("--meta-store redis-cluster: each redis-server's "
                                            "maxmemory; commits fail once a master is full "
                                            "(default: no limit)", None)

    def __post_init__(self) -> None:
        if self.meta_store not in ("auto", *LOCAL_STORES, "redis-cluster"):
            raise ValueError("--meta-store must be auto, rocksdb, sqlite or redis-cluster, got "
                             f"{self.meta_store!r}")
        if self.meta_store != "redis-cluster" and (self.redis_replicas or self.redis_maxmemory_bytes):
            raise ValueError("--redis-replicas and --redis-maxmemory need --meta-store redis-cluster")
        if self.chunkservers < 1:
            raise ValueError(f"--chunkservers must be at least 1, got {self.chunkservers}")
        parse_addr(self.listen, what="listen address")
        for name in ("restart_backoff_s", "restart_backoff_max_s", "restart_stable_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must not be negative")


@dataclass(frozen=True, kw_only=True)
class EngineConfig(TlsConfig):
    """The kvfs plug-ins for inference engines (``kvfs.integrations``), read from the
    engine's own configuration (SGLang ``extra_config``, LMCache ``extra_config`` with a
    ``kvfs_`` prefix, vLLM's tier config)."""

    addr: str | None = opt("kvfs://HOST:PORT of meta (default: $KVFS_ADDR)", None)
    token: str | None = opt("cluster token (default: $KVFS_TOKEN, else the token file)", None)
    namespace: str | None = opt("key prefix keeping models and ranks apart (default: from the "
                                "engine's model name and rank)", None)
    timeout_s: float = opt("an engine call waits at most this long on kvfs, then reports a "
                           "miss or failure", 5.0)
    connect_timeout_s: float = opt("give up connecting after this long", 2.0)
    lease_s: float = opt("blocks found by a lookup are kept from eviction this long", 30.0)
    ttl_s: float | None = opt("TTL of stored blocks (default: the cluster's)", None)
    key_memo: int = opt("LMCache: most chunk keys whose kvfs key is kept for the next call "
                        "that names them (cleared when full; 0: none)", 16384)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s", "lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.key_memo < 0:
            raise ValueError(f"key_memo must be 0 (none) or more, got {self.key_memo}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or unset, got {self.ttl_s}")


def from_mapping(cls: type[T], mapping: Any, *, prefix: str = "",
                 ignore: tuple[str, ...] = ()) -> T:
    """``cls`` from a plain dict (an engine's config): keys are the field names after
    ``prefix``; ``*_s`` accept ``500ms``/``5min`` and ``*_bytes`` accept ``64MiB``.  Keys
    with the prefix that name no field are refused, by name."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, raw in (mapping or {}).items():
        if not isinstance(key, str) or not key.startswith(prefix) or key in ignore:
            continue
        name = key[len(prefix):]
        if name not in fields:
            raise ValueError(f"unknown setting {key!r}; known: "
                             + ", ".join(prefix + n for n in fields))
        if raw is None:
            values[name] = None
        elif name.endswith("_s"):
            values[name] = parse_duration(raw) if isinstance(raw, str) else float(raw)
        elif name.endswith("_bytes"):
            values[name] = parse_size(raw) if isinstance(raw, str) else int(raw)
        elif hints[name] in (int, int | None):
            values[name] = int(raw)
        elif hints[name] in (float, float | None):
            values[name] = float(raw)
        elif hints[name] is bool:
            values[name] = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
        elif hints[name] in (Path, Path | None):
            values[name] = Path(raw)
        else:
            values[name] = str(raw)
    return cls(**values)
