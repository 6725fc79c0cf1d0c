"""Fake sysfs trees for the topology tests: NUMA nodes, CPUs and NVIDIA GPUs as PCI devices."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence

# Bus numbers of the GPUs of a typical 8-GPU board, in PCI order.
BUSES = (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD)


def fake_sysfs(
    root: pathlib.Path,
    nodes: Mapping[int, str],
    gpu_nodes: Sequence[int],
    *,
    siblings: Mapping[int, str] | None = None,
) -> str:
    """A sysfs tree: NUMA nodes with these cpulists, one NVIDIA GPU per entry of
    ``gpu_nodes`` (its numa_node, -1 for unknown), and devices that are not GPUs."""
    for node, cpus in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    if nodes:  # sysfs lists more than node directories there
        (root / "devices" / "system" / "node" / "possible").write_text("0-7\n")
    for cpu, sib in (siblings or {}).items():
        d = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    pci = root / "bus" / "pci" / "devices"
    pci.mkdir(parents=True)
    devices = [
        (f"0000:{BUSES[i]:02x}:00.0", "0x10de", "0x030200", n) for i, n in enumerate(gpu_nodes)
    ]
    devices += [
        ("0000:07:00.1", "0x10de", "0x040300", 0),  # the GPU's audio function
        ("0000:c4:00.0", "0x10de", "0x068000", 0),  # an NVSwitch bridge
        ("0000:00:02.0", "0x8086", "0x030000", 0),  # an Intel VGA controller
    ]
    for bus_id, vendor, cls, node in reversed(devices):  # directory order is not PCI order
        d = pci / bus_id
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        (d / "numa_node").write_text(f"{node}\n")
    return os.fspath(root)


def plant(root: pathlib.Path, rel: str, kind: str) -> pathlib.Path:
    """Replace the file ``root/rel`` of a fake tree by something hostile.

    ``kind``: ``"fifo"`` (a named pipe nobody writes: a plain open or read blocks forever),
    ``"devzero"`` (a symlink to ``/dev/zero``: a plain read never ends), ``"big"`` (a 1 MiB
    regular file: no sysfs attribute is that large).
    """
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "big":
        path.write_bytes(b"0" * (1 << 20))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return path


def srun_env(mode: str, tasks: Sequence[frozenset[int]], local: int, ncpus: int) -> dict[str, str]:
    """What srun puts in task ``local``'s environment for ``--cpu-bind=MODE``.

    ``mode``: ``cores`` (and ``widened``, the same variables) gives SLURM's per-task hex masks
    as slurmd writes them (``mask_cpu:``, one full-width mask per task of the node, the
    level cleared), ``map_cpu`` the first CPU of each task, ``none`` says so, ``unbound``
    sets nothing but ``SLURM_LOCALID``. ``tasks``: the CPUs of each task of the node;
    ``ncpus``: the node's CPU count (the masks' width).
    """
    env = {"SLURM_LOCALID": str(local)}
    if mode == "unbound":
        return env
    if mode == "none":
        return env | {
            "SLURM_CPU_BIND": "quiet,none",
            "SLURM_CPU_BIND_TYPE": "none",
            "SLURM_CPU_BIND_LIST": "",
            "SLURM_CPU_BIND_VERBOSE": "quiet",
        }
    if mode == "map_cpu":
        listed = ",".join(str(min(t)) for t in tasks)
    else:
        width = (ncpus + 3) // 4
        listed = ",".join(f"0x{sum(1 << c for c in t):0{width}X}" for t in tasks)
    kind = "mask_cpu:" if mode in ("cores", "widened") else "map_cpu:"
    return env | {
        "SLURM_CPU_BIND": f"quiet,{kind}{listed}",
        "SLURM_CPU_BIND_TYPE": kind,
        "SLURM_CPU_BIND_LIST": listed,
        "SLURM_CPU_BIND_VERBOSE": "quiet",
    }


def block_masks(ntasks: int, per_task: int, cpus: Sequence[int]) -> list[frozenset[int]]:
    """srun --cpu-bind=cores --distribution=block:block: consecutive cores per task."""
    return [frozenset(cpus[i * per_task : (i + 1) * per_task]) for i in range(ntasks)]


def fake_cgroup(
    sysfs: pathlib.Path,
    procfs: pathlib.Path,
    files: Mapping[str, str],
    *,
    version: int = 2,
    own: str = "/job/step",
) -> None:
    """A cgroup tree under ``sysfs/fs/cgroup`` and ``procfs/self/cgroup`` naming ``own``.

    ``files``: cgroup file (relative to the tree's root, e.g. ``"job/cpu.max"``) -> text.
    Version 2 marks the root with ``cgroup.controllers``; version 1 mounts the ``cpu``
    controller at ``cpu,cpuacct`` (paths in ``files`` are relative to that mount) and lists
    other controllers in ``self/cgroup`` as a hybrid host does.
    """
    tree = sysfs / "fs" / "cgroup"
    mount = tree if version == 2 else tree / "cpu,cpuacct"
    (mount / own.strip("/")).mkdir(parents=True, exist_ok=True)
    if version == 2:
        (tree / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        lines = f"0::{own}\n"
    else:
        (tree / "unified").mkdir()
        lines = f"12:memory:{own}\n4:cpu,cpuacct:{own}\n1:name=systemd:{own}\n0::{own}\n"
    for rel, text in files.items():
        path = mount / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    (procfs / "self").mkdir(parents=True, exist_ok=True)
    (procfs / "self" / "cgroup").write_text(lines)
