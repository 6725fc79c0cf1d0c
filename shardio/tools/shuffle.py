"""The shuffle quality of a packed dataset's orders, before training (``shardio inspect
--order``/``--orders``, ``shardio bench``).

The figures are a pure function of the order spec, the epoch and the dataset's shard sizes
and labels (:mod:`shardio.order.quality`); the labels are read from the index (a few pages of
it for a large dataset: the figures sample the epoch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from shardio.errors import UsageError
from shardio.order.quality import QualityReport, compare_orders, order_quality
from shardio.order.spec import OrderSpec
from shardio.read.reader import ShardReader

__all__ = ["DEFAULT_NODES", "OrderComparison", "inspect_order", "inspect_orders"]

DEFAULT_NODES = 4  # the nodes of a partitioned order, unless told


@dataclass(frozen=True)
class OrderComparison:
    """The standard orders side by side on one dataset.

    Attributes:
        path: the dataset.
        samples, shards, classes: its size (classes 0 without labels).
        reports: (name, report) per order, as :func:`shardio.order.quality.standard_orders`.
        nodes: the nodes of the partitioned order.
    """

    path: str
    samples: int
    shards: int
    classes: int
    reports: tuple[tuple[str, QualityReport], ...]
    nodes: int

    def to_json(self) -> dict[str, Any]:
        """The ``inspect --orders --json`` document."""
        return {
            "path": self.path,
            "samples": self.samples,
            "shards": self.shards,
            "classes": self.classes,
            "nodes": self.nodes,
            "orders": [{"name": name, **r.to_dict()} for name, r in self.reports],
        }


def _inputs(reader: ShardReader, nodes: int | None) -> tuple[list[int], Any, int]:
    """Samples per shard, the label column (None: no labels), and the nodes: as given, else
    4, or fewer on a dataset of fewer shards (a node needs one)."""
    man = reader.manifest
    sizes = [shard.num_samples for shard in man.shards]
    labels = reader.index.samples["label"] if man.classes is not None else None
    if nodes is None:
        nodes = max(1, min(DEFAULT_NODES, sum(1 for n in sizes if n > 0)))
    return sizes, labels, nodes


def inspect_order(
    path: str | os.PathLike[str],
    spec: OrderSpec,
    *,
    batch_size: int,
    epoch: int = 0,
    nodes: int | None = None,
) -> QualityReport:
    """The shuffle quality of ``spec``'s order of the dataset at ``path`` in ``epoch``.

    Args:
        nodes: the nodes of a partitioned spec (default 4, or the shards if fewer);
            refused for another spec.

    Raises:
        UsageError: a value out of range (batch size, epoch, nodes).
        FormatError, StorageError: the dataset cannot be read.
    """
    if nodes is not None and not spec.partitioned:
        raise UsageError(
            f"nodes apply to a partitioned order (partition=node or rotating), not {spec}"
        )
    with ShardReader(os.fspath(path)) as reader:
        sizes, labels, count = _inputs(reader, nodes)
        return order_quality(sizes, labels, spec, epoch=epoch, batch_size=batch_size, nodes=count)


def inspect_orders(
    path: str | os.PathLike[str],
    *,
    batch_size: int,
    epoch: int = 0,
    nodes: int | None = None,
) -> OrderComparison:
    """The standard orders of the dataset at ``path`` side by side (seed 0, windows of 4
    shards, the partition on ``nodes`` nodes: default 4, or the shards if fewer).

    Raises:
        UsageError: a value out of range, or fewer shards than nodes.
        FormatError, StorageError: the dataset cannot be read.
    """
    root = os.fspath(path)
    with ShardReader(root) as reader:
        sizes, labels, count = _inputs(reader, nodes)
        reports = compare_orders(sizes, labels, batch_size=batch_size, epoch=epoch, nodes=count)
        man = reader.manifest
        return OrderComparison(
            path=root,
            samples=man.num_samples,
            shards=len(man.shards),
            classes=len(man.classes) if man.classes is not None else 0,
            reports=tuple(reports),
            nodes=count,
        )
