"""One address parser and one token lookup, used by every client and service."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfs.address import (
    format_addr,
    format_addrs,
    is_addr,
    lookup_token,
    parse_addr,
    parse_addrs,
    user_token_path,
)
from kvfs.errors import AuthError, InvalidArgument


@pytest.mark.parametrize(("text", "expected"), [
    ("kvfs://127.0.0.1:7070", ("127.0.0.1", 7070)),
    ("127.0.0.1:0", ("127.0.0.1", 0)),
    ("kvfs://meta.example:65535/some/path", ("meta.example", 65535)),
    ("[::1]:7071", ("::1", 7071)),
    ("kvfs://[fe80::1%eth0]:9", ("fe80::1%eth0", 9)),
    ("::1:7071", ("::1", 7071)),  # a bare IPv6 host: the port follows the last colon
])
def test_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_addr(text) == expected
    assert parse_addr(format_addr(*expected)) == expected


@pytest.mark.parametrize("text", ["", "nonsense", "host:", ":7070", "host:65536", "host:-1",
                                  "http://host:80", "kvfs://host", "host:80x", "a b:1"])
def test_bad_addresses_name_what_and_the_text(text: str) -> None:
    with pytest.raises(InvalidArgument, match=f"bad listen address '{text}'"):
        parse_addr(text, what="listen address")


def test_default_address_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFS_ADDR", raising=False)
    assert parse_addr(None) == ("127.0.0.1", 7070)
    monkeypatch.setenv("KVFS_ADDR", "kvfs://10.0.0.1:8000")
    assert parse_addr(None) == ("10.0.0.1", 8000)


def test_is_addr_tells_a_url_head_from_a_path() -> None:
    assert is_addr("host:7070") and is_addr("[::1]:1")
    assert not is_addr("bucket") and not is_addr("host:7070/x") and not is_addr("a:b")


def test_token_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFS_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.delenv("KVFS_TOKEN", raising=False)
    addr = "kvfs://127.0.0.1:7999"
    with pytest.raises(AuthError, match=r"no token for kvfs://127.0.0.1:7999"):
        lookup_token(addr=addr)
    user = user_token_path("127.0.0.1", 7999)
    user.parent.mkdir(parents=True)
    user.write_text("from-file\n")
    assert lookup_token(addr=addr) == "from-file"
    monkeypatch.setenv("KVFS_TOKEN", "from-env")
    assert lookup_token(addr=addr) == "from-env"
    assert lookup_token("explicit", addr=addr) == "explicit"


def test_service_token_lives_in_its_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFS_TOKEN", raising=False)
    with pytest.raises(AuthError, match=r"no cluster token: .*copy meta's token file"):
        lookup_token(data_dir=tmp_path)
    made = lookup_token(data_dir=tmp_path, create=True)
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600
    assert lookup_token(data_dir=tmp_path) == made == lookup_token(data_dir=tmp_path, create=True)


def test_a_list_of_metas() -> None:
    """Several metas of one store: ``kvfs://H1:P1,H2:P2`` (clients, chunkservers, the GC)."""
    metas = parse_addrs("kvfs://10.0.0.1:7070,[::1]:7071, meta3.example:7072/some/path")
    assert metas == [("10.0.0.1", 7070), ("::1", 7071), ("meta3.example", 7072)]
    assert format_addrs(metas) == "kvfs://10.0.0.1:7070,[::1]:7071,meta3.example:7072"
    assert parse_addrs(format_addrs(metas)) == metas
    assert parse_addrs("h:1") == [("h", 1)]
    assert is_addr("h1:1,h2:2") and not is_addr("h1:1,path")
    with pytest.raises(InvalidArgument, match=r"'nope' is not HOST:PORT"):
        parse_addrs("kvfs://h1:1,nope")
    # where one address is meant (a listen address), a list is refused by name
    with pytest.raises(InvalidArgument, match=r"one address here, not a list"):
        parse_addr("h1:1,h2:2", what="listen address")


def test_a_list_takes_the_first_metas_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFS_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv("KVFS_TOKEN", raising=False)
    path = user_token_path("127.0.0.1", 7070)
    path.parent.mkdir(parents=True)
    path.write_text("t1\n")
    assert lookup_token(addr="kvfs://127.0.0.1:7070,127.0.0.1:7071") == "t1"
