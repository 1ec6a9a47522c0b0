"""Cluster addresses (``kvfs://host:port``) and the role tokens (client, admin, server)."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from kvfs.datadir import private_dir
from kvfs.errors import AuthError, InvalidArgument
from kvfs.handshake import Role

DEFAULT_ADDR = "kvfs://127.0.0.1:7070"

# HOST:PORT, HOST a name, an IPv4 address or a bracketed IPv6 one (a bare IPv6 host also
# parses: the port is after the last colon). The one address grammar of kvfs.
_HOSTPORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.%a-z]+)\]|(?P<host>[^/\s\[\]]+)):(?P<port>[0-9]{1,5})$")


def parse_addr(addr: str | None, *, what: str = "address") -> tuple[str, int]:
    """``kvfs://HOST:PORT[/path]`` or ``HOST:PORT`` -> ``(host, port)``.

    The one address parser: cluster addresses (``None`` -> ``$KVFS_ADDR``,
    else ``kvfs://127.0.0.1:7070``), listen and advertised addresses, and
    the head of a ``kvfs://`` URL. Raises :class:`InvalidArgument` naming
    ``what`` and the text.
    """
    text = (os.environ.get("KVFS_ADDR") or DEFAULT_ADDR) if addr is None else addr
    hit = _match(text) if isinstance(text, str) else None
    if hit is None:
        several = isinstance(text, str) and "," in text.removeprefix("kvfs://").split("/", 1)[0]
        raise InvalidArgument(f"bad {what} {text!r:.300}: expected kvfs://HOST:PORT or HOST:PORT"
                              + (" (one address here, not a list)" if several else ""))
    return hit


def parse_addrs(addr: str | None, *, what: str = "address") -> list[tuple[str, int]]:
    """``kvfs://H1:P1,H2:P2[/path]`` (or ``H1:P1,H2:P2``) -> ``[(h1, p1), (h2, p2)]``: the
    meta services a client, a chunkserver or the GC may use (several metas serving one
    Redis-backed store; :class:`kvfs.cluster.ClusterLink` spreads calls over them and skips
    one that is down).  One address is a list of one.  ``None``: ``$KVFS_ADDR``."""
    text = (os.environ.get("KVFS_ADDR") or DEFAULT_ADDR) if addr is None else addr
    if not isinstance(text, str):
        raise InvalidArgument(f"bad {what} {text!r:.300}: expected kvfs://HOST:PORT[,HOST:PORT...]")
    rest = text.removeprefix("kvfs://")
    head = rest.partition("/")[0]
    out = []
    for part in head.split(","):
        hit = _match(part.strip())
        if hit is None:
            raise InvalidArgument(f"bad {what} {text!r:.300}: {part.strip()!r:.100} is not HOST:PORT "
                                  "(expected kvfs://HOST:PORT[,HOST:PORT...])")
        out.append(hit)
    return out


def format_addrs(addrs: list[tuple[str, int]]) -> str:
    """``kvfs://h1:p1,h2:p2``: what :func:`parse_addrs` reads back."""
    return "kvfs://" + ",".join(format_addr(h, p).removeprefix("kvfs://") for h, p in addrs)


def is_addr(text: str) -> bool:
    """Whether ``text`` (the part of a ``kvfs://`` URL before the first ``/``) is HOST:PORT
    (or a list of them, ``H1:P1,H2:P2``)."""
    return "/" not in text and all(_match(p) is not None for p in text.split(","))


def _match(text: str) -> tuple[str, int] | None:
    rest = text.removeprefix("kvfs://")
    if "://" in rest:
        return None
    head = rest.split("/", 1)[0]
    if "," in head:  # a list of metas: parse_addrs
        return None
    m = _HOSTPORT.match(head)
    if m is None or int(m["port"]) > 65535:
        return None
    return m["v6"] or m["host"], int(m["port"])


def format_addr(host: str, port: int) -> str:
    """``kvfs://host:port`` (an IPv6 host in brackets): what :func:`parse_addr` reads back."""
    return f"kvfs://[{host}]:{port}" if ":" in host else f"kvfs://{host}:{port}"


def config_dir() -> Path:
    env = os.environ.get("KVFS_CONFIG_DIR")
    return Path(env) if env else Path.home() / ".config" / "kvfs"


TOKEN_FILES = {Role.CLIENT: "token", Role.ADMIN: "admin.token", Role.SERVER: "server.token"}
TOKEN_ENV = {Role.CLIENT: "KVFS_TOKEN", Role.ADMIN: "KVFS_ADMIN_TOKEN",
             Role.SERVER: "KVFS_SERVER_TOKEN"}
TOKEN_FILE_HELP = ("file holding the token (default: $KVFS_TOKEN, else the file kvfs up wrote); "
                   "tokens never go on a command line")


def user_token_path(host: str, port: int, role: Role = Role.CLIENT) -> Path:
    suffix = "" if role == Role.CLIENT else f".{role.value}"
    return config_dir() / "tokens" / f"{host}_{port}{suffix}"


def new_token() -> str:
    return secrets.token_hex(16)


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 from the first byte on (its folder 0700)."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


def read_secret(path: Path) -> str:
    text = path.read_text().strip()
    if not text:
        raise AuthError(f"token file {path} is empty")
    return text


def token_from_file(path: str | Path | None) -> str | None:
    """``--token-file PATH`` -> the token in it (None: look it up the usual way)."""
    return None if path is None else read_secret(Path(path))


def load_or_create_token(data_dir: Path, role: Role = Role.CLIENT) -> str:
    """A role's token kept in a data dir (created, mode 0600, on first start)."""
    path = data_dir / TOKEN_FILES[role]
    if path.exists():
        return read_secret(path)
    token = new_token()
    write_secret(path, token)
    return token


def lookup_token(token: str | None = None, *, addr: str | None = None,
                 data_dir: Path | None = None, create: bool = False,
                 role: Role = Role.CLIENT) -> str:
    """A role's token (client, admin or server), looked up in one order by every client
    and service.

    1. ``token`` (a ``token=`` argument or a ``--token-file``);
    2. the role's environment variable: ``$KVFS_TOKEN``, ``$KVFS_ADMIN_TOKEN``,
       ``$KVFS_SERVER_TOKEN``;
    3. a service (``data_dir`` given): the file ``data_dir/token`` (``admin.token``,
       ``server.token``), written first when ``create`` (meta makes the cluster's
       tokens on first start);
    4. a client (no ``data_dir``): the file ``kvfs up`` wrote for ``addr``,
       ``$KVFS_CONFIG_DIR/tokens/HOST_PORT`` (``.admin`` for the admin token).

    Raises :class:`AuthError` naming where it looked.
    """
    if token:
        return token
    env_name = TOKEN_ENV[role]
    env = os.environ.get(env_name)
    if env:
        return env
    if data_dir is not None and create:
        return load_or_create_token(data_dir, role)
    what = "cluster token" if role == Role.CLIENT else f"{role.value} token"
    if data_dir is not None:
        path = data_dir / TOKEN_FILES[role]
        missing = (f"no {what}: set {env_name}, or copy meta's token file to {path}")
    else:
        host, port = parse_addrs(addr)[0]  # several metas of one store share the tokens
        path = user_token_path(host, port, role)
        missing = (f"no token for {format_addr(host, port)} ({role.value} role): pass token=, "
                   f"set {env_name}, or start the cluster with `kvfs up` (which writes {path})")
    try:
        return read_secret(path)
    except FileNotFoundError:
        raise AuthError(missing) from None


def service_tokens(data_dir: Path, *, create: bool = False) -> dict[Role, str]:
    """The three role tokens a server checks (see :func:`lookup_token`)."""
    return {role: lookup_token(data_dir=data_dir, create=create, role=role) for role in Role}
