"""What ShardLoader needs of what it reads: the small source protocol.

ShardDataset and MixedDataset satisfy it; the loader reaches them through these members
only. The source owns the epoch and the position in it (:attr:`~ReadSource.cursor`, which
the loader advances as it hands batches to the training loop), says what a run over some
positions needs (:meth:`~ReadSource.needs`), is given each pass's frozen
:class:`~shardio.runtime.plan.RunPlan` (:meth:`~ReadSource.begin_run`,
:meth:`~ReadSource.end_run`), takes back what the workers send beside the samples
(:meth:`~ReadSource.absorb`) and reports the rank's figures (:meth:`~ReadSource.snapshot`).
Its batch read is its torch face: ``__getitems__`` (map mode) or ``__iter__`` (stream mode),
which the DataLoader calls in the workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shardio.metrics.snapshots import MetricsSnapshot
    from shardio.metrics.steps import StepTimer
    from shardio.order.cursor import EpochCursor
    from shardio.runtime.plan import RunNeeds, RunPlan

__all__ = ["FAULTS_KEY", "ReadSource"]

# What the loader itself saw (worker restarts, stalls), handed to ``absorb`` under this key.
FAULTS_KEY = "__shardio_faults__"


@runtime_checkable
class ReadSource(Protocol):
    """A source ShardLoader can drive (a torch ``Dataset`` or ``IterableDataset`` too)."""

    @property
    def cursor(self) -> EpochCursor:
        """The one owner of the epoch and the position in it (its ``state()`` is what a
        checkpoint records)."""

    @property
    def dataset_id(self) -> str | None:
        """What a checkpoint of the position records, so it resumes no other data."""

    def needs(self, positions: Any, *, batch_size: int, workers: int) -> RunNeeds:
        """What a run over ``positions`` needs of the loader (asked before its plan)."""

    def begin_run(self, plan: RunPlan) -> None:
        """Take a pass's plan, before the loader starts its workers (they get it along)."""

    def end_run(self) -> None:
        """After the pass (its workers shut down or parked): direct use reads as before."""

    def absorb(self, sent: dict[str, Any]) -> None:
        """Take out of ``sent`` (a delivered batch, or ``{FAULTS_KEY: counts}`` of the
        loader's own) what it carries beside the samples, into the rank's figures."""

    def snapshot(self, steps: StepTimer, *, transport: Mapping[str, int]) -> MetricsSnapshot:
        """The rank's data path so far: read figures, ``steps``' timings, ``transport``."""
