"""``shardio topo``: print the GPU -> NUMA node -> CPU map and each local rank's binding."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from shardio.cli.common import EXIT_OK, add_whole_number
from shardio.errors import UsageError
from shardio.topology import Placement, Topology, format_cpulist, placement, read_topology
from shardio.topology.cgroup import PROCFS_ENV
from shardio.topology.sizing import (
    CpuBudget,
    numa_finding,
    read_cpu_budget,
    room_for_workers,
    sizing_findings,
)
from shardio.topology.sysfs import SYSFS_ENV

__all__ = ["HELP", "add_arguments", "run"]


HELP = "show the GPU -> NUMA node -> CPU map and each local rank's CPU binding"
DESCRIPTION = (
    "Read the NVIDIA GPUs, NUMA nodes and allowed CPUs from sysfs and print, "
    "per local rank, its GPU, NUMA node, CPUs, numactl/taskset lines and thread counts; "
    "then the job's sizing: the CPUs it may use by each source (affinity, cgroup CPU quota, "
    "SLURM_CPUS_PER_TASK) and whether they have room for --workers W DataLoader workers."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio topo``."""
    parser.add_argument("--json", action="store_true", help="print the map as JSON (for scripts)")
    add_whole_number(
        parser,
        "--local-rank",
        None,
        "show this local rank only (default: one rank per visible GPU)",
        metavar="N",
    )
    add_whole_number(
        parser,
        "--workers",
        0,
        "DataLoader workers per rank, for the thread counts and the job sizing (default 0)",
        metavar="W",
    )
    parser.add_argument(
        "--sysfs",
        default=None,
        metavar="ROOT",
        help=f"the sysfs root to read (default ${SYSFS_ENV} or /sys; cgroups: ROOT/fs/cgroup)",
    )
    parser.add_argument(
        "--procfs",
        default=None,
        metavar="ROOT",
        help=f"the procfs root to read self/cgroup from (default ${PROCFS_ENV} or /proc)",
    )


def _placements(topo: Topology, args: argparse.Namespace) -> list[Placement]:
    if not topo.gpus:
        return []
    ranks = [args.local_rank] if args.local_rank is not None else range(len(topo.gpus))
    return [placement(topo, r, num_workers=args.workers) for r in ranks]


def _no_gpu(sysfs: str) -> str:
    return f"no NVIDIA GPU found in {os.path.join(sysfs, 'bus', 'pci', 'devices')}"


def run(args: argparse.Namespace) -> int:
    """Run ``shardio topo``."""
    if args.local_rank is not None and args.local_rank < 0:
        raise UsageError(f"--local-rank must be >= 0, got {args.local_rank}")
    if args.workers < 0:
        raise UsageError(f"--workers must be >= 0, got {args.workers}")
    sysfs = args.sysfs if args.sysfs is not None else os.environ.get(SYSFS_ENV) or "/sys"
    procfs = args.procfs if args.procfs is not None else os.environ.get(PROCFS_ENV) or "/proc"
    topo = read_topology(sysfs)
    placed = _placements(topo, args)
    budget = read_cpu_budget(os.environ, procfs=procfs, sysfs=sysfs)
    sizing = _sizing(topo, budget, placed, args.workers)
    if args.json:
        out = topo.to_json()
        out["workers"] = args.workers
        out["job_sizing"] = sizing
        out["placements"] = [p.to_json() for p in placed]  # last: bind.sh reads the first
        if not topo.gpus:
            out["message"] = _no_gpu(sysfs)
        print(json.dumps(out, indent=1))
        return EXIT_OK
    _print_map(topo)
    if not topo.gpus:
        print(_no_gpu(sysfs))
    for p in placed:
        _print_placement(p)
    _print_sizing(budget, sizing)
    return EXIT_OK


def _sizing(
    topo: Topology, budget: CpuBudget, placed: list[Placement], workers: int
) -> dict[str, Any]:
    """The job sizing section's data: each source, the room for workers, the warnings."""
    warnings = sizing_findings(budget, num_workers=workers)
    ranks = []
    for p in placed:
        ranks.append(
            {
                "local_rank": p.local_rank,
                "cpus": len(p.cpus),
                "room_for_workers": room_for_workers(budget, p),
            }
        )
        # The placement's own line only where it is tighter than the job's CPUs.
        tighter = len(p.cpus) < budget.usable_cpus
        found: list[str | None] = []
        if tighter:
            found += sizing_findings(budget, num_workers=workers, placement=p)
        found.append(numa_finding(topo, p))
        warnings += [f"local rank {p.local_rank}: {w}" for w in found if w and w not in warnings]
    room = min([room_for_workers(budget), *(r["room_for_workers"] for r in ranks)])
    return {
        **budget.to_json(),
        "workers": workers,
        "room_for_workers": room_for_workers(budget),
        "ranks": ranks,
        "room": workers <= room,
        "warnings": warnings,
    }


def _room(workers: int) -> str:
    return f"room for the main process and {workers} DataLoader worker" + "s" * (workers != 1)


def _print_sizing(budget: CpuBudget, sizing: dict[str, Any]) -> None:
    quota = budget.quota
    slurm = budget.slurm_cpus_per_task
    print("job sizing")
    print(f"  affinity             {format_cpulist(budget.affinity)} ({len(budget.affinity)})")
    print(
        "  cgroup CPU quota     "
        + (
            f"{quota.cpus:g} ({quota.quota_us}/{quota.period_us} in {quota.path})"
            if quota
            else "none"
        )
    )
    print(f"  SLURM_CPUS_PER_TASK  {slurm if slurm is not None else 'not set'}")
    print(f"  usable CPUs          {budget.usable_cpus:g}: {_room(sizing['room_for_workers'])}")
    for rank in sizing["ranks"]:
        placed = f"{rank['cpus']} CPU{'s' * (rank['cpus'] != 1)} placed"
        if budget.usable_cpus < rank["cpus"]:
            placed += f", {budget.usable_cpus:g} usable"
        print(f"  local rank {rank['local_rank']:<9} {placed}: {_room(rank['room_for_workers'])}")
    if not sizing["warnings"]:
        print(f"  --workers {sizing['workers']:<10} fits")
    for warning in sizing["warnings"]:
        print(f"  warning: {warning}")
    for note in budget.notes:
        print(f"  note: {note}")


def _node_name(node: int | None) -> str:
    return "unknown" if node is None else str(node)


def _print_map(topo: Topology) -> None:
    allowed = topo.allowed_cpus
    print(f"allowed CPUs  {format_cpulist(allowed)} ({len(allowed)})")
    for node, cpus in sorted(topo.nodes.items()):
        print(
            f"NUMA node {node:<3} CPUs {format_cpulist(cpus) or '-'} "
            f"({len(cpus)}, {len(cpus & allowed)} allowed)"
        )
    for gpu in topo.gpus:
        print(f"GPU {gpu.index:<9} {gpu.pci_bus_id}  NUMA node {_node_name(gpu.numa_node)}")
    slurm = topo.slurm
    if slurm.cpu_bind or slurm.cpu_bind_list:
        mine = slurm.task_cpus
        print(
            f"SLURM         SLURM_CPU_BIND={slurm.cpu_bind or ''} "
            f"SLURM_CPU_BIND_LIST={slurm.cpu_bind_list or ''}"
            + (f" (this task: CPUs {format_cpulist(mine)})" if mine is not None else "")
        )
        if slurm.step_cpus is not None:
            print(f"SLURM         the node's tasks: CPUs {format_cpulist(slurm.step_cpus)} (split)")
    if topo.bound_cpus is not None:
        print(f"bind.sh       this task: CPUs {format_cpulist(topo.bound_cpus)} (kept whole)")
    for note in topo.notes:
        print(f"note: {note}")


def _print_placement(p: Placement) -> None:
    node = _node_name(p.numa_node)
    print(
        f"local rank {p.local_rank}: GPU {p.gpu.index} ({p.gpu.pci_bus_id}), NUMA node {node}, "
        f"CPUs {format_cpulist(p.cpus)} ({p.cores} cores), OMP_NUM_THREADS={p.threads} for "
        f"the main process and each of {p.num_workers} worker(s)"
    )
    if p.numactl is not None:
        print(f"  {p.numactl} -- COMMAND")
    print(f"  {p.taskset} COMMAND")
    if len(p.shared_with) > 1:
        print(f"  NUMA node {node} is split among local ranks {', '.join(map(str, p.shared_with))}")
    if p.reason:
        print(f"  note: {p.reason}")
