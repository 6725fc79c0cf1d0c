"""``pack --force`` over an existing dataset: the old one stays until the new one is complete,
and a replacement killed at any point is finished by the next ``--force`` or ``--resume``.

The old dataset is the small tree as 256 KiB tar shards; the new one the same tree as 1 MiB
HDF5 shards, so every old file goes and none is replaced by name. A finished replacement
must be byte-identical to a fresh pack with the new options, with nothing else left behind.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
from killing import run_then_kill

from shardio.errors import StorageError
from shardio.format.manifest import load_manifest
from shardio.packing.run import PackOptions, pack

OLD = ("--shard-size", "256KiB")
NEW = ("--shard-size", "1MiB", "--format", "hdf5")
W1 = ("--workers", "1", "--no-progress")
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDIO_"))}


def dataset_files(dst: pathlib.Path) -> dict[str, bytes]:
    """Every file under dst (hidden ones included), by relative path, with its bytes."""
    return {
        p.relative_to(dst).as_posix(): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()
    }


def run_and_kill(argv: list[str], until: Callable[[], bool]) -> bool:
    """Run argv until ``until()`` holds, then SIGKILL the pack and its workers. Returns
    whether the command finished first."""
    return run_then_kill(argv, until, env=_env(), timeout_s=TIMEOUT_S)


@pytest.fixture
def old_dataset(packed_small, tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, bytes]]:
    dst = tmp_path / "ds"
    shutil.copytree(packed_small("tar", "256KiB", 1)[0], dst)
    return dst, dataset_files(dst)


@pytest.fixture(scope="module")
def new_reference(packed_small) -> dict[str, bytes]:
    return dataset_files(packed_small("hdf5", "1MiB", 1)[0])


def assert_old_intact(dst: pathlib.Path, old: dict[str, bytes], run_cli) -> None:
    got = {k: v for k, v in dataset_files(dst).items() if not k.startswith(".shardio-work/")}
    assert got == old, "the old dataset changed before the new one was complete"
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def finish_and_check(
    src: pathlib.Path, dst: pathlib.Path, how: str, reference: dict[str, bytes], run_cli
) -> None:
    rc, _out, err = run_cli("pack", src, dst, how, *NEW, *W1)
    assert rc == 0, err
    assert "Traceback" not in err
    assert dataset_files(dst) == reference  # exactly the new dataset, nothing else
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def test_force_replaces_a_dataset(
    old_dataset, small_tree: pathlib.Path, new_reference, run_cli
) -> None:
    dst, _ = old_dataset
    finish_and_check(small_tree, dst, "--force", new_reference, run_cli)


def test_a_failed_force_keeps_the_old_dataset(
    old_dataset, small_tree: pathlib.Path, monkeypatch: pytest.MonkeyPatch, run_cli
) -> None:
    import shardio.packing.part as run

    dst, old = old_dataset
    real, calls = run.write_shard, [0]

    def failing(job, counters=None):
        calls[0] += 1
        if calls[0] == 3:
            raise StorageError(28, f"no space left on device while writing {job.plan.name}")
        return real(job, counters)

    monkeypatch.setattr(run, "write_shard", failing)
    options = PackOptions(shard_format="hdf5", shard_size_bytes=1 << 20, force=True)
    with pytest.raises(StorageError, match="no space left"):
        pack(str(small_tree), str(dst), options)
    monkeypatch.undo()
    assert_old_intact(dst, old, run_cli)
    assert load_manifest(dst / "manifest.json").shard_format == "tar"


@pytest.mark.parametrize("how", ["--force", "--resume"])
def test_kill_while_packing_the_replacement(
    how: str, old_dataset, small_tree: pathlib.Path, new_reference, run_cli
) -> None:
    dst, old = old_dataset
    nxt = dst / ".shardio-work" / "next" / "shards"

    def two_new_shards() -> bool:
        try:
            return sum(1 for n in os.listdir(nxt) if n.endswith(".h5")) >= 2
        except FileNotFoundError:
            return False

    argv = [sys.executable, "-m", "shardio", "pack", str(small_tree), str(dst), "--force"]
    if run_and_kill([*argv, *NEW, *W1], two_new_shards):
        pytest.skip("the replacement finished before the kill landed")
    assert_old_intact(dst, old, run_cli)
    finish_and_check(small_tree, dst, how, new_reference, run_cli)


# Runs the CLI with one step of the replacement patched to SIGKILL the process there.
DRIVER = r"""
import os, signal, sys

def die():
    os.kill(os.getpid(), signal.SIGKILL)

point = sys.argv[1]
if point == "before-commit":
    import shardio.packing.run as run
    def commit_replacement(*args, **kwargs):
        die()
    run.commit_replacement = commit_replacement
else:
    import shardio.packing.replace as replace
    def reached(name):
        if name == point:
            die()
    replace._reached = reached

from shardio.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

POINTS = [
    "before-commit",  # the new dataset is complete in next/, no commit record yet
    "commit-recorded",  # commit.json written, nothing changed yet
    "commit-old-manifest-removed",
    "commit-old-files-removed",
    "commit-half-moved",  # half of the new files moved in
    "commit-new-manifest-in",  # only the work dir is left to remove
]


@pytest.mark.parametrize("how", ["--force", "--resume"])
@pytest.mark.parametrize("point", POINTS)
def test_kill_during_the_commit(
    point: str,
    how: str,
    old_dataset,
    small_tree: pathlib.Path,
    new_reference,
    run_cli,
    assert_cli_error,
) -> None:
    dst, old = old_dataset
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, point, "pack", str(small_tree), str(dst), "--force",
         *NEW, *W1],
        capture_output=True, env=_env(), timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    if point in ("before-commit", "commit-recorded"):
        assert_old_intact(dst, old, run_cli)
    elif point == "commit-new-manifest-in":
        assert load_manifest(dst / "manifest.json").shard_format == "hdf5"
        rc, _, err = run_cli("verify", dst, *W1)
        assert rc == 0, err
    else:  # half-way: nothing may look complete
        assert not (dst / "manifest.json").exists()
        result = run_cli("verify", dst, *W1)
        assert result.rc != 0
    if point != "before-commit":
        # A plain pack does not guess: it names the two ways to finish.
        before = dataset_files(dst)
        result = run_cli("pack", small_tree, dst, *NEW, *W1)
        assert result.rc == 2
        assert_cli_error(result, "interrupted half-way", "--force", "--resume")
        assert dataset_files(dst) == before
    finish_and_check(small_tree, dst, how, new_reference, run_cli)
