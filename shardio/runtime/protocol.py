"""What ShardLoader needs of a dataset: the small protocol ShardDataset satisfies.

The loader drives a run of DataLoader workers through these public calls only: the epoch
cursor (the one owner of the epoch and the position in it, which the loader advances as it
hands batches to the training loop), the run's plan handed to the workers
(:meth:`begin_run`, :meth:`end_run`), and the figures and events the workers send back
(:meth:`absorb_metrics`, :meth:`absorb_events`, :meth:`count_faults`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from shardio.metrics.read import ReadMetrics
    from shardio.order.cursor import EpochCursor
    from shardio.order.streams import RankStream
    from shardio.read import Opener
    from shardio.read.packed import PackedDataset
    from shardio.runtime.transport import BatchRing

__all__ = ["MATERIALISE_LIMIT", "LoaderDataset", "run_positions"]

# Samples of a rank's epoch held as one array; a longer epoch stays a lazy RankStream.
MATERIALISE_LIMIT = 1 << 22


def run_positions(stream: RankStream, batch_size: int, drop_last: bool) -> Any:
    """The samples of a loader's run over ``stream`` (the rest of the rank's epoch) that make
    its batches: an array (a lazy stream for a very long epoch), cut to whole batches with
    ``drop_last``. The loader and its persistent workers compute it alike."""
    positions: Any = stream.materialise() if len(stream) <= MATERIALISE_LIMIT else stream
    if drop_last:
        n = len(positions) // batch_size * batch_size
        return positions[:n] if isinstance(positions, np.ndarray) else positions.head(n)
    return positions


class LoaderDataset(Protocol):
    """A dataset ShardLoader can drive (a torch ``Dataset`` or ``IterableDataset`` too)."""

    @property
    def mode(self) -> str: ...

    @property
    def transport(self) -> str: ...

    @property
    def decode(self) -> Any: ...

    @property
    def transform(self) -> Any: ...

    @property
    def path(self) -> str: ...

    @property
    def timed(self) -> bool: ...

    @property
    def read_timeout_s(self) -> float: ...

    @property
    def opener(self) -> Opener | None: ...

    @property
    def cursor(self) -> EpochCursor: ...

    @property
    def packed(self) -> PackedDataset: ...

    def begin_run(
        self,
        positions: Any,
        *,
        batch_size: int,
        workers: int,
        prefetch: object = None,
        forked: bool = False,
        ring: BatchRing | None = None,
        board: Any = None,
        drop_last: bool = False,
    ) -> None: ...

    def end_run(self) -> None: ...

    def read_metrics(self) -> ReadMetrics: ...

    def absorb_metrics(self, delta: object) -> None: ...

    def absorb_events(self, events: list[dict[str, Any]]) -> None: ...

    def count_faults(self, **counts: int) -> None: ...
