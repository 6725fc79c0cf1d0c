"""``shardio parity add`` and ``shardio parity drop``: give a packed dataset parity, or take it
away, in place, resumable after a kill.

Both hold the dataset's exclusive lock (pack's), so no pack, merge or repair runs meanwhile.

- **add** computes every group's parity files and cell table (journaled group by group in
  the work directory, :func:`shardio.parity.encode.encode_parity`), then publishes the new
  manifest (format 3, with its ``parity`` section) atomically: until then readers see the
  dataset as it was. Every data shard is verified as it is read; a damaged one stops the add
  (repair it first). A rerun after SIGKILL keeps the groups finished and intact.
- **drop** first records the files it will remove, then publishes the manifest without
  parity, then removes them (regular files only, never through a symlink); a rerun after a
  kill finishes the removal. It also removes what a killed ``add`` left.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from dataclasses import dataclass

from shardio.errors import FormatError, StorageError, UsageError
from shardio.format.index_write import seal_manifest
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.parity import PARITY_DIR
from shardio.format.spec import MANIFEST_FILENAME, WORK_DIR
from shardio.parity.codec import parse_scheme
from shardio.parity.dataset import LOCK_DIR
from shardio.parity.encode import encode_parity, finish_journal, planned_paths
from shardio.storage.atomic import atomic_write, fsync_dir
from shardio.storage.dirlock import lock_directory
from shardio.storage.files import (
    make_dirs_inside,
    read_regular,
    remove_temps_inside,
    rmdir_inside,
    unlink_inside,
)
from shardio.storage.fsdetect import resolve_fs_type
from shardio.storage.runner import CommandRunner, run_command
from shardio.storage.striping import apply_layout

__all__ = ["ParityResult", "add_parity", "drop_parity"]

DROP_RECORD = f"{WORK_DIR}/parity-drop.json"
_BUSY = "another shardio process (a pack, merge, repair or parity run) is writing to"


@dataclass(frozen=True)
class ParityResult:
    """What ``parity add`` or ``parity drop`` did.

    Attributes:
        root: the dataset.
        scheme: ``"K+M"`` added or dropped ("" when there was none to drop).
        groups: parity groups of the dataset.
        files: parity files and cell tables written (add) or removed (drop).
        parity_bytes: their bytes.
        data_bytes: bytes of the data shards they protect.
        seconds: the run.
        already: nothing to do (add: the dataset already has this parity; drop: none).
    """

    root: str
    scheme: str
    groups: int
    files: int
    parity_bytes: int
    data_bytes: int
    seconds: float
    already: bool = False

    @property
    def overhead(self) -> float:
        """Parity bytes over data bytes."""
        return self.parity_bytes / self.data_bytes if self.data_bytes else 0.0


def _load(root: str) -> Manifest:
    manifest = load_manifest(os.path.join(root, MANIFEST_FILENAME))
    if manifest.staged_from is not None:
        raise UsageError(
            f"{root} is a staging area of {manifest.staged_from}: parity belongs to the "
            "dataset itself (its staged copies are rebuilt from the source's parity)"
        )
    return manifest


def _publish(root: str, manifest: Manifest, *, durable: bool) -> None:
    with atomic_write(os.path.join(root, MANIFEST_FILENAME), durable=durable) as fh:
        fh.write(manifest.dumps())


def add_parity(
    root: str | os.PathLike[str],
    scheme: str,
    *,
    workers: int = 1,
    durable: bool = True,
    runner: CommandRunner = run_command,
) -> ParityResult:
    """Add ``--parity K+M`` to the packed dataset at ``root`` (see the module docstring).

    Raises:
        UsageError: a staging area; parity of another scheme already there (drop it first);
            a parity path holding something shardio did not write; the dataset is locked.
        IntegrityError: a data shard is damaged (nothing is published; repair it first).
        MissingExtraError: pyeclib (the ``parity`` extra) is not installed.
        FormatError: the manifest or index cannot be read.
    """
    start = time.monotonic()
    path = os.fspath(root)
    k, m = parse_scheme(scheme)
    with lock_directory(path, shared=False, busy=_BUSY):
        _finish_drop(path, durable=durable)
        manifest = _load(path)
        data = manifest.total_bytes
        if manifest.parity is not None:
            if (manifest.parity.k, manifest.parity.m) != (k, m):
                raise UsageError(
                    f"{path} has parity {manifest.parity.scheme} already: drop it first "
                    f"(shardio parity drop {path}), then add {k}+{m}"
                )
            section = manifest.parity
            return ParityResult(path, section.scheme, len(section.groups), 0,
                                section.total_bytes, data, time.monotonic() - start,
                                already=True)  # fmt: skip
        stripe = manifest.options.get("stripe", "auto")
        size = manifest.options.get("shard_size_bytes", 1 << 30)
        if isinstance(stripe, str) and isinstance(size, int) and size > 0:
            apply_layout(
                make_dirs_inside(path, PARITY_DIR),
                fs_type=resolve_fs_type(path, None),
                stripe=stripe,
                shard_size_bytes=size,
                runner=runner,
            )
        section = encode_parity(path, manifest.shards, k=k, m=m, workers=workers,
                                durable=durable)  # fmt: skip
        new = dataclasses.replace(manifest, format_version=3, parity=section)
        if manifest.format_version < 2:  # format 1 kept no index checksums: add them
            new = seal_manifest(new, os.path.join(path, manifest.index.path))
        _publish(path, new, durable=durable)
        finish_journal(path)
        return ParityResult(path, section.scheme, len(section.groups),
                            len(section.files()), section.total_bytes, data,
                            time.monotonic() - start)  # fmt: skip


def drop_parity(root: str | os.PathLike[str], *, durable: bool = True) -> ParityResult:
    """Remove the parity of the dataset at ``root`` (see the module docstring).

    Raises:
        UsageError: a staging area, or the dataset is locked.
        FormatError: the manifest cannot be read, or the drop record is damaged.
    """
    start = time.monotonic()
    path = os.fspath(root)
    with lock_directory(path, shared=False, busy=_BUSY):
        finished = _finish_drop(path, durable=durable)
        manifest = _load(path)
        leftovers = planned_paths(path, len(manifest.shards))
        section = manifest.parity
        if section is None:
            removed = _remove(path, leftovers)
            finish_journal(path)
            return ParityResult(path, finished[0], 0, finished[1] + removed, 0,
                                manifest.total_bytes, time.monotonic() - start,
                                already=not (finished[1] or removed))  # fmt: skip
        files = [f.path for f in section.files()]
        record = {"scheme": section.scheme, "files": sorted(set(files) | set(leftovers))}
        make_dirs_inside(path, WORK_DIR)
        with atomic_write(os.path.join(path, DROP_RECORD), durable=durable) as fh:
            fh.write(json.dumps(record).encode("ascii"))
        _publish(path, dataclasses.replace(manifest, parity=None), durable=durable)
        _scheme, count = _finish_drop(path, durable=durable)
        finish_journal(path)
        return ParityResult(path, section.scheme, len(section.groups), count,
                            section.total_bytes, manifest.total_bytes,
                            time.monotonic() - start)  # fmt: skip


def _finish_drop(root: str, *, durable: bool) -> tuple[str, int]:
    """Finish a drop a kill interrupted (its record names the files); (scheme, removed)."""
    rec_path = os.path.join(root, DROP_RECORD)
    if not os.path.lexists(rec_path):
        return "", 0
    try:
        record = json.loads(read_regular(rec_path, max_bytes=1 << 28, what="parity drop record"))
        scheme, files = record["scheme"], record["files"]
        if not isinstance(scheme, str) or not all(isinstance(f, str) for f in files):
            raise TypeError("fields")
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{rec_path}: damaged ({exc}); remove it and drop again") from exc
    manifest = load_manifest(os.path.join(root, MANIFEST_FILENAME))
    if manifest.parity is not None:  # killed before the manifest went out: drop again
        os.unlink(rec_path)
        return "", 0
    removed = _remove(root, files)
    os.unlink(rec_path)
    if durable:
        fsync_dir(os.path.join(root, WORK_DIR))
    return scheme, removed


def _remove(root: str, rels: list[str]) -> int:
    """Remove the listed parity files (regular files only), their lock files and folder."""
    removed = 0
    for rel in rels:
        if not rel.startswith(f"{PARITY_DIR}/") or ".." in rel.split("/"):
            continue  # a record shardio did not write
        try:
            removed += unlink_inside(root, rel)
        except StorageError as exc:
            if exc.errno != errno.ENOENT:
                raise
    locks = os.path.join(root, LOCK_DIR)
    if os.path.isdir(locks) and not os.path.islink(locks):
        for name in os.listdir(locks):
            if name.startswith(("group-", "check-")):  # locks, and scratch a kill left
                unlink_inside(root, f"{LOCK_DIR}/{name}")
        rmdir_inside(root, LOCK_DIR)
    # A killed add leaves the temp file it was writing beside the finals: the dataset's lock
    # is held, so no run can still be writing it.
    finals = {rel.split("/", 1)[1] for rel in rels if rel.startswith(f"{PARITY_DIR}/")}
    remove_temps_inside(root, PARITY_DIR, finals)
    rmdir_inside(root, PARITY_DIR)
    return removed
