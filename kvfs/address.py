"""Cluster addresses (``kvfs://host:port``) and the cluster token."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from kvfs.errors import AuthError, InvalidArgument

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
        raise InvalidArgument(f"bad {what} {text!r:.300}: expected kvfs://HOST:PORT or HOST:PORT")
    return hit


def is_addr(text: str) -> bool:
    """Whether ``text`` (the part of a ``kvfs://`` URL before the first ``/``) is HOST:PORT."""
    return "/" not in text and _match(text) is not None


def _match(text: str) -> tuple[str, int] | None:
    rest = text.removeprefix("kvfs://")
    if "://" in rest:
        return None
    m = _HOSTPORT.match(rest.split("/", 1)[0])
    if m is None or int(m["port"]) > 65535:
        return None
    return m["v6"] or m["host"], int(m["port"])


def format_addr(host: str, port: int) -> str:
    """``kvfs://host:port`` (an IPv6 host in brackets): what :func:`parse_addr` reads back."""
    return f"kvfs://[{host}]:{port}" if ":" in host else f"kvfs://{host}:{port}"


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
    """The cluster token kept in a data dir (created, mode 0600, on first start)."""
    path = data_dir / "token"
    if path.exists():
        return path.read_text().strip()
    token = new_token()
    write_secret(path, token)
    return token


def lookup_token(token: str | None = None, *, addr: str | None = None,
                 data_dir: Path | None = None, create: bool = False) -> str:
    """The cluster token, looked up in one order by every client and service.

    1. ``token`` (a ``token=`` argument or a ``--token`` flag);
    2. ``$KVFS_TOKEN``;
    3. a service (``data_dir`` given): the file ``data_dir/token``, written
       first when ``create`` (meta makes the cluster's token on first start);
    4. a client (no ``data_dir``): the file ``kvfs up`` wrote for ``addr``,
       ``$KVFS_CONFIG_DIR/tokens/HOST_PORT`` (default ``~/.config/kvfs``).

    Raises :class:`AuthError` naming where it looked.
    """
    if token:
        return token
    env = os.environ.get("KVFS_TOKEN")
    if env:
        return env
    if data_dir is not None and create:
        return load_or_create_token(data_dir)
    if data_dir is not None:
        path = data_dir / "token"
        missing = f"no cluster token: pass --token, set KVFS_TOKEN, or copy meta's token file to {path}"
    else:
        host, port = parse_addr(addr)
        path = user_token_path(host, port)
        missing = (f"no token for {format_addr(host, port)}: pass token=, set KVFS_TOKEN, "
                f"or start the cluster with `kvfs up` (which writes {path})")
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise AuthError(missing) from None
