"""Which shards a node stages, and in which order: the order training first needs them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardio.format.manifest import Manifest, ShardEntry
from shardio.runtime.order import epoch_order

if TYPE_CHECKING:
    from shardio.cache.stage import StageOptions

__all__ = ["choose_shards", "node_shard_order"]


def node_shard_order(manifest: Manifest, options: StageOptions) -> list[int]:
    """The shards this node's ranks read in the epoch, in the order they first need them.

    Uses the same order and rank split as ShardDataset (epoch_order + rank_positions), with
    global rank = node * ranks_per_node + local rank, computed for this node's ranks only:
    memory is the node's share of the epoch, whatever the number of ranks.
    """
    # Imported here: stage_dataset runs this beside its first I/O, so that numpy's import
    # (a good part of a cold start) overlaps the copy of the index.
    import numpy as np

    sizes = np.array([s.num_samples for s in manifest.shards], dtype=np.int64)
    order = epoch_order(
        shard_sizes=sizes,
        seed=options.seed,
        epoch=options.epoch,
        order=options.order,
        window_shards=options.window_shards,
    )
    n = len(order)
    world = options.num_nodes * options.ranks_per_node
    first = options.node * options.ranks_per_node
    # rank_positions: rank r reads positions r, r + W, ... of the order padded (by repeating
    # it from its start) to a multiple of W, or cut to one with drop_last.
    steps = n // world if options.drop_last else -(-n // world)
    if steps == 0:
        return []
    ranks = np.arange(first, first + options.ranks_per_node, dtype=np.int64)
    # Time order: step 0 of every rank of the node, then step 1, ...
    positions = (np.arange(steps, dtype=np.int64)[:, None] * world + ranks[None, :]).ravel()
    samples = order[positions % n]  # a position past the end is padding: order[p - n], ...
    shards = np.searchsorted(np.cumsum(sizes), samples, side="right")
    _, first_seen = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in np.sort(first_seen)]


def choose_shards(
    manifest: Manifest, needed: list[int], capacity: int | None
) -> tuple[list[ShardEntry], list[str]]:
    """The shards to stage (the prefix of first need that fits) and those read from SRC."""
    chosen, from_source, budget = [], [], capacity
    for shard in needed:
        entry = manifest.shards[shard]
        if budget is not None and entry.size_bytes > budget:
            from_source.append(entry.path)
            budget = 0
            continue
        chosen.append(entry)
        if budget is not None:
            budget -= entry.size_bytes
    return chosen, from_source
