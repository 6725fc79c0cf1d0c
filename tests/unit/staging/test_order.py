"""node_shard_order: the shards a node's ranks read, in the order they first need them, the
same as an independent slicing of the materialised epoch order (padding and drop_last
included); with a node partition, each node's own share only, disjoint, covering the
dataset; a huge --ranks-per-node is refused instead of allocated."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from shardio.errors import UsageError
from shardio.format.manifest import IndexEntry, Manifest, ShardEntry
from shardio.order import ORDERS, EpochOrder, OrderSpec, node_shares
from shardio.staging import MAX_RANKS_PER_NODE, StageOptions, node_shard_order

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
    """Independently: the whole epoch order as an array, padded by repeating it from its start
    (or cut) to a multiple of the world size, sliced per rank, steps interleaved."""
    sizes = np.array([s.num_samples for s in manifest.shards], dtype=np.int64)
    spec = options.spec
    order = EpochOrder(
        sizes, order=spec.order, seed=spec.seed, epoch=options.epoch,
        window_shards=spec.window_shards,
    ).materialise()  # fmt: skip
    world = options.num_nodes * options.ranks_per_node
    first = options.node * options.ranks_per_node
    n = len(order)
    total = n // world * world if spec.drop_last else -(-n // world) * world
    padded = order[:total] if spec.drop_last else np.resize(order, total) if n else order
    per_rank = [padded[r::world] for r in range(first, first + options.ranks_per_node)]
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
            spec = OrderSpec(order=order, seed=seed, window_shards=3, drop_last=drop_last)
            options = StageOptions(
                node=node, num_nodes=nodes, ranks_per_node=ranks, spec=spec, epoch=epoch
            )
            got = node_shard_order(manifest, options)
            assert got == _old_node_shard_order(manifest, options), options


def test_many_ranks_on_a_small_dataset():
    """The largest allowed layout works (the padding repeats the order many times)."""
    manifest = _manifest([3, 2, 4])
    options = StageOptions(
        node=1, num_nodes=2, ranks_per_node=MAX_RANKS_PER_NODE, spec=OrderSpec(seed=3)
    )
    assert node_shard_order(manifest, options) == _old_node_shard_order(manifest, options)
    options = dataclasses.replace(options, spec=options.spec.with_(drop_last=True))
    assert node_shard_order(manifest, options) == []


@pytest.mark.parametrize("ranks", [MAX_RANKS_PER_NODE + 1, 10**9])
def test_huge_ranks_per_node_is_refused(ranks):
    with pytest.raises(UsageError, match="ranks per node"):
        StageOptions(ranks_per_node=ranks)


@pytest.mark.parametrize("partition", ["node", "rotating"])
@pytest.mark.parametrize("nodes", [4, 16])
def test_a_partitioned_node_stages_its_share_only(partition, nodes):
    sizes = [5 + (i * 7) % 11 for i in range(160)]
    manifest = _manifest(sizes)
    spec = OrderSpec(order="shard-local", seed=9, partition=partition)
    for epoch in (0, 3):
        owner = node_shares(np.array(sizes), spec, epoch, nodes)
        shares = []
        for node in range(nodes):
            options = StageOptions(node=node, num_nodes=nodes, ranks_per_node=4, spec=spec,
                                   epoch=epoch)  # fmt: skip
            got = node_shard_order(manifest, options)
            assert sorted(got) == np.flatnonzero(owner == node).tolist()
            shares.append(set(got))
        assert set().union(*shares) == set(range(len(sizes)))
        assert sum(len(x) for x in shares) == len(sizes)  # disjoint
        share = len(sizes) / nodes
        assert all(share / 2 <= len(x) <= share * 2 for x in shares), [len(x) for x in shares]
