"""Every RPC, declared once: ``op -> (request type, response type, roles)``; the roles
are the token roles that may call it (:class:`kvfs.handshake.Role`: client, admin,
server).

Op numbers are stable and never reused.  Each request is a frozen, keyword-only
``msgspec.Struct`` whose generic parameter names its response type, and every
field carries a type and a bound (length caps, ranges).  Rows inside a message
(a record head, a range, a move) are typed ``NamedTuple``\\ s: positional
msgpack arrays on the wire.  From :data:`RPCS` derive:

- server dispatch (:class:`kvfs.server.RpcServer` decodes and checks a request
  against its type, then calls ``handler.rpc_<name>(request, payload)``);
- the typed client call (:meth:`kvfs.transport.Connection.call`: a request in,
  its response type out, checked by mypy);
- the fuzz test (every field of every request missing, mistyped, out of bounds);
- the RPC table in README.md and ARCHITECTURE.md (``python -m kvfs.rpcdoc``).

The wire stays msgpack: a message is a map of its fields; raw payloads (values,
read bytes) never enter the header.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, NamedTuple, TypeVar, get_args

import msgspec

from kvfs.errors import RemoteProtocolError
from kvfs.handshake import NONCE_BYTES, Role
from kvfs.layout import MAX_KEY_BYTES, MAX_REPLICAS, Crc32, Layout, Replica
from kvfs.packed import HEAD as PACKED_HEAD
from kvfs.protocol import Flag, FrameHead, HeaderDecode, header_key

# -- field types and their bounds ---------------------------------------------------------
MAX_ITEMS = 1 << 20  # keys, records, ranges, moves... in one message
MAX_SECONDS = 100.0 * 365 * 24 * 3600  # ttl, lease, grace: a century
MAX_ADDR_CHARS = 256
MAX_TEXT_CHARS = 4096
MAX_LIST = 10_000  # keys per LIST page
MAX_REPORT_BAD = 1024  # replicas per REPORT_BAD (a reader holds at most these to report)
MAX_REFS_CHUNKS = 4096  # chunks per GC_CHUNK_REFS
MAX_EXPIRE_BATCH = 1_000_000
MAX_REPAIR_BATCH_BYTES = 1 << 30  # extent bytes per GC_REPAIR_PLAN
MAX_REPAIR_PLAN_ITEMS = 16_384  # extents per GC_REPAIR_PLAN answer, whatever their size: about
#                                 1.5 MB of header with 64-byte keys, 18 MB with 1 KiB ones, under
#                                 a client's 64 MiB (tiny values: 1M of 16 B in a 16 MiB plan made
#                                 an 88 MB answer, past it)
MAX_PACKED_BYTES = 1 << 30  # a COMMIT's packed layouts (in practice: meta's --max-header-bytes)
SERVER_ID_LIMIT = 1 << 23  # chunk ids embed the server id in their top bits (see kvfs.layout)
MAX_HOLDER_CHARS = 255  # a lease holder's id (meta's --max-lease-holder-chars is lower)
HOLDER_CHARS = "A-Za-z0-9._:@/+=-"  # what a lease holder's id is made of (printable, no spaces)

U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=2**62)]  # sizes and counts: room to add them up
Index = Annotated[int, msgspec.Meta(ge=0, lt=MAX_ITEMS)]
ServerId = Annotated[int, msgspec.Meta(ge=0, lt=SERVER_ID_LIMIT)]
ChunkId = U63
Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_SECONDS)]
Timestamp = Annotated[float, msgspec.Meta(ge=0.0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Addr = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADDR_CHARS)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=64)]
ClusterId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
DiskId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]  # host:st_dev
Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
Mac = Annotated[bytes, msgspec.Meta(max_length=64)]
# a COMMIT's packed layouts (kvfs.packed); also bounded by the server's max_header_bytes
PackedLayouts = Annotated[bytes, msgspec.Meta(min_length=PACKED_HEAD.size, max_length=MAX_PACKED_BYTES)]
# who takes or ends a lease (kvfs.client: one per client unless configured); "": the one
# shared holder of requests that name none
Holder = Annotated[str, msgspec.Meta(max_length=MAX_HOLDER_CHARS, pattern=rf"^[{HOLDER_CHARS}]*\Z")]

T = TypeVar("T")


K = TypeVar("K")
V = TypeVar("V")
Items = Annotated[list[T], msgspec.Meta(max_length=MAX_ITEMS)]
NonEmpty = Annotated[list[T], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]
Table = Annotated[dict[K, V], msgspec.Meta(max_length=MAX_ITEMS)]
Counters = Annotated[dict[Name, float], msgspec.Meta(max_length=64)]
RunCounters = Annotated[dict[Name, float | bool], msgspec.Meta(max_length=64)]


class Service(enum.Enum):
    ANY = "any"
    META = "meta"
    CHUNKSERVER = "chunkserver"


class Op(enum.IntEnum):
    # connection
    HELLO = 1
    AUTH = 2
    PING = 3
    # meta
    LOOKUP = 16
    COMMIT = 17
    DELETE = 18
    MATCH_PREFIX = 19
    LIST = 20
    STATS = 21
    REGISTER = 22
    HEARTBEAT = 23
    SERVERS = 24
    EXISTS = 25
    REPORT_LOST = 26
    RELEASE = 27
    REPORT_BAD = 28
    # chunkserver
    APPEND = 32
    READV = 33
    CHUNK_STATS = 34
    # garbage collection: meta (40-55)
    GC_STATUS = 40
    GC_EXPIRE = 41
    GC_EVICT = 42
    GC_PLAN = 43
    GC_CHUNK_REFS = 44
    GC_RELOCATE = 45
    GC_RETIRE = 46
    GC_DELETED = 47
    GC_CONTROL = 48
    GC_REPORT = 49
    GC_DROP_REPLICAS = 50
    TOUCH = 51
    MAKE_ROOM = 52
    GC_REPAIR_PLAN = 53
    GC_REPAIR = 54
    GC_SCRUB_PLAN = 55
    # garbage collection: chunkserver (56-63)
    CHUNK_COMPACT = 56
    CHUNK_DELETE = 57
    CHUNK_VERIFY = 58
    CHUNK_SEAL = 59
    CHUNK_SCAN = 60
    # garbage collection: meta, continued (64-)
    GC_DECOMMISSION = 64
    GC_TOMBSTONE = 65
    GC_LAYOUTS = 66


ANYONE = (Role.CLIENT, Role.ADMIN, Role.SERVER)
DATA = (Role.CLIENT, Role.ADMIN)  # an admin token may do what a client token may
ADMIN = (Role.ADMIN,)
SERVER = (Role.SERVER,)
SERVER_OR_ADMIN = (Role.SERVER, Role.ADMIN)  # the GC refreshes meta's view of a chunkserver


# -- message bases ----------------------------------------------------------------------------
class Response(msgspec.Struct, frozen=True, kw_only=True):
    """An answer's header."""


R = TypeVar("R", bound=Response)


class Request(msgspec.Struct, Generic[R], frozen=True, kw_only=True, forbid_unknown_fields=True,
              omit_defaults=True):
    """A request's header; ``R`` is the type of its answer.  Unknown fields are refused:
    a misspelled field is an error, not a silent default.  Fields at their defaults are not
    sent, so a request that uses none of a newer field is read by a server that predates
    it (a GC daemon upgraded before its meta: every ``GC_EVICT`` carried ``after: None``,
    which such a meta refused); one that uses it is refused, naming the field."""


class Empty(Response, frozen=True, kw_only=True):
    pass


class Hello(Request[Empty], frozen=True, kw_only=True):
    """Sent by the server as soon as a connection opens; never answered."""

    version: Annotated[int, msgspec.Meta(ge=0, le=255)]
    nonce: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
    service: Name


class Endpoint(NamedTuple):
    host: Addr
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)]


class AuthReply(Response, frozen=True, kw_only=True):
    role: Name  # the role of the token the client proved (kvfs.handshake.Role)
    mac: Mac  # the server's proof that it holds the same token
    # the largest request header and payload this server takes (--max-header,
    # --max-payload): a client refuses a larger request itself, never sending it (the
    # server would close the connection, failing every call on it); 0: not said
    max_header: Count = 0
    max_payload: Count = 0


class Auth(Request[AuthReply], frozen=True, kw_only=True):
    """The first frame of a client (:mod:`kvfs.handshake`): its nonce, the connection's
    two ends as its socket sees them, and an HMAC over both nonces and those ends."""

    version: Annotated[int, msgspec.Meta(ge=0, le=255)]
    nonce: Nonce
    client: Endpoint
    server: Endpoint
    mac: Mac


class Pong(Response, frozen=True, kw_only=True):
    service: Name
    server_id: ServerId | None = None


class Ping(Request[Pong], frozen=True, kw_only=True):
    pass


# (duplicates: the message classes below pair up by shape, typed fields each; each is one RPC's own declaration)
# -- meta: keys ---------------------------------------------------------------------------
class Layouts(Response, frozen=True, kw_only=True):
    layouts: Items[Layout | None]
    dirs: Items[bool] | None = None  # asked for: per key, a miss with keys under ``key + b"/"``


class Lookup(Request[Layouts], frozen=True, kw_only=True):
    """``lease_s``: the keys found are kept from eviction that long, by ``holder``'s
    lease (until it RELEASEs them)."""

    keys: Keys
    lease_s: Seconds | None = None
    holder: Holder = ""
    dirs: bool = False  # also say which misses are directories (kvfs.fs): one round trip


class CommitItem(NamedTuple):
    key: Key
    layout: Layout


class Committed(Response, frozen=True, kw_only=True):
    created: Timestamp
    expires_at: Timestamp | None
    present: Items[Index] = []  # if_absent: items not committed, their key being present


class Commit(Request[Committed], frozen=True, kw_only=True):
    """The keys and their layouts, in one of two forms: ``items`` (one msgpack array per
    layout), or ``packed`` (:mod:`kvfs.packed`: columns of fixed-width numbers, what the
    client sends: meta checks and builds a batch of them in a fraction of the time).
    Layouts' ``created``/``expires_at`` are ignored: meta stamps them at commit.
    ``if_absent``: an item whose key is present (unexpired and readable, or committed by
    an earlier item of this call) is not committed; the key keeps its value.  Items are
    numbered in order, in either form (``Committed.present``)."""

    items: Items[CommitItem] = []
    packed: PackedLayouts | None = None
    ttl_s: PositiveSeconds | None = None  # None: meta's default_ttl_s
    if_absent: bool = False

    def __post_init__(self) -> None:
        if bool(self.items) == (self.packed is not None):
            raise ValueError("give the layouts either as `items` or as `packed`, one of the two, "
                             f"not {'both' if self.items else 'neither'} - at `$.items`")


class Deleted(Response, frozen=True, kw_only=True):
    deleted: Count


class Delete(Request[Deleted], frozen=True, kw_only=True):
    """``tombstones[i]``: where the client wrote key ``i``'s tombstone (one replica per
    server), so meta keeps it until no older record of the key can survive it
    (:mod:`kvfs.meta.tombstones`); empty: none written (nothing is kept)."""

    keys: Keys
    tombstones: Items[Annotated[list[Replica], msgspec.Meta(min_length=1, max_length=MAX_REPLICAS)]] = []


class Matched(Response, frozen=True, kw_only=True):
    n: Count


class MatchPrefix(Request[Matched], frozen=True, kw_only=True):
    """How many leading keys are present and unexpired; ``lease_s`` keeps them from GC
    (``holder``'s lease)."""

    keys: Keys
    lease_s: Seconds | None = None
    holder: Holder = ""


class Existing(Response, frozen=True, kw_only=True):
    exists: Items[bool]


class Exists(Request[Existing], frozen=True, kw_only=True):
    """``lease_s``: the keys present are kept from eviction that long, by ``holder``'s
    lease (until it RELEASEs them)."""

    keys: Keys
    lease_s: Seconds | None = None
    holder: Holder = ""


class Released(Response, frozen=True, kw_only=True):
    released: Count  # keys on which this ended the holder's lease


class Release(Request[Released], frozen=True, kw_only=True):
    """End ``holder``'s leases of keys early; other holders' leases on them stay."""

    keys: Keys
    holder: Holder = ""


class LostItem(NamedTuple):
    key: Key
    layout: Layout  # the layout the reader read: the key is dropped only if it still has it


class LostDropped(Response, frozen=True, kw_only=True):
    dropped: Count


class ReportLost(Request[LostDropped], frozen=True, kw_only=True):
    """Keys a reader found lost: every replica answered without good bytes (CRC mismatch,
    record gone), not merely unreachable."""

    items: NonEmpty[LostItem]


class BadNoted(Response, frozen=True, kw_only=True):
    queued: Count  # replicas meta will check (the rest: no longer in the key's layout, already
    # queued, or past meta's --suspect-replicas)


class ReportBad(Request[BadNoted], frozen=True, kw_only=True):
    """Replicas a reader found failing their CRC-32C (the value read from another replica):
    meta checks each on its chunkserver (CHUNK_VERIFY), and repairs those found bad from a
    good copy, as a scrub does; a reader's word alone changes nothing."""

    items: Annotated[list[BadReplica], msgspec.Meta(min_length=1, max_length=MAX_REPORT_BAD)]


class KeyEntry(NamedTuple):
    key: Key
    size: Count
    created: Timestamp
    expires_at: Timestamp | None
    extents: Count


class Listing(Response, frozen=True, kw_only=True):
    entries: Annotated[list[KeyEntry], msgspec.Meta(max_length=MAX_LIST)]
    more: bool
    last: Key | None  # the key to pass as ``start_after`` for the next page


class ListKeys(Request[Listing], frozen=True, kw_only=True):
    prefix: Annotated[bytes, msgspec.Meta(max_length=MAX_KEY_BYTES)] = b""
    start_after: Key | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_LIST)] = 1000


class Touch(Request[Empty], frozen=True, kw_only=True):
    """Marks keys read (from a client's layout cache): last_access for LRU eviction."""

    keys: Keys


# -- meta: cluster --------------------------------------------------------------------------
class RepairState(Response, frozen=True, kw_only=True):
    """Extents with a replica on a dead server (:mod:`kvfs.meta.repair`)."""

    under_replicated_extents: Count = 0
    under_replicated_bytes: Count = 0
    unrepairable_extents: Count = 0  # no replica on a live server: lost unless one returns


class GcSummary(Response, frozen=True, kw_only=True):
    paused: bool
    metrics: Counters
    last_run: RunCounters | None
    dead_chunks: Count
    repair: RepairState = RepairState()


class ServerStats(msgspec.Struct, frozen=True, kw_only=True):
    server_id: ServerId
    addr: Addr
    alive: bool
    dead: bool = False  # silent past dead_after_s: its replicas count as lost
    draining: bool = False  # being decommissioned: no new placements, repair moves its extents
    capacity: Count
    free: Count
    used: Count
    shared_by: Count  # chunkservers on its disk (capacity and free are its share)
    chunks: Count
    written: Count
    live: Count
    garbage: Count


class StatsReply(Response, frozen=True, kw_only=True):
    keys: Count
    keys_stored: Count
    bytes: Count
    servers: Items[ServerStats]
    time: Timestamp
    gc: GcSummary
    leases_overflowed: Count = 0  # leases this meta gave the overflow holder (past
    #                               --max-lease-holders on a key) since it started
    store: Annotated[str, msgspec.Meta(max_length=32)] = ""  # where the index lives: sqlite,
    #                               rocksdb or redis-cluster
    store_bytes: Count = 0  # a local store's files on meta's disk (0: in Redis)
    store_free: Count = 0  # free bytes on the disk of meta's data directory (0: in Redis)
    refusing: Annotated[str, msgspec.Meta(max_length=4096)] = ""  # why meta refuses every
    #                               change now (a failed WAL sync: until it is restarted; its
    #                               store's disk full: until there is room); "": it takes them


class Stats(Request[StatsReply], frozen=True, kw_only=True):
    pass


class Registered(Response, frozen=True, kw_only=True):
    server_id: ServerId
    cluster_id: ClusterId


class Register(Request[Registered], frozen=True, kw_only=True):
    """WrongCluster: a chunkserver of another cluster, or one holding chunks (``nchunks``)
    without a cluster id that this meta never saw."""

    server_id: ServerId | None = None  # None: meta assigns the next free id
    addr: Addr
    capacity: Count = 0
    free: Count = 0
    key: Annotated[str, msgspec.Meta(max_length=128)] = ""  # proves the data dir (state.json)
    disk: DiskId | None = None  # the filesystem it stores on; None: its own --capacity
    cluster_id: ClusterId | None = None  # None: a fresh chunkserver
    nchunks: Count = 0


class Heartbeat(Request[Empty], frozen=True, kw_only=True):
    """A chunkserver's usage and chunk table (sent by it, and forwarded by the GC)."""

    server_id: ServerId
    addr: Addr
    capacity: Count
    free: Count
    used: Count
    chunks: Table[ChunkId, Count]  # chunk id -> bytes written
    open: ChunkId | None = None  # the chunk appends go to
    wanted: Count = 0  # bytes of the last append refused for lack of space
    disk: DiskId | None = None  # the filesystem it stores on; None: its own --capacity

    @classmethod
    def of(cls, stats: ChunkStatsReply, *, server_id: int, addr: str) -> Heartbeat:
        """The one way to build a heartbeat: from a chunkserver's own figures."""
        return cls(server_id=server_id, addr=addr, capacity=stats.capacity, free=stats.free,
                   used=stats.used, chunks=stats.chunks, open=stats.open, wanted=stats.wanted,
                   disk=stats.disk)


class ServerRow(NamedTuple):
    server_id: ServerId
    addr: Addr
    capacity: Count
    free: Count
    alive: bool


class ServerList(Response, frozen=True, kw_only=True):
    servers: Items[ServerRow]
    cluster_id: ClusterId


class Servers(Request[ServerList], frozen=True, kw_only=True):
    pass


# -- chunkserver -------------------------------------------------------------------------------
class RecordHead(NamedTuple):
    """One record of an APPEND; the trailing fields let ``kvfs meta rebuild`` re-derive
    meta from the chunks (:mod:`kvfs.chunkserver.records`)."""

    key: Key
    length: Count
    crc: Crc32
    expires_at: Timestamp | None
    write_id: U63 = 0  # orders the writes of one key: newest wins
    total_size: Count | None = None  # the whole value's; None: this extent's (0: unknown)
    total_crc: Crc32 | None = None
    extent: Index = 0  # the extent's index in the value (a value is striped in extents)
    tombstone: bool = False  # a delete: no value


# where an appended value landed: (chunk_id, offset).  A plain pair, not a NamedTuple: the
# same msgpack array, built and decoded in C (a NamedTuple's constructor is Python, run for
# every key of an APPEND on both sides)
Location = tuple[ChunkId, U63]


class BadAppendAnswer(RemoteProtocolError):
    """A chunkserver's APPEND answer with not one location per record: that server's fault
    (which record went where is not known), unlike the protocol errors it raises about the
    caller's own request (``FrameTooLarge``, ``VersionMismatch``)."""


class Appended(Response, frozen=True, kw_only=True):
    locations: Items[Location]

    def one_per_record(self, records: int, server: int, what: str = "records") -> list[Location]:
        """The locations, one per record of the APPEND that ``server`` answered
        (:class:`BadAppendAnswer` otherwise)."""
        if len(self.locations) != records:
            raise BadAppendAnswer(f"chunkserver {server} answered an APPEND of {records} {what} "
                                  f"with {len(self.locations)} locations")
        return self.locations


class Append(Request[Appended], frozen=True, kw_only=True):
    """Payload: the values back to back, in record order."""

    records: NonEmpty[RecordHead]


class Range(NamedTuple):
    chunk_id: ChunkId
    offset: U63
    length: Count


class WireError(NamedTuple):
    code: Annotated[int, msgspec.Meta(ge=0, lt=2**16)]
    message: Text


class ReadVReply(Response, frozen=True, kw_only=True):
    """Payload: the bytes of every range not in ``errors``, in order."""

    errors: Table[Index, WireError] = {}


class ReadV(Request[ReadVReply], frozen=True, kw_only=True):
    ranges: NonEmpty[Range]


class ChunkStatsReply(Response, frozen=True, kw_only=True):
    chunks: Table[ChunkId, Count]
    capacity: Count
    free: Count
    used: Count
    spans_read: Count
    readv_calls: Count
    append_calls: Count
    open: ChunkId | None
    wanted: Count
    server_id: ServerId | None
    addr: Annotated[str, msgspec.Meta(max_length=MAX_ADDR_CHARS)]
    cluster_id: ClusterId | None
    disk: DiskId | None
    mtimes: Table[ChunkId, float]


class ChunkStats(Request[ChunkStatsReply], frozen=True, kw_only=True):
    mtimes: bool = False  # also each chunk file's mtime (fsck's age cutoff)


class Span(NamedTuple):
    offset: U63
    length: Count


class CompactSource(NamedTuple):
    chunk_id: ChunkId
    ranges: Items[Span]


class Compacted(Response, frozen=True, kw_only=True):
    chunk_id: ChunkId | None  # None: nothing was copied
    size: Count
    locations: Items[Items[U63 | None]]  # per source, each range's new offset (None: gone)


class ChunkCompact(Request[Compacted], frozen=True, kw_only=True):
    """Copy the records at the given ranges into one new sealed chunk."""

    sources: Annotated[list[CompactSource], msgspec.Meta(min_length=1, max_length=MAX_REFS_CHUNKS)]


class ChunksDeleted(Response, frozen=True, kw_only=True):
    deleted: Table[ChunkId, Count]  # chunk id -> bytes freed


class ChunkDelete(Request[ChunksDeleted], frozen=True, kw_only=True):
    """WrongCluster unless ``cluster_id`` is the chunkserver's."""

    chunks: Items[ChunkId]
    cluster_id: ClusterId | None


class ScanRecord(NamedTuple):
    key: Key
    write_id: U63
    extent: Index  # the extent's index in its value
    total_size: Count
    total_crc: Crc32
    length: Count
    crc: Crc32
    expires_at: Timestamp | None
    tombstone: bool
    value_ok: bool  # the value's CRC-32C checked out
    value_offset: U63


class Scanned(Response, frozen=True, kw_only=True):
    records: Items[ScanRecord]


class ChunkScan(Request[Scanned], frozen=True, kw_only=True):
    """Every record of one chunk, values checked (``kvfs meta rebuild``)."""

    chunk_id: ChunkId


class VerifyRange(NamedTuple):
    chunk_id: ChunkId
    offset: U63
    length: Count
    crc: Crc32


class Verified(Response, frozen=True, kw_only=True):
    missing: Items[Index]
    bad: Items[Index]


class ChunkVerify(Request[Verified], frozen=True, kw_only=True):
    ranges: Items[VerifyRange]


class Sealed(Response, frozen=True, kw_only=True):
    sealed: bool


class ChunkSeal(Request[Sealed], frozen=True, kw_only=True):
    """Seal the open chunk, only after ``idle_s`` without appends."""

    chunk_id: ChunkId
    idle_s: Seconds = 0.0
    apply: bool = True  # False: only say whether it would be sealed


# -- meta: garbage collection -------------------------------------------------------------------
class GcServerStatus(msgspec.Struct, frozen=True, kw_only=True):
    server_id: ServerId
    addr: Addr
    alive: bool
    capacity: Count
    used: Count
    live: Count
    garbage: Count
    ratio: float
    chunks: Count
    dead_chunks: Count
    expired_keys: Count
    fill: float


class GcStatusReply(GcSummary, frozen=True, kw_only=True):
    time: Timestamp
    servers: Items[GcServerStatus]
    expired_keys: Count


class GcStatus(Request[GcStatusReply], frozen=True, kw_only=True):
    pass


class Shadowed(NamedTuple):
    """A key the GC expires or evicts only with a tombstone: an older record of it may
    outlive this one on the chunks (:mod:`kvfs.meta.tombstones`); GC_TOMBSTONE drops it."""

    key: Key
    layout: Layout


class Expired(Response, frozen=True, kw_only=True):
    keys: Count
    bytes: Count
    more: bool
    shadowed: Items[Shadowed] = []  # expired, not removed: write their tombstones, then GC_TOMBSTONE


class GcExpire(Request[Expired], frozen=True, kw_only=True):
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_EXPIRE_BATCH)] = 10_000
    apply: bool = False


class LruAt(NamedTuple):
    """A place in eviction's LRU order: a key's last use (meta's clock, in seconds) and the key."""

    last_use: float
    key: Key


class EvictTarget(NamedTuple):
    live: Count  # live bytes before eviction
    target: Count  # the low watermark in bytes


class Evicted(Response, frozen=True, kw_only=True):
    keys: Count
    bytes: Count
    leased: Count
    servers: Table[ServerId, EvictTarget]
    short: Table[ServerId, Count]  # bytes still to free once these keys and the shadowed go
    # chosen, not removed: write their tombstones, then GC_TOMBSTONE; then GC_EVICT again (with
    # some, the call stopped choosing there, short or not)
    shadowed: Items[Shadowed] = []
    # where the walk stopped with those: the next GC_EVICT of this eviction goes on after it
    stopped_at: LruAt | None = None


class GcEvict(Request[Evicted], frozen=True, kw_only=True):
    high: Fraction = 0.9
    low: Fraction = 0.8
    apply: bool = False
    server_id: ServerId | None = None
    after_expire: bool = False  # a dry run: pick as if the expire phase had run first
    # False: pass over the keys with older records (each goes only with a tombstone, which no
    # chunkserver took): choose among the keys that go without one
    older: bool = True
    # go on from where the last GC_EVICT of this eviction stopped (its stopped_at): the keys
    # before it that it passed over are not walked again
    after: LruAt | None = None
    # empty this chunk instead (the watermarks unused): every key with a replica in it, or
    # none if one is leased, so it is deleted, not copied; the GC's way out where a server
    # needs room and has too little to copy the live bytes of any chunk it could compact
    chunk: ChunkId | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.low <= self.high:
            raise ValueError(f"watermarks need 0 < low <= high <= 1, got low={self.low} high={self.high}"
                             " - at `$.low`")


class CompactCandidate(NamedTuple):
    server_id: ServerId
    chunk_id: ChunkId
    written: Count
    live: Count


class DeleteCandidate(NamedTuple):
    server_id: ServerId
    chunk_id: ChunkId
    written: Count


class SealCandidate(NamedTuple):
    """An open chunk to seal; once sealed it is a compact (live > 0) or delete candidate."""

    server_id: ServerId
    chunk_id: ChunkId
    written: Count
    live: Count


class Plan(Response, frozen=True, kw_only=True):
    compact: Items[CompactCandidate]  # most garbage first
    delete: Items[DeleteCandidate]
    seal: Items[SealCandidate]
    waiting: Count  # chunks without live bytes still inside the grace period


class Watermarks(NamedTuple):
    high: Fraction
    low: Fraction


class GcPlan(Request[Plan], frozen=True, kw_only=True):
    threshold: Fraction = 0.3
    grace_s: Seconds = 30.0
    high: Fraction = 0.9
    after_expire: bool = False  # a dry run: plan as if the expire phase had run first
    after_evict: Watermarks | None = None  # a dry run: ... and the evict phase with these


class Ref(NamedTuple):
    key: Key
    offset: U63
    length: Count
    crc: Crc32


class ChunkRefs(Response, frozen=True, kw_only=True):
    refs: Table[ChunkId, Items[Ref]]


class GcChunkRefs(Request[ChunkRefs], frozen=True, kw_only=True):
    """References into the given chunks (compaction's question; O(their keys) in meta).
    Every range of a server is walked with GC_LAYOUTS pages instead (kvfs.gc.scrub)."""

    chunks: Annotated[list[ChunkId], msgspec.Meta(min_length=1, max_length=MAX_REFS_CHUNKS)]


class KeyLayout(NamedTuple):
    key: Key
    layout: Layout


class KeyLayouts(Response, frozen=True, kw_only=True):
    rows: Annotated[list[KeyLayout], msgspec.Meta(max_length=MAX_LIST)]  # none: past the last key
    time: Timestamp = 0.0  # meta's clock as it read them (a key expired by it is dead; 0: none is)


class GcLayouts(Request[KeyLayouts], frozen=True, kw_only=True):
    """One page of the stored keys after ``start_after``, in key order, with their layouts
    (expired ones included): the background scrub's walk."""

    start_after: Key | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_LIST)] = 1000


class Move(NamedTuple):
    key: Key
    old_chunk: ChunkId
    old_offset: U63
    new_offset: U63


class Relocated(Response, frozen=True, kw_only=True):
    moved: Count
    skipped: Count


class GcRelocate(Request[Relocated], frozen=True, kw_only=True):
    server_id: ServerId
    new_chunk: ChunkId
    new_size: Count | None = None
    moves: Items[Move]


class Retired(Response, frozen=True, kw_only=True):
    retired: Items[ChunkId]


class GcRetire(Request[Retired], frozen=True, kw_only=True):
    server_id: ServerId
    chunks: Items[ChunkId]


class GcDeleted(Request[Empty], frozen=True, kw_only=True):
    server_id: ServerId
    deleted: Table[ChunkId, Count]
    compacted: Count = 0
    copied: Count = 0


class GcControlled(Response, frozen=True, kw_only=True):
    paused: bool
    granted: bool = True  # the daemon lease is the holder's (always, without a holder)
    # (to a holder) the last key the background scrub verified, as the last pass reported it:
    # a daemon taking its turn, or restarted, goes on after it
    scrub_cursor: Key | None = None


class GcControl(Request[GcControlled], frozen=True, kw_only=True):
    paused: bool | None = None  # None: only ask
    holder: Name | None = None  # a GC daemon taking or renewing the lease daemons take turns by
    lease_s: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_SECONDS)] = 30.0


class GcReport(Request[Empty], frozen=True, kw_only=True):
    run: RunCounters  # a finished pass's counters (kvfs.gc.driver.PassReport)
    scrub_cursor: Key | None = None  # the last key its background scrub verified (kept by meta)


class BadReplica(NamedTuple):
    key: Key
    server_id: ServerId
    chunk_id: ChunkId
    offset: U63


class Dropped(Response, frozen=True, kw_only=True):
    dropped: Count
    deleted_keys: Count


class GcDropReplicas(Request[Dropped], frozen=True, kw_only=True):
    """fsck repair: forget replicas whose bytes are missing or corrupt."""

    items: Items[BadReplica]


class TombstoneDrop(NamedTuple):
    key: Key
    layout: Layout  # as GC_EXPIRE or GC_EVICT named it: the key is removed only if it still has it
    tombstone: Annotated[list[Replica], msgspec.Meta(min_length=1, max_length=MAX_REPLICAS)]


class Tombstoned(Response, frozen=True, kw_only=True):
    keys: Count
    bytes: Count  # the removed values' bytes on disk, every replica


class GcTombstone(Request[Tombstoned], frozen=True, kw_only=True):
    """Remove keys GC_EXPIRE or GC_EVICT left for a tombstone (``shadowed``), keeping the
    tombstone the GC wrote for each, compare-and-swap: each key still with that layout, and
    still expired (``evict``: or without a lease)."""

    items: NonEmpty[TombstoneDrop]
    evict: bool = False


class RoomMade(Response, frozen=True, kw_only=True):
    expired_keys: Count
    evicted_keys: Count
    bytes_reclaimed: Count

    @property
    def freed(self) -> bool:
        """The pass freed something (a write may fit now, or another took that room)."""
        return bool(self.expired_keys or self.evicted_keys or self.bytes_reclaimed)


class MakeRoom(Request[RoomMade], frozen=True, kw_only=True):
    """A write found the cluster full: meta runs one GC pass (expire, evict to the low
    watermark and to fit the refused write, compact, delete) before answering.
    Concurrent requests share one pass."""


class RepairItem(NamedTuple):
    """An extent to copy: read it from a ``sources`` replica (on live servers), write it to
    a live server not in ``holders``, then switch ``lost`` to the copy (GC_REPAIR)."""

    key: Key
    extent: Index  # the extent's index in the value
    length: Count
    crc: Crc32
    expires_at: Timestamp | None
    sources: Items[Replica]
    lost: Replica
    holders: Items[ServerId]  # servers holding a replica of this extent (the lost one too)


class RepairPlan(RepairState, frozen=True, kw_only=True):
    items: Items[RepairItem]  # (at most MAX_REPAIR_PLAN_ITEMS from a meta of this version)


class GcRepairPlan(Request[RepairPlan], frozen=True, kw_only=True):
    """Extents with a replica on a dead server and one on a live server, up to
    ``limit_bytes`` of them (at least one) and :data:`MAX_REPAIR_PLAN_ITEMS`, and with
    ``totals`` the totals of every under-replicated one (a walk of every key on the gone
    servers; without, the answer's totals are 0 and meta stops at the plan's bounds)."""

    limit_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_REPAIR_BATCH_BYTES)] = 16 * 1024 * 1024
    totals: bool = True


class ReplicaSwitch(NamedTuple):
    key: Key
    extent: Index
    lost: Replica
    new: Replica


class Repaired(Response, frozen=True, kw_only=True):
    repaired: Count
    skipped: Count  # the layout no longer held the lost replica (a racing write won)


class GcRepair(Request[Repaired], frozen=True, kw_only=True):
    """Switch each lost replica to its copy, compare-and-swap (:mod:`kvfs.meta.repair`)."""

    items: Items[ReplicaSwitch]


class ScrubPlanned(Response, frozen=True, kw_only=True):
    items: Items[RepairItem]  # copy a good replica over a bad one (then GC_REPAIR)
    drop: Items[BadReplica]  # no good copy on a live server: forget (GC_DROP_REPLICAS)
    lost: Items[Key]  # keys with an extent whose every replica is bad: dropping deletes them


class GcScrubPlan(Request[ScrubPlanned], frozen=True, kw_only=True):
    """What to do about replicas a scrub found missing or corrupt (:func:`kvfs.meta.repair.plan_scrub`)."""

    bad: Items[BadReplica]


class DrainState(Response, frozen=True, kw_only=True):
    server_id: ServerId
    draining: bool
    forgotten: bool  # drained and forgotten: its id is never given out again
    extents_left: Count  # extents with a replica still on it
    bytes_left: Count


class GcDecommission(Request[DrainState], frozen=True, kw_only=True):
    """Drain a chunkserver (no new placements; the repair step copies its extents to other
    servers; meta forgets it once nothing references it), ``cancel`` a drain, or only ask
    (``start=False``)."""

    server_id: ServerId
    start: bool = True
    cancel: bool = False


# -- the table -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rpc:
    op: Op
    service: Service
    request: type[Request[Any]]
    doc: str
    roles: tuple[Role, ...] = ADMIN  # the token roles that may call it
    # the answer's type: the request's ``R``, found once (every answer looks it up)
    response: type[Response] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "response", response_type(self.request))

    @property
    def handler(self) -> str:
        return "rpc_" + self.op.name.lower()


def response_type(request: type[Request[Any]]) -> type[Response]:
    """The ``R`` of ``class X(Request[R])``."""
    for base in getattr(request, "__orig_bases__", ()):
        args = get_args(base)
        if args and isinstance(args[0], type) and issubclass(args[0], Response):
            return args[0]
    raise TypeError(f"{request.__name__} does not declare its response type")


def _rpcs(*rpcs: Rpc) -> dict[Op, Rpc]:
    return {r.op: r for r in rpcs}


# (duplicates: the rows below pair up by shape; each is one RPC, declared once)
RPCS: dict[Op, Rpc] = _rpcs(
    Rpc(Op.HELLO, Service.ANY, Hello, "server -> client on connect: protocol version and a nonce", ANYONE),
    Rpc(Op.AUTH, Service.ANY, Auth, "client's first frame: both sides prove a token (kvfs.handshake)",
        ANYONE),
    Rpc(Op.PING, Service.ANY, Ping, "liveness; names the service", ANYONE),
    Rpc(Op.LOOKUP, Service.META, Lookup, "layouts of many keys (None: miss), optional lease (the holder's); "
        "with `dirs`, which misses have keys under `key/`", DATA),
    Rpc(Op.COMMIT, Service.META, Commit, "make appended values visible, in one transaction (past meta's "
        "--commit-group-max-keys: in parts of that many, in order) (layouts as `items` or as "
        "`packed` columns, kvfs.packed); if_absent: only keys not present", DATA),
    Rpc(Op.DELETE, Service.META, Delete, "forget keys (keeping the tombstones named); their bytes become garbage", DATA),
    Rpc(Op.MATCH_PREFIX, Service.META, MatchPrefix, "count of leading keys present, optional lease (the holder's)", DATA),
    Rpc(Op.LIST, Service.META, ListKeys, "keys under a prefix, one page in key order", DATA),
    Rpc(Op.STATS, Service.META, Stats, "keys, bytes, per-server usage, GC summary, leases past --max-lease-holders, meta's store and its bytes on disk", DATA),
    Rpc(Op.REGISTER, Service.META, Register, "a chunkserver joins (or rejoins) the cluster", SERVER),
    Rpc(Op.HEARTBEAT, Service.META, Heartbeat, "a chunkserver's usage and chunk table", SERVER_OR_ADMIN),
    Rpc(Op.SERVERS, Service.META, Servers, "the chunkservers meta knows", DATA),
    Rpc(Op.EXISTS, Service.META, Exists, "which keys are present and unexpired, optional lease (the holder's)", DATA),
    Rpc(Op.RELEASE, Service.META, Release, "end the holder's leases of keys early: GC may evict those no other holder leases", DATA),
    Rpc(Op.REPORT_LOST, Service.META, ReportLost,
        "a reader found keys whose every replica is corrupt or gone: meta drops each key "
        "that still has the layout read (an overwrite since is kept)", DATA),
    Rpc(Op.REPORT_BAD, Service.META, ReportBad,
        "a reader found replicas failing their CRC-32C: meta checks them on their chunkservers "
        "and repairs those found bad from a good copy", DATA),
    Rpc(Op.APPEND, Service.CHUNKSERVER, Append,
        "write records (values in the payload) to the open chunk", DATA),
    Rpc(Op.READV, Service.CHUNKSERVER, ReadV, "read many ranges; bytes in the payload", DATA),
    Rpc(Op.CHUNK_STATS, Service.CHUNKSERVER, ChunkStats, "chunk table and usage", ADMIN),
    Rpc(Op.GC_STATUS, Service.META, GcStatus, "garbage per server, metrics, last pass", ADMIN),
    Rpc(Op.GC_EXPIRE, Service.META, GcExpire, "remove keys whose TTL passed (dry run unless apply)", ADMIN),
    Rpc(Op.GC_EVICT, Service.META, GcEvict,
        "remove LRU unleased keys of servers over the high watermark, or of one chunk", ADMIN),
    Rpc(Op.GC_PLAN, Service.META, GcPlan, "chunks to compact, delete, seal", ADMIN),
    Rpc(Op.GC_CHUNK_REFS, Service.META, GcChunkRefs, "live references into chunks", ADMIN),
    Rpc(Op.GC_LAYOUTS, Service.META, GcLayouts,
        "stored keys after a key, one page in key order, with their layouts (the scrub's and fsck's walk)", ADMIN),
    Rpc(Op.GC_RELOCATE, Service.META, GcRelocate,
        "switch layouts to compacted copies (compare-and-swap)", ADMIN),
    Rpc(Op.GC_RETIRE, Service.META, GcRetire, "mark unreferenced chunks dead (compare-and-swap)", ADMIN),
    Rpc(Op.GC_DELETED, Service.META, GcDeleted, "chunks a chunkserver deleted; GC counters", ADMIN),
    Rpc(Op.GC_CONTROL, Service.META, GcControl, "pause or resume GC; a GC daemon takes its turn (holder, lease_s)", ADMIN),
    Rpc(Op.GC_REPORT, Service.META, GcReport, "a finished pass's report", ADMIN),
    Rpc(Op.GC_DROP_REPLICAS, Service.META, GcDropReplicas, "fsck repair: forget bad replicas", ADMIN),
    Rpc(Op.GC_TOMBSTONE, Service.META, GcTombstone,
        "remove expired or evicted keys with older records, keeping the tombstones the GC wrote "
        "(compare-and-swap)", ADMIN),
    Rpc(Op.GC_REPAIR_PLAN, Service.META, GcRepairPlan,
        "extents that lost a replica to a dead server, to copy", ADMIN),
    Rpc(Op.GC_REPAIR, Service.META, GcRepair,
        "switch lost replicas to their copies (compare-and-swap)", ADMIN),
    Rpc(Op.GC_SCRUB_PLAN, Service.META, GcScrubPlan,
        "scrub: repair or drop the replicas found bad", ADMIN),
    Rpc(Op.GC_DECOMMISSION, Service.META, GcDecommission,
        "drain a chunkserver, then forget it (or cancel, or ask)", ADMIN),
    Rpc(Op.TOUCH, Service.META, Touch, "mark keys read (LRU)", DATA),
    Rpc(Op.MAKE_ROOM, Service.META, MakeRoom, "a write found the cluster full: meta runs one GC pass",
        DATA),
    Rpc(Op.CHUNK_COMPACT, Service.CHUNKSERVER, ChunkCompact, "copy live records into a new chunk", ADMIN),
    Rpc(Op.CHUNK_DELETE, Service.CHUNKSERVER, ChunkDelete, "unlink retired chunks", ADMIN),
    Rpc(Op.CHUNK_VERIFY, Service.CHUNKSERVER, ChunkVerify, "check ranges' CRC-32C", ADMIN),
    Rpc(Op.CHUNK_SCAN, Service.CHUNKSERVER, ChunkScan, "every record of a chunk (meta rebuild)", ADMIN),
    Rpc(Op.CHUNK_SEAL, Service.CHUNKSERVER, ChunkSeal, "seal the open chunk after idle_s", ADMIN),
)

OP_OF: dict[type[Request[Any]], Op] = {r.request: r.op for r in RPCS.values()}


# -- decoding --------------------------------------------------------------------------------------
def _typed(flags: Flag, types: dict[Op, type[msgspec.Struct]]) -> dict[int, HeaderDecode]:
    return {header_key(op, flags): msgspec.msgpack.Decoder(typ).decode for op, typ in types.items()}


# each frame's header decoded straight from its bytes into its type, once
# (kvfs.protocol.FrameDecoder's ``typed``): the requests a server receives (AUTH, the
# connection's first, is checked as a map by the handshake), and the answers a client does
REQUESTS: dict[int, HeaderDecode] = _typed(
    Flag.NONE, {op: r.request for op, r in RPCS.items() if op not in (Op.HELLO, Op.AUTH)})
ANSWERS: dict[int, HeaderDecode] = _typed(Flag.RESPONSE, {op: r.response for op, r in RPCS.items()})


def decode(header: dict[str, Any], typ: type[T]) -> T:
    """A decoded msgpack header checked against ``typ``; raises ``msgspec.ValidationError``
    naming the field path (``$.items[3].layout``)."""
    return msgspec.convert(header, typ)


def message(frame: FrameHead, typ: type[T]) -> T:
    """A frame's header as ``typ``: the message its decoder made straight from its bytes
    (:data:`REQUESTS`, :data:`ANSWERS`), else its plain map checked (:func:`decode`: a
    header that did not decode into its type names here what is wrong)."""
    msg = frame.message
    if type(msg) is typ:
        return msg
    return decode(frame.header, typ)


def to_dict(msg: msgspec.Struct) -> dict[str, Any]:
    """A message as plain Python (bytes stay bytes), e.g. for ``--json`` output."""
    out = msgspec.to_builtins(msg, builtin_types=(bytes, bytearray, memoryview))
    assert isinstance(out, dict)
    return out
