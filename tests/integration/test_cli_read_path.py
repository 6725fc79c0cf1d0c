"""``shardio inspect`` and ``shardio bench`` show the filesystem and the read strategy in use.

On the local disk here; tests/pfs/test_pfs_metadata.py checks the same on the MooseFS bed.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from shardio.read.strategy import choose_strategy
from shardio.storage.fsdetect import describe_fs

BENCH = ("--compute-ms", "0", "--workers", "0", "--batch", "32", "--epochs", "1")


@pytest.fixture(scope="module")
def dataset(packed_small: Any) -> pathlib.Path:
    dst, result = packed_small("tar", "256KiB", 1)
    assert result.rc == 0, result.stderr
    return dst


def test_inspect_text_names_the_filesystem_and_the_strategy(
    dataset: pathlib.Path, run_cli: Any
) -> None:
    result = run_cli("inspect", dataset, env={"SHARDIO_READ_STRATEGY": ""})
    assert (result.rc, result.stderr) == (0, "")
    lines = {ln[:14]: ln[14:] for ln in result.stdout.splitlines()}
    choice = choose_strategy(dataset, environ={})
    assert lines["filesystem    "] == describe_fs(dataset).describe()
    assert lines["read strategy "] == f"{choice.describe()}: {choice.strategy.describe()}"
    if not choice.fs.network:  # pytest's tmp dir on a local disk, as here
        assert lines["read strategy "].startswith("local (auto: ")


@pytest.mark.parametrize("override", ["pfs", "local", " PFS "])
def test_inspect_json_follows_the_environment_override(
    dataset: pathlib.Path, run_cli: Any, override: str
) -> None:
    result = run_cli("inspect", dataset, "--json", env={"SHARDIO_READ_STRATEGY": override})
    assert (result.rc, result.stderr) == (0, "")
    info = json.loads(result.stdout)
    fs = describe_fs(dataset)
    assert info["filesystem"] == fs.name
    assert info["filesystem_detail"] == {
        "name": fs.name,
        "description": fs.describe(),
        "network": fs.network,
        "mount_point": fs.mount_point,
        "mount_type": fs.mount_type,
        "source": fs.source,
    }
    strategy = info["read_strategy"]
    assert strategy["name"] == override.strip().lower()
    assert strategy["reason"] == f"SHARDIO_READ_STRATEGY={override.strip().lower()}"
    assert strategy["description"].startswith(strategy["name"] + " (")


def test_inspect_with_an_invalid_strategy_is_one_error_line(
    dataset: pathlib.Path, run_cli: Any, assert_cli_error: Any
) -> None:
    result = run_cli("inspect", dataset, env={"SHARDIO_READ_STRATEGY": "x" * 5000})
    line = assert_cli_error(result, "SHARDIO_READ_STRATEGY", "auto, local, pfs")
    assert len(line) < 200  # the huge value is cut


def test_bench_shows_the_filesystem_and_the_strategy(dataset: pathlib.Path, run_cli: Any) -> None:
    result = run_cli("bench", dataset, *BENCH, env={"SHARDIO_READ_STRATEGY": "local"})
    assert result.rc == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"bench {dataset}: ")
    assert lines[1] == f"  filesystem     {describe_fs(dataset).describe()}"
    assert lines[2].startswith("  read strategy  local (SHARDIO_READ_STRATEGY=local): local (")

    result = run_cli("bench", dataset, "--json", *BENCH, env={"SHARDIO_READ_STRATEGY": "pfs"})
    assert result.rc == 0, result.stderr
    settings = json.loads(result.stdout)["settings"]
    assert settings["filesystem"] == describe_fs(dataset).describe()
    assert settings["read_strategy"].startswith("pfs (SHARDIO_READ_STRATEGY=pfs): pfs (")
