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

from typing import TYPE_CHECKING

from shardio._lazy import lazy_face

if TYPE_CHECKING:
    from shardio.topology.cpulist import format_cpulist, parse_cpulist
    from shardio.topology.model import Gpu, Placement, SlurmBinding, Topology
    from shardio.topology.place import local_gpu, placement
    from shardio.topology.sysfs import read_topology

__all__ = [
    "Gpu",
    "Placement",
    "SlurmBinding",
    "Topology",
    "format_cpulist",
    "local_gpu",
    "parse_cpulist",
    "placement",
    "read_topology",
]

_LAZY = {
    "Gpu": "shardio.topology.model",
    "Placement": "shardio.topology.model",
    "SlurmBinding": "shardio.topology.model",
    "Topology": "shardio.topology.model",
    "format_cpulist": "shardio.topology.cpulist",
    "parse_cpulist": "shardio.topology.cpulist",
    "local_gpu": "shardio.topology.place",
    "placement": "shardio.topology.place",
    "read_topology": "shardio.topology.sysfs",
}


__getattr__, __dir__ = lazy_face(__name__, _LAZY)
