"""The PNG of ``shardio bench --plot``: throughput and stalls over time, read latency.

matplotlib is an optional extra (``plot``), imported only here and only when a plot
is asked for; it draws through its Agg canvas directly (no pyplot, no display, no global
backend switch).
"""

from __future__ import annotations

import bisect
import io
import os
from collections.abc import Sequence

from shardio.bench.report import READ_P99_ALERT_S, READ_P99_FAIL_S, BenchRun, timeline
from shardio.errors import MissingExtraError
from shardio.metrics.histogram import BUCKET_BOUNDS_NS
from shardio.storage.atomic import atomic_write
from shardio.storage.files import check_replaceable

__all__ = ["check_plot_path", "require_matplotlib", "write_plot"]

_NEEDS = "--plot needs matplotlib"


def require_matplotlib() -> None:
    """Check that matplotlib can be imported (before a long run, not after it).

    Raises:
        MissingExtraError: it cannot (a UsageError).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(_NEEDS, "plot") from exc


def check_plot_path(path: str | os.PathLike[str]) -> None:
    """Check that a plot can be published at ``path``: its directory exists, and nothing but
    a regular file is there (a symlink, FIFO, device or directory is never replaced).

    Raises:
        StorageError: it cannot.
    """
    check_replaceable(os.path.abspath(os.fspath(path)), what="plot file", parent=True)


def write_plot(runs: Sequence[BenchRun], path: str | os.PathLike[str]) -> None:
    """Write one PNG with three panels: samples/s over time per runner, stall fraction over
    time, and the read-latency histogram of each runner that times its reads.

    The file is written to a temporary name (``O_EXCL | O_NOFOLLOW``) and renamed into
    place only over nothing or a regular file, checked again just before the rename: never
    over (or through) a symlink, FIFO, device or directory at ``path``.

    Raises:
        UsageError: matplotlib is not installed.
        StorageError: the file cannot be written, or ``path`` is not a regular file.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingExtraError(_NEEDS, "plot") from exc
    fig = Figure(figsize=(9, 10), layout="constrained")
    FigureCanvasAgg(fig)
    rate, stall, latency = fig.subplots(3, 1)
    for run in runs:
        windows = timeline(run)
        if not windows:
            continue
        edges = [w.start_s for w in windows] + [
            min(run.wall_s, windows[-1].start_s + windows[-1].width_s)
        ]
        rate.stairs([w.samples_per_s for w in windows], edges, label=run.runner)
        stall.stairs([w.stall_fraction for w in windows], edges, label=run.runner)
    rate.set(title="throughput", xlabel="run time (s)", ylabel="samples/s")
    stall.set(
        title="data stall (share of each window spent waiting for a batch)",
        xlabel="run time (s)",
        ylabel="stall fraction",
        ylim=(0.0, 1.05),
    )
    drawn = False
    for run in runs:
        hist = run.read_histogram
        if hist is None or not hist.count:
            continue
        counts, edges_ms = _coarse(hist.counts)
        latency.stairs(counts, edges_ms, label=run.runner)
        drawn = True
    if drawn:
        latency.set_xscale("log")
        latency.axvline(READ_P99_ALERT_S * 1e3, color="orange", linestyle="--", label="alert")
        latency.axvline(READ_P99_FAIL_S * 1e3, color="red", linestyle="--", label="P99 limit")
        latency.legend()
    else:
        latency.text(0.5, 0.5, "no read latency timed", ha="center", transform=latency.transAxes)
    latency.set(title="read latency", xlabel="latency per read (ms)", ylabel="reads per bin")
    for ax in (rate, stall):
        if runs:
            ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    check_plot_path(path)
    with atomic_write(os.fspath(path), durable=False) as fh:
        fh.write(buf.getvalue())
        check_plot_path(path)  # again, just before the rename: what is there now


# Bins of the plot: 1, 2, 5 per decade (nearly even on a log axis; the histogram's own ten
# buckets per decade are not, and would draw a sawtooth).
_COARSE_NS = tuple(
    m * 10**d for d in range(3, 12) for m in (1, 2, 5) if m * 10**d <= BUCKET_BOUNDS_NS[-1]
)


def _coarse(counts: Sequence[int]) -> tuple[list[int], list[float]]:
    """A histogram's counts in 1-2-5 bins over the range it holds: (counts, edges in ms)."""
    binned = [0] * (len(_COARSE_NS) + 1)
    for i, c in enumerate(counts):
        if c:
            upper = BUCKET_BOUNDS_NS[i] if i < len(BUCKET_BOUNDS_NS) else BUCKET_BOUNDS_NS[-1] + 1
            binned[bisect.bisect_left(_COARSE_NS, upper)] += c
    used = [j for j, c in enumerate(binned) if c]
    lo = max(1, used[0])
    hi = max(lo, min(len(_COARSE_NS) - 1, used[-1]))
    # Values of the first bin (up to 1 µs) and past the last edge (100 s) join their
    # neighbours: a log axis has no 0 and no infinity.
    values = binned[lo : hi + 1]
    values[0] += sum(binned[:lo])
    values[-1] += sum(binned[hi + 1 :])
    edges_ms = [b / 1e6 for b in _COARSE_NS[lo - 1 : hi + 1]]
    return values, edges_ms
