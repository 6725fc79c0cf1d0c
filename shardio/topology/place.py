"""Where each local rank runs: its GPU's NUMA node's share of the usable CPUs."""

from __future__ import annotations

from shardio.errors import UsageError
from shardio.topology.cpulist import format_cpulist
from shardio.topology.model import Gpu, Placement, Topology

__all__ = ["placement"]


def _node_of(topology: Topology, gpu: Gpu) -> int | None:
    if gpu.numa_node is None:
        return next(iter(topology.nodes)) if len(topology.nodes) == 1 else None
    return gpu.numa_node if gpu.numa_node in topology.nodes else None


def _core_groups(topology: Topology, cpus: frozenset[int]) -> list[frozenset[int]]:
    """``cpus`` grouped by physical core, in CPU order."""
    groups = [core & cpus for core in topology.cores if core & cpus]
    covered = frozenset().union(*groups) if groups else frozenset()
    groups += [frozenset({c}) for c in cpus - covered]
    return sorted(groups, key=min)


def _usable(topology: Topology) -> tuple[frozenset[int], bool, str]:
    """The CPUs the node's local ranks split, whether they are this rank's own already, and
    what they are (for messages).

    bind.sh's share (``SHARDIO_BOUND_CPUS``, while this process's mask is within it) is
    this rank's own. Else, under a SLURM ``mask_cpu``/``map_cpu`` binding (``--cpu-bind=
    cores`` included), the union of the masks SLURM gave the node's tasks is split: this
    process's mask may have been widened since (``numactl --cpunodebind``), and a widened
    mask taken as the task's own made co-located ranks share cores. Else the allowed mask.
    """
    allowed = topology.allowed_cpus
    bound = topology.bound_cpus
    if bound is not None and allowed <= bound:
        return allowed, True, f"the CPUs bind.sh gave this task ({format_cpulist(allowed)})"
    step = topology.slurm.step_cpus
    if step is not None:
        return step, False, f"the CPUs SLURM gave this node's tasks ({format_cpulist(step)})"
    return allowed, False, f"this process's allowed CPUs ({format_cpulist(allowed)})"


def _cpu_nodes(topology: Topology, usable: frozenset[int], ranks: int) -> list[int | None]:
    """The NUMA node whose CPUs each local rank ``0..ranks-1`` splits with its peers.

    Its GPU's node when some of that node's CPUs are usable; else (the node is unknown, or
    the job's CPUs all lie elsewhere) the node with the most usable CPUs, so that such a
    rank still gets CPUs of its own instead of overlapping another's; None when no node
    holds a usable CPU (every rank then splits the usable CPUs).
    """
    counts = {n: len(cpus & usable) for n, cpus in topology.nodes.items()}
    best = max(sorted(counts), key=lambda n: counts[n]) if any(counts.values()) else None
    gpus = topology.gpus
    out: list[int | None] = []
    for q in range(ranks):
        node = _node_of(topology, gpus[q % len(gpus)])
        out.append(node if node is not None and counts.get(node) else best)
    return out


def _assign(
    topology: Topology, usable: frozenset[int], homes: list[int | None]
) -> tuple[list[list[frozenset[int]]], tuple[frozenset[int], str] | None]:
    """Every local rank's cores (``homes[q]``: the node rank q splits), and the ranks that
    did not get a core of their home node, with why.

    A node's usable cores are split evenly among its ranks, whole cores in order. Ranks a
    node has no core left for take the usable cores of nodes no rank calls home (disjoint
    still, if farther from their GPU); only when there are none left either do ranks share
    cores, round robin.
    """
    by_home: dict[int | None, list[int]] = {}
    for q, home in enumerate(homes):
        by_home.setdefault(home, []).append(q)
    shares: list[list[frozenset[int]]] = [[] for _ in homes]
    overflow: list[int] = []
    for home, ranks in by_home.items():
        pool = topology.nodes[home] & usable if home is not None else usable
        groups = _core_groups(topology, pool)
        k, n = len(ranks), len(groups)
        if n >= k:
            for i, q in enumerate(ranks):
                shares[q] = groups[i * n // k : (i + 1) * n // k]
        else:
            for i, q in enumerate(ranks[:n]):
                shares[q] = [groups[i]]
            overflow += ranks[n:]
    if not overflow:
        return shares, None
    overflow.sort()
    claimed = usable if None in by_home else frozenset()
    for home in by_home:
        if home is not None:
            claimed |= topology.nodes[home]
    spare = _core_groups(topology, usable - claimed)
    every = _core_groups(topology, usable)
    k, n = len(overflow), len(spare)
    for i, q in enumerate(overflow):
        if n >= k:
            shares[q] = spare[i * n // k : (i + 1) * n // k]
        elif i < n:
            shares[q] = [spare[i]]
        else:  # fewer cores than ranks: share, round robin
            shares[q] = [every[(i - n) % len(every)]]
    why = (
        f"{len(homes)} local ranks and {len(every)} usable core(s): a NUMA node has fewer "
        "cores than the ranks whose GPUs it holds, so some use cores of another node"
        + ("" if n >= k else ", and some share cores")
    )
    return shares, (frozenset(overflow), why)


def placement(
    topology: Topology,
    local_rank: int,
    *,
    num_workers: int,
    ranks_per_node: int | None = None,
) -> Placement:
    """Where local rank ``local_rank`` runs: its GPU, NUMA node, CPUs and thread count.

    Rank r of the node uses GPU ``r % len(gpus)``. Its CPUs are its GPU's NUMA node's share
    of the usable CPUs: the CPUs SLURM gave the node's tasks under a ``mask_cpu``/``map_cpu``
    binding (``srun --cpu-bind=cores`` included, however this process's mask was widened
    since), else the CPUs this process may use; when several local ranks' GPUs share that
    node, its cores are split evenly among them (whole cores, in order), so co-located
    ranks never share a core while there are enough. A task that scripts/slurm/bind.sh
    already pinned to its share (``SHARDIO_BOUND_CPUS``) keeps it whole. When the node is
    unknown or none of its CPUs is usable, the usable CPUs are split instead, and
    ``reason`` says why.

    Args:
        topology: from :func:`read_topology`.
        local_rank: the rank on this node (>= 0).
        num_workers: DataLoader workers per rank (>= 0), for the thread count.
        ranks_per_node: local ranks on this node; default one per visible GPU.

    Raises:
        UsageError: no GPU, or a negative rank, worker count or rank count.
    """
    if not topology.gpus:
        raise UsageError(f"no NVIDIA GPU found in {topology.sysfs}: nothing to place")
    if local_rank < 0 or num_workers < 0:
        raise UsageError(f"local rank and workers must be >= 0, got {local_rank} and {num_workers}")
    ranks = len(topology.gpus) if ranks_per_node is None else ranks_per_node
    if ranks < 1:
        raise UsageError(f"ranks per node must be at least 1, got {ranks}")
    slot = local_rank % ranks
    gpus = topology.gpus
    gpu = gpus[slot % len(gpus)]
    node = _node_of(topology, gpu)
    usable, own, usable_text = _usable(topology)
    reason: str | None = None
    if node is None and gpu.numa_node is not None:
        reason = f"GPU {gpu.index}'s NUMA node {gpu.numa_node} is not listed in sysfs"
    elif node is None:
        reason = f"the NUMA node of GPU {gpu.index} ({gpu.pci_bus_id}) is unknown"
    elif not topology.nodes[node] & usable:
        reason = (
            f"none of NUMA node {node}'s CPUs ({format_cpulist(topology.nodes[node])}) is in "
            f"{usable_text}"
        )
    if own:  # bind.sh gave this task its share already
        pool = (topology.nodes[node] & usable if node is not None else usable) or usable
        peers: tuple[int, ...] = (slot,)
        mine = _core_groups(topology, pool)
    else:
        homes = _cpu_nodes(topology, usable, ranks)
        home = homes[slot]
        peers = tuple(q for q in range(ranks) if homes[q] == home)
        if reason and home is not None:
            reason += f": it shares NUMA node {home}'s CPUs instead"
        shares, crowded = _assign(topology, usable, homes)
        mine = shares[slot]
        if crowded is not None and slot in crowded[0]:
            reason = reason or crowded[1]
    cpus = frozenset().union(*mine)
    numactl = None
    if node is not None and cpus != topology.nodes[node]:
        # memory next to the GPU, on this rank's share of the CPUs only
        numactl = f"numactl --physcpubind={format_cpulist(cpus)} --membind={node}"
    elif node is not None:
        numactl = f"numactl --cpunodebind={node} --membind={node}"
    return Placement(
        local_rank=local_rank,
        gpu=gpu,
        numa_node=node,
        cpus=cpus,
        cores=len(mine),
        shared_with=peers,
        reason=reason,
        num_workers=num_workers,
        threads=max(1, len(mine) // (1 + num_workers)),
        numactl=numactl,
    )


def local_gpu(topology: Topology, local_rank: int) -> int | None:
    """The CUDA ordinal local rank ``local_rank`` uses in this process: ``local_rank``
    modulo the GPUs it sees (0 when ``bind.sh`` narrowed ``CUDA_VISIBLE_DEVICES`` to the
    rank's one GPU); None when it sees none.

    Raises:
        UsageError: a negative rank.
    """
    if local_rank < 0:
        raise UsageError(f"local rank must be >= 0, got {local_rank}")
    gpus = topology.gpus
    return gpus[local_rank % len(gpus)].index if gpus else None
