"""partition=rotating at a huge epoch through the CLI and the dataset: `shardio stage
--epoch` stages what the node's ranks then read, and a mid-epoch state of the older rotation
is refused rather than resumed onto other node shares."""

from __future__ import annotations

import pytest

from shardio.errors import UsageError
from shardio.order import OrderSpec
from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset

SPEC_TEXT = "order=random,seed=5,partition=rotating,rotate=0.25"
SPEC = OrderSpec.parse(SPEC_TEXT)
NODES, RANKS_PER_NODE = 4, 2
EPOCH = 10**9 + 1


def _dataset(src, rank: int, **kw) -> ShardDataset:
    ranks = RankInfo(rank=rank, world_size=NODES * RANKS_PER_NODE, ranks_per_node=RANKS_PER_NODE)
    return ShardDataset(src.path, ranks=ranks, order=SPEC, **kw)


def test_stage_at_a_huge_epoch_stages_what_the_ranks_read(tiny_src, tmp_path, run_cli):
    node = 1
    dest = tmp_path / "area"
    env = {
        "SLURM_NODEID": str(node),
        "SLURM_NNODES": str(NODES),
        "SLURM_NTASKS_PER_NODE": str(RANKS_PER_NODE),
        "SHARDIO_ORDER": SPEC_TEXT,
    }
    rc, out, err = run_cli(
        "stage", tiny_src.path, dest, "--epoch", str(EPOCH), "--no-progress", env=env, timeout=120
    )
    assert rc == 0, err
    assert f"epoch {EPOCH}" in out
    staged = tiny_src.staged(dest)
    read: set[str] = set()
    for local in range(RANKS_PER_NODE):
        ds = _dataset(tiny_src, node * RANKS_PER_NODE + local, stage=dest)
        ds.set_epoch(EPOCH)
        loader = ds.loader(batch_size=2)
        keys = [k for batch in loader for k in batch["__key__"]]
        snap = loader.metrics()
        ds.close()
        assert ds.order_mismatch == []
        assert snap.bytes_source == 0, snap.counters  # every read was a staged copy
        read |= {tiny_src.rels[tiny_src.shard_of_sample[tiny_src.keys.index(k)]] for k in keys}
    assert read == staged


def _state(src, **changes):
    ds = _dataset(src, 0)
    ds.set_epoch(5)
    state = {**ds.state_dict(), "consumed": 4, **changes}
    ds.close()
    return state


def test_a_mid_epoch_state_of_the_older_rotation_is_refused(tiny_src):
    fresh = _dataset(tiny_src, 0)
    for version in (2, 3):  # older deals: every epoch's node shares differ, epoch 0's too
        for epoch in (5, 0):
            with pytest.raises(
                UsageError, match=rf"mid-epoch \(epoch {epoch}\) of a partition=rotating order"
            ):
                fresh.load_state_dict(_state(tiny_src, version=version, epoch=epoch))
    # This release's own state, and an older one at an epoch boundary, resume.
    fresh.load_state_dict(_state(tiny_src, version=2, consumed=0))
    assert fresh.epoch == 5
    fresh.load_state_dict(_state(tiny_src))
    assert fresh.epoch == 5
    fresh.close()
