"""Pin DataLoader workers to the CPUs next to this rank's GPU, with matching thread counts.

The main process computes the rank's :func:`shardio.topology.placement` before the
DataLoader starts (:func:`worker_pinning`); each worker then runs the returned
``worker_init_fn``: it sets its CPU affinity to the placement's CPUs, ``OMP_NUM_THREADS``
and ``torch.set_num_threads`` to the placement's thread count, then calls the user's own
``worker_init_fn``, if any.

Nothing is pinned when ``SHARDIO_PIN_WORKERS=0`` (a switch: 1/0, true/false, yes/no,
on/off; anything else is refused in one line, like every variable of :mod:`shardio._env`),
on a machine without an NVIDIA GPU, or when the placement cannot be computed (logged at
debug level: a malformed tree, or one whose files are FIFOs or devices, which are refused
without blocking). ``SHARDIO_SYSFS`` names another sysfs root to read the topology from (a
fake tree in tests; default ``/sys``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardio._env import env_flag
from shardio.errors import ShardioError
from shardio.topology import format_cpulist, placement, read_topology
from shardio.topology.model import Placement, Topology
from shardio.topology.sysfs import SYSFS_ENV

__all__ = [
    "PIN_ENV",
    "WorkerPinning",
    "pin_workers_enabled",
    "pinning_for",
    "rank_placement",
    "worker_pinning",
]

log = logging.getLogger(__name__)

PIN_ENV = "SHARDIO_PIN_WORKERS"


def pin_workers_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``SHARDIO_PIN_WORKERS`` turns pinning off (0, false, no, off).

    Raises:
        UsageError: ``SHARDIO_PIN_WORKERS`` is set to anything but a switch.
    """
    env = os.environ if environ is None else environ
    return env_flag(env, PIN_ENV, default=True)


@dataclass(frozen=True, kw_only=True)
class WorkerPinning:
    """A picklable ``worker_init_fn``: pin the worker, set its threads, call the user's.

    Attributes:
        cpus: the CPUs the worker runs on.
        threads: its OMP_NUM_THREADS and torch threads.
        user_init: the ``worker_init_fn`` given to the loader, called last.
    """

    cpus: frozenset[int]
    threads: int
    user_init: Callable[[int], Any] | None = None

    def __call__(self, worker_id: int) -> None:
        import torch

        try:
            os.sched_setaffinity(0, self.cpus)
        except OSError as exc:  # the job's cpuset changed since the placement: run unpinned
            log.debug("worker %d: cannot pin to CPUs %s: %s", worker_id, self.cpus, exc)
        os.environ["OMP_NUM_THREADS"] = str(self.threads)  # for what the worker starts
        torch.set_num_threads(self.threads)
        if self.user_init is not None:
            self.user_init(worker_id)


def rank_placement(
    *,
    num_workers: int,
    local_rank: int,
    environ: Mapping[str, str] | None = None,
) -> tuple[Topology, Placement] | None:
    """The machine's topology and this rank's placement, or None when its workers stay
    unpinned (pinning off, no NVIDIA GPU, no placement: said at debug level).

    Args:
        num_workers: the DataLoader's workers (for the thread count).
        local_rank: this process's rank on the node.
        environ: the environment (``SHARDIO_PIN_WORKERS``, ``SHARDIO_SYSFS``,
            ``CUDA_VISIBLE_DEVICES``, ``SLURM_*``); this process's by default.

    Raises:
        UsageError: ``SHARDIO_PIN_WORKERS`` is not a switch.
    """
    env = os.environ if environ is None else environ
    if not pin_workers_enabled(env):
        log.debug("%s=%s: DataLoader workers not pinned", PIN_ENV, env.get(PIN_ENV))
        return None
    sysfs = env.get(SYSFS_ENV) or "/sys"
    try:
        topology = read_topology(sysfs, environ=env)
        if not topology.gpus:
            log.debug("no NVIDIA GPU in %s: DataLoader workers not pinned", sysfs)
            return None
        return topology, placement(topology, local_rank, num_workers=num_workers)
    except (ShardioError, OSError) as exc:
        log.debug("no CPU placement (%s): DataLoader workers not pinned", exc)
        return None


def pinning_for(where: Placement, user_init: Callable[[int], Any] | None = None) -> WorkerPinning:
    """The ``worker_init_fn`` that pins workers to ``where`` (then calls ``user_init``)."""
    log.debug(
        "local rank %d: %d workers pinned to CPUs %s (NUMA node %s, GPU %d), %d thread(s) each",
        where.local_rank,
        where.num_workers,
        format_cpulist(where.cpus),
        where.numa_node,
        where.gpu.index,
        where.threads,
    )
    return WorkerPinning(cpus=where.cpus, threads=where.threads, user_init=user_init)


def worker_pinning(
    *,
    num_workers: int,
    local_rank: int,
    user_init: Callable[[int], Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> WorkerPinning | None:
    """The ``worker_init_fn`` that pins this rank's workers, or None to leave them alone
    (:func:`rank_placement`, then :func:`pinning_for`).

    Args:
        num_workers: the DataLoader's workers (for the thread count).
        local_rank: this process's rank on the node.
        user_init: a ``worker_init_fn`` to chain after pinning.
        environ: as in :func:`rank_placement`.

    Raises:
        UsageError: ``SHARDIO_PIN_WORKERS`` is not a switch.
    """
    where = rank_placement(num_workers=num_workers, local_rank=local_rank, environ=environ)
    return pinning_for(where[1], user_init) if where is not None else None
