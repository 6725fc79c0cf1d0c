"""Where this process sits in the job: rank, world size and local rank.

Taken from ``torch.distributed`` when it is initialised, else from SLURM's environment
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``), else from ``RANK``/``WORLD_SIZE``
(torchrun), else a single rank.
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

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise UsageError(f"invalid rank {self.rank} of world size {self.world_size}")


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.strip().isdigit() else None


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
        return RankInfo(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=_first_int(env, "LOCAL_RANK", "SLURM_LOCALID"),
            source="torch.distributed",
        )
    env = os.environ if environ is None else environ
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if rank is not None and world is not None:
        return RankInfo(
            rank=rank, world_size=world, local_rank=_first_int(env, "SLURM_LOCALID"), source="slurm"
        )
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        return RankInfo(
            rank=rank, world_size=world, local_rank=_first_int(env, "LOCAL_RANK"), source="env"
        )
    return RankInfo()
