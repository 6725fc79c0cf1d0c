"""Read the GPU -> NUMA node -> CPU map from sysfs (bounded, non-blocking reads)."""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Iterable, Mapping

from shardio._env import env_int
from shardio.errors import FormatError, StorageError, UsageError
from shardio.storage.files import read_regular
from shardio.topology.cpulist import CPU_NUMBER, parse_cpulist
from shardio.topology.model import Gpu, Topology
from shardio.topology.slurm import slurm_binding

__all__ = [
    "BOUND_CPUS_ENV",
    "GPU_CLASSES",
    "NVIDIA_VENDOR",
    "SYSFS_ENV",
    "SYSFS_MAX_BYTES",
    "read_attribute",
    "read_topology",
]

log = logging.getLogger(__name__)

NVIDIA_VENDOR = 0x10DE
BOUND_CPUS_ENV = "SHARDIO_BOUND_CPUS"  # set by scripts/slurm/bind.sh: the CPUs it gave the task
SYSFS_ENV = "SHARDIO_SYSFS"  # another sysfs root to read (tests, containers)
SYSFS_MAX_BYTES = 64 * 1024  # a sysfs attribute is at most a page; more is not sysfs
GPU_CLASSES = (0x030000, 0x030200)  # VGA-compatible and 3D controllers (the data-centre GPUs)
_INDEX = re.compile(r"-?[0-9]{1,6}")


def read_attribute(path: str, *, what: str = "sysfs file") -> str | None:
    """A kernel attribute's text (sysfs, procfs, cgroup); None when absent or unreadable.

    Opened without blocking and refused unless a regular file (a FIFO or a symlink to
    ``/dev/zero`` in a tree given with ``--sysfs``/``SHARDIO_SYSFS``), read up to 64 KiB:
    a bad tree is an error in bounded time, never a hang or a read until memory runs out.
    The last component may be a symlink (a fake tree made with ``cp -rs``); what it names
    must be a regular file.

    Raises:
        StorageError: the path is not a regular file (the message names ``what``).
        FormatError: the file is larger than 64 KiB.
    """
    try:
        data = read_regular(path, max_bytes=SYSFS_MAX_BYTES, what=what)
    except StorageError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        if exc.errno == errno.EINVAL:  # a FIFO, device, socket or directory
            raise
        log.debug("%s %s not read: %s", what, path, exc)
        return None
    return data.decode("ascii", errors="replace").strip()


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
        if _hex(read_attribute(os.path.join(dev, "vendor"))) != NVIDIA_VENDOR:
            continue
        if _hex(read_attribute(os.path.join(dev, "class"))) not in GPU_CLASSES:
            continue
        node_text = read_attribute(os.path.join(dev, "numa_node"))
        node = int(node_text) if node_text and _INDEX.fullmatch(node_text) else -1
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
        if not (name.startswith("node") and CPU_NUMBER.fullmatch(name[4:])):
            continue
        path = os.path.join(root, name, "cpulist")
        text = read_attribute(path)
        if text is None:
            continue
        nodes[int(name[4:])] = parse_cpulist(text, what=f"cpulist in {path}")
    if nodes:
        return nodes, ""
    online_path = os.path.join(sysfs, "devices", "system", "cpu", "online")
    online = read_attribute(online_path)
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
        text = read_attribute(path)
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
    return [int(t) for t in items] if all(CPU_NUMBER.fullmatch(t) for t in items) else None


def _visible_gpus(count: int, env: Mapping[str, str]) -> tuple[list[int], list[str]]:
    """The physical GPUs (PCI order positions) CUDA numbers 0, 1, ... here, and notes."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return list(range(count)), []
    if not cvd.strip() or cvd.strip() == "NoDevFiles":
        return [], []
    tokens = [t.strip() for t in cvd.split(",")]
    if not all(_INDEX.fullmatch(t) for t in tokens):
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
        UsageError: ``sysfs`` is not a directory, no CPU is allowed, or ``SLURM_LOCALID``/
            ``LOCAL_RANK`` is malformed (the message names it).
        FormatError: a cpulist in it (or ``SHARDIO_BOUND_CPUS``) is malformed, or a sysfs
            file is larger than 64 KiB (the message names the file).
        StorageError: a sysfs file is a FIFO, device or other non-regular file.
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
    local = env_int(env, "SLURM_LOCALID")
    if local is None:
        local = env_int(env, "LOCAL_RANK")
    bound_text = env.get(BOUND_CPUS_ENV)
    bound = parse_cpulist(bound_text, what=BOUND_CPUS_ENV) if bound_text is not None else None
    all_cpus = frozenset().union(*nodes.values()) | allowed
    return Topology(
        sysfs=sysfs,
        gpus=gpus,
        nodes=nodes,
        allowed_cpus=allowed,
        cores=_cores(sysfs, all_cpus),
        local_rank=local,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        slurm=slurm_binding(env, local),
        bound_cpus=bound or None,
        notes=tuple(notes),
    )
