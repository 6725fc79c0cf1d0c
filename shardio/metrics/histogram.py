"""LatencyHistogram: fixed log-spaced buckets of durations, mergeable and cheap to record.

The bucket bounds run from 1 µs to 100 s in ten steps per decade (1, 1.25, 1.5, 2, 2.5, 3, 4,
5, 6, 7.5), so the thresholds operators watch (5, 10, 50, 100 ms, 1 s) are bucket edges and a
Prometheus histogram exported from these buckets is exact at them. Every process records into
the same bounds, so histograms from workers, ranks and nodes add bucket by bucket.

Percentiles are interpolated inside their bucket (at most 25% wide) and clamped to the exact
minimum and maximum recorded, so a percentile never lies outside the values seen.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from shardio.errors import UsageError

__all__ = ["BUCKET_BOUNDS_NS", "LatencyHistogram", "LatencySummary"]

_MANTISSAS = (100, 125, 150, 200, 250, 300, 400, 500, 600, 750)
# Upper bounds (inclusive) in nanoseconds: 1 µs ... 100 s. Bucket i holds values in
# (BOUNDS[i-1], BOUNDS[i]]; one more bucket holds everything above 100 s.
BUCKET_BOUNDS_NS: tuple[int, ...] = (
    *(m * 10**decade // 100 for decade in range(3, 11) for m in _MANTISSAS),
    100 * 10**9,
)
N_BUCKETS = len(BUCKET_BOUNDS_NS) + 1
_NO_MIN = 2**63 - 1
_BOUNDS: list[Any] = []  # the bounds as a numpy array, made on first use


def _BOUNDS_ARRAY() -> Any:  # noqa: N802 - a constant made lazily
    if not _BOUNDS:
        import numpy as np

        _BOUNDS.append(np.array(BUCKET_BOUNDS_NS, dtype=np.int64))
    return _BOUNDS[0]


@dataclass(frozen=True, kw_only=True)
class LatencySummary:
    """Percentiles of a histogram, in seconds (0.0 for an empty one).

    Attributes:
        count: values recorded.
        mean_s: their mean.
        p50_s: median.
        p95_s: 95th percentile.
        p99_s: 99th percentile.
        max_s: the largest (exact).
    """

    count: int
    mean_s: float
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float

    def to_dict(self) -> dict[str, float | int]:
        """The summary as JSON-ready values."""
        return {
            "count": self.count,
            "mean_s": self.mean_s,
            "p50_s": self.p50_s,
            "p95_s": self.p95_s,
            "p99_s": self.p99_s,
            "max_s": self.max_s,
        }


class LatencyHistogram:
    """Durations in log-spaced buckets (see the module docstring).

    Attributes:
        counts: values per bucket (``N_BUCKETS`` of them).
        sum_ns: the sum of the values.
        min_ns: the least value (a large sentinel while empty).
        max_ns: the largest value (0 while empty).
    """

    __slots__ = ("counts", "max_ns", "min_ns", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * N_BUCKETS
        self.sum_ns = 0
        self.min_ns = _NO_MIN
        self.max_ns = 0

    def record(self, ns: int) -> None:
        """Add one duration, in nanoseconds."""
        self.counts[bisect.bisect_left(BUCKET_BOUNDS_NS, ns)] += 1
        self.sum_ns += ns
        self.max_ns = max(self.max_ns, ns)
        self.min_ns = min(self.min_ns, ns)

    def record_many(self, values_ns: Any) -> None:
        """Add many durations at once (an int64 numpy array, or anything array-like)."""
        import numpy as np  # here: recording one value needs no numpy

        values = np.asarray(values_ns, dtype=np.int64)
        if values.size == 0:
            return
        where = np.searchsorted(_BOUNDS_ARRAY(), values, side="left")
        for i, c in enumerate(np.bincount(where, minlength=N_BUCKETS).tolist()):
            if c:
                self.counts[i] += c
        self.sum_ns += int(values.sum())
        self.max_ns = max(self.max_ns, int(values.max()))
        self.min_ns = min(self.min_ns, int(values.min()))

    @property
    def count(self) -> int:
        """Values recorded."""
        return sum(self.counts)

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s values to this histogram."""
        for i, c in enumerate(other.counts):
            if c:
                self.counts[i] += c
        self.sum_ns += other.sum_ns
        self.max_ns = max(self.max_ns, other.max_ns)
        self.min_ns = min(self.min_ns, other.min_ns)

    def copy(self) -> LatencyHistogram:
        """An independent copy."""
        out = LatencyHistogram()
        out.merge(self)
        return out

    def percentile_s(self, q: float) -> float:
        """The ``q``-th percentile (0 < q <= 100) in seconds, interpolated in its bucket."""
        total = self.count
        if total == 0:
            return 0.0
        rank = q / 100.0 * total
        seen = 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                lo = BUCKET_BOUNDS_NS[i - 1] if i > 0 else 0
                hi = BUCKET_BOUNDS_NS[i] if i < len(BUCKET_BOUNDS_NS) else self.max_ns
                value = lo + (hi - lo) * max(0.0, rank - seen) / c
                return min(max(value, self.min_ns), self.max_ns) / 1e9
            seen += c
        return self.max_ns / 1e9  # pragma: no cover - rank <= total always lands above

    def summary(self) -> LatencySummary:
        """Count, mean, P50/P95/P99 and max, in seconds."""
        total = self.count
        return LatencySummary(
            count=total,
            mean_s=self.sum_ns / total / 1e9 if total else 0.0,
            p50_s=self.percentile_s(50),
            p95_s=self.percentile_s(95),
            p99_s=self.percentile_s(99),
            max_s=self.max_ns / 1e9,
        )

    def cumulative(self, bounds_s: tuple[float, ...]) -> list[int]:
        """Counts of values at most each of ``bounds_s`` (a Prometheus histogram's ``le``).

        Exact where a bound is a bucket edge (every 1-2.5-5 step is); otherwise a value is
        counted under the first bucket edge at or above it.
        """
        out = []
        for bound in bounds_s:
            if math.isinf(bound):
                out.append(self.count)
                continue
            edge = bisect.bisect_left(BUCKET_BOUNDS_NS, round(bound * 1e9))
            out.append(sum(self.counts[: edge + 1]))
        return out

    # -- the compact form workers send with their batches --------------------------------
    def to_wire(self) -> tuple[tuple[tuple[int, int], ...], int, int, int]:
        """(non-zero (bucket, count) pairs, sum, min, max): small and picklable."""
        pairs = tuple((i, c) for i, c in enumerate(self.counts) if c)
        return pairs, self.sum_ns, self.min_ns, self.max_ns

    @classmethod
    def from_wire(cls, wire: Any) -> LatencyHistogram:
        """The histogram :meth:`to_wire` described, checked.

        Raises:
            UsageError: ``wire`` is not such a description.
        """
        out = cls()
        try:
            pairs, total, least, most = wire
            values = [total, least, most]
            ok = all(_is_count(v) for v in values) and isinstance(pairs, tuple)
            for i, c in pairs if ok else ():
                if not (_is_count(i) and _is_count(c) and i < N_BUCKETS):
                    ok = False
                    break
                out.counts[i] += c
        except (TypeError, ValueError) as exc:
            raise UsageError(f"malformed latency histogram: {exc}") from exc
        if not ok:
            raise UsageError("malformed latency histogram: counts must be integers >= 0")
        out.sum_ns, out.min_ns, out.max_ns = total, least, most
        return out

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"LatencyHistogram(count={s.count}, p50={s.p50_s * 1e3:.3f}ms, "
            f"p99={s.p99_s * 1e3:.3f}ms, max={s.max_s * 1e3:.3f}ms)"
        )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def stddev(total: float, total_sq: float, n: int) -> float:
    """Standard deviation from a sum and a sum of squares (0.0 for fewer than 2 values)."""
    if n < 2:
        return 0.0
    mean = total / n
    return math.sqrt(max(0.0, total_sq / n - mean * mean))
