"""LatencyHistogram and ReadMetrics: percentiles inside the values seen, exact at the
watched thresholds, merge and wire form, a forked child counting from zero."""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest

from shardio.errors import UsageError
from shardio.metrics.histogram import BUCKET_BOUNDS_NS, LatencyHistogram
from shardio.metrics.read import ReadMetrics
from shardio.metrics.steps import StepTimer


def test_the_thresholds_operators_watch_are_bucket_edges() -> None:
    for ms in (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000):
        assert round(ms * 1e6) in BUCKET_BOUNDS_NS
    assert list(BUCKET_BOUNDS_NS) == sorted(set(BUCKET_BOUNDS_NS))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_percentiles_lie_within_a_bucket_of_the_exact_ones(seed: int) -> None:
    rng = random.Random(seed)
    values = [int(rng.lognormvariate(15, 1.5)) + 1 for _ in range(5000)]
    hist = LatencyHistogram()
    for v in values:
        hist.record(v)
    s = hist.summary()
    assert s.count == len(values)
    assert s.max_s == max(values) / 1e9
    assert s.mean_s == pytest.approx(sum(values) / len(values) / 1e9)
    for q, got in ((50, s.p50_s), (95, s.p95_s), (99, s.p99_s)):
        exact = float(np.percentile(values, q)) / 1e9
        assert exact / 1.34 <= got <= exact * 1.34, (q, got, exact)
        assert min(values) / 1e9 <= got <= max(values) / 1e9


def test_a_single_value_is_every_percentile() -> None:
    hist = LatencyHistogram()
    hist.record(37_000_000)
    s = hist.summary()
    assert s.p50_s == s.p99_s == s.max_s == 0.037


def test_empty_and_out_of_range() -> None:
    assert LatencyHistogram().summary().p99_s == 0.0
    hist = LatencyHistogram()
    hist.record(0)
    hist.record(10**12)  # 1000 s: above the last bound
    assert hist.counts[0] == 1 and hist.counts[-1] == 1
    assert hist.percentile_s(100) == 1000.0


def test_cumulative_counts_at_prometheus_bounds() -> None:
    hist = LatencyHistogram()
    for ms in (1, 5, 5, 49, 50, 51, 100, 101):
        hist.record(ms * 1_000_000)
    assert hist.cumulative((0.005, 0.05, 0.1, float("inf"))) == [3, 5, 7, 8]


def test_merge_and_wire_form() -> None:
    a, b = LatencyHistogram(), LatencyHistogram()
    for v in (1_000, 2_000_000):
        a.record(v)
    b.record(70_000_000)
    a.merge(LatencyHistogram.from_wire(b.to_wire()))
    assert a.count == 3 and a.max_ns == 70_000_000
    assert a.min_ns == 1_000


@pytest.mark.parametrize(
    "wire",
    [None, "x", ((), 0, 0), (((0, -1),), 0, 0, 0), (((0, 1.5),), 0, 0, 0), ((), -1, 0, 0),
     (((True, 1),), 0, 0, 0)],
)  # fmt: skip
def test_a_malformed_wire_form_is_refused(wire: object) -> None:
    with pytest.raises(UsageError, match="histogram"):
        LatencyHistogram.from_wire(wire)


def test_drain_hands_over_and_zeroes() -> None:
    m = ReadMetrics()
    assert m.drain() is None
    m.add("samples", 4)
    m.record_read(staged=False, nbytes=100, ns=5_000)
    delta = m.drain()
    assert delta is not None
    assert m.counts["samples"] == 0 and m.latency["source"].count == 0
    sink = ReadMetrics()
    sink.absorb(pickle.loads(pickle.dumps(delta)))
    sink.absorb(delta)
    assert sink["samples"] == 8 and sink["bytes_source"] == 200 and sink["members"] == 2
    assert sink.latency["source"].count == 2


def test_a_pickled_copy_starts_from_zero() -> None:
    m = ReadMetrics()
    m.add("samples", 9)
    assert pickle.loads(pickle.dumps(m)).counts["samples"] == 0


def test_a_forked_child_counts_from_zero() -> None:
    m = ReadMetrics()
    m.add("samples", 5)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        m.add("samples", 1)
        os.write(w, str(m["samples"]).encode())
        os._exit(0)
    os.close(w)
    got = os.read(r, 64)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1"
    assert m["samples"] == 5  # the parent's own


def test_step_timer_stall_fraction_and_steps() -> None:
    t = StepTimer()
    t.start(now_ns=0)
    t.batch(wait_ns=10, samples=4, now_ns=10)  # waited 10 of 10
    t.batch(wait_ns=30, samples=4, now_ns=100)  # computed 60, waited 30
    t.batch(wait_ns=0, samples=2, now_ns=200)
    assert t.batches == 3 and t.samples == 10
    assert t.wall_ns == 200 and t.wait_ns == 40
    assert t.stall_fraction == pytest.approx(0.2)
    assert t.step.count == 2
    assert t.step_mean_s == pytest.approx(95e-9)
    assert t.step_std_s == pytest.approx(5e-9)
    t.start(now_ns=1000)  # a new iteration: the gap before it is no step
    t.batch(wait_ns=5, samples=1, now_ns=1005)
    assert t.step.count == 2 and t.wall_ns == 205
