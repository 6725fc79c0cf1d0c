"""Where this process sits in the job: rank, world size, local rank and ranks per node.

Torch-free: the one rank layout of ShardDataset, the orders (:mod:`shardio.order.streams`)
and the stager. Nodes are blocks of ranks (node = rank // ranks per node, SLURM's default
block distribution).

Taken from ``torch.distributed`` when it is initialised, else from SLURM's environment
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``), else from
``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` (torchrun), else a single rank. Ranks per node
(what a node-partitioned order needs) come from ``LOCAL_WORLD_SIZE`` or
``SLURM_NTASKS_PER_NODE``; unknown, the job counts as one node.

Nodes have names when SLURM launched the ranks: the hosts of ``SLURM_STEP_NODELIST`` (else
``SLURM_JOB_NODELIST``), expanded by :func:`shardio.order.hostlist.expand_hostlist` (no
``scontrol``), in SLURM's node order, which ``SLURM_NODEID`` indexes (checked against
``SLURMD_NODENAME``). They are :attr:`RankInfo.node_keys`, the keys of the node partition's
deal (:mod:`shardio.order.partition`): a requeued job whose nodes are renumbered, or that
lost node k of N, keeps each surviving host's share. Node k of the layout is the k-th host
(SLURM's default block distribution; under another, the shares stay exact but a node's ranks
read another host's share). Elsewhere (torchrun, a layout given in code) nodes are numbers.

Every one of these variables is parsed strictly (ASCII digits, bounded, consistent with the
world size); a malformed one is refused with a :class:`~shardio.errors.UsageError` naming it,
never read as "rank 0 of 1" (which would make that rank read the whole dataset).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shardio._env import env_int, parse_tasks_per_node
from shardio.errors import UsageError
from shardio.order.hostlist import expand_hostlist

__all__ = ["RankInfo", "detect_ranks", "given_ranks", "slurm_hosts"]


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """One process's place among the job's ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"
    ranks_per_node: int = 0  # 0: unknown (the whole job counts as one node)
    node_keys: tuple[str, ...] | None = None  # each node's name (SLURM's hosts); None: numbers

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise UsageError(f"invalid rank {self.rank} of world size {self.world_size}")
        if self.ranks_per_node < 0:
            raise UsageError(f"invalid ranks per node {self.ranks_per_node}")
        if self.node_keys is not None:
            keys = self.node_keys
            if not isinstance(keys, tuple) or not all(isinstance(k, str) and k for k in keys):
                raise UsageError("node_keys must be a tuple of node names (or None)")
            if len(keys) != self.num_nodes:
                raise UsageError(
                    f"{len(keys)} node names for {self.num_nodes} node(s) of "
                    f"{self.node_size} rank(s): one name per node needed"
                )
            if len(set(keys)) != len(keys):
                raise UsageError("node_keys names a node twice")

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

    @property
    def node_key(self) -> str:
        """This rank's node's name in the deal: its host name, else its number."""
        return self.node_keys[self.node] if self.node_keys is not None else str(self.node)

    def with_rank(self, rank: int) -> RankInfo:
        """The same layout seen from ``rank``."""
        return RankInfo(
            rank=rank,
            world_size=self.world_size,
            ranks_per_node=self.node_size,
            node_keys=self.node_keys,
        )


def slurm_hosts(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The hosts of this SLURM job step in SLURM's node order (``SLURM_NODEID`` indexes
    them): ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``, expanded; None when
    neither is set.

    Raises:
        UsageError: a malformed list, a malformed ``SLURM_NODEID``, or one that is not the
            index of ``SLURMD_NODENAME`` in the list (each named).
    """
    name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    text = env.get(name)
    if text is None:
        return None
    hosts = expand_hostlist(text, name=name)
    node = env_int(env, "SLURM_NODEID")
    if node is not None and node >= len(hosts):
        raise UsageError(f"SLURM_NODEID={node} is not a node of {name} ({len(hosts)} hosts)")
    here = env.get("SLURMD_NODENAME")
    if node is not None and here is not None and hosts[node] != here:
        raise UsageError(
            f"SLURMD_NODENAME={here!r} is not host SLURM_NODEID={node} of {name} "
            f"({hosts[node]!r}): the node list and the node id disagree"
        )
    return hosts


def _node_keys(
    env: Mapping[str, str], rank: int, world: int, per_node: int
) -> tuple[str, ...] | None:
    """The hosts of the job as node names, when SLURM launched these ranks (its
    ``SLURM_PROCID``/``SLURM_NTASKS`` are this rank and world) and they make its nodes."""
    if _pair(env, "SLURM_PROCID", "SLURM_NTASKS") != (rank, world):
        return None
    hosts = slurm_hosts(env)
    nodes = world // (per_node or world)
    if hosts is None or (nodes == 1 and len(hosts) != 1):
        return None  # one node in the layout (unknown ranks per node): no names needed
    if len(hosts) != nodes:
        raise UsageError(
            f"the node list names {len(hosts)} host(s) but the {world} ranks make {nodes} "
            f"node(s) of {per_node}: set SLURM_NTASKS_PER_NODE (or srun --ntasks-per-node) to "
            "the tasks of each node"
        )
    return hosts


def _ranks_per_node(env: Mapping[str, str], world: int) -> int:
    """``LOCAL_WORLD_SIZE``, else ``SLURM_NTASKS_PER_NODE`` (SLURM's ``"2(x3)"`` form too);
    0 when neither is set or nodes run different numbers of tasks (``"4,2"``).

    Raises:
        UsageError: a malformed value, or more ranks per node than ranks.
    """
    local = env_int(env, "LOCAL_WORLD_SIZE", minimum=1)
    name = "LOCAL_WORLD_SIZE"
    if local is None and env.get("SLURM_NTASKS_PER_NODE") is not None:
        name = "SLURM_NTASKS_PER_NODE"
        local = parse_tasks_per_node(name, env["SLURM_NTASKS_PER_NODE"])
    if local is None:
        return 0
    if local > world:
        raise UsageError(f"{name}={local} is more than the world size {world}")
    return local if world % local == 0 else 0


def _local_rank(env: Mapping[str, str], names: tuple[str, ...], per_node: int, world: int) -> int:
    """The first of ``names`` that is set, below the ranks per node (or the world); else 0."""
    limit = per_node or world
    for name in names:
        value = env_int(env, name)
        if value is None:
            continue
        if value >= limit:
            raise UsageError(f"{name}={value} is not a local rank of a node of {limit} rank(s)")
        return value
    return 0


def _pair(env: Mapping[str, str], rank_name: str, world_name: str) -> tuple[int, int] | None:
    """(rank, world) when both variables are set; None when neither or only one is.

    Raises:
        UsageError: a malformed value, a world of 0, or a rank outside the world.
    """
    rank = env_int(env, rank_name)
    world = env_int(env, world_name, minimum=1)
    if rank is None or world is None:
        return None
    if rank >= world:
        raise UsageError(
            f"{rank_name}={rank} is not a rank of {world_name}={world} (ranks are 0 to {world - 1})"
        )
    return rank, world


def detect_ranks(environ: Mapping[str, str] | None = None) -> RankInfo:
    """Return this process's rank layout (see the module docstring for the order).

    Every variable consulted is parsed strictly (:mod:`shardio._env`): ASCII digits,
    bounded, the rank below the world size and the local rank below the ranks per node.
    When SLURM's pair and ``RANK``/``WORLD_SIZE`` are both set they must agree (torchrun
    inside a one-task-per-node srun sets both, differently: initialise torch.distributed
    first, or pass the ranks explicitly).

    Raises:
        UsageError: a malformed or inconsistent rank variable; the message names it.
    """
    env = os.environ if environ is None else environ
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        per_node = _ranks_per_node(env, world)
        return RankInfo(
            rank=rank,
            world_size=world,
            local_rank=_local_rank(env, ("LOCAL_RANK", "SLURM_LOCALID"), per_node, world),
            source="torch.distributed",
            ranks_per_node=per_node,
            node_keys=_node_keys(env, rank, world, per_node),
        )
    slurm = _pair(env, "SLURM_PROCID", "SLURM_NTASKS")
    plain = _pair(env, "RANK", "WORLD_SIZE")
    if slurm is not None and plain is not None and slurm != plain:
        raise UsageError(
            f"SLURM_PROCID/SLURM_NTASKS say rank {slurm[0]} of {slurm[1]} but RANK/WORLD_SIZE "
            f"say rank {plain[0]} of {plain[1]}: initialise torch.distributed before reading, "
            "or give the ranks explicitly"
        )
    for pair, local_keys, source in (
        (slurm, ("SLURM_LOCALID",), "slurm"),
        (plain, ("LOCAL_RANK",), "env"),
    ):
        if pair is not None:
            rank, world = pair
            per_node = _ranks_per_node(env, world)
            return RankInfo(
                rank=rank,
                world_size=world,
                local_rank=_local_rank(env, local_keys, per_node, world),
                source=source,
                ranks_per_node=per_node,
                node_keys=_node_keys(env, rank, world, per_node),
            )
    return RankInfo()


def given_ranks(rank: int, world_size: int, environ: Mapping[str, str] | None = None) -> RankInfo:
    """A rank and world size the caller gave (DALI's ``shard_id``/``num_shards``), in the
    node layout of the environment, read as :func:`detect_ranks` reads it: ranks per node
    from ``LOCAL_WORLD_SIZE`` or ``SLURM_NTASKS_PER_NODE`` (unknown: one node), the local
    rank from ``LOCAL_RANK`` or ``SLURM_LOCALID`` (default 0).

    Raises:
        UsageError: a rank outside the world, or a malformed or inconsistent variable.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"invalid rank {rank} of world size {world_size}")
    env = os.environ if environ is None else environ
    per_node = _ranks_per_node(env, world_size)
    return RankInfo(
        rank=rank,
        world_size=world_size,
        local_rank=_local_rank(env, ("LOCAL_RANK", "SLURM_LOCALID"), per_node, world_size),
        source="given",
        ranks_per_node=per_node,
        node_keys=_node_keys(env, rank, world_size, per_node),
    )
