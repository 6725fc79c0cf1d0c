"""xxh3 checksums of members (64-bit) and of whole files (128-bit), as hex strings."""

from __future__ import annotations

import os

import xxhash

from shardio.storage.files import open_regular

__all__ = ["file_xxh3_128", "hex64", "member_xxh3_64", "new_file_hasher"]

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


def file_xxh3_128(path: str | os.PathLike[str], *, chunk_bytes: int = _CHUNK) -> str:
    """Return the xxh3-128 of a whole file as 32 hex digits."""
    hasher = xxhash.xxh3_128()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    fd = open_regular(os.fspath(path), what="file")
    try:
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            hasher.update(view[:n])
    finally:
        os.close(fd)
    return hasher.hexdigest()
