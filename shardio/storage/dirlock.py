"""The lock on a directory that one shardio writer holds while it writes into it.

``pack`` holds it exclusively (or shared by the ``--part`` runs of one pack, which write
disjoint files), ``merge`` and ``verify --repair`` exclusively: one writer at a time, never
blocking (a second one is refused in one line).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterator

from shardio.errors import UsageError, wrap_os_error

__all__ = ["lock_directory"]

logger = logging.getLogger(__name__)

# flock on a filesystem without locks (some NFS mounts, FUSE filesystems): run unlocked.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


@contextlib.contextmanager
def lock_directory(
    path: str, *, shared: bool, busy: str = "another shardio pack is writing to"
) -> Iterator[None]:
    """Hold a lock on the directory ``path`` itself while writing into it.

    Exclusive, or shared with the other holders of a shared lock. Never blocks.

    Args:
        path: the directory.
        shared: a shared lock (``--part`` runs of one pack), else exclusive.
        busy: what the refusal says before the path when another holder conflicts.

    Raises:
        UsageError: another shardio process holds a conflicting lock.
        StorageError: the directory cannot be opened or locked.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise wrap_os_error(exc, f"cannot open {path}: {exc.strerror}") from exc
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise UsageError(f"{busy} {path}: wait for it to finish and retry") from exc
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise wrap_os_error(exc, f"cannot lock {path}: {exc.strerror}") from exc
            logger.warning(
                "cannot lock %s (%s): nothing stops another writer from writing there at once",
                path,
                exc.strerror,
            )
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if not same:  # removed or replaced between our open and our lock
            raise UsageError(f"{busy} {path}: retry")
        yield
    finally:
        os.close(fd)
