"""Which shards a node stages, and in which order: the order training first needs them."""

from __future__ import annotations

from shardio.format.manifest import Manifest, ShardEntry
from shardio.staging.options import StageOptions

__all__ = ["choose_shards", "node_shard_order"]


def node_shard_order(manifest: Manifest, options: StageOptions) -> list[int]:
    """The shards this node's ranks read in the epoch, in the order they first need them.

    Uses the order spec and rank layout ShardDataset uses (:func:`shardio.order.rank_stream`),
    for this node's ranks only (global rank = node * ranks_per_node + local rank), with the
    nodes' names (``options.node_keys``) the deal is keyed by. Without a
    partition every node reads from nearly every shard; with ``partition=node`` (or
    ``rotating``) only its own share, about 1/N of the shards. With ``options.ahead``, the
    shards the next epochs add follow (a rotating order moves some shards every epoch).
    """
    # Imported here: stage_dataset runs this beside its first I/O, so that numpy's import
    # (a good part of a cold start) overlaps the copy of the index.
    import numpy as np

    from shardio.order import RankInfo, rank_stream

    sizes = np.array([s.num_samples for s in manifest.shards], dtype=np.int64)
    world = options.num_nodes * options.ranks_per_node
    first = options.node * options.ranks_per_node
    out: list[int] = []
    seen: set[int] = set()
    # The epoch's shards in order of first need, then those the next epochs (``ahead``) add.
    for epoch in range(options.epoch, options.epoch + options.ahead + 1):
        streams = [
            rank_stream(
                sizes,
                options.spec,
                epoch,
                RankInfo(
                    rank=first + i,
                    world_size=world,
                    ranks_per_node=options.ranks_per_node,
                    node_keys=options.node_keys,
                ),
            )
            for i in range(options.ranks_per_node)
        ]
        if not streams or len(streams[0]) == 0:
            continue
        # Time order: step 0 of every rank of the node, then step 1, ...
        samples = np.stack([stream.materialise() for stream in streams], axis=1).ravel()
        shards = np.searchsorted(np.cumsum(sizes), samples, side="right")
        _, first_seen = np.unique(shards, return_index=True)
        for i in np.sort(first_seen).tolist():
            shard = int(shards[i])
            if shard not in seen:
                seen.add(shard)
                out.append(shard)
    return out


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
