"""The machine's GPU -> NUMA node -> CPU map, read from sysfs, and where each local rank runs.

Torch-free and CUDA-free: NVIDIA GPUs are found as PCI display controllers in
``<sysfs>/bus/pci/devices`` (vendor 0x10de, class 0x0302xx or 0x0300xx), numbered the way
CUDA numbers them with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (PCI bus id order), narrowed and
reordered by ``CUDA_VISIBLE_DEVICES`` when it holds indices. NUMA nodes and their CPUs come
from ``<sysfs>/devices/system/node/node*/cpulist``, physical cores (SMT siblings) from
``<sysfs>/devices/system/cpu/cpu*/topology/thread_siblings_list``. The sysfs root, the
environment and the allowed CPU mask are injectable, so tests describe any machine with a
fake tree.

:func:`placement` then gives one local rank its GPU, that GPU's NUMA node, the CPUs to run
on (the node's CPUs this process may use, split by whole cores among the local ranks whose
GPUs share the node), the ``numactl``/``taskset`` lines and the threads per process.

Under SLURM with ``ConstrainDevices``, ``CUDA_VISIBLE_DEVICES`` counts the job's GPUs from 0
while ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS`` name them on the node; the latter are then used
to find the physical GPU (assuming the driver's minor numbers follow PCI order, as they do
unless an administrator changed them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardio.errors import FormatError, UsageError

__all__ = [
    "Gpu",
    "Placement",
    "SlurmBinding",
    "Topology",
    "format_cpulist",
    "parse_cpulist",
    "placement",
    "read_topology",
]

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x030000, 0x030200)  # VGA-compatible and 3D controllers (the data-centre GPUs)
_MAX_CPU = 1 << 16  # far beyond any kernel's NR_CPUS: a larger number is a typo


def parse_cpulist(text: str, *, what: str = "CPU list") -> frozenset[int]:
    """The CPUs of a kernel cpulist such as ``"0-15,32-47"`` (empty text: no CPU).

    Raises:
        FormatError: ``text`` is not a cpulist; the message names ``what``.
    """
    stripped = text.strip()
    cpus: set[int] = set()
    if not stripped:
        return frozenset()
    for part in (p.strip() for p in stripped.split(",")):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise FormatError(f"malformed {what} {stripped!r}: {part!r} is not N or N-M")
        low, high = int(first), int(last) if dash else int(first)
        if low > high or high >= _MAX_CPU:
            raise FormatError(f"malformed {what} {stripped!r}: bad range {part!r}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 8}`` as the kernel writes it: ``"0-3,8"``."""
    ranges: list[str] = []
    run: list[int] = []
    for cpu in sorted(cpus):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            ranges.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [cpu]
    if run:
        ranges.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(ranges)


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
        per_task: the list names several different entries: every task of the node has its
            own CPUs, so local ranks must not split them again.
    """

    cpu_bind: str | None = None
    cpu_bind_type: str | None = None
    cpu_bind_list: str | None = None
    task_cpus: frozenset[int] | None = None
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
                "per_task": self.slurm.per_task,
            },
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
        numactl: ``numactl --cpunodebind=N --membind=N``; ``--physcpubind=LIST
            --membind=N`` when the CPUs are not the node's; None when the node is unknown.
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


# -- reading sysfs ------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _hex(text: str | None) -> int | None:
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


def _pci_sort_key(bus_id: str) -> tuple[int, ...]:
    """``"0000:07:00.0"`` as numbers, so bus 0x10 follows bus 0x9."""
    try:
        domain, bus, rest = bus_id.split(":")
        device, function = rest.split(".")
        return (int(domain, 16), int(bus, 16), int(device, 16), int(function, 16))
    except ValueError:
        return (1 << 32,)  # not a PCI address: last, then by name


def _nvidia_gpus(sysfs: str) -> list[tuple[str, int | None]]:
    """(pci bus id, numa node) of every NVIDIA GPU, in PCI bus id order."""
    root = os.path.join(sysfs, "bus", "pci", "devices")
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found: list[tuple[str, int | None]] = []
    for name in sorted(names, key=lambda n: (_pci_sort_key(n), n)):
        dev = os.path.join(root, name)
        if _hex(_read(os.path.join(dev, "vendor"))) != NVIDIA_VENDOR:
            continue
        if _hex(_read(os.path.join(dev, "class"))) not in GPU_CLASSES:
            continue
        node_text = _read(os.path.join(dev, "numa_node"))
        try:
            node = int(node_text) if node_text is not None else -1
        except ValueError:
            node = -1
        found.append((name.lower(), node if node >= 0 else None))
    return found


def _numa_nodes(sysfs: str, allowed: frozenset[int]) -> tuple[dict[int, frozenset[int]], str]:
    """NUMA node -> CPUs, and a note when sysfs lists no node."""
    root = os.path.join(sysfs, "devices", "system", "node")
    nodes: dict[int, frozenset[int]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        path = os.path.join(root, name, "cpulist")
        text = _read(path)
        if text is None:
            continue
        nodes[int(name[4:])] = parse_cpulist(text, what=f"cpulist in {path}")
    if nodes:
        return nodes, ""
    online_path = os.path.join(sysfs, "devices", "system", "cpu", "online")
    online = _read(online_path)
    cpus = parse_cpulist(online, what=f"CPU list in {online_path}") if online else allowed
    return {0: cpus}, "sysfs lists no NUMA node: one node 0 assumed"


def _cores(sysfs: str, cpus: Iterable[int]) -> tuple[frozenset[int], ...]:
    """The physical cores of ``cpus`` as SMT-sibling sets (a CPU alone when sysfs is silent)."""
    seen: dict[int, frozenset[int]] = {}
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        path = os.path.join(
            sysfs, "devices", "system", "cpu", f"cpu{cpu}", "topology", "thread_siblings_list"
        )
        text = _read(path)
        try:
            siblings = parse_cpulist(text) if text else frozenset()
        except FormatError:
            siblings = frozenset()
        core = siblings if cpu in siblings else frozenset({cpu})
        for member in core:
            seen.setdefault(member, core)
    return tuple(sorted(set(seen.values()), key=min))


def _index_list(text: str | None) -> list[int] | None:
    """``"0,1,3"`` as ints; None when any entry is not a plain index."""
    if text is None or not text.strip():
        return None
    items = [t.strip() for t in text.split(",")]
    return [int(t) for t in items] if all(t.isdigit() for t in items) else None


def _visible_gpus(count: int, env: Mapping[str, str]) -> tuple[list[int], list[str]]:
    """The physical GPUs (PCI order positions) CUDA numbers 0, 1, ... here, and notes."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return list(range(count)), []
    if not cvd.strip() or cvd.strip() == "NoDevFiles":
        return [], []
    tokens = [t.strip() for t in cvd.split(",")]
    if not all(t.lstrip("-").isdigit() for t in tokens):
        note = (
            f"CUDA_VISIBLE_DEVICES={cvd} names GPUs, not indices: every GPU is shown in PCI order"
        )
        return list(range(count)), [note]
    wanted: list[int] = []
    for t in tokens:  # CUDA stops at the first invalid entry
        index = int(t)
        if index < 0 or index in wanted:
            break
        wanted.append(index)
    notes: list[str] = []
    slurm = _index_list(env.get("SLURM_STEP_GPUS")) or _index_list(env.get("SLURM_JOB_GPUS"))
    if slurm and not set(wanted) <= set(slurm) and all(i < len(slurm) for i in wanted):
        # A device cgroup shows CUDA only the job's GPUs, counted from 0: SLURM names them.
        wanted = [slurm[i] for i in wanted]
        notes.append(f"CUDA_VISIBLE_DEVICES={cvd} read as the job's GPUs {slurm} (SLURM)")
    visible: list[int] = []
    for index in wanted:
        if index >= count:
            notes.append(f"CUDA_VISIBLE_DEVICES={cvd}: there is no GPU {index} (of {count})")
            break
        visible.append(index)
    return visible, notes


def _slurm_binding(env: Mapping[str, str]) -> SlurmBinding:
    bind = env.get("SLURM_CPU_BIND") or None
    kind = env.get("SLURM_CPU_BIND_TYPE") or None
    listed = env.get("SLURM_CPU_BIND_LIST") or None
    if bind is None and kind is None and listed is None:
        return SlurmBinding()
    entries = [e.strip() for e in listed.split(",")] if listed else []
    local = env.get("SLURM_LOCALID", "")
    cpus: frozenset[int] | None = None
    if entries and local.isdigit() and kind:
        entry = entries[int(local) % len(entries)]
        try:
            if kind.startswith("mask_cpu"):
                mask = int(entry, 16)
                cpus = frozenset(i for i in range(mask.bit_length()) if mask >> i & 1)
            elif kind.startswith("map_cpu"):
                cpus = frozenset({int(entry, 0)})
        except ValueError:
            cpus = None
    per_task = cpus is not None and len(set(entries)) > 1
    return SlurmBinding(
        cpu_bind=bind, cpu_bind_type=kind, cpu_bind_list=listed, task_cpus=cpus, per_task=per_task
    )


def read_topology(
    sysfs: str = "/sys",
    *,
    environ: Mapping[str, str] | None = None,
    allowed_cpus: Iterable[int] | None = None,
) -> Topology:
    """Read this machine's GPU -> NUMA node -> CPU map.

    Args:
        sysfs: the sysfs root (a fake tree in tests).
        environ: the environment (``CUDA_VISIBLE_DEVICES``, ``SLURM_*``, ``LOCAL_RANK``);
            this process's by default.
        allowed_cpus: the CPUs this process may use; ``os.sched_getaffinity(0)`` by default.

    Raises:
        UsageError: ``sysfs`` is not a directory, or no CPU is allowed.
        FormatError: a cpulist in it is malformed (the message names the file).
    """
    if not os.path.isdir(sysfs):
        raise UsageError(f"no sysfs at {sysfs}: not a directory")
    env = os.environ if environ is None else environ
    allowed = frozenset(os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus)
    if not allowed:
        raise UsageError("no CPU is allowed to this process: nothing to place")
    nodes, nodes_note = _numa_nodes(sysfs, allowed)
    notes = [nodes_note] if nodes_note else []
    physical = _nvidia_gpus(sysfs)
    visible, gpu_notes = _visible_gpus(len(physical), env)
    notes += gpu_notes
    gpus = tuple(
        Gpu(index=i, pci_bus_id=physical[p][0], numa_node=physical[p][1])
        for i, p in enumerate(visible)
    )
    if any(g.numa_node is None for g in gpus):
        notes.append(
            "sysfs gives no NUMA node (-1) for some GPU: "
            + ("node 0, the only one, is used" if len(nodes) == 1 else "its CPUs are unknown")
        )
    local = next(
        (int(env[k]) for k in ("SLURM_LOCALID", "LOCAL_RANK") if env.get(k, "").isdigit()), None
    )
    all_cpus = frozenset().union(*nodes.values()) | allowed
    return Topology(
        sysfs=sysfs,
        gpus=gpus,
        nodes=nodes,
        allowed_cpus=allowed,
        cores=_cores(sysfs, all_cpus),
        local_rank=local,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        slurm=_slurm_binding(env),
        notes=tuple(notes),
    )


# -- placing ranks --------------------------------------------------------------------------


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


def placement(
    topology: Topology,
    local_rank: int,
    *,
    num_workers: int,
    ranks_per_node: int | None = None,
) -> Placement:
    """Where local rank ``local_rank`` runs: its GPU, NUMA node, CPUs and thread count.

    Rank r of the node uses GPU ``r % len(gpus)``. The CPUs are its GPU's NUMA node's CPUs
    that this process may use; when several local ranks' GPUs share that node, its cores
    are split evenly among them (whole cores, in order), unless SLURM already gave every task
    CPUs of its own. When the node is unknown or none of its CPUs is allowed, the allowed
    mask is used, and ``reason`` says why.

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
    reason: str | None = None
    pool = topology.nodes[node] & topology.allowed_cpus if node is not None else frozenset()
    numactl = None if node is None else f"numactl --cpunodebind={node} --membind={node}"
    if node is None and gpu.numa_node is not None:
        reason = f"GPU {gpu.index}'s NUMA node {gpu.numa_node} is not listed in sysfs"
    elif node is None:
        reason = f"the NUMA node of GPU {gpu.index} ({gpu.pci_bus_id}) is unknown"
    elif not pool:
        reason = (
            f"none of NUMA node {node}'s CPUs ({format_cpulist(topology.nodes[node])}) is in "
            f"this process's allowed CPUs ({format_cpulist(topology.allowed_cpus)})"
        )
    elsewhere = node is not None and not pool
    if not pool:
        pool = topology.allowed_cpus
    if topology.slurm.per_task:
        peers: tuple[int, ...] = (slot,)  # SLURM gave this task its own CPUs
    else:
        peers = tuple(q for q in range(ranks) if _node_of(topology, gpus[q % len(gpus)]) == node)
    groups = _core_groups(topology, pool)
    share, k = peers.index(slot), len(peers)
    if len(groups) >= k:
        mine = groups[share * len(groups) // k : (share + 1) * len(groups) // k]
    else:  # fewer cores than ranks on the node: one core each, round robin
        mine = [groups[share % len(groups)]]
        reason = reason or f"{k} local ranks share {len(groups)} core(s) of NUMA node {node}"
    cpus = frozenset().union(*mine)
    if elsewhere:  # memory next to the GPU still, but on CPUs this process may use
        numactl = f"numactl --physcpubind={format_cpulist(cpus)} --membind={node}"
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
