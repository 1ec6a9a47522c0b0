"""One size parser (fio's rule: every unit is a power of 1024) and one duration parser."""

from __future__ import annotations

import argparse

import pytest

from kvfs.errors import InvalidArgument
from kvfs.units import BadUnitValue, format_size, parse_duration, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0), ("4096", 4096), (" 512 ", 512), ("7b", 7),
    ("1k", 1024), ("1K", 1024), ("1kb", 1024), ("1KB", 1024), ("1KiB", 1024), ("1ki", 1024),
    ("4k", 4096), ("64KiB", 65536), ("1m", 1 << 20), ("16MiB", 16 << 20), ("1.5m", 3 << 19),
    ("1g", 1 << 30), ("1GB", 1 << 30), ("1GiB", 1 << 30), ("2t", 2 << 40), ("1p", 1 << 50),
    (123, 123),
])
def test_sizes_follow_fio(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "k", "1x", "1kk", "1ib", "-1", "1 GB/s", "1e3", "1..5k", -1, True])
def test_bad_sizes_name_the_input(text: object) -> None:
    with pytest.raises(BadUnitValue, match="not a size") as err:
        parse_size(text)  # type: ignore[arg-type]
    assert isinstance(err.value, InvalidArgument) and isinstance(err.value, ValueError)


@pytest.mark.parametrize(("text", "expected"), [
    ("30", 30.0), ("30s", 30.0), ("30sec", 30.0), ("250ms", 0.25), ("5us", 5e-6),
    ("5m", 300.0), ("5min", 300.0), ("1h", 3600.0), ("1.5h", 5400.0), ("2d", 172800.0),
    (2, 2.0), (0.5, 0.5),
])
def test_durations(text: str | float, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "h", "1hour", "1y", "-5s", -1])
def test_bad_durations_name_the_input(text: object) -> None:
    with pytest.raises(BadUnitValue, match="not a duration"):
        parse_duration(text)  # type: ignore[arg-type]


def test_argparse_shows_the_parser_message() -> None:
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--size", type=parse_size)
    with pytest.raises(argparse.ArgumentError, match=r"not a size: '1x' \(examples"):
        p.parse_args(["--size", "1x"])


def test_every_cli_size_and_duration_uses_the_one_rule() -> None:
    from kvfs.cli import build_parser

    ns = build_parser().parse_args(["put", "k", "-", "--ttl", "1h"])
    assert ns.ttl == 3600.0
    ns = build_parser().parse_args(["up", "--capacity", "1GB", "--default-ttl", "5min"])
    assert (ns.capacity_bytes, ns.default_ttl_s) == (1 << 30, 300.0)
    ns = build_parser().parse_args(["bench", "--bs", "4k,1m", "--size", "1g", "--runtime", "500ms"])
    assert (ns.bs, ns.size, ns.runtime) == ([4096, 1 << 20], 1 << 30, 0.5)
    ns = build_parser().parse_args(["bench", "--bs", "4KiB", "--size", "1GB", "--runtime", "1min"])
    assert (ns.bs, ns.size, ns.runtime) == ([4096], 1 << 30, 60.0)
    ns = build_parser().parse_args(["gc", "run", "--grace", "2min", "--rate", "1GB/s"])
    assert (ns.grace, ns.rate) == (120.0, 1 << 30)


def test_format_size() -> None:
    assert [format_size(n) for n in (0, 1023, 1024, 3 << 29)] == ["0 B", "1023 B", "1.0 KiB", "1.5 GiB"]
