"""Tests for the default command runner, on real processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardio.errors import CommandNotFoundError, StorageError, UsageError
from shardio.storage.runner import CommandResult, run_command


def test_captures_stdout_stderr_and_exit_status() -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    result = run_command([sys.executable, "-c", code])
    assert result.argv == (sys.executable, "-c", code)
    assert result.returncode == 3
    assert not result.ok
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"


def test_success_is_ok() -> None:
    result = run_command((sys.executable, "-c", "print('h\u00e9llo')"))
    assert result.ok
    assert result.stdout == "h\u00e9llo\n"


def test_missing_command_raises_command_not_found_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CommandNotFoundError) as info:
        run_command(["lfs", "df"])
    message = str(info.value)
    assert message == "lfs not found on PATH"
    assert isinstance(info.value, StorageError)
    assert isinstance(info.value, OSError)


def test_timeout_raises_storage_error_naming_command() -> None:
    with pytest.raises(StorageError, match=r"timed out after 0\.2s") as info:
        run_command([sys.executable, "-c", "import time; time.sleep(10)"], timeout_s=0.2)
    assert sys.executable in str(info.value)
    assert "\n" not in str(info.value)


def test_not_executable_raises_storage_error(tmp_path: Path) -> None:
    script = tmp_path / "tool"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    with pytest.raises(StorageError, match="cannot run"):
        run_command([str(script)])


def test_empty_argv_and_bad_timeout_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        run_command([])
    with pytest.raises(UsageError):
        run_command(["true"], timeout_s=0)


def test_command_result_stores_tuple_and_renders_line() -> None:
    result = CommandResult(argv=["lfs", "df", "/a b"], returncode=0, stdout="", stderr="")  # type: ignore[arg-type]
    assert result.argv == ("lfs", "df", "/a b")
    assert result.command_line == "lfs df '/a b'"
    with pytest.raises(UsageError):
        CommandResult(argv=(), returncode=0, stdout="", stderr="")
