"""``make stage-nvme``, the job prologue, run from the project root as users run it."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

from shardio.cli.main import default_stage_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # the install step is a no-op once the venv's stamp exists, else slow

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _make(child_env, *variables: str, env: dict[str, str] | None = None):
    return subprocess.run(
        ["make", "-C", str(REPO), "--no-print-directory", "stage-nvme", *variables],
        capture_output=True,
        text=True,
        env=child_env(env),
        timeout=TIMEOUT_S,
        check=False,
    )


def test_stage_nvme_with_data_and_dir(big_src, tmp_path, child_env, helpers):
    dest = tmp_path / "nvme" / "job"
    proc = _make(child_env, f"SHARDIO_DATA={big_src.path}", f"SHARDIO_STAGE_DIR={dest}",
                 "SHARDIO_STAGE_ARGS=--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert re.search(
        rf"of {big_src.num_shards} shards .* copied {big_src.num_shards} ", proc.stdout
    ), proc.stdout
    big_src.assert_staged_ok(dest, set(big_src.rels))
    assert helpers.temp_files(dest) == []


def test_stage_nvme_without_data_fails_clearly(tmp_path, child_env):
    proc = _make(child_env, f"SHARDIO_STAGE_DIR={tmp_path / 'x'}")
    assert proc.returncode != 0
    assert "make stage-nvme: set SHARDIO_DATA=/path/to/dataset" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()


def test_stage_nvme_defaults_to_tmpdir(big_src, tmp_path, child_env):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = _make(
        child_env,
        f"SHARDIO_DATA={big_src.path}",
        "SHARDIO_STAGE_ARGS=--no-progress",
        env={"TMPDIR": str(scratch)},
    )
    assert proc.returncode == 0, proc.stderr
    dest = scratch / f"shardio-{big_src.path.name}"
    assert str(dest) in proc.stdout, proc.stdout
    big_src.assert_staged_ok(dest, set(big_src.rels))
    assert sorted(os.listdir(scratch)) == [dest.name]


def test_default_stage_dir_order():
    """$SLURM_TMPDIR, then $TMPDIR, then /mnt/nvme/$USER/$SLURM_JOB_ID, + /shardio-<name>."""
    env = {"SLURM_TMPDIR": "/a", "TMPDIR": "/b", "USER": "u", "SLURM_JOB_ID": "9"}
    assert default_stage_dir("/data/imagenet/", env) == "/a/shardio-imagenet"
    del env["SLURM_TMPDIR"]
    assert default_stage_dir("/data/imagenet", env) == "/b/shardio-imagenet"
    del env["TMPDIR"]
    assert default_stage_dir("/data/imagenet", env) == "/mnt/nvme/u/9/shardio-imagenet"
