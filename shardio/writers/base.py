"""The protocol every shard writer follows, and what a streamed member may raise."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import xxhash

from shardio.errors import PackError

__all__ = [
    "STREAM_CHUNK_BYTES",
    "ReadInto",
    "ShardFileWriter",
    "SourceChangedError",
    "copy_stream",
    "write_sample",
]

# Chunk size of a streamed member: large enough for full-speed sequential I/O on a parallel
# filesystem, small enough that a file larger than RAM costs one chunk of memory.
STREAM_CHUNK_BYTES = 8 * 1024 * 1024

# ``readinto(buffer) -> bytes read`` (0 at end of file), as io.RawIOBase.readinto.
ReadInto = Callable[[memoryview], int]


class SourceChangedError(PackError):
    """A streamed member's source was shorter or longer than planned, or failed mid-way.

    The writer has already rolled back to before the member when this is raised, so the
    caller may skip the file and go on with the shard.

    Attributes:
        reason: why, for the pack report ("changed size during the pack (...)").
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def copy_stream(
    size: int, readinto: ReadInto, buffer: bytearray, write: Callable[[memoryview], None]
) -> int:
    """Copy exactly ``size`` bytes from ``readinto`` to ``write`` in chunks; return the xxh3-64.

    ``write`` must be done with a chunk when it returns (the buffer is reused). One more
    read after ``size`` bytes checks that the source did not grow.

    Raises:
        SourceChangedError: the source ended early, had more bytes, or a read failed.
        StorageError: from ``write``, unchanged.
    """
    hasher = xxhash.xxh3_64()
    view = memoryview(buffer)
    done = 0
    while True:
        want = min(size - done, len(view)) if done < size else 1
        try:
            n = readinto(view[:want])
        except OSError as exc:
            raise SourceChangedError(
                f"unreadable after {done:,} of {size:,} bytes ({exc.strerror or exc})"
            ) from exc
        if done >= size:
            if n:
                raise SourceChangedError(
                    f"changed size during the pack (planned {size:,} bytes, found more)"
                )
            return int(hasher.intdigest())
        if not n:
            raise SourceChangedError(
                f"changed size during the pack (planned {size:,} bytes, found {done:,})"
            )
        chunk = view[:n]
        hasher.update(chunk)
        write(chunk)
        done += n


class ShardFileWriter(Protocol):
    """Writes one shard under a temp name and publishes it atomically on ``finish``.

    A sample is written as ``begin_sample``, then ``add_member``/``add_stream`` per member,
    then ``end_sample`` (a sample that ends with no member is not recorded). Offsets are
    absolute in the shard file, ready for ``pread``.
    """

    suffix: str

    def begin_sample(self, key: str, label: int) -> None:
        """Start a sample."""
        ...

    def add_member(self, ext: str, data: bytes, digest: int) -> tuple[int, int]:
        """Append a member held in memory (``digest`` is its xxh3-64); return (offset, size)."""
        ...

    def add_stream(self, ext: str, size: int, readinto: ReadInto) -> tuple[int, int, int]:
        """Copy a member of ``size`` bytes from ``readinto`` in chunks, hashing as it goes.

        Returns:
            (offset, size, xxh3-64).

        Raises:
            SourceChangedError: the source gave fewer or more bytes than ``size``, or failed;
                the shard is rolled back to before this member.
            StorageError: writing the shard failed.
        """
        ...

    def end_sample(self) -> int:
        """Close the sample; return how many members it got (0: it was not recorded)."""
        ...

    def add_sample(
        self, key: str, label: int, members: Sequence[tuple[str, bytes, int]]
    ) -> list[tuple[int, int]]:
        """Write a whole sample of in-memory members ``(ext, data, xxh3_64)``."""
        ...

    def finish(self) -> tuple[int, str]:
        """Complete, fsync and publish the shard; return ``(size_bytes, xxh3_128)``."""
        ...

    def abort(self) -> None:
        """Remove the unfinished shard."""
        ...


def write_sample(
    writer: ShardFileWriter, key: str, label: int, members: Sequence[tuple[str, bytes, int]]
) -> list[tuple[int, int]]:
    """Write a whole sample of in-memory members ``(ext, data, xxh3_64)`` through
    ``writer``'s sample calls; return each member's ``(offset, size)``."""
    writer.begin_sample(key, label)
    placed = [writer.add_member(ext, data, digest) for ext, data, digest in members]
    writer.end_sample()
    return placed
