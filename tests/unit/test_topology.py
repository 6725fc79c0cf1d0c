"""shardio.topology on fake sysfs trees: GPUs, NUMA nodes, allowed CPUs and rank placement."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

import pytest
from fakesysfs import fake_sysfs

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
    assert all(
        p.numactl == f"numactl --cpunodebind={p.numa_node} --membind={p.numa_node}" for p in got
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


def test_unknown_gpu_numa_node_on_two_nodes_uses_the_allowed_mask(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-3", 1: "4-7"}, [-1, 1], allowed="0-7")
    p = placement(t, 0, num_workers=0)
    assert p.numa_node is None
    assert p.numactl is None
    assert p.cpus == frozenset(range(8))
    assert p.reason is not None and "unknown" in p.reason
    assert p.taskset == "taskset -c 0-7"
    assert cpus_of(t, 1) == "4-7"


def test_a_restricted_allowed_mask_keeps_each_rank_on_its_own_node(tmp_path: pathlib.Path) -> None:
    # A SLURM job with 4 cores on each socket of a 32-core box.
    t = topo(tmp_path, {0: "0-15", 1: "16-31"}, [0, 1], allowed="4-7,20-23")
    first, second = (placement(t, r, num_workers=3) for r in (0, 1))
    assert format_cpulist(first.cpus) == "4-7"
    assert format_cpulist(second.cpus) == "20-23"
    assert (first.threads, second.threads, first.reason) == (1, 1, None)


def test_a_node_outside_the_allowed_mask_falls_back_to_the_mask(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-15", 1: "16-31"}, [0, 1], allowed="0-3")
    p = placement(t, 1, num_workers=1)
    assert p.numa_node == 1  # memory still belongs next to the GPU
    assert format_cpulist(p.cpus) == "0-3"
    assert p.reason is not None and "none of NUMA node 1's CPUs (16-31)" in p.reason
    assert p.threads == 2
    assert p.numactl == "numactl --physcpubind=0-3 --membind=1"  # --cpunodebind=1 would fail
    assert p.taskset == "taskset -c 0-3"


def test_a_gpu_on_a_node_sysfs_does_not_list(tmp_path: pathlib.Path) -> None:
    t = topo(tmp_path, {0: "0-3"}, [0, 2])
    p = placement(t, 1, num_workers=0)
    assert (p.numa_node, p.numactl, p.cpus) == (None, None, frozenset(range(4)))
    assert p.reason is not None and "NUMA node 2 is not listed" in p.reason


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


def test_slurm_cpu_binding_is_reported_and_not_split_again(tmp_path: pathlib.Path) -> None:
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
    p = placement(t, 1, num_workers=3)
    assert format_cpulist(p.cpus) == "4-7"  # SLURM's per-task mask, whole
    assert p.shared_with == (1,)


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
