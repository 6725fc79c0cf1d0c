"""DALI's ``.idx`` of a tar shard, derived from the dataset's index instead of read from disk.

The ``.idx`` beside each tar shard (what ``fn.readers.webdataset`` needs) is a function of
the shard: one line per sample, ``ext offset size name`` for each member. shardio's index
holds the same facts for every shard, checked against the manifest, so a lost or damaged
``.idx`` is written again from it (``verify --repair``, ``stage``) byte for byte as ``pack``
wrote it, with no source to copy it from.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from shardio.format.index import Index
from shardio.format.manifest import Manifest, ShardEntry
from shardio.writers.tar import dali_index_text

__all__ = ["dali_index_of", "dali_index_reader"]


def dali_index_of(index: Index, manifest: Manifest, shard: int) -> bytes:
    """The DALI ``.idx`` text of tar shard ``shard`` (as ``pack`` writes it).

    ``index`` must be bound to ``manifest`` (``Index.open(path, manifest=...)``); the shard's
    records are checked against the manifest first.

    Raises:
        FormatError: the shard's index records are damaged.
    """
    entry = manifest.shards[shard]
    index.check_shard(shard)
    samples = []
    members = index.members
    for sample in range(entry.first_sample, entry.first_sample + entry.num_samples):
        span = index.sample_member_range(sample)
        if not span:
            continue  # a sample with no member has no line (as the tar writer records)
        placed = [
            (index.exts[int(m["ext_id"])], int(m["offset"]), int(m["size"]))
            for m in members[span.start : span.stop]
        ]
        samples.append((index.key(sample), placed))
    return dali_index_text(samples)


def dali_index_reader(root: str, manifest: Manifest) -> Callable[[ShardEntry], bytes]:
    """``text(entry)``: the DALI ``.idx`` of a shard of the dataset whose index is at
    ``root`` (opened on first use, bound to ``manifest``, kept open).

    Raises (from the call):
        FormatError: the index cannot be opened, or the shard's records are damaged.
    """
    numbers = {e.path: i for i, e in enumerate(manifest.shards)}
    opened: list[Index] = []
    lock = threading.Lock()  # staging calls it from its copy threads

    def text(entry: ShardEntry) -> bytes:
        with lock:
            if not opened:
                path = os.path.join(root, manifest.index.path)
                opened.append(Index.open(path, manifest=manifest, in_memory=True))
        return dali_index_of(opened[0], manifest, numbers[entry.path])

    return text
