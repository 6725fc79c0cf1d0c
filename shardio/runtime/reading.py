"""How a ShardDataset reads: sample indices checked, samples decoded, batches read through the
recovery policy in the transport's form.

:class:`SampleReads` is the read path the dataset's map and stream faces
(:mod:`shardio.runtime.dataset`) both use: one sample decoded and transformed
(``ds[i]``), or a batch of samples undecoded in the form its transport sends (a ring slot, a
shared-memory segment, a mapping of the shard), each read through the recovery policy when
the dataset has one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from shardio._check import require_int
from shardio.format.spec import LABEL_EXT
from shardio.metrics.read import ReadDelta
from shardio.read.deadline import into_fresh_buffers
from shardio.read.reader import ShardReader
from shardio.read.strategy import ReadStrategy, StrategyChoice
from shardio.runtime.batch import read_batch, read_batch_mapped
from shardio.runtime.decode import Decoder, decode_sample
from shardio.runtime.plan import RunState
from shardio.runtime.recovering import Recoverable, SampleRecovery
from shardio.runtime.reuse import ReusedBuffers
from shardio.runtime.single import read_one
from shardio.runtime.threads import in_process, worker_info
from shardio.runtime.wire import EVENTS_KEY, METRICS_KEY, labels_to_tensor

__all__ = ["MIN_WORKER_INFLIGHT", "SampleReads", "collate_samples"]

MIN_WORKER_INFLIGHT = 4  # map mode, pfs: requests in flight per DataLoader worker, at least


def collate_samples(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Collate decoded samples: lists per field, ``cls`` as a tensor, equal-shape tensors
    stacked."""
    batch: dict[str, Any] = {}
    for field in samples[0]:
        values = [s.get(field) for s in samples]
        if field == LABEL_EXT:
            batch[field] = torch.tensor(values, dtype=torch.int64)
        elif all(isinstance(v, torch.Tensor) for v in values):
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            same = len({tuple(t.shape) for t in tensors}) == 1
            batch[field] = torch.stack(tensors) if same else tensors
        else:
            batch[field] = values
    return batch


class SampleReads:
    """The read path of a ShardDataset (its base: the dataset sets these attributes).

    Attributes:
        mode: "map" or "stream".
        path: the dataset directory.
        num_samples: samples in the dataset.
        verify: check every member's xxh3-64 on read.
        transport: how undecoded batches cross from the workers ("ring", "shm", "mmap").
        transform: the callable applied to each (decoded) sample, or None.
        timed: whether read latencies are timed and sent with the batches.
        read_choice: the read strategy chosen for the dataset's filesystem.
        recovering: the recovery policy the reads go through, or None.
    """

    mode: str
    path: str
    num_samples: int
    verify: bool
    transport: str
    transform: Decoder | None
    timed: bool
    read_choice: StrategyChoice
    recovering: SampleRecovery | None
    _decoder: Decoder | None
    _ds: ShardReader | None
    _run: RunState | None

    if TYPE_CHECKING:

        @property
        def packed(self) -> ShardReader: ...

    def _batch_strategy(self) -> ReadStrategy | None:
        """The strategy ``read_batch`` reads with: map mode's (stream mode reads its shards
        ahead instead, and each member with one pread from the page cache).

        In a DataLoader worker of several, each takes a share of the requests in flight
        (measured on the MooseFS bed: 16 in one process, 4 per worker with 2 workers; more
        threads per worker cost more CPU than they gained)."""
        if self.mode != "map":
            return None
        strategy = self.read_choice.strategy
        info = worker_info()
        if info is None or info.num_workers < 2 or strategy.inflight <= 1:
            return strategy
        share = max(MIN_WORKER_INFLIGHT, strategy.inflight // (2 * info.num_workers))
        return dataclasses.replace(strategy, inflight=min(share, strategy.inflight))

    def _drain_metrics(self) -> ReadDelta | None:
        """In a worker of the loader: this process's figures since its last batch."""
        if self._run is None or not self.timed or self._ds is None or worker_info() is None:
            return None
        return self._ds.metrics.drain()

    def _finish(self, sample: dict[str, Any]) -> dict[str, Any]:
        key = sample.get("__key__") if isinstance(sample, dict) else None
        if self.transform is not None:
            sample = self.transform(sample)
        if isinstance(sample, dict) and "__key__" not in sample and key is not None:
            # The loader counts delivered samples by key (exact resume): keep it.
            sample = {"__key__": key, **sample}
        return sample

    def _sample_index(self, index: object) -> int:
        """``index`` checked and made non-negative.

        Raises:
            UsageError: not an integer (a float, a bool, a string).
            IndexError: out of range (what ``for x in ds`` relies on to stop).
        """
        number = require_int(index, "sample index")
        if not -self.num_samples <= number < self.num_samples:
            raise IndexError(f"sample {number} out of range for {self.num_samples} samples")
        return number % self.num_samples

    def _sample_indices(self, indices: Sequence[object]) -> list[int]:
        """Each of ``indices`` checked and made non-negative, as :meth:`_sample_index` does,
        with the checks done for the whole batch where every index is a plain int in range
        (the usual batch: no Python step per sample).

        Raises:
            UsageError: an index is not an integer.
            IndexError: an index is out of range.
        """
        values = list(indices)
        n = self.num_samples
        if values and set(map(type, values)) == {int}:
            ints = cast("list[int]", values)
            low = min(ints)
            if -n <= low and max(ints) < n:
                return ints if low >= 0 else [v % n for v in ints]
        return [self._sample_index(i) for i in values]

    def _read_checked(self, read: Callable[[list[int]], Any], indices: list[int]) -> Any:
        """``read(indices)``, through the recovery policy when there is one; a worker sends
        the recovery's events with the batch, the training process keeps them."""
        if self.recovering is None:
            return read(indices)
        # The dataset this is the read path of (a Recoverable: its order, its probe).
        batch, events = self.recovering.read(cast("Recoverable", self), read, indices)
        if events:
            if worker_info() is not None:
                if isinstance(batch, dict):
                    batch[EVENTS_KEY] = events
            else:
                self.recovering.absorb(events)
        return batch

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as a dict: ``__key__``, bytes per extension, ``cls`` as int.

        Raises:
            SampleDecodeError: the decoder failed on the sample (naming it).
        """
        return self._sample(index)[0]

    def _sample(self, index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(sample ``index`` decoded and transformed, the recovery events of its read)."""
        got = self._read_checked(self._read_decoded, [self._sample_index(index)])
        events = got.pop(EVENTS_KEY, None) if isinstance(got, dict) else None
        return self._finish(got), events or []

    def _read_decoded(self, indices: list[int]) -> dict[str, Any]:
        """Read and decode the one sample of ``indices``: the read a ResilientDataset
        recovers, so that a sample its decoder refuses is substituted like an unreadable one.

        Raises:
            SampleDecodeError: the decoder failed on it.
        """
        sample = read_one(self.packed, indices[0], verify=self.verify)
        if self._decoder is None:
            return sample
        packed, index = self.packed, indices[0]
        decoded = decode_sample(
            self._decoder,
            sample,
            dataset=self.path,
            shard=packed.manifest.shards[packed.shard_of(index)].path,
            index=index,
        )
        if isinstance(decoded, dict) and "__key__" not in decoded:
            # The loader counts delivered samples by key (exact resume): keep it.
            decoded = {"__key__": sample["__key__"], **decoded}
        return decoded

    def _read_items(self, indices: Sequence[int]) -> Any:
        checked = self._sample_indices(indices)
        if self._decoder is None and self.transform is None:
            batch = self._read_checked(self._read_raw, checked)
        else:
            samples, events = [], []
            for i in checked:
                sample, got = self._sample(i)
                samples.append(sample)
                events.extend(got)
            batch = collate_samples(samples)
            if events:
                batch[EVENTS_KEY] = events
        delta = self._drain_metrics()
        if delta is not None and isinstance(batch, dict):
            batch[METRICS_KEY] = delta  # travels with the batch: no channel of its own
        return self._to_send(batch)

    def read_samples(self, indices: Sequence[int]) -> dict[str, Any]:
        """Samples ``indices`` undecoded, as one batch in this process's memory
        (:func:`~shardio.runtime.batch.read_batch`'s form), read through the recovery policy;
        in a DataLoader worker the recovery's events go along (``EVENTS_KEY``). What a mix
        reads this dataset's share of its batch with.

        Raises:
            IndexError: an index out of range.
        """
        checked = self._sample_indices(indices)
        return self._read_checked(self._read_local, checked)  # type: ignore[no-any-return]

    def _read_local(self, checked: list[int]) -> dict[str, Any]:
        self._share_strategy()
        return self._read_reused(checked)

    def _read_reused(self, checked: list[int]) -> dict[str, Any]:
        """A batch in this process's reused buffers; again into another where a stalled read
        was abandoned into one (that one stays with the I/O thread until its read returns)."""
        allocate = self._reused()
        return into_fresh_buffers(
            lambda: read_batch(self.packed, checked, verify=self.verify, allocate=allocate)
        )

    def _reused(self) -> Callable[[int], Any]:
        """The training process's reused batch buffers (:mod:`shardio.runtime.reuse`)."""
        buffers = self.__dict__.get("_buffers")
        if buffers is None:
            buffers = self.__dict__["_buffers"] = ReusedBuffers()
        return buffers.allocate

    def _share_strategy(self) -> None:
        """In a DataLoader worker: take its share of the requests in flight."""
        worker = worker_info()
        if worker is not None and self._ds is not None and self._ds.read_strategy is not None:
            self._ds.read_strategy = self._batch_strategy()  # a forked worker's share

    def _read_raw(self, checked: list[int]) -> Any:
        """Read a batch of checked indices, undecoded, in the transport's form."""
        self._share_strategy()
        worker = worker_info()
        if self.transport == "mmap":
            batch = read_batch_mapped(self.packed, checked, verify=self.verify)
            return batch if worker is not None else labels_to_tensor(batch)
        ring = self._run.plan.ring if self._run is not None else None
        if worker is not None and ring is not None:
            return ring.read(self.packed, checked, worker=worker.id, verify=self.verify)
        if in_process(worker):  # a buffer reused once nothing views its last batch
            return self._read_reused(checked)
        # "shm" or a plain DataLoader's worker (no ring): a shared segment of its own.
        return into_fresh_buffers(
            lambda: read_batch(self.packed, checked, verify=self.verify, shared=True)
        )

    def _to_send(self, batch: Any) -> Any:
        """``batch`` as a worker sends it: a ring slot's batch as a small description."""
        worker = worker_info()
        ring = self._run.plan.ring if self._run is not None else None
        if worker is None or ring is None or not isinstance(batch, dict):
            return batch
        return ring.describe(batch, worker=worker.id)
