"""Replace a dataset with a new one packed beside it (``--force``), by a journaled commit.

The new dataset is packed completely into ``DST/.shardio-work/next/`` (same filesystem, so
the stripe layout applies and renames are cheap). Only then is the swap committed:

1. write ``commit.json`` (the old files to remove, the new files to move in);
2. remove the old manifest (from here on DST does not look complete);
3. remove the old files the new dataset does not replace by name;
4. rename the new shards, DALI indexes, index and report into DST;
5. rename the new manifest into DST, last;
6. remove the work directory.

Every step can be repeated, so a run killed anywhere is completed by the next ``--force``
or ``--resume`` (:func:`finish_commit`). While ``next/manifest.json`` exists, step 5 has
not happened, so the old manifest (step 2) is never confused with the new one.
"""

from __future__ import annotations

import logging
import os

from shardio.errors import FormatError, UsageError, wrap_os_error
from shardio.format.manifest import Manifest
from shardio.format.spec import MANIFEST_FILENAME, WORK_DIR
from shardio.packing.dest import check_owned, dataset_files, remove_work_dir, unlink_regular
from shardio.packing.workfiles import COMMIT_NAME, NEXT_DIR, CommitRecord, write_record
from shardio.storage.atomic import fsync_dir
from shardio.storage.files import make_dirs_inside

__all__ = ["commit_replacement", "finish_commit", "next_dir"]

logger = logging.getLogger(__name__)


def next_dir(dst: str) -> str:
    """Where the replacement dataset is packed."""
    return os.path.join(dst, WORK_DIR, NEXT_DIR)


def commit_replacement(dst: str, old: Manifest, new: Manifest, *, durable: bool) -> None:
    """Swap the dataset in ``dst`` for the complete one in :func:`next_dir`.

    Raises:
        UsageError: an old file became a symlink or special file, or a file that is not the
            old dataset's stands where a new file must go; nothing is changed then.
    """
    remove = dataset_files(old)
    move = [rel for rel in dataset_files(new) if rel != MANIFEST_FILENAME]
    check_owned(dst, remove, source=os.path.join(dst, MANIFEST_FILENAME))
    owned = set(remove)
    for rel in move:
        if rel not in owned and os.path.lexists(os.path.join(dst, rel)):
            raise UsageError(
                f"{os.path.join(dst, rel)} is in the way: it is not a file of the dataset in "
                f"{dst}, so shardio will not replace it; move it away and rerun with --resume"
            )
    record = CommitRecord(remove=tuple(remove), move=tuple(move))
    write_record(os.path.join(dst, WORK_DIR, COMMIT_NAME), record, durable=durable)
    _reached("commit-recorded")
    finish_commit(dst, record, durable=durable)


def _reached(point: str) -> None:
    """A named step of the commit: a no-op that tests patch to SIGKILL the process there
    (tests/fault/test_replace.py)."""


def finish_commit(dst: str, record: CommitRecord, *, durable: bool) -> None:
    """Run (or finish, after a kill) the steps 2-6 of a commit; each is repeatable.

    Raises:
        FormatError: a new file is neither in ``next/`` nor in DST (removed by hand?).
        StorageError: a rename failed.
    """
    nxt = next_dir(dst)
    new_manifest = os.path.join(nxt, MANIFEST_FILENAME)
    if os.path.lexists(new_manifest):
        unlink_regular(os.path.join(dst, MANIFEST_FILENAME))
        _sync(dst, durable)
        _reached("commit-old-manifest-removed")
        moving = set(record.move)
        for rel in record.remove:
            if rel != MANIFEST_FILENAME and rel not in moving:
                unlink_regular(os.path.join(dst, rel))
        _reached("commit-old-files-removed")
        folders = set()
        for i, rel in enumerate(record.move):
            source, target = os.path.join(nxt, rel), os.path.join(dst, rel)
            folder = os.path.dirname(rel)
            if folder:
                make_dirs_inside(dst, folder)
            folders.add(os.path.join(dst, folder) if folder else dst)
            if os.path.lexists(source):
                _rename(source, target)
            elif not os.path.isfile(target):
                raise FormatError(
                    f"{source} vanished while {dst} was being replaced: remove {dst} by hand "
                    "and pack again"
                )
            if i == len(record.move) // 2:
                _reached("commit-half-moved")
        for folder in sorted(folders):
            _sync(folder, durable)
        _rename(new_manifest, os.path.join(dst, MANIFEST_FILENAME))
        _sync(dst, durable)
        _reached("commit-new-manifest-in")
    remove_work_dir(dst)
    logger.info("replaced the dataset in %s", dst)


def _rename(source: str, target: str) -> None:
    try:
        os.rename(source, target)
    except OSError as exc:
        raise wrap_os_error(exc, f"cannot move {source} to {target}: {exc.strerror}") from exc


def _sync(folder: str, durable: bool) -> None:
    if durable:
        fsync_dir(folder)
