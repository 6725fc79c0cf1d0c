"""Sample order: a pure function of (seed, epoch), split across ranks and workers.

Orders:
    ``random``       a full permutation: best mixing, random reads over all shards.
    ``shard-local``  shards shuffled, then samples shuffled within windows of a few shards:
                     reads stay within a few shards at a time (sequential-ish, friendly to
                     cold caches and to staging), mixing is limited to the window.
    ``sequential``   dataset order (no shuffling).

Ranks take interleaved positions of the remaining global order (rank r takes positions
r, r + W, ...), padded by repeating from its start (or cut) to a multiple of the world size.
So after every rank has delivered k samples the global prefix ``consumed + k*W`` is done,
which is what makes mid-epoch resume exact, also with a different number of ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardio.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ORDERS", "check_order", "epoch_order", "rank_positions"]

ORDERS = ("random", "shard-local", "sequential")


def check_order(order: str) -> None:
    """Raise UsageError unless ``order`` is one of ORDERS."""
    if order not in ORDERS:
        raise UsageError(f"invalid order {order!r}: choose one of {', '.join(ORDERS)}")


def epoch_order(
    *,
    shard_sizes: np.ndarray[Any, Any],
    seed: int,
    epoch: int,
    order: str,
    window_shards: int = 4,
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Return the global sample order of one epoch.

    Args:
        shard_sizes: samples per shard, in dataset order.
        seed: the job's seed.
        epoch: the epoch number.
        order: one of ORDERS.
        window_shards: shards per shuffle window in ``shard-local`` order.
    """
    check_order(order)
    import numpy as np  # here: ORDERS and check_order are for callers that need no numpy

    sizes = np.asarray(shard_sizes, dtype=np.int64)
    n = int(sizes.sum())
    if order == "sequential":
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, epoch, 0x5D])
    if order == "random":
        return rng.permutation(n).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    shard_perm = rng.permutation(len(sizes))
    out = np.empty(n, dtype=np.int64)
    pos = 0
    for w in range(0, len(shard_perm), max(1, window_shards)):
        window = shard_perm[w : w + window_shards]
        idx = np.concatenate([np.arange(starts[s], starts[s] + sizes[s]) for s in window])
        rng.shuffle(idx)
        out[pos : pos + len(idx)] = idx
        pos += len(idx)
    return out


def rank_positions(
    order: np.ndarray[Any, np.dtype[np.int64]],
    *,
    consumed: int,
    rank: int,
    world_size: int,
    drop_last: bool = False,
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Return the sample indices one rank reads from the rest of the epoch.

    Args:
        order: the epoch's global order.
        consumed: global positions already delivered (0 at the start of an epoch).
        rank: this rank.
        world_size: ranks now (may differ from the run that consumed the prefix).
        drop_last: cut the remainder instead of padding, so no sample repeats.

    Every rank gets the same count, so collective operations never hang at epoch end.
    """
    import numpy as np

    rest = order[min(consumed, len(order)) :]
    if drop_last:
        total = len(rest) // world_size * world_size
        rest = rest[:total]
    else:
        total = -(-len(rest) // world_size) * world_size
        if total > len(rest):
            pad_from = order if len(order) else rest
            rest = np.concatenate([rest, np.resize(pad_from, total - len(rest))])
    return rest[rank::world_size]
