"""``shardio topo`` end to end on fake sysfs trees (this machine has no GPU)."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
from fakesysfs import fake_sysfs

# Variables that change which GPUs or which local rank topo sees.
_ENV = ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "SHARDIO_SYSFS")


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


# This machine's CPUs are {0, 1}: node 0 holds CPU 0, node 1 CPU 1.
TWO = {0: "0", 1: "1"}


def test_json_lists_the_map_and_every_rank(
    run_cli: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", TWO, [1, 0])
    result = run_cli("topo", "--sysfs", sysfs, "--json", "--workers", "3")
    assert result.rc == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["sysfs"] == sysfs
    assert out["nodes"] == [
        {"node": 0, "cpus": "0", "cpu_count": 1},
        {"node": 1, "cpus": "1", "cpu_count": 1},
    ]
    assert out["gpus"] == [
        {"index": 0, "pci_bus_id": "0000:07:00.0", "numa_node": 1},
        {"index": 1, "pci_bus_id": "0000:0f:00.0", "numa_node": 0},
    ]
    assert out["workers"] == 3
    assert set(out["slurm"]) >= {"cpu_bind", "cpu_bind_list", "task_cpus"}
    first, second = out["placements"]
    assert first == {
        "local_rank": 0,
        "gpu_index": 0,
        "pci_bus_id": "0000:07:00.0",
        "numa_node": 1,
        "cpus": "1",
        "cpu_count": 1,
        "cores": 1,
        "shared_with": [0],
        "reason": None,
        "num_workers": 3,
        "omp_num_threads": 1,
        "torch_threads": 1,
        "numactl": "numactl --cpunodebind=1 --membind=1",
        "taskset": "taskset -c 1",
    }
    assert (second["numa_node"], second["cpus"]) == (0, "0")
    assert list(out)[-1] == "placements"  # bind.sh reads the first placement after the map


def test_local_rank_selects_one_placement(
    run_cli: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", TWO, [1, 0])
    result = run_cli("topo", "--sysfs", sysfs, "--json", "--local-rank", "3")
    assert result.rc == 0, result.stderr
    (only,) = json.loads(result.stdout)["placements"]
    assert (only["local_rank"], only["gpu_index"], only["numa_node"]) == (3, 1, 0)


def test_cuda_visible_devices_and_sysfs_from_the_environment(
    run_cli: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", TWO, [1, 0])
    result = run_cli("topo", "--json", env={"SHARDIO_SYSFS": sysfs, "CUDA_VISIBLE_DEVICES": "1"})
    assert result.rc == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["gpus"] == [{"index": 0, "pci_bus_id": "0000:0f:00.0", "numa_node": 0}]
    assert out["cuda_visible_devices"] == "1"


def test_text_output_gives_the_command_lines(
    run_cli: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", TWO, [1, 0])
    result = run_cli("topo", "--sysfs", sysfs)
    assert result.rc == 0, result.stderr
    out = result.stdout
    assert "NUMA node 1   CPUs 1 (1, 1 allowed)" in out
    assert "GPU 0         0000:07:00.0  NUMA node 1" in out
    assert "local rank 0: GPU 0 (0000:07:00.0), NUMA node 1, CPUs 1 (1 cores)" in out
    assert "numactl --cpunodebind=1 --membind=1 -- COMMAND" in out
    assert "taskset -c 0 COMMAND" in out  # rank 1's
    assert "OMP_NUM_THREADS=1" in out


def test_no_gpu_prints_the_numa_map_and_says_so(
    run_cli: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", TWO, [])
    result = run_cli("topo", "--sysfs", sysfs)
    assert result.rc == 0, result.stderr
    assert "NUMA node 0" in result.stdout and "NUMA node 1" in result.stdout
    assert f"no NVIDIA GPU found in {sysfs}/bus/pci/devices" in result.stdout
    result = run_cli("topo", "--sysfs", sysfs, "--json", "--local-rank", "2")
    assert result.rc == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["gpus"], out["placements"]) == ([], [])
    assert "no NVIDIA GPU found" in out["message"]


def test_this_machine(run_cli: Callable[..., Any]) -> None:
    result = run_cli("topo")
    assert result.rc == 0, result.stderr
    assert "allowed CPUs" in result.stdout
    assert "NUMA node 0" in result.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--sysfs", "{missing}"], ["no sysfs at", "missing"]),
        (["--sysfs", "{bad}"], ["malformed cpulist", "node1/cpulist", "'1-x'"]),
        (["--sysfs", "{good}", "--local-rank", "-1"], ["--local-rank='-1' is not a whole"]),
        (["--sysfs", "{good}", "--workers", "-1"], ["--workers='-1' is not a whole"]),
        (["--sysfs", "{good}", "--local-rank", "\u0663"], ["--local-rank='\u0663' is not"]),
    ],
)
def test_bad_input_is_one_line(
    run_cli: Callable[..., Any],
    assert_cli_error: Callable[..., str],
    tmp_path: pathlib.Path,
    args: list[str],
    needles: list[str],
) -> None:
    paths = {
        "missing": os.fspath(tmp_path / "missing"),
        "bad": fake_sysfs(tmp_path / "bad", {0: "0", 1: "1-x"}, [0]),
        "good": fake_sysfs(tmp_path / "good", TWO, [0]),
    }
    result = run_cli("topo", *(a.format(**paths) for a in args))
    assert_cli_error(result, *needles)
