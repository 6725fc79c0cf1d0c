"""Detect which filesystem holds a path, with statfs(2) through ctypes and the mount table.

``os.statvfs`` has no filesystem-type field, so the magic number is read from ``struct
statfs.f_type`` by calling libc's ``statfs`` directly. The result decides whether shardio sets
a Lustre or BeeGFS stripe layout before writing shards, or treats the path as a local disk.
FUSE filesystems (MooseFS, a FUSE-mounted Ceph or GPFS, sshfs) share one magic number, so
:func:`describe_fs` also reads the mount table (``/proc/self/mountinfo``) for the mount's type
and source, and says whether the path is on a network or parallel filesystem, which decides
the read path (:mod:`shardio.read.strategy`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import sys
from typing import Any

from shardio.errors import ShardioError, StorageError, UsageError
from shardio.storage.files import read_regular

__all__ = [
    "FS_MAGIC",
    "KNOWN_FS_TYPES",
    "NETWORK_FS",
    "PARALLEL_FS",
    "FsInfo",
    "describe_fs",
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
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x5346414F: "afs",
    0x73717368: "squashfs",
}
"""Filesystem names by ``statfs(2)`` ``f_type`` magic number (see ``linux/magic.h``)."""

PARALLEL_FS: frozenset[str] = frozenset({"lustre", "beegfs", "gpfs"})
"""Parallel filesystems whose stripe layout shardio sets (``lfs``, ``beegfs-ctl``)."""

NETWORK_FS: frozenset[str] = PARALLEL_FS | frozenset(
    {"moosefs", "cephfs", "nfs", "cifs", "smb2", "afs", "glusterfs", "weka", "fuse"}
)
"""Filesystems whose reads cross a network: latency-bound per request, fast in large
sequential requests with several in flight. A FUSE mount of unknown kind counts as one
(sshfs, s3fs and the FUSE clients of parallel filesystems are)."""

KNOWN_FS_TYPES: frozenset[str] = frozenset(FS_MAGIC.values()) | {"local", "moosefs"}
"""Names accepted by a ``--fs-type`` override; ``local`` means a plain local disk."""

# struct statfs is 120 bytes on x86_64 and aarch64 glibc/musl; a larger zero-filled buffer
# leaves room for any padding a libc adds. f_type is its first field, a C long.
_STATFS_BUFFER_BYTES = 512
_FS_TYPE_MASK = 0xFFFFFFFF  # f_type is signed; magic numbers are 32-bit unsigned values


@functools.cache
def _libc_statfs() -> Any:
    """Return libc's ``statfs`` function, loaded once and typed for ctypes: from the
    process's own symbols (``dlopen(NULL)``), not ``ctypes.util.find_library``, which runs
    ``ldconfig`` in a subprocess (read from disk on a cold node, inside a dataset's open)."""
    libc = ctypes.CDLL(None, use_errno=True)
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
        The overriding name in lower case, or the detected name (where the magic number
        says only ``fuse``, ``nfs`` or nothing, the mount table's name: ``moosefs``...).

    Raises:
        UsageError: ``override`` is not a known filesystem type.
        StorageError: detection failed.
    """
    if override is None or override.strip().lower() == "auto":
        name = detect_fs_type(path)
        if name in {"fuse", "unknown", "nfs"}:
            name = describe_fs(path).name
        return name
    name = override.strip().lower()
    if name not in KNOWN_FS_TYPES:
        allowed = ", ".join(["auto", *sorted(KNOWN_FS_TYPES)])
        raise UsageError(f"unknown --fs-type {override!r}: choose one of {allowed}")
    logger.info("filesystem type of %s set to %s by override", path, name)
    return name


# Mount table types (the third field after " - " in mountinfo) and FUSE subtypes or sources
# that name a filesystem the magic number cannot tell apart.
_MOUNT_TYPES: dict[str, str] = {
    "lustre": "lustre",
    "beegfs": "beegfs",
    "gpfs": "gpfs",
    "nfs": "nfs",
    "nfs4": "nfs",
    "ceph": "cephfs",
    "fuse.ceph-fuse": "cephfs",
    "fuse.mfs": "moosefs",
    "fuse.moosefs": "moosefs",
    "fuse.glusterfs": "glusterfs",
    "fuse.gpfs": "gpfs",
    "fuse.weka": "weka",
    "wekafs": "weka",
    "cifs": "cifs",
    "smb3": "cifs",
}
_MAGIC_NAMES = frozenset(FS_MAGIC.values())
_MOUNTINFO = "/proc/self/mountinfo"
_MOUNTINFO_MAX_BYTES = 16 << 20  # a node with thousands of mounts still fits


@dataclasses.dataclass(frozen=True, kw_only=True)
class FsInfo:
    """What holds a path: the filesystem's name, how it was told, and its class.

    Attributes:
        name: a name from :data:`FS_MAGIC` or the mount table (``moosefs``, ``cephfs``, ...),
            or ``unknown``.
        magic: the ``statfs`` magic number (0 where statfs could not be asked).
        mount_point: the mount holding the path, from the mount table ("" if not found).
        mount_type: the mount table's type of that mount (``fuse``, ``fuse.mfs``, ``ext4``).
        source: the mount's source (``mfs#10.0.0.1:9421``, ``/dev/nvme0n1p1``).
    """

    name: str
    magic: int
    mount_point: str = ""
    mount_type: str = ""
    source: str = ""

    @property
    def network(self) -> bool:
        """Reads cross a network (a parallel, network or FUSE filesystem)."""
        return self.name in NETWORK_FS

    @property
    def parallel(self) -> bool:
        """A parallel filesystem whose stripe layout shardio sets."""
        return self.name in PARALLEL_FS

    def describe(self) -> str:
        """One phrase for the CLI: ``moosefs (fuse, mfs#10.0.0.1:9421 at /mnt/mfs)``."""
        detail = [self.mount_type or f"magic 0x{self.magic:08X}"]
        if self.source and self.source not in {self.mount_type, "none"}:
            detail.append(self.source)
        where = f" at {self.mount_point}" if self.mount_point else ""
        return f"{self.name} ({', '.join(detail)}{where})"


_OCTAL = frozenset("01234567")


def _unescape(field: str) -> str:
    """Undo the octal escapes of the mount table (``\\040`` for a space)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        # Exactly three octal digits (str.isdigit would take "8", "9" and non-ASCII digits,
        # which int(..., 8) then refuses).
        if field[i] == "\\" and len(code) == 3 and all(c in _OCTAL for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mount_of(path: str, table: str) -> tuple[str, str, str]:
    """(mount point, type, source) of the mount holding ``path`` in a mountinfo text.

    The table lists mounts in the order they were made, and a mount hides every earlier one
    at or below its mount point. The mounts that contain ``path`` form a chain of ancestors,
    so the last of them is the one on top: a deeper mount made before a mount over its
    parent (``/a/b``, then ``/a``) is hidden, and a longest-prefix match would pick it.
    """
    best: tuple[str, str, str] = ("", "", "")
    for line in table.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = _unescape(fields[4])
        if not point.startswith("/"):
            continue  # not a mountinfo line
        if path == point or path.startswith(point.rstrip("/") + "/"):
            best = (point, tail[0], _unescape(tail[1]))
    return best


def _name_from_mount(mount_type: str, source: str, fallback: str) -> str:
    if mount_type in _MOUNT_TYPES:
        return _MOUNT_TYPES[mount_type]
    if mount_type in {"fuse", "fuseblk"} and source.startswith(("mfs#", "mfs:")):
        return "moosefs"  # mfsmount 3 mounts as plain "fuse" with source mfs#HOST:PORT
    if mount_type == "fuseblk" or mount_type.startswith("fuseblk."):
        return "fuseblk"  # FUSE over a local block device (ntfs-3g, exfat): not a network
    if mount_type.startswith("fuse.") and fallback in {"fuse", "unknown"}:
        return "fuse"
    if fallback == "unknown":  # statfs could not be asked: the table's type names it
        if mount_type in {"ext2", "ext3"}:
            return "ext4"
        if mount_type in _MAGIC_NAMES:
            return mount_type
    return fallback


def describe_fs(path: str | os.PathLike[str], *, mountinfo: str | None = None) -> FsInfo:
    """Tell which filesystem holds (or will hold) ``path``, from statfs and the mount table.

    Never raises: a path whose filesystem cannot be told is ``unknown`` (the caller then
    reads as on a local disk, or as the user says).

    Args:
        path: a file or directory, existing or not (its nearest existing parent is asked).
        mountinfo: the mount table's text (tests); default: ``/proc/self/mountinfo``.
    """
    existing = os.path.realpath(_nearest_existing(path))
    magic = 0
    name = "unknown"
    if sys.platform.startswith("linux"):
        try:
            magic = statfs_magic(existing)
            name = FS_MAGIC.get(magic, "unknown")
        except StorageError as exc:
            logger.debug("statfs of %s failed: %s", existing, exc)
    if mountinfo is None:
        try:
            mountinfo = read_regular(
                _MOUNTINFO, max_bytes=_MOUNTINFO_MAX_BYTES, what="mount table"
            ).decode("utf-8", "replace")
        except (ShardioError, OSError) as exc:
            logger.debug("cannot read the mount table: %s", exc)
            mountinfo = ""
    point, mount_type, source = _mount_of(existing, mountinfo)
    if name in {"fuse", "unknown", "nfs"} or not magic:
        name = _name_from_mount(mount_type, source, name)
    return FsInfo(name=name, magic=magic, mount_point=point, mount_type=mount_type, source=source)
