"""Detect which filesystem holds a path, with statfs(2) through ctypes.

``os.statvfs`` has no filesystem-type field, so the magic number is read from ``struct
statfs.f_type`` by calling libc's ``statfs`` directly. The result decides whether shardio sets
a Lustre or BeeGFS stripe layout before writing shards, or treats the path as a local disk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from typing import Any

from shardio.errors import StorageError, UsageError

__all__ = [
    "FS_MAGIC",
    "KNOWN_FS_TYPES",
    "PARALLEL_FS",
    "detect_fs_type",
    "resolve_fs_type",
    "statfs_magic",
]

logger = logging.getLogger(__name__)

FS_MAGIC: dict[int, str] = {
    0x0BD00BD0: "lustre",
    0x19830326: "beegfs",
    0x47504653: "gpfs",
    0x6969: "nfs",
    0x01021994: "tmpfs",
    0xEF53: "ext4",  # ext2, ext3 and ext4 share one magic number
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x794C7630: "overlay",
    0x2FC12FC1: "zfs",
    0x00C36400: "cephfs",
    0x65735546: "fuse",
}
"""Filesystem names by ``statfs(2)`` ``f_type`` magic number (see ``linux/magic.h``)."""

PARALLEL_FS: frozenset[str] = frozenset({"lustre", "beegfs", "gpfs"})
"""Parallel filesystems, where layout and metadata load matter."""

KNOWN_FS_TYPES: frozenset[str] = frozenset(FS_MAGIC.values()) | {"local"}
"""Names accepted by a ``--fs-type`` override; ``local`` means a plain local disk."""

# struct statfs is 120 bytes on x86_64 and aarch64 glibc/musl; a larger zero-filled buffer
# leaves room for any padding a libc adds. f_type is its first field, a C long.
_STATFS_BUFFER_BYTES = 512
_FS_TYPE_MASK = 0xFFFFFFFF  # f_type is signed; magic numbers are 32-bit unsigned values


@functools.cache
def _libc_statfs() -> Any:
    """Return libc's ``statfs`` function, loaded once and typed for ctypes."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    statfs = libc.statfs
    statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    statfs.restype = ctypes.c_int
    return statfs


def statfs_magic(path: str | os.PathLike[str]) -> int:
    """Return the ``f_type`` magic number of the filesystem holding ``path``.

    Args:
        path: an existing file or directory.

    Returns:
        The magic number as an unsigned 32-bit value, e.g. ``0x0BD00BD0`` for Lustre.

    Raises:
        StorageError: ``statfs`` failed (the path does not exist, permission denied), or the
            platform is not Linux, where the ``struct statfs`` layout is not known.
    """
    if not sys.platform.startswith("linux"):
        raise StorageError(f"cannot read the filesystem type of {path}: statfs needs Linux")
    buffer = ctypes.create_string_buffer(_STATFS_BUFFER_BYTES)
    if _libc_statfs()(os.fsencode(path), buffer) != 0:
        errno = ctypes.get_errno()
        error = StorageError(f"statfs failed for {path}: {os.strerror(errno)}")
        error.errno = errno
        raise error
    f_type = ctypes.c_long.from_buffer(buffer).value
    return f_type & _FS_TYPE_MASK


def _nearest_existing(path: str | os.PathLike[str]) -> str:
    """Return ``path`` or its nearest existing ancestor, as an absolute path."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def detect_fs_type(path: str | os.PathLike[str]) -> str:
    """Return the name of the filesystem that holds (or will hold) ``path``.

    A path that does not exist yet, such as a pack destination, is resolved through its
    nearest existing parent directory, which is where it will be created.

    Args:
        path: a file or directory, existing or not.

    Returns:
        A name from :data:`FS_MAGIC`, or ``"unknown"`` for an unlisted magic number or a
        platform other than Linux.

    Raises:
        StorageError: ``statfs`` failed on the nearest existing parent.
    """
    if not sys.platform.startswith("linux"):
        logger.info("filesystem type of %s unknown: detection needs Linux", path)
        return "unknown"
    existing = _nearest_existing(path)
    magic = statfs_magic(existing)
    fs_type = FS_MAGIC.get(magic, "unknown")
    logger.debug("%s is on %s (statfs magic 0x%08X, via %s)", path, fs_type, magic, existing)
    return fs_type


def resolve_fs_type(path: str | os.PathLike[str], override: str | None) -> str:
    """Return the filesystem type to plan for: the user's override, or the detected one.

    Args:
        path: the file or directory the type is for.
        override: a name from :data:`KNOWN_FS_TYPES` (case-insensitive), or ``None`` or
            ``"auto"`` to detect it with :func:`detect_fs_type`.

    Returns:
        The overriding name in lower case, or the detected name.

    Raises:
        UsageError: ``override`` is not a known filesystem type.
        StorageError: detection failed.
    """
    if override is None or override.strip().lower() == "auto":
        return detect_fs_type(path)
    name = override.strip().lower()
    if name not in KNOWN_FS_TYPES:
        allowed = ", ".join(["auto", *sorted(KNOWN_FS_TYPES)])
        raise UsageError(f"unknown --fs-type {override!r}: choose one of {allowed}")
    logger.info("filesystem type of %s set to %s by override", path, name)
    return name
