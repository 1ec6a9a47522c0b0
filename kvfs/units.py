"""Human sizes and durations: ``64MiB``, ``1.5GB``, ``5min``, ``250ms``."""

from __future__ import annotations

import argparse
import re

_SIZE = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_TIME = {
    "": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6,
    "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0,
}
class BadUnitValue(ValueError, argparse.ArgumentTypeError):
    """Text that is not a size or a duration. A ``ValueError``; as an ``ArgumentTypeError``,
    argparse prints its message (``argument --capacity: not a size: 'lots' ...``) instead
    of ``invalid parse_size value``, wherever a parser here is an option's ``type``."""


_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"4k"`` -> 4096, ``"1.5GiB"`` -> 1610612736; ints pass through."""
    if isinstance(text, int):
        return text
    m = _NUM.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE:
        raise BadUnitValue(f"not a size: {text!r} (examples: 4096, 64KiB, 1MiB, 2GB)")
    return int(float(m.group(1)) * _SIZE[unit])


def parse_duration(text: str | float | int) -> float:
    """``"5min"`` -> 300.0, ``"250ms"`` -> 0.25; numbers are seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _NUM.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _TIME:
        raise BadUnitValue(f"not a duration: {text!r} (examples: 30, 250ms, 5min, 1h)")
    return float(m.group(1)) * _TIME[unit]


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
