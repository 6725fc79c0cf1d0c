"""scripts/slurm/bind.sh takes the task's NUMA node and CPUs from `shardio topo`.

The real `shardio` (this venv's, on PATH) reads a fake sysfs tree named by SHARDIO_SYSFS;
numactl and taskset are the recording fakes. This machine's CPUs are {0, 1}, so the fake
nodes hold CPU 0 or CPU 1 (a node none of whose CPUs is allowed would move the CPU list to
the allowed mask, not the node).
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import pytest
from fakesysfs import fake_sysfs

from shardio.topology import format_cpulist

REPO = pathlib.Path(__file__).resolve().parents[2]
BIND = REPO / "scripts" / "slurm" / "bind.sh"

pytestmark = pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="the fake nodes need CPUs 0 and 1"
)


@pytest.fixture
def probe(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "probe.out"


def probe_cmd(out: pathlib.Path) -> list[str]:
    """A command that writes the GPU, local rank and NUMA node it was given."""
    return [
        "bash",
        "-c",
        f'echo "$CUDA_VISIBLE_DEVICES $LOCAL_RANK $SHARDIO_BOUND_NUMA_NODE" > {out}',
    ]


@pytest.fixture
def reversed_box(tmp_path: pathlib.Path) -> str:
    """GPU 0 on node 1 (CPU 1), GPU 1 on node 0 (CPU 0): the formula gets both wrong."""
    return fake_sysfs(tmp_path / "sys", {0: "0", 1: "1"}, [1, 0])


@pytest.mark.parametrize(("local_id", "gpu", "node"), [("0", "0", "1"), ("1", "1", "0")])
def test_bind_takes_the_node_from_shardio_topo(
    run_script: Callable[..., Any],
    probe: pathlib.Path,
    reversed_box: str,
    local_id: str,
    gpu: str,
    node: str,
) -> None:
    env = {"SLURM_LOCALID": local_id, "SHARDIO_SYSFS": reversed_box, "SHARDIO_BIND_VERBOSE": "1"}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls == [
        ["numactl", f"--cpunodebind={node}", f"--membind={node}", "--", *probe_cmd(probe)]
    ]
    assert probe.read_text().split() == [gpu, local_id, node]
    assert f"GPU {gpu}, NUMA node {node} of 2 (shardio topo)" in result.stderr


@pytest.mark.parametrize(("local_id", "node"), [("0", "3"), ("3", "1"), ("4", "7"), ("7", "5")])
def test_bind_follows_a_non_linear_eight_gpu_board(
    run_script: Callable[..., Any],
    probe: pathlib.Path,
    tmp_path: pathlib.Path,
    local_id: str,
    node: str,
) -> None:
    sysfs = fake_sysfs(
        tmp_path / "sys", {n: str(n % 2) for n in range(8)}, [3, 3, 1, 1, 7, 7, 5, 5]
    )
    result = run_script(
        [BIND, *probe_cmd(probe)], env={"SLURM_LOCALID": local_id, "SHARDIO_SYSFS": sysfs}
    )
    assert result.rc == 0, result.stderr
    assert result.calls[0][:3] == ["numactl", f"--cpunodebind={node}", f"--membind={node}"]
    assert probe.read_text().split() == [local_id, local_id, node]


def test_taskset_gets_the_tasks_share_of_the_node(
    run_script: Callable[..., Any], probe: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0-1"}, [0, 0])  # two GPUs share node 0
    env = {"SLURM_LOCALID": "1", "SHARDIO_SYSFS": sysfs, "SHARDIO_NUMACTL": ""}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls == [["taskset", "-c", "1", *probe_cmd(probe)]]  # not the node's 0-1


def test_visible_gpus_are_placed_by_shardio_too(
    run_script: Callable[..., Any], probe: pathlib.Path, reversed_box: str
) -> None:
    env = {"SLURM_LOCALID": "0", "SHARDIO_SYSFS": reversed_box, "CUDA_VISIBLE_DEVICES": "1"}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert probe.read_text().split() == ["1", "0", "0"]


def test_shardio_command_with_arguments(
    run_script: Callable[..., Any], probe: pathlib.Path, reversed_box: str
) -> None:
    env = {
        "SLURM_LOCALID": "0",
        "SHARDIO_SYSFS": reversed_box,
        "SHARDIO_BIN": f"{sys.executable} -m shardio",
    }
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls[0][:2] == ["numactl", "--cpunodebind=1"]


@pytest.mark.parametrize(
    "extra",
    [
        {"SHARDIO_BIN": ""},  # told not to use shardio
        {"SHARDIO_BIN": "/nonexistent/shardio"},  # not installed
        {"SHARDIO_BIN": "false"},  # fails
        {"SHARDIO_NUMA_NODES": "2"},  # the formula's input given: the formula
        {"SHARDIO_GPU_NUMA_MAP": "0,1"},  # the map given: the map
    ],
    ids=["empty", "missing", "failing", "numa-nodes", "map"],
)
def test_without_shardio_or_with_an_override_bind_uses_the_formula_or_map(
    run_script: Callable[..., Any], probe: pathlib.Path, reversed_box: str, extra: dict[str, str]
) -> None:
    env = {"SLURM_LOCALID": "0", "SHARDIO_SYSFS": reversed_box, "SHARDIO_BIND_VERBOSE": "1"}
    result = run_script([BIND, *probe_cmd(probe)], env=env | extra)
    assert result.rc == 0, result.stderr
    # slot 0 is node 0 by the formula (and by that map); shardio would say node 1.
    assert result.calls[0][:3] == ["numactl", "--cpunodebind=0", "--membind=0"]
    assert "(shardio topo)" not in result.stderr


def test_no_gpu_in_sysfs_falls_back_to_the_formula(
    run_script: Callable[..., Any], probe: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0", 1: "1"}, [])
    env = {"SLURM_LOCALID": "5", "SHARDIO_SYSFS": sysfs, "SHARDIO_BIND_VERBOSE": "1"}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls[0][:3] == ["numactl", "--cpunodebind=1", "--membind=1"]  # 5 * 2 / 8
    assert "(formula)" in result.stderr


def test_a_node_outside_the_tasks_cpus_binds_memory_there_and_cpus_here(
    run_script: Callable[..., Any], probe: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # The GPU's node 1 holds CPUs 8-9, which this process may not use (it has 0 and 1).
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0-1", 1: "8-9"}, [1])
    result = run_script(
        [BIND, *probe_cmd(probe)], env={"SLURM_LOCALID": "0", "SHARDIO_SYSFS": sysfs}
    )
    assert result.rc == 0, result.stderr
    expected = ["numactl", f"--physcpubind={format_cpulist(os.sched_getaffinity(0))}"]
    assert result.calls == [[*expected, "--membind=1", "--", *probe_cmd(probe)]]
    assert probe.read_text().split() == ["0", "0", "1"]
