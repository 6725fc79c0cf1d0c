"""Open files safely: regular files only (a FIFO or device never blocks), bounded reads, and
directories created inside a root without following a symlink out of it.

Every file shardio reads goes through :func:`open_regular`: it opens with ``O_NONBLOCK`` (so
opening a FIFO returns at once instead of waiting for a writer) and refuses anything that is
not a regular file before a byte is read. Every directory shardio writes into is made with
:func:`make_dirs_inside`, which refuses a symlink or a non-directory on the way.
"""

from __future__ import annotations

import errno
import os
import stat

from shardio.errors import FormatError, StorageError, UsageError

__all__ = [
    "describe_kind",
    "make_dirs_inside",
    "open_regular",
    "read_regular",
    "real_dir",
]

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def describe_kind(mode: int) -> str:
    """A word for a file type: "FIFO (named pipe)", "socket", "directory", ..."""
    if stat.S_ISREG(mode):
        return "regular file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "special file"


def open_regular(path: str | bytes, *, what: str = "file", nofollow: bool = False) -> int:
    """Open ``path`` read-only; refuse (without blocking) anything but a regular file.

    Args:
        path: the file.
        what: what the file is to the caller ("shard", "index", ...), for the message.
        nofollow: refuse a symlink (``O_NOFOLLOW``): for files shardio wrote itself.

    Returns:
        A file descriptor (close-on-exec; ``O_NONBLOCK`` is harmless on regular files).

    Raises:
        StorageError: the file cannot be opened, or is a FIFO, socket, device or directory.
    """
    name = os.fsdecode(path)
    try:
        fd = os.open(path, _READ_FLAGS | (os.O_NOFOLLOW if nofollow else 0))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EISDIR:
            reason = "is a directory, not a regular file"
        elif exc.errno == errno.ELOOP and nofollow:
            reason = "is a symlink, not a file shardio wrote"
        raise StorageError(exc.errno or errno.EIO, f"cannot open {what} {name}: {reason}") from exc
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise StorageError(exc.errno or errno.EIO, f"cannot stat {what} {name}") from exc
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise StorageError(
            errno.EINVAL, f"{what} {name} is a {describe_kind(mode)}, not a regular file"
        )
    return fd


def read_regular(path: str | bytes, *, max_bytes: int, what: str = "file") -> bytes:
    """Read a whole regular file of at most ``max_bytes`` (checked before allocating).

    Raises:
        StorageError: not a regular file, or unreadable.
        FormatError: larger than ``max_bytes``.
    """
    fd = open_regular(path, what=what)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FormatError(
                f"{what} {os.fsdecode(path)} is {size:,} bytes, more than the {max_bytes:,} "
                "a valid one can hold"
            )
        parts = []
        got = 0
        while got <= max_bytes:  # read to EOF, never past the bound (a file may grow)
            chunk = os.read(fd, max_bytes + 1 - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        if got > max_bytes:
            raise FormatError(f"{what} {os.fsdecode(path)} grew past {max_bytes:,} bytes")
        return b"".join(parts)
    except OSError as exc:
        if isinstance(exc, StorageError):
            raise
        raise StorageError(
            exc.errno or errno.EIO, f"cannot read {what} {os.fsdecode(path)}: {exc.strerror}"
        ) from exc
    finally:
        os.close(fd)


def real_dir(path: str) -> bool:
    """Whether ``path`` is a directory and not a symlink (False if it does not exist)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def make_dirs_inside(root: str, rel: str, *, mode: int = 0o777) -> str:
    """Create ``root/rel`` (and its parents below root), following no symlink inside ``root``.

    ``root`` itself may be a symlink (the user named it); every component below it must be a
    real directory or not exist yet.

    Returns:
        The joined path.

    Raises:
        UsageError: a component is a symlink or not a directory.
        StorageError: a directory cannot be created.
    """
    path = root
    for part in [p for p in rel.split("/") if p]:
        path = os.path.join(path, part)
        try:
            os.mkdir(path, mode)
            continue
        except FileExistsError:
            pass
        except OSError as exc:
            raise StorageError(
                exc.errno or errno.EIO, f"cannot create {path}: {exc.strerror}"
            ) from exc
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(
                f"{path} is a symlink: shardio does not write through symlinks inside {root}"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{path} is a {describe_kind(st.st_mode)}, not a directory")
    return path
