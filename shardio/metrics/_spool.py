"""The spool directory where a node's local ranks leave their snapshots for local rank 0.

Local rank 0 makes the spool and removes it at close; the other local ranks only write into
it, once it exists and checks out. Two kinds:

- ``spool_dir="auto"``: local rank 0 makes it with :func:`tempfile.mkdtemp` under a root
  (``/dev/shm`` by default) as ``shardio-metrics-<job key>-<random>``, mode 0700. The other
  local ranks find it by listing the root for that prefix and keeping only directories owned
  by their own uid with no access for others, whose ``local-rank-0.json`` (local rank 0's
  own snapshot, rewritten every interval) is fresh; of several, the freshest. The trust
  comes from the owner, not the name: another user can create any name in ``/dev/shm``, but never a
  directory owned by this uid, so no pre-created name can stop, read or feed the job, and
  the random part makes the name unknown in advance. The job key is a hash of the ``job``
  label: give each job its own (``SLURM_JOB_ID``) so that two jobs of one user on a node do
  not find each other's spool.
- an explicit path: created by local rank 0 (mode 0700) unless it exists; an existing one
  must be a real directory owned by this user and private (0700). Anything else (a symlink, a
  directory another user made first) is logged and the node reports without the spool: a
  metrics export never stops training.

At close local rank 0 removes the files shardio wrote there (``local-rank-<n>.json`` and
their temp files; regular files only, no symlink followed) and, when it made the directory,
the directory if nothing else is left in it. A job killed with ``kill -9`` leaves its spool
behind (a few KB in ``/dev/shm``; the next job does not use it).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
from typing import Any

from shardio.errors import StorageError, UsageError
from shardio.storage.atomic import storage_error
from shardio.storage.files import (
    describe_kind,
    find_temps_inside,
    open_regular,
    rmdir_inside,
    unlink_inside,
)

__all__ = [
    "MAX_SPOOL_BYTES",
    "read_spool_file",
    "AUTO",
    "DEFAULT_ROOT",
    "SPOOL_NAME",
    "auto_prefix",
    "check_private",
    "find_auto_spool",
    "make_spool",
    "remove_spool",
    "spool_file",
]

AUTO = "auto"
DEFAULT_ROOT = "/dev/shm"
SPOOL_NAME = re.compile(r"local-rank-([0-9]+)\.json\Z")
_MAX_CANDIDATES = 256  # directories of the prefix looked at per search (a flood is skipped)


def spool_file(spool: str, local_rank: int) -> str:
    """The file local rank ``local_rank`` writes in ``spool``."""
    return os.path.join(spool, f"local-rank-{local_rank}.json")


def auto_prefix(job: str | None) -> str:
    """The name prefix of an automatic spool for the ``job`` label."""
    key = hashlib.sha256((job or "").encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"shardio-metrics-{key}-"


def check_private(path: str) -> None:
    """Check that ``path`` is a real directory owned by this user, mode 0700.

    Raises:
        UsageError: it is a symlink, not a directory, or not private to this user.
        StorageError: it does not exist or cannot be looked at.
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise storage_error(exc, path, "checking the metrics spool directory") from exc
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(
            f"metrics spool directory {path} is a symlink: shardio does not write through symlinks"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(
            f"metrics spool directory {path} is a {describe_kind(st.st_mode)}, not a directory"
        )
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise UsageError(
            f"metrics spool directory {path} is not private to this user (owner uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}; shardio needs its own, 0700): "
            "use spool_dir='auto'"
        )


def make_spool(spool_dir: str, *, root: str, job: str | None) -> tuple[str, bool]:
    """Local rank 0's spool: made now (``auto``, or an explicit path that does not exist) or
    an existing private one.

    Returns:
        The spool's path, and whether it was made now (then :func:`remove_spool` removes it).

    Raises:
        UsageError: an explicit path exists but is not a private directory of this user.
        StorageError: it cannot be created.
    """
    if spool_dir == AUTO:
        try:
            return tempfile.mkdtemp(prefix=auto_prefix(job), dir=root), True
        except OSError as exc:
            raise storage_error(exc, root, "creating a metrics spool directory in") from exc
    try:
        os.mkdir(spool_dir, 0o700)
        return spool_dir, True
    except FileExistsError:
        pass
    except OSError as exc:
        raise storage_error(exc, spool_dir, "creating the metrics spool directory") from exc
    check_private(spool_dir)
    return spool_dir, False


def find_auto_spool(root: str, job: str | None, oldest: float) -> str | None:
    """The automatic spool local rank 0 of this job made under ``root``, or None (not yet).

    Only directories owned by this user, mode 0700, whose ``local-rank-0.json`` is a regular
    file of this user written since ``oldest``; of several, the freshest.

    Raises:
        StorageError: ``root`` cannot be listed.
    """
    prefix = auto_prefix(job)
    uid = os.geteuid()
    best: tuple[float, str] | None = None
    looked = 0
    try:
        entries = os.scandir(root)
    except OSError as exc:
        raise storage_error(exc, root, "listing") from exc
    with entries:
        for entry in entries:
            if not entry.name.startswith(prefix):
                continue
            looked += 1
            if looked > _MAX_CANDIDATES:
                break
            try:
                st = entry.stat(follow_symlinks=False)
                if not (stat.S_ISDIR(st.st_mode) and st.st_uid == uid):
                    continue
                if st.st_mode & 0o077:
                    continue
                beat = os.lstat(spool_file(entry.path, 0))
            except OSError:
                continue
            if not stat.S_ISREG(beat.st_mode) or beat.st_uid != uid or beat.st_mtime < oldest:
                continue
            if best is None or beat.st_mtime > best[0]:
                best = (beat.st_mtime, entry.path)
    return None if best is None else best[1]


def remove_spool(path: str, *, made: bool) -> None:
    """Remove the spool files shardio wrote in ``path`` and, when ``made``, the directory
    if it is empty then (anything else there is left, and so is the directory).

    Raises:
        StorageError: a file cannot be removed.
    """
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error(exc, path, "listing the metrics spool") from exc
    for name in names:
        if SPOOL_NAME.match(name):
            unlink_inside(path, name)
    for final, temps in find_temps_inside(path, "").items():
        if SPOOL_NAME.match(final):
            for name in temps:
                unlink_inside(path, name)
    if made and not rmdir_inside(os.path.dirname(path) or ".", os.path.basename(path)):
        try:
            left = sorted(os.listdir(path))
        except OSError:
            return
        if left:
            raise StorageError(
                errno.ENOTEMPTY,
                f"left the metrics spool directory {path} in place: it holds files shardio "
                f"did not write ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''})",
            )


MAX_SPOOL_BYTES = 1 << 20  # a snapshot is a few KB; anything larger is not one


def read_spool_file(path: str, oldest: float) -> dict[str, Any] | None:
    """A spool file's record, or None when it is gone or older than ``oldest``."""
    try:
        fd = open_regular(path, what="metrics spool file", nofollow=True)
    except StorageError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise
    try:
        st = os.fstat(fd)
        if st.st_mtime < oldest:
            return None
        if st.st_size > MAX_SPOOL_BYTES:
            raise StorageError(errno.EFBIG, f"metrics spool file {path} is too large")
        data = os.read(fd, MAX_SPOOL_BYTES)
    finally:
        os.close(fd)
    record = json.loads(data)
    if not isinstance(record, dict) or "snapshot" not in record:
        raise UsageError(f"metrics spool file {path} holds no snapshot")
    return record
