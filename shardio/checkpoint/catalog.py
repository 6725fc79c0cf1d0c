"""The checkpoints already in a directory: list them, read their manifests, check and prune them.

A checkpoint whose manifest cannot be read now (a server down, a stalled read) is listed as
unreadable, which says nothing of its state; one that is damaged is listed with why. Pruning
counts only checkpoints whose files were read and matched, so the last intact fallback stays.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import stat

from shardio.checkpoint.codec import check_file
from shardio.checkpoint.manifest import MAX_MANIFEST_BYTES, CheckpointManifest, parse_manifest
from shardio.checkpoint.naming import (
    MANIFEST_NAME,
    is_checkpoint_name,
    is_temp_dir_name,
    step_of_name,
)
from shardio.errors import (
    CheckpointError,
    CheckpointUnavailableError,
    FormatError,
    IntegrityError,
    ShardioError,
    StorageError,
    wrap_os_error,
)
from shardio.storage.atomic import TEMP_MARK, rename_noreplace
from shardio.storage.files import read_regular, rmdir_inside, unlink_inside
from shardio.storage.stall import IoThreads, call_with_deadline

__all__ = [
    "Listed",
    "all_damaged",
    "check_files",
    "list_checkpoints",
    "one_checkpoint",
    "prune",
    "read_manifest",
    "unavailable",
    "verify_files",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Listed:
    """One checkpoint directory found: its manifest, or why it has none that parses
    (``unreadable``: its manifest could not be read now, which says nothing of its state)."""

    path: str
    manifest: CheckpointManifest | None
    problem: str | None
    unreadable: bool = False


# A file that is not there, or not a file shardio wrote (a symlink, a FIFO): damage, not an
# outage. Any other error of the storage may pass (a server back, a permission restored).
_DAMAGE_ERRNOS = frozenset((errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EISDIR, errno.EINVAL))


def all_damaged(folder: str, skipped: list[tuple[str, str]]) -> CheckpointError:
    """The one-line error for a directory whose checkpoints are all damaged: each named,
    with why (the first five)."""
    reasons = "; ".join(f"{os.path.basename(p)}: {r}" for p, r in skipped[:5])
    more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
    return CheckpointError(
        errno.EIO,
        f"every checkpoint in {folder} is damaged: {len(skipped)} found, none loads "
        f"({reasons}){more}; not a fresh start: restore or remove them",
    )


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc``, raised reading a checkpoint, says the storage could not be read now
    (a server down, a stalled read, a permission) rather than that the checkpoint is damaged
    (bytes or sizes that do not match, a malformed manifest, a missing or foreign file)."""
    if isinstance(exc, (IntegrityError, FormatError)) or not isinstance(exc, StorageError):
        return False
    if isinstance(exc, CheckpointError) and not isinstance(exc, CheckpointUnavailableError):
        return False  # a verdict on the checkpoint itself (torch.load refused it, ...)
    return exc.errno not in _DAMAGE_ERRNOS


def read_manifest(path: str) -> CheckpointManifest:
    """The manifest of the checkpoint directory ``path``.

    Raises:
        FormatError: it is malformed or fails its seal. StorageError: it cannot be read.
    """
    where = os.path.join(path, MANIFEST_NAME)
    data = read_regular(where, max_bytes=MAX_MANIFEST_BYTES, what="manifest", nofollow=True)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{where}: not JSON ({exc})") from None
    return parse_manifest(doc, where)


def list_checkpoints(
    directory: str, *, pool: IoThreads | None = None, timeout_s: float = 120.0
) -> tuple[list[Listed], list[str]]:
    """The checkpoints in ``directory``, newest first, and the temp directories of saves in
    flight or interrupted.

    Only real directories with a checkpoint's name count: a symlink is never followed. With
    ``pool``, each manifest is read under a ``timeout_s`` deadline (one on a dead server is
    listed as unreadable, not waited for).

    Raises:
        StorageError: ``directory`` cannot be listed.
    """
    try:
        if pool is None:
            dirs = _scan(directory)
        else:  # a dead metadata server holds a listing as long as a read
            dirs = call_with_deadline(
                pool, functools.partial(_scan, directory), timeout_s,
                f"listing the checkpoints in {directory}",
            )  # fmt: skip
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        reason = str(exc) if isinstance(exc, ShardioError) else exc.strerror
        raise wrap_os_error(
            exc,
            f"the checkpoints in {directory} cannot be read now (not damaged; retry): {reason}",
            CheckpointUnavailableError,
        ) from exc
    found: list[Listed] = []
    temps: list[str] = []
    for name in dirs:
        path = os.path.join(directory, name)
        if is_temp_dir_name(name):
            temps.append(path)
        elif is_checkpoint_name(name):
            found.append(_listed(path, pool, timeout_s))
    return sorted(found, key=_order_key, reverse=True), temps


def _scan(directory: str) -> list[str]:
    """The names of the real directories (no symlinks) in ``directory``, sorted."""
    names = []
    with os.scandir(directory) as it:
        for entry in it:
            try:
                real = entry.is_dir(follow_symlinks=False)
            except OSError:
                real = False
            if real:
                names.append(entry.name)
    return sorted(names)


def _dir_at(path: str) -> bool | None:
    """As :func:`_real_dir`, but an error other than "nothing there" is raised."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _listed(path: str, pool: IoThreads | None, timeout_s: float) -> Listed:
    """The checkpoint at ``path``, its manifest read (under the deadline, with ``pool``)."""
    try:
        if pool is None:
            manifest = read_manifest(path)
        else:
            manifest = call_with_deadline(
                pool, functools.partial(read_manifest, path), timeout_s,
                f"reading the manifest of {path}",
            )  # fmt: skip
    except ShardioError as exc:
        return Listed(path, None, str(exc), unreadable=unavailable(exc))
    return Listed(path, manifest, None)


def one_checkpoint(path: str, *, pool: IoThreads, timeout_s: float) -> Listed | None:
    """The one checkpoint at ``path`` (None: nothing is there), its manifest read under the
    deadline.

    Raises:
        CheckpointUnavailableError: whether it is there cannot be told now.
    """
    try:
        found = call_with_deadline(
            pool, functools.partial(_dir_at, path), timeout_s, f"looking for {path}"
        )
    except OSError as exc:
        raise wrap_os_error(
            exc,
            f"checkpoint {path} cannot be read now (not damaged; retry): {exc}",
            CheckpointUnavailableError,
        ) from exc
    if found is None:
        return None
    if found is False:
        return Listed(path, None, "not a directory (or not one shardio wrote)")
    return _listed(path, pool, timeout_s)


def _order_key(x: Listed) -> tuple[int, int]:
    """Newest first by step, then commit time; one whose manifest is unreadable by the step
    in its name and its directory's time (so that it is reported where it would stand)."""
    if x.manifest is not None:
        return x.manifest.order_key()
    try:
        when = os.lstat(x.path).st_mtime_ns
    except OSError:
        when = 0
    return (step_of_name(os.path.basename(x.path)), when)


def verify_files(
    listed: Listed, *, ranks: list[int] | None, timeout_s: float, pool: IoThreads
) -> list[str]:
    """Problems with the files of a checkpoint (all ranks', or those of ``ranks``); empty
    when every one matches its manifest."""
    if listed.manifest is None:
        return [listed.problem or "no manifest"]
    failures = check_files(
        listed.path, listed.manifest, ranks=ranks, timeout_s=timeout_s, pool=pool
    )
    return [str(exc) for exc in failures]


def check_files(
    path: str,
    manifest: CheckpointManifest,
    *,
    ranks: list[int] | None,
    timeout_s: float,
    pool: IoThreads,
) -> list[ShardioError]:
    """Read every file of the checkpoint at ``path`` that ``manifest`` names (all ranks', or
    those of ``ranks``) and check it; the errors of those that do not match, in order."""
    failures = []
    for entry in manifest.files:
        if ranks is not None and entry.rank not in ranks:
            continue
        try:
            check_file(
                os.path.join(path, entry.name), size_bytes=entry.size_bytes,
                xxh3_128=entry.xxh3_128, timeout_s=timeout_s, pool=pool,
            )  # fmt: skip
        except ShardioError as exc:
            failures.append(exc)
    return failures


def prune(
    directory: str, kind: str, keep: int, *, protect: str, timeout_s: float = 120.0
) -> list[str]:
    """Remove the checkpoints of ``kind`` older than the newest ``keep`` intact ones (``protect``,
    the one just written and checked, counts as one and is never removed).

    Only a checkpoint whose files were read and matched counts: a damaged one, or one that
    cannot be read now, is kept and not counted, so the last intact fallback is never removed
    in favour of one that would not load. Only what a checkpoint's manifest names is removed;
    a directory holding anything else is left with a warning. Nothing is removed when the
    directory cannot be listed. Returns the paths removed."""
    pool = IoThreads(max_abandoned=2)
    removed = []
    try:
        try:
            listed, _ = list_checkpoints(directory, pool=pool, timeout_s=timeout_s)
        except StorageError as exc:
            logger.warning("old checkpoints not pruned: %s", exc)
            return []
        intact = 0
        for old in listed:
            if old.manifest is None or old.manifest.kind != kind:
                continue
            if os.path.abspath(old.path) == os.path.abspath(protect):
                intact += 1
            elif intact >= keep:
                if _remove(old):
                    removed.append(old.path)
            elif not (problems := verify_files(old, ranks=None, timeout_s=timeout_s, pool=pool)):
                intact += 1
            else:
                logger.warning(
                    "checkpoint %s kept, not counted among the %d %s kept: %s",
                    old.path, keep, kind, problems[0],
                )  # fmt: skip
    finally:
        pool.close()
    return removed


def _remove(listed: Listed) -> bool:
    """Take a checkpoint out of sight (a rename to a temp name), then delete its files."""
    if listed.manifest is None:
        return False
    head, name = os.path.split(listed.path)
    doomed = os.path.join(head, f".{name}{TEMP_MARK}removing-{os.getpid()}")
    try:
        rename_noreplace(listed.path, doomed)
    except OSError as exc:
        logger.warning("cannot remove old checkpoint %s: %s", listed.path, exc)
        return False
    try:
        for entry in listed.manifest.files:
            unlink_inside(doomed, entry.name)
        unlink_inside(doomed, MANIFEST_NAME)
    except StorageError as exc:
        logger.warning("cannot remove old checkpoint %s: %s", listed.path, exc)
    if not rmdir_inside(head, os.path.basename(doomed)):
        logger.warning(
            "old checkpoint %s held files shardio did not write: left them in %s",
            listed.path,
            doomed,
        )
    return True
