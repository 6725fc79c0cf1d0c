"""shardio.topology on fake sysfs trees: GPUs, NUMA nodes, allowed CPUs and rank placement."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

import pytest
from fakesysfs import block_masks, fake_sysfs, srun_env

from shardio.errors import FormatError, UsageError
from shardio.topology import (
    Topology,
    format_cpulist,
    parse_cpulist,
    placement,
    read_topology,
)


def topo(
    tmp_path: pathlib.Path,
    nodes: Mapping[int, str],
    gpu_nodes: Sequence[int],
    *,
    allowed: str | None = None,
    env: Mapping[str, str] | None = None,
    siblings: Mapping[int, str] | None = None,
) -> Topology:
    root = fake_sysfs(tmp_path / "sys", nodes, gpu_nodes, siblings=siblings)
    every = "".join(f",{c}" for c in nodes.values())[1:]
    return read_topology(
        str(root),
        environ=env or {},
        allowed_cpus=parse_cpulist(allowed if allowed is not None else every),
    )


def cpus_of(t: Topology, rank: int, workers: int = 0) -> str:
    return format_cpulist(placement(t, rank, num_workers=workers).cpus)


# -- cpulists -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-15,32-47", set(range(16)) | set(range(32, 48))),
        ("0", {0}),
        (" 3 \n", {3}),
        ("", set()),
        ("\n", set()),
        ("1,0,2-3", {0, 1, 2, 3}),
    ],
)
def test_parse_cpulist(text: str, cpus: set[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["0-", "a", "3-1", "0,,1", "-1", "0-3:2", "1 2", "99999999"])
def test_malformed_cpulist_is_a_format_error(text: str) -> None:
    with pytest.raises(FormatError, match="malformed CPU list"):
        parse_cpulist(text)


def test_format_cpulist_writes_what_the_kernel_writes() -> None:
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert format_cpulist([]) == ""
    text = "0-15,32-47"
    assert format_cpulist(parse_cpulist(text)) == text


# -- machines ---------------------------------------------------------------------------------


def test_one_gpu_on_one_socket(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-7"}, [0])
    assert [(g.index, g.pci_bus_id, g.numa_node) for g in t.gpus] == [(0, "0000:07:00.0", 0)]
    assert t.nodes == {0: frozenset(range(8))}
    p = placement(t, 0, num_workers=3)
    assert (p.gpu.index, p.numa_node, p.cpus, p.reason) == (0, 0, frozenset(range(8)), None)
    assert p.numactl == "numactl --cpunodebind=0 --membind=0"
    assert p.taskset == "taskset -c 0-7"
    assert p.threads == 2  # (1 + 3) x 2 <= 8
    assert p.shared_with == (0,)


def test_two_gpus_on_two_sockets_with_smt(tmp_path: pathlib.Path) -> None:
    nodes = {0: "0-15,32-47", 1: "16-31,48-63"}
    siblings = {c: f"{c % 32},{c % 32 + 32}" for c in range(64)}
    t = topo(tmp_path, nodes, [0, 1], siblings=siblings)
    assert len(t.cores) == 32
    p = placement(t, 1, num_workers=7)
    assert (p.gpu.pci_bus_id, p.numa_node) == ("0000:0f:00.0", 1)
    assert format_cpulist(p.cpus) == "16-31,48-63"
    assert p.cores == 16
    assert p.threads == 2  # 16 cores over 1 + 7 processes: SMT siblings count once
    assert p.numactl == "numactl --cpunodebind=1 --membind=1"
    assert cpus_of(t, 0) == "0-15,32-47"


def test_eight_gpus_on_two_sockets_split_each_node_among_its_four_ranks(
    tmp_path: pathlib.Path,
) -> None:
    t = topo(tmp_path, {0: "0-31", 1: "32-63"}, [0, 0, 0, 0, 1, 1, 1, 1])
    assert [g.pci_bus_id[5:7] for g in t.gpus] == ["07", "0f", "47", "4e", "87", "90", "b7", "bd"]
    got = [placement(t, r, num_workers=7) for r in range(8)]
    assert [p.numa_node for p in got] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [format_cpulist(p.cpus) for p in got] == [
        "0-7", "8-15", "16-23", "24-31", "32-39", "40-47", "48-55", "56-63",
    ]  # fmt: skip
    assert got[5].shared_with == (4, 5, 6, 7)
    assert all(p.threads == 1 for p in got)  # (1 + 7) x 1 <= 8
    assert all(  # a share of the node: its own CPUs, not the whole node's
        p.numactl == f"numactl --physcpubind={format_cpulist(p.cpus)} --membind={p.numa_node}"
        for p in got
    )


def test_eight_gpus_in_a_non_linear_order_on_eight_nodes(tmp_path: pathlib.Path) -> None:
    nodes = {n: f"{8 * n}-{8 * n + 7}" for n in range(8)}
    order = [3, 3, 1, 1, 7, 7, 5, 5]
    t = topo(tmp_path, nodes, order)
    got = [placement(t, r, num_workers=3) for r in range(8)]
    assert [p.numa_node for p in got] == order
    assert format_cpulist(got[0].cpus) == "24-27"
    assert format_cpulist(got[1].cpus) == "28-31"
    assert format_cpulist(got[4].cpus) == "56-59"
    assert all(p.threads == 1 for p in got)  # 4 cores over 1 + 3 processes
    assert all(not (a.cpus & b.cpus) for a in got for b in got if a is not b)


def test_unknown_gpu_numa_node_on_one_node_is_node_0(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-3"}, [-1])
    assert t.gpus[0].numa_node is None
    p = placement(t, 0, num_workers=1)
    assert (p.numa_node, p.cpus, p.reason) == (0, frozenset(range(4)), None)
    assert p.numactl == "numactl --cpunodebind=0 --membind=0"
    assert any("-1" in n for n in t.notes)


def test_unknown_gpu_numa_node_on_two_nodes_takes_cpus_of_its_own(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-3", 1: "4-7"}, [-1, 1], allowed="0-7")
    p = placement(t, 0, num_workers=0)
    assert p.numa_node is None
    assert p.numactl is None  # no node to bind memory to
    assert p.cpus == frozenset(range(4))  # node 0 (the first of the largest): not rank 1's
    assert p.reason is not None and "unknown" in p.reason
    assert p.taskset == "taskset -c 0-3"
    assert cpus_of(t, 1) == "4-7"


def test_a_restricted_allowed_mask_keeps_each_rank_on_its_own_node(tmp_path: pathlib.Path) -> None:
    # A SLURM job with 4 cores on each socket of a 32-core box.
    t = topo(tmp_path, {0: "0-15", 1: "16-31"}, [0, 1], allowed="4-7,20-23")
    first, second = (placement(t, r, num_workers=3) for r in (0, 1))
    assert format_cpulist(first.cpus) == "4-7"
    assert format_cpulist(second.cpus) == "20-23"
    assert (first.threads, second.threads, first.reason) == (1, 1, None)


def test_a_node_outside_the_allowed_mask_shares_the_allowed_node(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-15", 1: "16-31"}, [0, 1], allowed="0-3")
    p = placement(t, 1, num_workers=1)
    assert p.numa_node == 1  # memory still belongs next to the GPU
    assert format_cpulist(p.cpus) == "2-3"  # node 0's allowed CPUs, split with rank 0
    assert p.reason is not None and "none of NUMA node 1's CPUs (16-31)" in p.reason
    assert p.shared_with == (0, 1)
    assert p.threads == 1
    assert p.numactl == "numactl --physcpubind=2-3 --membind=1"  # --cpunodebind=1 would fail
    assert p.taskset == "taskset -c 2-3"
    assert cpus_of(t, 0) == "0-1"  # the ranks never share a core


def test_a_gpu_on_a_node_sysfs_does_not_list(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-3"}, [0, 2])
    p = placement(t, 1, num_workers=0)
    assert (p.numa_node, p.numactl, p.cpus) == (None, None, frozenset({2, 3}))
    assert p.reason is not None and "NUMA node 2 is not listed" in p.reason
    assert cpus_of(t, 0) == "0-1"


def test_ranks_on_one_node_split_its_cores_without_splitting_a_core(
    tmp_path: pathlib.Path,
) -> None:
    siblings = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    t = topo(tmp_path, {0: "0-15"}, [0, 0], siblings=siblings)
    assert cpus_of(t, 0) == "0-3,8-11"
    assert cpus_of(t, 1) == "4-7,12-15"
    p = placement(t, 1, num_workers=1)
    assert (p.cores, p.threads, p.shared_with) == (4, 2, (0, 1))


def test_more_ranks_than_cores_share_cores(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-1"}, [0, 0, 0])
    got = [placement(t, r, num_workers=2) for r in range(3)]
    assert [format_cpulist(p.cpus) for p in got] == ["0", "1", "0"]
    assert got[2].reason is not None and "share" in got[2].reason
    assert all(p.threads == 1 for p in got)


def test_more_ranks_than_gpus_wrap_around(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-7", 1: "8-15"}, [0, 1])
    got = [placement(t, r, num_workers=0, ranks_per_node=4) for r in range(4)]
    assert [p.gpu.index for p in got] == [0, 1, 0, 1]
    assert [format_cpulist(p.cpus) for p in got] == ["0-3", "8-11", "4-7", "12-15"]
    assert got[2].shared_with == (0, 2)


@pytest.mark.parametrize(
    ("cpus", "workers", "threads"),
    [("0-7", 0, 8), ("0-7", 1, 4), ("0-7", 3, 2), ("0-7", 7, 1), ("0-7", 15, 1), ("0", 4, 1)],
)
def test_thread_counts_fit_main_and_workers_in_the_cores(
    tmp_path: pathlib.Path, cpus: str, workers: int, threads: int
) -> None:
    p = placement(topo(tmp_path, {0: cpus}, [0]), 0, num_workers=workers)
    assert p.threads == threads
    assert p.threads >= 1
    assert (1 + workers) * p.threads <= max(len(p.cpus), 1 + workers)


# -- the environment ------------------------------------------------------------------------


EIGHT = {0: "0-31", 1: "32-63"}
EIGHT_GPUS = [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("cvd", "buses"),
    [
        ("6,7", ["b7", "bd"]),
        ("7,0", ["bd", "07"]),
        ("0,-1,1", ["07"]),  # CUDA stops at the first invalid entry
        ("1,9,2", ["0f"]),
        ("", []),
        ("NoDevFiles", []),
    ],
)
def test_cuda_visible_devices_indices_choose_and_order_the_gpus(
    tmp_path: pathlib.Path, cvd: str, buses: list[str]
) -> None:
    t = topo(tmp_path, EIGHT, EIGHT_GPUS, env={"CUDA_VISIBLE_DEVICES": cvd})
    assert [g.pci_bus_id[5:7] for g in t.gpus] == buses
    assert [g.index for g in t.gpus] == list(range(len(buses)))
    assert t.cuda_visible_devices == cvd


def test_visible_gpus_place_ranks_on_their_nodes(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, EIGHT, EIGHT_GPUS, env={"CUDA_VISIBLE_DEVICES": "6,2"})
    first, second = (placement(t, r, num_workers=0) for r in (0, 1))
    assert (first.numa_node, second.numa_node) == (1, 0)
    assert (format_cpulist(first.cpus), format_cpulist(second.cpus)) == ("32-63", "0-31")


def test_cuda_visible_devices_by_uuid_shows_every_gpu_with_a_note(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, EIGHT, EIGHT_GPUS, env={"CUDA_VISIBLE_DEVICES": "GPU-8f2a,GPU-11c0"})
    assert len(t.gpus) == 8
    assert any("names GPUs" in n for n in t.notes)


def test_slurm_gpus_name_a_device_cgroups_renumbered_gpus(tmp_path: pathlib.Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "4,5"}
    t = topo(tmp_path, EIGHT, EIGHT_GPUS, env=env)
    assert [g.pci_bus_id[5:7] for g in t.gpus] == ["87", "90"]
    assert placement(t, 0, num_workers=0).numa_node == 1
    # Not renumbered (no device cgroup): the indices already are SLURM's.
    t = topo(tmp_path / "b", EIGHT, EIGHT_GPUS, env=env | {"CUDA_VISIBLE_DEVICES": "5"})
    assert [g.pci_bus_id[5:7] for g in t.gpus] == ["90"]


def test_local_rank_comes_from_slurm_then_local_rank(tmp_path: pathlib.Path) -> None:
    assert topo(tmp_path / "a", {0: "0"}, [0]).local_rank is None
    env = {"SLURM_LOCALID": "3", "LOCAL_RANK": "5"}
    assert topo(tmp_path / "b", {0: "0"}, [0], env=env).local_rank == 3
    assert topo(tmp_path / "c", {0: "0"}, [0], env={"LOCAL_RANK": "5"}).local_rank == 5


def test_slurm_per_task_masks_are_reported_and_their_union_split(tmp_path: pathlib.Path) -> None:
    env = {
        "SLURM_CPU_BIND": "quiet,mask_cpu:0x0F,0xF0",
        "SLURM_CPU_BIND_TYPE": "mask_cpu:",
        "SLURM_CPU_BIND_LIST": "0x0F,0xF0",
        "SLURM_LOCALID": "1",
    }
    t = topo(tmp_path, {0: "0-15"}, [0, 0], allowed="4-7", env=env)
    assert t.slurm.task_cpus == frozenset(range(4, 8))
    assert t.slurm.per_task
    assert t.to_json()["slurm"]["task_cpus"] == "4-7"
    assert t.to_json()["slurm"]["step_cpus"] == "0-7"
    p = placement(t, 1, num_workers=3)
    assert format_cpulist(p.cpus) == "4-7"  # the node's masks split: SLURM's own choice here
    assert p.shared_with == (0, 1)


def test_one_slurm_mask_for_every_task_is_split_among_ranks(tmp_path: pathlib.Path) -> None:
    env = {"SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_CPU_BIND_LIST": "0xFF", "SLURM_LOCALID": "0"}
    t = topo(tmp_path, {0: "0-7"}, [0, 0], env=env)
    assert t.slurm.task_cpus == frozenset(range(8))
    assert not t.slurm.per_task
    assert [cpus_of(t, r) for r in (0, 1)] == ["0-3", "4-7"]


def test_map_cpu_binding(tmp_path: pathlib.Path) -> None:
    env = {"SLURM_CPU_BIND_TYPE": "map_cpu:", "SLURM_CPU_BIND_LIST": "0,5", "SLURM_LOCALID": "3"}
    assert topo(tmp_path, {0: "0-7"}, [0], env=env).slurm.task_cpus == {5}


# -- odd trees and bad input ----------------------------------------------------------------


def test_no_gpu(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-3"}, [])
    assert t.gpus == ()
    with pytest.raises(UsageError, match="no NVIDIA GPU found"):
        placement(t, 0, num_workers=0)


def test_no_numa_nodes_in_sysfs_means_one_node_of_the_online_cpus(tmp_path: pathlib.Path) -> None:
    root = pathlib.Path(fake_sysfs(tmp_path / "sys", {}, [-1]))
    (root / "devices" / "system" / "cpu").mkdir(parents=True)
    (root / "devices" / "system" / "cpu" / "online").write_text("0-5\n")
    t = read_topology(str(root), environ={}, allowed_cpus={0, 1, 2, 3, 4, 5})
    assert t.nodes == {0: frozenset(range(6))}
    assert any("no NUMA node" in n for n in t.notes)
    assert placement(t, 0, num_workers=0).numa_node == 0


def test_a_missing_sysfs_root_is_a_usage_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UsageError, match="no sysfs at"):
        read_topology(str(tmp_path / "nope"))


def test_a_malformed_node_cpulist_names_its_file(tmp_path: pathlib.Path) -> None:
    root = fake_sysfs(tmp_path / "sys", {0: "0-3", 1: "4-x"}, [0])
    with pytest.raises(FormatError, match=r"node1/cpulist.*'4-x'"):
        read_topology(str(root), environ={}, allowed_cpus={0})


def test_bad_placement_arguments(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-3"}, [0])
    for kwargs in ({"local_rank": -1, "num_workers": 0}, {"local_rank": 0, "num_workers": -2}):
        with pytest.raises(UsageError):
            placement(t, kwargs["local_rank"], num_workers=kwargs["num_workers"])
    with pytest.raises(UsageError, match="ranks per node"):
        placement(t, 0, num_workers=0, ranks_per_node=0)


def test_the_real_machine_reads(tmp_path: pathlib.Path) -> None:
    t = read_topology()
    assert t.nodes
    assert t.allowed_cpus
    for gpu in t.gpus:  # none on CI machines
        assert placement(t, gpu.index, num_workers=1).cpus


def test_json_forms(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0", 1: "1"}, [0, 1])
    data = t.to_json()
    assert data["nodes"] == [
        {"node": 0, "cpus": "0", "cpu_count": 1},
        {"node": 1, "cpus": "1", "cpu_count": 1},
    ]
    assert data["gpus"][1] == {"index": 1, "pci_bus_id": "0000:0f:00.0", "numa_node": 1}
    p = placement(t, 1, num_workers=0).to_json()
    assert p["numa_node"] == 1
    assert p["cpus"] == "1"
    assert p["taskset"] == "taskset -c 1"
    assert p["numactl"] == "numactl --cpunodebind=1 --membind=1"
    assert not any(isinstance(v, dict) for v in p.values())  # flat: bind.sh reads it


# -- srun's binding modes: co-located ranks never share a core ------------------------------
#
# What srun's task environment holds (slurmd turns --cpu-bind=cores|threads|sockets into one
# hex mask per task of the node, full width, and clears the level; map_cpu keeps its list;
# none says so; without a task plugin or binding nothing is set):
#   cores    SLURM_CPU_BIND=quiet,mask_cpu:0x00FF,0xFF00  SLURM_CPU_BIND_TYPE=mask_cpu:
#            SLURM_CPU_BIND_LIST=0x00FF,0xFF00  SLURM_CPU_BIND_VERBOSE=quiet
#   map_cpu  SLURM_CPU_BIND=quiet,map_cpu:0,8  SLURM_CPU_BIND_TYPE=map_cpu:  ..._LIST=0,8
#   none     SLURM_CPU_BIND=quiet,none  SLURM_CPU_BIND_TYPE=none  SLURM_CPU_BIND_LIST=
#   unbound  none of them


BOXES = {
    # name: (NUMA nodes, GPU nodes, SMT siblings, CPUs per task)
    "1gpu": ({0: "0-15", 1: "16-31"}, [1], None, 32),
    "2gpu": ({0: "0-15", 1: "16-31"}, [0, 1], None, 16),
    "2gpu-half": ({0: "0-15", 1: "16-31"}, [0, 1], None, 8),  # the step: socket 0 only
    "8gpu": ({0: "0-31", 1: "32-63"}, [0, 0, 0, 0, 1, 1, 1, 1], None, 8),
    "8gpu-smt": (
        {0: "0-31,64-95", 1: "32-63,96-127"},
        [0, 0, 0, 0, 1, 1, 1, 1],
        {c: f"{c % 64},{c % 64 + 64}" for c in range(128)},
        8,
    ),
    "8gpu-nonlinear": (
        {n: f"{8 * n}-{8 * n + 7}" for n in range(8)}, [3, 3, 1, 1, 7, 7, 5, 5], None, 8
    ),
}  # fmt: skip


@pytest.mark.parametrize("mode", ["cores", "widened", "map_cpu", "none", "unbound"])
@pytest.mark.parametrize("box", sorted(BOXES))
def test_srun_binding_modes_give_each_local_rank_cpus_of_its_own(
    tmp_path: pathlib.Path, box: str, mode: str
) -> None:
    nodes, gpu_nodes, siblings, per_task = BOXES[box]
    root = fake_sysfs(tmp_path / "sys", nodes, gpu_nodes, siblings=siblings)
    node_cpus = {n: parse_cpulist(c) for n, c in nodes.items()}
    everything = sorted(frozenset().union(*node_cpus.values()))
    first_threads = [c for c in everything if not siblings or c < 64]
    ranks = len(gpu_nodes)
    tasks = block_masks(ranks, per_task, first_threads)
    step = frozenset().union(*tasks) if mode in ("cores", "widened", "map_cpu") else None
    if mode == "map_cpu":
        step = frozenset(min(t) for t in tasks)
    got = []
    for local in range(ranks):
        env = srun_env(mode, tasks, local, len(everything))
        if mode == "cores":
            allowed = tasks[local]  # srun's mask, as the task starts
        elif mode == "map_cpu":
            allowed = frozenset({min(tasks[local])})
        elif mode == "widened":  # then `numactl --cpunodebind` (the old bind.sh) widened it
            allowed = frozenset().union(*(c for c in node_cpus.values() if c & tasks[local]))
        else:
            allowed = frozenset(everything)
        t = read_topology(root, environ=env, allowed_cpus=allowed)
        got.append(placement(t, local, num_workers=3))
    usable = step if step is not None else frozenset(everything)
    for p in got:
        assert p.cpus, p
        assert p.cpus <= usable  # never CPUs the step was not given
        own_node = node_cpus[gpu_nodes[p.local_rank]]
        room = len(own_node & usable)  # the steps here hold one thread of each core
        if room >= gpu_nodes.count(gpu_nodes[p.local_rank]):  # on its GPU's node if it can be
            assert p.cpus <= own_node, (p.local_rank, format_cpulist(p.cpus))
        elif not p.cpus <= own_node:
            assert p.reason is not None  # and says why
        assert p.numa_node == gpu_nodes[p.local_rank]  # memory next to the GPU, always
        assert (1 + p.num_workers) * p.threads <= max(p.cores, 1 + p.num_workers)
    for a in got:
        for b in got:
            if a is not b:
                assert not a.cpus & b.cpus, (box, mode, a.local_rank, b.local_rank)
    if box in ("8gpu", "8gpu-smt") and mode in ("cores", "widened"):
        # block:block on a linear board: the split is srun's own choice, mask for mask
        assert [p.cpus for p in got] == tasks


def test_a_mask_widened_after_srun_is_not_taken_as_the_tasks_own(tmp_path: pathlib.Path) -> None:
    # The issue's case: srun --cpu-bind=cores gave 8 tasks 8 cores each, bind.sh's numactl
    # --cpunodebind widened each to its 32-CPU node; the old placement kept the widened mask
    # whole for every rank of the node.
    nodes = {0: "0-31", 1: "32-63"}
    tasks = block_masks(8, 8, list(range(64)))
    shares = []
    for local in range(8):
        env = srun_env("cores", tasks, local, 64)
        widened = frozenset(range(0, 32)) if local < 4 else frozenset(range(32, 64))
        t = topo(tmp_path / str(local), nodes, EIGHT_GPUS, allowed=format_cpulist(widened), env=env)
        shares.append(placement(t, local, num_workers=7).cpus)
    assert shares == tasks


def test_a_share_bind_sh_gave_is_kept_whole(tmp_path: pathlib.Path) -> None:
    # bind.sh pinned the task to its share and made its GPU the only visible one: the loader
    # must neither split the share again nor take the whole node.
    env = srun_env("cores", block_masks(8, 8, list(range(64))), 5, 64) | {
        "CUDA_VISIBLE_DEVICES": "5",
        "SHARDIO_BOUND_CPUS": "40-47",
    }
    t = topo(tmp_path / "a", EIGHT, EIGHT_GPUS, allowed="40-47", env=env)
    p = placement(t, 5, num_workers=3)
    assert (format_cpulist(p.cpus), p.shared_with, p.threads) == ("40-47", (0,), 2)
    assert p.numactl == "numactl --physcpubind=40-47 --membind=1"
    # Every GPU visible (SHARDIO_BIND_GPU=0): the same share.
    t = topo(
        tmp_path / "b", EIGHT, EIGHT_GPUS, allowed="40-47", env=env | {"CUDA_VISIBLE_DEVICES": ""}
    )
    assert t.gpus == ()
    env.pop("CUDA_VISIBLE_DEVICES")
    t = topo(tmp_path / "c", EIGHT, EIGHT_GPUS, allowed="40-47", env=env)
    assert format_cpulist(placement(t, 5, num_workers=3).cpus) == "40-47"
    # Widened since (the mask is no longer within the share): split again, not trusted.
    t = topo(tmp_path / "d", EIGHT, EIGHT_GPUS, allowed="32-63", env=env)
    assert format_cpulist(placement(t, 5, num_workers=3).cpus) == "40-47"


@pytest.mark.parametrize(
    ("env", "task", "step"),
    [
        ({"SLURM_CPU_BIND": "verbose,mask_cpu:0x3,0xC"}, "2-3", "0-3"),  # no _TYPE/_LIST
        ({"SLURM_CPU_BIND_TYPE": "ldoms,mask_cpu:", "SLURM_CPU_BIND_LIST": "3,c"}, "2-3", "0-3"),
        ({"SLURM_CPU_BIND_TYPE": "map_cpu:", "SLURM_CPU_BIND_LIST": "0x1,0x3"}, "3", "1,3"),
        ({"SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_CPU_BIND_LIST": "3,C"}, "2-3", "0-3"),
        ({"SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_CPU_BIND_LIST": "0xZZ,0x1"}, None, None),
        ({"SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_CPU_BIND_LIST": "0x_3,0x1"}, None, None),
        ({"SLURM_CPU_BIND_TYPE": "map_cpu:", "SLURM_CPU_BIND_LIST": "\u00b2,1"}, None, None),
        ({"SLURM_CPU_BIND_TYPE": "map_cpu:", "SLURM_CPU_BIND_LIST": "99999999,1"}, None, None),
        ({"SLURM_CPU_BIND_TYPE": "mask_ldom:", "SLURM_CPU_BIND_LIST": "0x1,0x2"}, None, None),
        ({"SLURM_CPU_BIND": "quiet,none", "SLURM_CPU_BIND_TYPE": "none"}, None, None),
    ],
)  # fmt: skip
def test_slurm_binding_forms(
    tmp_path: pathlib.Path, env: dict[str, str], task: str | None, step: str | None
) -> None:
    t = topo(tmp_path, {0: "0-3"}, [0, 0], env=env | {"SLURM_LOCALID": "1"})
    shown = t.to_json()["slurm"]
    assert (shown["task_cpus"], shown["step_cpus"]) == (task, step)
    if step is None:  # not understood, or no CPU list: the allowed CPUs are split
        assert cpus_of(t, 1) == "2-3"


@pytest.mark.parametrize("value", ["-1", "\u0663", "1" * 5000, " 1", "1_0"])
@pytest.mark.parametrize("var", ["SLURM_LOCALID", "LOCAL_RANK"])
def test_a_malformed_local_rank_is_refused(tmp_path: pathlib.Path, var: str, value: str) -> None:
    root = fake_sysfs(tmp_path / "sys", {0: "0"}, [0])
    with pytest.raises(UsageError, match=f"^{var}="):
        read_topology(root, environ={var: value}, allowed_cpus={0})


@pytest.mark.parametrize(
    "cvd", ["\u00b2", "\u0663", "1" * 5000, "0,\u00b2"], ids=["sup2", "arabic3", "huge", "mixed"]
)
def test_odd_cuda_visible_devices_do_not_crash(tmp_path: pathlib.Path, cvd: str) -> None:
    t = topo(
        tmp_path, EIGHT, EIGHT_GPUS, env={"CUDA_VISIBLE_DEVICES": cvd, "SLURM_STEP_GPUS": "\u00b2"}
    )
    assert len(t.gpus) == 8  # not indices: every GPU, with a note
    assert any("names GPUs" in n for n in t.notes)


@pytest.mark.parametrize("text", ["\u00b2", "\u0663-4", "0-\u00b2", "1" * 5000])
def test_non_ascii_cpulists_are_format_errors(text: str) -> None:
    with pytest.raises(FormatError, match="malformed CPU list"):
        parse_cpulist(text)


def test_node_directories_with_non_ascii_digits_are_not_nodes(tmp_path: pathlib.Path) -> None:
    root = pathlib.Path(fake_sysfs(tmp_path / "sys", {0: "0"}, [0]))
    odd = root / "devices" / "system" / "node" / "node\u00b2"
    odd.mkdir()
    (odd / "cpulist").write_text("1\n")
    (root / "bus/pci/devices/0000:07:00.0/numa_node").write_text("\u0663\n")
    t = read_topology(str(root), environ={}, allowed_cpus={0})
    assert list(t.nodes) == [0]
    assert t.gpus[0].numa_node is None
