"""A hostile destination: shardio removes only files it can prove it wrote, follows no
symlink out of DST, and lets only one pack write into a DST at a time.

Every refusal is one ``shardio: error:`` line, and the user's files stay byte for byte.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from shardio.errors import UsageError
from shardio.packing.run import PackOptions, pack

W1 = ("--workers", "1", "--no-progress")


@pytest.fixture
def tiny_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    src = tmp_path / "tiny"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(3):
            (src / cls / f"{cls}_{i}.jpg").write_bytes(os.urandom(3000 + i))
    return src


@pytest.fixture
def dataset(tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli) -> pathlib.Path:
    """A real shardio dataset (tar, several shards) to aim --force at."""
    dst = tmp_path / "ds"
    rc, _, err = run_cli("pack", tiny_tree, dst, "--shard-size", "8KiB", *W1)
    assert rc == 0, err
    return dst


def listing(root: pathlib.Path) -> dict[str, bytes | str]:
    """Every entry under root (symlinks as their target text), hidden ones included."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = p.read_bytes()
        else:
            out[rel] = "dir"
    return out


# --------------------------------------------------------------------------- --force


def test_force_keeps_foreign_files_in_a_real_dataset(
    dataset: pathlib.Path, tiny_tree: pathlib.Path, run_cli
) -> None:
    (dataset / "notes.txt").write_text("precious")
    (dataset / "shards" / "README").write_text("mine too")
    rc, out, err = run_cli("pack", tiny_tree, dataset, "--force", "--format", "hdf5", *W1)
    assert rc == 0, err
    assert f"replaced the dataset that was in {dataset}" in out
    assert (dataset / "notes.txt").read_text() == "precious"
    assert (dataset / "shards" / "README").read_text() == "mine too"
    assert not list((dataset / "shards").glob("*.tar"))  # the old shards went
    assert not list((dataset / "shards").glob("*.idx"))
    assert not (dataset / ".shardio-work").exists()
    rc, _, err = run_cli("verify", dataset, *W1)
    assert rc == 0, err


def test_force_refuses_a_dataset_whose_index_does_not_match(
    dataset: pathlib.Path, tiny_tree: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """A manifest.json alone is not proof: index.bin must have the recorded checksum."""
    with open(dataset / "index.bin", "r+b") as fh:
        fh.seek(300)
        fh.write(b"\xff")
    before = listing(dataset)
    result = run_cli("pack", tiny_tree, dataset, "--force", *W1)
    assert result.rc == 2
    assert_cli_error(result, "index.bin", "will not remove anything")
    assert listing(dataset) == before


def test_force_never_follows_a_shards_symlink(
    dataset: pathlib.Path,
    tiny_tree: pathlib.Path,
    tmp_path: pathlib.Path,
    run_cli,
    assert_cli_error,
) -> None:
    """DST/shards a symlink to another directory: refused; the target is untouched."""
    elsewhere = tmp_path / "elsewhere"
    shutil.move(dataset / "shards", elsewhere)
    (dataset / "shards").symlink_to(elsewhere, target_is_directory=True)
    before_dst, before_target = listing(dataset), listing(elsewhere)
    result = run_cli("pack", tiny_tree, dataset, "--force", *W1)
    assert result.rc == 2
    assert_cli_error(result, str(dataset / "shards"), "symlink")
    assert listing(dataset) == before_dst
    assert listing(elsewhere) == before_target


def test_force_refuses_a_listed_shard_that_is_a_symlink(
    dataset: pathlib.Path,
    tiny_tree: pathlib.Path,
    tmp_path: pathlib.Path,
    run_cli,
    assert_cli_error,
) -> None:
    victim = tmp_path / "victim.tar"
    shard = sorted((dataset / "shards").glob("*.tar"))[1]
    shutil.move(shard, victim)
    shard.symlink_to(victim)
    before, victim_bytes = listing(dataset), victim.read_bytes()
    # The index still matches: only the shard was swapped for a link.
    result = run_cli("pack", tiny_tree, dataset, "--force", *W1)
    assert result.rc == 2
    assert_cli_error(result, str(shard), "symlink", "nothing was removed")
    assert listing(dataset) == before
    assert victim.read_bytes() == victim_bytes


def test_force_refuses_a_listed_shard_that_is_a_directory(
    dataset: pathlib.Path, tiny_tree: pathlib.Path, run_cli, assert_cli_error
) -> None:
    shard = sorted((dataset / "shards").glob("*.idx"))[0]
    shard.unlink()
    shard.mkdir()
    (shard / "keep").write_text("x")
    before = listing(dataset)
    result = run_cli("pack", tiny_tree, dataset, "--force", *W1)
    assert result.rc == 2
    assert_cli_error(result, str(shard), "directory")
    assert listing(dataset) == before


def test_force_leaves_temp_named_files_that_are_not_regular(
    dataset: pathlib.Path, tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli
) -> None:
    """Only regular files with shardio's temp mark are ever cleaned up."""
    target = tmp_path / "target.txt"
    target.write_text("keep")
    (dataset / ".x.shardio-tmp-1").symlink_to(target)
    (dataset / "shards" / ".y.shardio-tmp-2").mkdir()
    rc, _, err = run_cli("pack", tiny_tree, dataset, "--force", *W1)
    assert rc == 0, err
    assert (dataset / ".x.shardio-tmp-1").is_symlink()
    assert (dataset / "shards" / ".y.shardio-tmp-2").is_dir()
    assert target.read_text() == "keep"


def test_work_dir_symlink_is_refused(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    dst.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "state-0000-of-0001.json").write_text("{}")
    (dst / ".shardio-work").symlink_to(outside, target_is_directory=True)
    for flag in ("--resume", "--force"):
        result = run_cli("pack", tiny_tree, dst, flag, *W1)
        assert result.rc == 2
        assert_cli_error(result, str(dst / ".shardio-work"), "symlink")
    assert listing(outside) == {"state-0000-of-0001.json": b"{}"}


def test_fresh_pack_does_not_write_through_a_shards_symlink(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    dst.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (dst / "shards").symlink_to(outside, target_is_directory=True)
    result = run_cli("pack", tiny_tree, dst, *W1)
    assert result.rc == 2
    assert_cli_error(result, "symlink")
    assert list(outside.iterdir()) == []


def test_resume_into_a_foreign_directory_is_refused(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    (dst / "shards").mkdir(parents=True)
    (dst / "shards" / "shard-000000.tar").write_bytes(b"not ours")
    (dst / "data.csv").write_text("1,2")
    before = listing(dst)
    result = run_cli("pack", tiny_tree, dst, "--resume", *W1)
    assert result.rc == 2
    assert_cli_error(result, str(dst), "nothing to resume")
    assert listing(dst) == before


def test_plain_pack_into_an_interrupted_pack_asks_for_resume_or_force(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    rc, _, err = run_cli("pack", tiny_tree, dst, "--part", "0/2", *W1)
    assert rc == 0, err  # part 0 done, part 1 not started: DST is an unfinished pack
    before = listing(dst)
    again = run_cli("pack", tiny_tree, dst, "--part", "0/2", *W1)
    assert again.rc == 2
    assert_cli_error(again, "interrupted pack", "--resume", "--force")
    single = run_cli("pack", tiny_tree, dst, *W1)
    assert single.rc == 2
    assert_cli_error(single, "split into 2 part(s)", "--part I/2 --resume")
    assert listing(dst) == before


def test_force_starts_an_interrupted_pack_over(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli
) -> None:
    """An interrupted pack is recognised by its state record: --force removes exactly the
    shards it planned and its work dir, and keeps anything else."""
    dst = tmp_path / "ds"
    rc, _, err = run_cli("pack", tiny_tree, dst, "--part", "1/2", "--shard-size", "8KiB", *W1)
    assert rc == 0, err
    (dst / "shards" / "mine.tar").write_bytes(b"user file")
    rc, _, err = run_cli("pack", tiny_tree, dst, "--force", "--shard-size", "64KiB", *W1)
    assert rc == 0, err
    names = sorted(p.name for p in (dst / "shards").iterdir())
    assert "mine.tar" in names
    assert not [n for n in names if n.startswith("shard-p")]
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def test_force_with_parts_is_refused(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    result = run_cli("pack", tiny_tree, tmp_path / "ds", "--force", "--part", "0/2", *W1)
    assert result.rc == 2
    assert_cli_error(result, "--force", "--part")
    assert not (tmp_path / "ds").exists()


def test_a_refused_pack_removes_the_dst_it_created(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "only.fifo")
    result = run_cli("pack", src, tmp_path / "new" / "ds", *W1)
    assert_cli_error(result, "no packable files")
    assert not (tmp_path / "new" / "ds").exists()


# --------------------------------------------------------------------------- locks

# Runs the CLI with the scan of the source held until a "go" file appears, so the lock on
# DST is held for as long as the test needs.
HOLD = r"""
import os, sys, time
import shardio.packing.part as run
go, ready = sys.argv[1], sys.argv[2]
real_scan = run.scan_part
def held_scan(src, options):
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    return real_scan(src, options)
run.scan_part = held_scan
from shardio.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def _start_held(
    tmp_path: pathlib.Path, name: str, *argv: object
) -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    go, ready = tmp_path / f"{name}.go", tmp_path / f"{name}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(go), str(ready), *map(str, argv)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the held pack never reached its scan"
        time.sleep(0.01)
    return proc, go, ready


def test_two_concurrent_packs_into_one_dst(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    first, go, _ = _start_held(tmp_path, "a", "pack", tiny_tree, dst, "--shard-size", "8KiB", *W1)
    try:
        second = run_cli("pack", tiny_tree, dst, "--shard-size", "4KiB", *W1)
        assert second.rc == 2
        assert_cli_error(second, "another shardio pack is writing to", str(dst))
        merge = run_cli("merge", dst)
        assert_cli_error(merge, "another shardio pack is writing to")
    finally:
        go.touch()
        _out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err
    man = json.loads((dst / "manifest.json").read_text())
    listed = {s["path"] for s in man["shards"]} | {s["dali_index"] for s in man["shards"]}
    on_disk = {f"shards/{p.name}" for p in (dst / "shards").iterdir()}
    assert on_disk == listed  # no stray shard of the refused pack


def test_parts_share_the_lock_and_merge_waits_for_them(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    args = ("--shard-size", "8KiB", *W1)
    first, go, _ = _start_held(tmp_path, "p0", "pack", tiny_tree, dst, "--part", "0/2", *args)
    try:
        rc, _, err = run_cli("pack", tiny_tree, dst, "--part", "1/2", *args)
        assert rc == 0, err  # parts write disjoint files: both may run at once
        merge = run_cli("merge", dst)
        assert merge.rc == 2
        assert_cli_error(merge, "another shardio pack is writing to")
    finally:
        go.touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    rc, _out, err = run_cli("merge", dst)
    assert rc == 0, err
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def test_a_lock_held_by_another_process_is_refused_at_once(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    dst.mkdir()
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # like a running --part pack
        result = run_cli("pack", tiny_tree, dst, *W1)
        assert result.rc == 2
        assert_cli_error(result, "another shardio pack is writing to")
        assert list(dst.iterdir()) == []
    finally:
        os.close(fd)


def test_a_filesystem_without_locks_only_warns(
    tiny_tree: pathlib.Path,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import errno

    import shardio.storage.dirlock as dest

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(dest.fcntl, "flock", no_locks)
    dst = tmp_path / "ds"
    with caplog.at_level(logging.WARNING, logger="shardio.storage.dirlock"):
        result = pack(str(tiny_tree), str(dst), PackOptions(durable=False, fs_type="local"))
    assert result.num_samples == 6
    assert any("cannot lock" in r.getMessage() for r in caplog.records)
    assert (dst / "manifest.json").exists()


def test_a_lock_conflict_is_a_usage_error_in_the_api(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import shardio.storage.dirlock as dest

    def would_block(fd: int, op: int) -> None:
        raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable")

    monkeypatch.setattr(dest.fcntl, "flock", would_block)
    with pytest.raises(UsageError, match="another shardio pack"):
        pack(str(tiny_tree), str(tmp_path / "ds"), PackOptions(durable=False))
    assert not (tmp_path / "ds").exists() or list((tmp_path / "ds").iterdir()) == []


def test_a_fifo_named_like_the_manifest_or_index_never_blocks(
    dataset: pathlib.Path, tiny_tree: pathlib.Path, run_cli, assert_cli_error
) -> None:
    (dataset / "index.bin").unlink()
    os.mkfifo(dataset / "index.bin")
    for flag in ("--force", "--resume"):
        result = run_cli("pack", tiny_tree, dataset, flag, *W1, timeout=30)
        assert result.rc == 2
        assert_cli_error(result, str(dataset / "index.bin"))
    (dataset / "manifest.json").unlink()
    os.mkfifo(dataset / "manifest.json")
    result = run_cli("pack", tiny_tree, dataset, "--force", *W1, timeout=30)
    assert result.rc == 2
    assert_cli_error(result, str(dataset / "manifest.json"), "FIFO")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"workers": 10**6}, "--workers"),
        ({"workers": 0}, "--workers"),
        ({"part": 0, "num_parts": 10_000}, "N <= 9999"),
        ({"part": 3, "num_parts": 3}, "0 <= I < N"),
        ({"force": True, "num_parts": 2}, "--force cannot be combined with --part"),
        ({"force": True, "resume": True}, "exclude each other"),
        ({"stream_threshold_bytes": 0}, "stream_threshold_bytes"),
    ],
)
def test_pack_options_are_bounded(kwargs: dict, needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        PackOptions(**kwargs)
