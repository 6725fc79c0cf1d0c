"""The loader's guard against mis-sized jobs: one warning line per problem, once per loader.

When a ShardLoader's workers are about to start for the first time, :func:`warn_job_size`
compares the workers and the main process's torch threads with the CPUs this process may
really use (affinity, cgroup quota, ``SLURM_CPUS_PER_TASK``, the pinned placement:
:mod:`shardio.topology.sizing`) and the rank's GPU's NUMA node with its CPUs (when the
workers are pinned: the placement read for that is reused, nothing more is read). Each
problem is one WARNING line saying what to change; a well-sized job logs nothing. The
shared memory the ring transport needs is checked where the ring is sized
(:func:`shardio.runtime.transport.ring_shortfall`), once per loader too.

The cgroup and procfs trees read are those of ``SHARDIO_SYSFS`` (``<root>/fs/cgroup``) and
``SHARDIO_PROCFS`` (default ``/sys`` and ``/proc``), so tests describe any job with fake
trees. The check costs a few small reads, none blocking.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from shardio.topology.cgroup import PROCFS_ENV
from shardio.topology.model import Placement, Topology
from shardio.topology.sizing import numa_finding, read_cpu_budget, sizing_findings
from shardio.topology.sysfs import SYSFS_ENV

__all__ = ["warn_job_size"]

log = logging.getLogger(__name__)


def warn_job_size(
    *,
    num_workers: int,
    where: tuple[Topology, Placement] | None,
    environ: Mapping[str, str] | None = None,
    main_threads: int | None = None,
) -> list[str]:
    """Log one warning per sizing problem of a rank's loader; return them.

    Args:
        num_workers: the loader's DataLoader workers.
        where: the topology and the placement its workers are pinned to; None when they
            are not pinned (no NUMA check then).
        environ: the environment (``SLURM_CPUS_PER_TASK``, ``SHARDIO_SYSFS``,
            ``SHARDIO_PROCFS``); this process's by default.
        main_threads: the main process's threads; ``torch.get_num_threads()`` by default.
    """
    env = os.environ if environ is None else environ
    budget = read_cpu_budget(
        env, procfs=env.get(PROCFS_ENV) or "/proc", sysfs=env.get(SYSFS_ENV) or "/sys"
    )
    threads = torch.get_num_threads() if main_threads is None else main_threads
    lines = [f"job sizing: {note}" for note in budget.notes]
    lines += sizing_findings(
        budget,
        num_workers=num_workers,
        main_threads=threads,
        placement=where[1] if where is not None else None,
    )
    numa = numa_finding(*where) if where is not None else None
    if numa is not None:
        lines.append(numa)
    for line in lines:
        log.warning("%s", line)
    return lines
