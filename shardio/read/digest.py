"""The one member check: a member's bytes against the xxh3-64 its index record holds.

Reads and batches (:class:`~shardio.read.reader.ShardReader`, which ``unpack``, the
recovery layer and every transport read through) and ``verify`` all call
:func:`member_digest_problem`, so the rule for "this byte may reach training" is written once.
"""

from __future__ import annotations

from shardio.format.checksum import member_xxh3_64

__all__ = ["digest_problem", "member_digest_problem"]


def member_digest_problem(data: bytes | bytearray | memoryview, expected: int) -> int | None:
    """The actual xxh3-64 of ``data`` when it differs from ``expected``, else None."""
    return digest_problem(member_xxh3_64(data), expected)


def digest_problem(actual: int, expected: int) -> int | None:
    """``actual`` (a member's xxh3-64, hashed by the reader: :class:`MemberHashes
    <shardio.storage.opener.MemberHashes>`) when it differs from ``expected``, else None."""
    return None if actual == expected else actual
