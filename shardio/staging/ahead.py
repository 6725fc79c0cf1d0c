"""EpochStager: stage a node's share epoch by epoch, the next epoch's in the background.

A rotating order (``partition=rotating``) hands some of every node's shards to other nodes
each epoch; the order is a pure function of (seed, epoch), so the shards of epoch e + 1 are
known during epoch e. One process per node (local rank 0, or the job script) runs::

    stager = EpochStager(src, area, StageOptions(node=..., num_nodes=..., ranks_per_node=...,
                                                spec=spec, capacity_bytes=...))
    for epoch in range(epochs):
        stager.advance(epoch)   # epoch's share is staged; the next one's starts in the background
        ...train the epoch...
    stager.close()

:meth:`EpochStager.advance` returns once the epoch's shards are staged (usually at once: the
previous call staged them ahead) and starts a background run (a thread named
``shardio-stage-ahead``) that stages this epoch's and the next epoch's shards within the
capacity and evicts every staged shard neither needs; a copy a reader still holds is not
evicted (it goes at a later run). A failure of the background run is raised by the next
``advance`` or by ``close``, as the same exception.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from shardio.errors import UsageError
from shardio.staging.stage import StageOptions, StageResult, stage_dataset

__all__ = ["EpochStager"]


class EpochStager:
    """Stages the node's share of each epoch, and the next epoch's ahead.

    Args:
        src: the dataset.
        dest: the node's staging area.
        options: the node, layout, order spec and capacity (its ``epoch`` and ``ahead`` are
            set by :meth:`advance`).

    Attributes:
        results: the result of every run, in order (background runs when they end).
    """

    def __init__(
        self, src: str | os.PathLike[str], dest: str | os.PathLike[str], options: StageOptions
    ) -> None:
        self.src = os.fspath(src)
        self.dest = os.fspath(dest)
        self.options = options
        self.results: list[StageResult] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._covered = -1  # the last epoch a finished run staged in full
        self._running_for = -1  # the last epoch the running run covers
        self._closed = False

    def advance(self, epoch: int) -> StageResult | None:
        """Make ``epoch``'s share staged, then start staging the next epoch's.

        Returns:
            The result of the run that had to stage ``epoch`` now (None when it was ahead).

        Raises:
            UsageError: the stager was closed.
            ShardioError: a staging run failed (also the background run of an earlier call).
        """
        if self._closed:
            raise UsageError("this EpochStager is closed")
        self._join()
        now = None
        if self._covered < epoch:
            now = self._run(epoch, ahead=0)
        self._running_for = epoch + 1
        self._thread = threading.Thread(
            target=self._background, args=(epoch,), name="shardio-stage-ahead", daemon=True
        )
        self._thread.start()
        return now

    def _run(self, epoch: int, *, ahead: int) -> StageResult:
        options = dataclasses.replace(self.options, epoch=epoch, ahead=ahead)
        result = stage_dataset(self.src, self.dest, options)
        self.results.append(result)
        if not result.from_source:
            self._covered = max(self._covered, epoch + ahead)
        return result

    def _background(self, epoch: int) -> None:
        try:
            self._run(epoch, ahead=1)
        except BaseException as exc:  # handed to the next advance() or close()
            self._error = exc

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the background run (again: a no-op).

        Raises:
            ShardioError: the background run failed.
        """
        if self._closed:
            return
        self._closed = True
        self._join()

    def __enter__(self) -> EpochStager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
