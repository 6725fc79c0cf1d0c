"""The first real report follows the first batches, not a full interval of zeros.

Every reporter here runs with an interval of an hour: a figure that reaches its reader
within the bounded waits below (a minute at most) can only have come from the first-report
looks, never from the regular schedule. The waits are bounds on a test that would otherwise
hang, not measurements.
"""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from typing import ClassVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardio.metrics import MetricsSnapshot, PrometheusExporter, ReadMetrics, StepTimer, snapshot
from shardio.metrics.export import FIRST_POLL_S, PeriodicReporter, first_polls

HOUR_S = 3600.0
BOUND_S = 60.0  # how long a test waits for what must come within about FIRST_POLL_S
MS = 1_000_000


class Training:
    """A rank's live figures (like ``loader.metrics``): zeros until :meth:`deliver`."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.read = ReadMetrics()
        self.steps = StepTimer()
        self.lock = threading.Lock()
        self.calls = 0
        self.called = threading.Condition(self.lock)

    def deliver(self, batches: int = 1) -> None:
        with self.lock:
            self.steps.start(now_ns=0)
            for i in range(batches):
                self.read.record_read(False, 4000, 3 * MS)
                self.read.add("samples", 8)
                self.steps.batch(wait_ns=2 * MS, samples=8, now_ns=(i + 1) * 10 * MS)

    def __call__(self) -> MetricsSnapshot:
        with self.called:
            self.calls += 1
            self.called.notify_all()
            return snapshot(self.read, self.steps, rank=self.rank, world_size=2)

    def wait_for_calls(self, n: int) -> bool:
        with self.called:
            return self.called.wait_for(lambda: self.calls >= n, timeout=BOUND_S)


class Recording(PeriodicReporter):
    """Keeps what it is given; ``real`` is set by the first snapshot with figures."""

    kind: ClassVar[str] = "recording"

    def __init__(self, source: Training, *, interval_s: float) -> None:
        super().__init__(source, interval_s=interval_s)
        self.emitted: list[MetricsSnapshot] = []
        self.any = threading.Event()
        self.real = threading.Event()

    def emit(self, snap: MetricsSnapshot) -> None:
        self.emitted.append(snap)
        self.any.set()
        if snap.has_data:
            self.real.set()


def test_the_first_batches_are_reported_at_once_and_zeros_only_once() -> None:
    training = Training()
    reporter = Recording(training, interval_s=HOUR_S)
    with reporter:
        # Before the first batch the thread keeps looking (the old schedule looked first
        # after an hour) and reports nothing: no line of zeros per look.
        assert training.wait_for_calls(3), "the reporter did not look before an hour"
        assert reporter.emitted == []
        training.deliver(batches=3)
        assert reporter.real.wait(BOUND_S), "the first batches waited for the interval"
        assert [s.batches for s in reporter.emitted] == [3]
        assert reporter.emitted[0].samples_read == 24
        calls = training.calls
    # From the first real report on, the next is an interval away: close() adds the last
    # report and nothing else looked in between.
    assert [s.batches for s in reporter.emitted] == [3, 3]
    assert training.calls == calls + 1


def test_without_batches_the_regular_report_still_comes() -> None:
    training = Training()
    reporter = Recording(training, interval_s=2 * FIRST_POLL_S)  # one look, then the report
    with reporter:
        # The look finds only zeros and reports nothing; the report one interval in does.
        assert reporter.any.wait(BOUND_S), "no regular report"
        assert training.calls >= 2  # the look, then the report
        assert not any(s.has_data for s in reporter.emitted)


@pytest.mark.parametrize(
    ("interval_s", "polls"), [(HOUR_S, 7199), (15.0, 29), (1.2, 2), (FIRST_POLL_S, 0), (0.01, 0)]
)
def test_the_looks_fit_in_one_interval(interval_s: float, polls: int) -> None:
    assert first_polls(interval_s) == polls
    assert polls * FIRST_POLL_S < interval_s


def test_has_data() -> None:
    training = Training()
    assert not training().has_data
    training.deliver()
    assert training().has_data


def _scrape_batches(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "shardio_batches_delivered_total":
                out[sample.labels["rank"]] = sample.value
    return out


def _wait_until(check: object, what: str) -> None:
    done = threading.Event()
    for _ in range(int(BOUND_S / 0.05)):
        if check():  # type: ignore[operator]
            return
        done.wait(0.05)
    pytest.fail(f"{what} did not happen within {BOUND_S:g} s (the interval is an hour)")


def test_local_rank_zero_serves_the_first_batches_before_an_interval() -> None:
    training = Training()
    with PrometheusExporter(training, port=0, interval_s=HOUR_S) as node:
        port = node.bound_port
        assert port is not None
        assert _scrape_batches(port) == {"0": 0.0}  # the report of start(): before training
        training.deliver(batches=2)
        _wait_until(lambda: _scrape_batches(port) == {"0": 2.0}, "serving the first batches")


def test_another_local_rank_leaves_its_first_figures_once_the_spool_appears(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    rank1 = Training(rank=1)
    rank1.deliver(batches=5)
    other = PrometheusExporter(rank1, local_rank=1, spool_dir=spool, job="j", interval_s=HOUR_S)
    with other:
        assert not spool.exists()  # local rank 0 makes it, later
        node = PrometheusExporter(Training(), port=0, spool_dir=spool, job="j", interval_s=HOUR_S)
        with node:
            port = node.bound_port
            assert port is not None
            # The old schedule wrote the first spool file an interval after start.
            _wait_until((spool / "local-rank-1.json").is_file, "the spool file")
            assert _scrape_batches(port) == {"0": 0.0, "1": 5.0}
