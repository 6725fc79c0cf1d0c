"""The opener: every byte the read side takes from storage goes through one of these.

An opener opens a path, reads ranges of it with ``pread``, tells its size and identity,
passes read-ahead advice and (for the opt-in mapped transport only) maps it. The POSIX one is
the default; :mod:`shardio.read.faults` wraps it to inject faults in tests. Openers are
passed in (``PackedDataset(root, opener=...)``) and must pickle, since DataLoader workers get
a copy.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Protocol

from shardio.errors import StorageError
from shardio.storage.files import open_for_pread, open_regular

__all__ = ["Opener", "PosixOpener", "read_fully"]


class Opener(Protocol):
    """What the read side needs from storage. Every method may raise ``OSError``."""

    def open(self, path: str, *, nofollow: bool = False) -> int:
        """Open ``path`` read-only without blocking; return a descriptor."""

    def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
        """Read up to ``len(target)`` bytes at ``offset``; return how many (0 at the end)."""

    def size(self, fd: int) -> int:
        """The size of the open file in bytes."""

    def identity(self, fd: int) -> tuple[int, int]:
        """(device, inode) of the open file: tells a replaced file from the one read."""

    def advise(self, fd: int, offset: int, length: int) -> None:
        """Hint that ``length`` bytes at ``offset`` will be read soon."""

    def map(self, path: str) -> mmap.mmap | None:
        """A private read mapping of the whole file (None when it is empty)."""

    def close(self, fd: int) -> None:
        """Close a descriptor from :meth:`open`."""


class PosixOpener:
    """Plain POSIX calls: ``open(O_NONBLOCK)``, ``preadv``, ``fstat``, ``posix_fadvise``."""

    def open(self, path: str, *, nofollow: bool = False) -> int:
        return open_for_pread(path, what="shard", nofollow=nofollow)

    def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
        return os.preadv(fd, [target], offset)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def identity(self, fd: int) -> tuple[int, int]:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino

    def advise(self, fd: int, offset: int, length: int) -> None:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)

    def map(self, path: str) -> mmap.mmap | None:
        fd = open_regular(path, what="shard")
        try:
            if os.fstat(fd).st_size == 0:
                return None
            return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot map shard {path}: {exc.strerror}") from exc
        finally:
            os.close(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def __repr__(self) -> str:
        return "PosixOpener()"


def read_fully(opener: Opener, fd: int, target: memoryview, offset: int) -> int:
    """Fill ``target`` from ``offset``, looping over short reads; return the bytes read.

    Fewer than ``len(target)`` bytes means the file ended first (it is shorter than its
    index says). ``EINTR`` is retried by Python itself.
    """
    done = 0
    size = len(target)
    while done < size:
        got = opener.pread_into(fd, target[done:], offset + done)
        if got < 0:  # pragma: no cover - a broken opener
            raise OSError(errno.EIO, "negative read")
        if got == 0:
            break
        done += got
    return done
