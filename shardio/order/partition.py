"""Which node owns which shard: a seeded, sample-balanced partition, fixed or rotating, whose
shares move least when the number of nodes changes.

``node`` partition, a nested deal: with one node, node 0 holds every shard. Node k (k = 1,
2, ..., N - 1 in turn) then takes its share from the nodes before it: again and again it
takes, from the heaviest node that still holds two shards, that node's largest shard that
does not leave node k heavier than the node was (ties in a shuffle seeded by the order's
seed), until the heaviest node has no such shard. The partition is a pure function of
(seed, N, the shards' sample counts), so every rank and the stager compute it alike, and:

- **Minimal movement.** The deal for N - 1 nodes is the deal for N with node N - 1 left
  out: going from N nodes to N - 1 moves exactly the last node's shards (about 1/N of the
  samples; every other node keeps every shard it had and takes some of them), and going
  from N - 1 to N moves exactly the shards the new node takes (about 1/N). Re-dealing from
  scratch (the greedy deal of earlier releases) changed most nodes' shares. The node that
  leaves is the last one: a job that loses node k of N and restarts on N - 1 nodes keeps
  each survivor's share when the survivors keep their node numbers and the last number is
  the one that goes (``shardio stage --peers`` fetches what moved from the other nodes'
  areas; see docs/guides/staging-slurm.md, "When a node is lost").
- **Balance.** Node shares differ by at most one shard's samples (the largest shard's):
  a move never leaves the taking node heavier than the giving node was, so a giver ends at
  most one shard below the heaviest node, and a taking node stops within one shard of it.
- Every node holds at least one shard with samples (a giver keeps one), given at least N
  such shards; shards without samples are never read and stay with node 0.

Earlier releases dealt largest first to the lightest node (salt 0x70); their node shares
differ from these, so a loader state saved mid-epoch under that deal is refused (state
version 3, :mod:`shardio.order.cursor`), and a staging area staged under it keeps the
copies that are still this node's and stages the rest.

``rotating``: that partition laid out as a ring (node 0's shards, then node 1's, ..., each
node's in deal order, largest first), where node k owns an arc of as many places as the
deal gave it. Every epoch each shard moves ``m`` places round the ring, ``m =
min(floor(rotate * S / N), smallest share)`` for S shards on N nodes, so each node hands
exactly the ``m`` shards at the end of its arc to the next node and takes as many from the
one before: every moved shard changes owner, every node keeps its shard count of the deal in
every epoch (a node's share swaps its last shards, its smallest, for the smallest of the
node before), and every shard visits every node in turn. The owners of epoch e are a pure
function of (seed, e), computed directly in O(shards) for any epoch (the shift is ``e * m``
modulo S), so a resumed long job and the stager, which knows the next epoch's share in
advance, never replay earlier epochs. A rotating order moves shards every epoch anyway
(the stager fetches them ahead); a change of the number of nodes re-lays the ring, so the
minimal movement above is the ``node`` partition's (and epoch 0's of ``rotating``).
"""

from __future__ import annotations

import bisect
import functools
import heapq
from typing import Any

import numpy as np

from shardio.errors import UsageError
from shardio.order.permute import key_of, permute

__all__ = ["owners", "rotation_step", "share_of"]

_SALT_DEAL = 0x71  # 0x70: the greedy deal of releases before the nested one


def _deal(
    sizes: np.ndarray[Any, Any], num_nodes: int, seed: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The owner of each shard, and the shards in deal order (largest first, ties in the
    seeded shuffle's order): node 0 holds every shard, then each node k in turn takes its
    share from the nodes before it (see the module docstring)."""
    n_shards = len(sizes)
    shuffled = permute(np.arange(n_shards), max(1, n_shards), key_of(seed, _SALT_DEAL))
    ordered = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    owner = np.zeros(n_shards, dtype=np.int64)
    # Each node's shards with samples as (size, place in the shuffle, shard), ascending:
    # the largest that fits is found by bisection. Empty shards are never read: node 0's.
    rank = np.empty(n_shards, dtype=np.int64)
    rank[shuffled] = np.arange(n_shards, dtype=np.int64)
    held: list[list[tuple[int, int, int]]] = [
        sorted((int(sizes[s]), int(rank[s]), int(s)) for s in np.flatnonzero(sizes > 0).tolist())
    ]
    loads = [int(sizes.sum())]
    for new in range(1, num_nodes):
        held.append([])
        loads.append(0)
        # Donors: the heaviest node that keeps a shard after giving one (lazy max-heap).
        heap = [(-loads[k], k) for k in range(new) if len(held[k]) >= 2]
        heapq.heapify(heap)
        while heap:
            load, donor = heapq.heappop(heap)
            if -load != loads[donor] or len(held[donor]) < 2:
                continue  # a stale entry
            room = loads[donor] - loads[new]  # the move may not leave the new node heavier
            i = bisect.bisect_right(held[donor], (room, n_shards, n_shards)) - 1
            if i < 0:
                break  # nothing of the heaviest fits: within one shard of it (see above)
            size, place, shard = held[donor].pop(i)
            bisect.insort(held[new], (size, place, shard))
            owner[shard] = new
            loads[donor] -= size
            loads[new] += size
            if len(held[donor]) >= 2:
                heapq.heappush(heap, (-loads[donor], donor))
    return owner, ordered


@functools.lru_cache(maxsize=4)
def _cached_deal(
    sizes: bytes, num_nodes: int, seed: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """:func:`_deal`, kept for the last few datasets: every rank of a node asks for the same
    deal each epoch (the stager once per rank), and a deal of 100,000 shards takes about a
    second. The arrays are read-only."""
    owner, ordered = _deal(np.frombuffer(sizes, dtype=np.int64), num_nodes, seed)
    owner.flags.writeable = False
    ordered.flags.writeable = False
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
    owner, ordered = _cached_deal(sizes_arr.tobytes(), num_nodes, seed)
    if rotate is None or epoch == 0:
        return owner.copy()
    return _rotate(owner, ordered, num_nodes, epoch, rotate)


def share_of(
    sizes: Any, *, num_nodes: int, node: int, seed: int, epoch: int = 0, rotate: float | None = None
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The shards ``node`` owns in ``epoch``, ascending."""
    owner = owners(sizes, num_nodes=num_nodes, seed=seed, epoch=epoch, rotate=rotate)
    return np.flatnonzero(owner == node).astype(np.int64)
