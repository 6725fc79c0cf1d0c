"""Metrics of the data path: counters, latency histograms, snapshots and their exporters.

Torch-free. The read path counts into :class:`ReadMetrics`; the training side times steps
and waits in :class:`StepTimer`; ``loader.metrics()`` returns a :class:`MetricsSnapshot`,
which :class:`LogReporter`, :class:`JsonlWriter` and :class:`PrometheusExporter` report
every interval from a thread of their own. :func:`alerts_path` and :func:`dashboard_path`
name the Prometheus alert rules and the Grafana dashboard shipped with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardio._lazy import lazy_face

if TYPE_CHECKING:
    from shardio.metrics.bundled import alerts_path, dashboard_path
    from shardio.metrics.export import JsonlWriter, LogReporter
    from shardio.metrics.histogram import LatencyHistogram, LatencySummary
    from shardio.metrics.prometheus import PrometheusExporter
    from shardio.metrics.read import ReadDelta, ReadMetrics
    from shardio.metrics.snapshots import MetricsSnapshot, combine, snapshot
    from shardio.metrics.steps import StepTimer

__all__ = [
    "JsonlWriter",
    "LatencyHistogram",
    "LatencySummary",
    "LogReporter",
    "MetricsSnapshot",
    "PrometheusExporter",
    "ReadDelta",
    "ReadMetrics",
    "StepTimer",
    "alerts_path",
    "combine",
    "dashboard_path",
    "snapshot",
]

_LAZY = {
    "JsonlWriter": "shardio.metrics.export",
    "LogReporter": "shardio.metrics.export",
    "LatencyHistogram": "shardio.metrics.histogram",
    "LatencySummary": "shardio.metrics.histogram",
    "PrometheusExporter": "shardio.metrics.prometheus",
    "ReadDelta": "shardio.metrics.read",
    "ReadMetrics": "shardio.metrics.read",
    "MetricsSnapshot": "shardio.metrics.snapshots",
    "combine": "shardio.metrics.snapshots",
    "snapshot": "shardio.metrics.snapshots",
    "StepTimer": "shardio.metrics.steps",
    "alerts_path": "shardio.metrics.bundled",
    "dashboard_path": "shardio.metrics.bundled",
}

__getattr__, __dir__ = lazy_face(__name__, _LAZY)
