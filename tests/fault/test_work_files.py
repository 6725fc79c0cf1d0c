"""Damaged work files of an interrupted pack, and dead worker processes.

A damaged done-record or index fragment under ``--resume`` only means "not done": the shard
is written again. A damaged state record, part record, fragment (at merge) or commit record
ends in one ``shardio: error:`` line naming the file, never a traceback. A worker killed by
SIGKILL (the OOM killer) is a PackError telling to rerun with ``--resume``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import types

import pytest

SHARD_SIZE = "256KiB"  # ~27 shards from the small tree
W1 = ("--workers", "1", "--no-progress")
TIMEOUT_S = 120


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDIO_"))}
    env.update(extra)
    return env


def dataset_files(dst: pathlib.Path) -> dict[str, bytes]:
    return {
        p.relative_to(dst).as_posix(): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def reference(packed_small) -> dict[str, bytes]:
    return dataset_files(packed_small("tar", SHARD_SIZE, 1)[0])


# Packs every shard, then dies where the merge would start: all done-records are there.
BEFORE_MERGE = r"""
import os, signal, sys
import shardio.packing.part as run
def merge_locked(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
run.merge_locked = merge_locked
from shardio.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def interrupted(small_tree: pathlib.Path, tmp_path_factory) -> pathlib.Path:
    """A single-part pack of the small tree killed just before its merge."""
    dst = tmp_path_factory.mktemp("interrupted") / "ds"
    proc = subprocess.run(
        [sys.executable, "-c", BEFORE_MERGE, "pack", str(small_tree), str(dst),
         "--shard-size", SHARD_SIZE, *W1],
        capture_output=True, env=_env(), timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert not (dst / "manifest.json").exists()
    return dst


def damage(path: pathlib.Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"\x00\xffgarbage" * 7)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "wrong-type":
        doc = json.loads(data)
        key = "size_bytes" if "size_bytes" in doc else "num_parts" if "num_parts" in doc else "x"
        doc[key] = str(doc.get(key))
        doc["shards"] = "many" if "shards" in doc else doc.get("shards")
        path.write_text(json.dumps(doc))
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "garbage", "wrong-type", "fifo"])
def test_damaged_done_record_means_not_done(
    how: str, interrupted: pathlib.Path, tmp_path: pathlib.Path, small_tree, reference, run_cli
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(interrupted, dst, symlinks=True)
    record = dst / ".shardio-work" / "frag" / "shard-000003.json"
    damage(record, how)
    rc, out, err = run_cli("pack", small_tree, dst, "--shard-size", SHARD_SIZE, "--resume", *W1)
    assert rc == 0, err
    n = sum(1 for k in reference if k.endswith(".tar"))
    assert f"reused {n - 1} verified shard(s)" in out, out
    assert str(record) in err and "writing shard shard-000003 again" in err, err
    assert dataset_files(dst) == reference


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_damaged_fragment_under_resume_rewrites_the_shard(
    how: str, interrupted: pathlib.Path, tmp_path: pathlib.Path, small_tree, reference, run_cli
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(interrupted, dst)
    damage(dst / ".shardio-work" / "frag" / "shard-000005.index", how)
    rc, out, err = run_cli("pack", small_tree, dst, "--shard-size", SHARD_SIZE, "--resume", *W1)
    assert rc == 0, err
    n = sum(1 for k in reference if k.endswith(".tar"))
    assert f"reused {n - 1} verified shard(s)" in out, out
    assert dataset_files(dst) == reference


@pytest.mark.parametrize("how", ["truncated", "garbage", "wrong-type", "fifo"])
def test_damaged_state_record_is_one_line_naming_it(
    how: str,
    interrupted: pathlib.Path,
    tmp_path: pathlib.Path,
    small_tree,
    run_cli,
    assert_cli_error,
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(interrupted, dst)
    state = dst / ".shardio-work" / "state-0000-of-0001.json"
    damage(state, how)
    for flag in ("--resume", "--force"):
        result = run_cli("pack", small_tree, dst, "--shard-size", SHARD_SIZE, flag, *W1)
        assert result.rc == 1
        assert_cli_error(result, str(state))
        assert not (dst / "manifest.json").exists()


# --------------------------------------------------------------------------- merge


@pytest.fixture(scope="module")
def two_parts(small_tree: pathlib.Path, tmp_path_factory) -> pathlib.Path:
    dst = tmp_path_factory.mktemp("parts") / "ds"
    for part in ("0/2", "1/2"):
        proc = subprocess.run(
            [sys.executable, "-m", "shardio", "pack", str(small_tree), str(dst), "--part", part,
             "--shard-size", SHARD_SIZE, *W1],
            capture_output=True, env=_env(), timeout=TIMEOUT_S, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode()
    return dst


@pytest.mark.parametrize("how", ["truncated", "garbage", "wrong-type", "empty"])
def test_damaged_part_record_stops_the_merge(
    how: str, two_parts: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(two_parts, dst)
    record = dst / ".shardio-work" / "part-0001-of-0002.json"
    damage(record, how)
    before = dataset_files(dst)
    result = run_cli("merge", dst)
    assert result.rc == 1
    assert_cli_error(result, str(record), "part record")
    assert dataset_files(dst) == before


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_damaged_fragment_stops_the_merge_until_its_part_is_resumed(
    how: str,
    two_parts: pathlib.Path,
    tmp_path: pathlib.Path,
    small_tree,
    run_cli,
    assert_cli_error,
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(two_parts, dst)
    fragment = dst / ".shardio-work" / "frag" / "shard-p0001-000002.index"
    damage(fragment, how)
    result = run_cli("merge", dst)
    assert result.rc == 1
    assert_cli_error(result, str(fragment), "--resume", "1/2")
    assert not (dst / "manifest.json").exists()

    rc, _out, err = run_cli(
        "pack", small_tree, dst, "--part", "1/2", "--shard-size", SHARD_SIZE, "--resume", *W1
    )
    assert rc == 0, err
    rc, _, err = run_cli("merge", dst)
    assert rc == 0, err
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def test_damaged_commit_record_is_one_line_naming_it(
    packed_small, tmp_path: pathlib.Path, small_tree, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(packed_small("tar", SHARD_SIZE, 1)[0], dst)
    commit = dst / ".shardio-work" / "commit.json"
    commit.parent.mkdir()
    commit.write_text(json.dumps({"remove": ["../../../etc/passwd"], "move": []}))
    result = run_cli("pack", small_tree, dst, "--force", *W1)
    assert result.rc == 1
    assert_cli_error(result, str(commit))
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


# --------------------------------------------------------------------------- dead workers

HOOKS = r"""
import os, signal
import shardio.packing.write as write

_real = write.write_shard

def write_shard(job, counters=None):
    if job.plan.seq == 4:  # the OOM killer picks this worker
        os.kill(os.getpid(), signal.SIGKILL)
    return _real(job, counters)
"""

KILL_WORKER = r"""
import sys
import hooks
import shardio.packing.part as run
run.write_shard = hooks.write_shard
from shardio.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_worker_killed_by_sigkill_is_a_pack_error(
    tmp_path: pathlib.Path, small_tree, reference, run_cli, assert_cli_error
) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "hooks.py").write_text(HOOKS)
    dst = tmp_path / "ds"
    argv = ["pack", str(small_tree), str(dst), "--shard-size", SHARD_SIZE, "--workers", "2"]
    proc = subprocess.run(
        [sys.executable, "-c", KILL_WORKER, *argv, "--no-progress"],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
        env=_env(PYTHONPATH=os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])),
    )  # fmt: skip
    result = types.SimpleNamespace(rc=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
    assert result.rc == 1
    assert_cli_error(result, "a pack worker process died", "rerun with --resume")
    assert not (dst / "manifest.json").exists()

    rc, _out, err = run_cli(*argv, "--resume", "--no-progress")
    assert rc == 0, err
    assert dataset_files(dst) == reference
