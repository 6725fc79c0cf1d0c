"""Shuffle quality of an order spec, before training: a pure function of (spec, seed, epoch).

:func:`order_quality` cuts the epoch's order into the batches one rank would be handed and
measures them with :class:`~shardio.order.quality_report.QualityAccumulator` (the figures are
described there): label entropy per batch against the dataset's, distinct shards per batch
and per window of batches, shard switches per batch, and the correlation of the delivered
order with storage order, beside what the order holds in memory.

Which rank: without a partition, the whole epoch's order (one rank; a rank of W takes every
W-th position of it, which keeps its figures). With ``partition=node``/``rotating``, the order
of each node (one rank per node), whose shards the partition dealt it.

Sampling: an epoch of at most ``max_batches`` batches (2,000 by default) is measured whole.
A longer one is measured on ``max_batches`` of its batches, taken as groups of
``window_batches`` consecutive batches (whole read windows) spread evenly from its first
batch to its last, across up to 16 evenly spaced nodes: orders are computed position by
position, so this costs the same for a billion samples as for a million (well under a
second), and ``QualityReport.sampled`` says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardio._check import require_int
from shardio.errors import UsageError
from shardio.order.orders import EpochOrder
from shardio.order.quality_report import (
    WINDOW_BATCHES,
    QualityAccumulator,
    QualityReport,
    dataset_label_entropy,
)
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec
from shardio.order.streams import node_orders, node_shares, rank_stream

__all__ = [
    "MAX_BATCH_SIZE",
    "QualityAccumulator",
    "QualityReport",
    "compare_orders",
    "dataset_label_entropy",
    "order_quality",
    "standard_orders",
]

MAX_BATCH_SIZE = 1 << 20  # a batch beyond this is no batch (and bounds the cost)
MAX_BATCHES = 2000
MAX_NODES = 1 << 20
_NODES_MEASURED = 16
_EPOCH_LIMIT = 1 << 63


class _PaddedOrder:
    """A node's order as its rank reads it, alone on the node: cut or padded by repeating
    from its start to the per-rank count every rank of the job reads."""

    def __init__(self, order: EpochOrder, per_rank: int) -> None:
        self.order, self.per_rank = order, per_rank

    def __len__(self) -> int:
        return self.per_rank

    def take(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return self.order.take(positions % len(self.order))


def _streams(
    sizes: np.ndarray[Any, Any], spec: OrderSpec, epoch: int, nodes: int
) -> tuple[list[Any], int]:
    """The orders measured (each one rank's) and the most memory one of them holds."""
    if not spec.partitioned:
        # One rank's stream takes positions 0, 1, ... of the epoch's order: the order itself.
        order = rank_stream(sizes, spec, epoch, RankInfo()).order
        return [order], order.memory_bytes
    owner = node_shares(sizes, spec, epoch, nodes)
    counts = np.bincount(owner, weights=sizes, minlength=nodes).astype(np.int64)
    per_rank = int(counts.min() if spec.drop_last else counts.max())
    chosen = np.unique(np.linspace(0, nodes - 1, min(nodes, _NODES_MEASURED)).round())
    orders = node_orders(sizes, spec, epoch, owner, chosen.astype(np.int64)).values()
    memory = max(order.memory_bytes for order in orders) + int(owner.nbytes)
    return [_PaddedOrder(order, per_rank) for order in orders], memory


def _sampled_batches(n_batches: int, budget: int, window: int) -> np.ndarray[Any, Any]:
    """The batches measured: all, or whole windows spread evenly over the epoch."""
    if n_batches <= budget:
        return np.arange(n_batches, dtype=np.int64)
    n_windows = -(-n_batches // window)
    starts = np.unique(np.linspace(0, n_windows - 1, max(1, budget // window)).round())
    batches = (starts.astype(np.int64)[:, None] * window + np.arange(window)).ravel()
    return batches[batches < n_batches]


def _check_arguments(batch_size: int, epoch: int, nodes: int, n: int) -> None:
    require_int(batch_size, "batch size", minimum=1, maximum=MAX_BATCH_SIZE)
    require_int(epoch, "epoch", minimum=0, maximum=_EPOCH_LIMIT - 1)
    require_int(nodes, "nodes", minimum=1, maximum=MAX_NODES)
    if n == 0:
        raise UsageError("the dataset has no samples: no order to measure")
    if batch_size > n:
        raise UsageError(f"batch size {batch_size:,} is larger than the dataset's {n:,} samples")


def order_quality(
    sizes: Any,
    labels: Any,
    spec: OrderSpec,
    *,
    epoch: int = 0,
    batch_size: int,
    nodes: int = 1,
    max_batches: int = MAX_BATCHES,
    window_batches: int = WINDOW_BATCHES,
    dataset_entropy: float | None = None,
) -> QualityReport:
    """The shuffle quality of ``spec``'s order in ``epoch`` (see the module docstring).

    Args:
        sizes: samples per shard (the manifest's).
        labels: one label per sample (negative: none), e.g. an index's label column; None
            for an unlabelled dataset.
        spec: the order.
        epoch: the epoch.
        batch_size: samples per batch.
        nodes: the nodes of a ``node``/``rotating`` partition (ignored without one).
        max_batches: batches measured at most (a longer epoch is sampled).
        window_batches: consecutive batches per read window.
        dataset_entropy: the labels' entropy if known (:func:`dataset_label_entropy`);
            computed from ``labels`` otherwise.

    Raises:
        UsageError: a value out of range, a batch larger than the dataset, or a partition
            with more nodes than shards.
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    n = int(sizes_arr.sum())
    _check_arguments(batch_size, epoch, nodes, n)
    require_int(max_batches, "max_batches", minimum=1)
    if labels is not None and len(labels) != n:
        raise UsageError(f"{len(labels):,} labels for a dataset of {n:,} samples")
    if dataset_entropy is None and labels is not None:
        dataset_entropy = dataset_label_entropy(labels)
    first = np.zeros(len(sizes_arr) + 1, dtype=np.int64)
    np.cumsum(sizes_arr, out=first[1:])
    streams, memory = _streams(sizes_arr, spec, epoch, nodes)
    acc = QualityAccumulator(dataset_entropy=dataset_entropy, window_batches=window_batches)
    budget = max(window_batches, max_batches // len(streams))
    total = 0
    for stream in streams:
        size = len(stream)
        n_batches = -(-size // batch_size)
        total += n_batches
        batches = _sampled_batches(n_batches, budget, window_batches)
        starts = batches * batch_size
        widths = np.minimum(starts + batch_size, size) - starts
        cuts = np.cumsum(widths)
        within = np.arange(int(cuts[-1]), dtype=np.int64) - np.repeat(cuts - widths, widths)
        samples = stream.take(np.repeat(starts, widths) + within)
        shards = np.searchsorted(first, samples, side="right") - 1
        if labels is None:
            found = np.full(len(samples), -1, dtype=np.int64)
        else:
            found = np.asarray(labels[samples], dtype=np.int64)
        # Another node's stream restarts at position 0, so it never "follows" the last one.
        acc.add_rows(
            epoch,
            np.split(samples, cuts[:-1]),
            np.split(found, cuts[:-1]),
            np.split(shards, cuts[:-1]),
            starts.tolist(),
        )
    return acc.end_epoch(
        epoch,
        batches=total,
        order=str(spec),
        memory_bytes=memory,
        nodes=nodes if spec.partitioned else None,
        epoch_samples=max(len(stream) for stream in streams),
    )


def standard_orders(*, seed: int = 0, window: int = 4) -> list[tuple[str, OrderSpec]]:
    """The orders a user picks from, by name: random, shard-local, sequential, and
    ``partition=node`` (random within each node's shards)."""
    base = OrderSpec(seed=seed, window_shards=window)
    return [
        ("random", base),
        (f"shard-local, window {window}", base.with_(order="shard-local")),
        ("sequential", base.with_(order="sequential")),
        ("partition=node", base.with_(partition="node")),
    ]


def compare_orders(
    sizes: Any,
    labels: Any,
    *,
    batch_size: int,
    epoch: int = 0,
    nodes: int = 4,
    seed: int = 0,
    window: int = 4,
) -> list[tuple[str, QualityReport]]:
    """:func:`order_quality` of each of :func:`standard_orders` (the partition for
    ``nodes`` nodes), the dataset's label entropy computed once."""
    entropy = dataset_label_entropy(labels) if labels is not None else None
    return [
        (
            name,
            order_quality(
                sizes,
                labels,
                spec,
                epoch=epoch,
                batch_size=batch_size,
                nodes=nodes,
                dataset_entropy=entropy,
            ),
        )
        for name, spec in standard_orders(seed=seed, window=window)
    ]
