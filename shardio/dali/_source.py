"""The verified source: batches of checked member bytes and labels for DALI's external_source.

Torch-free and DALI-free. The order is ShardDataset's for the same order spec, epoch and
ranks: an :class:`~shardio.order.cursor.EpochCursor` holds the epoch and the position in it,
so a pass starts where the last delivered batch left off (mid-epoch resume). Every member
passes shardio's xxh3-64 check (:meth:`ShardReader.read_member_into`) before DALI sees it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from shardio._check import require_int
from shardio.errors import FormatError, ShardioError, UsageError
from shardio.order.cursor import EpochCursor
from shardio.order.ranks import RankInfo
from shardio.order.spec import OrderSpec
from shardio.read.deadline import into_fresh_buffers
from shardio.read.setup import set_up_reader

__all__ = ["Batch", "VerifiedSource"]

logger = logging.getLogger(__name__)


# (payload per sample as uint8 arrays, label per sample as 0-d int64 arrays)
Batch = tuple[list[np.ndarray[Any, Any]], list[np.ndarray[Any, Any]]]


class VerifiedSource:
    """A batch-mode ``external_source`` callable: ``source(batch_info)`` -> (data, labels).

    DALI calls it with ``BatchInfo(iteration, epoch_idx)``; iteration 0 starts a pass over
    the rank's samples of the cursor's epoch not yet delivered (the cursor is advanced by
    whoever hands the batches to training: :class:`~shardio.dali.DALILoader`), and the pass
    ends with ``StopIteration``. While DALI
    works on one batch, one thread (``shardio-dali-read``, started on the first call) reads
    and checks the next; every read of the dataset happens in that thread.

    Args:
        path: the dataset directory (or a staging area).
        batch_size: samples per batch (the last batch of a pass may be smaller).
        spec: the order (as ShardDataset's, partitions included).
        ranks: this process's rank and the world size.
        verify: check each member's xxh3-64 (False only for HDF5's unverified mode).
        stage: a staging area to read verified copies from.
        exts: extensions of the payload member, first match wins per sample.
        read_timeout_s: seconds a read may stall before it is abandoned and raises
            :class:`~shardio.errors.ReadStalledError` (None: 120 s on a network filesystem,
            none on a local one; 0: none); see :mod:`shardio.read.timeouts`.
        ahead: batches read ahead of DALI's request, one after the other in the read
            thread; while reads wait on storage, each batch's read first advises its own
            members and the next batch's (``POSIX_FADV_WILLNEED``), so the kernel or the
            filesystem client reads them in parallel while the thread reads in order (the
            advice is left out while batches come from the page cache). Measured on the
            MooseFS bed (4,000 samples, 7 shards of 8 MiB), the source alone per epoch: cold
            0.59 s against 0.82-1.05 s with one batch ahead and no advice, warm 0.21 s
            against 0.25 s; the map mode's coalesced requests on I/O threads did worse here
            (0.70 s cold, 0.50 s warm).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        batch_size: int,
        spec: OrderSpec,
        ranks: RankInfo,
        verify: bool,
        stage: str | os.PathLike[str] | None,
        exts: Sequence[str],
        read_timeout_s: float | None = None,
        ahead: int = 2,
    ) -> None:
        self.ahead = require_int(ahead, "ahead", minimum=1, maximum=64)
        # The same deadline as ShardDataset's (one statfs): a stalled read raises
        # ReadStalledError naming the shard instead of freezing the pipeline.
        reader = set_up_reader(path, read_timeout_s=read_timeout_s)
        self.read_choice = reader.choice
        self.read_timeout_s = reader.read_timeout_s
        self.packed = reader.open(stage=stage)
        self.batch_size = batch_size
        self.ranks = ranks
        self.verify = verify
        table = self.packed.index.exts
        # ext id -> priority (lower wins) of the extensions asked for.
        self._wanted = {table.index(e): i for i, e in enumerate(exts) if e in table}
        if not self._wanted:
            self.packed.close()
            raise UsageError(
                f"{os.fspath(path)}: no member has extension {' or '.join(exts)} "
                f"(the dataset's extensions: {', '.join(table) or 'none'})"
            )
        self._exts = tuple(exts)
        self._sizes = np.array([s.num_samples for s in self.packed.manifest.shards], np.int64)
        self.cursor = EpochCursor(spec, self._sizes, ranks=ranks)
        self._positions: np.ndarray[Any, Any] | None = None
        self._ahead: dict[int, Future[Batch]] = {}  # iteration -> its batch, being read
        self._pool: ThreadPoolExecutor | None = None

    @property
    def num_samples(self) -> int:
        """Samples in the dataset."""
        return len(self.packed)

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads (the cursor's)."""
        return self.cursor.epoch

    def rank_indices(self, epoch: int | None = None) -> np.ndarray[Any, Any]:
        """Sample indices this rank reads in a whole epoch (the current one by default)."""
        if epoch is None or epoch == self.cursor.epoch:
            return self.cursor.stream(consumed=0).materialise()
        other = self.cursor.copy()
        other.set_epoch(epoch)
        return other.stream(consumed=0).materialise()

    def samples_per_rank(self) -> int:
        """Samples each rank reads in a whole epoch (equal on every rank)."""
        return self.cursor.samples_per_rank()

    def __call__(self, info: Any) -> Batch:
        """The batch ``info.iteration`` of the current pass.

        Raises:
            StopIteration: the pass is over (DALI ends its epoch).
            ChecksumMismatchError: a member's bytes differ from the index.
            StorageError: a shard is missing or unreadable.
        """
        iteration = int(info.iteration)
        if iteration == 0 or self._positions is None:
            # A new pass: the epoch and position are read now, so set_epoch() or a loaded
            # state before it takes effect. It reads what was not delivered yet.
            self._cancel_ahead()
            self._positions = self.cursor.stream().materialise()
        chunk = self._chunk(iteration)
        if chunk is None:
            self._cancel_ahead()
            raise StopIteration
        future = self._ahead.pop(iteration, None)
        if future is None:
            self._cancel_ahead()  # another position than the one read ahead
            future = self._submit(iteration)
        for k in range(iteration + 1, iteration + 1 + self.ahead):
            if k not in self._ahead and self._chunk(k) is not None:
                self._ahead[k] = self._submit(k)
        return future.result()  # re-raises a read error with its own type

    def _chunk(self, iteration: int) -> list[int] | None:
        assert self._positions is not None
        start = iteration * self.batch_size
        if start >= len(self._positions):
            return None
        return [int(i) for i in self._positions[start : start + self.batch_size]]

    def _submit(self, iteration: int) -> Future[Batch]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardio-dali-read")
        samples = self._chunk(iteration)
        assert samples is not None
        following = self._chunk(iteration + 1) or []
        return self._pool.submit(self._read, samples, following)

    def _cancel_ahead(self) -> None:
        """Forget the batches read ahead (another pass or position); wait for them."""
        ahead, self._ahead = self._ahead, {}
        for future in ahead.values():
            if not future.cancel():
                future.exception()  # its error, if any, belongs to a batch nobody asked for

    def _read(self, samples: list[int], following: list[int]) -> Batch:
        packed = self.packed
        index = packed.index
        # Advice for this batch and the next: the kernel (or the filesystem's client) reads
        # them while this thread waits on the first members (none while reads come from the
        # page cache: ShardReader.reads_cached).
        with contextlib.suppress(ShardioError, OSError):
            packed.advise(samples + following)
        records = index.records(samples)  # checks the shards' index records first
        rows = [self._payload_member(sample) for sample in samples]
        sizes = index.members["size"][rows].astype(np.int64).tolist()
        shards = records["shard"].astype(np.int64).tolist()

        def read() -> list[bytearray]:  # fresh buffers each time (into_fresh_buffers)
            buffers = [bytearray(size) for size in sizes]
            packed.read_members_into(
                rows, shards, samples, [memoryview(buf) for buf in buffers], verify=self.verify
            )
            return buffers

        data = [np.frombuffer(buf, dtype=np.uint8) for buf in into_fresh_buffers(read)]
        # The label lives in the checked index (the synthesised cls member holds the same).
        labels = [np.array(int(label), dtype=np.int64) for label in records["label"]]
        packed.metrics.add("samples", len(samples))
        return data, labels

    def _payload_member(self, sample: int) -> int:
        index = self.packed.index
        best: tuple[int, int] | None = None
        for member in index.sample_member_range(sample):
            rank = self._wanted.get(int(index.members[member]["ext_id"]))
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, member)
        if best is None:
            raise FormatError(
                f"sample {index.key(sample)!r} has no member with extension "
                f"{' or '.join(self._exts)}"
            )
        return best[1]

    def close(self) -> None:
        """Stop the read-ahead thread and close the dataset's files."""
        self._cancel_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.packed.close()
