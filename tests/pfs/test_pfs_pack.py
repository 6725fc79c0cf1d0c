"""``shardio pack`` onto the MooseFS bed: 1 and 2 workers, ``--part`` + ``merge``, and a
kill -9 mid-pack then ``--resume``, each ending in a dataset that verifies and holds exactly
the source tree's bytes (byte-identical to an uninterrupted pack where the layout is the same).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
from killing import run_then_kill
from mfsbed import pfs_env

SHARD_SIZE = "256KiB"  # the small tree (300 files x ~20 KB) packs into ~27 shards
W = ("--no-progress",)


def pack_argv(src: pathlib.Path, dst: pathlib.Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "shardio", "pack", str(src), str(dst), "--shard-size", SHARD_SIZE,
        "--no-progress", *extra,
    ]  # fmt: skip


def dataset_files(dst: pathlib.Path) -> dict[str, bytes]:
    """Every file under dst (hidden ones included), by relative path, with its bytes."""
    return {
        p.relative_to(dst).as_posix(): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()
    }


def assert_holds_the_tree(dst: pathlib.Path, src: pathlib.Path, tmp: pathlib.Path, run_cli) -> None:
    """``verify`` passes and ``unpack`` gives back every source file, byte for byte."""
    rc, out, err = run_cli("verify", dst, "--workers", "2", *W)
    assert rc == 0, err
    assert out.startswith("OK: verified"), out
    out_dir = tmp / "unpacked"
    rc, _, err = run_cli("unpack", dst, out_dir, *W)
    assert rc == 0, err
    got = {
        p.relative_to(out_dir).as_posix(): p.read_bytes() for p in out_dir.rglob("*") if p.is_file()
    }
    want = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in want), "unpacked bytes differ from the source"


@pytest.fixture(scope="module")
def reference(pfs_dataset) -> dict[str, bytes]:
    """The files of the session's uninterrupted pack on the bed (2 workers)."""
    return dataset_files(pfs_dataset.path)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_pack_onto_the_pfs_is_byte_identical_for_any_worker_count(
    workers: str, pfs_dir: pathlib.Path, small_tree, reference, run_cli, tmp_path
) -> None:
    dst = pfs_dir / "ds"
    rc, _, err = run_cli(*pack_argv(small_tree, dst, "--workers", workers)[3:])
    assert rc == 0, err
    assert "Traceback" not in err
    manifest = json.loads((dst / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 20
    assert manifest["layout"]["message"] == (
        "moosefs filesystem: layout is managed by the filesystem, no striping"
    )
    assert dataset_files(dst) == reference  # the manifest too: same layout, same bytes
    if workers == "1":
        assert_holds_the_tree(dst, small_tree, tmp_path, run_cli)


def test_parts_then_merge_on_the_pfs(pfs_dir: pathlib.Path, small_tree, run_cli, tmp_path) -> None:
    dst = pfs_dir / "ds"
    for part in ("0/2", "1/2"):
        rc, _, err = run_cli(*pack_argv(small_tree, dst, "--part", part, "--workers", "1")[3:])
        assert rc == 0, err
        assert not (dst / "manifest.json").exists()
    rc, _, err = run_cli("merge", dst, *W)
    assert rc == 0, err
    assert_holds_the_tree(dst, small_tree, tmp_path, run_cli)


def _shards(dst: pathlib.Path) -> int:
    try:
        return sum(1 for n in os.listdir(dst / "shards") if n.endswith(".tar"))
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_kill_9_mid_pack_then_resume_is_byte_identical(
    workers: str, pfs_dir: pathlib.Path, small_tree, reference, run_cli
) -> None:
    dst = pfs_dir / "ds"
    argv = pack_argv(small_tree, dst, "--workers", workers)
    # Killed after a few shards are published (well before the last of ~27); were the pack
    # to finish first, kill it on the work directory's appearance instead: it must be cut.
    finished = run_then_kill(
        argv, lambda: _shards(dst) >= 4, env=pfs_env(), timeout_s=120, poll_s=0.001
    )
    if finished:
        for p in sorted(dst.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        finished = run_then_kill(
            argv, (dst / ".shardio-work").exists, env=pfs_env(), timeout_s=120, poll_s=0.0005
        )
    assert not finished, "the pack finished before either kill landed"
    assert not (dst / "manifest.json").exists()
    rc, _, err = run_cli(*argv[3:], "--resume")
    assert rc == 0, err
    assert "Traceback" not in err
    got = dataset_files(dst)
    assert sorted(got) == sorted(reference), "file sets differ: " + repr(set(got) ^ set(reference))
    for name, data in reference.items():
        assert got[name] == data, f"{name} differs from the uninterrupted pack"
