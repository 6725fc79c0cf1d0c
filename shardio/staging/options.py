"""What to stage and how: the options of a stage run (validated), and their limits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shardio._check import require_seconds
from shardio.errors import UsageError
from shardio.order.cursor import EpochCursor
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec

__all__ = ["MAX_AHEAD", "MAX_NODES", "MAX_RANKS_PER_NODE", "MAX_STREAMS", "StageOptions"]

MAX_RANKS_PER_NODE = 4096
MAX_NODES = 1 << 20
MAX_STREAMS = 256
MAX_AHEAD = 16
MAX_PEER_PATTERNS = 4096


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """What to stage and how.

    Attributes:
        node: this node's number (0-based), of ``num_nodes``.
        num_nodes: nodes of the job; 1 stages every shard.
        ranks_per_node: training ranks per node (the rank layout decides which shards a
            node reads first), at most MAX_RANKS_PER_NODE.
        spec: the order training uses (the one :class:`~shardio.order.OrderSpec` the job's
            stage step and ShardDataset share), recorded in the area's plan.
        epoch: the epoch to stage for.
        ahead: also stage the shards of this many following epochs (after this epoch's, as
            capacity allows), and evict every staged shard none of those epochs needs (a
            rotating order hands shards on every epoch; see :class:`EpochStager`).
        streams: parallel copy streams, at most MAX_STREAMS.
        capacity_bytes: stage at most this many bytes (the shards needed first); None: all.
        durable: fsync each copy before publishing it. Off by default: a staging area is a
            job-scoped cache, a kill -9 cannot expose a half-written copy (temp name, then
            rename), and every read verifies each member and falls back to the source, which
            also covers a copy damaged by a node crash.
        force: DEST holds another dataset (its marker records another dataset id): remove
            what shardio staged there, then stage (without it, staging is refused).
        read_timeout_s: seconds a copy's open or one of its chunks may stall (a dead data
            server) before that shard is given up, like a damaged one (it is read from the
            source later); 0: no deadline.
        peers: other nodes' staging areas of the same dataset (paths or glob patterns): a
            shard this node lacks is copied from the first that holds a copy that verifies,
            before the source is read (:mod:`shardio.staging.peers`).
        node_keys: each node's name, the keys of the node partition's deal (SLURM's hosts:
            what training's :attr:`~shardio.order.RankInfo.node_keys` holds, so that both
            compute the same share); None: the node numbers.
    """

    node: int = 0
    num_nodes: int = 1
    ranks_per_node: int = 1
    spec: OrderSpec = field(default_factory=OrderSpec)
    epoch: int = 0
    ahead: int = 0
    streams: int = 4
    capacity_bytes: int | None = None
    durable: bool = False
    force: bool = False
    read_timeout_s: float = 0.0
    peers: tuple[str, ...] = ()
    node_keys: tuple[str, ...] | None = None

    @classmethod
    def from_cursor(cls, cursor: EpochCursor, **options: Any) -> StageOptions:
        """The options that stage what training at ``cursor`` reads on this rank's node:
        its order spec, its epoch and its node in the rank layout (``ds.cursor`` of a
        ShardDataset, or a DALI pipeline's), with the other fields from ``options``.

        Raises:
            UsageError: ``options`` names a field the cursor sets, or an unknown one; the
                ranks do not split into equal nodes.
        """
        if not isinstance(cursor, EpochCursor):
            raise UsageError(f"from_cursor takes an EpochCursor, got {type(cursor).__name__}")
        taken = sorted(
            {"spec", "epoch", "node", "num_nodes", "ranks_per_node", "node_keys"} & set(options)
        )
        if taken:
            raise UsageError(f"the cursor sets {', '.join(taken)}: do not give them too")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UsageError(f"unknown stage option(s): {', '.join(unknown)}")
        ranks = cursor.ranks()
        return cls(
            spec=cursor.spec,
            epoch=cursor.epoch,
            node=ranks.node,
            num_nodes=ranks.num_nodes,
            ranks_per_node=ranks.node_size,
            node_keys=ranks.node_keys,
            **options,
        )

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "read_timeout_s", require_seconds(self.read_timeout_s, "read_timeout_s")
        )
        if not 1 <= self.num_nodes <= MAX_NODES or not 0 <= self.node < self.num_nodes:
            raise UsageError(
                f"invalid node {self.node}/{self.num_nodes}: need 0 <= I < N <= {MAX_NODES:,}"
            )
        if not 1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE:
            raise UsageError(
                f"invalid ranks per node {self.ranks_per_node}: need 1 to {MAX_RANKS_PER_NODE}"
            )
        if not 1 <= self.streams <= MAX_STREAMS:
            raise UsageError(f"invalid copy streams {self.streams}: need 1 to {MAX_STREAMS}")
        if not isinstance(self.spec, OrderSpec):
            raise UsageError(f"spec must be an OrderSpec, got {type(self.spec).__name__}")
        if self.epoch < 0:
            raise UsageError(f"epoch ({self.epoch}) must be >= 0")
        if not 0 <= self.ahead <= MAX_AHEAD:
            raise UsageError(f"epochs ahead ({self.ahead}) must be 0 to {MAX_AHEAD}")
        if isinstance(self.peers, str) or not all(isinstance(p, str) for p in self.peers):
            raise UsageError("peers must be a sequence of paths or glob patterns")
        object.__setattr__(self, "peers", tuple(self.peers))
        if len(self.peers) > MAX_PEER_PATTERNS:
            raise UsageError(f"at most {MAX_PEER_PATTERNS:,} peer paths or patterns")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise UsageError("capacity must be positive")
        if isinstance(self.node_keys, str):
            raise UsageError("node_keys must be a sequence of node names, not one string")
        if self.node_keys is not None:
            # The same checks as the training side's layout (one name per node, distinct).
            RankInfo(world_size=self.num_nodes, ranks_per_node=1, node_keys=tuple(self.node_keys))
            object.__setattr__(self, "node_keys", tuple(self.node_keys))

    @property
    def node_key(self) -> str:
        """This node's name in the deal (its host name, else its number)."""
        return self.node_keys[self.node] if self.node_keys is not None else str(self.node)

    def plan_record(self) -> dict[str, Any]:
        """What the plan records about the order and the layout it was staged for."""
        return {
            "spec": self.spec.to_dict(),
            "epoch": self.epoch,
            "ahead": self.ahead,
            "node": self.node,
            "num_nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "node_key": self.node_key,
            "node_keys": None if self.node_keys is None else list(self.node_keys),
        }
