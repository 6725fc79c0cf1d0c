"""The one member check: a member's bytes against the xxh3-64 its index record holds.

Reads, batches, ``verify``, ``unpack`` and the recovery layer all call :func:`check_member`
(or :func:`member_digest_problem` where a report, not an exception, is wanted), so the rule
for "this byte may reach training" is written once.
"""

from __future__ import annotations

from shardio.errors import ChecksumMismatchError
from shardio.format.checksum import hex64, member_xxh3_64

__all__ = ["check_member", "member_digest_problem"]


def member_digest_problem(data: bytes | bytearray | memoryview, expected: int) -> int | None:
    """The actual xxh3-64 of ``data`` when it differs from ``expected``, else None."""
    actual = member_xxh3_64(data)
    return None if actual == expected else actual


def check_member(
    data: bytes | bytearray | memoryview,
    expected: int,
    *,
    path: str,
    shard: str,
    key: str,
    member: str | None = None,
) -> None:
    """Raise unless ``data`` hashes to ``expected``.

    Args:
        data: the member's bytes, exactly its size.
        expected: the xxh3-64 from the member's index record.
        path: the file the bytes were read from (a staged copy or the source shard).
        shard: the shard's path in the manifest.
        key: the sample's key.
        member: the member's extension, when known.

    Raises:
        ChecksumMismatchError: naming path, shard, sample and both digests.
    """
    actual = member_digest_problem(data, expected)
    if actual is not None:
        raise ChecksumMismatchError(
            path=path,
            shard=shard,
            key=key,
            expected=hex64(expected),
            actual=hex64(actual),
            member=member,
        )
