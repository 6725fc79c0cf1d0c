"""StepTimer: the training side of the data path: step time and the wait for each batch.

The loader (or the GPU prefetcher, or the DALI loader: whatever the training loop iterates)
calls :meth:`StepTimer.start` when an iteration begins and :meth:`StepTimer.batch` each time a
batch reaches the loop, with the time the loop spent waiting for it. A step is the time from
one batch's arrival to the next one's: the loop's compute on the first plus the wait for the
second. The data stall fraction is the waiting time over the wall time of the iterations.
"""

from __future__ import annotations

import time

from shardio.metrics.histogram import LatencyHistogram, stddev

__all__ = ["StepTimer"]


class StepTimer:
    """Step and wait times of the loops over one loader.

    Attributes:
        batches: batches delivered.
        samples: samples delivered.
        wait_ns: time the loop waited for batches, in total.
        wall_ns: wall time of the iterations up to their last batch, in total.
        wait: histogram of the wait per batch.
        step: histogram of step times (the first batch of an iteration starts no step).
    """

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0
        self.wait_ns = 0
        self.wall_ns = 0
        self.wait = LatencyHistogram()
        self.step = LatencyHistogram()
        self._step_sq = 0.0
        self._began_ns: int | None = None
        self._last_ns: int | None = None

    def start(self, now_ns: int | None = None) -> None:
        """An iteration begins (its first wait counts from here)."""
        self._began_ns = time.perf_counter_ns() if now_ns is None else now_ns
        self._last_ns = None

    def batch(self, *, wait_ns: int, samples: int, now_ns: int | None = None) -> None:
        """A batch of ``samples`` reached the loop after ``wait_ns`` of waiting."""
        now = time.perf_counter_ns() if now_ns is None else now_ns
        if self._began_ns is None:
            self._began_ns = now - wait_ns
        self.batches += 1
        self.samples += samples
        self.wait_ns += wait_ns
        self.wait.record(wait_ns)
        previous = self._last_ns if self._last_ns is not None else self._began_ns
        self.wall_ns += now - previous
        if self._last_ns is not None:
            step = now - self._last_ns
            self.step.record(step)
            self._step_sq += float(step) * float(step)
        self._last_ns = now

    @property
    def stall_fraction(self) -> float:
        """The share of the wall time the loop spent waiting for data (0.0 before a batch)."""
        return self.wait_ns / self.wall_ns if self.wall_ns > 0 else 0.0

    @property
    def step_mean_s(self) -> float:
        """Mean step time in seconds."""
        n = self.step.count
        return self.step.sum_ns / n / 1e9 if n else 0.0

    @property
    def step_std_s(self) -> float:
        """Standard deviation of the step time in seconds."""
        return stddev(float(self.step.sum_ns), self._step_sq, self.step.count) / 1e9
