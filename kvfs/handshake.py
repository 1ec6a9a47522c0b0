"""The connection handshake, sans-IO: both sides prove a token, bound to the connection.

::

    server -> client  HELLO {version, nonce: sn, service}
    client -> server  AUTH  {version, nonce: cn, client: [host, port], server: [host, port],
                             mac: HMAC(token, "client" | sn | cn | service | client | server)}
    server -> client  AUTH reply {role, mac: HMAC(token, "server" | the same fields)}

``client``/``server`` are the two ends of the TCP connection as the client's socket
sees them.  The server finds which of its role tokens made the client's MAC (that
is the connection's role), then checks the addresses against its own view of the
connection: a relay between them (``kvfs://evil:port`` forwarding to the real
server) shows up as a different address and is refused, and since the MAC covers
the addresses the relay cannot rewrite them.  The server's MAC, with the side named,
proves to the client that the server holds the same token; a client refuses a
server that cannot prove it.  Nonces are fresh per connection, so nothing recorded
can be replayed.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Any

from kvfs.errors import AuthError, RemoteProtocolError

NONCE_BYTES = 16


class Role(enum.Enum):
    """Who a token speaks for (what a connection authenticated with it may call)."""

    CLIENT = "client"  # data: get, put, delete, lookup, match_prefix
    ADMIN = "admin"  # GC, fsck, chunk deletion, pause/resume; also every client op
    SERVER = "server"  # chunkservers: register and heartbeat


Endpoint = tuple[str, int]


def endpoint(sockaddr: Any) -> Endpoint:
    """``(host, port)`` of a socket address (IPv4 or IPv6 tuple)."""
    if not isinstance(sockaddr, (tuple, list)) or len(sockaddr) < 2:
        raise RemoteProtocolError(f"not an address: {sockaddr!r:.80}")
    host = str(sockaddr[0]).removeprefix("::ffff:")
    return host, int(sockaddr[1])


def _mac(token: str, side: bytes, sn: bytes, cn: bytes, service: str, client: Endpoint,
         server: Endpoint) -> bytes:
    msg = b"\0".join((b"kvfs-auth/2", side, sn, cn, service.encode(),
                      f"{client[0]}|{client[1]}|{server[0]}|{server[1]}".encode()))
    return hmac.new(token.encode(), msg, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def client_auth(token: str, hello: Mapping[str, Any], client_nonce: bytes, local: Endpoint,
                peer: Endpoint) -> dict[str, Any]:
    """The AUTH header a client sends in answer to ``hello``."""
    sn = hello.get("nonce")
    if not isinstance(sn, bytes) or len(sn) != NONCE_BYTES:
        raise RemoteProtocolError("the server's HELLO has no valid nonce")
    service = str(hello.get("service", ""))
    return {"version": hello.get("version"), "nonce": client_nonce, "client": list(local),
            "server": list(peer),
            "mac": _mac(token, b"client", sn, client_nonce, service, local, peer)}


def check_server_proof(token: str, hello: Mapping[str, Any], auth: Mapping[str, Any],
                       reply: Mapping[str, Any], name: str) -> Role:
    """The client's check of the server's AUTH reply; returns the role it granted."""
    mac = reply.get("mac")
    want = _mac(token, b"server", hello["nonce"], auth["nonce"], str(hello.get("service", "")),
                endpoint(auth["client"]), endpoint(auth["server"]))
    if not isinstance(mac, bytes) or not hmac.compare_digest(mac, want):
        raise AuthError(f"the server at {name} could not prove it holds the cluster token "
                        "(an impostor or a relay?); refusing it")
    try:
        return Role(reply.get("role"))
    except ValueError:
        raise RemoteProtocolError(f"{name} granted an unknown role {reply.get('role')!r:.40}") from None


def server_check(tokens: Mapping[Role, str], nonce: bytes, service: str, auth: Mapping[str, Any],
                 local: Endpoint, peer: Endpoint, *, bind_addresses: bool = True,
                 ) -> tuple[Role, dict[str, Any]]:
    """The server's check of a client's AUTH header: (the role its token has, the reply
    header proving the server's own knowledge of that token).  Raises AuthError."""
    cn, mac = auth.get("nonce"), auth.get("mac")
    if not isinstance(cn, bytes) or len(cn) != NONCE_BYTES or not isinstance(mac, bytes):
        raise AuthError("AUTH without a client nonce and MAC (a client older than this server?)")
    try:
        client, server = endpoint(auth.get("client")), endpoint(auth.get("server"))
    except (RemoteProtocolError, TypeError, ValueError):
        raise AuthError("AUTH without the connection's addresses") from None
    role = next((r for r, t in tokens.items()
                 if hmac.compare_digest(mac, _mac(t, b"client", nonce, cn, service, client, server))),
                None)
    if role is None:
        raise AuthError("wrong cluster token: none of this server's client, admin or server "
                        "tokens (check KVFS_TOKEN or the token file)")
    if bind_addresses and (client != peer or server != local):
        raise AuthError(f"the client connected to {server[0]}:{server[1]} from {client[0]}:"
                        f"{client[1]}, but this connection runs {peer[0]}:{peer[1]} -> "
                        f"{local[0]}:{local[1]}: a relay is between them (behind NAT or a proxy, "
                        "start the server with --no-bind-auth-to-addresses)")
    return role, {"role": role.value,
                  "mac": _mac(tokens[role], b"server", nonce, cn, service, client, server)}
