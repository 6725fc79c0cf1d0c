"""The epoch and position a dataset face shows, all held by its cursor.

:class:`CursorFace` is what ShardDataset and MixedDataset share of their public face: the
epoch, the rank layout, this rank's share of the epoch and the resumable position, each the
dataset's :class:`~shardio.order.cursor.EpochCursor` (a mix's is a
:class:`~shardio.order.mix.MixCursor`, whose epoch and layout are its sources').
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardio.metrics.read import ReadMetrics
from shardio.metrics.snapshots import MetricsSnapshot, snapshot
from shardio.metrics.steps import StepTimer
from shardio.order.cursor import EpochCursor
from shardio.order.ranks import RankInfo

__all__ = ["CursorFace"]


class CursorFace:
    """The epoch and position methods of a dataset whose ``cursor`` owns them.

    Attributes:
        cursor: the one owner of the epoch and the position in it (advanced as samples
            reach the training loop, by direct iteration or by a loader).
    """

    cursor: EpochCursor

    def read_metrics(self) -> ReadMetrics:  # pragma: no cover - each face has its own
        """This rank's read figures."""
        raise NotImplementedError

    def by_source(self) -> Mapping[str, int] | None:
        """Samples delivered per source (a mix's); None for a single dataset."""
        return None

    def snapshot(self, steps: StepTimer, *, transport: Mapping[str, int]) -> MetricsSnapshot:
        """This rank's read figures (:meth:`read_metrics`) with a loader's ``steps`` and
        ``transport`` counts (and a mix's samples per source)."""
        ranks = self.cursor.ranks()
        return snapshot(
            self.read_metrics(),
            steps,
            rank=ranks.rank,
            world_size=ranks.world_size,
            transport=transport,
            sources=self.by_source(),
        )

    @property
    def epoch(self) -> int:
        """The epoch (``cursor.epoch``; a mix's sources are in it too)."""
        return self.cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (a mix's sources too); a new epoch reshuffles and starts from its
        beginning.

        Raises:
            UsageError: ``epoch`` is not an integer >= 0.
        """
        self.cursor.set_epoch(epoch)

    def ranks(self) -> RankInfo:
        """The rank layout used for splitting (detected at call time unless given; a mix's
        is its sources' common one)."""
        return self.cursor.ranks()

    @property
    def drop_last(self) -> bool:
        """Whether each rank's epoch is cut instead of padded (``spec.drop_last``)."""
        return self.cursor.spec.drop_last

    def rank_indices(self, *, consumed: int | None = None) -> np.ndarray[Any, Any]:
        """What this rank reads in the rest of the epoch (sample indices; a mix's positions),
        as one array: a sampler for a plain DataLoader."""
        return self.cursor.stream(consumed=consumed).materialise()

    def samples_per_rank(self) -> int:
        """Samples each rank reads in a whole epoch (of the layout now)."""
        return self.cursor.samples_per_rank()

    # -- resumable state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: global positions delivered (``cursor.state()``; a
        mix's also says what the mix is made of). Plain values: JSON-ready."""
        return self.cursor.state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, also with another number of ranks or nodes
        (see :meth:`EpochCursor.load <shardio.order.cursor.EpochCursor.load>`).

        Raises:
            UsageError: the state is malformed (a key missing, of the wrong type or out of
                range), of another version, or from a dataset with another order (a mix:
                other sources, weights, seed or source orders).
        """
        self.cursor.load(state)
