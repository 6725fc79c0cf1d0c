"""Repair what ``verify`` finds: staged copies from their source, a dataset's shards from a copy.

Two kinds of destination:

- **A staging area** (``shardio stage``): every staged copy that is missing, damaged, stale
  or lacks its DALI index is staged again from the area's source (or ``source``), through
  :func:`shardio.staging.copy.stage_one`, under the shard's lock, so ranks reading or staging
  the same area meanwhile stay safe; a damaged copy is dropped only if it is still the file
  verify found bad (:func:`shardio.staging.protocol.drop_if_same`). A symlink or special file
  where a copy belongs is refused, never read, replaced or removed.
- **A packed dataset**, with ``source``: another copy of the same dataset (its manifest must
  list the same shards with the same xxh3-128). A damaged, truncated or missing shard (or
  index) is copied from it into a temp file beside the bad one, the copy's own bytes are
  hashed, and only a match is renamed over the bad file. Nothing is written through a
  symlink, and the dataset's lock (the one ``pack`` holds) is held throughout, so no pack
  runs meanwhile.

- **A packed dataset with parity** (``--parity K+M``), with or without ``source``: its damaged
  or missing data shards, parity files and cell tables are rebuilt from their group
  (:func:`shardio.parity.dataset.rebuild_files`: only the surviving files it needs are read,
  every cell checked against the group's cell table, a rebuilt file published only when its
  xxh3-128 matches), under the dataset's lock. A group with more damage than its parity can
  rebuild is reported with its files, never guessed at. With ``source`` too, a data shard is
  copied from the source first and rebuilt only when that copy is bad.

When no copy in a source is good, the ``rebuild`` hook is tried. What could not be repaired
is reported with why; the files touched are verified again at the end.

This module checks the request and takes the locks; the run is
:class:`~shardio.tools.repair_job.RepairJob`'s, its report :mod:`shardio.tools.repair_report`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from shardio._pool import check_workers
from shardio.errors import UsageError
from shardio.format.manifest import Manifest, load_manifest
from shardio.format.spec import MANIFEST_FILENAME
from shardio.metrics.progress import ProgressCallback
from shardio.staging.identity import check_area_holds, source_identity
from shardio.staging.protocol import read_area_marker
from shardio.storage.dirlock import lock_directory
from shardio.storage.opener import Opener
from shardio.tools.repair_job import RepairJob
from shardio.tools.repair_report import PARITY_SOURCE, Rebuild, RepairReport

__all__ = ["repair_dataset"]


# --------------------------------------------------------------------------- entry point


def repair_dataset(
    root: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | None = None,
    workers: int = 1,
    progress: ProgressCallback | None = None,
    rebuild: Rebuild | None = None,
    durable: bool | None = None,
    opener: Opener | None = None,
) -> RepairReport:
    """Verify ``root`` and repair what is wrong (see the module docstring).

    Args:
        root: a staging area, or a packed dataset.
        source: another copy of the same dataset to copy good shards from; required for a
            packed dataset without parity, default for a staging area: the source it was
            staged from.
        workers: processes verifying shards (1 to 4096).
        progress: called with snapshots while the first verify runs.
        rebuild: tried for a shard when no source copy of it is good (see :data:`Rebuild`).
        durable: fsync each replacement before renaming it (default: yes for a dataset; no
            for a staging area, a job-scoped cache, as ``shardio stage`` does).
        opener: what every byte checked or copied is read through (verify, the copies,
            the digests); default: POSIX calls.

    Raises:
        UsageError: no source for a dataset; a source that is not a copy of the same dataset;
            a staging area without its marker; the dataset is locked by a pack; ``workers``
            out of range.
        KeyboardInterrupt: Ctrl-C; what was being copied is removed (nothing half-written
            has a shard's name), so a second run picks up where this one stopped.
        FormatError: a manifest cannot be read, or the index is broken beyond repair.
    """
    start = time.monotonic()
    check_workers(workers, what="workers")  # before anything is written
    root_path = os.fspath(root)
    manifest = load_manifest(os.path.join(root_path, MANIFEST_FILENAME))
    if manifest.staged_from is not None:
        if read_area_marker(root_path) is None:
            raise UsageError(
                f"{root_path} has no staging-area marker (.shardio-stage/area.json): "
                "stage it again with shardio stage SRC DEST"
            )
        src = os.fspath(source) if source is not None else manifest.staged_from
        if source is not None:
            _check_same_dataset(root_path, manifest, src)
        else:  # the dataset at staged_from may have been re-packed since: never its bytes
            ident = source_identity(src)
            check_area_holds(root_path, ident, action="repair it from that source")
        job = RepairJob(root_path, manifest, src, rebuild, durable=bool(durable), opener=opener)
        found = job.run(workers, progress, staged=True)
    else:
        if source is None and manifest.parity is None:
            raise UsageError(
                f"{root_path} is a packed dataset, not a staging area: --repair needs "
                "--source SRC, another copy of the same dataset to copy good shards from "
                "(or re-pack it: shardio pack TREE DST --force)"
            )
        src = os.fspath(source) if source is not None else ""
        if src:
            _check_same_dataset(root_path, manifest, src)
        job = RepairJob(
            root_path, manifest, src, rebuild, durable=durable is not False, opener=opener
        )
        with _dataset_lock(root_path):
            job.manifest = load_manifest(os.path.join(root_path, MANIFEST_FILENAME))
            if src:
                _check_same_dataset(root_path, job.manifest, src)  # it may have changed
            elif job.manifest.parity is None:
                raise UsageError(f"{root_path} lost its parity meanwhile: give --source SRC")
            found = job.run(workers, progress, staged=False)
        src = src or PARITY_SOURCE
    return RepairReport(
        root=root_path,
        source=src,
        staging_area=manifest.staged_from is not None,
        found=found,
        after=job.after,
        repaired=tuple(job.repaired),
        unrepaired=tuple(job.unrepaired),
        seconds=time.monotonic() - start,
    )


@contextlib.contextmanager
def _dataset_lock(root: str) -> Iterator[None]:
    """Hold the dataset's exclusive lock (pack's), so no pack or merge runs meanwhile."""
    with lock_directory(
        root, shared=False, busy="another shardio process (a pack, merge or repair) is writing to"
    ):
        yield


def _check_same_dataset(root: str, manifest: Manifest, src: str) -> None:
    """Refuse a source that is not another copy of the dataset in ``root``.

    Raises:
        UsageError: the same directory, or a manifest listing other shards or checksums.
        FormatError: the source has no readable manifest.
    """
    try:
        same = os.path.samefile(root, src)
    except OSError:
        same = False
    if same:
        raise UsageError(f"--source {src} is {root} itself: give another copy of the dataset")
    other = load_manifest(os.path.join(src, MANIFEST_FILENAME))
    mine = [(s.path, s.size_bytes, s.xxh3_128) for s in manifest.shards]
    theirs = [(s.path, s.size_bytes, s.xxh3_128) for s in other.shards]
    if mine != theirs:
        if len(mine) != len(theirs):
            detail = f"{len(theirs)} shards, {root} has {len(mine)}"
        else:
            a, b = next((a, b) for a, b in zip(mine, theirs, strict=True) if a != b)
            detail = f"its {b[0]} has xxh3 {b[2]} ({b[1]} bytes), {root}'s {a[0]} has {a[2]}"
        raise UsageError(
            f"--source {src} is not a copy of the dataset in {root} ({detail}): "
            "give another copy of the same dataset"
        )
