"""Node-partitioned orders end to end: `shardio stage --node auto` on 4 and 16 simulated nodes
(SLURM variables) stages each node's share only, the ranks of a node then read only staged
copies, and resume (also elastic, to another number of nodes) is exact."""

from __future__ import annotations

import collections

import pytest
from resuming import assert_resumed_exactly, resumed, saved, take

from shardio.order import OrderSpec
from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset

SPEC_TEXT = "order=shard-local,seed=7,window=2,partition=node"
SPEC = OrderSpec.parse(SPEC_TEXT)
RANKS_PER_NODE = 2
BATCH = 2


def _stage_node(src, tmp_path, run_cli, node: int, nodes: int):
    dest = tmp_path / f"node{node}"
    env = {
        "SLURM_NODEID": str(node),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS_PER_NODE": str(RANKS_PER_NODE),
        "SLURM_JOB_ID": "777",
        "SHARDIO_ORDER": SPEC_TEXT,
    }
    rc, out, err = run_cli("stage", src.path, dest, "--no-progress", env=env)
    assert rc == 0, err
    assert f"for order {SPEC}" in out, out
    return dest


def _dataset(src, rank: int, world: int, stage=None, spec=SPEC) -> ShardDataset:
    ranks = RankInfo(rank=rank, world_size=world, ranks_per_node=RANKS_PER_NODE)
    return ShardDataset(src.path, stage=stage, ranks=ranks, order=spec)


def _keys(loader) -> list[str]:
    return [k for batch in loader for k in batch["__key__"]]


@pytest.mark.parametrize("nodes", [4, 16])
def test_each_node_stages_its_share_and_its_ranks_read_only_staged_copies(
    tiny_src, tmp_path, run_cli, nodes
):
    world = nodes * RANKS_PER_NODE
    shares: list[set[str]] = []
    delivered: list[str] = []
    counts = set()
    for node in range(nodes):
        dest = _stage_node(tiny_src, tmp_path, run_cli, node, nodes)
        share = tiny_src.staged(dest)
        shares.append(share)
        for local in range(RANKS_PER_NODE):
            ds = _dataset(tiny_src, node * RANKS_PER_NODE + local, world, stage=dest)
            assert ds.order_mismatch == []
            loader = ds.loader(batch_size=BATCH)
            keys = _keys(loader)
            snap = loader.metrics()
            # Every read of the node's ranks came from its staged copies.
            assert snap.bytes_source == 0 and snap.counters["cache_misses"] == 0, snap.counters
            assert snap.bytes_staged > 0
            rels = {tiny_src.rels[tiny_src.shard_of_sample[tiny_src.keys.index(k)]] for k in keys}
            assert rels <= share
            counts.add(len(keys))
            delivered += keys
    assert len(counts) == 1, f"ranks read different counts: {counts}"
    # Shares are disjoint, cover the dataset, and are each about 1/N of it.
    assert set().union(*shares) == set(tiny_src.rels)
    assert sum(len(s) for s in shares) == tiny_src.num_shards
    mean = tiny_src.num_shards / nodes
    assert all(mean / 2 <= len(s) <= mean * 2 for s in shares), [len(s) for s in shares]
    # Every sample is read in the epoch; only padding repeats.
    seen = collections.Counter(delivered)
    assert set(seen) == set(tiny_src.keys)
    assert sum(seen.values()) == counts.pop() * world


def test_a_dataset_reading_in_another_order_says_so(tiny_src, tmp_path, run_cli, caplog):
    dest = _stage_node(tiny_src, tmp_path, run_cli, 0, 4)
    ds = _dataset(tiny_src, 0, 8, stage=dest, spec=SPEC.with_(partition="none"))
    assert ds.order_mismatch == ["partition 'none' != 'node'"]
    assert "was staged for order" in caplog.text and "partition" in caplog.text


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_exact(tiny_src, workers):
    world = 2 * RANKS_PER_NODE
    for rank in range(world):
        full = _keys(_dataset(tiny_src, rank, world).loader(batch_size=BATCH, num_workers=workers))
        loader = _dataset(tiny_src, rank, world).loader(batch_size=BATCH, num_workers=workers)
        head = take(loader, 3)
        fresh = resumed(
            lambda r=rank: _dataset(tiny_src, r, world).loader(BATCH, num_workers=workers),
            saved(loader.state_dict()),
        )
        assert_resumed_exactly(head, _keys(fresh), full)


@pytest.mark.parametrize(("nodes_before", "nodes_after"), [(2, 3), (4, 2), (3, 5)])
def test_elastic_resume_reads_the_rest_of_the_epoch_once(tiny_src, nodes_before, nodes_after):
    """A job on N nodes stops mid-epoch and resumes on M: what was consumed is not read
    again, the rest is read under the new partition, and a second stop and resume (on N
    again) still honours both layouts."""
    steps = 2
    first: list[str] = []
    world = nodes_before * RANKS_PER_NODE
    state = None
    for rank in range(world):
        loader = _dataset(tiny_src, rank, world).loader(batch_size=1)
        first += take(loader, steps)
        state = saved(loader.state_dict())
    assert state is not None and state["consumed"] == steps * world

    second: list[str] = []
    world2 = nodes_after * RANKS_PER_NODE
    mid_state = None
    for rank in range(world2):
        loader = _dataset(tiny_src, rank, world2).loader(batch_size=1)
        loader.load_state_dict(state)
        second += take(loader, 1)
        mid_state = saved(loader.state_dict())
    assert mid_state is not None and len(mid_state["history"]) == 1

    third: list[str] = []
    for rank in range(world):
        loader = _dataset(tiny_src, rank, world).loader(batch_size=1)
        loader.load_state_dict(mid_state)
        third += _keys(loader)
    everything = collections.Counter(first + second + third)
    assert set(everything) == set(tiny_src.keys), "a sample was never read"
    # Repeats are padding only: of the last layout's remainder, fewer than one per rank.
    assert len(set(first) & set(second)) == 0
    assert len(set(first + second) & set(third)) == 0
    extra = sum(everything.values()) - len(tiny_src.keys)
    assert 0 <= extra < world * 2


@pytest.mark.parametrize("nodes", [4])
def test_rotating_order_staged_one_epoch_ahead_never_waits(tiny_src, tmp_path, nodes):
    """Three epochs of a rotating order with 2/N of the dataset per node: each epoch's
    shards are staged before it starts (its ranks read nothing from the source), shards that
    leave the node are evicted, and no shard needed in the epoch is ever evicted."""
    from shardio.order import node_shares
    from shardio.staging import EpochStager, StageOptions

    spec = SPEC.with_(partition="rotating", rotate=0.34)
    world = nodes * RANKS_PER_NODE
    capacity = tiny_src.manifest.total_bytes * 2 // nodes
    owners = [node_shares(
        [s.num_samples for s in tiny_src.manifest.shards], spec, e, nodes) for e in range(3)
    ]  # fmt: skip
    moved = sum(int((owners[e] != owners[e + 1]).sum()) for e in range(2))
    assert moved > 0, "the rotation moved nothing"
    for node in range(nodes):
        area = tmp_path / f"node{node}"
        options = StageOptions(node=node, num_nodes=nodes, ranks_per_node=RANKS_PER_NODE,
                               spec=spec, capacity_bytes=capacity, durable=False)  # fmt: skip
        with EpochStager(tiny_src.path, area, options) as stager:
            for epoch in range(3):
                ran_now = stager.advance(epoch)
                assert (ran_now is not None) == (epoch == 0), "an epoch was not staged ahead"
                mine = {tiny_src.rels[i] for i in (owners[epoch] == node).nonzero()[0]}
                assert mine <= tiny_src.staged(area), "a shard of the epoch is missing"
                for local in range(RANKS_PER_NODE):
                    ds = _dataset(tiny_src, node * RANKS_PER_NODE + local, world, stage=area,
                                  spec=spec)  # fmt: skip
                    ds.set_epoch(epoch)
                    loader = ds.loader(batch_size=BATCH)
                    keys = _keys(loader)
                    snap = loader.metrics()
                    ds.close()  # a reader's open copy is never evicted
                    assert keys and snap.bytes_source == 0, (epoch, snap.counters)
                    assert snap.counters["cache_misses"] == 0
            stager.close()
            staged = tiny_src.staged(area)
            assert tiny_src.size_of(staged) <= capacity
            # Shards that left the node and will not come back in epoch 3 are gone.
            later = {tiny_src.rels[i] for e in (2, 3) for i in
                     (node_shares([s.num_samples for s in tiny_src.manifest.shards], spec, e,
                                  nodes) == node).nonzero()[0]}  # fmt: skip
            assert staged <= later, sorted(staged - later)[:3]


def test_more_nodes_than_shards_is_refused_before_anything_is_written(tiny_src, tmp_path, run_cli):
    dest = tmp_path / "area"
    rc, _out, err = run_cli(
        "stage", tiny_src.path, dest, "--node", f"0/{tiny_src.num_shards + 1}",
        "--order", "partition=node", "--no-progress",
    )  # fmt: skip
    assert rc == 2 and "at least one shard per node" in err, err
    assert "Traceback" not in err
    assert not dest.exists()


def test_the_stager_takes_the_training_cursor(tiny_src, tmp_path):
    """StageOptions.from_cursor(ds.cursor): the node, the spec and the epoch of the rank that
    trains; its ranks then read only the copies staged, with no order mismatch."""
    from shardio.errors import UsageError
    from shardio.staging.options import StageOptions
    from shardio.staging.stage import stage_dataset

    nodes = 4
    world = nodes * RANKS_PER_NODE
    shares = []
    for node in range(nodes):
        dest = tmp_path / f"node{node}"
        first = _dataset(tiny_src, node * RANKS_PER_NODE, world)
        first.set_epoch(1)
        options = StageOptions.from_cursor(first.cursor, streams=2)
        assert (options.node, options.num_nodes, options.epoch) == (node, nodes, 1)
        assert options.spec == SPEC and options.ranks_per_node == RANKS_PER_NODE
        stage_dataset(tiny_src.path, dest, options)
        shares.append(tiny_src.staged(dest))
        for local in range(RANKS_PER_NODE):
            ds = _dataset(tiny_src, node * RANKS_PER_NODE + local, world, stage=dest)
            ds.set_epoch(1)
            assert ds.order_mismatch == []
            loader = ds.loader(batch_size=BATCH)
            _keys(loader)
            assert loader.metrics().bytes_source == 0
    assert set().union(*shares) == set(tiny_src.rels)
    with pytest.raises(UsageError, match="the cursor sets epoch"):
        StageOptions.from_cursor(first.cursor, epoch=3)
    with pytest.raises(UsageError, match="unknown stage option"):
        StageOptions.from_cursor(first.cursor, stream=3)
    with pytest.raises(UsageError, match="takes an EpochCursor"):
        StageOptions.from_cursor(SPEC)  # type: ignore[arg-type]
