"""Metrics snapshots as Prometheus metric families: their names, labels and buckets.

Metric names, all ``shardio_*`` with labels ``rank`` and ``job``:

- counters: ``shardio_samples_delivered_total``, ``shardio_batches_delivered_total``,
  ``shardio_samples_read_total``, ``shardio_bytes_read_total{source=staged|source}``,
  ``shardio_mix_samples_delivered_total{dataset=NAME}`` (the mix drawn, for a ``MixedDataset``),
  and every read counter (:data:`shardio.metrics.read.COUNTERS`) as ``shardio_<name>_total``;
- gauges: ``shardio_samples_per_second``, ``shardio_bytes_per_second``,
  ``shardio_stall_fraction``, ``shardio_step_mean_seconds``, ``shardio_step_std_seconds``,
  ``shardio_snapshot_timestamp_seconds``;
- histograms: ``shardio_read_latency_seconds{source=staged|source}`` (member reads),
  ``shardio_wait_seconds`` (the loop's wait per batch), ``shardio_step_seconds``.

Histogram buckets are 100 µs ... 10 s in 1-2.5-5 steps, each an edge of
:class:`~shardio.metrics.histogram.LatencyHistogram`, so their counts are exact.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from shardio.errors import MissingExtraError
from shardio.metrics.snapshots import MetricsSnapshot

__all__ = [
    "ALERT_COUNTERS",
    "BUCKETS_S",
    "Alerting",
    "alerting_counts",
    "load_client",
    "metric_families",
]

# Prometheus `le` bounds in seconds; every one is a LatencyHistogram bucket edge.
BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_METRIC_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_LABELS = ("rank", "job")
# The read counters the shipped alert rules watch (any increase alerts): a run that counted
# one of them serves its final figures after close until they were scraped (see linger_s).
ALERT_COUNTERS = (
    "checksum_failures",
    "read_errors",
    "stalls",
    "held_fails",
    "restages",
    "rebuilds",
    "drops",
    "restage_failures",
    "drop_failures",
    "substitutes",
    "unavailable",
    "worker_restarts",
    "epochs_not_exact",  # the exactly-once audit (ShardLoader's counters)
)


def load_client() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.utils
    except ImportError as exc:
        raise MissingExtraError("PrometheusExporter needs prometheus_client", "metrics") from exc
    return prometheus_client


def metric_families(labelled: Sequence[tuple[MetricsSnapshot, str]]) -> list[Any]:
    """The Prometheus metric families of snapshots, each labelled by its rank and a job.

    Args:
        labelled: (snapshot, job name) pairs; their (job, rank) pairs must be distinct.

    Returns:
        ``prometheus_client`` metric families (see the module docstring for the names).

    Raises:
        UsageError: prometheus_client is not installed.
    """
    client = load_client()
    core = client.core
    floats = client.utils.floatToGoString

    def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Any:
        return core.CounterMetricFamily(name, doc, labels=[*_LABELS, *extra])

    def gauge(name: str, doc: str) -> Any:
        return core.GaugeMetricFamily(name, doc, labels=list(_LABELS))

    def histogram(name: str, doc: str, extra: Sequence[str] = ()) -> Any:
        return core.HistogramMetricFamily(name, doc, labels=[*_LABELS, *extra])

    delivered = counter("shardio_samples_delivered", "Samples delivered to the training loop.")
    batches = counter("shardio_batches_delivered", "Batches delivered to the training loop.")
    read = counter("shardio_samples_read", "Samples read by the rank's workers.")
    nbytes = counter("shardio_bytes_read", "Payload bytes read, by source.", ["source"])
    mixed = counter(
        "shardio_mix_samples_delivered",
        "Samples delivered per source of a mix (MixedDataset), by its name.",
        ["dataset"],
    )
    gauges = {
        "samples_per_s": gauge("shardio_samples_per_second", "Samples delivered per second."),
        "bytes_per_s": gauge("shardio_bytes_per_second", "Payload bytes read per second."),
        "stall_fraction": gauge(
            "shardio_stall_fraction", "Share of the time the loop waited for data."
        ),
        "step_mean_s": gauge("shardio_step_mean_seconds", "Mean training step time."),
        "step_std_s": gauge("shardio_step_std_seconds", "Standard deviation of the step time."),
        "time_s": gauge("shardio_snapshot_timestamp_seconds", "When the figures were taken."),
    }
    read_latency = histogram(
        "shardio_read_latency_seconds", "Latency of member reads, by source.", ["source"]
    )
    wait = histogram("shardio_wait_seconds", "Time the training loop waited for each batch.")
    step = histogram("shardio_step_seconds", "Training step time (compute plus wait).")
    fixed = [delivered, batches, read, nbytes, mixed, *gauges.values(), read_latency, wait, step]
    taken = {family.name for family in fixed}
    counters: dict[str, Any] = {}

    for snap, job in labelled:
        labels = [str(snap.rank), _label_value(job)]
        delivered.add_metric(labels, snap.samples)
        batches.add_metric(labels, snap.batches)
        read.add_metric(labels, snap.samples_read)
        nbytes.add_metric([*labels, "staged"], snap.bytes_staged)
        nbytes.add_metric([*labels, "source"], snap.bytes_source)
        for name, count in sorted(snap.sources.items()):
            mixed.add_metric([*labels, _label_value(name)], count)
        for field, family in gauges.items():
            family.add_metric(labels, getattr(snap, field))
        for name, value in sorted(snap.counters.items()):
            # CounterMetricFamily drops a "_total" suffix: drop it first to see clashes.
            metric = f"shardio_{name.removesuffix('_total')}"
            if metric in taken or not _METRIC_NAME.match(metric):
                continue  # a name from a foreign spool file must not break the scrape
            if metric not in counters:
                counters[metric] = counter(metric, f"Read counter {name!r} (see ReadMetrics).")
            counters[metric].add_metric(labels, value)
        for hist_name, family, extra in (
            ("read_staged", read_latency, ["staged"]),
            ("read_source", read_latency, ["source"]),
            ("wait", wait, []),
            ("step", step, []),
        ):
            hist = snap.histograms.get(hist_name)
            if hist is None:
                continue
            total = hist.count
            buckets = [
                (floats(bound), count)
                for bound, count in zip(BUCKETS_S, hist.cumulative(BUCKETS_S), strict=True)
            ]
            buckets.append(("+Inf", total))
            family.add_metric([*labels, *extra], buckets, hist.sum_ns / 1e9)
    return [*fixed[:5], *counters.values(), *fixed[5:]]


def _label_value(value: str) -> str:
    """``value`` as UTF-8 can write it: a lone surrogate (a job name from a non-UTF-8
    environment variable) as ``\\udcff``, so it cannot fail every scrape."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


Alerting = dict[tuple[str, int, str], int]  # (job, rank, counter) -> count


def alerting_counts(labelled: Sequence[tuple[MetricsSnapshot, str]]) -> Alerting:
    """The non-zero :data:`ALERT_COUNTERS` of snapshots, by job, rank and name."""
    return {
        (job, snap.rank, name): count
        for snap, job in labelled
        for name in ALERT_COUNTERS
        if (count := int(snap.counters.get(name, 0)))
    }
