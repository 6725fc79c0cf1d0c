"""A ShardDataset's side of a loader's run: the plan taken, the epoch's shards checked and
opened ahead, reads advised or read ahead, and the figures the workers send back.

:class:`ShardRuns` is the part of the :class:`~shardio.runtime.protocol.ReadSource` protocol
that the dataset's map and stream faces (:mod:`shardio.runtime.dataset`) share: what a run
needs, its plan (:class:`~shardio.runtime.plan.RunPlan`) followed in the workers, the advice
of the batches a worker reads next (map mode) and the read-ahead of a stream worker's shards.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shardio._check import require_int
from shardio.errors import ShardioError
from shardio.metrics.read import ReadMetrics
from shardio.order.cursor import EpochCursor
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec
from shardio.read.readahead import StreamReadahead
from shardio.read.reader import ShardReader
from shardio.read.strategy import StrategyChoice
from shardio.read.timeouts import replaceable_readers
from shardio.runtime.decode import Decoder
from shardio.runtime.plan import RunNeeds, RunPlan, RunState
from shardio.runtime.protocol import FAULTS_KEY
from shardio.runtime.recovering import SampleRecovery
from shardio.runtime.reuse import ReusedBuffers
from shardio.runtime.stallwatch import watched_opener
from shardio.runtime.threads import ThreadWorkerInfo, worker_info
from shardio.runtime.transport import max_batch_bytes
from shardio.runtime.wire import EVENTS_KEY, METRICS_KEY

__all__ = ["ShardRuns"]

logger = logging.getLogger(__name__)

# The most a stream read-ahead reads into shards not begun to hold the next whole window.
_WINDOW_AHEAD_MAX = 1 << 30
# Samples of an epoch scanned for the order its shards are first read in (open_ahead).
_OPEN_AHEAD_SCAN = 1 << 18


def _first_use(shards: np.ndarray[Any, Any], num_shards: int) -> np.ndarray[Any, Any]:
    """The distinct shards of ``shards`` in the order of their first appearance."""
    first = np.full(num_shards, len(shards), dtype=np.int64)
    np.minimum.at(first, shards, np.arange(len(shards), dtype=np.int64))
    used = np.flatnonzero(first < len(shards))
    return used[np.argsort(first[used], kind="stable")]


class ShardRuns:
    """A ShardDataset's runs under a loader (its base: the dataset sets these attributes).

    Attributes:
        mode: "map" or "stream".
        path: the dataset directory.
        spec: the order.
        cursor: the epoch and the position in it.
        decode: the decoder asked for, or None (raw bytes).
        transform: the callable applied to each sample, or None.
        transport: how undecoded batches cross from the workers.
        read_choice: the read strategy chosen for the dataset's filesystem.
        read_timeout_s: the read deadline in force (0: none).
        recovering: the recovery policy the reads go through, or None.
    """

    mode: str
    path: str
    spec: OrderSpec
    cursor: EpochCursor
    decode: str | Decoder | None
    transform: Decoder | None
    transport: str
    read_choice: StrategyChoice
    read_timeout_s: float
    recovering: SampleRecovery | None
    # A loader's pass while it drives this dataset (its plan, set before its workers start).
    _run: RunState | None = None
    # Stream mode, in the training process while its forked workers start: (pid, the read-
    # ahead of the run's first window). Not pickled; a forked worker never touches it.
    _warming: tuple[int, StreamReadahead] | None = None
    _ds: ShardReader | None
    _shard_sizes: np.ndarray[Any, Any]
    _received: ReadMetrics
    _closed_metrics: ReadMetrics | None

    if TYPE_CHECKING:

        @property
        def packed(self) -> ShardReader: ...

        @property
        def epoch(self) -> int: ...

        def ranks(self) -> RankInfo: ...

    # -- a loader's run (ReadSource) ----------------------------------------------------------
    def needs(self, positions: Any, *, batch_size: int, workers: int) -> RunNeeds:
        """What a loader's run over ``positions`` needs (see :class:`RunNeeds`): a ring when
        undecoded batches cross from ``workers`` over ``transport="ring"``."""
        ringed = self.transport == "ring" and workers > 0
        ringed = ringed and self.decode is None and self.transform is None
        opener = watched_opener(self)
        return RunNeeds(
            mode=self.mode,
            slot_bytes=max_batch_bytes(self.packed, positions, batch_size) if ringed else None,
            read_timeout_s=self.read_timeout_s,
            # Readers behind the deadline's threads: a kill replaces none (no stall watch).
            watch=opener if replaceable_readers(self.read_choice.fs) else None,
            shards=len(self.packed.manifest.shards),
            where=self.path,
        )

    def begin_run(self, plan: RunPlan) -> None:
        """In the training process, before a loader starts its workers (they get the dataset
        with its plan): with workers, the stamps of the epoch's shards checked once here and,
        when the workers share this process's descriptors, its first shards opened here for
        all of them."""
        self._run = RunState(plan)
        if plan.workers == 0:
            return
        positions = plan.positions
        # One stamp check per shard of the epoch, here, instead of one in every worker:
        # each worker still opens a copy without following a symlink, locks it and checks
        # every member, so a decision gone stale costs a fallback to the source, never a byte.
        # An epoch too large to scan (a lazy stream) checks the shards its rank may read.
        self.packed.decide(positions if isinstance(positions, np.ndarray) else self._shards_read())
        if plan.shares_opens:
            first = self._first_shards(positions)
            self.packed.open_ahead(first)
            if not plan.threads:
                self._warm_first_window(positions, plan.batch_size, first)

    def adopt_opens(self, source: ShardRuns) -> None:
        """A reader thread's copy of ``source`` (the training process's dataset): read
        through duplicates of the shard descriptors ``source`` holds, as forked workers read
        through inherited ones (a shard costs the metadata server one open a process; on a
        FUSE client that drops a file's cached pages at each open, such as MooseFS's, a second
        open would also throw away what the read-ahead fetched)."""
        self.packed.adopt_opens(source.packed)

    def _follow_board(self) -> None:
        """In a persistent worker at a pass's start: follow the loader's board (the copies
        staged since the last epoch are looked for again)."""
        if self._run is not None and self._run.follow(self.cursor):
            self.packed.resolver.recheck_unstaged()

    def enter_thread(self, plan: RunPlan, buffers: ReusedBuffers) -> None:
        """A reader thread's copy of the dataset (:mod:`shardio.runtime.threads`), at its
        run's start: the run's plan, and the thread's reused batch buffers."""
        self._run = RunState(plan)
        self.__dict__["_buffers"] = buffers

    def end_run(self) -> None:
        """After a loader's run (its workers shut down): direct use reads as before."""
        self._run = None
        self._stop_warming()

    def _stop_warming(self) -> None:
        """Stop the training process's read-ahead of a run's first window, if one runs
        (a forked worker leaves its inherited copy alone)."""
        warming, self._warming = self._warming, None
        if warming is not None and warming[0] == os.getpid():
            warming[1].close()

    def absorb(self, sent: dict[str, Any]) -> None:
        """Take a worker's figures and recovery events out of ``sent`` (a batch), and the
        loader's own fault counts (``worker_restarts``, ``stalls``, ``stall_ms``).

        Raises:
            UsageError: the figures are malformed.
        """
        delta = sent.pop(METRICS_KEY, None)
        if delta is not None:
            self._received.absorb(delta)
        events = sent.pop(EVENTS_KEY, None)
        if events is not None:
            self.absorb_events(events)
        for name, value in sent.pop(FAULTS_KEY, {}).items():
            self._received.add(name, require_int(value, name, minimum=0))

    def absorb_events(self, events: list[dict[str, Any]]) -> None:
        """Recovery events a worker sent (kept with a recovery policy; a dataset without one
        sends none)."""
        if self.recovering is not None:
            self.recovering.absorb(events)
        elif events:
            logger.debug("%d recovery events without a recovery policy: dropped", len(events))

    # -- read-ahead advice ------------------------------------------------------------------
    def _first_shards(self, positions: Any) -> list[int]:
        """The shards of the epoch in the order its first samples reach them (a lazy stream:
        the shards this rank may read, by number)."""
        if not isinstance(positions, np.ndarray):
            return [int(s) for s in self.packed.index.shards_of(self._shards_read())]
        head = np.asarray(positions[:_OPEN_AHEAD_SCAN], dtype=np.int64)
        if len(head) == 0:
            return []
        return [
            int(s) for s in _first_use(self.packed.index.shards_of(head), len(self._shard_sizes))
        ]

    def _shards_read(self) -> np.ndarray[Any, Any]:
        """A first sample of every shard this rank may read in the epoch (its node's share
        with a partition, else every shard)."""
        first = np.concatenate([[0], np.cumsum(self._shard_sizes)[:-1]]).astype(np.int64)
        shards = np.flatnonzero(self._shard_sizes > 0)
        if self.spec.partitioned:
            from shardio.order import node_shares

            layout = self.ranks()
            owner = node_shares(
                self._shard_sizes, self.spec, self.epoch, layout.num_nodes, layout.node_keys
            )
            shards = shards[owner[shards] == layout.node]
        return first[shards]

    def _advise_planned(self, indices: Sequence[int]) -> None:
        """Map mode, in a loader's worker, before its first batch ``indices`` (workers start
        afresh each epoch): advise its next ``depth - 1`` batches of the plan too."""
        run, info = self._run, worker_info()
        if run is None or info is None or run.plan.workers == 0:
            return
        if run.advised_in == os.getpid():
            return
        run.advised_in = os.getpid()
        plan = run.plan
        first, size = info.id, plan.batch_size
        if not np.array_equal(plan.positions[first * size : (first + 1) * size], indices):
            return  # not the batch the plan deals this worker first (another sampler)
        ahead = (first + a * plan.workers for a in range(1, plan.depth))
        self._advise_batches(plan.positions, size, ahead)

    def _advise_batches(
        self, positions: np.ndarray[Any, Any], batch_size: int, batches: Iterable[int]
    ) -> None:
        """Advise the reads of batches ``batches`` of ``positions`` (those past the end are
        none)."""
        wanted = [
            positions[b * batch_size : (b + 1) * batch_size]
            for b in batches
            if 0 <= b * batch_size < len(positions)
        ]
        if not wanted:
            return
        # Advice only: a fault found here (a shard that cannot be opened, altered records) is
        # raised, with its own type, by the read of that batch.
        with contextlib.suppress(ShardioError, OSError):
            self.packed.advise(np.concatenate(wanted).tolist(), ahead=True)

    def _readahead_bound(self, least: int) -> int:
        """Bytes a stream read-ahead may read into shards not begun: ``least``, and at least
        a whole window of the shard-local order (up to ``_WINDOW_AHEAD_MAX``). A window's
        first batch needs every shard of the window: with less, the read-ahead stops while
        the window before it is consumed, and each window's start waits for the rest."""
        if self.spec.order != "shard-local" or not len(self._shard_sizes):
            return least
        sizes = sorted((int(s.size_bytes) for s in self.packed.manifest.shards), reverse=True)
        window = sum(sizes[: self.spec.window_shards])
        return max(least, min(window, _WINDOW_AHEAD_MAX))

    def _stream_readahead(
        self,
        positions: np.ndarray[Any, Any],
        batch_size: int,
        worker: int,
        workers: int,
        first: int,
    ) -> StreamReadahead | None:
        """The read strategy's read-ahead of this worker's shards from its batch ``first``
        (an index among all batches) on, started (None: the strategy reads none). The order
        is the epoch's; only how its bytes arrive changes: each shard sequentially, in large
        requests, before its members are read."""
        strategy = self.read_choice.strategy
        if strategy.stream_readahead_bytes <= 0 or not len(positions):
            return None
        n = len(positions)
        step = workers * batch_size
        mine = np.concatenate(
            [positions[c : c + batch_size] for c in range(first * batch_size, n, step)]
            or [np.empty(0, dtype=np.int64)]
        )
        packed = self.packed
        shards = packed.index.shards_of(np.asarray(mine, dtype=np.int64))
        if not len(shards):
            return None
        order = _first_use(shards, len(self._shard_sizes))
        return StreamReadahead(
            packed,
            order.tolist(),
            request_bytes=strategy.request_bytes,
            ahead_bytes=self._readahead_bound(strategy.stream_readahead_bytes),
        ).start()

    def _warm_first_window(
        self, positions: Any, batch_size: int, first_shards: Sequence[int]
    ) -> None:
        """Stream mode, in the training process, before it forks its workers: start the read
        strategy's read-ahead of the run's first window (``first_shards``, the shards in the
        order the run first reaches them, as far as the read-ahead's bound), unless the
        first batch is in the page cache.

        Each worker starts its own read-ahead at its first batch, but only once the workers
        are forked and torch's worker set-up is done: 0.05 to 0.1 s on the MooseFS bed in
        which no byte would be asked for. This one reads then; the workers' read-aheads find
        its pages read, or being read, and go on from there. It reads the first window once
        and ends (:meth:`end_run` stops it sooner). A lazy stream of positions (an epoch too
        large for an array) is not warmed: its first shards are not known in order."""
        strategy = self.read_choice.strategy
        if strategy.stream_readahead_bytes <= 0 or self.mode != "stream":
            return
        if not isinstance(positions, np.ndarray) or not len(positions) or not first_shards:
            return
        packed = self.packed
        bound = self._readahead_bound(strategy.stream_readahead_bytes)
        window: list[int] = []
        total = ahead = 0
        for shard in first_shards:
            if total >= bound:
                break
            size = int(packed.manifest.shards[shard].size_bytes)
            total += size
            if not packed.resolver.locate(int(shard)).staged:  # a local copy: not read ahead
                window.append(int(shard))
                ahead += size
        if not window:
            return
        # Probed where it would be read ahead only (a staged copy is not opened here).
        batch = np.asarray(positions[:batch_size], dtype=np.int64)
        batch = batch[np.isin(packed.index.shards_of(batch), window)]
        if all(packed.first_member_cached(batch[i : i + 1]) for i in range(len(batch))):
            return  # a warm epoch: nothing to read ahead
        readahead = StreamReadahead(
            packed, window, request_bytes=strategy.request_bytes, ahead_bytes=ahead + 1
        )
        self._stop_warming()
        self._warming = (os.getpid(), readahead.start())

    def _stream_batches(
        self,
        positions: np.ndarray[Any, Any],
        batch_size: int,
        worker: int,
        workers: int,
    ) -> Generator[list[int], None, None]:
        """Stream mode: worker ``worker``'s batches of ``positions`` (every ``workers``-th),
        each read ahead (the strategy's read-ahead: its shards sequentially, before the
        window's shuffled member reads) before it is given out.

        The read-ahead starts at the reader's first batch not in the page cache (a one-byte
        probe that cannot wait, of each sample of the first batch, then of each batch's
        first sample): an epoch the page cache holds never starts one (on a local disk, with
        2 workers, one cost about a tenth more CPU and wall time warm for nothing), a cold
        one starts it at its first batch, in every worker."""
        n_chunks = -(-len(positions) // batch_size)
        # Reader threads share one page cache: the first reads ahead every thread's shards,
        # the others read after it, without advice (it would ask for the same pages again).
        # A read-ahead per thread, as each worker process has, was slower on the MooseFS bed
        # (two warm epochs: 0.62-0.83 s against 0.50-0.60 s).
        threads = isinstance(worker_info(), ThreadWorkerInfo) and workers > 1
        quiet = self.read_choice.strategy.stream_readahead_bytes > 0
        waiting = quiet and not (threads and worker)  # may still start a read-ahead
        readahead: StreamReadahead | None = None
        if quiet:
            self.packed.advising = False  # a read-ahead fills the page cache
        probe = self.packed.first_member_cached
        try:
            for k, c in enumerate(range(worker, n_chunks, workers)):
                batch = positions[c * batch_size : (c + 1) * batch_size]
                # The first batch: every sample probed (a sibling worker's read-ahead may have
                # read the first few already); later ones: their first sample.
                if waiting and not all(
                    probe(batch[i : i + 1]) for i in range(len(batch) if k == 0 else 1)
                ):
                    waiting = False
                    readahead = (
                        self._stream_readahead(positions, batch_size, 0, 1, c)
                        if threads
                        else self._stream_readahead(positions, batch_size, worker, workers, c)
                    )
                if readahead is not None:
                    readahead.before_batch(batch)  # its shards are read ahead, not advised
                yield batch.tolist()
        finally:
            if readahead is not None:
                readahead.close()
            if quiet:
                self.packed.advising = True

    # -- metrics ---------------------------------------------------------------------------
    def read_metrics(self) -> ReadMetrics:
        """This rank's read figures: its workers' (sent with their batches) plus this
        process's own reads. A copy."""
        out = self._received.copy()
        if self._ds is not None:
            out.merge(self._ds.metrics)
        elif self._closed_metrics is not None:
            out.merge(self._closed_metrics)
        return out
