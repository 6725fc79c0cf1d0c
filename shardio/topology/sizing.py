"""Whether a job's DataLoader workers and threads fit the CPUs it may really use.

A job given one CPU for four DataLoader workers runs many times slower than one given five,
and nothing says why. The CPUs a process may really use are the tightest of: its affinity
mask (``os.sched_getaffinity``), its cgroup's CPU quota (:mod:`shardio.topology.cgroup`),
``SLURM_CPUS_PER_TASK`` (what the job asked for, whether or not srun bound it) and, where
the loader pins its workers, the rank's placement (:func:`~shardio.topology.placement`).
:func:`sizing_findings` compares the main process and ``W`` workers (and the main
process's threads) with them, and the rank's GPU's NUMA node with its CPUs: one line per
problem, saying what to change; none when the job is well sized. The loader logs them once
(:mod:`shardio.runtime.sizing`); ``shardio topo`` prints them in its "job sizing" section.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardio._env import env_int
from shardio.errors import UsageError
from shardio.topology.cgroup import CpuQuota, read_cpu_quota
from shardio.topology.cpulist import MAX_CPU, format_cpulist
from shardio.topology.model import Placement, Topology

__all__ = [
    "SLURM_CPUS_ENV",
    "CpuBudget",
    "numa_finding",
    "read_cpu_budget",
    "room_for_workers",
    "sizing_findings",
]

SLURM_CPUS_ENV = "SLURM_CPUS_PER_TASK"


def _cpus(count: float) -> str:
    """``1`` -> ``"1 CPU"``, ``1.5`` -> ``"1.5 CPUs"``."""
    return f"{count:g} CPU" + ("" if count == 1 else "s")


@dataclass(frozen=True, kw_only=True)
class CpuBudget:
    """The CPUs this process may use, by each source.

    Attributes:
        affinity: its affinity mask.
        quota: its cgroup's CPU quota; None when none is set (or it could not be read).
        slurm_cpus_per_task: ``SLURM_CPUS_PER_TASK``; None when not set (or malformed).
        notes: what could not be read, one line each (a FIFO as ``cpu.max``, a malformed
            ``SLURM_CPUS_PER_TASK``, ...).
    """

    affinity: frozenset[int]
    quota: CpuQuota | None = None
    slurm_cpus_per_task: int | None = None
    notes: tuple[str, ...] = ()

    def limits(self) -> list[tuple[float, str, str]]:
        """(CPUs, what says so, what to ask for more) of each source, tightest first."""
        out: list[tuple[float, str, str]] = [
            (float(len(self.affinity)), f"affinity {format_cpulist(self.affinity)}", "affinity")
        ]
        if self.quota is not None:
            out.append((self.quota.cpus, self.quota.describe(), "cgroup"))
        if self.slurm_cpus_per_task is not None:
            out.append(
                (float(self.slurm_cpus_per_task), f"{SLURM_CPUS_ENV}={self.slurm_cpus_per_task}",
                 "slurm")
            )  # fmt: skip
        return sorted(out, key=lambda limit: limit[0])

    @property
    def usable_cpus(self) -> float:
        """The tightest of the sources (CPUs of time for a quota: may be fractional)."""
        return self.limits()[0][0]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data: each source, the usable CPUs and the notes."""
        quota = self.quota
        return {
            "affinity": format_cpulist(self.affinity),
            "affinity_cpus": len(self.affinity),
            "cgroup_quota_cpus": quota.cpus if quota is not None else None,
            "cgroup_quota_file": quota.path if quota is not None else None,
            "slurm_cpus_per_task": self.slurm_cpus_per_task,
            "usable_cpus": self.usable_cpus,
            "notes": list(self.notes),
        }


def read_cpu_budget(
    environ: Mapping[str, str],
    *,
    procfs: str = "/proc",
    sysfs: str = "/sys",
    allowed_cpus: Iterable[int] | None = None,
) -> CpuBudget:
    """The CPUs this process may use: its affinity, its cgroup quota, ``SLURM_CPUS_PER_TASK``.

    A few small reads (``self/cgroup`` and the quota files of its cgroup's levels), none
    blocking. Nothing here raises for what it reads: a malformed ``SLURM_CPUS_PER_TASK``
    (parsed strictly, :func:`shardio._env.env_int`) or an unreadable cgroup file is a note
    and that source is left out.

    Args:
        environ: the environment (``SLURM_CPUS_PER_TASK``).
        procfs: the procfs root.
        sysfs: the sysfs root (the cgroup tree is its ``fs/cgroup``).
        allowed_cpus: the affinity mask; ``os.sched_getaffinity(0)`` by default.
    """
    affinity = frozenset(os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus)
    notes: list[str] = []
    quota, note = read_cpu_quota(procfs=procfs, sysfs=sysfs)
    if note:
        notes.append(note)
    try:
        slurm = env_int(environ, SLURM_CPUS_ENV, minimum=1, maximum=MAX_CPU)
    except UsageError as exc:
        slurm = None
        notes.append(f"{exc}: left out")
    return CpuBudget(affinity=affinity, quota=quota, slurm_cpus_per_task=slurm, notes=tuple(notes))


def _advice(kind: str, processes: int) -> str:
    if kind == "cgroup":
        return (
            f"raise the CPU limit to {processes} (cgroup cpu.max; docker --cpus, a pod's "
            "limits.cpu)"
        )
    if kind == "placement":
        return "run fewer ranks per NUMA node"
    return f"ask for --cpus-per-task={processes}"


_PREFERRED = ("slurm", "cgroup", "placement", "affinity")  # which of equal limits to name


def _tightest(budget: CpuBudget, placement: Placement | None) -> tuple[float, str, str]:
    """(CPUs, what says so, kind) of the tightest source, the placement's CPUs included;
    of equal ones, SLURM's, then the quota's, then the placement's: what to change first.
    Every source at that limit is named, the affinity mask always."""
    limits = budget.limits()
    if placement is not None:
        share = (
            float(len(placement.cpus)),
            f"placement of GPU {placement.gpu.index}: CPUs {format_cpulist(placement.cpus)}",
            "placement",
        )
        limits.append(share)
    usable = min(limit[0] for limit in limits)
    tied = sorted((x for x in limits if x[0] == usable), key=lambda x: _PREFERRED.index(x[2]))
    said = [x[1] for x in tied if x[2] != "affinity"]
    said.append(f"affinity {format_cpulist(budget.affinity)}")
    return usable, ", ".join(said), tied[0][2]


def room_for_workers(budget: CpuBudget, placement: Placement | None = None) -> int:
    """The most DataLoader workers that, with the main process, get a CPU each (0: none)."""
    return max(0, math.floor(_tightest(budget, placement)[0]) - 1)


def sizing_findings(
    budget: CpuBudget,
    *,
    num_workers: int,
    main_threads: int | None = None,
    placement: Placement | None = None,
) -> list[str]:
    """What is mis-sized for a rank running ``num_workers`` DataLoader workers: one line each.

    - the main process and its workers outnumber the usable CPUs (the placement's CPUs
      count too when given: the loader pins its workers there);
    - the main process runs more threads (``main_threads``: torch's) than it may use CPUs
      (torch counts the affinity mask, not a cgroup quota or what SLURM granted).

    Args:
        budget: from :func:`read_cpu_budget`.
        num_workers: DataLoader workers per rank (>= 0).
        main_threads: the main process's threads; None: not checked.
        placement: the rank's placement, when its workers are pinned to it.

    Returns:
        The findings; empty when the job is well sized.
    """
    out: list[str] = []
    usable, said, kind = _tightest(budget, placement)
    processes = 1 + num_workers
    if num_workers > 0 and processes > usable:
        out.append(
            f"{num_workers} DataLoader worker{'s' if num_workers > 1 else ''} and the main "
            f"process share {_cpus(usable)} ({said}): expect them to wait on each other; "
            f"{_advice(kind, processes)} or use num_workers={room_for_workers(budget, placement)}"
        )
    own, said, _ = _tightest(budget, None)
    if main_threads is not None and main_threads > max(1, math.floor(own)):
        fit = max(1, math.floor(own))
        out.append(
            f"torch runs {main_threads} threads in the main process, which may use "
            f"{_cpus(own)} ({said}): they will wait on each other; set "
            f"OMP_NUM_THREADS={fit} or torch.set_num_threads({fit})"
        )
    return out


def numa_finding(topology: Topology, placement: Placement) -> str | None:
    """A line when the rank's GPU is on a NUMA node none of its CPUs belongs to; else None.

    The GPU's node must be known and listed; a machine of one node never has this problem.
    """
    node = placement.gpu.numa_node
    if node is None or node not in topology.nodes or placement.cpus & topology.nodes[node]:
        return None
    allowed = topology.allowed_cpus
    cpus = allowed if not allowed & topology.nodes[node] else placement.cpus
    homes = sorted(n for n, c in topology.nodes.items() if c & cpus)
    where = f"node {homes[0]}" if len(homes) == 1 else "nodes " + ", ".join(str(n) for n in homes)
    return (
        f"GPU {placement.gpu.index} is on NUMA node {node} but this process may only use CPUs "
        f"of {where} ({format_cpulist(cpus)}): bind with scripts/slurm/bind.sh or srun "
        "--cpu-bind"
    )
