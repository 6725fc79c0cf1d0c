"""ShardLoader's shuffle-quality observer: the quality of the order each epoch delivered.

A batch observer (the hook of :mod:`shardio.runtime.audit`): each delivered batch's sample
indices, labels and shards go to a :class:`~shardio.order.quality_report.QualityAccumulator`,
and at the end of each epoch its report is logged as one line (``epoch 3 shuffle: label
entropy 0.97 of the dataset's per batch (p5 0.91), 5.2 distinct shards per batch, ...``) and
kept as ``loader.shuffle_quality``. It measures this rank's share as training received it,
so a resumed epoch reports what was delivered since the resume. A mix's batches carry no
labels or shards here (they are the sources'), so a mix is not measured. What an order would
give before training starts: ``shardio inspect DATASET --order SPEC``.
"""

from __future__ import annotations

import logging
from typing import Any

from shardio.order.quality_report import (
    QualityAccumulator,
    QualityReport,
    dataset_label_entropy,
)

__all__ = ["ShuffleQuality", "shuffle_observer"]

logger = logging.getLogger(__name__)


class ShuffleQuality:
    """Measures the shuffle of the batches delivered, epoch by epoch."""

    def __init__(self, labels: Any) -> None:
        self._entropy = dataset_label_entropy(labels)
        self._acc = QualityAccumulator(dataset_entropy=self._entropy)
        self._seen = False
        self.last: QualityReport | None = None

    def observe(self, epoch: int, indices: Any, labels: Any, shards: Any) -> None:
        if shards is None:
            return
        self._acc.observe(epoch, indices, labels, shards)
        self._seen = True

    def end_epoch(self, epoch: int) -> None:
        if not self._seen:
            return
        self.last = self._acc.end_epoch(epoch)
        self._seen = False
        logger.info("%s", self.last.line())


def shuffle_observer(source: Any) -> ShuffleQuality | None:
    """The observer for ``source``: a dataset with an index; None for a mix (or a source
    without one)."""
    packed = getattr(source, "packed", None)
    if packed is None or getattr(source, "locate_many", None) is not None:
        return None
    return ShuffleQuality(packed.index.samples["label"])
