"""A real Prometheus scrapes a real training run's exporter, evaluates the shipped rules over
it, and holds exactly what ``loader.metrics()`` says.

The run: a small tree packed with shardio, half of it staged (reads from both sources), one
member corrupted in an unstaged shard (a checksum failure, a retry, a substitute), two ranks
on one node (local rank 0 serves the port, local rank 1 leaves its figures in the spool),
each a ResilientDataset loader with DataLoader workers. The exporters' interval is an hour:
figures that reach Prometheus during the run come from the first report after the first
batches, and the final ones from the explicit ``report()`` at the end.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pytest

from shardio import RecoveryPolicy
from shardio.errors import SampleUnavailableError
from shardio.metrics import MetricsSnapshot, PrometheusExporter, alerts_path
from shardio.metrics.prometheus_families import BUCKETS_S
from shardio.metrics.read import COUNTERS, SOURCES
from shardio.order.ranks import RankInfo
from shardio.packing.run import PackOptions, pack
from shardio.read.reader import ShardReader
from shardio.runtime.dataset import ShardDataset
from shardio.staging.options import StageOptions
from shardio.staging.stage import stage_dataset

JOB = "shardio-prom-test"
SCRAPE_JOB = "shardio-node"
HOUR_S = 3600.0


def _corrupt_member(dataset: Path, shard_path: str) -> str:
    """Flip a byte in the middle of the first member of a sample in ``shard_path``; its key."""
    with ShardReader(dataset) as ds:
        for sample in range(len(ds)):
            rec = ds.index.samples[sample]
            path = ds.shard_path(int(rec["shard"]))
            if not path.endswith(shard_path):
                continue
            for m in ds.index.sample_member_range(sample):
                member = ds.index.members[m]
                if int(member["size"]) > 16:
                    where = int(member["offset"]) + int(member["size"]) // 2
                    with open(path, "r+b") as fh:
                        fh.seek(where)
                        byte = fh.read(1)
                        fh.seek(where)
                        fh.write(bytes([byte[0] ^ 0x5A]))
                    return str(ds.key(sample))
    raise AssertionError(f"no member to corrupt in {shard_path}")


@pytest.fixture
def run_dataset(small_tree: Path, tmp_path: Path) -> tuple[Path, Path, str]:
    """(dataset, staging area, corrupted key): the small tree packed, about half staged, and
    one member of an unstaged shard corrupted in the dataset."""
    dataset = tmp_path / "ds"
    pack(
        os.fspath(small_tree),
        os.fspath(dataset),
        PackOptions(shard_size_bytes=256 * 1024, durable=False),
    )
    with ShardReader(dataset) as ds:
        total = sum(s.size_bytes for s in ds.manifest.shards)
        num_shards = len(ds.manifest.shards)
    area = tmp_path / "area"
    staged = stage_dataset(dataset, area, StageOptions(capacity_bytes=total // 2))
    assert 0 < len(staged.from_source) < num_shards, staged
    key = _corrupt_member(dataset, staged.from_source[0])
    return dataset, area, key


def _config(port: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(alerts_path())],
        "scrape_configs": [
            {
                "job_name": SCRAPE_JOB,
                "honor_labels": True,  # keep the exporter's job label (the metrics guide says so)
                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
            }
        ],
    }


def _sel(rank: int, **labels: str) -> str:
    pairs = {"job": JOB, "rank": str(rank), **labels}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items())) + "}"


def _one(prom: Any, expr: str) -> float:
    result = prom.query(expr)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


def _check_rank(prom: Any, rank: int, snap: MetricsSnapshot) -> None:
    """Every series of ``rank`` equals (counters, histogram counts) or matches (gauges)
    the rank's own loader.metrics()."""
    sel = _sel(rank)
    assert _one(prom, f"shardio_samples_delivered_total{sel}") == snap.samples
    assert _one(prom, f"shardio_batches_delivered_total{sel}") == snap.batches
    assert _one(prom, f"shardio_samples_read_total{sel}") == snap.samples_read
    by_source = prom.values(f"shardio_bytes_read_total{sel}", "source")
    assert by_source == {"staged": snap.bytes_staged, "source": snap.bytes_source}
    for name in COUNTERS:
        assert _one(prom, f"shardio_{name}_total{sel}") == snap.counters[name], name
    # Histograms: every bucket, the count and the sum.
    for metric, hist_name, labels in [
        ("shardio_read_latency_seconds", "read_staged", {"source": "staged"}),
        ("shardio_read_latency_seconds", "read_source", {"source": "source"}),
        ("shardio_wait_seconds", "wait", {}),
        ("shardio_step_seconds", "step", {}),
    ]:
        hist = snap.histograms[hist_name]
        hsel = _sel(rank, **labels)
        buckets = {float(le): v for le, v in prom.values(f"{metric}_bucket{hsel}", "le").items()}
        expected = dict(zip(BUCKETS_S, hist.cumulative(BUCKETS_S), strict=True))
        expected[math.inf] = hist.count
        assert buckets == expected, hist_name
        assert _one(prom, f"{metric}_count{hsel}") == hist.count
        assert _one(prom, f"{metric}_sum{hsel}") == pytest.approx(hist.sum_ns / 1e9, rel=1e-9)
    assert snap.histograms["wait"].count == snap.batches
    assert snap.histograms["step"].count == snap.steps
    for source in SOURCES:
        assert snap.read_latency[source].count == snap.histograms[f"read_{source}"].count
    # Gauges.
    for metric, value in [
        ("shardio_stall_fraction", snap.stall_fraction),
        ("shardio_step_mean_seconds", snap.step_mean_s),
        ("shardio_step_std_seconds", snap.step_std_s),
        ("shardio_samples_per_second", snap.samples_per_s),
        ("shardio_bytes_per_second", snap.bytes_per_s),
    ]:
        assert _one(prom, f"{metric}{sel}") == pytest.approx(value, rel=1e-9, abs=1e-12), metric
    assert 0.0 <= snap.stall_fraction <= 1.0 and snap.step_mean_s > 0
    # PromQL's P99 of the cumulative buckets lies in the bucket of the loader's own P99.
    for source in SOURCES:
        summary = snap.read_latency[source]
        if not summary.count:
            continue
        p99 = _one(
            prom,
            "histogram_quantile(0.99, sum by (le) "
            f"(shardio_read_latency_seconds_bucket{_sel(rank, source=source)}))",
        )
        edges = [0.0, *BUCKETS_S]
        upper = next((i for i, b in enumerate(edges) if b >= summary.p99_s), len(edges) - 1)
        assert edges[max(0, upper - 2)] <= p99 <= edges[upper], (source, p99, summary.p99_s)


def _batches(prom: Any) -> dict[str, float]:
    return prom.values(f'shardio_batches_delivered_total{{job="{JOB}"}}', "rank")


def _firing(prom: Any, job: str = JOB) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for alert in prom.api("alerts")["alerts"]:
        if alert["state"] == "firing" and alert["labels"].get("job") == job:
            out.setdefault(alert["labels"]["alertname"], set()).add(alert["labels"]["rank"])
    return out


def test_prometheus_scrapes_a_training_run_and_its_figures_are_the_loaders(
    run_dataset: tuple[Path, Path, str],
    tmp_path: Path,
    start_prometheus: Any,
    dashboard_queries: list[tuple[str, str]],
) -> None:
    dataset, area, bad_key = run_dataset
    spool = tmp_path / "spool"
    loaders = []
    for rank in (0, 1):
        ranks = RankInfo(rank=rank, world_size=2, local_rank=rank, ranks_per_node=2)
        ds = ShardDataset(
            dataset,
            stage=area,
            ranks=ranks,
            recovery=RecoveryPolicy(policy="skip", retries=1, backoff_s=0.0),
        )
        loaders.append(ds.loader(batch_size=16, num_workers=1))
    node = PrometheusExporter(
        loaders[0].metrics, port=0, local_rank=0, spool_dir=spool, job=JOB, interval_s=HOUR_S
    )
    other = PrometheusExporter(
        loaders[1].metrics, local_rank=1, spool_dir=spool, job=JOB, interval_s=HOUR_S
    )
    try:
        with node, other:
            port = node.bound_port
            assert port is not None
            prom = start_prometheus(_config(port))
            # Both ranks are scraped before training starts, at zero (so the counters' first
            # increases count), through one port.
            prom.wait_for(
                "both ranks at zero",
                lambda: _batches(prom) == {"0": 0.0, "1": 0.0},
                show=lambda: _batches(prom),
            )
            assert prom.values(f'up{{job="{SCRAPE_JOB}"}}', "instance") == {
                f"127.0.0.1:{port}": 1.0
            }

            keys: list[str] = []
            iters = [iter(loader) for loader in loaders]
            for _ in range(3):
                for it in iters:
                    keys.extend(next(it)["__key__"])
            # The first batches reach Prometheus long before the hour-long interval (the first
            # real report follows the first batch it sees: 1 to 3 of them).
            prom.wait_for(
                "the first batches of both ranks",
                lambda: (
                    set(_batches(prom)) == {"0", "1"}
                    and all(1 <= v <= 3 for v in _batches(prom).values())
                ),
                show=lambda: _batches(prom),
            )
            for it in iters:
                for batch in it:
                    keys.extend(batch["__key__"])

            # The quiescent point: training is over; each exporter reports its last figures.
            snaps = [loader.metrics() for loader in loaders]
            assert node.report() and other.report()
            assert [loader.metrics().to_dict()["counters"] for loader in loaders] == [
                s.to_dict()["counters"] for s in snaps
            ]
            prom.wait_for(
                "the final figures",
                lambda: (
                    prom.values(f'shardio_samples_read_total{{job="{JOB}"}}', "rank")
                    == {"0": snaps[0].samples_read, "1": snaps[1].samples_read}
                ),
            )
            for rank, snap in enumerate(snaps):
                _check_rank(prom, rank, snap)

            # What the run did, as Prometheus has it: both sources read, one sample replaced.
            assert bad_key not in keys
            total = sum(s.samples for s in snaps)
            assert total == len(keys) and total > 0
            assert sum(s.read_latency["staged"].count for s in snaps) > 0
            assert sum(s.read_latency["source"].count for s in snaps) > 0
            assert _one(prom, f'sum(shardio_substitutes_total{{job="{JOB}"}})') == 1
            assert _one(prom, f'sum(shardio_checksum_failures_total{{job="{JOB}"}})') >= 2
            bad_rank = next(r for r, s in enumerate(snaps) if s.counters["substitutes"])

            # The shipped rules loaded and evaluate cleanly over these series; the fault alerts
            # fire for the rank that met the corrupt member, and only for it.
            def healthy_rules() -> bool:
                rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
                return bool(rules) and all(
                    r["health"] == "ok" and not r["lastEvaluation"].startswith("0001-")  # evaluated
                    for r in rules
                )

            prom.wait_for("the shipped rules evaluated", healthy_rules)
            groups = prom.api("rules")["groups"]
            assert [g["name"] for g in groups] == ["shardio-data-path"]
            assert {g["file"] for g in groups} == {str(alerts_path())}
            expected = {"ShardioReadFaults", "ShardioSamplesSubstituted"}
            prom.wait_for(
                "the fault alerts",
                lambda: expected <= set(_firing(prom)),
                show=lambda: _firing(prom),
            )
            firing = _firing(prom)
            assert firing["ShardioSamplesSubstituted"] == {str(bad_rank)}
            assert firing["ShardioReadFaults"] == {str(bad_rank)}
            assert "ShardioSamplesUnavailable" not in firing
            assert "ShardioShardsRepaired" not in firing  # nothing re-staged or rebuilt

            # Every query of the shipped dashboard is valid PromQL on this server, and the
            # throughput and latency panels have data.
            for title, expr in dashboard_queries:
                concrete = (
                    expr.replace("$__rate_interval", "1m")
                    .replace("$job", JOB)
                    .replace("$instance", ".*")
                    .replace("$rank", ".*")
                )
                prom.query(concrete)  # fails the test on a parse error
                if title.startswith(("Throughput: samples", "Read latency P50")):
                    assert prom.query(concrete), title
    finally:
        for loader in loaders:
            loader.close()  # its DataLoader workers


def test_a_run_that_gives_up_on_a_sample_fires_the_critical_alert(
    run_dataset: tuple[Path, Path, str], start_prometheus: Any
) -> None:
    """Recovery policy "raise": the unreadable sample ends training, and the exporter is
    closed in the same instant by the ``with`` it trains in. Its final figures (the sample
    given up on) are still served until scraped, so ShardioSamplesUnavailable fires on a
    real Prometheus that scrapes every second and evaluates the shipped rules."""
    dataset, _, bad_key = run_dataset
    job = "shardio-prom-unavailable"
    ds = ShardDataset(dataset, recovery=RecoveryPolicy(policy="raise", retries=1, backoff_s=0.0))
    loader = ds.loader(batch_size=16, num_workers=1)
    exporter = PrometheusExporter(loader.metrics, port=0, job=job, interval_s=HOUR_S, linger_s=60)
    sel = f'{{job="{job}"}}'
    try:
        with pytest.raises(SampleUnavailableError, match=re.escape(bad_key)), exporter:
            port = exporter.bound_port
            assert port is not None
            prom = start_prometheus(_config(port))
            prom.wait_for(
                "the run scraped at zero",
                lambda: prom.values(f"shardio_unavailable_total{sel}", "rank") == {"0": 0.0},
            )
            for _ in loader:  # the corrupt member: retried once, then given up on
                pass
        assert exporter.bound_port is None and not exporter.running  # closed
        unavailable = loader.metrics().counters["unavailable"]
        assert unavailable >= 1
        # Scraped before the port closed (the series is stale by now: ask over the past).
        seen = prom.values(f"max_over_time(shardio_unavailable_total{sel}[5m])", "rank")
        assert seen == {"0": unavailable}
        prom.wait_for(
            "ShardioSamplesUnavailable firing",
            lambda: _firing(prom, job).get("ShardioSamplesUnavailable") == {"0"},
            show=lambda: _firing(prom, job),
        )
        alert = next(
            a
            for a in prom.api("alerts")["alerts"]
            if a["labels"]["alertname"] == "ShardioSamplesUnavailable"
        )
        assert alert["labels"]["severity"] == "critical"
    finally:
        loader.close()
