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
