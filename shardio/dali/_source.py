"""The verified source: batches of checked member bytes and labels for DALI's external_source.

Torch-free and DALI-free. The order is ShardDataset's (map mode) for the same seed, epoch and
ranks (:func:`shardio.order.rank_stream`). Every member passes shardio's xxh3-64 check
(:meth:`PackedDataset.read_member_into`) before DALI sees it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from shardio.errors import FormatError, UsageError
from shardio.order import OrderSpec, rank_stream
from shardio.order.ranks import RankInfo
from shardio.read.deadline import resolve_read_timeout, with_deadline
from shardio.read.packed import PackedDataset

__all__ = ["Batch", "VerifiedSource"]

logger = logging.getLogger(__name__)

# (payload per sample as uint8 arrays, label per sample as 0-d int64 arrays)
Batch = tuple[list[np.ndarray[Any, Any]], list[np.ndarray[Any, Any]]]


class VerifiedSource:
    """A batch-mode ``external_source`` callable: ``source(batch_info)`` -> (data, labels).

    DALI calls it with ``BatchInfo(iteration, epoch_idx)``; iteration 0 starts a pass over
    the rank's samples of :attr:`epoch`, and the pass ends with ``StopIteration``. While DALI
    works on one batch, one thread (``shardio-dali-read``, started on the first call) reads
    and checks the next; every read of the dataset happens in that thread.

    Args:
        path: the dataset directory (or a staging area).
        batch_size: samples per batch (the last batch of a pass may be smaller).
        ranks: this process's rank and the world size.
        seed: the order seed (as ShardDataset's).
        order: "random", "shard-local" or "sequential".
        window_shards: shards per window in shard-local order.
        drop_last: cut each rank's epoch to ``num_samples // world_size`` instead of padding.
        verify: check each member's xxh3-64 (False only for HDF5's unverified mode).
        cache: a staging area to read verified copies from.
        exts: extensions of the payload member, first match wins per sample.
        read_timeout_s: seconds a read may stall before it is abandoned and raises
            :class:`~shardio.errors.ReadStalledError` (None: 120 s on a network filesystem,
            none on a local one; 0: none); see :mod:`shardio.read.deadline`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        batch_size: int,
        ranks: RankInfo,
        seed: int,
        order: str,
        window_shards: int,
        drop_last: bool,
        verify: bool,
        cache: str | os.PathLike[str] | None,
        exts: Sequence[str],
        read_timeout_s: float | None = None,
    ) -> None:
        # The same deadline as ShardDataset's: a stalled read raises ReadStalledError naming
        # the shard instead of freezing the pipeline.
        self.read_timeout_s = resolve_read_timeout(path, read_timeout_s)
        opener = with_deadline(None, self.read_timeout_s, scope=path)
        self.packed = PackedDataset(path, cache=cache, opener=opener)
        self.batch_size = batch_size
        self.ranks = ranks
        self.seed = seed
        self.order = order
        self.window_shards = window_shards
        self.drop_last = drop_last
        self.verify = verify
        self.epoch = 0
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
        self._positions: np.ndarray[Any, Any] | None = None
        self._ahead: tuple[int, Future[Batch]] | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def num_samples(self) -> int:
        """Samples in the dataset."""
        return len(self.packed)

    def rank_indices(self, epoch: int | None = None) -> np.ndarray[Any, Any]:
        """Sample indices this rank reads in a whole epoch (the current one by default)."""
        spec = OrderSpec(
            order=self.order,
            seed=self.seed,
            window_shards=self.window_shards,
            drop_last=self.drop_last,
        )
        layout = self.ranks
        return rank_stream(
            self._sizes, spec, self.epoch if epoch is None else epoch, layout
        ).materialise()

    def samples_per_rank(self) -> int:
        """Samples each rank reads in a whole epoch (equal on every rank)."""
        world = self.ranks.world_size
        n = self.num_samples
        return n // world if self.drop_last else -(-n // world)

    def __call__(self, info: Any) -> Batch:
        """The batch ``info.iteration`` of the current pass.

        Raises:
            StopIteration: the pass is over (DALI ends its epoch).
            ChecksumMismatchError: a member's bytes differ from the index.
            StorageError: a shard is missing or unreadable.
        """
        iteration = int(info.iteration)
        if iteration == 0 or self._positions is None:
            # A new pass: the epoch is read now, so set_epoch() before it takes effect.
            self._cancel_ahead()
            self._positions = self.rank_indices()
        chunk = self._chunk(iteration)
        if chunk is None:
            self._cancel_ahead()
            raise StopIteration
        if self._ahead is not None and self._ahead[0] == iteration:
            future = self._ahead[1]
        else:
            self._cancel_ahead()
            future = self._submit(chunk)
        self._ahead = None
        following = self._chunk(iteration + 1)
        if following is not None:
            self._ahead = (iteration + 1, self._submit(following))
        return future.result()  # re-raises a read error with its own type

    def _chunk(self, iteration: int) -> list[int] | None:
        assert self._positions is not None
        start = iteration * self.batch_size
        if start >= len(self._positions):
            return None
        return [int(i) for i in self._positions[start : start + self.batch_size]]

    def _submit(self, samples: list[int]) -> Future[Batch]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardio-dali-read")
        return self._pool.submit(self._read, samples)

    def _cancel_ahead(self) -> None:
        """Forget the batch read ahead (another pass or position); wait for it to finish."""
        if self._ahead is not None:
            _, future = self._ahead
            self._ahead = None
            if not future.cancel():
                future.exception()  # its error, if any, belongs to a batch nobody asked for

    def _read(self, samples: list[int]) -> Batch:
        packed = self.packed
        index = packed.index
        records = index.records(samples)  # checks the shards' index records first
        data: list[np.ndarray[Any, Any]] = []
        labels: list[np.ndarray[Any, Any]] = []
        for sample, rec in zip(samples, records, strict=True):
            member = self._payload_member(sample)
            buf = bytearray(int(index.members[member]["size"]))
            packed.read_member_into(
                member, memoryview(buf), shard=int(rec["shard"]), sample=sample, verify=self.verify
            )
            data.append(np.frombuffer(buf, dtype=np.uint8))
            # The label lives in the checked index (the synthesised cls member holds the same).
            labels.append(np.array(int(rec["label"]), dtype=np.int64))
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
