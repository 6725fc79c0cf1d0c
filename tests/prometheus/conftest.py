"""Fixtures of the Prometheus tests: a real ``prometheus`` server on 127.0.0.1 and ``promtool``.

Every test here is marked ``prometheus``. Without the binaries the tests skip; under
``SHARDIO_PROMETHEUS=required`` (CI) a missing binary, or a server that does not start or
answer, fails them instead, and a prometheus test that skips fails the run (see
``pytest_terminal_summary`` in tests/conftest.py).

A server listens on 127.0.0.1 only, on a free port, with its configuration and its storage
in the test's tmp_path; it is killed and reaped when the test ends. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shardio.metrics import ReadMetrics, StepTimer, dashboard_path, snapshot
from shardio.metrics.prometheus_families import metric_families
from shardio.runtime.audit import EpochAudit, with_audit_counts

HERE = pathlib.Path(__file__).resolve().parent
REQUIRED = os.environ.get("SHARDIO_PROMETHEUS", "") == "required"
START_TIMEOUT_S = 60.0  # for the server to answer /-/ready (a few seconds here)
WAIT_TIMEOUT_S = 90.0  # for a figure to show in a query (scrapes come every second)
STOP_TIMEOUT_S = 15.0
_POLL_S = 0.2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if pathlib.Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.prometheus)


def need_binary(name: str) -> str:
    """The path of ``name``; skip the test without it, or fail under
    SHARDIO_PROMETHEUS=required."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed (Debian: apt-get install prometheus)"
        if REQUIRED:
            pytest.fail(f"SHARDIO_PROMETHEUS=required but {reason}")
        pytest.skip(reason)
    return path


def _cannot(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"SHARDIO_PROMETHEUS=required but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def require_binary() -> Callable[[str], str]:
    """:func:`need_binary` (for the test of this module's own skip-or-fail logic)."""
    return need_binary


@pytest.fixture
def promtool() -> str:
    """The path of promtool."""
    return need_binary("promtool")


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrometheusServer:
    """A running ``prometheus`` and its HTTP API.

    Attributes:
        port: where it listens (127.0.0.1 only).
        log: its output.
    """

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: pathlib.Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the ``data`` of a successful answer."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # a bad query: 400 with the error in JSON
            body = json.loads(exc.read() or b"{}")
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now: [{"metric": labels, "value": [t, "v"]}]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def values(self, expr: str, key: str) -> dict[str, float]:
        """``expr``'s samples now, by the value of label ``key``."""
        out: dict[str, float] = {}
        for item in self.query(expr):
            label = item["metric"].get(key, "")
            assert label not in out, f"{expr}: two series with {key}={label!r}"
            out[label] = float(item["value"][1])
        return out

    def wait_for(
        self, what: str, check: Callable[[], Any], show: Callable[[], Any] | None = None
    ) -> Any:
        """Poll ``check`` until it returns something true (returned); fail after
        WAIT_TIMEOUT_S, naming ``what`` and the last thing it (or ``show``) returned."""
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        last: Any = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log_tail()}"
            last = check()
            if last:
                return last
            time.sleep(_POLL_S)
        if show is not None:
            last = show()
        pytest.fail(f"{what}: not within {WAIT_TIMEOUT_S:g} s (last: {last!r})")

    def stop(self) -> None:
        """Kill the server and reap it (bounded)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _launch(binary: str, config: pathlib.Path, root: pathlib.Path) -> PrometheusServer | str:
    """A ready server, or why it did not start."""
    port = _free_port()
    log = root / f"prometheus-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / f'tsdb-{port}'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=info",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a signal meant for pytest does not reach it first
        )
    server = PrometheusServer(proc, port, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"prometheus exited with {proc.returncode}:\n{server.log_tail()}"
        if _ready(port):
            return server
        time.sleep(_POLL_S)
    server.stop()
    return f"prometheus did not answer /-/ready within {START_TIMEOUT_S:g} s:\n{server.log_tail()}"


StartPrometheus = Callable[[dict[str, Any]], PrometheusServer]


@pytest.fixture
def start_prometheus(tmp_path: pathlib.Path) -> Iterator[StartPrometheus]:
    """``start_prometheus(config)`` -> a ready PrometheusServer; ``config`` is the
    configuration as a dict (written as JSON, which Prometheus's YAML reader takes).
    Every server is killed and reaped when the test ends."""
    binary = need_binary("prometheus")
    root = tmp_path / "prometheus"
    root.mkdir()
    started: list[PrometheusServer] = []

    def start(config: dict[str, Any]) -> PrometheusServer:
        path = root / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))
        why = ""
        for _ in range(3):  # another process may take the free port first
            got = _launch(binary, path, root)
            if isinstance(got, PrometheusServer):
                started.append(got)
                return got
            why = got
            if "address already in use" not in why:
                break
        _cannot(why)
        raise AssertionError("unreachable")  # _cannot skips or fails

    try:
        yield start
    finally:
        for server in started:
            server.stop()
        leftover = [s.proc.pid for s in started if s.proc.poll() is None]
        assert not leftover, f"prometheus still running: {leftover}"


def exported_names() -> set[str]:
    """Every sample name the exporter emits (``_total``, ``_bucket``, ``_sum``, ... included),
    from the exporter's own rendering of a snapshot, not from a list kept here."""
    read, steps = ReadMetrics(), StepTimer()
    snap = snapshot(read, steps, sources={"a": 1})  # a mix's series too
    # As ShardLoader.metrics() gives it: with the exactly-once audit's counters.
    snap = with_audit_counts(snap, [EpochAudit(None, batch_size=1, drop_last=False)])

    class Families:
        def collect(self) -> Any:
            return metric_families([(snap, "j")])

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    text = generate_latest(registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="session")
def exporter_names() -> set[str]:
    """:func:`exported_names`, once."""
    return exported_names()


@pytest.fixture(scope="session")
def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the shipped Grafana dashboard."""
    doc = json.loads(dashboard_path().read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]
