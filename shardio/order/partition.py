"""Which node owns which shard: a seeded, sample-balanced rendezvous deal over the nodes'
names, fixed or rotating, whose shares move little when a node goes or comes.

``node`` partition. Each node has a key: its host name when the job's are known (SLURM's
node list, :attr:`shardio.order.RankInfo.node_keys`), else its number (``"0"`` to
``"N-1"``: torchrun, or ``--node I/N``). Keys come from the rank layout, not the order spec:
the same spec serves every allocation, and the stager (``shardio stage --node auto``) reads
the same node list as the training ranks. Every (shard, key) pair has a score, a 64-bit hash
of (seed, shard number, key); shard s prefers the nodes in the order of their scores
(highest-random-weight, or rendezvous, hashing). The deal, over the shards in a seeded
shuffle:

1. each shard goes to the node it prefers most among those it leaves at or under the
   floor of the mean share, ``floor(total samples / N)``; a shard no node has room for
   is put aside;
2. the shards put aside (largest first, ties in the shuffle's order) each go to the
   lightest node (ties: the one the shard prefers);
3. a node left without samples (only when there are about as many shards as nodes) takes
   the smallest shard of the node holding the most.

It is a pure function of (seed, the set of keys, the shards' sample counts): the order the
keys are given in changes only the node numbers, never which key holds which shard. Every
rank and the stager compute it alike, and:

- **Balance.** Node shares differ by at most the largest shard's samples. After step 1
  every node is at or under the floor, and short of it by less than any shard put aside
  (its room only shrank after that shard found none); step 2 adds each shard to the
  lightest node, which keeps the spread at most the larger of the spread before and the
  shard's samples; step 3 moves a shard only when the heaviest node holds at most one
  shard's samples. Every node holds at least one shard with samples, given at least N such
  shards.
- **Small movement, whichever node goes.** Losing a node moves its shards (about 1/N of
  the samples) to the nodes that prefer them next, plus a small cascade: the mean share
  rises and a few shards find room at a node they prefer more. The others stay where they
  were, whatever the lost node's place in the list, and a new node takes about 1/N
  (measured in benchmarks/bench_restage.py and RESULTS.md, "Re-staging after a lost node":
  1.0 to 1.2 N-ths of the bytes for 8 nodes, a node lost first, in the middle or last, or
  one added). A host that replaces a lost one under another name takes its own share,
  not the lost one's: the lost share (1/N) is staged by the nodes that take it and the new
  host's (1/N) comes mostly from the other nodes' areas (``shardio stage --peers``). A
  SLURM requeue that renumbers the nodes (``SLURM_NODEID`` follows the sorted host list)
  moves nothing by that alone. The shuffle, not largest first, sets the order of step 1,
  so that the shards a change bumps are a fair sample of the bytes (largest first would
  make the shards of fewest samples, which may be the largest in bytes, such as video
  clips, the ones that move).
- Shards without samples are never read; each goes to the node it prefers.

Earlier releases dealt largest first to the lightest node (salt 0x70, by node number); their
shares differ from these, so a loader state saved mid-epoch under that deal is refused (state
versions before 4, :mod:`shardio.order.cursor`), and a staging area staged under it keeps
the copies that are still this node's and stages the rest.

``rotating``: that partition laid out as a ring (node 0's shards, then node 1's, ..., each
node's largest first, ties in a seeded shuffle), where node k owns an arc of as many places
as the deal gave it. Every epoch each shard moves ``m`` places round the ring, ``m =
min(floor(rotate * S / N), smallest share)`` for S shards on N nodes, so each node hands
exactly the ``m`` shards at the end of its arc to the next node and takes as many from the
one before: every moved shard changes owner, every node keeps its shard count of the deal in
every epoch (a node's share swaps its last shards, its smallest, for the smallest of the
node before), and every shard visits every node in turn. The owners of epoch e are a pure
function of (seed, keys, e), computed directly in O(shards) for any epoch (the shift is
``e * m`` modulo S), so a resumed long job and the stager, which knows the next epoch's
share in advance, never replay earlier epochs. A rotating order moves shards every epoch
anyway (the stager fetches them ahead); the ring follows the node numbers, so a change of
the nodes re-lays it, and the small movement above is the ``node`` partition's (and epoch
0's of ``rotating``).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardio.errors import UsageError
from shardio.order.permute import key_of, mix64, permute

__all__ = ["default_keys", "owners", "rotation_step", "share_of"]

_SALT_DEAL = 0x72  # 0x70: the greedy deal of earlier releases; 0x71: the nested deal
_SALT_RING = 0x73
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SCORES_PER_CHUNK = 1 << 21  # scores computed at once (16 MiB)
_MAX_KEY_CHARS = 255


def default_keys(num_nodes: int) -> tuple[str, ...]:
    """The keys of nodes known only by number: ``"0"`` to ``"N-1"``."""
    return tuple(str(i) for i in range(num_nodes))


def _key_hashes(keys: Sequence[str], seed: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """A 64-bit hash of each key under the seed."""
    salt = (seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    out = np.empty(len(keys), dtype=np.uint64)
    for i, key in enumerate(keys):
        digest = hashlib.blake2b(key.encode(), digest_size=8, key=salt, person=b"shardio-deal")
        out[i] = int.from_bytes(digest.digest(), "little")
    return out


def _scores(shard_h: np.ndarray[Any, Any], key_h: np.ndarray[Any, Any]) -> Any:
    """The score of each (shard, key) pair: a shards x keys array."""
    x = shard_h[:, None] ^ key_h[None, :]
    with np.errstate(over="ignore"):
        x *= _M1
        x ^= x >> np.uint64(32)
        x *= _M2
        x ^= x >> np.uint64(29)
    return x


def _preferred(shard_h: Any, key_h: Any, shard: int, among: np.ndarray[Any, Any]) -> int:
    """The node of ``among`` that ``shard`` prefers."""
    return int(among[np.argmax(_scores(shard_h[shard : shard + 1], key_h[among])[0])])


def _deal(sizes: np.ndarray[Any, Any], keys: tuple[str, ...], seed: int) -> np.ndarray[Any, Any]:
    """The owner of each shard (an index into ``keys``, sorted; see the module docstring)."""
    n_shards, n_nodes = len(sizes), len(keys)
    shard_h = mix64(np.arange(n_shards, dtype=np.uint64) ^ np.uint64(key_of(seed, _SALT_DEAL)))
    key_h = _key_hashes(keys, seed)
    owner = np.empty(n_shards, dtype=np.int64)  # first, each shard's favourite
    rows = max(1, _SCORES_PER_CHUNK // n_nodes)
    for start in range(0, n_shards, rows):
        owner[start : start + rows] = np.argmax(_scores(shard_h[start : start + rows], key_h), 1)
    floor = int(sizes.sum()) // n_nodes
    loads = np.zeros(n_nodes, dtype=np.int64)
    counted = [0] * n_nodes  # loads as Python ints: the common case is one comparison
    favourite, size_of = owner.tolist(), sizes.tolist()
    aside = []
    shuffled = permute(np.arange(n_shards), max(1, n_shards), key_of(seed, _SALT_DEAL, 1))
    for shard in shuffled.tolist():  # step 1
        size = size_of[shard]
        if size == 0:
            continue
        node = favourite[shard]
        if counted[node] + size > floor:
            room = np.flatnonzero(loads <= floor - size)
            if len(room) == 0:
                aside.append(shard)
                continue
            node = _preferred(shard_h, key_h, shard, room)
            owner[shard] = node
        counted[node] += size
        loads[node] += size
    aside.sort(key=lambda s: -size_of[s])  # stable: ties stay in the shuffle's order
    for shard in aside:  # step 2
        node = _preferred(shard_h, key_h, shard, np.flatnonzero(loads == loads.min()))
        owner[shard] = node
        loads[node] += size_of[shard]
    _fill_empty(sizes, owner, loads)  # step 3
    return owner


def _fill_empty(sizes: np.ndarray[Any, Any], owner: np.ndarray[Any, Any], loads: Any) -> None:
    """Each node without samples takes the smallest shard of the node holding the most
    shards with samples (ties: the lower sorted key), in place."""
    for node in np.flatnonzero(loads == 0).tolist():
        full = sizes > 0
        counts = np.bincount(owner[full], minlength=len(loads))
        giver = int(np.argmax(counts))
        mine = np.flatnonzero((owner == giver) & full)
        shard = int(mine[np.argmin(sizes[mine])])
        owner[shard] = node
        loads[giver] -= sizes[shard]
        loads[node] += sizes[shard]


def _ring_order(sizes: np.ndarray[Any, Any], seed: int) -> np.ndarray[Any, Any]:
    """The shards largest first, ties in a seeded shuffle: each node's order in the ring."""
    n_shards = len(sizes)
    shuffled = permute(np.arange(n_shards), max(1, n_shards), key_of(seed, _SALT_RING))
    ordered: np.ndarray[Any, Any] = shuffled[np.argsort(-sizes[shuffled], kind="stable")]
    return ordered


@functools.lru_cache(maxsize=4)
def _cached_deal(
    sizes: bytes, keys: tuple[str, ...], seed: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The owners (indices into ``keys`` as given) and the ring order, kept for the last few
    datasets: every rank of a node asks for the same deal each epoch (the stager once per
    rank), and a deal of 100,000 shards over 1,024 nodes takes most of a second. The arrays
    are read-only."""
    sizes_arr = np.frombuffer(sizes, dtype=np.int64)
    by_name = sorted(range(len(keys)), key=keys.__getitem__)
    owner = np.asarray(by_name, dtype=np.int64)[_deal(sizes_arr, tuple(sorted(keys)), seed)]
    ordered = _ring_order(sizes_arr, seed)
    owner.flags.writeable = False
    ordered.flags.writeable = False
    return owner, ordered


def _checked_keys(keys: Sequence[str] | None, num_nodes: int) -> tuple[str, ...]:
    """``keys`` as a tuple of ``num_nodes`` distinct names (None: the node numbers).

    Raises:
        UsageError: a key is not a non-empty string of at most 255 characters, a key is
            given twice, or there are not ``num_nodes`` of them.
    """
    if keys is None:
        return default_keys(num_nodes)
    if isinstance(keys, str):
        raise UsageError("node keys must be a sequence of names, not one string")
    given = tuple(keys)
    if len(given) != num_nodes:
        raise UsageError(f"{len(given)} node keys for {num_nodes} nodes: one per node needed")
    for key in given:
        if not isinstance(key, str) or not 0 < len(key) <= _MAX_KEY_CHARS:
            raise UsageError(f"node key {key!r} is not a name of 1 to {_MAX_KEY_CHARS} characters")
    seen: set[str] = set()
    for key in given:
        if key in seen:
            raise UsageError(f"node key {key!r} is given twice: each node needs its own")
        seen.add(key)
    return given


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
        return owner.copy()
    # The ring: node 0's shards largest first, then node 1's, ...
    ring = ordered[np.argsort(owner[ordered], kind="stable")]
    ends = np.cumsum(counts)
    shift = (epoch % n_shards) * step % n_shards  # Python ints: any epoch, no overflow
    places = (np.arange(n_shards, dtype=np.int64) + shift) % n_shards
    out = np.empty(n_shards, dtype=np.int64)
    out[ring] = np.searchsorted(ends, places, side="right")
    return out


def owners(
    sizes: Any,
    *,
    num_nodes: int,
    seed: int,
    epoch: int = 0,
    rotate: float | None = None,
    keys: Sequence[str] | None = None,
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The node (a number: an index into ``keys``) owning each shard in ``epoch``.

    Args:
        sizes: samples per shard.
        num_nodes: nodes of the job.
        seed: the order's seed.
        epoch: the epoch (matters only with ``rotate``).
        rotate: None: the fixed ``node`` partition; else ``rotating``'s fraction.
        keys: each node's name (SLURM's host names); None: the node numbers.

    Raises:
        UsageError: fewer shards with samples than nodes (a node would have nothing to read),
            a negative epoch, or keys that are not ``num_nodes`` distinct names.
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    if num_nodes < 1:
        raise UsageError(f"a partition needs at least one node, got {num_nodes}")
    epoch = int(epoch)
    if epoch < 0:
        raise UsageError(f"a partition's epoch must be >= 0, got {epoch}")
    names = _checked_keys(keys, num_nodes)
    nonempty = int((sizes_arr > 0).sum())
    if nonempty < num_nodes:
        raise UsageError(
            f"a node-partitioned order needs at least one shard per node: {num_nodes} nodes, "
            f"{nonempty} shards with samples (repack with smaller shards, or use partition=none)"
        )
    owner, ordered = _cached_deal(sizes_arr.tobytes(), names, seed)
    if rotate is None or epoch == 0:
        return owner.copy()
    return _rotate(owner, ordered, num_nodes, epoch, rotate)


def share_of(
    sizes: Any,
    *,
    num_nodes: int,
    node: int,
    seed: int,
    epoch: int = 0,
    rotate: float | None = None,
    keys: Sequence[str] | None = None,
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The shards ``node`` (a number, an index into ``keys``) owns in ``epoch``, ascending."""
    owner = owners(sizes, num_nodes=num_nodes, seed=seed, epoch=epoch, rotate=rotate, keys=keys)
    return np.flatnonzero(owner == node).astype(np.int64)
