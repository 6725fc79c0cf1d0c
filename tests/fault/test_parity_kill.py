"""kill -9 during ``pack --parity``, ``parity add``, ``parity drop`` and ``verify --repair``
of a dataset with parity, then a rerun that completes with verified output.

Real SIGKILLs of real ``python -m shardio`` subprocesses (their whole session, workers
included), polled on the files each run publishes, so the kill lands between groups. After
each kill nothing half-written has a final name, readers see the dataset as it was (the
manifest is published last), and the rerun gives the bytes an uninterrupted run gives.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
from killing import run_then_kill
from trees import tree_files

pytest.importorskip("pyeclib")

from shardio.format.manifest import load_manifest
from shardio.tools.verify import verify_dataset

TIMEOUT_S = 120.0
SCHEME = "1+1"  # one group per shard: many groups, so the kill lands between them


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDIO_"))}


def _cli(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, "-m", "shardio", *map(os.fspath, args)]


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {
        k: v
        for k, v in tree_files(root).items()
        if not k.startswith(("parity/.locks/", ".shardio-work/"))
    }


def _count(folder: pathlib.Path, pattern: str) -> int:
    try:
        return sum(1 for p in folder.glob(pattern) if ".shardio-tmp-" not in p.name)
    except FileNotFoundError:
        return 0


def _at_least(folder: pathlib.Path, pattern: str, n: int) -> Callable[[], bool]:
    return lambda: _count(folder, pattern) >= n


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """48 files of 192 KiB: 48 shards of 256 KiB, 48 groups of 1+1."""
    src = tmp_path_factory.mktemp("killtree") / "src"
    for i in range(48):
        path = src / f"c{i % 3}" / f"{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(192 << 10))
    return src


@pytest.fixture(scope="module")
def reference(tree: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The uninterrupted pack --parity."""
    dst = tmp_path_factory.mktemp("ref") / "ds"
    argv = _cli("pack", tree, dst, "--shard-size", "256KiB", "--parity", SCHEME,
                "--workers", "1", "--no-progress")  # fmt: skip
    assert run_then_kill(argv, lambda: False, env=_env(), timeout_s=TIMEOUT_S)
    return dst


def _run(argv: list[str]) -> int:
    done = subprocess.run(argv, env=_env(), capture_output=True, timeout=TIMEOUT_S, check=False)
    return done.returncode


def _no_half_written(root: pathlib.Path, reference: pathlib.Path) -> None:
    """Every parity file with a final name is whole: the bytes the uninterrupted run wrote."""
    folder = root / "parity"
    names = [p.name for p in folder.glob("group-*")] if folder.is_dir() else []
    for name in names:
        if ".shardio-tmp-" not in name:
            assert (folder / name).read_bytes() == (reference / "parity" / name).read_bytes()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_kill_during_pack_parity_then_resume(
    tree: pathlib.Path, reference: pathlib.Path, tmp_path: pathlib.Path, workers: str
) -> None:
    dst = tmp_path / "ds"
    argv = _cli("pack", tree, dst, "--shard-size", "256KiB", "--parity", SCHEME,
                "--workers", workers, "--no-progress")  # fmt: skip
    finished = run_then_kill(argv, _at_least(dst / "parity", "*.cells", 6), env=_env(),
                             timeout_s=TIMEOUT_S)  # fmt: skip
    if not finished:
        assert not (dst / "manifest.json").exists()  # readers see no dataset yet
        _no_half_written(dst, reference)
    assert run_then_kill([*argv, "--resume"], lambda: False, env=_env(), timeout_s=TIMEOUT_S)
    assert _files(dst) == _files(reference) | {
        "manifest.json": _files(dst)["manifest.json"]
    }  # the manifest's created_by/options are the same run's: compared below
    assert (
        load_manifest(dst / "manifest.json").parity
        == load_manifest(reference / "manifest.json").parity
    )
    assert verify_dataset(dst).ok
    assert not (dst / ".shardio-work").exists()


def test_kill_during_parity_add_then_rerun(
    tree: pathlib.Path, reference: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dst = tmp_path / "ds"
    assert run_then_kill(
        _cli("pack", tree, dst, "--shard-size", "256KiB", "--workers", "1", "--no-progress"),
        lambda: False, env=_env(), timeout_s=TIMEOUT_S,
    )  # fmt: skip
    before = (dst / "manifest.json").read_bytes()
    add = _cli("parity", "add", dst, "--parity", SCHEME, "--workers", "1")
    finished = run_then_kill(add, _at_least(dst / "parity", "*.cells", 10), env=_env(),
                             timeout_s=TIMEOUT_S)  # fmt: skip
    if not finished:
        assert (dst / "manifest.json").read_bytes() == before  # readers: no parity yet
        assert verify_dataset(dst).ok
        _no_half_written(dst, reference)
    assert run_then_kill(add, lambda: False, env=_env(), timeout_s=TIMEOUT_S)
    assert {k: v for k, v in _files(dst).items() if k.startswith("parity/")} == {
        k: v for k, v in _files(reference).items() if k.startswith("parity/")
    }
    report = verify_dataset(dst)
    assert report.ok and report.parity_checked == 96
    # A kill during drop: the rerun finishes it.
    drop = _cli("parity", "drop", dst)
    record = dst / ".shardio-work" / "parity-drop.json"
    run_then_kill(drop, record.exists, env=_env(), timeout_s=TIMEOUT_S)
    assert _run(drop) == 0
    assert not (dst / "parity").exists()
    assert verify_dataset(dst).ok


def test_a_killed_add_is_cleaned_up_by_drop(tree: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dst = tmp_path / "ds"
    assert run_then_kill(
        _cli("pack", tree, dst, "--shard-size", "256KiB", "--workers", "1", "--no-progress"),
        lambda: False, env=_env(), timeout_s=TIMEOUT_S,
    )  # fmt: skip
    add = _cli("parity", "add", dst, "--parity", SCHEME, "--workers", "1")
    if run_then_kill(add, _at_least(dst / "parity", "*.cells", 4), env=_env(),
                     timeout_s=TIMEOUT_S):  # fmt: skip
        pytest.skip("the add finished before the kill")
    assert run_then_kill(_cli("parity", "drop", dst), lambda: False, env=_env(),
                         timeout_s=TIMEOUT_S)  # fmt: skip
    assert not (dst / "parity").exists()
    assert not (dst / ".shardio-work").exists()
    assert load_manifest(dst / "manifest.json").parity is None


def test_kill_during_repair_then_rerun(reference: pathlib.Path, tmp_path: pathlib.Path) -> None:
    dst = tmp_path / "ds"
    shutil.copytree(reference, dst)
    original = _files(dst)
    man = load_manifest(dst / "manifest.json")
    lost = [s.path for s in man.shards[::2]]  # 24 shards, each in its own group
    for rel in lost:
        (dst / rel).unlink()
    repair = _cli("verify", dst, "--repair", "--workers", "1", "--no-progress")

    def some_rebuilt() -> bool:
        return sum((dst / rel).exists() for rel in lost) >= 3

    finished = run_then_kill(repair, some_rebuilt, env=_env(), timeout_s=TIMEOUT_S)
    if not finished:
        for rel in lost:  # a shard is there whole, or not at all
            path = dst / rel
            assert not path.exists() or path.read_bytes() == original[rel]
    assert _run(repair) in (0, 4)  # 4: repaired what the killed run left, 0: nothing left
    assert _files(dst) == original
    assert verify_dataset(dst).ok


def test_drop_removes_the_temp_file_a_killed_add_was_writing(
    tree: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Where a kill lands mid-write (often under load), the add leaves a shardio temp file
    beside the finished parity files: drop removes it with them, and only it."""
    dst = tmp_path / "ds"
    assert run_then_kill(
        _cli("pack", tree, dst, "--shard-size", "256KiB", "--workers", "1", "--no-progress",
             "--parity", SCHEME),
        lambda: False, env=_env(), timeout_s=TIMEOUT_S,
    )  # fmt: skip
    parity = dst / "parity"
    final = sorted(parity.glob("*.cells"))[0].name
    (parity / f".{final}.shardio-tmp-0123abcd").write_bytes(b"half a group")
    foreign = tmp_path / "mine.txt"
    foreign.write_text("not shardio's")
    assert run_then_kill(_cli("parity", "drop", dst), lambda: False, env=_env(),
                         timeout_s=TIMEOUT_S)  # fmt: skip
    assert not parity.exists()
    assert foreign.read_text() == "not shardio's"
    assert verify_dataset(dst).ok
