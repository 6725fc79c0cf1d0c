"""A real ShardLoader warns once about a mis-sized job, and says nothing about a well-sized one.

The job is described by fake trees: ``SHARDIO_SYSFS`` (no GPU, or a fake one, and the cgroup
tree under its ``fs/cgroup``), ``SHARDIO_PROCFS`` (``self/cgroup``) and
``SLURM_CPUS_PER_TASK``; /dev/shm's free size by replacing the one function that asks it.
Each loader runs two epochs with new workers each (``persistent_workers=False``): the
warnings must come once per loader, not per epoch.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fakesysfs import fake_cgroup, fake_sysfs, plant

from shardio.order.ranks import RankInfo
from shardio.runtime import shmroom
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.sizing import warn_job_size

Packed = Any  # tests/unit/runtime/conftest.py's Packed
CPUS = os.sched_getaffinity(0)
GUARD = "shardio.runtime.sizing"
RING = "shardio.runtime.transport"


@pytest.fixture(autouse=True)
def _fake_job(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No GPU, no cgroup quota, no SLURM, one torch thread: a well-sized job, unless a test
    says otherwise."""
    (tmp_path / "sys").mkdir()
    (tmp_path / "proc").mkdir()
    monkeypatch.setenv("SHARDIO_SYSFS", str(tmp_path / "sys"))
    monkeypatch.setenv("SHARDIO_PROCFS", str(tmp_path / "proc"))
    for name in ("SLURM_CPUS_PER_TASK", "SHARDIO_PIN_WORKERS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def two_epochs(packed: Packed, caplog: pytest.LogCaptureFixture, workers: int) -> list[str]:
    """The WARNING lines of the guard and the ring over two epochs of one loader."""
    ds = ShardDataset(packed.path, ranks=RankInfo(local_rank=0))
    loader = ds.loader(batch_size=64, num_workers=workers, persistent_workers=False)
    keys: list[str] = []
    try:
        with caplog.at_level(logging.WARNING):
            for epoch in range(2):
                loader.set_epoch(epoch)
                keys += packed.keys_of(loader)
    finally:
        loader.close()
        ds.close()
    assert len(keys) == 2 * len(set(keys))  # every sample, each epoch: warnings change nothing
    return [
        r.getMessage()
        for r in caplog.records
        if r.name in (GUARD, RING) and r.levelno >= logging.WARNING
    ]


def test_more_workers_than_slurm_cpus_warns_once(
    packed_tar: Packed, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    [line] = two_epochs(packed_tar, caplog, workers=2)
    assert line.startswith(
        "2 DataLoader workers and the main process share 1 CPU (SLURM_CPUS_PER_TASK=1, affinity "
    )
    assert line.endswith("ask for --cpus-per-task=3 or use num_workers=0")


def test_a_cgroup_quota_of_one_cpu_warns_once(
    packed_tar: Packed, caplog: pytest.LogCaptureFixture, tmp_path: pathlib.Path
) -> None:
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", {"job/step/cpu.max": "100000 100000"})
    [line] = two_epochs(packed_tar, caplog, workers=2)
    assert "share 1 CPU (cgroup CPU quota 100000/100000 in " in line
    assert "raise the CPU limit to 3" in line


@pytest.mark.skipif(len(CPUS) < 2, reason="a well-sized loader with workers needs 2 CPUs")
def test_a_well_sized_loader_says_nothing(
    packed_tar: Packed, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(len(CPUS)))
    assert two_epochs(packed_tar, caplog, workers=len(CPUS) - 1) == []


def test_a_small_dev_shm_warns_once(
    packed_tar: Packed, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shmroom, "shm_free_bytes", lambda shm_dir="/dev/shm": 64 << 10)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    [line] = two_epochs(packed_tar, caplog, workers=1)
    assert line.startswith("ring transport: ")
    assert "/dev/shm has 64.0 KiB free: each batch takes a fresh segment instead" in line
    assert "enlarge /dev/shm (docker run --shm-size" in line


@pytest.mark.skipif(not {0, 1} <= CPUS, reason="the fake nodes need CPUs 0 and 1")
def test_a_gpu_on_another_numa_node_warns_once(
    packed_tar: Packed,
    caplog: pytest.LogCaptureFixture,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This process may use CPUs 0-1 (node 0); its GPU sits on node 1 (CPUs 2-3).
    fake_sysfs(tmp_path / "sys" / "box", {0: "0-1", 1: "2-3"}, [1])
    monkeypatch.setenv("SHARDIO_SYSFS", str(tmp_path / "sys" / "box"))
    [line] = two_epochs(packed_tar, caplog, workers=1)
    assert line == (
        "GPU 0 is on NUMA node 1 but this process may only use CPUs of node 0 (0-1): bind "
        "with scripts/slurm/bind.sh or srun --cpu-bind"
    )


def test_main_threads_and_a_fifo_quota(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"SHARDIO_SYSFS": str(tmp_path / "sys"), "SHARDIO_PROCFS": str(tmp_path / "proc")}
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", {"job/cpu.max": "200000 100000"})
    with caplog.at_level(logging.WARNING, logger=GUARD):
        lines = warn_job_size(num_workers=1, where=None, environ=env, main_threads=64)
    assert [r.getMessage() for r in caplog.records] == lines
    [line] = lines
    assert line.startswith("torch runs 64 threads in the main process, which may use 2 CPUs")
    plant(tmp_path / "sys", "fs/cgroup/job/cpu.max", "fifo")
    [note] = warn_job_size(num_workers=1, where=None, environ=env, main_threads=1)
    assert note.startswith("job sizing: cgroup CPU quota not read: cgroup file ")
    assert note.endswith("cpu.max is a FIFO (named pipe), not a regular file")
