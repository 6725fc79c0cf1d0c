"""The harness of these tests: without Prometheus they skip, but under
SHARDIO_PROMETHEUS=required a missing binary or a server that cannot start fails."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REQUIRED = os.environ.get("SHARDIO_PROMETHEUS", "") == "required"
OUTCOME = pytest.fail.Exception if REQUIRED else pytest.skip.Exception


def test_a_missing_binary_skips_or_fails_under_required(
    require_binary: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert require_binary("promtool")  # found where it is installed
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no binaries
    with pytest.raises(OUTCOME, match="promtool is not installed"):
        require_binary("promtool")


def test_a_server_that_cannot_start_skips_or_fails_under_required(
    start_prometheus: Any,
) -> None:
    with pytest.raises(OUTCOME, match="prometheus exited with"):
        start_prometheus({"global": {"scrape_interval": "not a duration"}})


def test_a_server_listens_on_127_0_0_1_only(start_prometheus: Any) -> None:
    prom = start_prometheus({"global": {"scrape_interval": "1s"}})
    assert prom.query("vector(1)")[0]["value"][1] == "1"
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            next(fh)
            for line in fh:
                local, state = line.split()[1], line.split()[3]
                addr, _, port = local.partition(":")
                if state == "0A" and int(port, 16) == prom.port:
                    listening.add(addr)
    assert listening == {"0100007F"}  # 127.0.0.1, nothing else
    prom.stop()
    assert prom.proc.poll() is not None  # reaped
