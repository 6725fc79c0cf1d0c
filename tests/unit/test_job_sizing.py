"""Job sizing: the CPUs a process may use (affinity, cgroup quota, SLURM) and what is mis-sized.

Fake cgroup and procfs trees (tests/fakesysfs.py) stand for containers, systemd slices and
SLURM jobs; hostile ones (a FIFO or /dev/zero as ``cpu.max``, a climbing path) must give a
one-line note in bounded time, never a hang or an exception.
"""

from __future__ import annotations

import pathlib
import threading

import pytest
from fakesysfs import fake_cgroup, fake_sysfs, plant

from shardio.topology import placement, read_topology
from shardio.topology.cgroup import CpuQuota, read_cpu_quota
from shardio.topology.sizing import (
    CpuBudget,
    numa_finding,
    read_cpu_budget,
    room_for_workers,
    sizing_findings,
)


def quota_of(tmp_path: pathlib.Path, files: dict[str, str], **kw: object) -> tuple[object, str]:
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", files, **kw)  # type: ignore[arg-type]
    return read_cpu_quota(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))


def test_v2_quota_of_one_cpu(tmp_path: pathlib.Path) -> None:
    quota, note = quota_of(tmp_path, {"job/step/cpu.max": "100000 100000"})
    assert note == ""
    assert isinstance(quota, CpuQuota)
    assert (quota.cpus, quota.version) == (1.0, 2)
    assert quota.path == str(tmp_path / "sys/fs/cgroup/job/step/cpu.max")


def test_v2_max_is_no_limit(tmp_path: pathlib.Path) -> None:
    assert quota_of(tmp_path, {"job/step/cpu.max": "max 100000"}) == (None, "")


def test_v2_a_parents_cap_holds_for_its_children(tmp_path: pathlib.Path) -> None:
    files = {"job/cpu.max": "150000 100000", "job/step/cpu.max": "max 100000"}
    quota, _ = quota_of(tmp_path, files)
    assert isinstance(quota, CpuQuota) and quota.cpus == 1.5
    assert quota.path.endswith("fs/cgroup/job/cpu.max")
    files["job/step/cpu.max"] = "50000 100000"  # the child is tighter: it wins
    quota, _ = quota_of(tmp_path / "tighter", files)
    assert isinstance(quota, CpuQuota) and quota.cpus == 0.5


def test_v2_own_cgroup_outside_the_tree_reads_the_root(tmp_path: pathlib.Path) -> None:
    # A container sees its cgroup as the tree's root while self/cgroup names the host path.
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", {"cpu.max": "200000 100000"}, own="/")
    (tmp_path / "proc/self/cgroup").write_text("0::/kubepods/pod1/ctr\n")
    quota, note = read_cpu_quota(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))
    assert isinstance(quota, CpuQuota) and quota.cpus == 2.0 and note == ""


def test_v1_quota_and_no_limit(tmp_path: pathlib.Path) -> None:
    files = {"job/step/cpu.cfs_quota_us": "250000", "job/step/cpu.cfs_period_us": "100000"}
    quota, note = quota_of(tmp_path / "a", files, version=1)
    assert isinstance(quota, CpuQuota) and (quota.cpus, quota.version, note) == (2.5, 1, "")
    files["job/step/cpu.cfs_quota_us"] = "-1"
    assert quota_of(tmp_path / "b", files, version=1) == (None, "")


def test_no_cgroup_tree_or_no_procfs_is_no_quota(tmp_path: pathlib.Path) -> None:
    assert read_cpu_quota(procfs=str(tmp_path), sysfs=str(tmp_path)) == (None, "")


@pytest.mark.parametrize(
    ("text", "version"),
    [("lots", 2), ("100000", 2), ("0 100000", 2), ("100000 0", 2), ("-5 100000", 2), ("x", 1)],
)
def test_malformed_quota_file_is_a_note(tmp_path: pathlib.Path, text: str, version: int) -> None:
    name = "cpu.max" if version == 2 else "cpu.cfs_quota_us"
    quota, note = quota_of(tmp_path, {f"job/step/{name}": text}, version=version)
    assert quota is None
    assert note.startswith("cgroup CPU quota not read: malformed cgroup file ")
    assert name in note and repr(text) in note and "\n" not in note


def test_v1_quota_without_a_period_is_a_note(tmp_path: pathlib.Path) -> None:
    quota, note = quota_of(tmp_path, {"job/step/cpu.cfs_quota_us": "50000"}, version=1)
    assert quota is None and "cpu.cfs_period_us: missing" in note


@pytest.mark.parametrize("kind", ["fifo", "devzero", "big"])
def test_hostile_cpu_max_is_a_note_never_a_hang(tmp_path: pathlib.Path, kind: str) -> None:
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", {})
    plant(tmp_path / "sys", "fs/cgroup/job/step/cpu.max", kind)
    got: list[tuple[object, str]] = []
    reader = threading.Thread(
        target=lambda: got.append(
            read_cpu_quota(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))
        ),
        daemon=True,
    )
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), f"reading a {kind} as cpu.max hung"
    [(quota, note)] = got
    assert quota is None and note.startswith("cgroup CPU quota not read: ")
    assert "cpu.max" in note and "\n" not in note


def test_a_climbing_cgroup_path_is_a_note(tmp_path: pathlib.Path) -> None:
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", {})
    (tmp_path / "proc/self/cgroup").write_text("0::/job/../../../etc\n")
    quota, note = read_cpu_quota(procfs=str(tmp_path / "proc"), sysfs=str(tmp_path / "sys"))
    assert quota is None and "is not a plain absolute path" in note


@pytest.mark.parametrize("value", ["", " 4", "4 ", "+4", "0", "-1", "04", "٤", "4.0", "99999999"])
def test_malformed_slurm_cpus_per_task_is_a_note(tmp_path: pathlib.Path, value: str) -> None:
    budget = read_cpu_budget(
        {"SLURM_CPUS_PER_TASK": value},
        procfs=str(tmp_path),
        sysfs=str(tmp_path),
        allowed_cpus={0, 1},
    )
    assert budget.slurm_cpus_per_task is None
    [note] = budget.notes
    assert note.startswith("SLURM_CPUS_PER_TASK=") and note.endswith(": left out")


def test_budget_takes_the_tightest_source(tmp_path: pathlib.Path) -> None:
    fake_cgroup(tmp_path / "sys", tmp_path / "proc", {"job/step/cpu.max": "300000 100000"})
    budget = read_cpu_budget(
        {"SLURM_CPUS_PER_TASK": "4"},
        procfs=str(tmp_path / "proc"),
        sysfs=str(tmp_path / "sys"),
        allowed_cpus=range(8),
    )
    assert (budget.slurm_cpus_per_task, budget.usable_cpus, budget.notes) == (4, 3.0, ())
    assert budget.to_json()["cgroup_quota_cpus"] == 3.0
    assert room_for_workers(budget) == 2


def test_four_workers_on_one_slurm_cpu() -> None:
    budget = CpuBudget(affinity=frozenset({0}), slurm_cpus_per_task=1)
    assert sizing_findings(budget, num_workers=4) == [
        "4 DataLoader workers and the main process share 1 CPU (SLURM_CPUS_PER_TASK=1, "
        "affinity 0): expect them to wait on each other; ask for --cpus-per-task=5 or use "
        "num_workers=0"
    ]


def test_a_fractional_quota_under_a_wide_mask() -> None:
    quota = CpuQuota(quota_us=450000, period_us=100000, path="/c/cpu.max", version=2)
    budget = CpuBudget(affinity=frozenset(range(32)), quota=quota)
    [line] = sizing_findings(budget, num_workers=4)
    assert line.startswith(
        "4 DataLoader workers and the main process share 4.5 CPUs (cgroup CPU quota "
        "450000/100000 in /c/cpu.max, affinity 0-31)"
    )
    assert line.endswith("raise the CPU limit to 5 (cgroup cpu.max; docker --cpus, a pod's "
                         "limits.cpu) or use num_workers=3")  # fmt: skip
    assert sizing_findings(budget, num_workers=3) == []


def test_a_well_sized_job_has_no_finding() -> None:
    budget = CpuBudget(affinity=frozenset(range(8)), slurm_cpus_per_task=8)
    assert sizing_findings(budget, num_workers=7, main_threads=8) == []
    assert sizing_findings(budget, num_workers=0, main_threads=1) == []


def test_main_threads_beyond_the_quota() -> None:
    quota = CpuQuota(quota_us=200000, period_us=100000, path="/c/cpu.max", version=2)
    budget = CpuBudget(affinity=frozenset(range(64)), quota=quota)
    assert sizing_findings(budget, num_workers=1, main_threads=64) == [
        "torch runs 64 threads in the main process, which may use 2 CPUs (cgroup CPU quota "
        "200000/100000 in /c/cpu.max, affinity 0-63): they will wait on each other; set "
        "OMP_NUM_THREADS=2 or torch.set_num_threads(2)"
    ]
    assert sizing_findings(budget, num_workers=1, main_threads=2) == []


def test_gpu_on_another_numa_node_than_the_cpus(tmp_path: pathlib.Path) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0-31", 1: "32-63"}, [0, 0, 0, 1])
    topo = read_topology(sysfs, environ={}, allowed_cpus=range(32))
    far = placement(topo, 3, num_workers=2)
    assert numa_finding(topo, far) == (
        "GPU 3 is on NUMA node 1 but this process may only use CPUs of node 0 (0-31): bind "
        "with scripts/slurm/bind.sh or srun --cpu-bind"
    )
    assert numa_finding(topo, placement(topo, 0, num_workers=2)) is None
    # The placement is the tightest source when it is: 32 CPUs among ranks 0-3 of node 0.
    budget = CpuBudget(affinity=frozenset(range(32)))
    [line] = sizing_findings(budget, num_workers=8, placement=far)
    assert "(placement of GPU 3: CPUs 24-31, affinity 0-31)" in line
    assert line.endswith("run fewer ranks per NUMA node or use num_workers=7")
