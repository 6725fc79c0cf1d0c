"""The arithmetic of a weighted mix: weights, draws per source, the epoch's schedule, its cursor.

Pure functions of the sizes, weights, seed and epoch (numpy only), used by
:class:`shardio.runtime.mixed.MixedDataset`; see its module for what they mean.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardio.errors import UsageError
from shardio.order.cursor import EpochCursor
from shardio.order.orders import EpochOrder
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec

__all__ = [
    "MixCursor",
    "MixOrder",
    "MixSchedule",
    "apportion",
    "check_weight",
    "mix_counts",
    "mix_schedule",
    "rank_layout",
]

_CELLS_PER_CHUNK = 1 << 18  # candidates (positions x draws) ordered at once: a few MB
_MAX_FIXES = 64  # steps correcting an estimated draw count (rounding needs one or two)
_MAX_DRAWS = 2**53  # draws of an epoch: their float64 times are distinct up to here


def check_weight(value: object, index: int) -> float:
    """``value`` as a positive finite weight.

    Raises:
        UsageError: a bool, not a real number, or not positive and finite.
    """
    if isinstance(value, bool | np.bool_):
        raise UsageError(f"weight of source {index} must be a number, not a bool ({value!r})")
    if not isinstance(value, numbers.Real):
        raise UsageError(
            f"weight of source {index} must be a number, got {type(value).__name__} {value!r}"
        )
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise UsageError(f"weight of source {index} must be positive and finite, got {value!r}")
    return number


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` draws shared by ``weights`` (summing to 1): largest remainders, ties to the
    lower source."""
    quotas = [total * w for w in weights]
    counts = [math.floor(q) for q in quotas]
    rest = total - sum(counts)
    by_remainder = sorted(range(len(weights)), key=lambda s: (counts[s] - quotas[s], s))
    for s in by_remainder[:rest]:
        counts[s] += 1
    return counts


def mix_counts(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Draws per source in an epoch: the apportionment by ``weights`` (normalised) of the
    longest mix in which no source draws more than its ``sizes`` (the first to run out ends
    the epoch).

    Raises:
        UsageError: a source has no samples, or the epoch would exceed 2**53 draws.
    """
    for s, size in enumerate(sizes):
        if size <= 0:
            raise UsageError(f"source {s} of the mix has no samples")
    norm = [w / sum(weights) for w in weights]
    # The minimum before the floor: a tiny weight's n / w is inf, which has no floor.
    total = math.floor(min(n / w for n, w in zip(sizes, norm, strict=True)))
    if total > _MAX_DRAWS:
        raise UsageError(
            f"a mix of these sources would draw about {total} samples an epoch, more than the "
            f"{_MAX_DRAWS} (2**53) whose order float64 times can tell apart"
        )

    def fits(n: int) -> bool:
        return all(c <= size for c, size in zip(apportion(n, norm), sizes, strict=True))

    while total > 0 and not fits(total):  # rounding of n / w: a step or two at most
        total -= 1
    while fits(total + 1):
        total += 1
    return apportion(total, norm)


def mix_schedule(
    counts: Sequence[int], seed: int, epoch: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The whole mix of an epoch as arrays: (source of each position, its draw number in that
    source); memory: 12 bytes a position (:class:`MixSchedule` computes any part of it)."""
    schedule = MixSchedule(counts, seed, epoch)
    return schedule.take(np.arange(schedule.size, dtype=np.int64))


class MixSchedule:
    """The mix of one epoch, evaluated position by position (nothing of the size of the epoch
    is built: a mix of billions of draws starts at once).

    Source ``s``'s ``k``-th draw sits at the virtual time ``(k + u_s) / counts[s]`` (float64),
    with phases ``u`` drawn from (seed, epoch); positions follow the times, ties to the lower
    source. The draws of source ``s`` before time ``t`` number about ``t * counts[s] - u_s``,
    so the draw at position ``p`` lies within a few draws per source of time
    ``(p + sum(u)) / N``: :meth:`take` counts each source's draws below a bound exactly (with
    the same float64 times) and orders the few candidates above it.

    Args:
        counts: draws per source in the epoch (:func:`mix_counts`).
        seed, epoch: the phases are a pure function of these.
    """

    def __init__(self, counts: Sequence[int], seed: int, epoch: int) -> None:
        phases = np.random.Generator(np.random.PCG64([seed, epoch])).random(len(counts))
        all_counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        self.size = int(all_counts.sum())
        # Sources without draws take no part (their phase is still drawn: the others' stay).
        self._drawing = np.flatnonzero(all_counts > 0)
        self._count = all_counts[self._drawing]
        self._count_f = self._count.astype(np.float64)
        self._phase = phases[self._drawing]
        self._phase_sum = float(self._phase.sum())
        n = len(self._drawing)
        # Candidates per position: about (n + 4) * count / size + 2 per source.
        width = float(np.sum((n + 4) * self._count_f / max(1, self.size))) + 3 * n + 1
        self._chunk = max(16, int(_CELLS_PER_CHUNK // width))

    def __len__(self) -> int:
        return self.size

    def _times(self, draws: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The virtual time of each draw (columns: the drawing sources), as the eager merge
        computed it: ``(k + u_s) / counts[s]`` in float64."""
        times: np.ndarray[Any, Any] = (draws.astype(np.float64) + self._phase) / self._count_f
        return times

    def _draws_before(self, bound: np.ndarray[Any, Any], *, inclusive: bool) -> Any:
        """Draws of each source whose time is below ``bound`` (at or below, ``inclusive``):
        an int64 array (positions, sources), exact for the float64 times."""
        estimate = np.ceil(bound[:, None] * self._count_f - self._phase)
        draws = np.minimum(np.clip(estimate, 0, self._count_f).astype(np.int64), self._count)
        inside = np.less_equal if inclusive else np.less
        for _ in range(_MAX_FIXES):  # the estimate is off by rounding: a step or two
            down = (draws > 0) & ~inside(self._times(draws - 1), bound[:, None])
            up = (draws < self._count) & inside(self._times(draws), bound[:, None])
            if not (down.any() or up.any()):
                return draws
            draws += up.astype(np.int64) - down.astype(np.int64)
        raise RuntimeError("MixSchedule: draw counts did not settle")  # pragma: no cover

    def take(self, positions: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(source, draw number in that source) of each of ``positions``.

        Raises:
            IndexError: a position is outside ``[0, len(self))``.
        """
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.size):
            bad = int(pos.min()) if int(pos.min()) < 0 else int(pos.max())
            raise IndexError(f"position {bad} out of range for a mix of {self.size}")
        source = np.empty(pos.size, dtype=np.int32)
        draw = np.empty(pos.size, dtype=np.int64)
        for start in range(0, pos.size, self._chunk):
            part = slice(start, start + self._chunk)
            source[part], draw[part] = self._take_chunk(pos[part])
        return source, draw

    def _take_chunk(self, pos: np.ndarray[Any, Any]) -> tuple[Any, Any]:
        n = len(self._drawing)
        # Bounds around each position's time: draws below ``low`` number at most pos - 2,
        # draws at or below ``high`` at least pos + 2 (each source's count is within one of
        # t * count - u); widened where float rounding says otherwise.
        margin = np.full(pos.size, n + 2, dtype=np.float64)
        while True:
            low = (pos - margin + self._phase_sum) / self.size
            high = (pos + margin + self._phase_sum) / self.size
            below = self._draws_before(low, inclusive=False)
            upto = self._draws_before(high, inclusive=True)
            wrong = (below.sum(axis=1) > pos) | (upto.sum(axis=1) <= pos)
            if not wrong.any():
                break
            margin[wrong] *= 4  # pragma: no cover - rounding beyond a draw per source
        # The candidates: each source's draws between the bounds, by source then draw (the
        # stable sort then breaks ties of time to the lower source, as the merge did).
        widths = (upto - below).max(axis=0)
        columns = np.repeat(np.arange(n), widths)
        offsets = np.arange(columns.size) - np.repeat(np.cumsum(widths) - widths, widths)
        candidates = below[:, columns] + offsets
        times = np.where(
            candidates < upto[:, columns],
            (candidates.astype(np.float64) + self._phase[columns]) / self._count_f[columns],
            np.inf,
        )
        rank = pos - below.sum(axis=1)
        chosen = np.argsort(times, axis=1, kind="stable")[np.arange(pos.size), rank]
        return self._drawing[columns[chosen]], candidates[np.arange(pos.size), chosen]


class MixOrder:
    """The mix of one epoch down to samples: (source, sample index in that source) of any
    position, from the :class:`MixSchedule` and each source's lazy epoch order.

    Args:
        counts: draws per source in the epoch.
        seed, epoch: the mix's seed and the epoch (the sources' epoch too).
        sources: ``(shard sizes, order spec)`` of each source: its global epoch order is the
            one :meth:`EpochCursor.epoch_order <shardio.order.cursor.EpochCursor.epoch_order>`
            materialises, evaluated position by position here.
    """

    def __init__(
        self,
        counts: Sequence[int],
        seed: int,
        epoch: int,
        sources: Sequence[tuple[Any, OrderSpec]],
    ) -> None:
        self.epoch = epoch
        self.schedule = MixSchedule(counts, seed, epoch)
        self.orders = [
            EpochOrder(
                sizes,
                order=spec.order,
                seed=spec.seed,
                epoch=epoch,
                window_shards=spec.window_shards,
            )
            for sizes, spec in sources
        ]

    def take(self, positions: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(source, sample index in that source) of each of ``positions``.

        Raises:
            IndexError: a position is outside the mix.
        """
        source, draw = self.schedule.take(positions)
        index = np.empty_like(draw)
        for s in np.unique(source).tolist():
            mine = source == s
            index[mine] = self.orders[s].take(draw[mine])
        return source, index


def rank_layout(ranks: RankInfo) -> tuple[int, int, int]:
    return ranks.rank, ranks.world_size, ranks.node_size


class MixCursor(EpochCursor):
    """The mix's position: an EpochCursor over the ``N`` positions of the mix whose rank
    layout is its sources' (checked to agree) and whose epoch is theirs too."""

    def __init__(self, spec: OrderSpec, total: int, sources: Sequence[EpochCursor]) -> None:
        super().__init__(spec, [total])
        self.sources = list(sources)

    def ranks(self) -> RankInfo:
        """The sources' common rank layout (detected at call time unless given to them).

        Raises:
            UsageError: the sources see different rank layouts.
        """
        layouts = [c.ranks() for c in self.sources]
        for s, layout in enumerate(layouts[1:], start=1):
            if rank_layout(layout) != rank_layout(layouts[0]):
                raise UsageError(
                    f"the sources of a mix must share one rank layout: source 0 is rank "
                    f"{layouts[0].rank} of {layouts[0].world_size} ({layouts[0].node_size} a "
                    f"node), source {s} rank {layout.rank} of {layout.world_size} "
                    f"({layout.node_size} a node)"
                )
        return layouts[0]

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        for cursor in self.sources:
            cursor.set_epoch(self.epoch)

    def begin(self) -> None:
        """At an iteration's start (see EpochCursor.begin); a source whose epoch was set on
        its own follows the mix's again."""
        super().begin()
        for cursor in self.sources:
            cursor.set_epoch(self.epoch)

    def place(self, epoch: int, consumed: int) -> None:
        super().place(epoch, consumed)
        for cursor in self.sources:
            cursor.set_epoch(self.epoch)

    def load(self, state: Mapping[str, Any]) -> None:
        super().load(state)
        for cursor in self.sources:
            cursor.set_epoch(self.epoch)
