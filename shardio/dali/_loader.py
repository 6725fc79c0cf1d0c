"""DALILoader: PyTorch batches from a ShardPipeline, one epoch per ``for`` loop.

Built on ``nvidia.dali.plugin.pytorch.DALIGenericIterator`` (or its ragged sibling
``DALIRaggedIterator`` when the data has one shape per sample, not per batch).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from shardio.dali._pipeline import ShardPipeline
from shardio.errors import UsageError
from shardio.metrics.snapshots import MetricsSnapshot, snapshot
from shardio.metrics.steps import StepTimer
from shardio.runtime.audit import make_observers, observe, with_audit_counts
from shardio.runtime.plan import run_positions

__all__ = ["OUTPUT_MAP", "DALILoader"]

OUTPUT_MAP = ("data", "label")


class DALILoader:
    """Iterate ``{"data": ..., "label": int64 tensor (B,)}`` batches of a ShardPipeline.

    ``data`` is a dense uint8 tensor ``(B, crop, crop, 3)`` when the pipeline decodes and
    crops; otherwise (raw bytes, or decoded images of their own sizes) a list of B uint8
    tensors. With ``decode="mixed"`` the data lies on the pipeline's GPU; ``label`` is an
    int64 CPU tensor in every mode (move it with the batch: ``label.to(data.device)``).

    Each ``for batch in loader`` is one epoch; :meth:`set_epoch` before it selects the epoch
    (the DistributedSampler habit; nothing advances it by itself, as with ShardDataset).
    On the verified path the loader resumes exactly, as ShardLoader does: :meth:`state_dict`
    says which samples were handed to the loop; :meth:`load_state_dict` (in a new process,
    also with another number of ranks) makes the next loop read the rest of that epoch. A
    loop left before the epoch's end (``break``, an exception) makes the next loop build a
    fresh DALI pipeline and continue the epoch after the last batch it delivered; a loop
    after a finished epoch reads that epoch again unless :meth:`set_epoch` chose another.

    Errors: on the verified path a damaged member raises shardio's ChecksumMismatchError (a
    missing or unreadable shard StorageError) from the loop, as it is, when DALI asks for
    the batch holding it, which is up to ``prefetch_queue_depth`` batches before the loop
    would reach that batch. On DALI's reader path DALI raises its own RuntimeError.

    Audit: where shardio's reader feeds DALI (the verified path, and HDF5), each epoch is
    audited as ShardLoader's are (:mod:`shardio.runtime.audit`: every planned sample handed
    to the loop exactly once, one log line an epoch, ``epochs_audited`` and
    ``epochs_not_exact`` in :meth:`metrics`); DALI's own reader (``verify=False`` on tar) is
    not seen by shardio and is not audited.

    Args:
        pipeline: the pipeline to iterate (the loader closes it in :meth:`close`).
        audit: True (default) or False, as ShardLoader's (no records directory here).

    Attributes:
        steps: step time and the wait for each batch, where the loop takes it.
    """

    def __init__(self, pipeline: ShardPipeline, *, audit: bool = True) -> None:
        if not isinstance(audit, bool):
            raise UsageError(f"audit must be True or False, got {audit!r}")
        self.pipeline = pipeline
        self.steps = StepTimer()
        self._iterator: Any = None
        self._state = "fresh"  # "fresh", "running" (a pass in progress, or left), "ended"
        self._observers: list[Any] = []
        self._audited = _AuditedPipeline(pipeline)
        if audit and pipeline.packed is not None and pipeline.cursor is not None:
            # As a ShardLoader's: its batches are whole but for the epoch's last (DALI's
            # partial batch), so the loader cuts nothing (drop_last False).
            view = SimpleNamespace(
                dataset=self._audited, batch_size=pipeline.options.batch_size, drop_last=False
            )
            self._observers = make_observers(view, True)

    @property
    def epoch(self) -> int:
        """The epoch the next loop reads."""
        return self.pipeline.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next loop (see :meth:`ShardPipeline.set_epoch`)."""
        self.pipeline.set_epoch(epoch)

    @property
    def dataset_id(self) -> str | None:
        """The id of the dataset it reads (the xxh3-128 of its manifest's bytes, as
        ShardLoader's): what a checkpoint of its position records (:mod:`shardio.checkpoint`),
        so that it resumes no other dataset."""
        found = getattr(self.pipeline, "dataset_id", None)
        return found if isinstance(found, str) else None

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands (see :meth:`ShardPipeline.state_dict`)."""
        return self.pipeline.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (see :meth:`ShardPipeline.load_state_dict`)."""
        self.pipeline.load_state_dict(state)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.pipeline)

    def _make_iterator(self) -> Any:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, DALIRaggedIterator

        kwargs: dict[str, Any] = {
            "output_map": list(OUTPUT_MAP),
            "auto_reset": False,  # reset when the next loop starts: after set_epoch()
            "prepare_first_batch": False,  # nothing is read before the first loop
            **self.pipeline.iterator_kwargs(),
        }
        if self.pipeline.uniform:
            return DALIGenericIterator([self.pipeline.pipe], **kwargs)
        ragged = [DALIRaggedIterator.SPARSE_LIST_TAG, DALIRaggedIterator.DENSE_TAG]
        return DALIRaggedIterator([self.pipeline.pipe], output_types=ragged, **kwargs)

    def _start_pass(self) -> Any:
        cursor = self.pipeline.cursor
        if cursor is not None:
            cursor.begin()  # a loop after a finished epoch reads it again
        if self._iterator is None:
            self._iterator = self._make_iterator()
        elif self._state == "ended":
            self._iterator.reset()  # DALI reads the next pass's first batches now
        elif self._state != "fresh":
            # DALI cannot reset mid-epoch (it holds batches read ahead): start afresh.
            self._iterator = None
            self.pipeline.rebuild()
            self._iterator = self._make_iterator()
        self._state = "running"
        return self._iterator

    def metrics(self) -> MetricsSnapshot:
        """This rank's data path: shardio's reads (verified path only; DALI's own reader
        is not seen) and the step time, wait and stall fraction of the loops."""
        ranks = self.pipeline.ranks
        snap = snapshot(
            self.pipeline.read_metrics(),
            self.steps,
            rank=ranks.rank,
            world_size=ranks.world_size,
        )
        return with_audit_counts(snap, self._observers)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        iterator = self._start_pass()
        cursor = self.pipeline.cursor
        world = self.pipeline.ranks.world_size
        clock = time.perf_counter_ns
        planned: Any = None  # what this pass hands to the loop, in order (the audit's ids)
        if self._observers and cursor is not None:
            planned = run_positions(cursor.stream(), 1, False)
        delivered = 0
        self.steps.start()
        while True:
            asked = clock()
            try:
                outputs = next(iterator)
            except StopIteration:
                break
            batch = outputs[0]
            now = clock()
            samples = _batch_len(batch)
            self.steps.batch(wait_ns=now - asked, samples=samples, now_ns=now)
            if cursor is not None:
                if planned is not None:
                    values = planned[delivered : delivered + samples]
                    observe(self._observers, self._audited, cursor.epoch, values)
                delivered += samples
                cursor.advance(samples * world)  # handed to the loop: a resume starts after it
            yield batch
        self._state = "ended"
        if cursor is not None:
            cursor.finish()
            for observer in self._observers:
                observer.end_epoch(cursor.epoch)

    def close(self) -> None:
        """Drop the DALI iterator and close the pipeline."""
        self._iterator = None
        self.pipeline.close()

    def __enter__(self) -> DALILoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AuditedPipeline:
    """What the audit reads of a pipeline fed by shardio's reader: its cursor, dataset id,
    reader (for the samples' labels and shards) and read figures (for substitutions)."""

    def __init__(self, pipeline: ShardPipeline) -> None:
        self._pipeline = pipeline

    @property
    def cursor(self) -> Any:
        return self._pipeline.cursor

    @property
    def dataset_id(self) -> str | None:
        return self._pipeline.dataset_id

    @property
    def packed(self) -> Any:  # read afresh: a rebuilt pipeline has a new reader
        return self._pipeline.packed

    def read_metrics(self) -> Any:
        return self._pipeline.read_metrics()


def _batch_len(batch: dict[str, Any]) -> int:
    label = batch.get("label")
    shape = getattr(label, "shape", None)
    return int(shape[0]) if shape else 0
