"""partition=rotating: the owners of any epoch directly (no replay of earlier epochs), and
the properties the docs promise hold across epochs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shardio.errors import UsageError
from shardio.order import OrderSpec, RankInfo, node_shares, rank_stream

SPEC = OrderSpec(order="random", seed=11, partition="rotating", rotate=0.25)


def _sizes(n: int = 203, seed: int = 0) -> np.ndarray:
    sizes = np.full(n, 100, dtype=np.int64)
    sizes[-1] = 37  # the last shard of a pack is short
    sizes[np.random.default_rng(seed).integers(0, n, 9)] -= 3
    return sizes


def test_a_huge_epoch_returns_at_once() -> None:
    """Epoch 10**9 (a resumed long job) and 10**18: a replay of every epoch never ends."""
    code = textwrap.dedent(
        """
        import numpy as np
        from shardio.order import OrderSpec, RankInfo, node_shares, rank_stream
        spec = OrderSpec(seed=3, partition="rotating", rotate=0.25)
        sizes = np.full(500, 20)
        for epoch in (10**9, 10**18):
            owner = node_shares(sizes, spec, epoch, 8)
            stream = rank_stream(sizes, spec, epoch, RankInfo(rank=5, world_size=16,
                                                              ranks_per_node=2))
            print(epoch, sorted(np.bincount(owner, minlength=8).tolist()), len(stream))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out == [f"{e} {[62, 62, 62, 62, 63, 63, 63, 63]} 630" for e in (10**9, 10**18)]


@pytest.mark.parametrize(("nodes", "rotate"), [(2, 0.25), (4, 0.25), (8, 0.5), (5, 1.0)])
def test_every_epoch_hands_the_same_count_to_the_next_node(nodes: int, rotate: float) -> None:
    sizes = _sizes()
    spec = SPEC.with_(rotate=rotate)
    base = node_shares(sizes, spec.with_(partition="node"), 0, nodes)
    counts = np.bincount(base, minlength=nodes)
    step = min(int(rotate * len(sizes) / nodes), int(counts.min()))
    assert step >= 1
    assert np.array_equal(node_shares(sizes, spec, 0, nodes), base)  # epoch 0: the deal
    prev = base
    seen_nodes = [set() for _ in sizes]
    samples_per_node = []
    for epoch in [*range(1, 60), 10**9, 10**9 + 1]:
        owner = node_shares(sizes, spec, epoch, nodes)
        assert np.array_equal(owner, node_shares(sizes, spec, epoch, nodes))  # determinism
        assert np.array_equal(np.bincount(owner, minlength=nodes), counts)  # shard counts kept
        if epoch != 10**9:  # consecutive epochs
            moved = owner != prev
            # each node hands exactly `step` shards, each to the next node round the ring
            assert np.bincount(prev[moved], minlength=nodes).tolist() == [step] * nodes
            assert ((owner[moved] - prev[moved]) % nodes == 1).all()
        for shard, node in enumerate(owner.tolist()):
            seen_nodes[shard].add(node)
        samples_per_node.append(np.bincount(owner, weights=sizes, minlength=nodes))
        prev = owner
    # balanced: node shares never differ by more than two shards' samples
    spread = max(float(s.max() - s.min()) for s in samples_per_node)
    assert spread <= 2 * sizes.max(), spread
    # every shard visits every node in turn
    assert all(len(s) == nodes for s in seen_nodes)


def test_rotate_zero_and_one_node_keep_the_deal() -> None:
    sizes = _sizes()
    fixed = node_shares(sizes, SPEC.with_(partition="node"), 7, 4)
    assert np.array_equal(node_shares(sizes, SPEC.with_(rotate=0.0), 10**12, 4), fixed)
    assert (node_shares(sizes, SPEC, 10**12, 1) == 0).all()


def test_every_sample_is_read_once_per_epoch_at_a_huge_epoch() -> None:
    sizes = _sizes(64)
    nodes, per_node = 4, 2
    world = nodes * per_node
    spec = SPEC.with_(drop_last=False)
    read = np.concatenate(
        [
            rank_stream(sizes, spec, 10**9 + 3, RankInfo(rank=r, world_size=world,
                                                         ranks_per_node=per_node)).materialise()
            for r in range(world)
        ]
    )  # fmt: skip
    assert set(read.tolist()) == set(range(int(sizes.sum())))


def test_a_negative_epoch_is_refused() -> None:
    with pytest.raises(UsageError, match="epoch must be >= 0"):
        node_shares(_sizes(), SPEC, -1, 4)
