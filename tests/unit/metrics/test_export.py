"""LogReporter, JsonlWriter, their shared thread, and MetricsSnapshot.from_dict."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardio.errors import UsageError
from shardio.metrics import JsonlWriter, LogReporter, MetricsSnapshot
from shardio.metrics.export import PeriodicReporter

LOGGER = "tests.shardio.metrics"


def metrics_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shardio-metrics-")]


class Counting:
    """Wraps a source; sets ``reached`` once it was called ``n`` times."""

    def __init__(self, source: Callable[[], MetricsSnapshot], n: int) -> None:
        self.source = source
        self.n = n
        self.calls = 0
        self.reached = threading.Event()

    def __call__(self) -> MetricsSnapshot:
        self.calls += 1
        if self.calls >= self.n:
            self.reached.set()
        return self.source()


# -- MetricsSnapshot.from_dict -------------------------------------------------------------


def test_snapshot_round_trips_through_json(make_rank: Any) -> None:
    snap = make_rank(1, scale=2)()
    data = json.loads(json.dumps(snap.to_dict()))
    back = MetricsSnapshot.from_dict(data)
    assert back.to_dict() == snap.to_dict()
    assert back.rank == 1 and back.samples == 12 and back.counters["cache_hits"] == 8
    assert set(back.histograms) == {"read_staged", "read_source", "wait", "step"}
    for name, hist in snap.histograms.items():
        assert back.histograms[name].to_wire() == hist.to_wire()
    assert back.histograms["read_staged"].count == 8
    assert back.read_latency["all"] == snap.read_latency["all"]


def test_to_dict_keeps_its_keys_and_adds_histograms(make_rank: Any) -> None:
    data = make_rank(0)().to_dict()
    assert data["version"] == 1
    assert data["read_latency"]["staged"]["count"] == 4
    assert data["histograms"]["step"][1] == 300_000_000  # sum_ns of the 100 + 200 ms steps


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("samples"), "missing key 'samples'"),
        (lambda d: d.update(version=2), "unsupported version 2"),
        (lambda d: d.update(samples=True), "samples must be an integer"),
        (lambda d: d.update(batches=-1), "batches must be >= 0"),
        (lambda d: d.update(time_s="now"), "time_s must be a number"),
        (lambda d: d["counters"].update(retries=1.5), "retries must be an integer"),
        (lambda d: d.update(histograms={"wait": [[[999, 1]], 0, 0, 0]}), "malformed"),
        (lambda d: d.update(histograms={"wait": "x"}), "malformed histogram"),
        (lambda d: d.update(wait_latency=[]), "latency summary must be a mapping"),
    ],
)
def test_from_dict_refuses_malformed_data(
    make_rank: Any, change: Callable[[dict[str, Any]], Any], message: str
) -> None:
    data = json.loads(json.dumps(make_rank(0)().to_dict()))
    change(data)
    with pytest.raises(UsageError, match=message):
        MetricsSnapshot.from_dict(data)


def test_from_dict_without_histograms_and_with_extra_keys(make_rank: Any) -> None:
    data = make_rank(0)().to_dict()
    del data["histograms"]
    data["job"] = "vit"
    back = MetricsSnapshot.from_dict(data)
    assert back.histograms == {} and back.samples == 12


# -- the shared thread ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "interval_s", [0, -1.0, math.nan, math.inf, "1", True, None, 86400.5, 1e12, 1e308, 10**400]
)
def test_interval_must_be_positive(make_rank: Any, interval_s: Any) -> None:
    with pytest.raises(UsageError, match="interval_s"):
        LogReporter(make_rank(0), interval_s=interval_s)
    with pytest.raises(UsageError, match="interval_s"):
        JsonlWriter(make_rank(0), "unused.jsonl", interval_s=interval_s)


def test_source_must_be_callable() -> None:
    with pytest.raises(UsageError, match="callable"):
        LogReporter(42)  # type: ignore[arg-type]


def test_nothing_starts_before_start_and_all_is_joined_by_close(
    make_rank: Any, tmp_path: Path
) -> None:
    source = Counting(make_rank(0), n=3)
    writer = JsonlWriter(source, tmp_path / "m.jsonl", interval_s=0.01)
    assert metrics_threads() == [] and not (tmp_path / "m.jsonl").exists()
    with pytest.raises(UsageError, match="not running"):
        writer.report()
    with writer:
        assert metrics_threads() == ["shardio-metrics-jsonl"]
        assert source.reached.wait(30), "the thread never reported"
    assert metrics_threads() == []
    writer.close()  # again: nothing
    with pytest.raises(UsageError, match="closed"):
        writer.start()


def test_a_failing_source_is_logged_once_and_reporting_goes_on(
    make_rank: Any, caplog: pytest.LogCaptureFixture
) -> None:
    good = make_rank(0)
    state = {"calls": 0}
    recovered = threading.Event()

    def flaky() -> MetricsSnapshot:
        state["calls"] += 1
        if state["calls"] <= 5:
            raise RuntimeError("source broke")
        recovered.set()
        return good()

    caplog.set_level(logging.DEBUG)
    reporter = LogReporter(flaky, interval_s=0.01, logger=logging.getLogger(LOGGER)).start()
    try:
        assert recovered.wait(30)
        assert reporter.running
    finally:
        reporter.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "source broke" in warnings[0].getMessage()
    assert warnings[0].name == "shardio.metrics.export"
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert lines and "rank 0/2" in lines[-1].getMessage()


def test_a_failing_sink_is_logged_once_per_distinct_error(
    make_rank: Any, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(PeriodicReporter):
        kind = "broken"

        def __init__(self) -> None:
            super().__init__(make_rank(0), interval_s=0.01)
            self.emits = 0
            self.done = threading.Event()

        def emit(self, snap: MetricsSnapshot) -> None:
            self.emits += 1
            if self.emits >= 6:
                self.done.set()
            raise OSError(f"sink broke {self.emits % 2}")

    caplog.set_level(logging.WARNING)
    with Broken() as reporter:
        assert reporter.done.wait(30)
        assert reporter.report() is False
    messages = sorted(r.getMessage() for r in caplog.records)
    assert len(messages) == 2, messages
    assert "sink broke 0" in messages[0] and "sink broke 1" in messages[1]
    assert metrics_threads() == []


def test_close_does_not_wait_on_a_stalled_sink(
    make_rank: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sink that hangs (a stalled network filesystem) must not hang the end of training."""
    from shardio.metrics import export

    monkeypatch.setattr(export, "CLOSE_TIMEOUT_S", 0.2)

    class Stalled(PeriodicReporter):
        kind = "stalled"

        def __init__(self) -> None:
            super().__init__(make_rank(0), interval_s=0.01)
            self.inside = threading.Event()
            self.release_sink = threading.Event()

        def emit(self, snap: MetricsSnapshot) -> None:
            self.inside.set()
            self.release_sink.wait(60)

    caplog.set_level(logging.WARNING)
    reporter = Stalled().start()
    try:
        assert reporter.inside.wait(30)
        closer = threading.Thread(target=reporter.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() waited on the stalled sink"
        assert any("did not return within 0.2 s" in r.getMessage() for r in caplog.records)
    finally:
        reporter.release_sink.set()
    for thread in threading.enumerate():
        if thread.name == "shardio-metrics-stalled":
            thread.join(30)
    assert metrics_threads() == []


# -- LogReporter ---------------------------------------------------------------------------


def test_log_reporter_logs_the_line(make_rank: Any, caplog: pytest.LogCaptureFixture) -> None:
    source = make_rank(0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with LogReporter(source, interval_s=3600, logger=logging.getLogger(LOGGER)) as reporter:
        assert metrics_threads() == ["shardio-metrics-log"]
        assert reporter.report()
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 2  # report() and the final one of close()
    expected = source().line()
    assert all(r.levelno == logging.INFO and r.getMessage() == expected for r in records)
    assert "rank 0/2" in expected and "checksum failures 1" in expected
    assert metrics_threads() == []


def test_log_reporter_level(make_rank: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reporter = LogReporter(
        make_rank(0), interval_s=3600, logger=logging.getLogger(LOGGER), level=logging.WARNING
    )
    reporter.start().close()
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [logging.WARNING]
    with pytest.raises(UsageError, match="level"):
        LogReporter(make_rank(0), level="INFO")  # type: ignore[arg-type]


# -- JsonlWriter ---------------------------------------------------------------------------


def test_jsonl_lines_parse_and_close_writes_the_last(make_rank: Any, tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"earlier": "run"}\n')
    source = make_rank(1)
    counting = Counting(source, n=3)
    with JsonlWriter(counting, path, interval_s=0.01, job="vit") as writer:
        assert counting.reached.wait(30)
        assert writer.report()
        # A change after the last interval must reach the file through close().
        source.read.add("retries", 40)
    lines = path.read_text().splitlines()
    assert lines[0] == '{"earlier": "run"}'  # appended to, never truncated
    records = [json.loads(line) for line in lines[1:]]
    assert len(records) >= 4
    assert all(r["job"] == "vit" and r["rank"] == 1 and r["samples"] == 12 for r in records)
    assert records[0]["counters"]["retries"] == 2
    last = MetricsSnapshot.from_dict(records[-1])
    assert last.counters["retries"] == 42
    assert last.histograms["read_source"].count == 2
    assert metrics_threads() == []


def test_jsonl_refuses_a_symlink_leaves_its_target_and_training_goes_on(
    make_rank: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(target)
    caplog.set_level(logging.WARNING, logger="shardio.metrics.export")
    rank = make_rank(0)
    with JsonlWriter(rank, link, interval_s=3600) as writer:  # the with line does not raise
        assert not writer.report()  # each report tries again, and is refused again
    assert rank.calls >= 2
    assert target.read_text() == "keep me\n" and link.is_symlink()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"{link} is a symlink" in warned[0], warned
    assert metrics_threads() == []


def test_jsonl_refuses_a_fifo_and_a_directory_without_stopping_training(
    make_rank: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    caplog.set_level(logging.WARNING, logger="shardio.metrics.export")
    for path, kind in ((fifo, "FIFO"), (folder, "directory")):
        caplog.clear()
        with JsonlWriter(make_rank(0), path, interval_s=3600):
            pass
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and f"{path} is a {kind}" in warned[0], warned
    assert list(folder.iterdir()) == []
    assert metrics_threads() == []


def test_jsonl_that_cannot_be_opened_at_start_is_written_once_it_can(
    make_rank: Any, tmp_path: Path
) -> None:
    """A log directory not there (or not writable) at start: training goes on, and the lines
    come once it can be written (the close's last one here)."""
    folder = tmp_path / "later"
    path = folder / "metrics.jsonl"
    with JsonlWriter(make_rank(0), path, interval_s=3600, job="j") as writer:
        assert not writer.report()
        folder.mkdir()
        assert writer.report()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2 and all(line["job"] == "j" for line in lines)


@pytest.mark.parametrize("path", [b"m.jsonl", "", "a\0b", 3])
def test_jsonl_path_must_be_a_str_path(make_rank: Any, path: Any) -> None:
    with pytest.raises(UsageError, match="JsonlWriter path"):
        JsonlWriter(make_rank(0), path)
