"""Where the Prometheus alert rules and the Grafana dashboard shipped with shardio lie.

Both read the metric names of :class:`~shardio.metrics.PrometheusExporter`:
``shardio-alerts.yml`` (load it with Prometheus's ``rule_files``) holds the read-latency P99
alerts (50 ms, critical at 100 ms, by node and source), the step-time spread (standard
deviation over 5% of the mean), data stalls (over 10% of the time) and any fault, repair or
substitute; ``shardio-grafana.json`` is a dashboard to import into Grafana.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["alerts_path", "dashboard_path"]

_DIR = Path(__file__).resolve().parent / "alerts"


def alerts_path() -> Path:
    """The Prometheus alert rules file (``shardio-alerts.yml``) installed with shardio."""
    return _DIR / "shardio-alerts.yml"


def dashboard_path() -> Path:
    """The Grafana dashboard (``shardio-grafana.json``) installed with shardio."""
    return _DIR / "shardio-grafana.json"
