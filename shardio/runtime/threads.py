"""Reader threads: a ShardLoader's workers as threads of the training process
(``ShardLoader(..., threads=True)``).

Each thread reads the batches a DataLoader worker of the same number would (batch ``j`` by
thread ``j % num_workers``: the same order, the same advice and read-ahead) through its own
copy of the dataset, taken as a spawned worker gets it (``copy.deepcopy`` of the state it
pickles: its own reader, descriptors, read figures and recovery policy; a ``transform`` or
``rebuild`` function is shared, not pickled). The batches stay in the thread's reused
buffers: nothing is forked, copied into shared memory or sent through a socket. Reading and
hashing release the GIL, so for undecoded batches two threads read about as fast as two
processes for less CPU (``benchmarks/RESULTS.md``, CPU per verified GB). The copies and
buffers are kept from one run (epoch) to the next, as persistent workers keep theirs.

:func:`worker_info` is what the dataset asks where torch's ``get_worker_info`` was asked: the
reader thread's :class:`ThreadWorkerInfo` in such a thread, else torch's answer.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import get_worker_info

from shardio.errors import UsageError
from shardio.runtime.plan import RunPlan
from shardio.runtime.reuse import ReusedBuffers

__all__ = ["ReaderThreads", "ThreadRun", "ThreadWorkerInfo", "in_process", "worker_info"]

_local = threading.local()
# How long the end of a run waits for its threads. One still inside a read (bounded by the
# read deadline, when the dataset has one) ends by itself and closes its copy then.
_JOIN_S = 5.0
_POLL_S = 0.1  # a thread blocked on its full queue looks for the run's end this often


@dataclass(frozen=True)
class ThreadWorkerInfo:
    """A reader thread's answer to ``get_worker_info()`` (torch's WorkerInfo fields)."""

    id: int
    num_workers: int
    seed: int
    dataset: Any


def worker_info() -> Any:
    """The worker this code runs in: a reader thread's :class:`ThreadWorkerInfo`, a
    DataLoader worker's ``WorkerInfo``, or None (the training process itself)."""
    info = getattr(_local, "info", None)
    return info if info is not None else get_worker_info()


def in_process(info: Any) -> bool:
    """Whether a worker ``info`` runs in the training process (a reader thread, or none):
    its batches stay in this process's memory."""
    return info is None or isinstance(info, ThreadWorkerInfo)


class ReaderThreads:
    """A loader's reader threads: each run's threads read through copies of the dataset
    and into buffers kept from run to run.

    Args:
        workers: threads.
        depth: batches each thread has in flight (the queued ones and the one it reads).
    """

    def __init__(self, workers: int, depth: int) -> None:
        self.workers = workers
        self.depth = depth
        # Each thread's buffers: one per batch in flight, the batch the training loop holds
        # and the one it let go of (:mod:`shardio.runtime.reuse`).
        self.buffers = [ReusedBuffers(keep=depth + 2) for _ in range(workers)]
        self._copies: list[Any] | None = None  # kept for the next run
        self._source: Any = None  # the dataset they are copies of
        self._live: ThreadRun | None = None  # the run reading through them

    def run(self, dataset: Any, plan: RunPlan) -> ThreadRun:
        """Start the threads of ``dataset``'s run ``plan`` (begun on it already)."""
        if self._live is not None:
            # Another iteration of the loader still reads through the kept copies: they
            # are its own now (closed at its end), and this run takes new ones.
            self._copies = self._source = None
        if self._copies is None or self._source is not dataset:
            self.close()
            try:
                self._copies = [copy.deepcopy(dataset) for _ in range(self.workers)]
            except (TypeError, AttributeError, copy.Error) as exc:  # what pickling refuses
                raise UsageError(
                    f"threads=True: each reader thread reads through a copy of the dataset, "
                    f"and {dataset.path} cannot be copied ({exc}): use worker processes"
                ) from None
            self._source = dataset
        else:
            for kept in self._copies:
                # As a persistent worker at an epoch's start: copies staged since are found.
                kept.packed.resolver.recheck_unstaged()
        for mine in self._copies:
            mine.adopt_opens(dataset)  # the shards the training process opened for them
        self._live = ThreadRun(plan, self._copies, self.buffers, self._ended)
        return self._live

    def _ended(self, run: ThreadRun, finished: bool) -> None:
        """A run's end: its copies are kept for the next run if they are the kept ones and
        every thread of it ended; else closed (by a thread still running, as it ends)."""
        if self._live is run:
            self._live = None
        if run.copies is self._copies:
            if finished:
                return
            self._copies = self._source = None
        run.close_finished()

    def close(self) -> None:
        """Close the kept copies (their shard files and index), unless a run reads through
        them (they are closed at its end)."""
        copies, self._copies, self._source = self._copies, None, None
        if self._live is not None and self._live.copies is copies:
            return
        for kept in copies or ():
            kept.close()


class _End:
    """A thread's last item: its batches are done (``error``: it failed with this)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class ThreadRun:
    """One run's reader threads and the iterator over their batches, in the plan's order."""

    def __init__(
        self,
        plan: RunPlan,
        copies: list[Any],
        buffers: list[ReusedBuffers],
        ended: Callable[[ThreadRun, bool], None],
    ) -> None:
        self.plan = plan
        self.copies = copies
        self._ended = ended
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._done = [False] * len(copies)
        self._abandoned = False
        self._queues: list[queue.Queue[Any]] = [
            queue.Queue(maxsize=max(1, plan.depth - 1)) for _ in copies
        ]
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(k, mine, buffers[k]),
                name=f"shardio-reader-{k}",
                daemon=True,
            )
            for k, mine in enumerate(copies)
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self, k: int, mine: Any, buffers: ReusedBuffers) -> None:
        """Thread ``k``: read its batches through its copy ``mine`` into its queue, in order."""
        plan = self.plan
        mine.enter_thread(plan, buffers)
        _local.info = ThreadWorkerInfo(k, plan.workers, k, mine)
        end = _End()
        try:
            with contextlib.closing(self._batches(k, mine)) as batches:
                for batch in batches:
                    if not self._put(k, batch):
                        return
        except BaseException as exc:  # raised in the training loop's thread, at its batch
            end = _End(exc)
        finally:
            _local.info = None
            mine.end_run()
            with self._lock:
                self._done[k] = True
                if self._abandoned:
                    mine.close()
        self._put(k, end)

    def _batches(self, k: int, mine: Any) -> Generator[Any, None, None]:
        """Thread ``k``'s batches: every ``workers``-th of the plan from its ``k``-th."""
        if mine.mode == "stream":
            yield from iter(mine)
            return
        plan = self.plan
        size, positions = plan.batch_size, plan.positions
        for start in range(k * size, len(positions), plan.workers * size):
            yield mine.__getitems__(positions[start : start + size].tolist())

    def _put(self, k: int, item: Any) -> bool:
        """Queue ``item`` for the training loop; False once the run ended."""
        while not self._stop.is_set():
            try:
                self._queues[k].put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        """The items in the plan's order: batches, or an error of the data as a
        :class:`~shardio.runtime.wire.WorkerFailure` (as a worker process sends it); any
        other error of a thread is raised at its batch."""
        k = 0
        while True:
            item = self._queues[k].get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return  # batch j's thread ended first: there is no batch j, nor any after
            yield item
            k = (k + 1) % len(self._queues)

    def close(self) -> None:
        """Stop the threads: each ends at its next batch (a read under way first returns,
        within the read deadline), waited for up to a few seconds."""
        self._stop.set()
        for q in self._queues:
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        deadline = time.monotonic() + _JOIN_S
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            finished = all(self._done)
            self._abandoned = not finished
        self._ended(self, finished)

    def close_finished(self) -> None:
        """Close the copies whose threads ended (the others close theirs as they end)."""
        with self._lock:
            for mine, done in zip(self.copies, self._done, strict=True):
                if done:
                    mine.close()
