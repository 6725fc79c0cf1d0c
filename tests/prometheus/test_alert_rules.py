"""The shipped alert rules and Grafana dashboard: promtool checks and unit-tests the rules
(each alert fires on a bad series, stays quiet on a healthy one, and a rule with a moved
threshold fails those tests), and every expression names only metrics the exporter emits."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardio.metrics import alerts_path, dashboard_path

HERE = Path(__file__).resolve().parent
ALERT_TESTS = HERE / "alerts_test.yml"
_NAME = re.compile(r"\bshardio_[a-zA-Z0-9_]+")
PROMTOOL_TIMEOUT_S = 120


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(alerts_path().read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _promtool(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
        check=False,
    )


def _tests_against(rules: Path, where: Path) -> Path:
    """alerts_test.yml with its rule_files pointing at ``rules``, written under ``where``."""
    doc = yaml.safe_load(ALERT_TESTS.read_text())
    doc["rule_files"] = [str(rules)]
    out = where / "alerts_test.yml"
    out.write_text(json.dumps(doc, indent=1))
    return out


def test_promtool_checks_the_shipped_rules(promtool: str) -> None:
    result = _promtool(promtool, "check", "rules", alerts_path())
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout, result.stdout


def test_every_alert_fires_on_bad_series_and_only_there(promtool: str, tmp_path: Path) -> None:
    result = _promtool(promtool, "test", "rules", _tests_against(alerts_path(), tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout
    # Every shipped alert is tested both ways: once expected firing, once expected quiet.
    doc = yaml.safe_load(ALERT_TESTS.read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in _rules()}
    assert firing == names, f"alerts never tested firing: {sorted(names - firing)}"
    assert quiet == names, f"alerts never tested quiet: {sorted(names - quiet)}"


# A moved threshold, a shorter `for`, a dropped condition: each must break the unit tests.
STALLS = "rate(shardio_wait_seconds_sum[10m]) > "
MUTATIONS = [
    ("warning P99 at 80 ms", ") > 0.05\n", ") > 0.08\n"),
    ("warning P99 at 20 ms", ") > 0.05\n", ") > 0.02\n"),
    ("critical P99 at 200 ms", ") > 0.1\n", ") > 0.2\n"),
    ("P99 alert without its 5 minutes", "for: 5m\n", "for: 1m\n"),
    ("step spread at 15%", "> 0.05\n            and", "> 0.15\n            and"),
    ("stalls at 30%", f"{STALLS}0.1", f"{STALLS}0.3"),
    ("stalls at 1%", f"{STALLS}0.1", f"{STALLS}0.01"),
    ("substitutes over 5", "substitutes_total[15m]) > 0", "substitutes_total[15m]) > 5"),
    (
        "checksum failures ignored",
        "checksum_failures_total[15m]) > 0",
        "checksum_failures_total[15m]) > 9",
    ),
    ("rebuilds ignored", "or increase(shardio_rebuilds_total[15m]) > 0\n            ", ""),
    ("unavailable over 1", "unavailable_total[15m]) > 0", "unavailable_total[15m]) > 1"),
]


@pytest.mark.parametrize(("what", "old", "new"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_rule_with_a_moved_threshold_fails_the_unit_tests(
    promtool: str, tmp_path: Path, what: str, old: str, new: str
) -> None:
    text = alerts_path().read_text()
    assert text.count(old) >= 1, f"{what}: {old!r} is not in the rules"
    mutated = tmp_path / "mutated.yml"
    mutated.write_text(text.replace(old, new, 1))
    assert _promtool(promtool, "check", "rules", mutated).returncode == 0  # still valid rules
    result = _promtool(promtool, "test", "rules", _tests_against(mutated, tmp_path))
    assert result.returncode != 0, f"{what}: the unit tests still pass\n{result.stdout}"
    assert "FAILED" in result.stdout + result.stderr


def test_the_rules_name_only_exported_metrics(exporter_names: set[str]) -> None:
    for rule in _rules():
        used = set(_NAME.findall(rule["expr"]))
        assert used, f"{rule['alert']} reads no shardio metric"
        assert used <= exporter_names, f"{rule['alert']}: {sorted(used - exporter_names)}"
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_the_dashboard_is_grafana_json_over_exported_metrics(
    exporter_names: set[str], dashboard_queries: list[tuple[str, str]]
) -> None:
    doc = json.loads(dashboard_path().read_text())
    assert doc["uid"] and doc["title"] and isinstance(doc["schemaVersion"], int)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "job", "instance", "rank"} <= variables
    exprs = dashboard_queries
    assert exprs and all(p.get("targets") for p in doc["panels"])
    for title, expr in exprs:
        used = set(_NAME.findall(expr))
        assert used, f"panel {title!r} reads no shardio metric: {expr}"
        assert used <= exporter_names, f"panel {title!r}: {sorted(used - exporter_names)}"
        for var in re.findall(r"\$(\w+)", expr):
            assert var in variables or var == "__rate_interval", f"{title!r}: ${var}"
    # The panels the article's monitoring asks for.
    read = " ".join(expr for _, expr in exprs)
    for needed in (
        "rate(shardio_samples_delivered_total",  # throughput
        "histogram_quantile(0.5, sum by (source, le) (rate(shardio_read_latency_seconds_bucket",
        "histogram_quantile(0.99, sum by (source, le) (rate(shardio_read_latency_seconds_bucket",
        "shardio_stall_fraction",
        "shardio_step_mean_seconds",
        "shardio_step_std_seconds",
        "shardio_substitutes_total",
        "shardio_checksum_failures_total",
    ):
        assert needed in read, needed


def test_the_names_come_from_the_exporter(exporter_names: set[str]) -> None:
    from shardio.metrics.read import COUNTERS

    # The derived list is the exporter's: every read counter, the histograms' parts.
    assert {f"shardio_{name}_total" for name in COUNTERS} <= exporter_names
    assert {
        "shardio_read_latency_seconds_bucket",
        "shardio_read_latency_seconds_sum",
        "shardio_read_latency_seconds_count",
        "shardio_stall_fraction",
    } <= exporter_names
    assert "shardio_read_latency_seconds" not in exporter_names  # only its parts are series
