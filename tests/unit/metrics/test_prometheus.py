"""PrometheusExporter: scraped over real HTTP, two local ranks sharing a spool, a textfile;
and against hostile neighbours: stalled and trickling clients, the listening address, a spool
directory another local user made first, and what is left after close."""

from __future__ import annotations

import json
import logging
import os
import re
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

from shardio.errors import UsageError
from shardio.metrics import PrometheusExporter, alerts_path
from shardio.metrics.prometheus_families import ALERT_COUNTERS

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
    assert not spool.exists()  # local rank 0 makes the spool; until then rank 1 waits
    spool.mkdir(mode=0o700)  # (as local rank 0 would)
    assert other.report()
    assert (spool / "local-rank-1.json").is_file()
    node = PrometheusExporter(
        rank0,
        port=port,
        host="127.0.0.1",
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
    # Local rank 0 removed the spool files; the directory it did not make stays.
    assert list(spool.iterdir()) == []


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
    port = free_port()
    node = PrometheusExporter(
        make_rank(0), port=port, host="127.0.0.1", spool_dir=spool, job="j", interval_s=3600
    )
    exporters.append(node)
    node.start()
    assert os.stat(spool).st_mode & 0o777 == 0o700
    subprocess.run([sys.executable, "-c", code, str(spool)], check=True, timeout=120)
    samples = parse(scrape(port))
    assert ranks_in(samples) == {"0", "5"}
    assert value(samples, "shardio_rebuilds_total", rank="5", job="j") == 7
    assert value(samples, "shardio_rebuilds_total", rank="0", job="j") == 0


def test_stale_and_malformed_spool_files_are_passed_over(
    make_rank: Any, spool: Path, exporters: list[PrometheusExporter], caplog: Any
) -> None:
    spool.mkdir(mode=0o700)
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
        make_rank(0), port=port, host="127.0.0.1", spool_dir=spool, interval_s=60
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
    node = PrometheusExporter(make_rank(4), port=port, host="127.0.0.1", interval_s=3600)
    exporters.append(node)
    node.start()
    samples = parse(scrape(port))
    assert ranks_in(samples) == {"4"}
    check_rank(samples, "4", "", scale=1)


@pytest.mark.parametrize("local_rank", [0, 1])
def test_an_unusable_spool_dir_is_logged_never_written_through_and_training_goes_on(
    make_rank: Any, tmp_path: Path, caplog: Any, local_rank: int
) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    afile = tmp_path / "afile"
    afile.write_text("x")
    caplog.set_level(logging.WARNING)
    for path, message in ((link, "is a symlink"), (shared, "not private to this user"),
                          (afile, "not a directory")):  # fmt: skip
        caplog.clear()
        rank = make_rank(0)
        with PrometheusExporter(rank, local_rank=local_rank, spool_dir=path) as exporter:
            assert exporter.report()  # reports go on
        assert rank.calls >= 2
        logged = [r.getMessage() for r in caplog.records]
        assert any(message in m and str(path) in m for m in logged), logged
    assert list(real.iterdir()) == [] and list(shared.iterdir()) == []
    assert afile.read_text() == "x" and link.is_symlink()
    assert metrics_threads() == []


def test_textfile_alone(make_rank: Any, tmp_path: Path) -> None:
    textfile = tmp_path / "shardio.prom"
    with PrometheusExporter(make_rank(0), textfile=textfile, job="a", interval_s=3600):
        check_rank(parse(textfile.read_text()), "0", "a", scale=1)
    assert [p.name for p in tmp_path.iterdir()] == ["shardio.prom"]  # no temp file left
    assert metrics_threads() == []


def test_textfile_checks(make_rank: Any, tmp_path: Path, caplog: Any) -> None:
    with pytest.raises(UsageError, match=r"must end in \.prom"):
        PrometheusExporter(make_rank(0), textfile=tmp_path / "metrics.txt")
    target = tmp_path / "precious.prom"
    target.write_text("keep me\n")
    link = tmp_path / "link.prom"
    link.symlink_to(target)
    missing = tmp_path / "missing" / "m.prom"
    caplog.set_level(logging.WARNING)
    # Neither stops training: logged once each, the reports go on, nothing written through.
    for path, message in ((link, f"{link} is a symlink"), (missing, "no directory")):
        caplog.clear()
        rank = make_rank(0)
        with PrometheusExporter(rank, textfile=path, interval_s=3600) as exporter:
            assert not exporter.report()
        assert rank.calls >= 3
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and message in warned[0], warned
    assert target.read_text() == "keep me\n" and link.is_symlink()
    assert not missing.parent.exists()
    assert metrics_threads() == []


def test_a_busy_port_is_logged_and_training_goes_on(
    make_rank: Any, tmp_path: Path, caplog: Any
) -> None:
    """Two jobs on one node asking for one port (the metrics guide's example): the second trains
    without the endpoint, with one warning naming the port; its textfile is still written."""
    caplog.set_level(logging.WARNING)
    textfile = tmp_path / "node.prom"
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rank = make_rank(0)
        with PrometheusExporter(
            rank, port=port, host="127.0.0.1", textfile=textfile, interval_s=3600
        ) as exporter:
            assert exporter.bound_port is None
            assert metrics_threads() == ["shardio-metrics-prometheus"]
            trained = True  # the training loop runs
            assert exporter.report()
        assert trained
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert f"cannot serve metrics on 127.0.0.1:{port}" in warned[0]
    assert "training goes on without this endpoint" in warned[0]
    check_rank(parse(textfile.read_text()), "0", "", scale=1)
    assert metrics_threads() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 70000}, "port"),
        ({"port": True}, "port"),
        ({"local_rank": -1}, "local_rank"),
        ({"host": ""}, "host"),
        ({"job": 3}, "job"),
        ({"interval_s": 0}, "interval_s"),
        ({"port": "9464"}, "port"),
        ({"port": -1}, "port"),
        ({"linger_s": -1}, "linger_s"),
        ({"linger_s": float("nan")}, "linger_s"),
        ({"linger_s": 1e9}, "linger_s"),
        ({"linger_s": 10**400}, "linger_s"),
        ({"linger_s": True}, "linger_s"),
        ({"textfile": b"m.prom"}, "textfile"),
        ({"textfile": "a\0b.prom"}, "textfile"),
        ({"spool_dir": "sp\0ol"}, "spool_dir"),
        ({"spool_dir": 7}, "spool_dir"),
        ({"spool_root": ""}, "spool_root"),
    ],
)
def test_arguments_are_checked(make_rank: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        PrometheusExporter(make_rank(0), **kwargs)


def test_missing_prometheus_client_says_what_to_install(
    make_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(UsageError, match=r"pip install prometheus-client"):
        PrometheusExporter(make_rank(0), port=0)


def test_one_series_per_rank_when_spool_files_repeat_a_rank(
    make_rank: Any, spool: Path, exporters: list[PrometheusExporter]
) -> None:
    # A spool file left by another local rank that reported rank 0 too (a restarted job
    # with another layout): the node's own figures win, and no series appears twice.
    spool.mkdir(mode=0o700)
    stray = make_rank(0, scale=5)
    PrometheusExporter(stray, local_rank=3, spool_dir=spool, interval_s=60).start().close()
    port = free_port()
    node = PrometheusExporter(
        make_rank(0), port=port, host="127.0.0.1", spool_dir=spool, interval_s=60
    )
    exporters.append(node)
    node.start()
    samples = parse(scrape(port))  # parse() fails on a repeated sample
    assert ranks_in(samples) == {"0"}
    check_rank(samples, "0", "", scale=1)


# -- hostile neighbours ------------------------------------------------------------------
GENEROUS_S = 60.0  # a test timeout, not a measurement


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the listening TCP sockets on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            next(fh)
            for line in fh:
                local, state = line.split()[1], line.split()[3]
                addr, _, hexport = local.partition(":")
                if state == "0A" and int(hexport, 16) == port:
                    found.add(addr)
    return found


def test_the_default_address_is_this_node_only(
    make_rank: Any, exporters: list[PrometheusExporter]
) -> None:
    node = PrometheusExporter(make_rank(0), port=0, interval_s=3600)
    exporters.append(node)
    node.start()
    assert node.bound_port is not None
    assert _listening_addresses(node.bound_port) == {"0100007F"}  # 127.0.0.1, nothing else
    assert node.host == "127.0.0.1"
    assert ranks_in(parse(scrape(node.bound_port))) == {"0"}


class _Trickler(threading.Thread):
    """A client that sends its request one byte a second (and never reads)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.done = threading.Event()

    def run(self) -> None:
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X: " + b"y" * 10_000
        try:
            for byte in request:
                if self.done.wait(1.0):
                    return
                self.sock.send(bytes([byte]))
        except OSError:
            return  # cut off by the server: what it should do


def test_stalled_and_trickling_clients_block_neither_scrapes_nor_close(
    make_rank: Any, exporters: list[PrometheusExporter]
) -> None:
    node = PrometheusExporter(make_rank(0), port=0, interval_s=3600)
    exporters.append(node)
    node.start()
    port = node.bound_port
    assert port is not None
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # send nothing
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /metr")  # half a request line, then nothing
    greedy = socket.create_connection(("127.0.0.1", port))
    greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    greedy.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # and never reads the answer
    trickler = _Trickler(port)
    trickler.start()
    try:
        time.sleep(0.2)  # let the server accept them all first
        for _ in range(3):
            samples = parse(scrape(port))
            assert value(samples, "shardio_samples_delivered_total", rank="0", job="") == 12
        closer = threading.Thread(target=node.close, daemon=True)
        closer.start()
        closer.join(GENEROUS_S)
        assert not closer.is_alive(), "close() hung on a stalled client"
        assert metrics_threads() == []
    finally:
        trickler.done.set()
        for sock in [*silent, half, greedy, trickler.sock]:
            sock.close()


def _foreign_dir(path: Path, *, beat: bool = False) -> Path:
    """A directory made by "another user" (uid 54321), mode 0700."""
    path.mkdir(mode=0o700)
    if beat:  # dressed up as a live spool: a fresh local-rank-0.json
        (path / "local-rank-0.json").write_text(json.dumps({"snapshot": {}}))
        os.chown(path / "local-rank-0.json", 54321, 54321)
    os.chown(path, 54321, 54321)
    return path


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's dir needs root")


@needs_root
def test_a_spool_path_another_user_made_first_does_not_stop_training(
    make_rank: Any, tmp_path: Path, caplog: Any, exporters: list[PrometheusExporter]
) -> None:
    taken = _foreign_dir(tmp_path / "shardio-metrics-1234")  # an old release's guessable name
    caplog.set_level(logging.WARNING)
    node = PrometheusExporter(make_rank(0), port=0, spool_dir=taken, job="1234", interval_s=3600)
    exporters.append(node)
    node.start()  # no exception: training goes on
    other = PrometheusExporter(make_rank(1), local_rank=1, spool_dir=taken, job="1234")
    exporters.append(other)
    other.start()
    assert other.report()
    assert node.bound_port is not None
    assert ranks_in(parse(scrape(node.bound_port))) == {"0"}
    assert list(taken.iterdir()) == []  # nothing written into another user's directory
    assert any("not private to this user" in r.getMessage() for r in caplog.records)
    other.close()
    node.close()
    assert taken.is_dir() and os.stat(taken).st_uid == 54321  # and nothing removed


@needs_root
def test_the_auto_spool_is_private_unpredictable_shared_and_removed_at_close(
    make_rank: Any, tmp_path: Path, exporters: list[PrometheusExporter]
) -> None:
    from shardio.metrics._spool import auto_prefix

    root = tmp_path / "shm"
    root.mkdir(mode=0o1777)
    # Another user's decoys with the job's prefix, one dressed up as a live spool.
    decoys = [_foreign_dir(root / f"{auto_prefix('77')}{n}", beat=True) for n in "ab"]
    (root / f"{auto_prefix('77')}link").symlink_to(decoys[0])
    rank1 = PrometheusExporter(
        make_rank(1, scale=3), local_rank=1, spool_dir="auto", spool_root=root, job="77"
    )
    exporters.append(rank1)
    rank1.start()  # before local rank 0: finds nothing yet, writes nowhere
    assert rank1.spool_path is None
    node = PrometheusExporter(
        make_rank(0), port=0, spool_dir="auto", spool_root=root, job="77", interval_s=3600
    )
    exporters.append(node)
    node.start()
    spool = node.spool_path
    assert spool is not None and os.path.dirname(spool) == str(root)
    assert os.path.basename(spool).startswith(auto_prefix("77"))
    st = os.lstat(spool)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    assert rank1.report()  # finds local rank 0's spool by its owner, not the decoys
    assert rank1.spool_path == spool
    assert node.bound_port is not None
    samples = parse(scrape(node.bound_port))
    assert ranks_in(samples) == {"0", "1"}
    assert value(samples, "shardio_samples_read_total", rank="1", job="77") == 18
    assert all(list(d.iterdir()) == [d / "local-rank-0.json"] for d in decoys)
    # Another job's exporter makes another, unpredictable name.
    again = PrometheusExporter(make_rank(0), spool_dir="auto", spool_root=root, job="77")
    again.start()
    assert again.spool_path not in (None, spool)
    again.close()
    rank1.close()
    node.close()
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted([d.name for d in decoys] + [f"{auto_prefix('77')}link"])
    assert all(os.stat(d).st_uid == 54321 for d in decoys)  # decoys untouched


def test_the_auto_spool_lives_in_dev_shm_and_goes_at_close(make_rank: Any) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with PrometheusExporter(make_rank(0), spool_dir="auto", job="dev-shm-test") as node:
        spool = node.spool_path
        assert spool is not None and spool.startswith("/dev/shm/shardio-metrics-")
        assert os.path.isfile(os.path.join(spool, "local-rank-0.json"))
    assert not os.path.exists(spool)


def test_a_user_file_in_the_spool_is_left_alone(make_rank: Any, tmp_path: Path) -> None:
    node = PrometheusExporter(make_rank(0), spool_dir="auto", spool_root=tmp_path, job="x")
    node.start()
    assert node.spool_path is not None
    keep = Path(node.spool_path) / "notes.txt"
    keep.write_text("mine")
    node.close()
    assert keep.read_text() == "mine"
    assert sorted(p.name for p in keep.parent.iterdir()) == ["notes.txt"]


def _closing(exporter: PrometheusExporter) -> threading.Thread:
    closer = threading.Thread(target=exporter.close, name="test-closer", daemon=True)
    closer.start()
    return closer


def test_an_unscraped_abnormal_count_is_served_after_close_until_scraped(
    make_rank: Any, caplog: Any
) -> None:
    """A sample given up on ends training and closes the exporter at once: the port stays
    up with the final figures until two scrapes read them, then closes."""
    caplog.set_level(logging.INFO, logger="shardio.metrics.prometheus")
    rank = make_rank(0)
    node = PrometheusExporter(rank, port=0, interval_s=3600, linger_s=GENEROUS_S)
    node.start()
    port = node.bound_port
    assert port is not None
    assert value(parse(scrape(port)), "shardio_unavailable_total", rank="0", job="") == 0
    rank.read.add("unavailable")  # the failure; training ends in the same instant
    closer = _closing(node)
    time.sleep(0.3)
    assert closer.is_alive()  # lingering: the count was never scraped
    for _ in range(2):
        assert value(parse(scrape(port)), "shardio_unavailable_total", rank="0", job="") == 1
    closer.join(GENEROUS_S)
    assert not closer.is_alive()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    assert metrics_threads() == []
    logged = [r.getMessage() for r in caplog.records]
    assert any("unavailable=1 (rank 0)" in m and "linger_s" in m for m in logged), logged


def test_the_linger_is_bounded_and_zero_turns_it_off(make_rank: Any, caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="shardio.metrics.prometheus")
    for linger_s in (0.5, 0.0):
        caplog.clear()
        rank = make_rank(0)
        node = PrometheusExporter(rank, port=0, interval_s=3600, linger_s=linger_s)
        node.start()
        assert node.bound_port is not None
        scrape(node.bound_port)
        rank.read.add("substitutes", 3)
        began = time.monotonic()
        node.close()  # nobody scrapes again
        took = time.monotonic() - began
        assert took >= linger_s and took < GENEROUS_S
        warned = [r.getMessage() for r in caplog.records]
        assert bool(warned) == (linger_s > 0), warned
        if linger_s:
            assert "not scraped 2 times within 0.5 s" in warned[0]
    assert metrics_threads() == []


@pytest.mark.parametrize("scraped", [False, True])
def test_no_linger_without_a_scraper_or_without_anything_unseen(
    make_rank: Any, scraped: bool
) -> None:
    """Nobody scraped during the run (no Prometheus), or the last scrape already read every
    abnormal count (the known figures hold a checksum failure): close at once."""
    node = PrometheusExporter(make_rank(0), port=0, interval_s=3600, linger_s=GENEROUS_S)
    node.start()
    assert node.bound_port is not None
    if scraped:
        samples = parse(scrape(node.bound_port))
        assert value(samples, "shardio_checksum_failures_total", rank="0", job="") == 1
    closer = _closing(node)
    closer.join(GENEROUS_S / 2)
    assert not closer.is_alive()
    assert metrics_threads() == []


def test_a_job_label_that_is_not_unicode_does_not_fail_scrapes(
    make_rank: Any, tmp_path: Path
) -> None:
    """A job name from an environment variable holding non-UTF-8 bytes (os.environ gives
    lone surrogates): every scrape and the textfile still render, the byte escaped."""
    job = os.fsdecode(b"job-\xff")
    textfile = tmp_path / "node.prom"
    with PrometheusExporter(
        make_rank(0), port=0, textfile=textfile, job=job, interval_s=3600
    ) as node:
        assert node.bound_port is not None
        check_rank(parse(scrape(node.bound_port)), "0", "job-\\udcff", scale=1)
    check_rank(parse(textfile.read_text()), "0", "job-\\udcff", scale=1)


def test_a_reporting_thread_that_cannot_start_does_not_stop_training(
    make_rank: Any, tmp_path: Path, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    caplog.set_level(logging.WARNING)
    textfile = tmp_path / "node.prom"
    rank = make_rank(0)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with PrometheusExporter(rank, port=0, textfile=textfile, interval_s=3600) as node:
        assert node.bound_port is None and node.running
    monkeypatch.undo()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("cannot serve metrics" in m and "can't start new thread" in m for m in warned)
    assert any("starting the metrics prometheus thread" in m for m in warned), warned
    check_rank(parse(textfile.read_text()), "0", "", scale=1)  # the last report, at close
    assert metrics_threads() == []


def test_the_linger_watches_every_counter_the_shipped_rules_alert_on() -> None:
    text = alerts_path().read_text()
    watched = set(re.findall(r"increase\(shardio_([a-z_]+)_total\[", text))
    assert watched and watched == set(ALERT_COUNTERS)
