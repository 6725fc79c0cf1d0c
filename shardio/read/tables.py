"""Open a dataset's tables for a reader: its manifest (checked), dataset id and index.

From a :class:`~shardio.read.handoff.Handoff` the manifest is the parent's; otherwise it is
read here. The index is always mapped (or read) and checked against the manifest.
"""

from __future__ import annotations

import os

from shardio.errors import FormatError
from shardio.format.identity import load_identified
from shardio.format.index import Index
from shardio.format.manifest import Manifest
from shardio.read.handoff import Handoff
from shardio.storage.fsdetect import FsInfo, describe_fs

__all__ = ["open_tables"]


def open_tables(
    root: str, handoff: Handoff | None, fs: FsInfo | None
) -> tuple[Manifest, str | None, Index]:
    """The manifest (checked), its dataset id and the index bound to it.

    Args:
        root: the dataset directory, or a staging area.
        handoff: the parent's manifest and dataset id, taken instead of reading them.
        fs: the filesystem of ``root`` (default: told here).

    Raises:
        FormatError: ``root`` is not a directory, or its manifest or index is bad.
    """
    if handoff is not None:
        # Read and checked by the parent (a stat and a read of the manifest per worker and
        # epoch saved); the index below is still mapped and checked against it here.
        manifest, dataset_id = handoff.manifest, handoff.dataset_id
    else:
        if not os.path.isdir(root):
            what = "is not a directory" if os.path.lexists(root) else "no such directory"
            raise FormatError(f"{root}: {what} (a dataset is a directory with a manifest)")
        # The dataset's id is of the very bytes parsed: the cache is checked against it.
        manifest, dataset_id = load_identified(root)
    # Bound to the manifest: header checked now, each shard's records on first use.
    # On a network filesystem the index is read, not only mapped: a page that a dead
    # server cannot serve would be SIGBUS in the training process (Index.open).
    index = Index.open(
        os.path.join(root, manifest.index.path),
        manifest=manifest,
        in_memory=(fs if fs is not None else describe_fs(root)).network,
    )
    return manifest, dataset_id, index
