"""kill -9 a training loop mid-epoch, restart it from its checkpoints: no sample is lost or
repeated, including those that sat in the loader's prefetch queues when it died."""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from shardio.runtime.dataset import ShardDataset

SEED = 31  # train_loop.py's default
BATCH = 16
START_TIMEOUT_S = 60


def start(scripts_dir, env, dataset, ckpt_dir, *extra):
    """Start train_loop.py in its own process group (its DataLoader workers join it), with
    its output in a log file next to the checkpoints."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    log = ckpt_dir.parent / f"{ckpt_dir.name}.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(scripts_dir / "train_loop.py"),
                str(dataset),
                str(ckpt_dir),
                *extra,
            ],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log = log
    return proc


def output(proc):
    return proc.log.read_text(encoding="utf-8", errors="replace")[-4000:]


def rank_args(rank, world):
    return ["--rank", str(rank), "--world-size", str(world)]


def steps_in(ckpt_dir):
    return sorted(ckpt_dir.glob("step-*.json")) if ckpt_dir.is_dir() else []


def kill_when(procs, dirs, min_steps):
    """SIGKILL every job (the training process and its loader workers, as the scheduler does
    on preemption) once each directory holds ``min_steps`` checkpoints; check they were all
    still mid-epoch when killed."""
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while any(len(steps_in(d)) < min_steps for d in dirs):
            for proc in procs:
                if proc.poll() is not None:
                    pytest.fail(
                        f"a training process ended early (rc {proc.returncode}):\n{output(proc)}"
                    )
            assert time.monotonic() < deadline, "no checkpoints appeared"
            time.sleep(0.002)
        assert all(proc.poll() is None for proc in procs), "finished before the kill"
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert all(proc.returncode == -signal.SIGKILL for proc in procs)
    for d in dirs:
        assert not (d / "done.json").exists()


def finish(procs):
    """Wait for every process to end well."""
    try:
        for proc in procs:
            proc.wait(timeout=START_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc in procs:
        assert proc.returncode == 0, output(proc)


def read_steps(ckpt_dir, last=None):
    """The checkpoints of one run, in step order (up to step ``last``)."""
    records = [json.loads(p.read_text()) for p in steps_in(ckpt_dir)]
    assert [r["step"] for r in records] == list(range(len(records))), "steps are not contiguous"
    return [r for r in records if last is None or r["step"] <= last]


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_sigkill_mid_epoch_then_resume_delivers_every_sample_once(
    packed_tar, scripts_dir, child_env, tmp_path, mode
):
    ckpt = tmp_path / "ckpt"
    env = child_env()
    proc = start(scripts_dir, env, packed_tar.path, ckpt, "--mode", mode)
    kill_when([proc], [ckpt], min_steps=5)
    killed_at = len(steps_in(ckpt))
    total_steps = math.ceil(600 / BATCH)
    assert 5 <= killed_at < total_steps

    finish([start(scripts_dir, env, packed_tar.path, ckpt, "--mode", mode)])
    assert json.loads((ckpt / "done.json").read_text())["steps"] == total_steps
    records = read_steps(ckpt)
    assert len(records) == total_steps
    keys = [k for r in records for k in r["keys"]]
    packed_tar.assert_exactly_once(keys)
    # Exactly the uninterrupted epoch, in its order.
    uninterrupted = packed_tar.keys_of(
        ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH, 0)
    )
    assert keys == uninterrupted
    assert records[-1]["state"]["consumed"] == 600


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_sigkill_two_ranks_then_resume_with_three(
    packed_hdf5, scripts_dir, child_env, tmp_path, mode
):
    env = child_env()
    dataset = packed_hdf5.path
    slow = ["--mode", mode, "--sleep-s", "0.05"]

    # Phase 1: two ranks start together and are both killed mid-epoch.
    dirs1 = [tmp_path / "p1" / f"rank-{r}" for r in range(2)]
    barrier = ["--barrier", str(tmp_path / "p1" / "barrier")]
    procs = [
        start(scripts_dir, env, dataset, dirs1[r], *slow, *rank_args(r, 2), *barrier)
        for r in range(2)
    ]
    kill_when(procs, dirs1, min_steps=3)
    # A job resumes from the last step that every rank checkpointed.
    common = min(len(steps_in(d)) for d in dirs1) - 1
    assert common >= 2
    phase1 = [k for d in dirs1 for r in read_steps(d, last=common) for k in r["keys"]]
    resume_from = dirs1[0] / f"step-{common:06d}.json"
    consumed = (common + 1) * BATCH * 2
    assert json.loads(resume_from.read_text())["state"]["consumed"] == consumed

    # Phase 2: three ranks resume from rank 0's checkpoint and finish the epoch.
    dirs2 = [tmp_path / "p2" / f"rank-{r}" for r in range(3)]
    resume = ["--mode", mode, "--init-state", str(resume_from), "--sleep-s", "0"]
    finish(
        [start(scripts_dir, env, dataset, dirs2[r], *resume, *rank_args(r, 3)) for r in range(3)]
    )
    rest = 600 - consumed
    per_rank = math.ceil(rest / 3)
    phase2 = []
    for d in dirs2:
        keys = [k for r in read_steps(d) for k in r["keys"]]
        assert len(keys) == per_rank
        phase2 += keys
    assert len({len(read_steps(d)) for d in dirs2}) == 1, "ranks took different step counts"

    order = ShardDataset(dataset, mode=mode, seed=SEED).epoch_order()
    padding = [packed_hdf5.keys[i] for i in order[: per_rank * 3 - rest]]
    counts = collections.Counter(phase1 + phase2)
    assert set(counts) == set(packed_hdf5.keys)
    repeated = collections.Counter({k: n - 1 for k, n in counts.items() if n > 1})
    assert repeated == collections.Counter(padding)
