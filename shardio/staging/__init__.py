"""The staging cache: stage shards from the parallel filesystem to node-local storage, verified.

``stage_dataset`` copies the shards a node will read, in the order training first needs
them, with parallel copy streams; each copy is published under its final name only when its
xxh3-128 matches the manifest, and a per-shard ``flock`` lets every rank of a node run it at
once. A rerun copies only what is missing or bad. Readers (``ShardDataset(src, stage=DEST)``)
trust a copy whose stamp still matches and drop one that fails its checksum.

Staging writes only into a new or empty directory, or into a staging area it made before
(recognised by its marker, never by a file name alone); it follows no symlink inside DEST,
opens every file so that a FIFO or device cannot block it, and ``clean_stage`` removes only
the regular files the staged manifest lists. Layout of the destination::

    DEST/.shardio-stage/area.json  the marker: {"format": "shardio-stage", "version": 1,
                                   "staged_from": SRC, "dataset_id": xxh3-128 of SRC's manifest}
    DEST/manifest.json             the source's manifest plus "staged_from" (the source path)
    DEST/index.bin                 copy of the source index
    DEST/shards/...                staged shards, same relative names as in the source
    DEST/.shardio-stage/locks/     one lock file per shard
    DEST/.shardio-stage/ok/        one stamp per verified shard (size, inode, ctime, xxh3)
    DEST/.shardio-stage/repairs.jsonl  the repair journal (moved out by ``clean_stage``)

An area holds one dataset: staging another one into it is refused (``force`` removes what
shardio staged there first), and so is reading it as another dataset's cache.

The default DEST (``default_stage_dir``) is ``<base>/shardio-<uid>-<job>/<name>-<hash>``
(hash: 8 hex digits of the SHA-256 of the source's real path), in a directory private to the
user and job.

Modules: ``area`` (recognise, create, clean an area; the default DEST), ``identity`` (which
dataset an area holds, and the checks), ``clean`` (remove what was staged, keep the
journal), ``protocol`` (the area's records: marker, stamps, lock paths), ``copy``
(per-shard locks, the verified copy), ``evict`` (capacity eviction), ``plan`` (which shards,
in which order), ``options`` (what to stage and how), ``stage`` (the run), ``ahead``
(:class:`EpochStager`: the next epoch's shards in the background). The names below load on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardio._lazy import lazy_face

if TYPE_CHECKING:
    from shardio.staging.ahead import EpochStager
    from shardio.staging.area import clean_stage, default_stage_dir
    from shardio.staging.clean import CleanResult
    from shardio.staging.options import MAX_NODES, MAX_RANKS_PER_NODE, MAX_STREAMS, StageOptions
    from shardio.staging.plan import node_shard_order
    from shardio.staging.stage import StageResult, stage_dataset

__all__ = [
    "MAX_NODES",
    "MAX_RANKS_PER_NODE",
    "MAX_STREAMS",
    "CleanResult",
    "EpochStager",
    "StageOptions",
    "StageResult",
    "clean_stage",
    "default_stage_dir",
    "node_shard_order",
    "stage_dataset",
]

_LAZY = {
    "EpochStager": "shardio.staging.ahead",
    "clean_stage": "shardio.staging.area",
    "default_stage_dir": "shardio.staging.area",
    "CleanResult": "shardio.staging.clean",
    "node_shard_order": "shardio.staging.plan",
    "MAX_NODES": "shardio.staging.options",
    "MAX_RANKS_PER_NODE": "shardio.staging.options",
    "MAX_STREAMS": "shardio.staging.options",
    "StageOptions": "shardio.staging.options",
    "StageResult": "shardio.staging.stage",
    "stage_dataset": "shardio.staging.stage",
}

__getattr__, __dir__ = lazy_face(__name__, _LAZY)
