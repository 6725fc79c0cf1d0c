"""Replace a file of a dataset safely: never through a symlink, only by verified bytes.

What ``verify --repair`` writes goes through here: a bad shard or index is replaced by a
source's copy only once the copy's own bytes hash right, and a lost DALI index is written
only where nothing is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat

from shardio.errors import UsageError
from shardio.metrics.progress import Counters
from shardio.staging.verified import copy_verified
from shardio.storage.atomic import (
    create_temp,
    fsync_dir,
    rename_noreplace,
    storage_error,
    temp_path_for,
)
from shardio.storage.files import describe_kind, make_dirs_inside
from shardio.storage.opener import Opener

__all__ = ["refuse_non_regular", "replace_verified", "write_new"]

logger = logging.getLogger(__name__)


def refuse_non_regular(path: str) -> None:
    """Refuse to replace anything but a regular file (or nothing) at ``path``.

    Raises:
        UsageError: a symlink, directory, FIFO, socket or device is there.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error(exc, path, "checking") from exc
    if not stat.S_ISREG(mode):
        raise UsageError(
            f"{path} is a {describe_kind(mode)}, not a shard shardio wrote: refusing to write "
            "through or replace it; remove it yourself and repair again"
        )


def replace_verified(
    src: str,
    root: str,
    rel: str,
    expected: str,
    size_bytes: int,
    *,
    durable: bool,
    what: str,
    opener: Opener,
) -> None:
    """Copy ``src`` into a temp file beside ``root/rel``, hash the copy's own bytes, and
    rename it over ``root/rel`` only if it matches ``expected``.

    Raises:
        UsageError: ``root/rel`` (or a folder on the way) is a symlink or not a regular file.
        IntegrityError: the source's copy has the wrong size or checksum.
        StorageError: reading or writing failed.
    """
    final = os.path.join(root, rel)
    refuse_non_regular(final)
    make_dirs_inside(root, os.path.dirname(rel))
    copy_verified(
        src,
        final,
        expected,
        size_bytes=size_bytes,
        durable=durable,
        counters=Counters(shared=False),
        what=what,
        action="repairing",
        before_publish=lambda: refuse_non_regular(final),  # nothing planted is replaced
        opener=opener,
    )
    logger.info("replaced %s by the verified copy %s", final, src)


def write_new(root: str, rel: str, data: bytes, *, durable: bool) -> None:
    """Write ``root/rel`` atomically where nothing is: a temp file, then a rename that
    replaces nothing (something put there meanwhile, a symlink included, is never replaced).

    Raises:
        UsageError: something is at ``root/rel`` (or a folder on the way is a symlink).
        StorageError: writing failed.
    """
    final = os.path.join(make_dirs_inside(root, os.path.dirname(rel)), os.path.basename(rel))
    tmp = temp_path_for(final)
    try:
        fd = create_temp(tmp)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        rename_noreplace(tmp, final)
    except FileExistsError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UsageError(
            f"{final} appeared while it was being written, and shardio replaces nothing it did "
            "not write: check what is there"
        ) from exc
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise storage_error(exc, final, "writing") from exc
    if durable:
        fsync_dir(os.path.dirname(final))
