"""Typed access to fields of a JSON document read from disk (manifests and work records)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardio.errors import FormatError

__all__ = ["MAX_INT", "get_field"]

# Every count, size and offset fits a signed 64-bit integer (numpy and the index use
# int64/uint64 for them); larger values are refused before any arithmetic.
MAX_INT = 2**63 - 1


def get_field(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """Return ``doc[key]`` if it is a ``kind`` (a bool is no int), an int in 0..2^63-1 or a
    string without NUL.

    Raises:
        FormatError: the field is missing, mistyped or out of range; the message names
            ``where`` and the field.
    """
    if key not in doc:
        raise FormatError(f"{where}: missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FormatError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT:
        raise FormatError(f"{where}: field {key!r} is out of range ({value})")
    if isinstance(value, str) and "\0" in value:
        raise FormatError(f"{where}: field {key!r} holds a NUL byte")
    return value
