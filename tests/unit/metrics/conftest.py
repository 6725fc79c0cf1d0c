"""Snapshots with known figures, built from real ReadMetrics and StepTimer objects."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from shardio.metrics import MetricsSnapshot, ReadMetrics, StepTimer, snapshot

MS = 1_000_000  # ns


def record_known(read: ReadMetrics, steps: StepTimer, *, scale: int = 1) -> None:
    """Record figures whose Prometheus rendering the tests know by heart.

    Per ``scale``: staged reads of 1000 bytes at 0.2 ms (x3) and 3 ms (x1); source reads of
    5000 bytes at 40 ms (x2); 6 samples read, 4 cache hits, 1 miss, 1 checksum failure,
    2 retries. Three batches of 4 samples: waits 2, 1 and 30 ms; steps 100 and 200 ms.
    """
    for _ in range(scale):
        for ns in (MS // 5, MS // 5, MS // 5, 3 * MS):
            read.record_read(staged=True, nbytes=1000, ns=ns)
        for _ in range(2):
            read.record_read(staged=False, nbytes=5000, ns=40 * MS)
        read.add("samples", 6)
        read.add("cache_hits", 4)
        read.add("cache_misses", 1)
        read.add("checksum_failures", 1)
        read.add("retries", 2)
    steps.start(now_ns=0)
    steps.batch(wait_ns=2 * MS, samples=4, now_ns=2 * MS)
    steps.batch(wait_ns=1 * MS, samples=4, now_ns=102 * MS)
    steps.batch(wait_ns=30 * MS, samples=4, now_ns=302 * MS)


class Rank:
    """One rank's live figures and a source over them (like ``loader.metrics``)."""

    def __init__(self, rank: int, *, scale: int = 1, world_size: int = 2) -> None:
        self.rank = rank
        self.world_size = world_size
        self.read = ReadMetrics()
        self.steps = StepTimer()
        self.lock = threading.Lock()
        self.calls = 0
        record_known(self.read, self.steps, scale=scale)

    def __call__(self) -> MetricsSnapshot:
        with self.lock:
            self.calls += 1
            return snapshot(self.read, self.steps, rank=self.rank, world_size=self.world_size)


@pytest.fixture
def make_rank() -> Callable[..., Rank]:
    return Rank
