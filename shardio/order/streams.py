"""What each rank reads in an epoch: its stream of samples, lazily, exact on resume.

Without a partition, rank r of W takes positions r, r + W, ... of the epoch's global order
(:class:`~shardio.order.orders.EpochOrder`), padded by repeating from the order's start (or
cut, with ``drop_last``) to a multiple of W. With a ``node``/``rotating`` partition, the ranks
of a node (block layout: node = rank // ranks_per_node) take interleaved positions of their
node's order, and every rank reads the same count: the largest node share's (padded by
repeating from the node's order), or the smallest's with ``drop_last``.

Progress is one number either way: ``consumed`` global positions, where position p is step
p // W of rank p % W, so after every rank delivered k samples ``consumed = k * W``. A job
resumed with another layout keeps what was consumed: without a partition the global order's
prefix is done; with one, each earlier layout's consumed samples (``history``) are taken out
and the rest is shared out again under the new layout (this costs one pass over the
dataset's positions at resume).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shardio.errors import UsageError
from shardio.order.orders import EpochOrder
from shardio.order.partition import owners
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec

__all__ = [
    "EarlierLayout",
    "RankStream",
    "node_orders",
    "node_shares",
    "rank_stream",
    "remaining_samples",
    "samples_per_rank",
]

_NODE_SALT = 0x1000

# An earlier layout of the epoch: (world size, ranks per node, global positions consumed
# under it, its node names or None for numbers); a 3-tuple is one of numbered nodes.
EarlierLayout = tuple[int, int, int, tuple[str, ...] | None]


def _layouts(history: Sequence[Sequence[Any]] | None) -> list[EarlierLayout]:
    out: list[EarlierLayout] = []
    for entry in history or []:
        keys = entry[3] if len(entry) > 3 else None
        out.append((entry[0], entry[1], entry[2], None if keys is None else tuple(keys)))
    return out


class _ArrayOrder:
    """An explicit order (what is left of a node's order after an elastic resume)."""

    def __init__(self, samples: np.ndarray[Any, Any]) -> None:
        self.samples = samples
        self.size = len(samples)

    def take(self, positions: Any) -> Any:
        return self.samples[np.asarray(positions, dtype=np.int64)]

    @property
    def memory_bytes(self) -> int:
        """Bytes it holds: 8 a sample."""
        return int(self.samples.nbytes)


class RankStream:
    """The samples one rank reads in the rest of an epoch, computed chunk by chunk.

    Args:
        order: the order the rank's group shares (the global one, or its node's).
        index: the rank's place in the group; ``group``: ranks in the group.
        first: the group's first step for this rank (steps already consumed).
        steps: the rank's steps in the whole epoch.
        base: the group's positions consumed before the interleaving starts (the global
            order's consumed prefix, without a partition).
    """

    def __init__(
        self, order: Any, *, index: int, group: int, first: int, steps: int, base: int = 0
    ) -> None:
        self.order = order
        self.index = index
        self.group = group
        self.first = min(first, steps)
        self.steps = steps
        self.base = base

    def __len__(self) -> int:
        return self.steps - self.first

    @property
    def memory_bytes(self) -> int:
        """Bytes the stream's order holds (O(shards) for a lazy order)."""
        return int(self.order.memory_bytes)

    def take(self, start: int, stop: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Samples ``start`` to ``stop`` of the rest of the rank's epoch."""
        stop = min(stop, len(self))
        if start >= stop:
            return np.empty(0, dtype=np.int64)
        k = np.arange(self.first + start, self.first + stop, dtype=np.int64)
        positions = self.base + self.index + k * self.group
        n = self.order.size
        beyond = positions >= n
        if beyond.any():  # padding: repeat the order from its start
            positions[beyond] = (positions[beyond] - n) % n
        samples: np.ndarray[Any, np.dtype[np.int64]] = self.order.take(positions)
        return samples

    def materialise(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The whole rest as one array (memory: 8 bytes per sample)."""
        return self.take(0, len(self))

    def head(self, n: int) -> RankStream:
        """The first ``n`` samples of the rest, still lazy."""
        return RankStream(
            self.order,
            index=self.index,
            group=self.group,
            first=self.first,
            steps=min(self.steps, self.first + max(0, n)),
            base=self.base,
        )

    def __getitem__(self, key: int | slice) -> Any:
        """Sample ``key`` (an int), or samples ``key`` (a slice of step 1) as an array: the
        slices a loader cuts batches with."""
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self.materialise()[key]
            return self.take(start, stop)
        n = len(self)
        index = int(key)
        if not -n <= index < n:
            raise IndexError(f"position {index} out of range for {n}")
        return int(self.take(index % n, index % n + 1)[0])


def _steps(consumed: int, world: int, rank: int) -> int:
    """Steps rank ``rank`` took when ``consumed`` global positions were delivered."""
    return consumed // world + (1 if rank < consumed % world else 0)


def node_shares(
    sizes: Any,
    spec: OrderSpec,
    epoch: int,
    num_nodes: int,
    keys: Sequence[str] | None = None,
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The node (a number, an index into ``keys``) owning each shard in ``epoch`` under
    ``spec``'s partition; ``keys``: the nodes' names (:attr:`RankInfo.node_keys`), None for
    numbered nodes."""
    rotate = spec.rotate if spec.partition == "rotating" else None
    return owners(sizes, num_nodes=num_nodes, seed=spec.seed, epoch=epoch, rotate=rotate, keys=keys)


def node_orders(
    sizes: Any, spec: OrderSpec, epoch: int, owner: Any, nodes: Any
) -> dict[int, EpochOrder]:
    """The order of each of ``nodes`` in ``epoch``, given the shards' ``owner``
    (:func:`node_shares`): what a node's ranks take interleaved positions of."""
    sizes_arr, owner_arr = np.asarray(sizes, dtype=np.int64), np.asarray(owner)
    return {
        int(node): _node_order(sizes_arr, spec, epoch, np.flatnonzero(owner_arr == node), int(node))
        for node in nodes
    }


def _node_order(
    sizes: Any, spec: OrderSpec, epoch: int, shards: np.ndarray[Any, Any], node: int
) -> EpochOrder:
    return EpochOrder(
        sizes,
        shards=shards,
        order=spec.order,
        seed=spec.seed,
        epoch=epoch,
        window_shards=spec.window_shards,
        salt=_NODE_SALT + node,
    )


def _per_rank(node_sizes: list[int], ranks_per_node: int, drop_last: bool) -> int:
    if drop_last:
        return min(m // ranks_per_node for m in node_sizes)
    return max(-(-m // ranks_per_node) for m in node_sizes)


def _partitioned(
    sizes: np.ndarray[Any, Any],
    spec: OrderSpec,
    epoch: int,
    layout: RankInfo,
    remaining: np.ndarray[Any, Any] | None,
    *,
    only: int | None = None,
) -> tuple[dict[int, Any], int]:
    """Nodes' orders (filtered to ``remaining`` samples; with ``only``, that node's alone)
    and the per-rank count."""
    owner = node_shares(sizes, spec, epoch, layout.num_nodes, layout.node_keys)
    nodes = range(layout.num_nodes) if only is None or remaining is not None else [only]
    orders: dict[int, Any] = {}
    for node in nodes:
        order: Any = _node_order(sizes, spec, epoch, np.flatnonzero(owner == node), node)
        if remaining is not None:
            samples = order.materialise()
            order = _ArrayOrder(samples[remaining[samples]])
        orders[node] = order
    if remaining is None:
        counts = np.bincount(owner, weights=sizes, minlength=layout.num_nodes).astype(np.int64)
    else:
        counts = np.array([orders[node].size for node in range(layout.num_nodes)])
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        raise UsageError(f"node {int(empty[0])} has no samples left to read in epoch {epoch}")
    per_rank = _per_rank(counts.tolist(), layout.node_size, spec.drop_last)
    return orders, per_rank


def _remaining(
    sizes: np.ndarray[Any, Any],
    spec: OrderSpec,
    epoch: int,
    history: list[EarlierLayout],
) -> np.ndarray[Any, Any] | None:
    """Samples not consumed under the earlier layouts of this epoch (None: all)."""
    if not history:
        return None
    n = int(sizes.sum())
    left = np.ones(n, dtype=bool)
    for world, ranks_per_node, consumed, keys in history:
        layout = RankInfo(rank=0, world_size=world, ranks_per_node=ranks_per_node, node_keys=keys)
        orders, per_rank = _partitioned(sizes, spec, epoch, layout, left)
        taken = []
        for rank in range(world):
            here = layout.with_rank(rank)
            done = min(_steps(consumed, world, rank), per_rank)
            stream = RankStream(
                orders[here.node], index=here.rank_in_node, group=ranks_per_node, first=0,
                steps=per_rank,
            )  # fmt: skip
            taken.append(stream.take(0, done))
        left[np.concatenate(taken)] = False
    return left


def remaining_samples(
    sizes: Any, spec: OrderSpec, epoch: int, history: Sequence[Sequence[Any]]
) -> np.ndarray[Any, Any] | None:
    """A mask of the samples left after the earlier layouts of a partitioned epoch
    (``history``: the cursor's entries, 3 or 4 fields); None: all are left (no history)."""
    return _remaining(np.asarray(sizes, dtype=np.int64), spec, epoch, _layouts(history))


def rank_stream(
    sizes: Any,
    spec: OrderSpec,
    epoch: int,
    layout: RankInfo,
    *,
    consumed: int = 0,
    history: Sequence[Sequence[Any]] | None = None,
) -> RankStream:
    """The rest of ``layout.rank``'s epoch after ``consumed`` global positions.

    Args:
        sizes: samples per shard.
        spec: the order.
        epoch: the epoch.
        layout: this rank's place (``ranks_per_node`` matters only with a partition).
        consumed: global positions delivered under this layout (see the module docstring).
        history: (world size, ranks per node, consumed, node names or None) of each
            earlier layout of this epoch (an elastic resume of a partitioned order; a 3-tuple
            has numbered nodes); ignored without a partition, whose ``consumed`` counts every
            layout's positions.
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    world = layout.world_size
    if not spec.partitioned:
        order = EpochOrder(
            sizes_arr,
            order=spec.order,
            seed=spec.seed,
            epoch=epoch,
            window_shards=spec.window_shards,
        )
        rest = order.size - min(consumed, order.size)
        steps = rest // world if spec.drop_last else -(-rest // world)
        base = min(consumed, order.size)
        return RankStream(order, index=layout.rank, group=world, first=0, steps=steps, base=base)
    remaining = _remaining(sizes_arr, spec, epoch, _layouts(history))
    orders, per_rank = _partitioned(sizes_arr, spec, epoch, layout, remaining, only=layout.node)
    return RankStream(
        orders[layout.node],
        index=layout.rank_in_node,
        group=layout.node_size,
        first=_steps(consumed, world, layout.rank),
        steps=per_rank,
    )


def samples_per_rank(
    sizes: Any,
    spec: OrderSpec,
    epoch: int,
    layout: RankInfo,
    history: Sequence[Sequence[Any]] | None = None,
) -> int:
    """Samples every rank reads in the whole epoch (under the current layout)."""
    stream = rank_stream(sizes, spec, epoch, layout, consumed=0, history=history)
    return stream.steps
