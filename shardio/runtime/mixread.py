"""A mix's batch read: each source reads its share of a batch in one batch read, and the
shares are laid out in one buffer in the mix's order.

A batch of a :class:`~shardio.runtime.mixed.MixedDataset` draws its samples from several
sources. Each source reads (stages, verifies, recovers) the samples drawn from it with one
batch read (:meth:`ShardDataset.read_samples <shardio.runtime.dataset.ShardDataset.
read_samples>`), as a single dataset's batch is read; :func:`merge_batches` then lays the
shares out field by field, samples in the mix's order, in the one buffer that
``allocate`` gives (a ring slot in a loader's worker), so a batch of a mix crosses from the
workers as a single dataset's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from shardio.format.spec import LABEL_EXT
from shardio.runtime.batch import ByteColumn, shared_uint8
from shardio.runtime.reading import SampleReads, collate_samples
from shardio.runtime.wire import EVENTS_KEY, SOURCE_KEY

__all__ = [
    "Allocate",
    "allocate_local",
    "allocate_shared",
    "collate_mixed",
    "merge_batches",
    "read_shares",
    "reads_batches",
]

Allocate = Callable[[int], torch.Tensor]


def merge_batches(
    parts: Sequence[tuple[np.ndarray[Any, Any], dict[str, Any]]], n: int, allocate: Allocate
) -> dict[str, Any]:
    """One batch of ``n`` samples from ``parts``: (places, batch) pairs, where each batch is
    :func:`~shardio.runtime.batch.read_batch`'s form and ``places`` the merged batch's
    positions of its samples, in order. The payload is copied into ``allocate(nbytes)``
    (fields by name, samples in order within a field); labels are left to the caller."""
    keys: list[str] = [""] * n
    exts = sorted(
        {ext for _, batch in parts for ext, col in batch.items() if isinstance(col, ByteColumn)}
    )
    sizes = {ext: np.zeros(n, dtype=np.int64) for ext in exts}
    present = {ext: np.zeros(n, dtype=bool) for ext in exts}
    for places, batch in parts:
        for i, key in zip(places.tolist(), batch["__key__"], strict=True):
            keys[i] = key
        for ext in exts:
            col = batch.get(ext)
            if isinstance(col, ByteColumn):
                sizes[ext][places] = np.diff(col.offsets)
                present[ext][places] = col.present
    offsets: dict[str, np.ndarray[Any, Any]] = {}
    base = 0
    for ext in exts:
        offsets[ext] = np.concatenate([[base], base + np.cumsum(sizes[ext])]).astype(np.int64)
        base = int(offsets[ext][-1])
    buffer = allocate(base)
    out = buffer.numpy()
    for places, batch in parts:
        for ext in exts:
            col = batch.get(ext)
            if not isinstance(col, ByteColumn):
                continue
            src, starts, ends = col.buffer.numpy(), col.offsets[:-1], col.offsets[1:]
            to = offsets[ext][places]
            for lo, hi, at in zip(starts.tolist(), ends.tolist(), to.tolist(), strict=True):
                if hi > lo:
                    out[at : at + hi - lo] = src[lo:hi]
    merged: dict[str, Any] = {"__key__": keys}
    for ext in exts:
        merged[ext] = ByteColumn(buffer, offsets[ext], present[ext])
    return merged


def read_shares(
    sources: Sequence[Any],
    source: np.ndarray[Any, Any],
    index: np.ndarray[Any, Any],
    allocate: Allocate,
    relabel: Callable[[int, np.ndarray[Any, Any], list[str]], np.ndarray[Any, Any]],
) -> dict[str, Any]:
    """A mix's batch: sample ``index[i]`` of source ``source[i]`` at place ``i``.

    Each source reads its share with one batch read (``read_samples``); ``relabel(s,
    labels, keys)`` maps a share's labels into the mix's label map. The batch carries
    ``__source__`` (int64) and, from workers, the sources' recovery events as
    ``[(source, events), ...]``; labels when every source has them.
    """
    n = len(source)
    parts: list[tuple[np.ndarray[Any, Any], dict[str, Any]]] = []
    events: list[tuple[int, list[dict[str, Any]]]] = []
    labels: np.ndarray[Any, Any] | None = np.zeros(n, dtype=np.int64)
    for s in np.unique(source).tolist():
        places = np.flatnonzero(source == s)
        share = sources[s].read_samples(index[places].tolist())
        got = share.pop(EVENTS_KEY, None)
        if got:
            events.append((s, got))
        found = share.pop(LABEL_EXT, None)
        if found is None or labels is None:
            labels = None
        else:
            labels[places] = relabel(s, np.asarray(found, dtype=np.int64), share["__key__"])
        parts.append((places, share))
    batch = merge_batches(parts, n, allocate)
    if labels is not None:
        batch[LABEL_EXT] = torch.from_numpy(labels)
    batch[SOURCE_KEY] = torch.from_numpy(np.asarray(source, dtype=np.int64))
    if events:
        batch[EVENTS_KEY] = events
    return batch


def reads_batches(ds: Any) -> bool:
    """Whether source ``ds`` reads a share of a batch with one batch read: a ShardDataset
    read undecoded through its own reads (one that overrides ``__getitem__`` is read by it)."""
    reads = type(ds).__getitem__ is SampleReads.__getitem__
    return reads and ds.decode is None and ds.transform is None


def allocate_local(nbytes: int) -> torch.Tensor:
    """A batch buffer of this process (read here, in the training process)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def allocate_shared(nbytes: int) -> torch.Tensor:
    """A batch buffer in shared memory (read in a worker of a plain DataLoader)."""
    return shared_uint8(nbytes)


def collate_mixed(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Collate samples as ShardDataset does; samples of sources with other fields give a list
    per field (None where a sample lacks it), labels included."""
    fields = list(dict.fromkeys(f for s in samples for f in s))
    if all(len(s) == len(fields) for s in samples):
        return collate_samples(samples)
    batch: dict[str, Any] = {f: [s.get(f) for s in samples] for f in fields}
    if all(v is not None for v in batch.get(LABEL_EXT, [None])):
        batch[LABEL_EXT] = torch.tensor(batch[LABEL_EXT], dtype=torch.int64)
    return batch
