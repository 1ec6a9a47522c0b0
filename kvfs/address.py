"""Cluster addresses (``kvfs://host:port``) and the cluster token."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvfs.errors import AuthError, InvalidArgument

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


def user_token_path(host: str, port: int) -> Path:
    return config_dir() / "tokens" / f"{host}_{port}"


def new_token() -> str:
    return secrets.token_hex(16)


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 from the first byte on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


def load_or_create_token(data_dir: Path) -> str:
    """The cluster token kept in a data dir (created on first start)."""
    path = data_dir / "token"
    if path.exists():
        return path.read_text().strip()
    token = new_token()
    write_secret(path, token)
    return token


def resolve_token(addr: str | None, token: str | None = None) -> str:
    """``token=``, else ``$KVFS_TOKEN``, else the file ``kvfs up`` wrote for this address."""
    if token:
        return token
    env = os.environ.get("KVFS_TOKEN")
    if env:
        return env
    host, port = parse_addr(addr)
    path = user_token_path(host, port)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise AuthError(
            f"no token for {format_addr(host, port)}: pass token=, set KVFS_TOKEN, "
            f"or start the cluster with `kvfs up` (which writes {path})"
        ) from None
