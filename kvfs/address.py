"""Cluster addresses (``kvfs://host:port``) and the role tokens (client, admin, server)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvfs.datadir import private_dir
from kvfs.errors import AuthError, InvalidArgument
from kvfs.handshake import Role

DEFAULT_ADDR = "kvfs://127.0.0.1:7070"


def parse_addr(addr: str | None) -> tuple[str, int]:
    """``kvfs://host:port`` (or ``host:port``) -> ``(host, port)``; None -> $KVFS_ADDR."""
    text = addr or os.environ.get("KVFS_ADDR") or DEFAULT_ADDR
    rest = text.removeprefix("kvfs://").split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"bad address {text!r}: expected kvfs://HOST:PORT")
    return host.strip("[]"), int(port)


def format_addr(host: str, port: int) -> str:
    return f"kvfs://{host}:{port}"


def config_dir() -> Path:
    env = os.environ.get("KVFS_CONFIG_DIR")
    return Path(env) if env else Path.home() / ".config" / "kvfs"


TOKEN_FILES = {Role.CLIENT: "token", Role.ADMIN: "admin.token", Role.SERVER: "server.token"}
TOKEN_ENV = {Role.CLIENT: "KVFS_TOKEN", Role.ADMIN: "KVFS_ADMIN_TOKEN",
             Role.SERVER: "KVFS_SERVER_TOKEN"}


def user_token_path(host: str, port: int, role: Role = Role.CLIENT) -> Path:
    suffix = "" if role == Role.CLIENT else f".{role.value}"
    return config_dir() / "tokens" / f"{host}_{port}{suffix}"


def new_token() -> str:
    return secrets.token_hex(16)


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 from the first byte on."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


TOKEN_FILE_HELP = ("file holding the token (default: $KVFS_TOKEN, else the file kvfs up wrote); "
                   "tokens never go on a command line")


def token_from_file(path: str | Path | None) -> str | None:
    """``--token-file PATH`` -> the token in it (None: look it up the usual way)."""
    return None if path is None else read_secret(Path(path))


def read_secret(path: Path) -> str:
    text = path.read_text().strip()
    if not text:
        raise AuthError(f"token file {path} is empty")
    return text


def service_tokens(data_dir: Path, *, create: bool = False) -> dict[Role, str]:
    """The three role tokens a server checks: each from its environment variable, else
    its file in ``data_dir`` (created, mode 0600, when ``create``: meta and `kvfs up`)."""
    out: dict[Role, str] = {}
    missing = []
    for role, name in TOKEN_FILES.items():
        env = os.environ.get(TOKEN_ENV[role])
        path = data_dir / name
        if env:
            out[role] = env
        elif path.exists():
            out[role] = read_secret(path)
        elif create:
            out[role] = new_token()
            write_secret(path, out[role])
        else:
            missing.append(f"${TOKEN_ENV[role]} or {path}")
    if missing:
        raise AuthError("missing tokens: " + ", ".join(missing))
    return out


def load_or_create_token(data_dir: Path) -> str:
    """The client token kept in a data dir (created with the others on first start)."""
    return service_tokens(data_dir, create=True)[Role.CLIENT]


def resolve_token(addr: str | None, token: str | None = None, role: Role = Role.CLIENT) -> str:
    """``token=``, else the role's environment variable (``$KVFS_TOKEN`` for a client),
    else the file ``kvfs up`` wrote for this address."""
    if token:
        return token
    env = os.environ.get(TOKEN_ENV[role])
    if env:
        return env
    host, port = parse_addr(addr)
    path = user_token_path(host, port, role)
    try:
        return read_secret(path)
    except FileNotFoundError:
        raise AuthError(
            f"no token for {format_addr(host, port)} ({role.value} role): pass token=, set "
            f"{TOKEN_ENV[role]}, or start the cluster with `kvfs up` (which writes {path})"
        ) from None
