"""ShardLoader: the DataLoader shardio recommends, with exact mid-epoch resume.

Batches are built inside the workers and delivered in a deterministic order; with the default
``transport="ring"`` the loader allocates the shared-memory slots the workers read into, once
per iteration (:mod:`shardio.runtime.transport`). The loader counts the samples it has handed
to the training loop, so ``state_dict()`` taken after step k resumes at the first sample not
yet delivered, including those that sat in prefetch queues when the job died.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import weakref
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import torch

from shardio._check import require_int
from shardio.errors import StorageError, UsageError
from shardio.metrics.snapshots import MetricsSnapshot
from shardio.metrics.steps import StepTimer
from shardio.order.quality_report import QualityReport
from shardio.read.timeouts import check_read_timeout
from shardio.runtime.audit import make_observers, observe, with_audit_counts
from shardio.runtime.plan import RunNeeds, RunPlan, run_positions
from shardio.runtime.protocol import FAULTS_KEY, ReadSource
from shardio.runtime.quality import ShuffleQuality
from shardio.runtime.reaping import kill_workers, stop_workers
from shardio.runtime.runs import ShardRuns
from shardio.runtime.sizing import warn_job_size
from shardio.runtime.stallwatch import StallWatch, WorkersStuckError
from shardio.runtime.threads import ReaderThreads, ThreadRun
from shardio.runtime.transport import BatchRing, RingBatch
from shardio.runtime.wire import METRICS_KEY, WorkerFailure, labels_to_tensor
from shardio.runtime.workers import (
    PREFETCH,
    KeptWorkers,
    WorkerKeeper,
    make_dataloader,
    start_batches,
)

__all__ = ["ShardLoader"]

logger = logging.getLogger(__name__)

_Batches = Generator[dict[str, Any], None, None]
_SPARE_SLOTS = 2  # ring slots per worker beyond those: the batch in use, the one arriving
_SLOT_HEADROOM_DIVISOR = 8  # persistent workers' slots: the first run's largest batch + 1/8
# The default watchdog: this many read deadlines without a batch (a batch may meet a few
# stalls of distinct shards, each one deadline), and never under a minute.
_WATCHDOG_DEADLINES = 6
_MIN_WATCHDOG_S = 60.0


def default_watchdog_s(read_timeout_s: float | None) -> float:
    """The default watchdog for workers reading under a read deadline of ``read_timeout_s``
    (None or 0: no deadline, no watchdog)."""
    deadline = float(read_timeout_s or 0.0)
    return max(_MIN_WATCHDOG_S, _WATCHDOG_DEADLINES * deadline) if deadline else 0.0


# The DataLoader arguments reader threads take (threads=True), and the most batches a
# thread reads ahead (in this process's memory: a typo of 10**9 would read the whole epoch).
_THREAD_KWARGS = frozenset({"prefetch_factor", "in_order"})
_MAX_THREAD_DEPTH = 64

# DataLoader worker processes per loader: beyond any node's cores many times over. 99,999
# workers (a typo) would otherwise start forking and allocating until the node gave out.
MAX_WORKERS = 1024


class ShardLoader:
    """Iterate batches of a ShardDataset or a MixedDataset; resumable mid-epoch.

    Args:
        dataset: the ShardDataset (map or stream mode) or MixedDataset: any
            :class:`~shardio.runtime.protocol.ReadSource`.
        batch_size: samples per batch (an int >= 1).
        num_workers: DataLoader worker processes (an int from 0 to 1,024), or reader
            threads with ``threads=True``.
        threads: read with ``num_workers`` threads of this process instead of worker
            processes (:mod:`shardio.runtime.threads`): the same batches in the same order,
            each thread reading through its own copy of the dataset, with nothing forked or
            copied between processes. Reads and checksums release the GIL, so undecoded
            batches come about as fast as from worker processes for much less CPU; a
            per-sample ``decode`` or ``transform`` runs in the threads under the GIL (worker
            processes scale it better). A ShardDataset only; of the DataLoader's arguments
            only ``prefetch_factor`` applies (batches each thread reads ahead); no watchdog
            (a thread cannot be killed): reads stall for at most the dataset's read deadline,
            as with ``num_workers=0``.
        drop_last: drop this rank's last incomplete batch.
        pin_workers: pin each worker to the CPUs of this rank's GPU's NUMA node and set its
            threads (:mod:`shardio.runtime.placement`; a no-op without an NVIDIA GPU);
            False, or ``SHARDIO_PIN_WORKERS=0``, leaves the workers alone.
        worker_timeout_s: the watchdog: when no batch arrives from the workers for this
            long, they are killed (SIGKILL: a worker blocked in a filesystem wait that the
            read deadline does not cover, such as a page fault on a mapped file or a hung
            open, is killable) and new ones resume at the first sample not yet delivered.
            None (default): six read deadlines of the dataset (``read_timeout_s``), at least
            60 s, or off when the dataset has no deadline; 0: off. Workers only.
        max_worker_restarts: replacements in a row that deliver no batch before the loader
            gives up with a StorageError.
        persistent_workers: keep the workers (and the shards they hold open, and the
            shared-memory ring) from one epoch to the next: after an epoch read to its end,
            the next iteration tells them its epoch and position through a small shared
            board instead of starting new workers. An iteration left early (``break``, an
            error, replaced workers) or an epoch with an elastic history starts new ones.
            Workers only; :meth:`close` (or the loader's end) stops them. On by default:
            measured here (4,000 samples, 201 shards, 2 workers), the wait for an epoch's
            first batch fell from 53 ms to 15 ms with forked workers and from 2.5 s to
            13 ms with ``forkserver``, whose new workers re-opened all 402 shard files
            every epoch. False starts new workers every epoch.
        audit: prove each epoch delivered every planned sample exactly once
            (:mod:`shardio.runtime.audit`; about 20 ns a sample) and report the shuffle
            quality it delivered (:mod:`shardio.runtime.quality`; one log line an epoch,
            :attr:`shuffle_quality`): True (default), False (neither), or a directory where
            each rank also writes its audit record (``shardio audit DIR`` combines them when
            ``torch.distributed`` is not initialised).
        **kwargs: passed to ``torch.utils.data.DataLoader`` (pin_memory, prefetch_factor,
            multiprocessing_context, ...).
    """

    def __init__(
        self,
        dataset: ReadSource,
        *,
        batch_size: int,
        num_workers: int = 0,
        drop_last: bool = False,
        pin_workers: bool = True,
        worker_timeout_s: float | None = None,
        max_worker_restarts: int = 2,
        persistent_workers: bool = True,
        audit: bool | str | os.PathLike[str] = True,
        threads: bool = False,
        **kwargs: Any,
    ) -> None:
        batch_size = require_int(batch_size, "batch_size", minimum=1)
        self.worker_timeout_s = check_read_timeout(worker_timeout_s, "worker_timeout_s")
        self.max_worker_restarts = require_int(
            max_worker_restarts, "max_worker_restarts", minimum=0
        )
        num_workers = require_int(num_workers, "num_workers", minimum=0, maximum=MAX_WORKERS)
        if not isinstance(persistent_workers, bool):
            raise UsageError(
                f"persistent_workers must be True or False, got {persistent_workers!r}"
            )
        if kwargs.get("in_order") is False:
            raise UsageError("ShardLoader needs in_order=True: resume relies on the order")
        for key in ("sampler", "batch_sampler", "shuffle", "collate_fn", "batch_size"):
            if key in kwargs:
                raise UsageError(f"ShardLoader sets {key} itself; pass it to ShardDataset")
        if not isinstance(threads, bool):
            raise UsageError(f"threads must be True or False, got {threads!r}")
        threads = threads and num_workers > 0
        if threads and not isinstance(dataset, ShardRuns):
            raise UsageError(
                "threads=True reads a ShardDataset; a MixedDataset reads in worker processes"
            )
        if threads and worker_timeout_s is not None:
            raise UsageError(
                "threads=True has no watchdog (a thread cannot be killed): worker_timeout_s is "
                "for worker processes; bound each read with ShardDataset(read_timeout_s=...)"
            )
        if threads and (extra := sorted(set(kwargs) - _THREAD_KWARGS)):
            raise UsageError(
                f"threads=True takes no DataLoader argument but prefetch_factor: got "
                f"{', '.join(extra)} (worker processes take them: threads=False)"
            )
        self.threads = threads
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.pin_workers = pin_workers
        self.kwargs = kwargs
        self.persistent_workers = persistent_workers and num_workers > 0 and not threads
        # Persistent workers between iterations, stopped by close() or when this loader is
        # collected (a loader made per epoch, ``for b in ds.loader(...)``, leaves none behind).
        self._keeper = WorkerKeeper()
        weakref.finalize(self, self._keeper.drop)
        self._ring_counts: torch.Tensor | None = None  # the last ring's, shared with workers
        self._transport_done = {"ring": 0, "fallback": 0}  # of the iterations before it
        self._live: weakref.ref[_Batches] | None = None  # the last iteration
        self._readers: ReaderThreads | None = None  # threads=True: kept from run to run
        if threads:
            depth = kwargs.get("prefetch_factor", PREFETCH)
            # Bounded: each thread holds that many batches in this process's memory.
            depth = (
                2
                if depth is None
                else require_int(depth, "prefetch_factor", minimum=0, maximum=_MAX_THREAD_DEPTH)
            )
            self._readers = ReaderThreads(num_workers, depth=max(2, depth))
            weakref.finalize(self, self._readers.close)
        self._needs: RunNeeds | None = None  # the current (or last) run's
        self._sized = False  # the job's sizing checked (once per loader: runtime/sizing.py)
        self.steps = StepTimer()
        # Internal: each gets every delivered batch's samples and the epochs' ends
        # (shardio.runtime.audit.observe); the exactly-once audit is the first.
        self._observers: list[Any] = make_observers(self, audit)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (a new one reshuffles and starts at its beginning)."""
        self.dataset.cursor.set_epoch(epoch)

    @property
    def pin_memory(self) -> bool:
        """Whether the DataLoader pins each batch (``pin_memory=True`` was passed)."""
        return bool(self.kwargs.get("pin_memory", False))

    def __len__(self) -> int:
        n = self.dataset.cursor.samples_per_rank()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _make_ring(self, needs: RunNeeds) -> BatchRing | None:
        """The ring of one iteration, when its batches take one."""
        if needs.slot_bytes is None or self.num_workers == 0 or self.threads:
            return None
        prefetch = self.kwargs.get("prefetch_factor", PREFETCH)
        prefetch = 2 if prefetch is None else require_int(prefetch, "prefetch_factor", minimum=0)
        slot_bytes = needs.slot_bytes
        if self.persistent_workers:
            # Kept for the later epochs too, whose largest batch differs from this one's: a
            # batch over the slot takes a fresh segment, faulted in page by page.
            slot_bytes += slot_bytes // _SLOT_HEADROOM_DIVISOR
        return BatchRing.allocate(
            workers=self.num_workers,
            slots=prefetch + _SPARE_SLOTS,
            slot_bytes=slot_bytes,
            quiet=self._sized,  # warned at the first iteration's: once per loader
        )

    @property
    def transport_stats(self) -> dict[str, int]:
        """Batches of the current (or last) iteration by how they crossed from the workers.

        ``ring``: through a reused slot; ``fallback``: through a fresh shared segment,
        because every slot of the worker was still viewed (batches kept by the caller) or
        the batch did not fit. Counted when the worker sends a batch (prefetched ones too).
        """
        if self._ring_counts is None:
            return {"ring": 0, "fallback": 0}
        ring, fallback = self._ring_counts.sum(dim=0).tolist()
        return {"ring": int(ring), "fallback": int(fallback)}

    @property
    def shuffle_quality(self) -> QualityReport | None:
        """The shuffle quality of the last epoch this rank finished (None before one, for a
        mix, or with ``audit=False``)."""
        found = [o for o in self._observers if isinstance(o, ShuffleQuality)]
        return found[0].last if found else None

    def metrics(self) -> MetricsSnapshot:
        """This rank's data path so far, over every iteration of this loader.

        Read figures (latency by source, bytes, opens, cache hits, checksum failures,
        retries, repairs) are those of every worker, sent with the batches, plus this
        process's own reads; step time, wait and stall fraction are measured where the
        training loop takes each batch. A batch's reads count once the batch is delivered.
        """
        current = self.transport_stats
        transport = {k: v + current[k] for k, v in self._transport_done.items()}
        snap = self.dataset.snapshot(self.steps, transport=transport)
        return with_audit_counts(snap, self._observers)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = self._iterate()
        self._live = weakref.ref(batches)  # weak: an abandoned iteration is still collected
        return batches

    def close(self) -> None:
        """End the current iteration, if one is live, and shut down its workers (idempotent).

        The iteration's next ``next()`` raises StopIteration; a new ``iter()`` continues where
        it stopped, as after any abandoned iteration.

        Raises:
            UsageError: another thread is inside the iteration's ``next()`` right now.
        """
        live = self._live() if self._live is not None else None
        self._live = None
        if live is not None:
            try:
                live.close()  # runs its finally: the workers are shut down there
            except ValueError as exc:
                raise UsageError(f"ShardLoader.close() while another thread reads: {exc}") from exc
        self._drop_kept()
        if self._readers is not None:
            self._readers.close()  # the reader threads' copies of the dataset

    def _drop_kept(self) -> None:
        """Stop the persistent workers, if any are kept."""
        self._keeper.drop()

    def _watchdog_s(self, needs: RunNeeds) -> float:
        """Seconds without a batch after which the workers are deemed stuck (0: never)."""
        if self.num_workers == 0 or self.threads:
            return 0.0
        if self.worker_timeout_s is not None:
            return self.worker_timeout_s
        given = self.kwargs.get("timeout")
        if given:
            return float(given)
        return default_watchdog_s(needs.read_timeout_s)

    def _iterate(self) -> _Batches:
        """Iterate, replacing workers that stopped answering (see ``worker_timeout_s``)."""
        fruitless = stalled = 0
        while True:
            try:
                yield from self._iterate_once()
                return
            except WorkersStuckError as stuck:
                # Whatever they had prefetched is lost, not delivered: the next run starts at
                # the first sample not yet handed to the training loop, as a resume would.
                self._count_faults(worker_restarts=self.num_workers)
                if stuck.stalls:
                    # Each stall held its shard: the new workers fail its reads at once, so
                    # restarts for stalls end (one per shard at most), unless the holds do
                    # not reach them (no usable /dev/shm): bounded by the shards then.
                    stalled = stalled + 1 if not stuck.progressed else 1
                    self._count_faults(
                        stalls=stuck.stalls, stall_ms=int(stuck.stalls * stuck.waited_s * 1000)
                    )
                    if stalled > self._stall_restart_limit():
                        raise StorageError(
                            errno.ETIMEDOUT,
                            f"reads of {self._where()} stalled for {stuck.waited_s:g} s "
                            f"{stalled} times in a row with no batch delivered between: is "
                            "a storage server down?",
                        ) from None
                    logger.warning(
                        "a read stalled for %g s: DataLoader workers replaced, resuming after "
                        "%d samples",
                        stuck.waited_s,
                        self.dataset.cursor.consumed,
                    )
                    continue
                fruitless = 0 if stuck.progressed else fruitless + 1
                if fruitless > self.max_worker_restarts:
                    raise StorageError(
                        errno.ETIMEDOUT,
                        f"no batch arrived for {stuck.waited_s:g} s, {fruitless} times in a row "
                        f"after replacing the DataLoader workers: reads of {self._where()} "
                        "do not complete (is a storage server down?)",
                    ) from None
                logger.warning(
                    "no batch for %g s: DataLoader workers replaced, resuming after %d samples",
                    stuck.waited_s,
                    self.dataset.cursor.consumed,
                )

    def _check_size(self, where: Any) -> None:
        """At the first start of workers: warn about a mis-sized job, once."""
        self._sized = True
        warn_job_size(num_workers=self.num_workers, where=where)

    def _count_faults(self, **counts: int) -> None:
        """Add what this loader saw to the rank's read figures."""
        self.dataset.absorb({FAULTS_KEY: counts})

    def _where(self) -> str:
        """What the last run read, for messages."""
        return self._needs.where if self._needs is not None else "the dataset"

    def _stall_restart_limit(self) -> int:
        """Restarts for stalls in a row, with no batch between, before the loader gives up:
        one per shard and then some (each stall holds a shard)."""
        shards = self._needs.shards if self._needs is not None else 0
        return shards + self.max_worker_restarts + 1

    def _stall_watch(self, needs: RunNeeds) -> StallWatch | None:
        """The watch over this iteration's workers' reads, when they read under a deadline
        through readers that a kill can replace."""
        if self.num_workers == 0 or self.threads or needs.watch is None:
            return None
        return StallWatch(workers=self.num_workers, timeout_s=needs.watch.timeout_s)

    def _iterate_once(self) -> _Batches:
        cursor = self.dataset.cursor
        cursor.begin()  # an epoch read to its end is read again, as a DataLoader does
        world = cursor.ranks().world_size
        # From the first sample not yet handed to the training loop (the cursor moves as each
        # batch is: a run after replaced workers starts where the last one stopped).
        positions = run_positions(cursor.stream(), self.batch_size, self.drop_last)
        kept = self._keeper.kept if self._keeper.kept is not None and not cursor.history else None
        if kept is not None and not kept.resume():
            logger.warning("a persistent DataLoader worker died between epochs: starting new ones")
            kept = None
        if kept is None:
            self._drop_kept()  # an elastic history, or a dead worker: new workers
        if self._ring_counts is not None and (kept is None or kept.ring is None):
            last = self.transport_stats
            self._transport_done = {k: v + last[k] for k, v in self._transport_done.items()}
            self._ring_counts = None
        clock = time.perf_counter_ns
        processes = self.num_workers if kept is None and not self.threads else 0
        needs = self._needs = self.dataset.needs(
            positions, batch_size=self.batch_size, workers=processes
        )
        watchdog = self._watchdog_s(needs)
        progressed = finished = False
        batches: Any = None
        readers: ThreadRun | None = None
        delivered = 0  # samples of this run handed to training
        if kept is not None:
            # The persistent workers learn this run from the board when it starts.
            ring, watch = kept.ring, kept.watch
            kept.board[1], kept.board[2] = cursor.epoch, cursor.consumed
            kept.board[0] += 1
            if kept.sampler is not None:
                kept.sampler.positions = positions
        else:
            # Allocated before the DataLoader starts its workers: they get it with the dataset.
            ring = self._make_ring(needs)
            self._ring_counts = ring.counts if ring is not None else None
            watch = self._stall_watch(needs)
        try:
            self.steps.start()
            if kept is not None:
                batches = start_batches(kept.loader, forks=False)
            elif self.threads:
                readers = self._start_threads(positions)
                batches = iter(readers)
            else:
                board = torch.zeros(3, dtype=torch.int64) if self.persistent_workers else None
                if board is not None:
                    board.share_memory_()  # type: ignore[no-untyped-call]
                loader, sampler = make_dataloader(
                    self.dataset,
                    positions,
                    needs.mode,
                    batch_size=self.batch_size,
                    num_workers=self.num_workers,
                    drop_last=self.drop_last,
                    pin_workers=self.pin_workers,
                    kwargs=self.kwargs,
                    ring=ring,
                    timeout=watchdog,
                    watch=watch,
                    board=board,
                    on_start=None if self._sized else self._check_size,
                )
                batches = start_batches(loader, forks=self.num_workers > 0)
                if board is not None:
                    kept = KeptWorkers(loader, batches, sampler, ring, watch, board)
            if watch is not None:
                watch.start(batches, kill_workers)
            while True:
                asked = clock()
                try:
                    item = next(batches)
                except StopIteration:
                    finished = True
                    cursor.finish()
                    for observer in self._observers:
                        observer.end_epoch(cursor.epoch)
                    break
                except Exception as exc:
                    # Whatever a killed worker's iterator raises once the watch fired is the
                    # kill's doing, not an error of the data.
                    if watch is not None and watch.fired.is_set():
                        raise watch.stuck(progressed) from None
                    if not isinstance(exc, RuntimeError):
                        raise
                    if not watchdog or "timed out" not in str(exc):
                        raise
                    kill_workers(batches)
                    raise WorkersStuckError(watchdog, progressed) from exc
                if watch is not None and watch.fired.is_set():
                    raise watch.stuck(progressed)  # a batch that arrived as they were killed
                try:
                    batch = self._arrived(item, ring)
                except Exception:
                    if watch is not None and watch.fired.is_set():
                        raise watch.stuck(progressed) from None  # the wake-up item
                    raise
                progressed = True
                n = len(batch["__key__"])
                if self._observers:
                    batch_values = positions[delivered : delivered + n]
                    observe(self._observers, self.dataset, cursor.epoch, batch_values)
                delivered += n
                cursor.advance(n * world)
                batch = labels_to_tensor(batch)
                now = clock()
                self.steps.batch(wait_ns=now - asked, samples=len(batch["__key__"]), now_ns=now)
                yield batch
        finally:
            if watch is not None:
                watch.stop()
            if finished and kept is not None:
                kept.park()
                self._keeper.kept = kept  # kept for the next epoch, workers idle
            else:
                # Now, not when the garbage collector finds the iterator (a traceback may
                # hold it). A run left early ends its persistent workers too: batches they
                # had in flight would still arrive.
                self._keeper.kept = None
                if kept is not None:
                    kept.shutdown()
                elif readers is not None:
                    batches.close()
                    readers.close()
                elif batches is not None:
                    stop_workers(batches)
            self.dataset.end_run()

    def _start_threads(self, positions: Any) -> ThreadRun:
        """This run's reader threads (``threads=True``), the dataset's run begun first."""
        readers = self._readers
        if readers is None:
            raise UsageError("ShardLoader: a run in threads of a loader made without them")
        plan = RunPlan(
            positions=positions,
            batch_size=self.batch_size,
            workers=self.num_workers,
            depth=readers.depth,
            shares_opens=True,
            drop_last=self.drop_last,
            threads=True,
        )
        self.dataset.begin_run(plan)
        return readers.run(self.dataset, plan)

    def _arrived(self, item: Any, ring: BatchRing | None) -> dict[str, Any]:
        """The batch a worker's ``item`` stands for, its figures and events taken out."""
        if isinstance(item, WorkerFailure) and item.metrics is not None:
            self.dataset.absorb({METRICS_KEY: item.metrics})
        batch = _arrived(item, ring)
        self.dataset.absorb(batch)
        return batch  # type: ignore[no-any-return]

    @property
    def dataset_id(self) -> str | None:
        """The id of the dataset (or mix) this loader reads: what a checkpoint of its
        position records, so that it resumes no other dataset."""
        return self.dataset.dataset_id

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands: global positions delivered to the training loop."""
        return self.dataset.cursor.state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`, also with another number of ranks."""
        self.dataset.cursor.load(state)


def _arrived(item: Any, ring: BatchRing | None) -> Any:
    """The batch a worker's ``item`` stands for: a failure re-raised, a ring slot's checked."""
    if isinstance(item, WorkerFailure):
        raise item.error
    if isinstance(item, RingBatch):
        if ring is None:
            raise StorageError(errno.EPROTO, "ring transport: a ring batch without a ring")
        return ring.receive(item)
    return item
