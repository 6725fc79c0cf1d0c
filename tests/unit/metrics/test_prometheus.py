"""PrometheusExporter: scraped over real HTTP, two local ranks sharing a spool, a textfile."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardio.errors import StorageError, UsageError
from shardio.metrics import PrometheusExporter

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metrics_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("shardio-metrics-"))


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in out, f"duplicate sample {key}"
            out[key] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def ranks_in(samples: Samples) -> set[str]:
    return {
        dict(labels)["rank"]
        for name, labels in samples
        if name == "shardio_samples_delivered_total"
    }


def check_rank(samples: Samples, rank: str, job: str, scale: int) -> None:
    """The figures conftest.record_known recorded, as Prometheus renders them."""
    lab = {"rank": rank, "job": job}
    assert value(samples, "shardio_samples_delivered_total", **lab) == 12
    assert value(samples, "shardio_batches_delivered_total", **lab) == 3
    assert value(samples, "shardio_samples_read_total", **lab) == 6 * scale
    assert value(samples, "shardio_bytes_read_total", **lab, source="staged") == 4000 * scale
    assert value(samples, "shardio_bytes_read_total", **lab, source="source") == 10000 * scale
    assert value(samples, "shardio_cache_hits_total", **lab) == 4 * scale
    assert value(samples, "shardio_checksum_failures_total", **lab) == scale
    assert value(samples, "shardio_retries_total", **lab) == 2 * scale
    assert value(samples, "shardio_members_total", **lab) == 6 * scale
    assert value(samples, "shardio_rebuilds_total", **lab) == 0
    assert value(samples, "shardio_stall_fraction", **lab) == pytest.approx(33 / 302)
    assert value(samples, "shardio_step_mean_seconds", **lab) == pytest.approx(0.15)
    assert value(samples, "shardio_step_std_seconds", **lab) == pytest.approx(0.05)
    assert value(samples, "shardio_samples_per_second", **lab) == pytest.approx(12 / 0.302)
    # Staged reads: 0.2 ms x3, 3 ms x1 (per scale).
    staged = {**lab, "source": "staged"}
    bucket = "shardio_read_latency_seconds_bucket"
    assert value(samples, bucket, **staged, le="0.0001") == 0
    assert value(samples, bucket, **staged, le="0.00025") == 3 * scale
    assert value(samples, bucket, **staged, le="0.0025") == 3 * scale
    assert value(samples, bucket, **staged, le="0.005") == 4 * scale
    assert value(samples, bucket, **staged, le="+Inf") == 4 * scale
    assert value(samples, "shardio_read_latency_seconds_count", **staged) == 4 * scale
    sum_s = value(samples, "shardio_read_latency_seconds_sum", **staged)
    assert sum_s == pytest.approx(0.0036 * scale)
    # Source reads: 40 ms x2.
    source = {**lab, "source": "source"}
    assert value(samples, bucket, **source, le="0.025") == 0
    assert value(samples, bucket, **source, le="0.05") == 2 * scale
    assert value(samples, "shardio_read_latency_seconds_sum", **source) == pytest.approx(
        0.08 * scale
    )
    # Waits 2, 1, 30 ms; 1 ms lies on a bound and counts under it.
    wait = "shardio_wait_seconds_bucket"
    assert value(samples, wait, **lab, le="0.0005") == 0
    assert value(samples, wait, **lab, le="0.001") == 1
    assert value(samples, wait, **lab, le="0.0025") == 2
    assert value(samples, wait, **lab, le="0.025") == 2
    assert value(samples, wait, **lab, le="0.05") == 3
    assert value(samples, "shardio_wait_seconds_sum", **lab) == pytest.approx(0.033)
    # Steps 100 and 200 ms.
    step = "shardio_step_seconds_bucket"
    assert value(samples, step, **lab, le="0.05") == 0
    assert value(samples, step, **lab, le="0.1") == 1
    assert value(samples, step, **lab, le="0.25") == 2
    assert value(samples, step, **lab, le="+Inf") == 2
    assert value(samples, "shardio_step_seconds_count", **lab) == 2


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def exporters() -> Iterator[list[PrometheusExporter]]:
    """Exporters to close whatever a test's asserts did."""
    made: list[PrometheusExporter] = []
    yield made
    for exporter in made:
        exporter.close()


def test_one_port_serves_both_local_ranks(
    make_rank: Any, spool: Path, tmp_path: Path, exporters: list[PrometheusExporter]
) -> None:
    port = free_port()
    rank0, rank1 = make_rank(0), make_rank(1, scale=3)
    textfile = tmp_path / "node.prom"
    other = PrometheusExporter(
        rank1, port=port, local_rank=1, spool_dir=spool, job="vit", interval_s=3600
    )
    exporters.append(other)
    other.start()
    assert other.bound_port is None  # the port is local rank 0's
    assert (spool / "local-rank-1.json").is_file()
    assert os.stat(spool).st_mode & 0o777 == 0o700
    node = PrometheusExporter(
        rank0,
        port=port,
        addr="127.0.0.1",
        textfile=textfile,
        local_rank=0,
        spool_dir=spool,
        job="vit",
        interval_s=3600,
    )
    exporters.append(node)
    node.start()
    assert node.bound_port == port
    assert metrics_threads() == [
        "shardio-metrics-http",
        "shardio-metrics-prometheus",
        "shardio-metrics-prometheus",
    ]

    samples = parse(scrape(port))
    assert ranks_in(samples) == {"0", "1"}
    check_rank(samples, "0", "vit", scale=1)
    check_rank(samples, "1", "vit", scale=3)

    # The textfile written at start (rank 1 was in the spool already) says the same.
    from_file = parse(textfile.read_text())
    check_rank(from_file, "0", "vit", scale=1)
    check_rank(from_file, "1", "vit", scale=3)

    # Rank 1 moves on; its next report reaches the node's scrape.
    rank1.read.add("retries", 100)
    assert other.report()
    samples = parse(scrape(port))
    assert value(samples, "shardio_retries_total", rank="1", job="vit") == 106
    assert value(samples, "shardio_retries_total", rank="0", job="vit") == 2

    other.close()
    rank0.read.add("cache_misses", 9)
    node.close()
    assert metrics_threads() == []
    # close() rewrote the textfile one last time.
    final = parse(textfile.read_text())
    assert value(final, "shardio_cache_misses_total", rank="0", job="vit") == 10
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_rank_one_in_another_process(
    make_rank: Any, spool: Path, exporters: list[PrometheusExporter]
) -> None:
    import subprocess

    code = (
        "import sys\n"
        "from shardio.metrics import PrometheusExporter, ReadMetrics, StepTimer, snapshot\n"
        "read, steps = ReadMetrics(), StepTimer()\n"
        "read.add('rebuilds', 7)\n"
        "src = lambda: snapshot(read, steps, rank=5, world_size=8)\n"
        "PrometheusExporter(src, local_rank=1, spool_dir=sys.argv[1], job='j').start().close()\n"
    )
    subprocess.run([sys.executable, "-c", code, str(spool)], check=True, timeout=120)
    port = free_port()
    node = PrometheusExporter(
        make_rank(0), port=port, addr="127.0.0.1", spool_dir=spool, job="j", interval_s=3600
    )
    exporters.append(node)
    node.start()
    samples = parse(scrape(port))
    assert ranks_in(samples) == {"0", "5"}
    assert value(samples, "shardio_rebuilds_total", rank="5", job="j") == 7
    assert value(samples, "shardio_rebuilds_total", rank="0", job="j") == 0


def test_stale_and_malformed_spool_files_are_passed_over(
    make_rank: Any, spool: Path, exporters: list[PrometheusExporter], caplog: Any
) -> None:
    gone = PrometheusExporter(make_rank(2), local_rank=2, spool_dir=spool, interval_s=1)
    gone.start().close()
    alive = PrometheusExporter(make_rank(3), local_rank=3, spool_dir=spool, interval_s=1)
    alive.start().close()
    old = time.time() - 3600
    os.utime(spool / "local-rank-2.json", (old, old))  # ten intervals of 1 s ago, and more
    (spool / "local-rank-4.json").write_text("{not json")
    (spool / "local-rank-6.json").write_text(json.dumps({"snapshot": {"version": 99}}))
    (spool / "notes.txt").write_text("ignored")
    port = free_port()
    caplog.set_level(logging.WARNING)
    node = PrometheusExporter(
        make_rank(0), port=port, addr="127.0.0.1", spool_dir=spool, interval_s=60
    )
    exporters.append(node)
    node.start()
    for _ in range(2):
        samples = parse(scrape(port))
        assert ranks_in(samples) == {"0", "3"}
        assert value(samples, "shardio_samples_delivered_total", rank="3", job="") == 12
    bad = sorted(r.getMessage() for r in caplog.records if "spool file" in r.getMessage())
    assert len(bad) == 2, bad  # each logged once, whatever the number of scrapes
    assert "local-rank-4.json" in bad[0] and "unsupported version 99" in bad[1]


def test_without_a_spool_only_the_own_snapshot_is_served(
    make_rank: Any, exporters: list[PrometheusExporter]
) -> None:
    port = free_port()
    node = PrometheusExporter(make_rank(4), port=port, addr="127.0.0.1", interval_s=3600)
    exporters.append(node)
    node.start()
    samples = parse(scrape(port))
    assert ranks_in(samples) == {"4"}
    check_rank(samples, "4", "", scale=1)


def test_spool_dir_must_be_private_and_no_symlink(make_rank: Any, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UsageError, match=f"{link} is a symlink"):
        PrometheusExporter(make_rank(0), local_rank=1, spool_dir=link).start()
    assert list(real.iterdir()) == []
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(UsageError, match="not one shardio made"):
        PrometheusExporter(make_rank(0), local_rank=1, spool_dir=shared).start()
    assert list(shared.iterdir()) == []
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        PrometheusExporter(make_rank(0), local_rank=1, spool_dir=afile).start()
    assert metrics_threads() == []


def test_textfile_alone(make_rank: Any, tmp_path: Path) -> None:
    textfile = tmp_path / "shardio.prom"
    with PrometheusExporter(make_rank(0), textfile=textfile, job="a", interval_s=3600):
        check_rank(parse(textfile.read_text()), "0", "a", scale=1)
    assert [p.name for p in tmp_path.iterdir()] == ["shardio.prom"]  # no temp file left
    assert metrics_threads() == []


def test_textfile_checks(make_rank: Any, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"must end in \.prom"):
        PrometheusExporter(make_rank(0), textfile=tmp_path / "metrics.txt")
    target = tmp_path / "precious.prom"
    target.write_text("keep me\n")
    link = tmp_path / "link.prom"
    link.symlink_to(target)
    with pytest.raises(StorageError, match=f"{link} is a symlink"):
        PrometheusExporter(make_rank(0), textfile=link).start()
    assert target.read_text() == "keep me\n" and link.is_symlink()
    with pytest.raises(StorageError, match="no directory"):
        PrometheusExporter(make_rank(0), textfile=tmp_path / "missing" / "m.prom").start()


def test_a_busy_port_is_a_storage_error(make_rank: Any) -> None:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        exporter = PrometheusExporter(make_rank(0), port=port, addr="127.0.0.1")
        with pytest.raises(StorageError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            exporter.start()
    assert metrics_threads() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 70000}, "port"),
        ({"port": True}, "port"),
        ({"local_rank": -1}, "local_rank"),
        ({"addr": ""}, "addr"),
        ({"job": 3}, "job"),
        ({"interval_s": 0}, "interval_s"),
    ],
)
def test_arguments_are_checked(make_rank: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        PrometheusExporter(make_rank(0), **kwargs)


def test_missing_prometheus_client_says_what_to_install(
    make_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(UsageError, match=r"pip install shardio\[metrics\]"):
        PrometheusExporter(make_rank(0), port=0)


def test_one_series_per_rank_when_spool_files_repeat_a_rank(
    make_rank: Any, spool: Path, exporters: list[PrometheusExporter]
) -> None:
    # A spool file left by another local rank that reported rank 0 too (a restarted job
    # with another layout): the node's own figures win, and no series appears twice.
    stray = make_rank(0, scale=5)
    PrometheusExporter(stray, local_rank=3, spool_dir=spool, interval_s=60).start().close()
    port = free_port()
    node = PrometheusExporter(
        make_rank(0), port=port, addr="127.0.0.1", spool_dir=spool, interval_s=60
    )
    exporters.append(node)
    node.start()
    samples = parse(scrape(port))  # parse() fails on a repeated sample
    assert ranks_in(samples) == {"0"}
    check_rank(samples, "0", "", scale=1)
