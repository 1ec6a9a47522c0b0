"""Every RPC, described once.

Op numbers are stable and never reused.  Client stubs
(:meth:`kvfs.transport.Connection.call`), server dispatch
(:class:`kvfs.server.RpcServer` calls ``handler.rpc_<name>``) and test fakes
all derive from :data:`RPCS`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Rpc:
    op: Op
    service: Service
    request: str  # msgpack header fields of the request (and what the payload holds)
    response: str


RPCS: dict[Op, Rpc] = {
    r.op: r
    for r in (
        Rpc(Op.HELLO, Service.ANY, "{version, nonce, service}", "-"),
        Rpc(Op.AUTH, Service.ANY, "{version, mac=HMAC-SHA256(token, nonce)}", "{}"),
        Rpc(Op.PING, Service.ANY, "{}", "{service}"),
        Rpc(Op.LOOKUP, Service.META, "{keys: [bytes]}", "{layouts: [layout | nil]}"),
        Rpc(Op.COMMIT, Service.META, "{items: [[key, layout]]}", "{}"),
        Rpc(Op.DELETE, Service.META, "{keys}", "{deleted: int}"),
        Rpc(Op.MATCH_PREFIX, Service.META, "{keys, lease_s?}", "{n: int}"),
        Rpc(Op.EXISTS, Service.META, "{keys}", "{exists: [bool]}"),
        Rpc(Op.LIST, Service.META, "{prefix, start_after?, limit}",
            "{entries: [[key, size, created, expires_at]], more: bool}"),
        Rpc(Op.STATS, Service.META, "{}", "{keys, bytes, servers: [...], chunks}"),
        Rpc(Op.REGISTER, Service.META, "{server_id?, addr, capacity, free}", "{server_id}"),
        Rpc(Op.HEARTBEAT, Service.META, "{server_id, addr, capacity, free, used, chunks}", "{}"),
        Rpc(Op.SERVERS, Service.META, "{}", "{servers: [[id, addr, capacity, free, alive]]}"),
        Rpc(Op.APPEND, Service.CHUNKSERVER,
            "{records: [[key, length, crc, expires_at]]} + payload: the values back to back",
            "{locations: [[chunk_id, offset]]}"),
        Rpc(Op.READV, Service.CHUNKSERVER, "{ranges: [[chunk_id, offset, length]]}",
            "{errors: {index: [code, message]}, spans: int} + payload: the ok ranges in order"),
        Rpc(Op.CHUNK_STATS, Service.CHUNKSERVER, "{}", "{chunks: {id: size}, capacity, free}"),
    )
}

HANDLER_NAMES: dict[Op, str] = {op: "rpc_" + op.name.lower() for op in RPCS}
