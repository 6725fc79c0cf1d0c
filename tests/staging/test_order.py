"""node_shard_order computes a node's positions by index arithmetic: the same result as the
per-rank rank_positions arrays it replaced (padding and drop_last included), in memory of
the node's share, and a huge --ranks-per-node is refused instead of allocated."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from shardio.cache import MAX_RANKS_PER_NODE, StageOptions, node_shard_order
from shardio.errors import UsageError
from shardio.format.manifest import IndexEntry, Manifest, ShardEntry
from shardio.runtime.order import ORDERS, epoch_order, rank_positions

DIGEST = "0" * 32


def _manifest(sizes: list[int]) -> Manifest:
    shards, first = [], 0
    for i, n in enumerate(sizes):
        shards.append(
            ShardEntry(
                path=f"shards/s{i:04d}.tar",
                size_bytes=1024,
                num_samples=n,
                first_sample=first,
                xxh3_128=DIGEST,
            )
        )
        first += n
    return Manifest(
        shard_format="tar",
        num_samples=first,
        num_members=first,
        data_bytes=0,
        index=IndexEntry(path="index.bin", size_bytes=0, xxh3_128=DIGEST),
        shards=tuple(shards),
        classes=None,
        label_layout="none",
    )


def _old_node_shard_order(manifest: Manifest, options: StageOptions) -> list[int]:
    """The previous algorithm: one padded full-epoch array per rank (rank_positions)."""
    sizes = np.array([s.num_samples for s in manifest.shards], dtype=np.int64)
    order = epoch_order(
        shard_sizes=sizes,
        seed=options.seed,
        epoch=options.epoch,
        order=options.order,
        window_shards=options.window_shards,
    )
    world = options.num_nodes * options.ranks_per_node
    first = options.node * options.ranks_per_node
    per_rank = [
        rank_positions(order, consumed=0, rank=r, world_size=world, drop_last=options.drop_last)
        for r in range(first, first + options.ranks_per_node)
    ]
    steps = np.stack(per_rank).T.ravel()
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    shards = shard_of[steps]
    _, first_seen = np.unique(shards, return_index=True)
    return [int(shards[i]) for i in sorted(first_seen)]


SIZES = {
    "even": [4] * 12,
    "uneven": [1, 7, 2, 0, 5, 3, 3, 9, 1, 0, 6],
    "one-sample": [1],
    "fewer-samples-than-ranks": [1, 2, 0, 1],
    "empty-shards-only": [0, 0],
}
LAYOUTS = [(1, 1), (1, 3), (2, 2), (3, 4), (4, 5), (2, 16)]  # (nodes, ranks per node)


@pytest.mark.parametrize("sizes", list(SIZES), ids=list(SIZES))
@pytest.mark.parametrize("drop_last", [False, True], ids=["padded", "drop-last"])
@pytest.mark.parametrize("order", ORDERS)
def test_same_as_the_rank_positions_algorithm(sizes, drop_last, order):
    manifest = _manifest(SIZES[sizes])
    for (nodes, ranks), seed, epoch in itertools.product(LAYOUTS, (0, 5), (0, 2)):
        for node in range(nodes):
            options = StageOptions(
                node=node,
                num_nodes=nodes,
                ranks_per_node=ranks,
                seed=seed,
                epoch=epoch,
                order=order,
                window_shards=3,
                drop_last=drop_last,
            )
            got = node_shard_order(manifest, options)
            assert got == _old_node_shard_order(manifest, options), options


def test_many_ranks_on_a_small_dataset():
    """The largest allowed layout works (the padding repeats the order many times)."""
    manifest = _manifest([3, 2, 4])
    options = StageOptions(node=1, num_nodes=2, ranks_per_node=MAX_RANKS_PER_NODE, seed=3)
    assert node_shard_order(manifest, options) == _old_node_shard_order(manifest, options)
    options = dataclasses.replace(options, drop_last=True)
    assert node_shard_order(manifest, options) == []


@pytest.mark.parametrize("ranks", [MAX_RANKS_PER_NODE + 1, 10**9])
def test_huge_ranks_per_node_is_refused(ranks):
    with pytest.raises(UsageError, match="ranks per node"):
        StageOptions(ranks_per_node=ranks)
