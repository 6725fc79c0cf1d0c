"""Shuffle quality of delivered batches: the figures, their accumulator and their report.

What a batch says about the shuffle that made it:

* **label entropy**: the Shannon entropy of the batch's labels over the dataset's label
  entropy: 1.0 means the batch is as mixed as the dataset, 0.0 one class only. A batch of B
  samples cannot hold more than ``log(B)`` nats, so with more classes than that the figure's
  ceiling is ``log(B) / H(dataset)`` (the report says so); a random draw of B samples also
  falls a little short of 1.0 by chance.
* **distinct shards** it draws from (its reads' spread), and the distinct shards of each
  window of consecutive batches (the shards a loader keeps open to serve them).
* **shard switches**: consecutive delivered samples from different shards, per batch (0 for
  a shard read front to back; about B for a random order): how sequential the reads are.
* **rho**: the correlation of delivery position with storage position (sample index). Over
  an epoch that delivers each sample once both are ranks, so this Pearson correlation is
  Spearman's rank correlation; 1 for a sequential read, about 0 for a good shuffle, about
  0 also for a rank's share of one. It is kept as running co-moments (Chan's merge), so the
  accumulator holds O(1) for it whatever the epoch's length.

:class:`QualityAccumulator` takes the batches as a loader delivers them
(:meth:`~QualityAccumulator.observe`) and gives a :class:`QualityReport` per epoch; the spec
path (:func:`shardio.order.quality.order_quality`) feeds it the batches an order would deliver.
Memory: a few numbers, plus 8 bytes per batch of the epoch (the per-batch entropies, for
their 5th percentile) and the shards of the open window.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shardio.errors import UsageError

__all__ = ["QualityAccumulator", "QualityReport", "dataset_label_entropy"]

WINDOW_BATCHES = 8  # consecutive batches per read window (workers x prefetch, about)
_EXACT_LABELS = 1 << 22  # up to this many samples the dataset's entropy is exact
_LABEL_SAMPLE = 1 << 20  # else labels read evenly strided (stratified on a class-sorted index)
_BINCOUNT_LIMIT = 1 << 24  # labels below this are counted with bincount, else sorted


def _entropy_of_counts(counts: np.ndarray[Any, Any]) -> float:
    counts = counts[counts > 0].astype(np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def dataset_label_entropy(labels: Any) -> float | None:
    """The entropy (nats) of a dataset's labels; None when it has no labels (all < 0).

    Args:
        labels: one label per sample (an array, or anything indexed by an int64 array with a
            ``len``: an index's memory-mapped label column). Negative values are no label.
            Up to 4,194,304 samples every label is counted; beyond, 1,048,576 evenly
            strided ones are (a few pages of the index, however large).
    """
    n = len(labels)
    if n == 0:
        return None
    if n <= _EXACT_LABELS:
        values = np.asarray(labels[np.arange(n, dtype=np.int64)], dtype=np.int64)
    else:
        step = n // _LABEL_SAMPLE
        values = np.asarray(labels[np.arange(0, n, step, dtype=np.int64)], dtype=np.int64)
    values = values[values >= 0]
    if len(values) == 0:
        return None
    if int(values.max()) < _BINCOUNT_LIMIT:
        return _entropy_of_counts(np.bincount(values))
    ordered = np.sort(values)
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    return _entropy_of_counts(np.diff(np.append(starts, len(ordered))))


def _row_runs(
    values: np.ndarray[Any, Any],
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The runs of equal values in each row of ``values`` once sorted, negatives left out:
    (row of each run, its length, valid values per row)."""
    rows, width = values.shape
    ordered = np.sort(values, axis=1).ravel()  # the negatives (pads, no label) come first
    valid = ordered >= 0
    new = np.ones(len(ordered), dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    new[::width] = True  # a row's first value starts a run
    starts = np.flatnonzero(new & valid)
    row_ends = (starts // width + 1) * width
    ends = np.minimum(np.append(starts[1:], rows * width), row_ends)
    per_row = valid.reshape(rows, width).sum(axis=1)
    return starts // width, ends - starts, per_row


def _entropies(labels: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Entropy (nats) of each row's labels (>= 0); NaN for a row without one."""
    rows = labels.shape[0]
    row, length, per_row = _row_runs(labels)
    p = length / per_row[row]
    out = np.bincount(row, weights=-p * np.log(p), minlength=rows)
    out[per_row == 0] = np.nan
    return out


def _distinct(shards: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Distinct values (>= 0) of each row."""
    row, _, _ = _row_runs(shards)
    return np.bincount(row, minlength=shards.shape[0])


@dataclass(frozen=True, kw_only=True)
class QualityReport:
    """One epoch's shuffle quality (see the module docstring for each figure).

    Attributes:
        epoch: the epoch.
        batches: batches in the epoch (spec path) or delivered (accumulator).
        batches_measured: of them, those measured (all, unless the epoch was sampled).
        samples_measured: samples in the measured batches.
        batch_size: the largest batch measured.
        label_entropy: mean per-batch label entropy over the dataset's; None without labels.
        label_entropy_p5: its 5th percentile over the batches.
        entropy_ceiling: the most a batch of ``batch_size`` can reach (1.0 unless the dataset
            has more entropy than ``log(batch_size)``).
        dataset_entropy_nats: the dataset's label entropy; None without labels.
        shards_per_batch: mean distinct shards per batch; ``shards_per_batch_min`` the least.
        shards_per_window: mean distinct shards per window of ``window_batches`` batches.
        switches_per_batch: mean shard switches between consecutive samples, per batch.
        rho: delivery position vs sample index (1 sequential, ~0 shuffled); None under
            two samples.
        order: the order spec measured (spec path); None for delivered batches.
        memory_bytes: what the order holds (spec path); None for delivered batches.
        nodes: the nodes of a partitioned order (spec path; one rank each), else None.
        epoch_samples: samples in the epoch of the rank measured (the largest share of a
            partition; spec path), else None.
    """

    epoch: int
    batches: int
    batches_measured: int
    samples_measured: int
    batch_size: int
    label_entropy: float | None
    label_entropy_p5: float | None
    entropy_ceiling: float | None
    dataset_entropy_nats: float | None
    shards_per_batch: float
    shards_per_batch_min: int
    shards_per_window: float
    window_batches: int
    switches_per_batch: float
    rho: float | None
    order: str | None = None
    memory_bytes: int | None = None
    nodes: int | None = None
    epoch_samples: int | None = None

    @property
    def sampled(self) -> bool:
        """Whether the figures come from a sample of the epoch's batches."""
        return self.batches_measured < self.batches

    def line(self) -> str:
        """The report as one log line."""
        head = f"epoch {self.epoch} shuffle: "
        if not self.batches_measured:
            return head + "no batches"
        if self.label_entropy is None or self.label_entropy_p5 is None:
            entropy = "no labels"
        else:
            entropy = (
                f"label entropy {self.label_entropy:.2f} of the dataset's per batch "
                f"(p5 {self.label_entropy_p5:.2f}"
            )
            if self.entropy_ceiling is not None and self.entropy_ceiling < 0.995:
                entropy += (
                    f"; a batch of {self.batch_size} holds at most {self.entropy_ceiling:.2f}"
                )
            entropy += ")"
        rho = "n/a" if self.rho is None else f"{self.rho:.3f}"
        shards = self.shards_per_batch
        shown = (
            f"{shards:.2f}" if shards < 10 else f"{shards:.1f}" if shards < 100 else f"{shards:.0f}"
        )
        return f"{head}{entropy}, {shown} distinct shards per batch, order vs storage rho={rho}"

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values (``sampled`` added)."""
        return {**asdict(self), "sampled": self.sampled}


class _Moments:
    """Running means and co-moments of (position, sample) pairs, merged batch by batch."""

    def __init__(self) -> None:
        self.n = 0
        self.mean_p = self.mean_s = 0.0
        self.m2p = self.m2s = self.cps = 0.0

    def add(self, positions: np.ndarray[Any, Any], samples: np.ndarray[Any, Any]) -> None:
        nb = len(positions)
        if nb == 0:
            return
        p, s = positions.astype(np.float64), samples.astype(np.float64)
        mp, ms = float(p.mean()), float(s.mean())
        dp, ds = p - mp, s - ms
        # einsum, not @: BLAS threads spin for milliseconds on a busy node.
        m2p, m2s = float(np.einsum("i,i", dp, dp)), float(np.einsum("i,i", ds, ds))
        cps = float(np.einsum("i,i", dp, ds))
        n = self.n + nb
        delta_p, delta_s = mp - self.mean_p, ms - self.mean_s
        weight = self.n * nb / n
        self.m2p += m2p + delta_p * delta_p * weight
        self.m2s += m2s + delta_s * delta_s * weight
        self.cps += cps + delta_p * delta_s * weight
        self.mean_p += delta_p * nb / n
        self.mean_s += delta_s * nb / n
        self.n = n

    def correlation(self) -> float | None:
        if self.n < 2 or self.m2p <= 0 or self.m2s <= 0:
            return None
        return max(-1.0, min(1.0, self.cps / math.sqrt(self.m2p * self.m2s)))


def _column(values: Any, n: int, what: str) -> np.ndarray[Any, Any]:
    out = np.asarray(values)
    if out.ndim != 1 or len(out) != n or (n and out.dtype.kind not in "iu"):
        raise UsageError(f"observe: {what} must be {n} integers, one per sample of the batch")
    return out.astype(np.int64, copy=False)


_PENDING_ROWS = 64  # batches observed before they are taken in together
_Ints = np.ndarray[Any, Any]


class QualityAccumulator:
    """Shuffle quality from the batches a loader delivers, one epoch at a time.

    Args:
        dataset_entropy: the dataset's label entropy in nats
            (:func:`dataset_label_entropy`); None: no labels (no entropy figures).
        window_batches: consecutive batches per read window.

    A batch of another epoch than the one being measured starts that epoch afresh.
    """

    def __init__(
        self, *, dataset_entropy: float | None, window_batches: int = WINDOW_BATCHES
    ) -> None:
        if dataset_entropy is not None and not (
            math.isfinite(dataset_entropy) and dataset_entropy >= 0
        ):
            raise UsageError(f"dataset_entropy must be >= 0 nats, got {dataset_entropy!r}")
        if isinstance(window_batches, bool) or not isinstance(window_batches, int):
            raise UsageError(f"window_batches must be an int, got {window_batches!r}")
        if window_batches < 1:
            raise UsageError(f"window_batches must be >= 1, got {window_batches}")
        self.dataset_entropy = dataset_entropy
        self.window_batches = window_batches
        self._reset(None)

    def _reset(self, epoch: int | None) -> None:
        self._epoch = epoch
        # Observed batches not yet taken in: add_rows takes many at once for about the cost
        # of one (its numpy calls are per call, not per row).
        self._pending: list[
            tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], int]
        ] = []
        self._pending_next: int | None = None
        self._batches = self._samples = self._biggest = 0
        self._entropy_parts: list[np.ndarray[Any, Any]] = []
        self._distinct_sum = 0
        self._distinct_min: int | None = None
        self._switches = 0
        self._window_sum = self._windows = 0
        self._window_shards: set[int] = set()
        self._window_count = 0
        self._next_position: int | None = None
        self._last_shard = -1
        self._moments = _Moments()

    def observe(
        self,
        epoch: int,
        indices: Any,
        labels: Any,
        shards: Any,
        *,
        position: int | None = None,
    ) -> None:
        """Take in one delivered batch.

        Args:
            epoch: its epoch.
            indices: the sample index of each of its samples, in delivery order.
            labels: their labels (negative: none), or None for an unlabelled dataset.
            shards: their shards.
            position: the epoch position of its first sample; None: right after the
                previous batch (0 for the first). A gap starts a new read window.

        Raises:
            UsageError: the arrays are not one integer per sample.
        """
        idx = np.asarray(indices)
        n = len(idx) if idx.ndim == 1 else -1
        idx = _column(idx, n, "indices")
        lab = np.full(n, -1, np.int64) if labels is None else _column(labels, n, "labels")
        shd = _column(shards, n, "shards")
        if n and int(shd.min()) < 0:
            raise UsageError(f"observe: shards must be >= 0, got {int(shd.min())}")
        if epoch != self._epoch:
            self._reset(epoch)
        if n == 0:
            return
        expected = self._pending_next if self._pending else self._next_position
        first = (expected or 0) if position is None else int(position)
        self._pending.append((idx.copy(), lab.copy(), shd.copy(), first))  # the caller's may change
        self._pending_next = first + n
        if len(self._pending) >= _PENDING_ROWS:
            self._take_pending()

    def _take_pending(self) -> None:
        if self._pending and self._epoch is not None:
            idx, lab, shd, first = zip(*self._pending, strict=True)
            self._pending = []
            self.add_rows(self._epoch, list(idx), list(lab), list(shd), list(first))

    def add_rows(
        self,
        epoch: int,
        indices: list[np.ndarray[Any, Any]],
        labels: list[np.ndarray[Any, Any]],
        shards: list[np.ndarray[Any, Any]],
        positions: list[int],
    ) -> None:
        """Take in several batches at once (the spec path's sampled batches): ``positions``
        are their first samples' epoch positions; each row non-empty, as :meth:`observe`."""
        if epoch != self._epoch:
            self._reset(epoch)
        self._take_pending()  # batches observed before these come first
        rows = len(indices)
        widths = [len(r) for r in indices]
        width = max(widths)
        lab2 = np.full((rows, width), -1, dtype=np.int64)
        shd2 = np.full((rows, width), -1, dtype=np.int64)
        for r in range(rows):
            lab2[r, : widths[r]] = labels[r]
            shd2[r, : widths[r]] = shards[r]
        if self.dataset_entropy is not None:
            self._entropy_parts.append(_entropies(lab2))
        distinct = _distinct(shd2)
        self._distinct_sum += int(distinct.sum())
        least = int(distinct.min())
        self._distinct_min = least if self._distinct_min is None else min(self._distinct_min, least)
        valid = shd2 >= 0
        self._switches += int(np.count_nonzero((shd2[:, 1:] != shd2[:, :-1]) & valid[:, 1:]))
        firsts = shd2[:, 0]
        lasts = shd2[np.arange(rows), np.asarray(widths) - 1]
        expected, previous_last = self._next_position, self._last_shard
        for r in range(rows):
            follows = positions[r] == expected
            if follows and previous_last != firsts[r]:
                self._switches += 1
            if not follows or self._window_count == self.window_batches:
                self._close_window()
            self._window_shards.update(shards[r].tolist())
            self._window_count += 1
            expected, previous_last = positions[r] + widths[r], int(lasts[r])
        self._moments.add(
            np.concatenate([np.arange(p, p + w) for p, w in zip(positions, widths, strict=True)]),
            np.concatenate(indices),
        )
        self._next_position, self._last_shard = expected, previous_last
        self._batches += rows
        self._samples += sum(widths)
        self._biggest = max(self._biggest, width)

    def _close_window(self) -> None:
        if self._window_count:
            self._window_sum += len(self._window_shards)
            self._windows += 1
        self._window_shards = set()
        self._window_count = 0

    def end_epoch(
        self,
        epoch: int,
        *,
        batches: int | None = None,
        order: str | None = None,
        memory_bytes: int | None = None,
        nodes: int | None = None,
        epoch_samples: int | None = None,
    ) -> QualityReport:
        """The report of ``epoch`` (and a fresh start): empty when none of its batches came.

        Args:
            epoch: the epoch to report.
            batches: the epoch's batches when only some were observed (the spec path).
            order, memory_bytes, nodes, epoch_samples: what the spec path knows of the
                order.
        """
        if epoch != self._epoch:
            self._reset(epoch)
        self._take_pending()
        self._close_window()  # the last window, however short
        h = self.dataset_entropy
        mean = p5 = ceiling = None
        if h == 0 and self._batches:  # one class: every batch is as mixed as the dataset
            mean = p5 = ceiling = 1.0
        elif h is not None and self._batches:
            nats = np.concatenate(self._entropy_parts)
            nats = nats[~np.isnan(nats)]
            if len(nats):
                mean = float(nats.mean() / h)
                p5 = float(np.percentile(nats, 5) / h)
            ceiling = min(1.0, math.log(self._biggest) / h) if self._biggest > 1 else 0.0
        seen = self._batches
        report = QualityReport(
            epoch=epoch,
            batches=seen if batches is None else batches,
            batches_measured=seen,
            samples_measured=self._samples,
            batch_size=self._biggest,
            label_entropy=mean,
            label_entropy_p5=p5,
            entropy_ceiling=ceiling,
            dataset_entropy_nats=h,
            shards_per_batch=self._distinct_sum / seen if seen else 0.0,
            shards_per_batch_min=self._distinct_min or 0,
            shards_per_window=self._window_sum / self._windows if self._windows else 0.0,
            window_batches=self.window_batches,
            switches_per_batch=self._switches / seen if seen else 0.0,
            rho=self._moments.correlation(),
            order=order,
            memory_bytes=memory_bytes,
            nodes=nodes,
            epoch_samples=epoch_samples,
        )
        self._reset(None)
        return report
