"""Drop files from the page cache for a test that needs cold reads: the one helper for it."""

from __future__ import annotations

import os
from collections.abc import Iterable

from shardio.storage.residency import resident


def evict(paths: Iterable[str | os.PathLike[str]]) -> bool:
    """Write back and drop each file's pages; False where the filesystem keeps them in
    memory (tmpfs) or residency cannot be told, so the caller skips."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if resident(fd, 0, 1):
                return False
        finally:
            os.close(fd)
    return True
