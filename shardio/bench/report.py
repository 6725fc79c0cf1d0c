"""The result of ``shardio bench``: one BenchRun per runner, its checks, and their text form.

Torch-free: the timed loop (:mod:`shardio.bench.loop`) fills a :class:`BenchRun`; this
module derives the figures a storage benchmark reports (accelerator utilisation, throughput,
read-latency percentiles, step-time spread, stall fraction over time) and checks them against
the thresholds MLPerf Storage and operators use:

* storage read latency P99 under 100 ms (an alert from 50 ms on);
* step-time standard deviation under 5% of the mean;
* accelerator utilisation (AU: emulated compute time / wall time) of at least 90%, the share
  at which MLPerf Storage counts a ResNet-50 run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from shardio.metrics.histogram import LatencyHistogram, LatencySummary

if TYPE_CHECKING:
    from shardio.order.quality import QualityReport

__all__ = [
    "AU_MIN",
    "READ_P99_ALERT_S",
    "READ_P99_FAIL_S",
    "STEP_CV_MAX",
    "BenchRun",
    "Check",
    "StepSample",
    "Window",
    "check_run",
    "format_report",
    "report_dict",
    "timeline",
]

READ_P99_FAIL_S = 0.100
READ_P99_ALERT_S = 0.050
STEP_CV_MAX = 0.05
AU_MIN = 0.90
STATUSES = ("PASS", "ALERT", "FAIL")
# Runs shorter than this get ten windows instead of one-second ones (a plot of one point
# says nothing).
_SHORT_RUN_S = 10.0


@dataclass(frozen=True, kw_only=True)
class StepSample:
    """One batch as the timed loop saw it.

    Attributes:
        epoch: the epoch it belongs to.
        t_s: when it reached the loop, in seconds of run time (epochs back to back: pauses
            between them, such as dropping the page cache, are left out).
        wait_s: how long the loop waited for it (for an epoch's first batch: since the epoch
            began, worker start-up included).
        compute_s: the emulated compute on it (the sleep, as measured).
        samples: samples in the batch.
        nbytes: payload bytes in the batch.
    """

    epoch: int
    t_s: float
    wait_s: float
    compute_s: float
    samples: int
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Window:
    """The run between ``start_s`` and ``start_s + width_s``.

    Attributes:
        start_s: where the window begins, in seconds of run time.
        width_s: its width (the last window may cover less of the run).
        samples_per_s: samples of the batches that arrived in it, per second.
        bytes_per_s: their payload bytes, per second.
        stall_fraction: the share of the window the loop spent waiting for a batch.
    """

    start_s: float
    width_s: float
    samples_per_s: float
    bytes_per_s: float
    stall_fraction: float

    def to_dict(self) -> dict[str, float]:
        """The window as JSON-ready values."""
        return {
            "start_s": self.start_s,
            "width_s": self.width_s,
            "samples_per_s": self.samples_per_s,
            "bytes_per_s": self.bytes_per_s,
            "stall_fraction": self.stall_fraction,
        }


@dataclass(frozen=True, kw_only=True)
class BenchRun:
    """One runner's timed loop over a dataset.

    Attributes:
        runner: "shardio", "loose" or "webdataset".
        source: what it read (the dataset directory or the loose tree).
        mode: "map" (random order) or "stream".
        workers: DataLoader worker processes.
        batch_size: samples per batch.
        epochs: epochs run.
        compute_ms: the emulated compute per step that was asked for.
        samples: samples delivered to the loop.
        batches: batches delivered.
        bytes_read: payload bytes delivered.
        wall_s: wall time of the epochs (each from its start to the end of its last compute).
        compute_s: emulated compute, as measured.
        wait_s: time the loop waited for batches (first batches included).
        first_wait_s: per epoch, the wait for its first batch (worker start-up included).
        steps: steps timed for the step time (every batch but each epoch's first).
        step_mean_s: mean step time: compute on a batch and the wait for the next one.
        step_std_s: its standard deviation.
        read_latency: storage read latency (per file or member read), or None where the
            runner cannot time its reads (webdataset).
        read_histogram: those latencies as a histogram (for the plot), or None.
        files_opened: files the run opened, where known.
        series: every batch as the loop saw it (for the time series).
        notes: what the reader should know about the run (cold cache, start-up).
        order_quality: the shuffle quality of the order read, per epoch measured (the
            first few; shardio's runner only).
    """

    runner: str
    source: str
    mode: str
    workers: int
    batch_size: int
    epochs: int
    compute_ms: float
    samples: int
    batches: int
    bytes_read: int
    wall_s: float
    compute_s: float
    wait_s: float
    first_wait_s: tuple[float, ...]
    steps: int
    step_mean_s: float
    step_std_s: float
    read_latency: LatencySummary | None
    read_histogram: LatencyHistogram | None = field(default=None, repr=False, compare=False)
    files_opened: int | None = None
    series: tuple[StepSample, ...] = field(default=(), repr=False)
    notes: tuple[str, ...] = ()
    order_quality: tuple[QualityReport, ...] = ()

    @property
    def au(self) -> float:
        """Accelerator utilisation: emulated compute time over wall time (0.0 to 1.0)."""
        return min(1.0, self.compute_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def au_steady(self) -> float:
        """AU without the waits for each epoch's first batch (worker start-up)."""
        steady = self.wall_s - sum(self.first_wait_s)
        return min(1.0, self.compute_s / steady) if steady > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        """Samples per second of wall time."""
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Payload bytes per second of wall time."""
        return self.bytes_read / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def stall_fraction(self) -> float:
        """The share of the wall time the loop waited for data."""
        return min(1.0, self.wait_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def step_cv(self) -> float:
        """Step-time standard deviation as a fraction of the mean (0.0 without steps)."""
        return self.step_std_s / self.step_mean_s if self.step_mean_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The run as JSON-ready values (the time series as per-window figures)."""
        return {
            "runner": self.runner,
            "source": self.source,
            "mode": self.mode,
            "workers": self.workers,
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "compute_ms": self.compute_ms,
            "samples": self.samples,
            "batches": self.batches,
            "bytes_read": self.bytes_read,
            "wall_s": self.wall_s,
            "compute_s": self.compute_s,
            "wait_s": self.wait_s,
            "au": self.au,
            "au_steady": self.au_steady,
            "samples_per_s": self.samples_per_s,
            "bytes_per_s": self.bytes_per_s,
            "mb_per_s": self.bytes_per_s / 1e6,
            "stall_fraction": self.stall_fraction,
            "first_wait_s": list(self.first_wait_s),
            "steps": self.steps,
            "step_mean_s": self.step_mean_s,
            "step_std_s": self.step_std_s,
            "step_cv": self.step_cv,
            "read_latency": self.read_latency.to_dict() if self.read_latency else None,
            "files_opened": self.files_opened,
            "timeline": [w.to_dict() for w in timeline(self)],
            "notes": list(self.notes),
            "order_quality": [q.to_dict() for q in self.order_quality],
        }


class Check(NamedTuple):
    """One threshold check of one run.

    Attributes:
        name: "read_latency_p99", "step_time_std" or "au".
        status: "PASS", "ALERT" (passes, but close to the limit) or "FAIL".
        text: what was measured against what limit, in words.
    """

    name: str
    status: str
    text: str


def check_run(run: BenchRun) -> list[Check]:
    """The checks of one run: read latency P99 (where timed), step-time spread, AU."""
    out: list[Check] = []
    lat = run.read_latency
    if lat is not None and lat.count:
        p99 = lat.p99_s
        if p99 >= READ_P99_FAIL_S:
            status = "FAIL"
        elif p99 >= READ_P99_ALERT_S:
            status = "ALERT"
        else:
            status = "PASS"
        limit = f"limit {_ms(READ_P99_FAIL_S)}, alert from {_ms(READ_P99_ALERT_S)}"
        out.append(Check("read_latency_p99", status, f"read latency P99 {_ms(p99)} ({limit})"))
    if run.steps < 2:
        out.append(
            Check(
                "step_time_std",
                "FAIL",
                f"step time: {run.steps} step(s) after the first of each epoch, too few to "
                "judge (more samples or a smaller batch)",
            )
        )
    else:
        status = "PASS" if run.step_cv < STEP_CV_MAX else "FAIL"
        out.append(
            Check(
                "step_time_std",
                status,
                f"step time std {_ms(run.step_std_s)} = {run.step_cv:.1%} of the mean "
                f"{_ms(run.step_mean_s)} (limit {STEP_CV_MAX:.0%})",
            )
        )
    status = "PASS" if run.au >= AU_MIN else "FAIL"
    out.append(
        Check(
            "au",
            status,
            f"AU {run.au:.1%} (MLPerf Storage counts a ResNet-50 run from {AU_MIN:.0%})",
        )
    )
    return out


def timeline(run: BenchRun, width_s: float | None = None) -> list[Window]:
    """The run in windows of ``width_s`` seconds (default: one second; a tenth of a run
    shorter than ten seconds): throughput and stall fraction in each."""
    if run.wall_s <= 0 or not run.series:
        return []
    if width_s is None:
        width_s = 1.0 if run.wall_s >= _SHORT_RUN_S else run.wall_s / 10
    n = max(1, int(-(-run.wall_s // width_s)))
    samples = [0] * n
    nbytes = [0] * n
    waited = [0.0] * n
    for step in run.series:
        k = min(n - 1, int(step.t_s // width_s))
        samples[k] += step.samples
        nbytes[k] += step.nbytes
        # The wait [t - wait, t] may span several windows: give each its share.
        lo, hi = step.t_s - step.wait_s, step.t_s
        first = max(0, int(lo // width_s))
        for j in range(first, min(n - 1, int(hi // width_s)) + 1):
            overlap = min(hi, (j + 1) * width_s) - max(lo, j * width_s)
            if overlap > 0:
                waited[j] += overlap
    out = []
    for k in range(n):
        start = k * width_s
        covered = min(width_s, run.wall_s - start)
        if covered <= 0:
            break
        out.append(
            Window(
                start_s=start,
                width_s=width_s,
                samples_per_s=samples[k] / covered,
                bytes_per_s=nbytes[k] / covered,
                stall_fraction=min(1.0, waited[k] / covered),
            )
        )
    return out


def report_dict(runs: Sequence[BenchRun], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The whole bench as one JSON-ready object: settings, runs, checks (per runner)."""
    return {
        "settings": dict(settings),
        "runs": [run.to_dict() for run in runs],
        "checks": [
            {"runner": run.runner, **check._asdict()} for run in runs for check in check_run(run)
        ],
    }


def format_report(runs: Sequence[BenchRun], settings: Mapping[str, Any]) -> str:
    """The bench as text: the settings, a block per run, a comparison, then the checks."""
    lines = [_settings_line(settings)]
    for run in runs:
        lines.append("")
        lines.extend(_run_lines(run))
    if len(runs) > 1:
        lines.append("")
        lines.extend(_comparison_lines(runs))
        if not settings.get("cold"):
            lines.append(
                "  (warm page cache: a runner may read what an earlier one left in memory; "
                "--cold empties it before each epoch)"
            )
    lines.append("")
    lines.append("checks")
    for run in runs:
        for check in check_run(run):
            lines.append(f"  {check.status:<5}  {run.runner:<10}  {check.text}")
    return "\n".join(lines)


def _settings_line(settings: Mapping[str, Any]) -> str:
    epochs = settings.get("epochs", 1)
    workers = settings.get("workers", "?")
    cache = "cold page cache" if settings.get("cold") else "warm page cache"
    return (
        f"bench {settings.get('dataset', '?')}: {settings.get('mode', '?')} mode, batch "
        f"{settings.get('batch_size', '?')}, {workers} worker{'s' if workers != 1 else ''}, "
        f"compute {float(settings.get('compute_ms', 0.0)):.1f} ms per step, {epochs} "
        f"epoch{'s' if epochs != 1 else ''}, {cache}"
    )


def _run_lines(run: BenchRun) -> list[str]:
    lat = run.read_latency
    if lat is None:
        read = f"n/a ({run.runner} does not time its reads)"
    elif not lat.count:
        read = "no reads timed"
    else:
        read = (
            f"P50 {_ms(lat.p50_s)}, P95 {_ms(lat.p95_s)}, P99 {_ms(lat.p99_s)}, max "
            f"{_ms(lat.max_s)} ({lat.count:,} reads)"
        )
    firsts = ", ".join(f"{w:.2f} s" for w in run.first_wait_s) or "none"
    lines = [
        f"{run.runner}: {run.source}",
        f"  samples       {run.samples:,} in {run.batches:,} batches, {run.wall_s:.2f} s: "
        f"{run.samples_per_s:,.1f} samples/s, {run.bytes_per_s / 1e6:,.2f} MB/s",
        f"  AU            {run.au:.1%} (compute {run.compute_s:.2f} s of {run.wall_s:.2f} s; "
        f"{run.au_steady:.1%} without the first batch of each epoch)",
        f"  stall         {run.stall_fraction:.1%} of the wall time waiting for batches",
        f"  read latency  {read}",
        f"  step time     {_ms(run.step_mean_s)} ± {_ms(run.step_std_s)} over {run.steps:,} "
        "steps (the first step of each epoch is left out: its wait includes worker start-up)",
        f"  first batch   after {firsts} (per epoch)",
    ]
    if run.files_opened is not None:
        lines.append(f"  files opened  {run.files_opened:,}")
    for quality in run.order_quality:
        lines.append(f"  order         {quality.line()}")
    if run.order_quality:
        lines.append(f"                ({run.order_quality[0].order}; shardio inspect "
                     "--order SPEC measures another)")  # fmt: skip
    lines.extend(f"  note          {note}" for note in run.notes)
    return lines


def _comparison_lines(runs: Sequence[BenchRun]) -> list[str]:
    base = runs[0]
    lines = [f"compared with {base.runner}"]
    for other in runs[1:]:
        ratio = base.samples_per_s / other.samples_per_s if other.samples_per_s > 0 else 0.0
        parts = [
            f"{base.runner} {ratio:.2f}x the samples/s of {other.runner}",
            f"AU {base.au:.1%} vs {other.au:.1%}",
            f"stall {base.stall_fraction:.1%} vs {other.stall_fraction:.1%}",
        ]
        if base.read_latency is not None and other.read_latency is not None:
            parts.append(
                f"read P99 {_ms(base.read_latency.p99_s)} vs {_ms(other.read_latency.p99_s)}"
            )
        if base.files_opened is not None and other.files_opened is not None:
            parts.append(f"files opened {base.files_opened:,} vs {other.files_opened:,}")
        lines.append("  " + "; ".join(parts))
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 0.001 else f"{seconds * 1e6:.0f} µs"
