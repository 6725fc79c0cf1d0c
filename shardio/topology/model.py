"""What the topology is made of: GPUs, SLURM's binding, the machine map and a placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardio.topology.cpulist import format_cpulist

__all__ = ["Gpu", "Placement", "SlurmBinding", "Topology"]


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """One NVIDIA GPU as this process sees it.

    Attributes:
        index: its CUDA ordinal in this process (after ``CUDA_VISIBLE_DEVICES``).
        pci_bus_id: e.g. ``"0000:07:00.0"``.
        numa_node: the NUMA node it is attached to; None when sysfs says -1 (unknown).
    """

    index: int
    pci_bus_id: str
    numa_node: int | None


@dataclass(frozen=True, kw_only=True)
class SlurmBinding:
    """What SLURM says about this task's CPU binding (reported; the mask is already applied).

    Attributes:
        cpu_bind: ``SLURM_CPU_BIND`` as given, e.g. ``"quiet,mask_cpu:0xF,0xF0"``.
        cpu_bind_type: ``SLURM_CPU_BIND_TYPE``, e.g. ``"mask_cpu:"``.
        cpu_bind_list: ``SLURM_CPU_BIND_LIST``: one mask (or CPU) per task of the node.
        task_cpus: this task's entry of that list (by ``SLURM_LOCALID``) when it is a
            ``mask_cpu`` or ``map_cpu`` list; else None.
        step_cpus: the union of that list's entries: the CPUs SLURM gave this node's tasks
            (what :func:`placement` splits among them); None without such a list.
        per_task: the list names several different entries (every task its own CPUs).
    """

    cpu_bind: str | None = None
    cpu_bind_type: str | None = None
    cpu_bind_list: str | None = None
    task_cpus: frozenset[int] | None = None
    step_cpus: frozenset[int] | None = None
    per_task: bool = False


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The GPUs, NUMA nodes and CPUs of this machine, as this process may use them.

    Attributes:
        sysfs: the sysfs root read.
        gpus: the NVIDIA GPUs in CUDA's order for this process.
        nodes: NUMA node -> its CPUs.
        allowed_cpus: the CPUs this process may run on (its affinity mask).
        cores: the physical cores as sets of SMT-sibling CPUs (from sysfs; each CPU its own
            core when sysfs does not say).
        local_rank: ``SLURM_LOCALID``, else ``LOCAL_RANK``; None when neither is set.
        cuda_visible_devices: ``CUDA_VISIBLE_DEVICES`` as given, or None.
        slurm: SLURM's CPU binding of this task.
        bound_cpus: ``SHARDIO_BOUND_CPUS``: the share scripts/slurm/bind.sh pinned this
            task to (its own CPUs, not to be split again while the mask is still within it).
        notes: what was assumed (unknown NUMA node, names instead of indices, ...).
    """

    sysfs: str
    gpus: tuple[Gpu, ...]
    nodes: dict[int, frozenset[int]]
    allowed_cpus: frozenset[int]
    cores: tuple[frozenset[int], ...] = ()
    local_rank: int | None = None
    cuda_visible_devices: str | None = None
    slurm: SlurmBinding = field(default_factory=SlurmBinding)
    bound_cpus: frozenset[int] | None = None
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The map as JSON-ready data (CPU sets as cpulist strings)."""
        return {
            "sysfs": self.sysfs,
            "nodes": [
                {"node": n, "cpus": format_cpulist(c), "cpu_count": len(c)}
                for n, c in sorted(self.nodes.items())
            ],
            "allowed_cpus": format_cpulist(self.allowed_cpus),
            "gpus": [
                {"index": g.index, "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node}
                for g in self.gpus
            ],
            "cuda_visible_devices": self.cuda_visible_devices,
            "local_rank": self.local_rank,
            "slurm": {
                "cpu_bind": self.slurm.cpu_bind,
                "cpu_bind_type": self.slurm.cpu_bind_type,
                "cpu_bind_list": self.slurm.cpu_bind_list,
                "task_cpus": (
                    format_cpulist(self.slurm.task_cpus)
                    if self.slurm.task_cpus is not None
                    else None
                ),
                "step_cpus": (
                    format_cpulist(self.slurm.step_cpus)
                    if self.slurm.step_cpus is not None
                    else None
                ),
                "per_task": self.slurm.per_task,
            },
            "bound_cpus": (
                format_cpulist(self.bound_cpus) if self.bound_cpus is not None else None
            ),
            "notes": list(self.notes),
        }


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one local rank runs.

    Attributes:
        local_rank: the rank on this node.
        gpu: its GPU.
        numa_node: the NUMA node its CPUs and memory come from; None when unknown.
        cpus: the CPUs to run on (never empty).
        cores: physical cores among ``cpus``.
        shared_with: the local ranks (this one included) whose GPUs share that NUMA node
            and split its cores.
        reason: why ``cpus`` is not the node's CPUs this process may use, or None.
        num_workers: DataLoader workers the thread count is for.
        threads: OMP_NUM_THREADS / torch threads per process (the main one and each worker),
            so that ``(1 + num_workers) * threads <= cores`` (at least 1).
        numactl: ``numactl --cpunodebind=N --membind=N`` when the CPUs are the whole node's;
            ``--physcpubind=LIST --membind=N`` when they are a share of it (or outside it);
            None when the node is unknown.
    """

    local_rank: int
    gpu: Gpu
    numa_node: int | None
    cpus: frozenset[int]
    cores: int
    shared_with: tuple[int, ...]
    reason: str | None
    num_workers: int
    threads: int
    numactl: str | None

    @property
    def taskset(self) -> str:
        """``taskset -c LIST`` with this rank's CPUs."""
        return f"taskset -c {format_cpulist(self.cpus)}"

    def to_json(self) -> dict[str, Any]:
        """Flat JSON-ready data (scripts/slurm/bind.sh relies on it having no nested object)."""
        return {
            "local_rank": self.local_rank,
            "gpu_index": self.gpu.index,
            "pci_bus_id": self.gpu.pci_bus_id,
            "numa_node": self.numa_node,
            "cpus": format_cpulist(self.cpus),
            "cpu_count": len(self.cpus),
            "cores": self.cores,
            "shared_with": list(self.shared_with),
            "reason": self.reason,
            "num_workers": self.num_workers,
            "omp_num_threads": self.threads,
            "torch_threads": self.threads,
            "numactl": self.numactl,
            "taskset": self.taskset,
        }
