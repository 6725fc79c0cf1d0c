"""Which node owns which shard: a seeded, sample-balanced partition, fixed or rotating.

``node`` partition: the shards, shuffled by the seed, are dealt largest first to the node
with the fewest samples so far (ties to the lowest node), so node shares differ by at most
one shard's samples. ``rotating``: from that partition, every epoch each node hands
``floor(rotate * its shard count)`` of its shards (chosen by a hash of seed, epoch and
shard) to the other nodes, one by one round the ring, so every moved shard changes owner and
node shares stay balanced. Owners of epoch e are a pure function of (seed, e): the stager
knows the next epoch's share in advance.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from shardio.errors import UsageError
from shardio.order.permute import key_of, mix64, permute

__all__ = ["owners", "share_of"]

_SALT_DEAL = 0x70
_SALT_ROTATE = 0x71


def _deal(sizes: np.ndarray[Any, Any], num_nodes: int, seed: int) -> np.ndarray[Any, Any]:
    n_shards = len(sizes)
    shuffled = permute(np.arange(n_shards), max(1, n_shards), key_of(seed, _SALT_DEAL))
    # Largest first (stable: ties keep the seeded shuffle), each to the lightest node.
    ordered = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    owner = np.empty(n_shards, dtype=np.int64)
    heap = [(0, node) for node in range(num_nodes)]
    for shard, size in zip(ordered.tolist(), sizes[ordered].tolist(), strict=True):
        total, node = heapq.heappop(heap)
        owner[shard] = node
        heapq.heappush(heap, (total + size, node))
    return owner


def _rotate(
    owner: np.ndarray[Any, Any], num_nodes: int, seed: int, epoch: int, rotate: float
) -> np.ndarray[Any, Any]:
    """Owners of ``epoch`` from those of ``epoch - 1``."""
    if num_nodes < 2 or rotate <= 0.0:
        return owner
    n_shards = len(owner)
    keys = mix64(
        np.arange(n_shards, dtype=np.uint64) ^ np.uint64(key_of(seed, epoch, _SALT_ROTATE))
    )
    by_node = np.lexsort((keys, owner))  # each node's shards, in key order
    counts = np.bincount(owner, minlength=num_nodes)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank_in_node = np.empty(n_shards, dtype=np.int64)
    rank_in_node[by_node] = np.arange(n_shards) - np.repeat(starts, counts)
    moving = rank_in_node < np.floor(rotate * counts[owner]).astype(np.int64)
    offset = int(key_of(seed, epoch, _SALT_ROTATE, 1) % (num_nodes - 1))
    step = 1 + (rank_in_node + offset) % (num_nodes - 1)  # never 0: a moved shard moves
    out = owner.copy()
    out[moving] = (owner[moving] + step[moving]) % num_nodes
    return out


def owners(
    sizes: Any, *, num_nodes: int, seed: int, epoch: int = 0, rotate: float | None = None
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The node owning each shard in ``epoch`` (``rotate`` None: the fixed ``node`` partition).

    Raises:
        UsageError: fewer shards with samples than nodes (a node would have nothing to read).
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    if num_nodes < 1:
        raise UsageError(f"a partition needs at least one node, got {num_nodes}")
    nonempty = int((sizes_arr > 0).sum())
    if nonempty < num_nodes:
        raise UsageError(
            f"a node-partitioned order needs at least one shard per node: {num_nodes} nodes, "
            f"{nonempty} shards with samples (repack with smaller shards, or use partition=none)"
        )
    owner = _deal(sizes_arr, num_nodes, seed)
    if rotate is not None:
        for e in range(1, epoch + 1):
            owner = _rotate(owner, num_nodes, seed, e, rotate)
    return owner


def share_of(
    sizes: Any, *, num_nodes: int, node: int, seed: int, epoch: int = 0, rotate: float | None = None
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The shards ``node`` owns in ``epoch``, ascending."""
    owner = owners(sizes, num_nodes=num_nodes, seed=seed, epoch=epoch, rotate=rotate)
    return np.flatnonzero(owner == node).astype(np.int64)
