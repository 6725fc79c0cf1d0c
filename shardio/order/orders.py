"""The order of one epoch over a set of shards, evaluated position by position.

Orders (the ``order`` of :class:`~shardio.order.spec.OrderSpec`):
    ``random``       a full permutation of the samples: best mixing, random reads.
    ``shard-local``  shards shuffled, then samples shuffled within windows of a few shards:
                     reads stay within a few shards at a time (sequential-ish, friendly to
                     cold caches and to staging); mixing is limited to the window.
    ``sequential``   dataset order (no shuffling).

An :class:`EpochOrder` holds O(shards) numbers and computes ``take(positions)`` on demand
(:mod:`shardio.order.permute`), so a billion-sample epoch starts in milliseconds and a rank
materialises only the positions it asks for. It is a pure function of (seed, epoch, the
shards it covers, salt): every rank and every process computes the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardio.order.permute import key_of, permute
from shardio.order.spec import ORDERS, check_order

__all__ = ["ORDERS", "EpochOrder", "check_order", "make_order"]
_SALT_SAMPLES = 0x5D
_SALT_SHARDS = 0x5E
_SALT_WINDOWS = 0x5F


class EpochOrder:
    """The samples of some shards in one epoch's order, computed position by position.

    Args:
        sizes: samples per shard of the whole dataset.
        shards: the shards this order covers, ascending (None: all of them).
        order: one of ORDERS.
        seed, epoch: the order is a pure function of these (and of ``salt``).
        window_shards: shards per window in ``shard-local`` order.
        salt: tells apart orders of the same epoch over other shard sets (a node's).
    """

    def __init__(
        self,
        sizes: Any,
        *,
        shards: Any = None,
        order: str,
        seed: int,
        epoch: int,
        window_shards: int = 4,
        salt: int = 0,
    ) -> None:
        check_order(order)
        all_sizes = np.asarray(sizes, dtype=np.int64)
        starts = np.zeros(len(all_sizes), dtype=np.int64)
        np.cumsum(all_sizes[:-1], out=starts[1:])
        self.order = order
        self._everything = shards is None
        chosen = np.arange(len(all_sizes)) if shards is None else np.asarray(shards, np.int64)
        self._key = key_of(seed, epoch, salt, _SALT_SAMPLES)
        if order == "shard-local":
            k = key_of(seed, epoch, salt, _SALT_SHARDS)
            chosen = chosen[permute(np.arange(len(chosen)), max(1, len(chosen)), k)]
        self._shard_first = starts[chosen]  # first sample of each shard, in order
        sizes_in_order = all_sizes[chosen]
        self._offsets = np.zeros(len(chosen) + 1, dtype=np.int64)  # positions of each shard
        np.cumsum(sizes_in_order, out=self._offsets[1:])
        self.size = int(self._offsets[-1])
        if order == "shard-local":
            window = max(1, int(window_shards))
            self._window_starts = self._offsets[::window]  # position of each window's start
            ends = np.append(self._window_starts[1:], self.size)
            self._window_sizes = ends - self._window_starts
            self._window_seed = key_of(seed, epoch, salt, _SALT_WINDOWS)

    def __len__(self) -> int:
        return self.size

    @property
    def memory_bytes(self) -> int:
        """Bytes the order holds: its per-shard (and per-window) tables, whatever the epoch's
        size (materialising it would cost 8 bytes per sample)."""
        tables = [self._shard_first, self._offsets]
        if self.order == "shard-local":
            tables += [self._window_starts, self._window_sizes]
        return sum(int(t.nbytes) for t in tables)

    def take(self, positions: Any) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The samples at ``positions`` (each in ``[0, len(self))``) of this epoch."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size == 0:
            return pos.astype(np.int64)
        if self.order == "random":
            pos = permute(pos, self.size, self._key)
        elif self.order == "shard-local":
            w = np.searchsorted(self._window_starts, pos, side="right") - 1
            keys = np.asarray(self._window_seed, dtype=np.uint64) ^ w.astype(np.uint64)
            local = permute(pos - self._window_starts[w], self._window_sizes[w], keys)
            pos = self._window_starts[w] + local
        if self._everything and self.order != "shard-local":
            return pos  # shards in dataset order: a position is a sample
        k = np.searchsorted(self._offsets, pos, side="right") - 1
        return self._shard_first[k] + (pos - self._offsets[k])

    def materialise(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The whole order as an array (memory: 8 bytes per sample)."""
        return self.take(np.arange(self.size, dtype=np.int64))


def make_order(
    sizes: Any,
    *,
    order: str,
    seed: int,
    epoch: int,
    window_shards: int = 4,
    shards: Any = None,
    salt: int = 0,
) -> EpochOrder:
    """The :class:`EpochOrder` of ``shards`` (all by default) in ``epoch``."""
    return EpochOrder(
        sizes,
        shards=shards,
        order=order,
        seed=seed,
        epoch=epoch,
        window_shards=window_shards,
        salt=salt,
    )
