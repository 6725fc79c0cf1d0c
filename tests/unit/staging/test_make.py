"""``make stage-nvme``, the job prologue, run from the project root as users run it."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import shutil
import stat
import subprocess

import pytest

from shardio.cli.stage import default_stage_dir as cli_default_stage_dir
from shardio.errors import UsageError
from shardio.staging import default_stage_dir

REPO = pathlib.Path(__file__).resolve().parents[3]
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
    private = scratch / f"shardio-{os.getuid()}-nojob"
    dest = private / f"{big_src.path.name}-{_source_hash(big_src.path)}"
    assert str(dest) in proc.stdout, proc.stdout
    big_src.assert_staged_ok(dest, set(big_src.rels))
    assert sorted(os.listdir(scratch)) == [private.name]
    assert stat.S_IMODE(os.lstat(private).st_mode) == 0o700


def _source_hash(path: str | os.PathLike[str]) -> str:
    """8 hex digits of the SHA-256 of the source's real path, as the docs give it."""
    return hashlib.sha256(os.fsencode(os.path.realpath(path))).hexdigest()[:8]


def test_default_stage_dir_order(tmp_path):
    """$SLURM_TMPDIR, then $TMPDIR, then /mnt/nvme; + /shardio-<uid>-<job or nojob>/
    <name>-<hash>, the private directory made with mode 0700."""
    h = _source_hash("/data/imagenet")
    uid = os.getuid()
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    env = {"SLURM_TMPDIR": str(first), "TMPDIR": str(second), "USER": "u", "SLURM_JOB_ID": "9"}
    got = default_stage_dir("/data/imagenet/", env)
    assert got == f"{first}/shardio-{uid}-9/imagenet-{h}"
    assert stat.S_IMODE(os.lstat(first / f"shardio-{uid}-9").st_mode) == 0o700
    assert not os.path.exists(got), "only the private directory is made"
    assert cli_default_stage_dir("/data/imagenet/", env) == got  # the CLI's is the same
    del env["SLURM_TMPDIR"]
    assert default_stage_dir("/data/imagenet", env) == f"{second}/shardio-{uid}-9/imagenet-{h}"
    del env["SLURM_JOB_ID"]
    got = default_stage_dir("/data/imagenet", env)
    assert got == f"{second}/shardio-{uid}-nojob/imagenet-{h}"
    del env["TMPDIR"]
    env["SLURM_JOB_ID"] = "9"
    if os.path.isdir("/mnt/nvme"):
        assert default_stage_dir("/data/imagenet", env).startswith(f"/mnt/nvme/shardio-{uid}-9/")
    else:
        with pytest.raises(UsageError, match=f"/mnt/nvme/shardio-{uid}-9"):
            default_stage_dir("/data/imagenet", env)


def test_default_stage_dir_names_no_escape(tmp_path):
    """The name comes from the source's absolute path: `..` or a bad job id cannot lead
    the staging area out of the private directory."""
    env = {"TMPDIR": str(tmp_path)}
    private = f"{tmp_path}/shardio-{os.getuid()}-nojob"
    got = default_stage_dir(os.path.join(str(tmp_path), "x", "data", ".."), env)
    assert got == f"{private}/x-{_source_hash(tmp_path / 'x')}"
    with pytest.raises(UsageError, match="SLURM_JOB_ID"):
        default_stage_dir("/data/imagenet", {**env, "SLURM_JOB_ID": "../../etc"})
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(private)]


def _hostile_private_dir(base: pathlib.Path, kind: str) -> tuple[pathlib.Path, pathlib.Path]:
    """Pre-create ``base/shardio-<uid>-nojob`` the way another user could; return it and
    the directory whose content must not change."""
    private = base / f"shardio-{os.getuid()}-nojob"
    elsewhere = base / "attacker"
    elsewhere.mkdir()
    if kind == "symlink":
        private.symlink_to(elsewhere, target_is_directory=True)
        return private, elsewhere
    private.mkdir()
    if kind == "world-writable":
        os.chmod(private, 0o777)
    elif kind == "group-writable":
        os.chmod(private, 0o770)
    elif kind == "other-owner":
        os.chown(private, os.getuid() + 4242, -1)
    else:
        raise AssertionError(kind)
    return private, private


HOSTILE = ["symlink", "world-writable", "group-writable", "other-owner"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_default_stage_dir_refuses_a_pre_created_hostile_dir(tmp_path, kind):
    if kind == "other-owner" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    private, watched = _hostile_private_dir(tmp_path, kind)
    reason = {
        "symlink": "symlink",
        "world-writable": "writable by other users",
        "group-writable": "writable by other users",
        "other-owner": "owned by uid",
    }[kind]
    with pytest.raises(UsageError, match=reason) as info:
        default_stage_dir("/data/imagenet", {"TMPDIR": str(tmp_path)})
    assert str(private) in str(info.value)
    assert os.listdir(watched) == []


@pytest.mark.parametrize("kind", ["symlink", "world-writable"])
def test_stage_without_dest_refuses_a_hostile_dir(
    big_src, tmp_path, run_cli, assert_cli_error, kind
):
    """`shardio stage SRC` with a planted directory at the default place: one error line,
    nothing written there."""
    private, watched = _hostile_private_dir(tmp_path, kind)
    result = run_cli("stage", big_src.path, "--no-progress", env={"TMPDIR": str(tmp_path)})
    assert_cli_error(result, str(private))
    assert os.listdir(watched) == []


def test_default_stage_dir_differs_per_source_of_one_name(tmp_path):
    """/x/a/train and /x/b/train: two default areas (the defect: one, shared), named by the
    source's name and a hash of its real path; a symlink to a source shares its hash."""
    env = {"TMPDIR": str(tmp_path)}
    for sub in ("a", "b"):
        (tmp_path / "x" / sub / "train").mkdir(parents=True)
    first = default_stage_dir(tmp_path / "x" / "a" / "train", env)
    second = default_stage_dir(tmp_path / "x" / "b" / "train", env)
    assert first != second
    assert os.path.basename(first).startswith("train-")
    assert os.path.basename(second).startswith("train-")
    (tmp_path / "link").symlink_to(tmp_path / "x" / "a" / "train")
    linked = default_stage_dir(tmp_path / "link", env)
    assert os.path.basename(linked) == f"link-{os.path.basename(first)[len('train-') :]}"


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils")
def test_default_stage_dir_hash_is_the_documented_shell_line(tmp_path):
    """The shell line the staging guide and job scripts use gives the same hash."""
    src = tmp_path / "données" / "train"
    src.mkdir(parents=True)
    line = 'printf %s "$(realpath -m -- "$1")" | sha256sum | cut -c1-8'
    proc = subprocess.run(
        ["bash", "-c", line, "hash", str(src)], capture_output=True, text=True, check=True
    )
    got = default_stage_dir(src, {"TMPDIR": str(tmp_path)})
    assert got.endswith(f"/train-{proc.stdout.strip()}")
