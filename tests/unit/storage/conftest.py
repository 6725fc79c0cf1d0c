"""Fixtures for storage tests: recording fakes of lfs and beegfs-ctl first on PATH."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from fakebins import fake_path, read_calls

FAKE_PATH = fake_path("lfs", "beegfs-ctl")


@dataclass(frozen=True, kw_only=True)
class FakeCommands:
    """Handle on the recording fakes of ``lfs`` and ``beegfs-ctl`` (tests/fakebin).

    Attributes:
        log_path: the file the fakes append one tab-separated argv per invocation to.
    """

    log_path: Path
    monkeypatch: pytest.MonkeyPatch

    def calls(self) -> list[list[str]]:
        """Return every recorded invocation, command name first, in order."""
        return read_calls(self.log_path)

    def fail_with(self, returncode: int) -> None:
        """Make every later fake invocation exit with ``returncode``."""
        self.monkeypatch.setenv("SHARDIO_FAKE_RC", str(returncode))

    def set_ost_count(self, count: int) -> None:
        """Make ``lfs df`` list ``count`` OSTs instead of 4."""
        self.monkeypatch.setenv("SHARDIO_FAKE_OSTS", str(count))


@pytest.fixture
def fake_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCommands:
    """Put the fakes of ``lfs`` and ``beegfs-ctl`` first on ``PATH`` with a fresh call log."""
    log_path = tmp_path / "fake-commands.log"
    monkeypatch.setenv("PATH", f"{FAKE_PATH}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("SHARDIO_FAKE_LOG", str(log_path))
    monkeypatch.delenv("SHARDIO_FAKE_RC", raising=False)
    monkeypatch.delenv("SHARDIO_FAKE_OSTS", raising=False)
    return FakeCommands(log_path=log_path, monkeypatch=monkeypatch)
