"""scripts/beeond/beeond_stage.sh with recording fakes of `beeond` and `scontrol`.

A real BeeOND cannot run here (root, BeeGFS services, several nodes): the fake `beeond`
records its argv and creates the -c mount point as a plain directory, so the stage step
writes a real, verifiable copy into it.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import pytest

from shardio import RankInfo, ShardDataset, verify_dataset

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "beeond" / "beeond_stage.sh"
NODES = ["node01", "node02", "node03", "node04"]
JOB_ID = "4242"


def private_dir(mount: str | pathlib.Path) -> pathlib.Path:
    """The job's private directory on the BeeOND mount, where shardio stages."""
    return pathlib.Path(mount) / f"shardio-{os.getuid()}-{JOB_ID}"


def area_name(name: str, src: str | pathlib.Path) -> str:
    """The area's name in it: the source's name and 8 hex digits of the SHA-256 of its
    real path (shardio.staging.default_stage_dir)."""
    return f"{name}-{hashlib.sha256(os.fsencode(os.path.realpath(src))).hexdigest()[:8]}"


@pytest.fixture
def beeond_env(tmp_path: pathlib.Path) -> dict[str, str]:
    """A job of 4 nodes with BeeOND's data dir and mount point under tmp_path."""
    return {
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST": "node[01-04]",
        "BEEOND_DATA_DIR": str(tmp_path / "nvme" / "beeond"),
        "BEEOND_MOUNT": str(tmp_path / "mnt" / "beeond"),
        "BEEOND_NODEFILE": str(tmp_path / "beeond-nodes"),
        "SHARDIO_FAKE_BEEOND_MOUNT": str(tmp_path / "mnt" / "beeond"),
    }


def test_start_stage_stop(
    run_script: Callable[..., Any],
    beeond_env: dict[str, str],
    tiny_dataset: pathlib.Path,
    tiny_source_files: list[bytes],
) -> None:
    nodefile = beeond_env["BEEOND_NODEFILE"]
    mount = pathlib.Path(beeond_env["BEEOND_MOUNT"])

    started = run_script([SCRIPT, "start"], env=beeond_env)
    assert started.rc == 0, started.stderr
    assert started.calls == [
        ["scontrol", "show", "hostnames", "node[01-04]"],
        ["beeond", "start", "-n", nodefile, "-d", beeond_env["BEEOND_DATA_DIR"], "-c",
         str(mount), "-P"],
    ]  # fmt: skip
    assert pathlib.Path(nodefile).read_text().split() == NODES
    assert mount.is_dir()

    staged = run_script([SCRIPT, "stage", tiny_dataset], env=beeond_env)
    assert staged.rc == 0, staged.stderr
    dest = private_dir(mount) / area_name("tiny-ds", tiny_dataset)
    assert staged.stdout.strip() == str(dest)  # only the path: DATA=$(... stage SRC)
    assert (private_dir(mount).stat().st_mode & 0o777) == 0o700  # shardio made it private
    assert "staged node 0/1" in staged.stderr
    assert len(staged.calls) == 2  # shardio is the real one, not a fake
    # Every shard is there, byte for byte, and checks against the manifest's xxh3.
    src_shards = sorted(p.relative_to(tiny_dataset) for p in tiny_dataset.glob("shards/*.tar"))
    assert sorted(p.relative_to(dest) for p in dest.glob("shards/*.tar")) == src_shards
    for rel in src_shards:
        assert (dest / rel).read_bytes() == (tiny_dataset / rel).read_bytes()
    report = verify_dataset(str(dest))
    assert report.ok and report.shards_checked == len(src_shards)
    # ...and reads as training would, with per-sample checksums on.
    ds = ShardDataset(str(dest), shuffle=False, verify=True, ranks=RankInfo())
    assert sorted(ds[i]["bin"] for i in range(len(ds))) == tiny_source_files

    stopped = run_script([SCRIPT, "stop"], env=beeond_env)
    assert stopped.rc == 0, stopped.stderr
    assert stopped.calls[-1] == ["beeond", "stop", "-n", nodefile, "-L", "-d", "-P"]
    assert len(stopped.calls) == 3
    assert not pathlib.Path(nodefile).exists()
    assert not mount.exists()  # the fake deletes the data as `-d` would


def test_path_matches_stage(run_script: Callable[..., Any], beeond_env: dict[str, str]) -> None:
    result = run_script([SCRIPT, "path", "/lustre/proj/imagenet-shards/"], env=beeond_env)
    assert result.rc == 0, result.stderr
    name = area_name("imagenet-shards", "/lustre/proj/imagenet-shards")
    assert result.stdout == f"{private_dir(beeond_env['BEEOND_MOUNT'])}/{name}\n"
    assert result.calls == []


@pytest.mark.parametrize("spelling", ["plain", "trailing-slash", "dot-dot", "symlink"])
def test_stage_prints_where_shardio_staged(
    run_script: Callable[..., Any],
    beeond_env: dict[str, str],
    tiny_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
    spelling: str,
) -> None:
    """`path SRC` and `stage SRC` name the area shardio picked, however SRC is spelled."""
    name = "tiny-ds"
    src = str(tiny_dataset)
    if spelling == "trailing-slash":
        src += "/"
    elif spelling == "dot-dot":
        src += "/./shards/.."
    elif spelling == "symlink":
        name = "linked-ds"
        (tmp_path / name).symlink_to(tiny_dataset)  # abspath, not realpath: the link's name
        src = str(tmp_path / name)
    assert run_script([SCRIPT, "start"], env=beeond_env).rc == 0
    path = run_script([SCRIPT, "path", src], env=beeond_env)
    staged = run_script([SCRIPT, "stage", src], env=beeond_env)
    assert staged.rc == 0, staged.stderr
    dest = private_dir(beeond_env["BEEOND_MOUNT"]) / area_name(name, tiny_dataset)
    assert path.stdout == staged.stdout == f"{dest}\n"
    assert (dest / "manifest.json").is_file()


@pytest.mark.parametrize("trap", ["symlink", "writable-by-others"])
def test_stage_refuses_a_planted_private_directory(
    run_script: Callable[..., Any],
    beeond_env: dict[str, str],
    tiny_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
    trap: str,
) -> None:
    """Another user on the job's nodes made shardio-<uid>-<job> on the mount first: nothing
    is staged into it and no path is printed."""
    assert run_script([SCRIPT, "start"], env=beeond_env).rc == 0
    private = private_dir(beeond_env["BEEOND_MOUNT"])
    planted = tmp_path / "planted"
    (planted / "tiny-ds").mkdir(parents=True)
    (planted / "tiny-ds" / "theirs.txt").write_bytes(b"not yours")
    if trap == "symlink":
        private.symlink_to(planted)
    else:
        shutil.copytree(planted, private)
        private.chmod(0o777)
    result = run_script([SCRIPT, "stage", tiny_dataset], env=beeond_env)
    assert result.rc != 0
    assert f"shardio: error: staging directory {private}" in result.stderr
    assert "another user could control it" in result.stderr
    assert result.stdout == ""
    for root in (planted, private):
        assert sorted(p.name for p in root.rglob("*")) == ["theirs.txt", "tiny-ds"]
        assert (root / "tiny-ds" / "theirs.txt").read_bytes() == b"not yours"


def test_stage_fails_when_shardio_stages_elsewhere(
    run_script: Callable[..., Any],
    beeond_env: dict[str, str],
    tiny_dataset: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    """A SHARDIO_BIN that drops SLURM_TMPDIR (env -u) stages somewhere else: the script
    prints no path rather than a wrong one."""
    assert run_script([SCRIPT, "start"], env=beeond_env).rc == 0
    (tmp_path / "elsewhere").mkdir()
    env = beeond_env | {
        "SHARDIO_BIN": f"env -u SLURM_TMPDIR TMPDIR={tmp_path / 'elsewhere'} shardio"
    }
    result = run_script([SCRIPT, "stage", tiny_dataset], env=env)
    assert result.rc == 2
    assert "no staging area at" in result.stderr
    assert result.stdout == ""


def test_without_pdsh_and_with_extra_args(
    run_script: Callable[..., Any], beeond_env: dict[str, str]
) -> None:
    env = beeond_env | {
        "BEEOND_PDSH": "0",
        "BEEOND_START_ARGS": "-f /etc/beegfs -F",
        "BEEOND_STOP_ARGS": "-c",
    }
    assert run_script([SCRIPT, "start"], env=env).rc == 0
    result = run_script([SCRIPT, "stop"], env=env)
    assert result.rc == 0, result.stderr
    nodefile = env["BEEOND_NODEFILE"]
    assert result.calls[1:] == [
        ["beeond", "start", "-n", nodefile, "-d", env["BEEOND_DATA_DIR"], "-c",
         env["BEEOND_MOUNT"], "-f", "/etc/beegfs", "-F"],
        ["beeond", "stop", "-n", nodefile, "-L", "-d", "-c"],
    ]  # fmt: skip


def test_start_needs_a_job(run_script: Callable[..., Any], beeond_env: dict[str, str]) -> None:
    env = beeond_env | {"SLURM_JOB_NODELIST": ""}
    result = run_script([SCRIPT, "start"], env=env)
    assert result.rc == 2
    assert "SLURM_JOB_NODELIST is not set" in result.stderr
    assert result.calls == []


def test_stage_before_start_fails(
    run_script: Callable[..., Any], beeond_env: dict[str, str], tiny_dataset: pathlib.Path
) -> None:
    result = run_script([SCRIPT, "stage", tiny_dataset], env=beeond_env)
    assert result.rc == 2
    assert "run 'beeond_stage.sh start' first" in result.stderr
    assert result.stdout == ""


def test_stage_refuses_to_run_in_every_task(
    run_script: Callable[..., Any],
    beeond_env: dict[str, str],
    tiny_dataset: pathlib.Path,
) -> None:
    assert run_script([SCRIPT, "start"], env=beeond_env).rc == 0
    result = run_script([SCRIPT, "stage", tiny_dataset], env=beeond_env | {"SLURM_PROCID": "3"})
    assert result.rc == 2
    assert "run once from the batch script" in result.stderr
    assert list(pathlib.Path(beeond_env["BEEOND_MOUNT"]).iterdir()) == []


def test_stage_of_a_missing_dataset_fails(
    run_script: Callable[..., Any], beeond_env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    assert run_script([SCRIPT, "start"], env=beeond_env).rc == 0
    result = run_script([SCRIPT, "stage", tmp_path / "no-such-ds"], env=beeond_env)
    assert result.rc != 0
    assert "shardio: error:" in result.stderr
    assert result.stdout == ""


def test_failed_stop_keeps_the_nodefile_and_says_how_to_clean(
    run_script: Callable[..., Any],
    beeond_env: dict[str, str],
    recorded_calls: Callable[[], list[list[str]]],
) -> None:
    assert run_script([SCRIPT, "start"], env=beeond_env).rc == 0
    result = run_script([SCRIPT, "stop"], env=beeond_env | {"SHARDIO_FAKE_RC": "5"})
    assert result.rc == 5
    nodefile = beeond_env["BEEOND_NODEFILE"]
    assert f"stop -n {nodefile} -L -d -c -P" in result.stderr
    assert pathlib.Path(nodefile).exists()
    assert recorded_calls()[-1][:2] == ["beeond", "stop"]


def test_stop_without_start_fails(
    run_script: Callable[..., Any], beeond_env: dict[str, str]
) -> None:
    result = run_script([SCRIPT, "stop"], env=beeond_env)
    assert result.rc == 2
    assert "no node file" in result.stderr
    assert result.calls == []


@pytest.mark.parametrize("argv", [[], ["bogus"], ["stage"], ["start", "extra"]])
def test_usage_errors(
    run_script: Callable[..., Any], beeond_env: dict[str, str], argv: list[str]
) -> None:
    result = run_script([SCRIPT, *argv], env=beeond_env)
    assert result.rc == 2
    assert "usage:" in result.stderr or "unknown action" in result.stderr
    assert result.calls == []
