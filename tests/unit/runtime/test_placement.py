"""ShardLoader pins its DataLoader workers to the CPUs of the rank's GPU's NUMA node.

The topology comes from a fake sysfs tree named by ``SHARDIO_SYSFS`` (the hook the loader
reads, documented in shardio.runtime.placement). This machine has CPUs {0, 1}, so the fake
box has two NUMA nodes of one CPU each, node 0 = CPU 0 and node 1 = CPU 1, and one GPU on
each: local rank 0 must land on CPU 0, local rank 1 on CPU 1. The workers report their
affinity through a transform.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from typing import Any

import pytest
import torch
from fakesysfs import fake_sysfs
from torch.utils.data import get_worker_info

from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.placement import WorkerPinning, pin_workers_enabled, worker_pinning
from shardio.topology import format_cpulist, read_topology

Packed = Any  # tests/unit/runtime/conftest.py's Packed (a conftest is not imported by name)
MACHINE_CPUS = os.sched_getaffinity(0)
pytestmark = pytest.mark.skipif(
    not {0, 1} <= MACHINE_CPUS, reason="the fake nodes need CPUs 0 and 1 in this process's mask"
)


@pytest.fixture
def two_node_box(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """SHARDIO_SYSFS names a box with GPU 0 on node 0 (CPU 0) and GPU 1 on node 1 (CPU 1)."""
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0", 1: "1"}, [0, 1])
    monkeypatch.setenv("SHARDIO_SYSFS", sysfs)
    return sysfs


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SHARDIO_SYSFS", "SHARDIO_PIN_WORKERS", "CUDA_VISIBLE_DEVICES", "PLACEMENT_TAG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # what a worker inherits unless it is set


def report(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform: what the worker that read the sample runs with."""
    info = get_worker_info()
    return {
        "__key__": sample["__key__"],
        "worker": info.id if info is not None else -1,
        "cpus": format_cpulist(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "tag": os.environ.get("PLACEMENT_TAG"),
    }


def tag_worker(worker_id: int) -> None:
    """A user's worker_init_fn: leaves a mark the transform reports."""
    os.environ["PLACEMENT_TAG"] = f"init-{worker_id}"


def seen_by_workers(
    packed: Packed, *, local_rank: int, mode: str = "map", **loader_kwargs: Any
) -> dict[int, set[tuple[Any, ...]]]:
    """worker id -> the (cpus, threads, omp, tag) its samples report, over one epoch."""
    ds = ShardDataset(
        packed.path,
        mode=mode,
        transform=report,
        ranks=RankInfo(local_rank=local_rank),
    )
    seen: dict[int, set[tuple[Any, ...]]] = {}
    try:
        for batch in ds.loader(batch_size=50, num_workers=2, **loader_kwargs):
            for i, worker in enumerate(batch["worker"]):
                row = (batch["cpus"][i], batch["threads"][i], batch["omp"][i], batch["tag"][i])
                seen.setdefault(worker, set()).add(row)
    finally:
        ds.close()
    assert sorted(seen) == [0, 1], "both workers must have read samples"
    return seen


@pytest.mark.parametrize(("local_rank", "cpu"), [(0, "0"), (1, "1")])
def test_workers_are_pinned_to_their_ranks_numa_node(
    packed_tar: Packed, two_node_box: str, local_rank: int, cpu: str
) -> None:
    seen = seen_by_workers(packed_tar, local_rank=local_rank)
    assert seen == {0: {(cpu, 1, "1", None)}, 1: {(cpu, 1, "1", None)}}
    assert os.sched_getaffinity(0) == MACHINE_CPUS  # the training process is left alone


def test_stream_mode_workers_are_pinned_too(packed_tar: Packed, two_node_box: str) -> None:
    seen = seen_by_workers(packed_tar, local_rank=1, mode="stream")
    assert {row[0] for rows in seen.values() for row in rows} == {"1"}


def test_the_users_worker_init_fn_still_runs(packed_tar: Packed, two_node_box: str) -> None:
    seen = seen_by_workers(packed_tar, local_rank=1, worker_init_fn=tag_worker)
    assert seen == {0: {("1", 1, "1", "init-0")}, 1: {("1", 1, "1", "init-1")}}


def test_pin_workers_false_leaves_workers_alone(packed_tar: Packed, two_node_box: str) -> None:
    seen = seen_by_workers(packed_tar, local_rank=1, pin_workers=False, worker_init_fn=tag_worker)
    everything = format_cpulist(MACHINE_CPUS)
    assert {row[0] for rows in seen.values() for row in rows} == {everything}
    assert {row[2] for rows in seen.values() for row in rows} == {"7"}
    assert {row[3] for rows in seen.values() for row in rows} == {"init-0", "init-1"}


def test_shardio_pin_workers_0_leaves_workers_alone(
    packed_tar: Packed, two_node_box: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDIO_PIN_WORKERS", "0")
    seen = seen_by_workers(packed_tar, local_rank=1)
    assert {row[0] for rows in seen.values() for row in rows} == {format_cpulist(MACHINE_CPUS)}


def test_this_machine_without_a_fake_tree(packed_tar: Packed) -> None:
    seen = seen_by_workers(packed_tar, local_rank=0)
    cpus = {row[0] for rows in seen.values() for row in rows}
    if not read_topology().gpus:  # CI: no NVIDIA GPU, nothing is pinned
        assert cpus == {format_cpulist(MACHINE_CPUS)}
    else:
        assert len(cpus) == 1


# -- worker_pinning, directly ---------------------------------------------------------------


def test_worker_pinning_from_a_fake_tree(two_node_box: str) -> None:
    pin = worker_pinning(num_workers=2, local_rank=1, user_init=tag_worker)
    assert pin == WorkerPinning(cpus=frozenset({1}), threads=1, user_init=tag_worker)
    assert pickle.loads(pickle.dumps(pin)) == pin  # a spawn/forkserver worker gets a copy


@pytest.mark.parametrize("value", ["0", "false", "off", "no"])
def test_pinning_is_turned_off_by_the_environment(two_node_box: str, value: str) -> None:
    env = {"SHARDIO_SYSFS": two_node_box, "SHARDIO_PIN_WORKERS": value}
    assert not pin_workers_enabled(env)
    assert worker_pinning(num_workers=2, local_rank=0, environ=env) is None
    assert pin_workers_enabled({"SHARDIO_PIN_WORKERS": "1"})


def test_no_placement_means_no_pinning(tmp_path: pathlib.Path) -> None:
    no_gpu = fake_sysfs(tmp_path / "no-gpu", {0: "0-1"}, [])
    malformed = fake_sysfs(tmp_path / "bad", {0: "0-x"}, [0])
    for sysfs in (no_gpu, malformed, os.fspath(tmp_path / "missing")):
        assert worker_pinning(num_workers=1, local_rank=0, environ={"SHARDIO_SYSFS": sysfs}) is None


@pytest.mark.parametrize("value", ["maybe", "2", " 0", "", "\u00b2"])
def test_a_malformed_pin_switch_is_refused_naming_it(two_node_box: str, value: str) -> None:
    from shardio.errors import UsageError

    env = {"SHARDIO_SYSFS": two_node_box, "SHARDIO_PIN_WORKERS": value}
    with pytest.raises(UsageError, match=r"^SHARDIO_PIN_WORKERS="):
        worker_pinning(num_workers=2, local_rank=0, environ=env)


def test_workers_keep_the_share_bind_sh_gave_whole(tmp_path: pathlib.Path) -> None:
    # Two GPUs on one node of CPUs 0-1: local rank 1's split is CPU 1. bind.sh gave this
    # task CPUs 0-1 as its own share (SHARDIO_BOUND_CPUS, its mask within it): kept whole.
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0-1"}, [0, 0])
    env = {"SHARDIO_SYSFS": sysfs}
    split = worker_pinning(num_workers=1, local_rank=1, environ=env)
    assert split is not None and split.cpus == frozenset({1})
    own = worker_pinning(num_workers=1, local_rank=1, environ=env | {"SHARDIO_BOUND_CPUS": "0-1"})
    assert own is not None and own.cpus == frozenset({0, 1})
