"""``shardio stage`` against a hostile or careless environment.

Each test sets a trap a user (or another user of the node) could set, and checks that
staging refuses with one clear line naming the path, touches no file it did not create,
follows no symlink inside DEST and never blocks on a FIFO: a directory that is not a staging
area, symlinks where staging writes, FIFOs where it reads, a source shard whose size is not
the manifest's, an oversized DALI index, a manifest path inside staging's own records, and
bad options.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import stat

import pytest

import shardio.staging.copy as cache_copy
import shardio.staging.stage as cache_stage
from shardio.errors import FormatError, IntegrityError, StorageError, UsageError
from shardio.format.identity import dataset_id
from shardio.format.manifest import load_manifest
from shardio.metrics.progress import Counters
from shardio.staging import (
    MAX_RANKS_PER_NODE,
    StageOptions,
    clean_stage,
    node_shard_order,
    stage_dataset,
)
from shardio.staging.protocol import lock_path, stamp_matches, stamp_path

CLI_TIMEOUT_S = 60  # a blocked open would hang far longer: the run is killed, the test fails
OPTIONS = StageOptions(durable=False)


def tree(root: pathlib.Path) -> dict[str, tuple[str, bytes | str]]:
    """Everything under root without following a symlink: path -> (kind, bytes or target)."""
    out: dict[str, tuple[str, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(mode):
                out[rel] = ("file", pathlib.Path(path).read_bytes())
            elif stat.S_ISDIR(mode):
                out[rel] = ("dir", "")
            else:
                out[rel] = ("special", "")
    return out


@pytest.fixture
def src_copy(tiny_src, tmp_path):
    """A private, writable copy of the tiny dataset (for traps on the source side)."""
    path = tmp_path / "srccopy"
    shutil.copytree(tiny_src.path, path)
    return path


def _user_files(root: pathlib.Path) -> pathlib.Path:
    """A user's own files outside any staging area."""
    root.mkdir()
    (root / "precious.txt").write_bytes(b"the user's data")
    return root


def _stage_ok(src, dest) -> None:
    result = stage_dataset(src, dest, OPTIONS)
    assert result.copied + result.present == result.shards_needed > 0


# --------------------------------------------------------------------------- not an area


def _fill(dest: pathlib.Path, kind: str, outside: pathlib.Path) -> None:
    dest.mkdir()
    if kind == "user-dataset-names":
        (dest / "index.bin").write_bytes(b"my index")
        (dest / "manifest.json").write_text('{"mine": true}')
        (dest / "shards").mkdir()
        (dest / "shards" / "shard-000000.tar").write_bytes(b"my tar")
    elif kind == "one-file":
        (dest / "notes.txt").write_text("hello")
    elif kind == "stage-dir-symlink":
        real = outside / "fake-stage"
        real.mkdir()
        (real / "area.json").write_text(json.dumps({"format": "shardio-stage", "version": 1}))
        (dest / ".shardio-stage").symlink_to(real, target_is_directory=True)
    elif kind == "garbage-marker":
        (dest / ".shardio-stage").mkdir()
        (dest / ".shardio-stage" / "area.json").write_text("not json")
        (dest / "notes.txt").write_text("hello")
    elif kind == "wrong-format-marker":
        (dest / ".shardio-stage").mkdir()
        (dest / ".shardio-stage" / "area.json").write_text('{"format": "other"}')
    elif kind == "fifo-marker":
        (dest / ".shardio-stage").mkdir()
        os.mkfifo(dest / ".shardio-stage" / "area.json")
    elif kind == "stage-dir-name-only":
        (dest / ".shardio-stage").mkdir()
        (dest / ".shardio-stage" / "ok").mkdir()
    else:
        raise AssertionError(kind)


NOT_AREAS = [
    "user-dataset-names",
    "one-file",
    "stage-dir-symlink",
    "garbage-marker",
    "wrong-format-marker",
    "fifo-marker",
    "stage-dir-name-only",
]


@pytest.mark.parametrize("kind", NOT_AREAS)
def test_stage_refuses_a_directory_that_is_not_a_staging_area(tiny_src, tmp_path, kind):
    dest = tmp_path / "dest"
    outside = _user_files(tmp_path / "outside")
    _fill(dest, kind, outside)
    before, outside_before = tree(dest), tree(outside)
    with pytest.raises(UsageError, match="not a shardio staging area") as info:
        stage_dataset(tiny_src.path, dest, OPTIONS)
    assert str(dest) in str(info.value)
    assert tree(dest) == before, "staging wrote into a directory that is not a staging area"
    assert tree(outside) == outside_before


def test_cli_refuses_a_users_directory_in_one_line(tiny_src, tmp_path, run_cli, assert_cli_error):
    dest = tmp_path / "dest"
    _fill(dest, "user-dataset-names", tmp_path)
    before = tree(dest)
    result = run_cli("stage", tiny_src.path, dest, "--no-progress", timeout=CLI_TIMEOUT_S)
    assert_cli_error(result, str(dest), "not a shardio staging area")
    assert tree(dest) == before


@pytest.mark.parametrize("kind", NOT_AREAS)
def test_clean_refuses_a_directory_that_is_not_a_staging_area(tmp_path, kind):
    dest = tmp_path / "dest"
    outside = _user_files(tmp_path / "outside")
    _fill(dest, kind, outside)
    before, outside_before = tree(dest), tree(outside)
    with pytest.raises(UsageError, match="no staged dataset") as info:
        clean_stage(dest)
    assert str(dest) in str(info.value)
    assert tree(dest) == before
    assert tree(outside) == outside_before


@pytest.mark.parametrize("kind", ["file", "dangling-symlink"])
def test_dest_that_is_not_a_directory(tiny_src, tmp_path, run_cli, assert_cli_error, kind):
    dest = tmp_path / "dest"
    if kind == "file":
        dest.write_bytes(b"mine")
    else:
        dest.symlink_to(tmp_path / "nowhere")
    result = run_cli("stage", tiny_src.path, dest, "--no-progress", timeout=CLI_TIMEOUT_S)
    assert_cli_error(result, str(dest))
    assert not (tmp_path / "nowhere").exists()
    if kind == "file":
        assert dest.read_bytes() == b"mine"


@pytest.mark.parametrize("start", ["missing", "empty"])
def test_a_new_area_gets_its_marker_before_anything_else(tiny_src, tmp_path, monkeypatch, start):
    dest = tmp_path / "dest"
    if start == "empty":
        dest.mkdir()
    marker = dest / ".shardio-stage" / "area.json"
    seen = []
    original = cache_stage.write_local_metadata

    def checking(*args, **kwargs):
        seen.append(marker.is_file() and sorted(os.listdir(dest)) == [".shardio-stage"])
        return original(*args, **kwargs)

    monkeypatch.setattr(cache_stage, "write_local_metadata", checking)
    _stage_ok(tiny_src.path, dest)
    assert seen == [True], "the marker was not the first thing written"
    doc = json.loads(marker.read_text())
    assert doc == {
        "format": "shardio-stage",
        "version": 1,
        "staged_from": os.path.abspath(tiny_src.path),
        "dataset_id": dataset_id(tiny_src.path),  # the xxh3-128 of the source manifest's bytes
    }
    tiny_src.assert_staged_ok(dest, set(tiny_src.rels))


def test_an_area_of_the_previous_release_is_recognised(tiny_src, tmp_path):
    """A staging area without marker whose manifest names its source (as the previous
    release wrote them) is restaged in place, and gets its marker."""
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    shutil.rmtree(dest / ".shardio-stage")
    result = stage_dataset(tiny_src.path, dest, OPTIONS)
    assert result.copied == 0 and result.present == tiny_src.num_shards
    assert (dest / ".shardio-stage" / "area.json").is_file()
    assert clean_stage(dest).removed == tiny_src.num_shards
    assert os.listdir(dest) == []


def test_an_area_whose_creator_was_killed_before_its_marker(tiny_src, tmp_path):
    """Only `.shardio-stage` with a temp marker in it: staging goes on, clean removes it."""
    dest = tmp_path / "dest"
    (dest / ".shardio-stage").mkdir(parents=True)
    (dest / ".shardio-stage" / ".area.json.shardio-tmp-99999").write_text("{")
    assert clean_stage(dest).removed == 0
    assert os.listdir(dest) == []
    (dest / ".shardio-stage").mkdir()
    (dest / ".shardio-stage" / ".area.json.shardio-tmp-99999").write_text("{")
    _stage_ok(tiny_src.path, dest)
    tiny_src.assert_staged_ok(dest, set(tiny_src.rels))


def test_source_inside_the_staging_area_is_refused(tiny_src, tmp_path):
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    inner = dest / "inner"
    shutil.copytree(tiny_src.path, inner)
    before = tree(dest)
    with pytest.raises(UsageError, match="must not contain the source"):
        stage_dataset(inner, dest, OPTIONS)
    assert tree(dest) == before


# --------------------------------------------------------------------------- symlinks


def test_a_shards_symlink_in_dest_is_not_followed(tiny_src, tmp_path, run_cli, assert_cli_error):
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    shutil.rmtree(dest / "shards")
    outside = _user_files(tmp_path / "outside")
    (dest / "shards").symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    result = run_cli("stage", tiny_src.path, dest, "--no-progress", timeout=CLI_TIMEOUT_S)
    assert_cli_error(result, str(dest / "shards"), "symlink")
    assert tree(outside) == before, "staging wrote through a symlink"
    with pytest.raises(UsageError, match="symlink"):
        stage_dataset(tiny_src.path, dest, OPTIONS)
    assert tree(outside) == before


@pytest.mark.parametrize("what", ["shard", "dali-index", "index", "manifest"])
def test_a_symlink_where_staging_wrote_is_refused(tiny_src, tmp_path, what):
    """A staged file replaced by a symlink to a user's file: refused by name; the user's
    file is neither read into the area, replaced, nor removed by stage or --clean."""
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    entry = tiny_src.manifest.shards[0]
    rel = {
        "shard": entry.path,
        "dali-index": entry.dali_index,
        "index": tiny_src.manifest.index.path,
        "manifest": "manifest.json",
    }[what]
    assert rel is not None
    outside = _user_files(tmp_path / "outside")
    (dest / rel).unlink()
    (dest / rel).symlink_to(outside / "precious.txt")
    before = tree(outside)
    with pytest.raises(UsageError, match="symlink") as info:
        stage_dataset(tiny_src.path, dest, OPTIONS)
    assert str(dest / rel) in str(info.value)
    assert tree(outside) == before
    assert (dest / rel).is_symlink()
    if what == "manifest":
        with pytest.raises(UsageError, match="symlink"):
            clean_stage(dest)
    else:
        clean_stage(dest)
        assert (dest / rel).is_symlink(), "--clean removed a symlink staging did not make"
    assert tree(outside) == before


def test_a_symlinked_copy_is_never_trusted_by_the_reader(tiny_src, tmp_path):
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    entry = tiny_src.manifest.shards[0]
    assert stamp_matches(str(dest), entry.path, entry.xxh3_128)
    copy = tmp_path / "copy.tar"
    os.replace(dest / entry.path, copy)
    (dest / entry.path).symlink_to(copy)
    assert not stamp_matches(str(dest), entry.path, entry.xxh3_128)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_lock_that_is_not_a_regular_file_is_refused(tiny_src, tmp_path, kind):
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    rel = tiny_src.rels[0]
    lock = pathlib.Path(lock_path(str(dest), rel))
    target = tmp_path / "outside" / "created-through-the-lock"
    target.parent.mkdir()
    lock.unlink()
    if kind == "symlink":
        lock.symlink_to(target)
    else:
        os.mkfifo(lock)
    with pytest.raises(UsageError, match="symlink" if kind == "symlink" else "FIFO") as info:
        stage_dataset(tiny_src.path, dest, OPTIONS)
    assert str(lock) in str(info.value)
    assert not target.exists(), "the lock was opened through a symlink"


def test_eviction_never_removes_through_a_symlink(tiny_src, tmp_path):
    """A staged shard that eviction would remove, replaced by a symlink to a user's file:
    neither the link nor the user's file goes."""
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    capacity = tiny_src.manifest.total_bytes // 3
    options = StageOptions(durable=False, epoch=1, capacity_bytes=capacity)
    order = [tiny_src.rels[i] for i in node_shard_order(tiny_src.manifest, options)]
    victim = order[-1]  # needed last: never within the capacity, so eviction picks it
    outside = _user_files(tmp_path / "outside")
    (dest / victim).unlink()
    (dest / victim).symlink_to(outside / "precious.txt")
    result = stage_dataset(tiny_src.path, dest, options)
    assert result.evicted, "nothing was evicted: the test does not test eviction"
    assert victim not in result.evicted
    assert (dest / victim).is_symlink()
    assert (outside / "precious.txt").read_bytes() == b"the user's data"


def test_clean_does_not_follow_a_symlinked_shards_directory(tiny_src, tmp_path):
    """After staging, DEST/shards is swapped for a symlink to a user's directory holding
    files with the staged names: --clean removes none of them."""
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    outside = tmp_path / "outside"
    shutil.move(dest / "shards", outside)
    (dest / "shards").symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    assert clean_stage(dest).removed == 0
    assert tree(outside) == before
    assert (dest / "shards").is_symlink()


def test_clean_removes_only_regular_files_it_staged(tiny_src, tmp_path):
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    (dest / "shards" / "mine.bin").write_bytes(b"user")
    first = tiny_src.rels[0]
    (dest / first).unlink()
    os.mkfifo(dest / first)
    assert clean_stage(dest).removed == tiny_src.num_shards - 1
    assert tree(dest) == {
        "shards": ("dir", ""),
        "shards/mine.bin": ("file", b"user"),
        first: ("special", ""),
    }


# --------------------------------------------------------------------------- FIFOs


SOURCE_SIDE = ["source-shard", "source-index", "source-dali-index", "source-manifest"]
STAGED_SIDE = ["staged-shard", "staged-dali-index", "staged-index", "staged-manifest"]


@pytest.mark.parametrize("where", SOURCE_SIDE + STAGED_SIDE)
def test_a_fifo_never_blocks_stage(tiny_src, src_copy, tmp_path, run_cli, assert_cli_error, where):
    """A FIFO in place of a file staging reads: one error line naming it, no hang (the CLI
    runs under a timeout), and nothing written on the source side."""
    manifest = load_manifest(src_copy / "manifest.json")
    entry = manifest.shards[0]
    dest = tmp_path / "dest"
    side, _, kind = where.partition("-")
    rel = {
        "shard": entry.path,
        "index": manifest.index.path,
        "dali-index": entry.dali_index,
        "manifest": "manifest.json",
    }[kind]
    assert rel is not None
    root = src_copy
    if side == "staged":
        _stage_ok(src_copy, dest)
        root = dest
    (root / rel).unlink()
    os.mkfifo(root / rel)
    result = run_cli("stage", src_copy, dest, "--no-progress", timeout=CLI_TIMEOUT_S)
    if where == "source-dali-index":
        # Staging writes each .idx from the verified index: the source's is never opened.
        assert result.rc == 0, result.stderr
        assert (dest / rel).read_bytes() == (tiny_src.path / rel).read_bytes()
    else:
        assert_cli_error(result, str(root / rel), "FIFO")
    assert stat.S_ISFIFO(os.lstat(root / rel).st_mode), "the FIFO was replaced"


def test_a_fifo_stamp_is_just_not_a_stamp(tiny_src, tmp_path, run_cli):
    dest = tmp_path / "dest"
    _stage_ok(tiny_src.path, dest)
    stamp = pathlib.Path(stamp_path(str(dest), tiny_src.rels[0]))
    stamp.unlink()
    os.mkfifo(stamp)
    rc, out, err = run_cli("stage", tiny_src.path, dest, "--no-progress", timeout=CLI_TIMEOUT_S)
    assert rc == 0, err
    assert "copied 0 " in out, out
    assert stamp.is_file()
    tiny_src.assert_staged_ok(dest, set(tiny_src.rels))


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("change", ["grown", "truncated"])
def test_a_source_shard_of_the_wrong_size_is_refused_before_copying(
    src_copy, tmp_path, helpers, change
):
    manifest = load_manifest(src_copy / "manifest.json")
    entry = manifest.shards[0]
    path = src_copy / entry.path
    with open(path, "r+b") as fh:
        if change == "grown":
            fh.seek(0, os.SEEK_END)
            fh.write(b"\0" * 4096)
        else:
            fh.truncate(entry.size_bytes - 1)
    dest = tmp_path / "dest"
    with pytest.raises(IntegrityError, match=f"{entry.size_bytes:,}") as info:
        stage_dataset(src_copy, dest, StageOptions(durable=False, streams=1))
    assert str(path) in str(info.value)
    assert not (dest / entry.path).exists()
    assert helpers.temp_files(dest) == []


def test_an_oversized_dali_index_is_never_read(tiny_src, src_copy, tmp_path, run_cli, caplog):
    """stage writes the staged .idx from the verified index (the source's is not read); a
    reader's re-stage, which copies the source's, refuses an oversized one with a warning
    and stages the shard all the same."""
    manifest = load_manifest(src_copy / "manifest.json")
    entry = manifest.shards[0]
    assert entry.dali_index is not None
    idx = src_copy / entry.dali_index
    bound = cache_copy._IDX_BASE_BYTES + cache_copy._IDX_BYTES_PER_SAMPLE * entry.num_samples
    with open(idx, "r+b") as fh:
        fh.truncate(bound + 1)  # sparse: nothing is written to disk
    result = run_cli("stage", src_copy, tmp_path / "dest", "--no-progress")
    assert result.rc == 0, result.stderr
    good = (tiny_src.path / entry.dali_index).read_bytes()
    assert (tmp_path / "dest" / entry.dali_index).read_bytes() == good
    other = tmp_path / "other"
    for folder in ("shards", ".shardio-stage/ok", ".shardio-stage/locks"):
        (other / folder).mkdir(parents=True)
    with caplog.at_level("WARNING"):
        _rel, outcome, _n = cache_copy.stage_one(
            os.fspath(src_copy), os.fspath(other), entry, [], durable=False,
            counters=Counters(shared=False),
        )  # fmt: skip
    assert outcome == "copied" and not (other / entry.dali_index).exists()
    assert "staged without its DALI index" in caplog.text and str(idx) in caplog.text


def test_a_manifest_path_inside_staging_records_is_refused(src_copy, tmp_path):
    manifest = load_manifest(src_copy / "manifest.json")
    entry = manifest.shards[0]
    bad = dataclasses.replace(entry, path=".shardio-stage/ok/x.tar")
    tampered = dataclasses.replace(manifest, shards=(bad, *manifest.shards[1:]))
    (src_copy / "manifest.json").write_bytes(tampered.dumps())
    dest = tmp_path / "dest"
    with pytest.raises(FormatError, match="reserved"):
        stage_dataset(src_copy, dest, OPTIONS)
    assert not dest.exists()


def test_a_missing_source_shard_names_it(src_copy, tmp_path):
    manifest = load_manifest(src_copy / "manifest.json")
    rel = manifest.shards[0].path
    (src_copy / rel).unlink()
    with pytest.raises(StorageError) as info:
        stage_dataset(src_copy, tmp_path / "dest", OPTIONS)
    assert str(src_copy / rel) in str(info.value)


# --------------------------------------------------------------------------- options


BAD_OPTIONS = [
    (["--window-shards", "0"], "window must be at least 1"),
    (["--window-shards", "-3"], "--window-shards='-3' is not a whole number"),
    (["--order", "order=random,colour=red"], "is not one of order="),
    (["--order", "zigzag"], "invalid order 'zigzag'"),
    (["--order", "partition=rack"], "invalid partition 'rack'"),
    (["--streams", "0"], "streams"),
    (["--streams", "-1"], "streams"),
    (["--streams", "1000000"], "streams"),
    (["--ranks-per-node", "0"], "ranks per node"),
    (["--ranks-per-node", "-2"], "--ranks-per-node='-2' is not a whole number"),
    (["--ranks-per-node", "100000000"], "ranks per node"),
    (["--seed", "-1"], "seed"),
    (["--epoch", "-1"], "epoch"),
    (["--node", "0/99999999999999999999999"], "node"),
]


@pytest.mark.parametrize(("args", "needle"), BAD_OPTIONS)
def test_bad_options_are_one_line(
    tiny_src, tmp_path, run_cli, run_cli_here, assert_cli_error, args, needle
):
    dest = tmp_path / "dest"
    run = run_cli if (args, needle) == BAD_OPTIONS[0] else run_cli_here  # one: the command
    result = run("stage", tiny_src.path, dest, "--no-progress", *args)
    line = assert_cli_error(result, needle)
    assert result.rc == 2, line
    assert not dest.exists()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"spec": None},
        {"streams": 0},
        {"ranks_per_node": 0},
        {"ranks_per_node": MAX_RANKS_PER_NODE + 1},
        {"spec": "random"},
        {"epoch": -1},
        {"num_nodes": 0},
        {"node": 2, "num_nodes": 2},
        {"capacity_bytes": -1},
    ],
)
def test_stage_options_validate(kwargs):
    with pytest.raises(UsageError):
        StageOptions(**kwargs)
