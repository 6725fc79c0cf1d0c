"""What one pass of a loader reads: the frozen run plan, and what a source's run needs.

:class:`ShardLoader <shardio.runtime.loader.ShardLoader>` builds a :class:`RunPlan` once per
pass (iteration) and hands it to its source before the DataLoader workers start, which get it
with the source. A source keeps it in a :class:`RunState` for the run's length; persistent
workers follow the loader's board from one pass to the next (:meth:`RunState.follow`).
Before building the plan the loader asks the source what its run needs of it
(:class:`RunNeeds`: the torch face, the ring's slot size, the read deadline...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from shardio.order.cursor import EpochCursor
    from shardio.order.streams import RankStream
    from shardio.read.deadline import DeadlineOpener
    from shardio.runtime.transport import BatchRing

__all__ = ["MATERIALISE_LIMIT", "RunNeeds", "RunPlan", "RunState", "run_positions"]

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


@dataclass(frozen=True, kw_only=True, eq=False)
class RunPlan:
    """What one pass of the loader reads, built once by the loader and handed to the source
    (and with it to the workers) before they start.

    A worker reads batches ``id``, ``id + workers``, ... (the DataLoader deals batches to its
    workers in turn, and asks each for ``depth`` at once when the epoch starts); in map
    mode, before reading its first, it advises its next ``depth - 1`` too (stream mode reads
    its shards ahead instead).

    Attributes:
        positions: the rank's positions that make this run's batches, in order (an array,
            or a lazy RankStream for an epoch too large for one): batch ``b`` is
            ``positions[b * batch_size:(b + 1) * batch_size]``.
        batch_size: samples per batch.
        workers: DataLoader workers (0: read in the training process).
        depth: batches of each worker advised at once (its prefetch factor, at least 2).
        shares_opens: the workers read through the training process's descriptors (forked
            workers inherit them, reader threads take duplicates): it opens the epoch's
            first shards for them before they start.
        drop_last: the run is cut to whole batches (persistent workers cut theirs alike).
        ring: the ring transport's shared-memory slots the workers read into, or None
            (each batch takes a fresh shared segment).
        board: persistent workers: a shared int64 tensor ``[run, epoch, consumed]`` the loader
            rewrites before each later pass; None starts new workers every pass.
        threads: the workers are reader threads of the training process, not processes.
    """

    positions: Any
    batch_size: int
    workers: int
    depth: int = 2
    shares_opens: bool = False
    drop_last: bool = False
    ring: BatchRing | None = None
    board: Any = None
    threads: bool = False


@dataclass(frozen=True, kw_only=True)
class RunNeeds:
    """What a source's run needs of the loader (:meth:`ReadSource.needs`).

    Attributes:
        mode: "map" (the DataLoader samples positions) or "stream" (the source deals them).
        slot_bytes: the ring's slot size (the largest batch payload of the run); None: the
            run's batches take no ring (decoded samples, another transport, no workers).
        read_timeout_s: the read deadline in force (0: none): the default watchdog's base.
        watch: the deadline opener the workers' stall watch reads through, or None.
        shards: shards a stalled read can hold (bounds the restarts for stalls in a row).
        where: what the source reads, for messages (its path, or its sources' paths).
    """

    mode: str
    slot_bytes: int | None
    read_timeout_s: float
    watch: DeadlineOpener | None
    shards: int
    where: str


class RunState:
    """A source's run while a loader drives it: the plan, and what a worker followed of it."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        self.board_run = -1 if plan.board is None else int(plan.board[0])
        self.advised_in = -1  # map mode: the process whose first batches were advised

    def follow(self, cursor: EpochCursor) -> bool:
        """In a persistent worker at a pass's start: take that pass's epoch and position
        from the loader's board and recompute the positions it deals (the same as the
        loader's). Whether a new pass began."""
        board = self.plan.board
        if board is None or int(board[0]) == self.board_run:
            return False
        self.board_run = int(board[0])
        cursor.place(int(board[1]), int(board[2]))
        plan = self.plan
        positions = run_positions(cursor.stream(), plan.batch_size, plan.drop_last)
        self.plan = dataclasses.replace(plan, positions=positions)
        self.advised_in = -1  # advise this pass's first batches too
        return True
