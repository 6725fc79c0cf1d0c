"""DALI pipelines over shardio shards, imported only when used (``import shardio.dali``).

``import shardio`` and the pack path never import DALI; this package imports ``nvidia.dali``
when a pipeline is built, and torch (through DALI's PyTorch plugin) when a loader is made.
Without DALI, ``import shardio.dali`` raises :class:`~shardio.errors.MissingExtraError` (an
``ImportError``) saying ``pip install nvidia-dali-cuda120``.

Two ways to read, chosen by ``verify``:

- ``verify=True`` (the default, and every HDF5 dataset): shardio's own reader feeds DALI's
  ``fn.external_source`` and checks every member's xxh3-64 before DALI sees a byte, in
  ShardDataset's order (map mode) for the same seed, epoch and ranks: DALI and ShardDataset
  deliver the same samples per rank and epoch. Reads run in one Python thread
  (``shardio-dali-read``), one batch ahead of DALI.
- ``verify=False`` on tar shards: DALI's ``fn.readers.webdataset`` reads the shards and
  their ``.idx`` files itself. Nothing checks those bytes against shardio's xxh3-64: a
  damaged shard reaches training unnoticed (or fails inside DALI's decoder). The pipeline
  warns with :class:`UnverifiedReadWarning`. The order is DALI's: shards in a seeded order,
  split into contiguous ranges per rank, shuffled within DALI's buffer of ``initial_fill``
  (1024) samples. HDF5 with ``verify=False`` still goes through shardio's reader, unchecked.

Example::

    import shardio.dali

    loader = shardio.dali.loader("/data/imagenet-packed", batch_size=256, decode="cpu",
                                 crop=224, num_threads=8)
    for epoch in range(90):
        loader.set_epoch(epoch)
        for batch in loader:
            images, labels = batch["data"], batch["label"]   # (256, 224, 224, 3) uint8, (256,)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.machinery import PathFinder
from typing import TYPE_CHECKING, Any

from shardio._check import require_path
from shardio._deprecated import renamed_option
from shardio.errors import MissingExtraError


def _require_dali() -> None:
    """Say at ``import shardio.dali`` which extra is missing (nothing of DALI, not even the
    ``nvidia`` namespace, is imported here: that happens when a pipeline is built)."""
    found = False
    if sys.modules.get("nvidia.dali", False) is not None:  # None: blocked on purpose
        try:
            parent = importlib.util.find_spec("nvidia")  # a top-level name: not imported
            where = None if parent is None else parent.submodule_search_locations
            found = bool(where) and PathFinder.find_spec("dali", list(where or ())) is not None
        except (ImportError, ValueError):
            found = False
    if not found:
        raise MissingExtraError("shardio.dali needs NVIDIA DALI", "dali")


_require_dali()

from shardio.dali._pipeline import (  # noqa: E402  (after the check above)
    DALIOptions,
    ShardPipeline,
    UnverifiedReadWarning,
)

if TYPE_CHECKING:
    from shardio.dali._loader import DALILoader
    from shardio.order.ranks import RankInfo
    from shardio.order.spec import OrderSpec

__all__ = [
    "DALILoader",
    "DALIOptions",
    "ShardPipeline",
    "UnverifiedReadWarning",
    "loader",
    "pipeline",
]


def pipeline(
    dataset_path: str | os.PathLike[str],
    *,
    batch_size: int,
    num_threads: int = 2,
    device_id: int | str | None = "auto",
    shard_id: int | None = None,
    num_shards: int | None = None,
    seed: int | None = None,
    shuffle: bool = True,
    order: str | OrderSpec | None = None,
    window_shards: int | None = None,
    drop_last: bool | None = None,
    decode: str | None = None,
    crop: int | None = None,
    verify: bool = True,
    stage: str | os.PathLike[str] | None = None,
    prefetch_queue_depth: int = 2,
    exts: Sequence[str] = ("jpeg",),
    ranks: RankInfo | None = None,
    cache: str | os.PathLike[str] | None = None,
) -> ShardPipeline:
    """Build a DALI pipeline yielding ``(data, label)`` batches of a packed dataset.

    Args:
        dataset_path: the dataset directory (holding manifest.json), or a staging area.
        batch_size: samples per batch.
        num_threads: DALI's CPU threads.
        device_id: the CUDA device. "auto" (default): this local rank's GPU (``LOCAL_RANK``
            or ``SLURM_LOCALID`` modulo the GPUs this process sees, read from sysfs without
            CUDA and narrowed by ``CUDA_VISIBLE_DEVICES``: index 0 when ``bind.sh`` gave the
            rank one GPU), or a CPU-only pipeline where it sees none (or no NVIDIA driver is
            loaded: no ``/sys/module/nvidia``); None: a CPU-only
            pipeline. Where batches land: the payload (or the images) on the CPU, or on
            this GPU with ``decode="mixed"``; the labels are always an int64 CPU tensor
            (from the verified source), moved with the batch by the caller.
        shard_id: this rank; with ``num_shards``. Both None: detected as ShardDataset does
            (torch.distributed, SLURM, RANK/WORLD_SIZE), so the split matches its world.
            Given, the nodes are still the environment's (``LOCAL_WORLD_SIZE`` or SLURM's
            tasks per node), so ``partition=node`` reads this node's share.
        num_shards: the number of ranks.
        seed: the order is a function of (seed, epoch), as ShardDataset's (default 0).
        shuffle: shuffle each epoch; False reads in dataset order.
        order: the order, as ShardDataset's: a name ("random", the default,
            "shard-local" or "sequential"), a spec string such as
            ``"order=random,partition=node"`` (each node reads the shards ``shardio stage
            --node`` staged for it) or an :class:`~shardio.order.OrderSpec`. The same
            samples per rank and epoch as ShardDataset with that spec (verified path; a
            partition needs ``verify=True``).
        window_shards: shards per shuffle window of "shard-local" (default 4).
        drop_last: each rank cuts its epoch to ``N // world`` samples instead of padding to
            ``ceil(N / world)`` by repeating samples from the epoch's start (ShardDataset's
            rule). Either way every rank delivers the same count; the last batch of a rank
            may be smaller. On DALI's reader (``verify=False``) the count is rounded to whole
            batches: up (``pad_last_batch``, repeating the shard's last sample; DALI's
            ``LastBatchPolicy.FILL``) or down with ``drop_last`` (``LastBatchPolicy.DROP``).
        decode: None (the payload bytes, uint8 1-D per sample), "cpu"
            (``fn.decoders.image(device="cpu")``) or "mixed" (nvJPEG on ``device_id``).
        crop: with ``decode``: a ResNet-style random resized crop to ``crop x crop``
            (``fn.random_resized_crop``), so batches are ``(B, crop, crop, 3)`` uint8.
        verify: True: shardio reads and checks every member's xxh3-64 before DALI sees it.
            False (tar): DALI's webdataset reader reads the shards itself, UNCHECKED;
            warns with :class:`UnverifiedReadWarning`.
        stage: a staging area (``shardio stage SRC DEST``) to read verified copies from.
        prefetch_queue_depth: batches DALI prepares ahead.
        exts: the payload member's extensions, first match per sample (e.g. ``("jpeg",
            "png")``).
        ranks: the whole rank and node layout, as ShardDataset's ``ranks`` (instead of
            ``shard_id``/``num_shards``).
        cache: the old name of ``stage`` (warns; goes in 0.3).

    Returns:
        A :class:`ShardPipeline` holding the built DALI pipeline (``.pipe``).

    Raises:
        UsageError: a bad argument (``decode="mixed"`` without ``device_id``, ``crop``
            without ``decode``, an extension no member has, ...).
        FormatError: the dataset's manifest or index is malformed.
    """
    stage = renamed_option("shardio.dali.pipeline", "cache", cache, "stage", stage)
    options = DALIOptions(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        shard_id=shard_id,
        num_shards=num_shards,
        seed=seed,
        shuffle=shuffle,
        order=order,
        window_shards=window_shards,
        drop_last=drop_last,
        decode=decode,
        crop=crop,
        verify=verify,
        stage=None if stage is None else require_path(stage, "stage"),
        prefetch_queue_depth=prefetch_queue_depth,
        exts=tuple(exts),
        rank_layout=ranks,
    )
    return ShardPipeline(dataset_path, options)


def loader(dataset_path: str | os.PathLike[str], **kwargs: Any) -> DALILoader:
    """A :class:`DALILoader` over ``pipeline(dataset_path, **kwargs)`` (imports torch)."""
    from shardio.dali._loader import DALILoader

    return DALILoader(pipeline(dataset_path, **kwargs))


def __getattr__(name: str) -> Any:
    if name == "DALILoader":  # torch comes with it: load on first use
        from shardio.dali._loader import DALILoader

        return DALILoader
    raise AttributeError(f"module 'shardio.dali' has no attribute {name!r}")
