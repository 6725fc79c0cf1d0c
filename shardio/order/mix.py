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
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec

__all__ = ["MixCursor", "apportion", "check_weight", "mix_counts", "mix_schedule", "rank_layout"]


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
        UsageError: a source has no samples.
    """
    for s, size in enumerate(sizes):
        if size <= 0:
            raise UsageError(f"source {s} of the mix has no samples")
    norm = [w / sum(weights) for w in weights]
    # The minimum before the floor: a tiny weight's n / w is inf, which has no floor.
    total = math.floor(min(n / w for n, w in zip(sizes, norm, strict=True)))

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
    """The mix of an epoch: (source of each position, its draw number in that source).

    Source ``s``'s ``k``-th draw sits at the virtual time ``(k + u_s) / counts[s]``, with
    phases ``u`` drawn from (seed, epoch); positions follow the times (ties: lower source).
    """
    phases = np.random.Generator(np.random.PCG64([seed, epoch])).random(len(counts))
    spans: list[np.ndarray[Any, Any]] = [
        (np.arange(c, dtype=np.float64) + phases[s]) / c for s, c in enumerate(counts) if c
    ]
    times = np.concatenate(spans or [np.empty(0)])
    order = np.argsort(times, kind="stable")  # concatenated by source: ties to the lower
    source = np.repeat(np.arange(len(counts), dtype=np.int32), counts)[order]
    draw = np.concatenate(
        [np.arange(c, dtype=np.int64) for c in counts] or [np.empty(0, dtype=np.int64)]
    )
    return source, draw[order].astype(np.int64)


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
