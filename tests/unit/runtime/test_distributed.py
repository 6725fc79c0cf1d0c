"""Real torch.distributed jobs (gloo, one process per rank) reading one epoch each, and rank
detection from SLURM's and torchrun's environment variables."""

from __future__ import annotations

import collections
import json
import math
import socket
import subprocess
import sys
import time

import pytest

from shardio.errors import UsageError
from shardio.order.ranks import RankInfo, detect_ranks
from shardio.runtime.dataset import ShardDataset

JOB_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_job(script, dataset, out_dir, world, env):
    """Start ``world`` ranks, wait for all; return each rank's JSON result."""
    out_dir.mkdir(parents=True)
    port = free_port()
    args = [sys.executable, str(script), str(dataset), str(out_dir)]
    procs = [
        subprocess.Popen(
            [*args, str(r), str(world), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for r, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {r} failed (rc {proc.returncode}):\n{out}"
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_job_splits_an_epoch_across_ranks(packed_tar, scripts_dir, child_env, tmp_path, world):
    script = scripts_dir / "dist_epoch.py"
    first = run_job(script, packed_tar.path, tmp_path / "run1", world, child_env())
    # A second job of the same size gives every rank the same keys in the same order: run
    # for one size only (a job of 3 ranks with 2 workers each takes half a minute on 2 cores).
    second = (
        run_job(script, packed_tar.path, tmp_path / "run2", world, child_env())
        if world == 2
        else None
    )

    per_rank = math.ceil(600 / world)
    padding = per_rank * world - 600
    for mode in ("map", "stream"):
        # The order the ranks share, as a single process computes it.
        order = ShardDataset(packed_tar.path, mode=mode, seed=17).epoch_order()
        order_keys = [packed_tar.keys[i] for i in order]
        for r, result in enumerate(first):
            assert result["detected"] == {
                "rank": r,
                "world_size": world,
                "source": "torch.distributed",
            }
            got = result[mode]
            assert len(got["keys"]) == per_rank, (mode, r)
            assert got["batches"] == got["len_loader"] == math.ceil(per_rank / 16)
            assert got["total"] == per_rank * world
            assert got["min"] == got["max"] == per_rank
            # Rank r takes the positions r, r + W, ... of the epoch order (padded at the end).
            padded = order_keys + order_keys[:padding]
            assert got["keys"] == padded[r::world]
        union = [k for result in first for k in result[mode]["keys"]]
        assert set(union) == set(packed_tar.keys)
        repeated = collections.Counter(union) - collections.Counter(packed_tar.keys)
        assert repeated == collections.Counter(order_keys[:padding])
        if second is not None:  # same seed, same job size: the same keys, the same order
            assert [r[mode]["keys"] for r in second] == [r[mode]["keys"] for r in first]
        # Each rank's metrics (2 workers each, sent with the batches) add up to the epoch.
        figures = [r[mode]["metrics"] for r in first]
        assert [m["rank"] for m in figures] == list(range(world))
        assert all(m["world_size"] == world for m in figures)
        assert [m["samples"] for m in figures] == [per_rank] * world
        assert [m["samples_read"] for m in figures] == [per_rank] * world
        payload = sum(len(packed_tar.payload[k]) for k in union)
        assert sum(m["bytes_read"] for m in figures) == payload
        assert sum(m["read_latency"]["source"]["count"] for m in figures) == len(union)
        assert sum(m["counters"]["members"] for m in figures) == len(union)


# -------------------------------------------------------------------- rank detection


def test_detects_slurm_ranks():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "42"}
    assert detect_ranks(environ=env) == RankInfo(rank=5, world_size=8, local_rank=1, source="slurm")


def test_detects_torchrun_ranks():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}
    assert detect_ranks(environ=env) == RankInfo(rank=3, world_size=4, local_rank=3, source="env")


def test_slurm_comes_before_rank_and_world_size_which_must_agree():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "1", "WORLD_SIZE": "2"}
    info = detect_ranks(environ=env)
    assert (info.rank, info.world_size, info.source) == (1, 2, "slurm")
    # torchrun inside a one-task-per-node srun: two layouts, refused rather than guessed
    with pytest.raises(UsageError, match="say rank 1 of 2 but RANK/WORLD_SIZE say rank 0 of 4"):
        detect_ranks(environ=env | {"RANK": "0", "WORLD_SIZE": "4"})


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SLURM_PROCID": "1"},  # half a layout is no layout
        {"RANK": "2"},
    ],
)
def test_single_rank_without_a_complete_layout(env):
    assert detect_ranks(environ=env) == RankInfo()


@pytest.mark.parametrize(
    "env", [{"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, {"RANK": "", "WORLD_SIZE": "2"}]
)
def test_a_malformed_layout_is_refused_not_read_as_one_rank(env):
    with pytest.raises(UsageError, match="is not a whole number"):
        detect_ranks(environ=env)


def test_impossible_rank_is_a_usage_error():
    with pytest.raises(UsageError, match="SLURM_PROCID=4 is not a rank of SLURM_NTASKS=4"):
        detect_ranks(environ={"SLURM_PROCID": "4", "SLURM_NTASKS": "4"})
    with pytest.raises(UsageError):
        detect_ranks(environ={"RANK": "0", "WORLD_SIZE": "0"})


@pytest.mark.parametrize("source", ["slurm", "env"])
def test_dataset_splits_by_environment_ranks(packed_tar, monkeypatch, source):
    """Without explicit ranks, a dataset reads the layout from the environment at use time."""
    names = ("SLURM_PROCID", "SLURM_NTASKS") if source == "slurm" else ("RANK", "WORLD_SIZE")
    keys = []
    for rank in range(3):
        monkeypatch.setenv(names[0], str(rank))
        monkeypatch.setenv(names[1], "3")
        ds = ShardDataset(packed_tar.path, mode="stream", seed=2)
        assert ds.ranks().source == source
        assert len(ds) == 200
        keys.append([s["__key__"] for s in ds])
    assert [len(k) for k in keys] == [200, 200, 200]
    packed_tar.assert_exactly_once([k for part in keys for k in part])
