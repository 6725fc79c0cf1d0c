"""scripts/slurm/bind.sh takes the task's NUMA node and CPUs from `shardio topo`.

The real `shardio` (this venv's, on PATH) reads a fake sysfs tree named by SHARDIO_SYSFS;
numactl and taskset are the recording fakes. This machine's CPUs are {0, 1}, so the fake
nodes hold CPU 0 or CPU 1 (a node none of whose CPUs is allowed would move the CPU list to
the allowed mask, not the node).

The masks here are srun's as the fakes spell them (SLURM_CPU_BIND*), for boards this machine
is not: 8 GPUs, several NUMA nodes, non-linear GPU order, numactl. What real srun does with
two co-located ranks on this machine (--cpu-bind=cores, none, its default; bind.sh and the
loader's worker pinning on top) is checked in tests/slurm/test_slurm_binding.py.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import pytest
from fakesysfs import block_masks, fake_sysfs, plant, srun_env

from shardio.topology import format_cpulist, parse_cpulist

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
    assert result.calls == [  # the node's one CPU is this task's share
        ["numactl", f"--physcpubind={node}", f"--membind={node}", "--", *probe_cmd(probe)]
    ]
    assert probe.read_text().split() == [gpu, local_id, node]
    assert f"GPU {gpu}, NUMA node {node} of 2 (shardio topo), CPUs {node}," in result.stderr


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
    assert result.calls[0][0] == "numactl"
    assert result.calls[0][2] == f"--membind={node}"
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
    assert result.calls[0][:3] == ["numactl", "--physcpubind=1", "--membind=1"]


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


# -- each local rank its own cores, under each of srun's binding modes ----------------------


def bound_probe(out: pathlib.Path) -> list[str]:
    """A command that writes the GPU, NUMA node and CPUs bind.sh gave it."""
    return [
        "bash",
        "-c",
        f'echo "$CUDA_VISIBLE_DEVICES $SHARDIO_BOUND_NUMA_NODE $SHARDIO_BOUND_CPUS '
        f'$OMP_NUM_THREADS" > {out}',
    ]


# name: (NUMA nodes, GPU nodes, CPUs per task); the masks follow srun's block:block layout
BIG_BOXES = {
    "1gpu": ({0: "0-15", 1: "16-31"}, [1], 32),
    "2gpu": ({0: "0-15", 1: "16-31"}, [0, 1], 16),
    "8gpu": ({0: "0-31", 1: "32-63"}, [0, 0, 0, 0, 1, 1, 1, 1], 8),
    "8gpu-nonlinear": ({n: f"{8 * n}-{8 * n + 7}" for n in range(8)}, [3, 3, 1, 1, 7, 7, 5, 5], 8),
}


def run_every_local_rank(
    run_script: Callable[..., Any],
    tmp_path: pathlib.Path,
    sysfs: str,
    env_of: Callable[[int], dict[str, str]],
    ranks: int,
) -> list[tuple[str, str, set[int], str]]:
    """bind.sh once per local rank: (GPU, node, CPUs, OMP_NUM_THREADS) each was given, as
    numactl was asked to bind it (and as bind.sh exported it)."""
    got = []
    for local in range(ranks):
        out = tmp_path / f"probe-{local}"
        log = tmp_path / "fake-calls.log"
        log.unlink(missing_ok=True)
        env = env_of(local) | {"SHARDIO_SYSFS": sysfs, "OMP_NUM_THREADS": "64"}
        result = run_script([BIND, *bound_probe(out)], env=env)
        assert result.rc == 0, result.stderr
        ((cmd, physcpubind, membind, dashes, *_),) = result.calls
        assert (cmd, dashes) == ("numactl", "--")
        assert physcpubind.startswith("--physcpubind=")
        gpu, node, cpus, omp = out.read_text().split()
        assert membind == f"--membind={node}"
        assert cpus == physcpubind.removeprefix("--physcpubind=")  # SHARDIO_BOUND_CPUS
        got.append((gpu, node, set(parse_cpulist(cpus)), omp))
    return got


@pytest.mark.parametrize("mode", ["cores", "map_cpu"])
@pytest.mark.parametrize("box", sorted(BIG_BOXES))
def test_co_located_ranks_get_disjoint_cpus_on_their_gpus_node(
    run_script: Callable[..., Any], tmp_path: pathlib.Path, box: str, mode: str
) -> None:
    nodes, gpu_nodes, per_task = BIG_BOXES[box]
    sysfs = fake_sysfs(tmp_path / "sys", nodes, gpu_nodes)
    node_cpus = {n: parse_cpulist(c) for n, c in nodes.items()}
    everything = sorted(frozenset().union(*node_cpus.values()))
    tasks = block_masks(len(gpu_nodes), per_task, everything)
    got = run_every_local_rank(
        run_script,
        tmp_path,
        sysfs,
        lambda local: srun_env(mode, tasks, local, len(everything)),
        len(gpu_nodes),
    )
    step = frozenset().union(*tasks) if mode == "cores" else {min(t) for t in tasks}
    for local, (gpu, node, cpus, omp) in enumerate(got):
        assert (gpu, node) == (str(local), str(gpu_nodes[local]))
        assert cpus and cpus <= step
        if len(node_cpus[gpu_nodes[local]] & step) >= gpu_nodes.count(gpu_nodes[local]):
            assert cpus <= node_cpus[gpu_nodes[local]], (local, cpus)
        assert omp == str(min(64, len(cpus)))  # one thread per CPU of its share
    for a in range(len(got)):
        for b in range(a):
            assert not got[a][2] & got[b][2], (box, mode, a, b)


@pytest.mark.parametrize("mode", ["none", "unbound"])
def test_an_unbound_step_is_split_among_the_local_ranks(
    run_script: Callable[..., Any], tmp_path: pathlib.Path, mode: str
) -> None:
    # This machine's CPUs 0 and 1 are the task's allowed CPUs (srun bound nothing): two GPUs
    # on one node split it, one CPU each.
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0-1"}, [0, 0])
    got = run_every_local_rank(
        run_script, tmp_path, sysfs, lambda local: srun_env(mode, [], local, 2), 2
    )
    assert [cpus for _gpu, _node, cpus, _omp in got] == [{0}, {1}]


def test_the_old_widening_is_gone(run_script: Callable[..., Any], tmp_path: pathlib.Path) -> None:
    # srun --cpu-bind=cores, 8 tasks of 8 cores: bind.sh no longer hands every task of a node
    # the whole node (numactl --cpunodebind), which made their workers share its cores.
    nodes, gpu_nodes, per_task = BIG_BOXES["8gpu"]
    sysfs = fake_sysfs(tmp_path / "sys", nodes, gpu_nodes)
    tasks = block_masks(8, per_task, list(range(64)))
    env = srun_env("cores", tasks, 5, 64) | {"SHARDIO_SYSFS": sysfs}
    result = run_script([BIND, "true"], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls == [["numactl", "--physcpubind=40-47", "--membind=1", "--", "true"]]


def test_without_shardio_srun_s_own_mask_is_kept(
    run_script: Callable[..., Any], probe: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    tasks = block_masks(2, 1, [0, 1])
    env = srun_env("cores", tasks, 1, 2) | {"SHARDIO_BIN": "", "SHARDIO_GPUS_PER_NODE": "2"}
    env["SHARDIO_NUMA_NODES"] = "1"  # not this machine's count
    out = tmp_path / "bound"
    result = run_script([BIND, *bound_probe(out)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls == [["numactl", "--membind=0", "--", *bound_probe(out)]]  # no widening
    mine = format_cpulist(os.sched_getaffinity(0))  # what the fake srun left this task
    assert out.read_text().split()[2] == mine


def test_without_shardio_or_srun_binding_a_shared_node_is_said(
    run_script: Callable[..., Any], probe: pathlib.Path
) -> None:
    env = {"SLURM_LOCALID": "1", "SHARDIO_BIN": "", "SHARDIO_NUMA_NODES": "1"}
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 0, result.stderr
    assert result.calls[0][:3] == ["numactl", "--cpunodebind=0", "--membind=0"]
    assert "warning: local ranks share NUMA node 0's CPUs" in result.stderr


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SLURM_LOCALID", "-1"),
        ("SLURM_LOCALID", "\u00b2"),
        ("SLURM_LOCALID", "1" * 5000),
        ("SLURM_LOCALID", " 1"),
        ("SLURM_LOCALID", ""),
        ("LOCAL_RANK", "abc"),
        ("SLURM_PROCID", "+1"),
        ("SLURM_NTASKS", "1_000"),
        ("SHARDIO_GPUS_PER_NODE", "\u0663"),
        ("SHARDIO_NUMA_NODES", "99999999999999999999"),
        ("SHARDIO_NUMA_NODES", "999999999"),
        ("SHARDIO_GPUS_PER_NODE", "999999999"),  # was a loop of 10^9 array appends
        ("SHARDIO_GPUS_PER_NODE", "257"),
        ("SHARDIO_GPU_NUMA_MAP", "0,-1"),
    ],
)
def test_bind_refuses_malformed_numbers_in_one_line(
    run_script: Callable[..., Any], probe: pathlib.Path, var: str, value: str
) -> None:
    env = {var: value}
    if var == "SHARDIO_GPU_NUMA_MAP":
        env["SLURM_LOCALID"] = "1"
    result = run_script([BIND, *probe_cmd(probe)], env=env)
    assert result.rc == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("bind.sh: error: ")
    assert var in line or "SHARDIO_GPU_NUMA_MAP entry" in line
    assert len(line) < 200
    assert result.calls == []
    assert not probe.exists()


def test_a_fifo_in_the_sysfs_tree_does_not_hang_bind(
    run_script: Callable[..., Any], probe: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    root = pathlib.Path(fake_sysfs(tmp_path / "sys", {0: "0", 1: "1"}, [1, 0]))
    plant(root, "devices/system/node/node1/cpulist", "fifo")
    env = {"SLURM_LOCALID": "0", "SHARDIO_SYSFS": str(root), "SHARDIO_NUMACTL": ""}
    result = run_script([BIND, *probe_cmd(probe)], env=env, timeout=30)
    assert result.rc == 0, result.stderr
    assert "shardio topo failed" in result.stderr and "not a regular file" in result.stderr
    # The formula's node 0 (slot 0 of 8 GPUs over 2 nodes), its cpulist read by bind.sh;
    # node 1's FIFO is never opened by bind.sh either.
    assert result.calls == [["taskset", "-c", "0", *probe_cmd(probe)]]
