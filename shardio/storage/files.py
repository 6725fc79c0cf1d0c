"""Open files safely: regular files only (a FIFO or device never blocks), bounded reads, and
directories created inside a root without following a symlink out of it.

Every file shardio reads goes through :func:`open_regular`: it opens with ``O_NONBLOCK`` (so
opening a FIFO returns at once instead of waiting for a writer) and refuses anything that is
not a regular file before a byte is read. Every directory shardio writes into is made with
:func:`make_dirs_inside`, which refuses a symlink or a non-directory on the way. Files are
removed through directory descriptors (:func:`unlink_inside`, :func:`rmdir_inside`), never
through a symlink, and only when they are regular files.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Collection

from shardio.errors import FormatError, ShardioError, StorageError, UsageError, wrap_os_error
from shardio.storage.atomic import TEMP_MARK, storage_error

__all__ = [
    "check_replaceable",
    "describe_kind",
    "open_for_pread",
    "find_temps_inside",
    "make_dirs_inside",
    "open_regular",
    "read_regular",
    "real_dir",
    "remove_temps_inside",
    "rmdir_inside",
    "unlink_inside",
]

logger = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_GROWTH_CHUNK = 1 << 20  # what a read past a file's stat size asks for


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
        raise wrap_os_error(exc, f"cannot open {what} {name}: {reason}") from exc
    refuse_irregular(fd, name, what=what)
    return fd


def refuse_irregular(
    fd: int, path: str | bytes, *, what: str = "file", close: Callable[[int], None] = os.close
) -> None:
    """Close ``fd`` (with ``close``) and raise StorageError unless it is a regular file."""
    name = os.fsdecode(path)
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        close(fd)
        raise wrap_os_error(exc, f"cannot stat {what} {name}") from exc
    if not stat.S_ISREG(mode):
        close(fd)
        raise StorageError(
            errno.EINVAL, f"{what} {name} is a {describe_kind(mode)}, not a regular file"
        )


def open_for_pread(path: str | bytes, *, what: str = "file", nofollow: bool = False) -> int:
    """Open ``path`` for ``pread`` in a hot path: no ``fstat`` (a metadata round trip on a
    parallel filesystem), yet nothing blocks.

    ``O_NONBLOCK`` makes opening a FIFO return at once; ``pread`` on a FIFO, socket or
    terminal then fails (ESPIPE), on a directory too (EISDIR), and bytes read from a device
    fail their checksum. Callers bound every read by sizes they already trust.

    Raises:
        StorageError: the file cannot be opened.
    """
    try:
        return os.open(path, _READ_FLAGS | (os.O_NOFOLLOW if nofollow else 0))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ELOOP and nofollow:
            reason = "is a symlink, not a file shardio wrote"
        raise wrap_os_error(exc, f"cannot open {what} {os.fsdecode(path)}: {reason}") from exc


def read_regular(
    path: str | bytes, *, max_bytes: int, what: str = "file", nofollow: bool = False
) -> bytes:
    """Read a whole regular file of at most ``max_bytes`` (checked before allocating: a
    read asks for what the file holds, not for ``max_bytes``).

    Args:
        path: the file.
        max_bytes: the largest file accepted.
        what: what the file is to the caller, for the messages.
        nofollow: refuse a symlink (see :func:`open_regular`).

    Raises:
        StorageError: not a regular file, or unreadable.
        FormatError: larger than ``max_bytes``.
    """
    fd = open_regular(path, what=what, nofollow=nofollow)
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
            chunk = os.read(fd, min(max_bytes + 1 - got, max(size + 1 - got, _GROWTH_CHUNK)))
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
        raise wrap_os_error(exc, f"cannot read {what} {os.fsdecode(path)}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def check_replaceable(path: str, *, what: str, parent: bool = False) -> None:
    """Check that ``path`` is absent or a regular file, so renaming over it replaces no
    symlink, directory or device; with ``parent``, that its directory exists.

    Raises:
        StorageError: it is not.
    """
    if parent:
        head = os.path.dirname(path) or "."
        if not os.path.isdir(head):
            raise StorageError(errno.ENOENT, f"{what} {path}: no directory {head}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error(exc, path, f"checking {what}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(
            errno.EINVAL,
            f"{what} {path} is a {describe_kind(st.st_mode)}, not a regular file: "
            "shardio replaces only regular files",
        )


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
            raise wrap_os_error(exc, f"cannot create {path}: {exc.strerror}") from exc
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(
                f"{path} is a symlink: shardio does not write through symlinks inside {root}"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{path} is a {describe_kind(st.st_mode)}, not a directory")
    return path


# --------------------------------------------------------------------------- removal


def _open_dir_inside(root: str, parts: list[str]) -> int | None:
    """A descriptor of ``root/parts...``, following no symlink below root; None if absent,
    a symlink or not a directory."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    for part in parts:
        try:
            sub = os.open(
                part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None
            raise
        os.close(fd)
        fd = sub
    return fd


def _unlink_regular_at(dir_fd: int, name: str, shown: str) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        logger.warning(
            "left %s in place: a %s, not a file shardio wrote",
            shown,
            "symlink" if stat.S_ISLNK(st.st_mode) else "non-regular file",
        )
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def unlink_inside(root: str, rel: str) -> bool:
    """Remove the regular file ``root/rel``; return whether one was removed.

    No symlink below ``root`` is followed (a symlinked directory on the way means the file
    is not shardio's), and a symlink or special file at ``rel`` is left in place.

    Raises:
        StorageError: a directory on the way cannot be opened, or the file cannot be removed.
    """
    parts = rel.split("/")
    try:
        fd = _open_dir_inside(root, parts[:-1])
        if fd is None:
            return False
        try:
            return _unlink_regular_at(fd, parts[-1], os.path.join(root, rel))
        finally:
            os.close(fd)
    except ShardioError:
        raise
    except OSError as exc:
        raise wrap_os_error(
            exc, f"cannot remove {os.path.join(root, rel)}: {exc.strerror}"
        ) from exc


def rmdir_inside(root: str, rel: str) -> bool:
    """Remove the empty directory ``root/rel`` (no symlink followed); whether it was."""
    parts = rel.split("/")
    try:
        fd = _open_dir_inside(root, parts[:-1])
    except OSError:
        return False
    if fd is None:
        return False
    try:
        os.rmdir(parts[-1], dir_fd=fd)  # a symlink there fails with ENOTDIR
        return True
    except OSError:  # not empty, a symlink or not a directory, or gone
        return False
    finally:
        os.close(fd)


def find_temps_inside(root: str, folder: str) -> dict[str, list[str]]:
    """shardio temp files in ``root/folder``: final name -> the temp names of it.

    Left by killed runs (or being written by live ones). Lists nothing through a symlink.

    Raises:
        StorageError: the folder cannot be listed.
    """
    found: dict[str, list[str]] = {}
    try:
        fd = _open_dir_inside(root, [p for p in folder.split("/") if p])
        if fd is None:
            return found
        try:
            entries = os.listdir(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise wrap_os_error(
            exc, f"cannot list {os.path.join(root, folder)}: {exc.strerror}"
        ) from exc
    for entry in entries:
        head, mark, _ = entry.partition(TEMP_MARK)
        if mark and head.startswith(".") and len(head) > 1:
            found.setdefault(head[1:], []).append(entry)
    return found


def remove_temps_inside(root: str, folder: str, finals: Collection[str] | None = None) -> None:
    """Remove the shardio temp files in ``root/folder`` (of the files named ``finals`` only,
    if given): leftovers of killed runs, when no run can be writing them. Regular files
    only; no symlink is followed."""
    for final, temps in find_temps_inside(root, folder).items():
        if finals is not None and final not in finals:
            continue
        for name in temps:
            unlink_inside(root, f"{folder}/{name}" if folder else name)
