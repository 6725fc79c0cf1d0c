"""Malformed rank variables through the CLI and ShardDataset: one line naming the variable.

``pack --part auto``, ``stage --node auto`` (and its default ``--ranks-per-node``), ``topo``
and a ShardDataset under SLURM all read rank variables; each malformed or inconsistent one
is refused (exit 2 from the CLI), never read as "rank 0 of 1" or "node 0 of 1".
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest
from fakesysfs import fake_sysfs

BAD = ["-1", "abc", "\u00b2", "\u0663", "1" * 5000, "+1", " 1", "1_000", ""]


@pytest.fixture
def src(tmp_path: pathlib.Path) -> pathlib.Path:
    tree = tmp_path / "src" / "cls"
    tree.mkdir(parents=True)
    (tree / "a.bin").write_bytes(b"x" * 100)
    return tmp_path / "src"


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_pack_part_auto_refuses_a_malformed_slurm_procid(
    run_cli: Callable[..., Any],
    assert_cli_error: Callable[..., str],
    src: pathlib.Path,
    tmp_path: pathlib.Path,
    value: str,
) -> None:
    env = {"SLURM_PROCID": value, "SLURM_NTASKS": "4"}
    result = run_cli("pack", src, tmp_path / "out", "--part", "auto", "--no-progress", env=env)
    line = assert_cli_error(result, "SLURM_PROCID=")
    assert result.rc == 2
    assert len(line) < 300  # 5,000 digits are shown cut
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "\u00b2"}, "SLURM_NTASKS="),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "SLURM_NTASKS=0"),
    ],
)
def test_pack_part_auto_refuses_an_inconsistent_pair(
    run_cli: Callable[..., Any],
    assert_cli_error: Callable[..., str],
    src: pathlib.Path,
    tmp_path: pathlib.Path,
    env: dict[str, str],
    needle: str,
) -> None:
    result = run_cli("pack", src, tmp_path / "out", "--part", "auto", "--no-progress", env=env)
    assert_cli_error(result, needle)
    assert result.rc == 2


@pytest.mark.parametrize("part", ["\u0663/4", "1/\u00b2", "1_0/20", " 1/4", "-1/4", "1/0"])
def test_pack_part_takes_ascii_digits_only(
    run_cli: Callable[..., Any],
    assert_cli_error: Callable[..., str],
    src: pathlib.Path,
    tmp_path: pathlib.Path,
    part: str,
) -> None:
    result = run_cli("pack", src, tmp_path / "out", f"--part={part}", "--no-progress")
    assert_cli_error(result, "invalid --part")
    assert result.rc == 2


@pytest.mark.parametrize("var", ["SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"])
def test_pack_refuses_a_malformed_cpu_count(
    run_cli: Callable[..., Any],
    assert_cli_error: Callable[..., str],
    src: pathlib.Path,
    tmp_path: pathlib.Path,
    var: str,
) -> None:
    result = run_cli("pack", src, tmp_path / "out", "--no-progress", env={var: "\u00b2"})
    assert_cli_error(result, f"{var}=")
    assert result.rc == 2


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SLURM_NODEID": "abc", "SLURM_NNODES": "2"}, "SLURM_NODEID='abc'"),
        ({"SLURM_NODEID": "-1", "SLURM_NNODES": "2"}, "SLURM_NODEID='-1'"),
        ({"SLURM_NODEID": "2", "SLURM_NNODES": "2"}, "SLURM_NODEID=2 is not below SLURM_NNODES"),
        ({"SLURM_NODEID": "0", "SLURM_NNODES": "1" * 5000}, "5,000 characters"),
        ({"SLURM_NODEID": "1"}, "only SLURM_NODEID is set"),
        ({"SLURM_NTASKS_PER_NODE": "4,2"}, "give --ranks-per-node"),
        ({"SLURM_NTASKS_PER_NODE": "x"}, "SLURM_NTASKS_PER_NODE='x'"),
    ],
)
def test_stage_node_auto_refuses_malformed_slurm_variables(
    run_cli: Callable[..., Any],
    assert_cli_error: Callable[..., str],
    tmp_path: pathlib.Path,
    env: dict[str, str],
    needle: str,
) -> None:
    dest = tmp_path / "area"
    result = run_cli("stage", tmp_path / "ds", dest, "--no-progress", env=env)
    assert_cli_error(result, needle)
    assert result.rc == 2
    assert not dest.exists()


@pytest.mark.parametrize("var", ["SLURM_LOCALID", "LOCAL_RANK"])
def test_topo_refuses_a_malformed_local_rank(
    run_cli: Callable[..., Any],
    assert_cli_error: Callable[..., str],
    tmp_path: pathlib.Path,
    var: str,
) -> None:
    sysfs = fake_sysfs(tmp_path / "sys", {0: "0"}, [0])
    result = run_cli("topo", "--sysfs", sysfs, env={var: "\u0663"})
    assert_cli_error(result, f"{var}=")
    assert result.rc == 2


def test_shard_dataset_refuses_a_malformed_rank_instead_of_reading_everything(
    packed_small: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardio.errors import UsageError
    from shardio.runtime.dataset import ShardDataset

    ds, _ = packed_small()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "1")
    quarter = ShardDataset(str(ds)).samples_per_rank()
    monkeypatch.setenv("SLURM_PROCID", "-1")
    with pytest.raises(UsageError, match=r"SLURM_PROCID='-1'"):
        ShardDataset(str(ds)).samples_per_rank()
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.delenv("SLURM_NTASKS")
    assert ShardDataset(str(ds)).samples_per_rank() > quarter  # one rank reads it all
