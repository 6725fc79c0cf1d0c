"""Atomic publication of files: temp name, fsync, rename, fsync of the directory."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import IO, Any

from shardio.errors import StorageError, wrap_os_error

__all__ = [
    "TEMP_MARK",
    "atomic_write",
    "rename_noreplace",
    "create_temp",
    "fsync_dir",
    "is_temp_name",
    "publish",
    "temp_path_for",
]

# Temp files are hidden and carry this mark, so nothing half-written has a final name and a
# resumed run can recognise and remove leftovers.
TEMP_MARK = ".shardio-tmp-"


def temp_path_for(path: str) -> str:
    """Return the temp name used while ``path`` is being written."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}{TEMP_MARK}{os.getpid()}")


def create_temp(tmp: str, mode: int = 0o644, *, readable: bool = False) -> int:
    """Create a temp file for writing: never through a symlink, never an existing file.

    A file already at the temp name (left by a killed process that had the same pid) is
    removed first when it is a regular file; anything else there is refused.
    """
    flags = (
        (os.O_RDWR if readable else os.O_WRONLY)
        | os.O_CREAT
        | os.O_EXCL
        | os.O_NOFOLLOW
        | os.O_CLOEXEC
    )
    try:
        return os.open(tmp, flags, mode)
    except FileExistsError:
        st = os.lstat(tmp)
        if not stat.S_ISREG(st.st_mode):
            raise
        os.unlink(tmp)
        return os.open(tmp, flags, mode)


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of shardio's temp names."""
    return TEMP_MARK in name


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename in it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, final: str, *, durable: bool = True) -> None:
    """Rename a complete temp file to its final name (after fsync when durable)."""
    if durable:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, final)
    if durable:
        fsync_dir(os.path.dirname(final) or ".")


_RENAME_NOREPLACE = 1  # linux/fs.h


def _renameat2() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (``renameat2(RENAME_NOREPLACE)``; where
    the filesystem lacks it, a check then ``rename``, which for a directory still fails on a
    non-empty target).

    Raises:
        FileExistsError: something is at ``dst``.
        OSError: the rename failed.
    """
    fn = _renameat2()
    if fn is not None:
        at_fdcwd = -100
        if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), dst)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def storage_error(exc: OSError, path: str, action: str) -> StorageError:
    """Turn an OSError into a one-line StorageError naming the file."""
    if exc.errno == errno.ENOSPC:
        return StorageError(exc.errno, f"no space left on device while {action} {path}")
    if exc.errno == errno.EDQUOT:
        return StorageError(exc.errno, f"disk quota exceeded while {action} {path}")
    return wrap_os_error(exc, f"{action} {path} failed: {exc.strerror or exc}")


@contextmanager
def atomic_write(path: str, *, durable: bool = True) -> Iterator[IO[bytes]]:
    """Open a temp file for writing; publish it under ``path`` only if the block succeeds.

    Raises:
        StorageError: writing or publishing failed (ENOSPC included); the temp file is removed.
    """
    tmp = temp_path_for(path)
    try:
        fh = os.fdopen(create_temp(tmp), "wb")
    except OSError as exc:
        raise storage_error(exc, path, "creating") from exc
    try:
        with fh:
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(os.path.dirname(path) or ".")
    except BaseException as exc:
        with suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, StorageError):
            raise storage_error(exc, path, "writing") from exc
        raise
