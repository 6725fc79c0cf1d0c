"""xxh3 checksums of members (64-bit) and of whole files (128-bit), as hex strings."""

from __future__ import annotations

import errno
import os

import xxhash

from shardio.errors import StorageError
from shardio.storage.files import open_regular

__all__ = ["fd_xxh3_128", "file_xxh3_128", "hex64", "member_xxh3_64", "new_file_hasher"]

_CHUNK = 8 * 1024 * 1024


def member_xxh3_64(data: bytes | bytearray | memoryview) -> int:
    """Return the xxh3-64 of one member's bytes as an unsigned integer."""
    return xxhash.xxh3_64_intdigest(data)


def hex64(value: int) -> str:
    """Format a 64-bit checksum as 16 hex digits."""
    return f"{value:016x}"


def new_file_hasher() -> xxhash.xxh3_128:
    """Return a streaming xxh3-128 hasher for whole files."""
    return xxhash.xxh3_128()


def fd_xxh3_128(fd: int, *, chunk_bytes: int = _CHUNK) -> str:
    """Return the xxh3-128 of an open file from its current position to its end (read, not
    mapped: a file truncated meanwhile ends the hash early instead of raising SIGBUS)."""
    hasher = xxhash.xxh3_128()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    while n := os.readv(fd, [buf]):
        hasher.update(view[:n])
    return hasher.hexdigest()


def file_xxh3_128(
    path: str | os.PathLike[str], *, what: str = "file", chunk_bytes: int = _CHUNK
) -> str:
    """Return the xxh3-128 of a whole regular file as 32 hex digits.

    Raises:
        StorageError: not a regular file (a FIFO never blocks), or unreadable; names
            ``what`` and the path.
    """
    name = os.fspath(path)
    fd = open_regular(name, what=what)
    try:
        return fd_xxh3_128(fd, chunk_bytes=chunk_bytes)
    except OSError as exc:
        raise StorageError(
            exc.errno or errno.EIO, f"cannot read {what} {name}: {exc.strerror or exc}"
        ) from exc
    finally:
        os.close(fd)
