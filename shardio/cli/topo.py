"""``shardio topo``: print the GPU -> NUMA node -> CPU map and each local rank's binding."""

from __future__ import annotations

import argparse
import json
import os

from shardio.cli.common import EXIT_OK, add_whole_number
from shardio.errors import UsageError
from shardio.topology import Placement, Topology, format_cpulist, placement, read_topology
from shardio.topology.sysfs import SYSFS_ENV

__all__ = ["HELP", "add_arguments", "run"]


HELP = "show the GPU -> NUMA node -> CPU map and each local rank's CPU binding"
DESCRIPTION = (
    "Read the NVIDIA GPUs, NUMA nodes and allowed CPUs from sysfs and print, "
    "per local rank, its GPU, NUMA node, CPUs, numactl/taskset lines and thread counts."
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
        "DataLoader workers per rank, for the thread counts (default 0)",
        metavar="W",
    )
    parser.add_argument(
        "--sysfs",
        default=None,
        metavar="ROOT",
        help=f"the sysfs root to read (default ${SYSFS_ENV} or /sys)",
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
    topo = read_topology(sysfs)
    placed = _placements(topo, args)
    if args.json:
        out = topo.to_json()
        out["workers"] = args.workers
        out["placements"] = [p.to_json() for p in placed]  # last: bind.sh reads the first
        if not topo.gpus:
            out["message"] = _no_gpu(sysfs)
        print(json.dumps(out, indent=1))
        return EXIT_OK
    _print_map(topo)
    if not topo.gpus:
        print(_no_gpu(sysfs))
        return EXIT_OK
    for p in placed:
        _print_placement(p)
    return EXIT_OK


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
