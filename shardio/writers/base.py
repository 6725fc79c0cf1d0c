"""The protocol every shard writer follows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["ShardWriter"]


class ShardWriter(Protocol):
    """Writes one shard under a temp name and publishes it atomically on ``finish``."""

    suffix: str

    def add_sample(
        self, key: str, label: int, members: Sequence[tuple[str, bytes, int]]
    ) -> list[tuple[int, int]]:
        """Append one sample's members ``(ext, data, xxh3_64)``; return ``(offset, size)``.

        Offsets are absolute in the shard file, ready for ``pread``.
        """
        ...

    def finish(self) -> tuple[int, str]:
        """Complete, fsync and publish the shard; return ``(size_bytes, xxh3_128)``."""
        ...

    def abort(self) -> None:
        """Remove the unfinished shard."""
        ...
