"""Where this process sits in the job: rank, world size, local rank and ranks per node.

Torch-free: the one rank layout of ShardDataset, the orders (:mod:`shardio.order.streams`)
and the stager. Nodes are blocks of ranks (node = rank // ranks per node, SLURM's default
block distribution).

Taken from ``torch.distributed`` when it is initialised, else from SLURM's environment
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``), else from
``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` (torchrun), else a single rank. Ranks per node
(what a node-partitioned order needs) come from ``LOCAL_WORLD_SIZE`` or
``SLURM_NTASKS_PER_NODE``; unknown, the job counts as one node.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shardio.errors import UsageError

__all__ = ["RankInfo", "detect_ranks"]


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """One process's place among the job's ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"
    ranks_per_node: int = 0  # 0: unknown (the whole job counts as one node)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise UsageError(f"invalid rank {self.rank} of world size {self.world_size}")
        if self.ranks_per_node < 0:
            raise UsageError(f"invalid ranks per node {self.ranks_per_node}")

    @property
    def node_size(self) -> int:
        """Ranks per node (the world size when unknown)."""
        return self.ranks_per_node or self.world_size

    @property
    def num_nodes(self) -> int:
        """Nodes of the job.

        Raises:
            UsageError: the ranks do not split into nodes of ``node_size``.
        """
        if self.world_size % self.node_size:
            raise UsageError(
                f"{self.world_size} ranks do not split into nodes of {self.node_size}: "
                "a node-partitioned order needs the same number of ranks on every node"
            )
        return self.world_size // self.node_size

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.rank // self.node_size

    @property
    def rank_in_node(self) -> int:
        """This rank's place among its node's ranks (block layout)."""
        return self.rank % self.node_size

    def with_rank(self, rank: int) -> RankInfo:
        """The same layout seen from ``rank``."""
        return RankInfo(rank=rank, world_size=self.world_size, ranks_per_node=self.node_size)


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.strip().isdigit() else None


def _leading_int(env: Mapping[str, str], name: str) -> int:
    """The leading integer of ``name`` ("4(x2)" is SLURM's 4 tasks on each of 2 nodes)."""
    value = env.get(name, "").strip()
    digits = value[: len(value) - len(value.lstrip("0123456789"))]
    return int(digits) if digits and len(digits) < 10 else 0


def _ranks_per_node(env: Mapping[str, str], world: int) -> int:
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = _leading_int(env, name)
        if 0 < value <= world and world % value == 0:
            return value
    return 0


def _first_int(env: Mapping[str, str], *names: str) -> int:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value
    return 0


def detect_ranks(environ: Mapping[str, str] | None = None) -> RankInfo:
    """Return this process's rank layout (see the module docstring for the order)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        env = os.environ if environ is None else environ
        world = dist.get_world_size()
        return RankInfo(
            rank=dist.get_rank(),
            world_size=world,
            local_rank=_first_int(env, "LOCAL_RANK", "SLURM_LOCALID"),
            source="torch.distributed",
            ranks_per_node=_ranks_per_node(env, world),
        )
    env = os.environ if environ is None else environ
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if rank is not None and world is not None:
        return RankInfo(
            rank=rank,
            world_size=world,
            local_rank=_first_int(env, "SLURM_LOCALID"),
            source="slurm",
            ranks_per_node=_ranks_per_node(env, world),
        )
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        return RankInfo(
            rank=rank,
            world_size=world,
            local_rank=_first_int(env, "LOCAL_RANK"),
            source="env",
            ranks_per_node=_ranks_per_node(env, world),
        )
    return RankInfo()
