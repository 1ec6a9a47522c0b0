"""Human sizes and durations, one parser each: ``64MiB``, ``4k``, ``1g``, ``5min``, ``250ms``.

Sizes follow fio: every unit is a power of 1024, and the case, a trailing
``b`` and the IEC ``i`` change nothing. So ``1k`` = ``1KB`` = ``1KiB`` =
1024, and ``1g`` = ``1GB`` = ``1GiB`` = 2**30 bytes. (fio reads ``1GB`` the
same way; unlike fio's default ``kb_base=1024`` mode, ``1GiB`` is never
read as 10**9.) Units: ``b``, ``k``, ``m``, ``g``, ``t``, ``p``; a bare
number is bytes; fractions are allowed (``1.5m``) and rounded down.

Durations: a bare number is seconds; units ``us``, ``ms``, ``s``/``sec``,
``m``/``min``, ``h``, ``d`` (so ``30s``, ``5min``, ``1h``, ``1.5h``).

Both raise :class:`BadUnitValue`, an :class:`~kvfs.errors.InvalidArgument` that
argparse also shows as is (``argument --size: not a size: 'x' ...``), so the
parsers are used directly as ``type=`` of every size and duration flag.
"""

from __future__ import annotations

import argparse
import re

from kvfs.errors import InvalidArgument

_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_TIME = {
    "": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6,
    "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0,
}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNIT = re.compile(r"^(?:([kmgtp])i?)?b?$")


class BadUnitValue(InvalidArgument, argparse.ArgumentTypeError):
    """Text that is not a size or a duration. An ``InvalidArgument`` (so a ``ValueError``);
    as an ``ArgumentTypeError``, argparse prints its message (``argument --capacity: not a
    size: 'lots' ...``) instead of ``invalid parse_size value``, wherever a parser here is
    an option's ``type``."""


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: ``"4k"`` -> 4096, ``"1GB"`` = ``"1GiB"`` = ``"1g"`` -> 2**30.

    Every unit is a power of 1024 (fio's rule; see the module docstring);
    ints pass through unchanged. Raises :class:`BadUnitValue`.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise BadUnitValue(f"not a size: {text!r} (a size is >= 0)")
        return text
    m = _NUM.match(text) if isinstance(text, str) else None
    unit = _SIZE_UNIT.match(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise BadUnitValue(f"not a size: {text!r} (examples: 4096, 4k, 64KiB, 1m, 2g; "
                      "k, m, g are powers of 1024)")
    return int(float(m.group(1)) * 1024 ** _POW[unit.group(1) or ""])


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``text``: ``"5min"`` -> 300.0, ``"250ms"`` -> 0.25, ``"1h"`` -> 3600.0.

    Numbers are seconds and pass through. Raises :class:`BadUnitValue`.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise BadUnitValue(f"not a duration: {text!r} (a duration is >= 0)")
        return float(text)
    m = _NUM.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _TIME:
        raise BadUnitValue(f"not a duration: {text!r} (examples: 30, 30s, 250ms, 5min, 1h)")
    return float(m.group(1)) * _TIME[unit]


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
