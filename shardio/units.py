"""Parse and format byte sizes and rates with binary and decimal units."""

from __future__ import annotations

import re
from fractions import Fraction

from shardio.errors import UsageError

__all__ = ["format_duration", "format_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_MAX_SIZE = 2**63 - 1  # sizes and offsets are signed 64-bit on disk and in numpy
_SIZE_RE = re.compile(r"^\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse a size such as ``512MiB``, ``1GiB``, ``4M`` or ``1000`` into bytes.

    Raises:
        UsageError: the text is not a positive size with a known unit.
    """
    match = _SIZE_RE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise UsageError(f"invalid size {text!r}: use a number with a unit such as 512MiB or 1GiB")
    value = int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise UsageError(f"invalid size {text!r}: must be positive")
    if value > _MAX_SIZE:
        raise UsageError(f"invalid size {text!r}: larger than {_MAX_SIZE:,} bytes")
    return value


def format_size(size_bytes: float) -> str:
    """Format a byte count with binary units, e.g. ``1.5 GiB``."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_duration(seconds: float) -> str:
    """Format seconds as ``1h02m``, ``3m05s`` or ``4.2s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
