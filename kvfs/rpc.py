"""Every RPC, described once, with the token roles that may call it
(:class:`kvfs.handshake.Role`: client, admin, server).

Op numbers are stable and never reused.  Client stubs
(:meth:`kvfs.transport.Connection.call`), server dispatch
(:class:`kvfs.server.RpcServer` calls ``handler.rpc_<name>``) and test fakes
all derive from :data:`RPCS`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvfs.handshake import Role


class Service(enum.Enum):
    ANY = "any"
    META = "meta"
    CHUNKSERVER = "chunkserver"


class Op(enum.IntEnum):
    # connection
    HELLO = 1  # server -> client on connect: {version, nonce, service}
    AUTH = 2  # client -> server: {version, mac}; reply {} or an error frame
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
    # garbage collection: chunkserver (56-63)
    CHUNK_COMPACT = 56
    CHUNK_DELETE = 57
    CHUNK_VERIFY = 58
    CHUNK_SEAL = 59
    CHUNK_SCAN = 60


ANYONE = (Role.CLIENT, Role.ADMIN, Role.SERVER)
DATA = (Role.CLIENT, Role.ADMIN)  # an admin token may do what a client token may
ADMIN = (Role.ADMIN,)
SERVER = (Role.SERVER,)
SERVER_OR_ADMIN = (Role.SERVER, Role.ADMIN)  # the GC refreshes meta's view of a chunkserver


@dataclass(frozen=True)
class Rpc:
    op: Op
    service: Service
    request: str  # msgpack header fields of the request (and what the payload holds)
    response: str
    roles: tuple[Role, ...] = ADMIN  # the token roles that may call it


RPCS: dict[Op, Rpc] = {
    r.op: r
    for r in (
        Rpc(Op.HELLO, Service.ANY, "{version, nonce, service}", "-", roles=ANYONE),
        Rpc(Op.AUTH, Service.ANY, "{version, nonce, client, server, mac} (kvfs.handshake)",
            "{role, mac}", roles=ANYONE),
        Rpc(Op.PING, Service.ANY, "{}", "{service}", roles=ANYONE),
        Rpc(Op.LOOKUP, Service.META, "{keys: [bytes]}", "{layouts: [layout | nil]}", roles=DATA),
        Rpc(Op.COMMIT, Service.META, "{items: [[key, layout]]}", "{}", roles=DATA),
        Rpc(Op.DELETE, Service.META, "{keys}", "{deleted: int}", roles=DATA),
        Rpc(Op.MATCH_PREFIX, Service.META, "{keys, lease_s?}", "{n: int}", roles=DATA),
        Rpc(Op.EXISTS, Service.META, "{keys}", "{exists: [bool]}", roles=DATA),
        Rpc(Op.LIST, Service.META, "{prefix, start_after?, limit}",
            "{entries: [[key, size, created, expires_at]], more: bool}", roles=DATA),
        Rpc(Op.STATS, Service.META, "{}", "{keys, bytes, servers: [...], chunks}", roles=DATA),
        Rpc(Op.REGISTER, Service.META,
            "{server_id?, addr, capacity, free, key, disk, cluster_id?, nchunks}",
            "{server_id, cluster_id} (WrongCluster: another cluster's chunkserver, or one holding "
            "chunks this meta never saw)", roles=SERVER),
        Rpc(Op.HEARTBEAT, Service.META, "{server_id, addr, capacity, free, used, chunks}", "{}",
            roles=SERVER_OR_ADMIN),
        Rpc(Op.SERVERS, Service.META, "{}",
            "{servers: [[id, addr, capacity, free, alive]], cluster_id}", roles=DATA),
        Rpc(Op.APPEND, Service.CHUNKSERVER,
            "{records: [[key, length, crc, expires_at, write_id?, total_size?, total_crc?, index?, "
            "tombstone?]]} + payload: the values back to back",
            "{locations: [[chunk_id, offset]]}", roles=DATA),
        Rpc(Op.READV, Service.CHUNKSERVER, "{ranges: [[chunk_id, offset, length]]}",
            "{errors: {index: [code, message]}, spans: int} + payload: the ok ranges in order", roles=DATA),
        Rpc(Op.CHUNK_STATS, Service.CHUNKSERVER, "{}",
            "{chunks: {id: size}, capacity, free, used, open: chunk_id | nil, mtimes: {id: mtime}}", roles=ADMIN),
        # garbage collection (driven by kvfs.gc; every destructive step is compare-and-swap)
        Rpc(Op.GC_STATUS, Service.META, "{}",
            "{paused, time, servers: [{server_id, capacity, used, live, garbage, ratio, "
            "expired_keys, ...}], metrics, last_run, expired_keys, dead_chunks}", roles=ADMIN),
        Rpc(Op.GC_EXPIRE, Service.META, "{limit, apply}", "{keys, bytes, more}", roles=ADMIN),
        Rpc(Op.GC_EVICT, Service.META, "{high, low, apply, server_id?, after_expire?}",
            "{keys, bytes, leased, servers: {id: [live_before, target]}}", roles=ADMIN),
        Rpc(Op.GC_PLAN, Service.META, "{threshold, grace_s, high, low, after_expire?, after_evict?: [high, low]}",
            "{compact: [[server_id, chunk_id, written, live]], delete: [[server_id, chunk_id, written]], "
            "seal: [[server_id, chunk_id, written, live]] (open chunks that become compact (live > 0) "
            "or delete candidates once sealed), waiting: int}", roles=ADMIN),
        Rpc(Op.GC_CHUNK_REFS, Service.META, "{chunk_id}", "{refs: [[key, offset, length, crc]]}",
            roles=ADMIN),
        Rpc(Op.GC_RELOCATE, Service.META,
            "{server_id, new_chunk, new_size, moves: [[key, old_chunk, old_offset, new_offset]]}",
            "{moved, skipped}", roles=ADMIN),
        Rpc(Op.GC_RETIRE, Service.META, "{server_id, chunks: [id]}", "{retired: [id]}", roles=ADMIN),
        Rpc(Op.GC_DELETED, Service.META, "{server_id, deleted: {id: size}, compacted?, copied?}", "{}", roles=ADMIN),
        Rpc(Op.GC_CONTROL, Service.META, "{paused?: bool}", "{paused}", roles=ADMIN),
        Rpc(Op.GC_REPORT, Service.META, "{run: {...}}", "{}", roles=ADMIN),
        Rpc(Op.GC_DROP_REPLICAS, Service.META, "{items: [[key, server_id, chunk_id, offset]]}",
            "{dropped, deleted_keys}", roles=ADMIN),
        Rpc(Op.TOUCH, Service.META, "{keys}", "{} (marks keys read: last_access for LRU eviction)", roles=DATA),
        Rpc(Op.CHUNK_COMPACT, Service.CHUNKSERVER, "{sources: [[chunk_id, [[offset, length]]]]}",
            "{chunk_id | nil, size, locations: [[new_offset | nil]] per source}", roles=ADMIN),
        Rpc(Op.CHUNK_DELETE, Service.CHUNKSERVER, "{chunks: [id], cluster_id}",
            "{deleted: {id: size}} (WrongCluster unless cluster_id is the chunkserver's)", roles=ADMIN),
        Rpc(Op.CHUNK_VERIFY, Service.CHUNKSERVER, "{ranges: [[chunk_id, offset, length, crc]]}",
            "{missing: [index], bad: [index]}", roles=ADMIN),
        Rpc(Op.CHUNK_SCAN, Service.CHUNKSERVER, "{chunk_id}",
            "{records: [[key, write_id, index, total_size, total_crc, length, crc, expires_at, "
            "tombstone, value_ok, value_offset]]} (every record of the chunk, values checked)",
            roles=ADMIN),
        Rpc(Op.CHUNK_SEAL, Service.CHUNKSERVER, "{chunk_id, idle_s, apply?}",
            "{sealed: bool} (the open chunk is sealed only after idle_s without appends; "
            "apply=false only says whether it would be)", roles=ADMIN),
    )
}

HANDLER_NAMES: dict[Op, str] = {op: "rpc_" + op.name.lower() for op in RPCS}
