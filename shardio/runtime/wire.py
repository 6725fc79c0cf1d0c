"""The worker-to-trainer wire format: what a DataLoader worker sends beside a batch.

A batch of a mix names each sample's source (:data:`SOURCE_KEY`). A worker's batch (a dict)
may carry two extra keys, which the loader takes out before the
training loop sees the batch: :data:`EVENTS_KEY` (recovery events of ResilientDataset) and
:data:`METRICS_KEY` (the worker's read figures since its last batch, a ``ReadDelta``). A
ShardioError raised in a worker travels as a :class:`WorkerFailure`, intact. Labels and
sources travel as ndarrays and become tensors in the training process
(:func:`labels_to_tensor`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardio.format.spec import LABEL_EXT
from shardio.metrics.read import ReadDelta

__all__ = ["EVENTS_KEY", "METRICS_KEY", "SOURCE_KEY", "WorkerFailure", "labels_to_tensor"]

# Recovery events a worker sends with a batch (ResilientDataset); the loader takes them out.
EVENTS_KEY = "__shardio_events__"
# The read metrics a worker drained after reading a batch (a ReadDelta); the loader takes them
# out and merges them into the rank's figures.
METRICS_KEY = "__shardio_metrics__"
# Each sample's source index in a batch of a mix (its keys are the source's own).
SOURCE_KEY = "__source__"


class WorkerFailure:
    """A ShardioError raised in a DataLoader worker, carried to the main process intact.

    torch re-raises worker errors by building a new exception from a message, which loses
    the type and the attributes of a ChecksumMismatchError; the loader re-raises this one.

    Attributes:
        error: the exception.
        metrics: the worker's read metrics up to the failure (its checksum failures, ...):
            a ReadDelta, or a mix's ``[(source, ReadDelta), ...]``.
    """

    def __init__(
        self, error: BaseException, metrics: ReadDelta | list[tuple[int, ReadDelta]] | None = None
    ) -> None:
        self.error = error
        self.metrics = metrics


def labels_to_tensor(batch: dict[str, Any]) -> dict[str, Any]:
    """Make a batch's labels (and a mix's sources) tensors (workers send them as ndarrays:
    no shared memory)."""
    for key in (LABEL_EXT, SOURCE_KEY):
        found = batch.get(key)
        if isinstance(found, np.ndarray):
            batch[key] = torch.from_numpy(found)
    return batch
