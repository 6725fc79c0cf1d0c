"""The loader's side of watched reads: workers that stall in the storage are replaced.

A DataLoader worker of :class:`~shardio.runtime.loader.ShardLoader` reads without the read
deadline's thread hop (:meth:`shardio.read.deadline.DeadlineOpener.watch`): each ``pread``
runs in the calling thread and publishes its start in a table in shared memory, one block of
rows per worker. A thread of the worker holds the path of a call older than the deadline
(node-wide) and counts it in the block's first row. :class:`StallWatch`, a thread of the
training process, polls those counts; when one grows it kills the workers (SIGKILL: a
process blocked in a FUSE or network-filesystem wait is killable) and hands the iterator a
wake-up item, so that the loader starts new workers at once, at the first sample not yet
delivered. They find the path held and fail its reads at once: a stall costs one deadline
and one restart of the workers, per shard.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from shardio.errors import ReadStalledError
from shardio.read.deadline import DeadlineOpener
from shardio.read.watch import WATCH_SLOTS
from shardio.runtime import internals
from shardio.runtime.wire import WorkerFailure

__all__ = ["StallWatch", "WorkersStuckError", "watched_opener"]

logger = logging.getLogger(__name__)

_TICK_S = 0.05


def watched_opener(dataset: Any) -> DeadlineOpener | None:
    """The deadline opener of ``dataset`` (a ShardDataset, or one wrapped by
    ResilientDataset), or None when it reads without a deadline."""
    opener = getattr(dataset, "opener", None)
    return opener if isinstance(opener, DeadlineOpener) else None


class WorkersStuckError(Exception):
    """The loader killed its workers: no batch arrived within the watchdog's bound, or a
    worker's read stalled past the deadline (``stalls`` > 0)."""

    def __init__(self, waited_s: float, progressed: bool, *, stalls: int = 0) -> None:
        super().__init__(f"no batch for {waited_s:g} s")
        self.waited_s = waited_s
        self.progressed = progressed  # a batch was delivered since the last restart
        self.stalls = stalls


class _WatchInit:
    """A worker's init function: watch its reads in its block of the table, then run the
    init function it wraps (pinning, the user's). Picklable for spawned workers."""

    def __init__(self, table: torch.Tensor, then: Callable[[int], Any] | None) -> None:
        self.table = table
        self.then = then

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        opener = watched_opener(info.dataset) if info is not None else None
        if opener is not None:
            opener.watch(self.table[worker_id].numpy())
        if self.then is not None:
            self.then(worker_id)


class StallWatch:
    """The table of one iteration's workers and the thread that replaces them on a stall.

    Args:
        workers: the DataLoader's workers.
        timeout_s: the dataset's read deadline.
    """

    def __init__(self, *, workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.table = torch.zeros((workers, WATCH_SLOTS + 1, 2), dtype=torch.int64)
        self.table.share_memory_()  # type: ignore[no-untyped-call]
        self.fired = threading.Event()
        self.stalls = 0  # stalls the workers held before they were killed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def init_fn(self, then: Callable[[int], Any] | None) -> Callable[[int], None]:
        """The workers' init function, running ``then`` after it."""
        return _WatchInit(self.table, then)

    def start(self, batches: Any, kill: Callable[[Any], None]) -> None:
        """Watch the workers of the DataLoader iterator ``batches``; ``kill`` kills them.
        Started again for each run of persistent workers (after :meth:`stop`)."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(batches, kill), name="shardio-stall-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def stuck(self, progressed: bool) -> WorkersStuckError:
        """The error that makes the loader start new workers after the watch fired."""
        self.stop()
        return WorkersStuckError(self.timeout_s, progressed, stalls=max(1, self.stalls))

    def _run(self, batches: Any, kill: Callable[[Any], None]) -> None:
        counts = self.table[:, 0, 0]
        while not self._stop.wait(_TICK_S):
            stalls = int(counts.sum())
            if not stalls:
                continue
            self.stalls = stalls
            self.fired.set()
            kill(batches)
            _wake(batches, self.timeout_s)
            return


def _wake(batches: Any, timeout_s: float) -> None:
    """Hand the iterator an item in place of the batch it waits for, so that its ``next()``
    returns now rather than at its next look at the workers (seconds later)."""
    error = ReadStalledError(errno.ETIMEDOUT, f"a read stalled for {timeout_s:g} s")
    try:
        internals.wake(batches, WorkerFailure(error))
    except Exception:  # a closed queue: the iterator notices the dead workers itself
        logger.debug("could not wake the DataLoader iterator", exc_info=True)
