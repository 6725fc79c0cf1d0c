"""Per-node selection: each node of a 4-node job stages exactly the shards its ranks read,
in the order they first need them, computed independently from ShardDataset itself.

The dataset has about 2 samples per shard, so the nodes need different shard sets.
"""

from __future__ import annotations

import os

import pytest

import shardio.staging.copy as cache_copy
from shardio.errors import UsageError
from shardio.order import OrderSpec
from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset
from shardio.staging import StageOptions, node_shard_order, stage_dataset

NODES = 4
RANKS_PER_NODE = 2
SEED = 7
STREAM = OrderSpec(order="shard-local", seed=SEED)  # ShardDataset(mode="stream")'s order


def _needed_by_node(src, node: int, *, seed: int = SEED, epoch: int = 0) -> list[str]:
    """Shards node ``node``'s ranks read, in the order first needed (step by step, rank by
    rank), straight from ShardDataset's stream order."""
    per_rank = []
    for r in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE):
        ds = ShardDataset(
            src.path,
            mode="stream",
            seed=seed,
            ranks=RankInfo(rank=r, world_size=NODES * RANKS_PER_NODE),
        )
        try:
            ds.set_epoch(epoch)
            shard_col = ds.packed.index.samples["shard"]
            per_rank.append([int(shard_col[i]) for i in ds.rank_indices()])
        finally:
            ds.close()
    assert len({len(p) for p in per_rank}) == 1, "ranks got different sample counts"
    order: list[str] = []
    for step in range(len(per_rank[0])):
        for shards in per_rank:
            rel = src.rels[shards[step]]
            if rel not in order:
                order.append(rel)
    return order


def test_each_node_stages_what_its_ranks_read(tiny_src, tmp_path, run_cli):
    union: set[str] = set()
    sets = []
    for node in range(NODES):
        dest = tmp_path / f"node{node}"
        env = {"SLURM_NODEID": str(node), "SLURM_NNODES": str(NODES), "SLURM_JOB_ID": "4242"}
        rc, out, err = run_cli(
            "stage", tiny_src.path, dest, "--ranks-per-node", str(RANKS_PER_NODE),
            "--seed", str(SEED), "--mode", "stream", "--no-progress", env=env,
        )  # fmt: skip
        assert rc == 0, err
        assert f"staged node {node}/{NODES}:" in out, out
        assert f"for order order=shard-local,seed={SEED},window=4" in out, out
        expected = _needed_by_node(tiny_src, node)
        assert f" {len(expected)} of {len(expected)} shards" in out, out
        tiny_src.assert_staged_ok(dest, set(expected))
        union |= set(expected)
        sets.append(set(expected))
    assert union == set(tiny_src.rels), "some shard is staged on no node"
    assert len({frozenset(s) for s in sets}) > 1, "the test data does not tell nodes apart"
    assert all(s != union for s in sets), "a node staged the whole dataset"


@pytest.mark.parametrize("node", range(NODES))
def test_node_shard_order_is_the_order_of_first_need(tiny_src, node):
    options = StageOptions(node=node, num_nodes=NODES, ranks_per_node=RANKS_PER_NODE, spec=STREAM)
    got = [tiny_src.rels[i] for i in node_shard_order(tiny_src.manifest, options)]
    assert got == _needed_by_node(tiny_src, node)


def test_later_epoch_and_other_seed(tiny_src):
    options = StageOptions(
        node=1, num_nodes=NODES, ranks_per_node=RANKS_PER_NODE, spec=STREAM.with_(seed=SEED + 1),
        epoch=3,
    )  # fmt: skip
    got = [tiny_src.rels[i] for i in node_shard_order(tiny_src.manifest, options)]
    assert got == _needed_by_node(tiny_src, 1, seed=SEED + 1, epoch=3)


def test_copies_happen_in_the_order_of_first_need(tiny_src, tmp_path, monkeypatch):
    """With one copy stream, the stager copies shards in node_shard_order."""
    copied: list[str] = []
    original = cache_copy.copy_verified

    def recording(src: str, dst: str, *args, **kwargs):
        if os.sep + "shards" + os.sep in dst:
            copied.append(os.path.relpath(dst, tmp_path / "stage").replace(os.sep, "/"))
        return original(src, dst, *args, **kwargs)

    monkeypatch.setattr(cache_copy, "copy_verified", recording)
    options = StageOptions(
        node=2, num_nodes=NODES, ranks_per_node=RANKS_PER_NODE, spec=STREAM, streams=1,
        durable=False,
    )  # fmt: skip
    stage_dataset(tiny_src.path, tmp_path / "stage", options)
    assert copied == _needed_by_node(tiny_src, 2)


def test_ranks_per_node_from_slurm(tiny_src, tmp_path, run_cli):
    """Without --ranks-per-node, SLURM_NTASKS_PER_NODE gives the rank layout."""
    dest = tmp_path / "node1"
    env = {"SLURM_NODEID": "1", "SLURM_NNODES": str(NODES), "SLURM_NTASKS_PER_NODE": "2"}
    rc, out, err = run_cli(
        "stage", tiny_src.path, dest, "--seed", str(SEED), "--mode", "stream", "--no-progress",
        env=env,
    )  # fmt: skip
    assert rc == 0, err
    assert f"staged node 1/{NODES}:" in out, out
    tiny_src.assert_staged_ok(dest, set(_needed_by_node(tiny_src, 1)))


def test_explicit_node_overrides_slurm(tiny_src, tmp_path, run_cli):
    dest = tmp_path / "node3"
    env = {"SLURM_NODEID": "0", "SLURM_NNODES": "1"}
    rc, out, err = run_cli(
        "stage", tiny_src.path, dest, "--node", f"3/{NODES}", "--ranks-per-node", "2",
        "--seed", str(SEED), "--order", "shard-local", "--no-progress", env=env,
    )  # fmt: skip
    assert rc == 0, err
    assert f"staged node 3/{NODES}:" in out, out
    tiny_src.assert_staged_ok(dest, set(_needed_by_node(tiny_src, 3)))


def test_unknown_order_is_refused_before_anything_is_written(tiny_src, tmp_path):
    with pytest.raises(UsageError, match="invalid order 'bogus'"):
        stage_dataset(
            tiny_src.path, tmp_path / "stage", StageOptions(spec=OrderSpec.parse("bogus"))
        )
    assert not (tmp_path / "stage").exists()
