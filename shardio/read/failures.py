"""The error a member read from the source raises: a checksum mismatch, a truncated or an
unreadable shard (typed as unavailable where the server is gone or the read stalled)."""

from __future__ import annotations

import errno

from shardio.errors import ChecksumMismatchError, StorageError, unavailable_error
from shardio.format.checksum import hex64
from shardio.format.index import Index
from shardio.read.digest import member_digest_problem

__all__ = ["member_read_error"]


def member_read_error(
    index: Index,
    problem: str,
    error: OSError | None,
    *,
    path: str,
    shard_name: str,
    member: int,
    sample: int,
    bytes_read: memoryview,
) -> StorageError:
    """The error for ``member`` of ``sample`` that failed in the source file ``path``.

    Args:
        index: the dataset's index (the member's record, the sample's key).
        problem: what the read found: ``"checksum mismatch"``, ``"truncated"`` or
            ``"unreadable: ..."``.
        error: the OS error of an unreadable read, else None.
        path: the file read.
        shard_name: the shard's path in the manifest.
        member: the member's row in the index.
        sample: the sample the member is of.
        bytes_read: the bytes read (a mismatch names their actual checksum).
    """
    key = index.key(sample)
    rec = index.members[member]
    if problem == "checksum mismatch":
        actual = member_digest_problem(bytes_read, int(rec["xxh3_64"]))
        return ChecksumMismatchError(
            path=path,
            shard=shard_name,
            key=key,
            expected=hex64(int(rec["xxh3_64"])),
            actual=hex64(actual if actual is not None else int(rec["xxh3_64"])),
            member=index.exts[int(rec["ext_id"])],
        )
    if problem == "truncated":
        return StorageError(errno.EIO, f"shard {path} is truncated (sample {key!r})")
    reason = error.strerror if error is not None and error.strerror else problem
    message = f"cannot read shard {path} (sample {key!r}): {reason}"
    if error is None:
        return StorageError(errno.EIO, message)
    # Typed: a stall (ReadStalledError) or a server gone (ENXIO, ENOTCONN, ...) is a
    # StorageUnavailableError, which recovery retries and holds per shard.
    return unavailable_error(error, message)
