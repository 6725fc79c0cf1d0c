"""xxh3 checksums of members (64-bit) and of whole files (128-bit), as hex strings."""

from __future__ import annotations

import os

import xxhash

from shardio.errors import ShardioError, wrap_os_error
from shardio.storage.files import refuse_irregular
from shardio.storage.opener import Opener, PosixOpener, open_named

__all__ = [
    "digest_or_none",
    "fd_xxh3_128",
    "file_xxh3_128",
    "hex64",
    "member_xxh3_64",
    "new_file_hasher",
]

_CHUNK = 8 * 1024 * 1024
_POSIX = PosixOpener()


def member_xxh3_64(data: bytes | bytearray | memoryview) -> int:
    """Return the xxh3-64 of one member's bytes as an unsigned integer."""
    return xxhash.xxh3_64_intdigest(data)


def hex64(value: int) -> str:
    """Format a 64-bit checksum as 16 hex digits."""
    return f"{value:016x}"


def new_file_hasher() -> xxhash.xxh3_128:
    """Return a streaming xxh3-128 hasher for whole files."""
    return xxhash.xxh3_128()


def fd_xxh3_128(fd: int, *, chunk_bytes: int = _CHUNK, opener: Opener | None = None) -> str:
    """Return the xxh3-128 of an open file, read from its start through ``opener`` (default:
    POSIX ``pread``). Read, not mapped: a file truncated meanwhile ends the hash early
    instead of raising SIGBUS."""
    reader = opener if opener is not None else _POSIX
    hasher = xxhash.xxh3_128()
    view = memoryview(bytearray(chunk_bytes))
    pos = 0
    while n := reader.pread_into(fd, view, pos):
        hasher.update(view[:n])
        pos += n
    return hasher.hexdigest()


def file_xxh3_128(
    path: str | os.PathLike[str],
    *,
    what: str = "file",
    chunk_bytes: int = _CHUNK,
    opener: Opener | None = None,
    nofollow: bool = False,
) -> str:
    """Return the xxh3-128 of a whole regular file as 32 hex digits, read through ``opener``
    (default: POSIX calls).

    Raises:
        StorageError: not a regular file (a FIFO never blocks; with ``nofollow``, a
            symlink), or unreadable; names ``what`` and the path.
    """
    name = os.fspath(path)
    reader = opener if opener is not None else _POSIX
    fd = open_named(reader, name, what=what, nofollow=nofollow)
    try:
        refuse_irregular(fd, name, what=what, close=lambda _fd: None)
        return fd_xxh3_128(fd, chunk_bytes=chunk_bytes, opener=reader)
    except ShardioError:
        raise
    except OSError as exc:
        raise wrap_os_error(exc, f"cannot read {what} {name}: {exc.strerror or exc}") from exc
    finally:
        reader.close(fd)


def digest_or_none(
    path: str | os.PathLike[str], *, opener: Opener | None = None, size: int | None = None
) -> str | None:
    """The xxh3-128 of a regular file (read through ``opener``, never through a symlink), or
    None when it is absent, unreadable, not a regular file, or (with ``size``) of another
    size: then it cannot be the file wanted, and nothing of it is read."""
    name = os.fspath(path)
    if size is not None:
        try:
            st = os.lstat(name)
        except OSError:
            return None
        if st.st_size != size:
            return None
    try:
        return file_xxh3_128(name, what="file", opener=opener, nofollow=True)
    except ShardioError:
        return None
