"""Which node owns which shard: a seeded, sample-balanced partition, fixed or rotating.

``node`` partition: the shards, shuffled by the seed, are dealt largest first to the node
with the fewest samples so far (ties to the lowest node), so node shares differ by at most
one shard's samples. ``rotating``: that partition laid out as a ring (node 0's shards, then
node 1's, ..., each node's in the order they were dealt, largest first), where node k owns
an arc of as many places as the deal gave it. Every epoch each shard moves ``m`` places
round the ring, ``m = min(floor(rotate * S / N), smallest share)`` for S shards on N nodes,
so each node hands exactly the ``m`` shards at the end of its arc to the next node and takes
as many from the one before: every moved shard changes owner, every node keeps its shard
count of the deal in every epoch (a node's share swaps its last shards for ones dealt in the
same rounds, of about the same size), and every shard visits every node in turn. The owners
of epoch e are a pure function of (seed, e), computed directly in O(shards) for any epoch
(the shift is ``e * m`` modulo S), so a resumed long job and the stager, which knows the
next epoch's share in advance, never replay earlier epochs.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from shardio.errors import UsageError
from shardio.order.permute import key_of, permute

__all__ = ["owners", "rotation_step", "share_of"]

_SALT_DEAL = 0x70


def _deal(
    sizes: np.ndarray[Any, Any], num_nodes: int, seed: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The owner of each shard, and the shards in the order they were dealt."""
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
    return owner, ordered


def rotation_step(counts: Any, rotate: float) -> int:
    """Shards each node hands on per epoch: ``min(floor(rotate * S / N), smallest share)``
    for the deal's shard counts per node (``counts``)."""
    counts_arr = np.asarray(counts, dtype=np.int64)
    if len(counts_arr) < 2 or rotate <= 0.0:
        return 0
    total = int(counts_arr.sum())
    return min(int(rotate * total / len(counts_arr)), int(counts_arr.min()))


def _rotate(
    owner: np.ndarray[Any, Any], ordered: np.ndarray[Any, Any], num_nodes: int, epoch: int,
    rotate: float,
) -> np.ndarray[Any, Any]:  # fmt: skip
    """Owners of ``epoch`` from the deal's, directly (see the module docstring)."""
    counts = np.bincount(owner, minlength=num_nodes)
    step = rotation_step(counts, rotate)
    n_shards = len(owner)
    if step == 0 or n_shards == 0:
        return owner
    # The ring: node 0's shards in deal order, then node 1's, ...
    ring = ordered[np.argsort(owner[ordered], kind="stable")]
    ends = np.cumsum(counts)
    shift = (epoch % n_shards) * step % n_shards  # Python ints: any epoch, no overflow
    places = (np.arange(n_shards, dtype=np.int64) + shift) % n_shards
    out = np.empty(n_shards, dtype=np.int64)
    out[ring] = np.searchsorted(ends, places, side="right")
    return out


def owners(
    sizes: Any, *, num_nodes: int, seed: int, epoch: int = 0, rotate: float | None = None
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The node owning each shard in ``epoch`` (``rotate`` None: the fixed ``node`` partition).

    Raises:
        UsageError: fewer shards with samples than nodes (a node would have nothing to read),
            or a negative epoch.
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    if num_nodes < 1:
        raise UsageError(f"a partition needs at least one node, got {num_nodes}")
    epoch = int(epoch)
    if epoch < 0:
        raise UsageError(f"a partition's epoch must be >= 0, got {epoch}")
    nonempty = int((sizes_arr > 0).sum())
    if nonempty < num_nodes:
        raise UsageError(
            f"a node-partitioned order needs at least one shard per node: {num_nodes} nodes, "
            f"{nonempty} shards with samples (repack with smaller shards, or use partition=none)"
        )
    owner, ordered = _deal(sizes_arr, num_nodes, seed)
    if rotate is None or epoch == 0:
        return owner
    return _rotate(owner, ordered, num_nodes, epoch, rotate)


def share_of(
    sizes: Any, *, num_nodes: int, node: int, seed: int, epoch: int = 0, rotate: float | None = None
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The shards ``node`` owns in ``epoch``, ascending."""
    owner = owners(sizes, num_nodes=num_nodes, seed=seed, epoch=epoch, rotate=rotate)
    return np.flatnonzero(owner == node).astype(np.int64)
