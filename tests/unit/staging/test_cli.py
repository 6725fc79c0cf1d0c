"""``shardio stage``: --clean (the job epilogue), bad input, DALI indexes, hdf5 shards."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset
from shardio.staging import StageOptions, stage_dataset

SINGLE = RankInfo(rank=0, world_size=1)


def _listing(root: pathlib.Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names
    )


# --------------------------------------------------------------------------- --clean


def test_clean_removes_only_what_staging_wrote(big_src, tmp_path, run_cli):
    """Files a user put into the staging area after staging survive --clean."""
    dest = tmp_path / "scratch"
    rc, _, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    assert (dest / ".shardio-stage").is_dir()
    (dest / "notes.txt").write_text("the user's")
    (dest / "shards" / "mine.bin").write_bytes(b"also the user's")

    rc, out, err = run_cli("stage", "--clean", dest)
    assert rc == 0, err
    removed, left = out.strip().splitlines()
    assert removed == f"removed {big_src.num_shards} staged shard(s) from {dest}"
    assert left == (
        f"left 2 file(s) shardio did not stage in {dest} (and the folders holding them): "
        "notes.txt, shards/mine.bin"
    )
    assert _listing(dest) == ["notes.txt", "shards/mine.bin"]
    assert (dest / "notes.txt").read_text() == "the user's"
    assert (dest / "shards" / "mine.bin").read_bytes() == b"also the user's"


def test_clean_after_partial_capacity_stage(big_src, tmp_path, run_cli):
    dest = tmp_path / "stage"
    rc, _, err = run_cli("stage", big_src.path, dest, "--capacity", "5MiB", "--no-progress")
    assert rc == 0, err
    staged = len(big_src.staged(dest))
    assert 0 < staged < big_src.num_shards
    rc, out, err = run_cli("stage", "--clean", dest)
    assert rc == 0, err
    assert f"removed {staged} staged shard(s)" in out
    assert _listing(dest) == []


def test_clean_refuses_a_packed_dataset(big_src, run_cli, assert_cli_error):
    result = run_cli("stage", "--clean", big_src.path)
    assert_cli_error(result, str(big_src.path), "packed dataset", "refusing")
    # The autouse guard checks that the source is untouched.


def test_clean_refuses_a_directory_without_staging(tmp_path, run_cli, assert_cli_error):
    (tmp_path / "keep.txt").write_text("x")
    assert_cli_error(run_cli("stage", "--clean", tmp_path), str(tmp_path), "no staged dataset")
    assert _listing(tmp_path) == ["keep.txt"]


def test_clean_takes_one_path(big_src, tmp_path, run_cli, assert_cli_error):
    assert_cli_error(run_cli("stage", "--clean", big_src.path, tmp_path), "one path")


# --------------------------------------------------------------------------- bad input


def test_src_not_a_dataset(tmp_path, run_cli, assert_cli_error):
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "x.jpg").write_bytes(b"jpeg")
    dest = tmp_path / "dest"
    assert_cli_error(run_cli("stage", tree, dest, "--no-progress"), str(tree), "manifest")
    assert not dest.exists(), "a failed stage created its destination"
    assert_cli_error(run_cli("stage", tmp_path / "missing", dest), "missing", "manifest")
    assert not dest.exists()


@pytest.mark.parametrize("where", ["inside", "same", "symlink-inside"])
def test_dest_inside_src(big_src, tmp_path, run_cli, assert_cli_error, where):
    if where == "inside":
        dest = big_src.path / "shards" / "stage"
    elif where == "same":
        dest = big_src.path
    else:
        dest = tmp_path / "link" / "stage"
        (tmp_path / "link").symlink_to(big_src.path, target_is_directory=True)
    assert_cli_error(run_cli("stage", big_src.path, dest, "--no-progress"), "outside the source")
    # The autouse guard checks that nothing was created inside the source.


def test_bad_options(big_src, tmp_path, run_cli, assert_cli_error):
    dest = tmp_path / "dest"
    assert_cli_error(run_cli("stage", big_src.path, dest, "--capacity", "lots"), "lots")
    assert_cli_error(run_cli("stage", big_src.path, dest, "--streams", "0"), "streams")
    assert_cli_error(run_cli("stage", big_src.path, dest, "--ranks-per-node", "0"), "ranks")
    assert_cli_error(run_cli("stage", big_src.path, dest, tmp_path / "third"), "SRC")
    assert not dest.exists()


def test_bad_node_names_the_option(big_src, tmp_path, run_cli, assert_cli_error):
    """`--node 5/4` is a user error about --node; the line must not talk about --part."""
    line = assert_cli_error(
        run_cli("stage", big_src.path, tmp_path / "d", "--node", "5/4"), "5/4", "--node"
    )
    assert "--part" not in line


def test_dest_holding_a_packed_dataset_is_refused(
    big_src, tiny_src, tmp_path, run_cli, assert_cli_error, helpers
):
    """Staging into a directory that holds another packed dataset must not overwrite it."""
    other = tmp_path / "other"
    shutil.copytree(tiny_src.path, other)
    before = helpers.snapshot(other)
    assert_cli_error(run_cli("stage", big_src.path, other, "--no-progress"), str(other))
    assert helpers.snapshot(other) == before, "staging overwrote a packed dataset"


# --------------------------------------------------------------------------- DALI, hdf5


def test_dali_indexes_are_staged_beside_tar_shards(big_src, tmp_path, run_cli):
    dest = tmp_path / "stage"
    rc, _, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    entries = big_src.manifest.shards
    assert all(e.dali_index is not None for e in entries)
    for e in entries:
        assert (dest / e.dali_index).read_bytes() == (big_src.path / e.dali_index).read_bytes()
        assert os.path.dirname(e.dali_index) == os.path.dirname(e.path)
    names = set(os.listdir(dest / "shards"))
    assert names == {os.path.basename(e.path) for e in entries} | {
        os.path.basename(e.dali_index) for e in entries
    }


def test_dali_index_of_a_missing_idx_is_restored(big_src, tmp_path, run_cli):
    dest = tmp_path / "stage"
    rc, _, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    entry = big_src.manifest.shards[3]
    (dest / entry.dali_index).unlink()
    rc, out, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    assert "copied 0 " in out, out
    big_src.assert_staged_ok(dest, set(big_src.rels))


def test_restaging_a_new_version_refreshes_dali_indexes(make_source, tmp_path):
    """The same staging area, a re-packed dataset with the same shard names: every staged
    .idx must describe the new tar beside it, not the old one."""
    old = make_source("v1", files=96, size_bytes=1536, shard_size_bytes=8192, seed=11)
    new = make_source("v2", files=96, size_bytes=2048, shard_size_bytes=8192, seed=12)
    common = set(old.rels) & set(new.rels)
    assert common
    assert any(
        (old.path / e.dali_index).read_bytes() != (new.path / e.dali_index).read_bytes()
        for e in new.manifest.shards
        if e.path in common and e.dali_index is not None
    )
    dest = tmp_path / "stage"
    stage_dataset(old.path, dest, StageOptions(durable=False))
    # Another dataset now (the area records the old one's id): only with force.
    result = stage_dataset(new.path, dest, StageOptions(durable=False, force=True))
    assert result.copied == new.num_shards
    new.assert_staged_ok(dest, set(new.rels))


def test_hdf5_shards_stage_without_idx(make_source, tmp_path):
    src = make_source("h5ds", files=64, size_bytes=4096, shard_size_bytes=64 * 1024, fmt="hdf5")
    dest = tmp_path / "stage"
    result = stage_dataset(src.path, dest, StageOptions(durable=False))
    assert result.copied == src.num_shards
    assert all(e.dali_index is None for e in src.manifest.shards)
    assert not any(n.endswith(".idx") for n in os.listdir(dest / "shards"))
    src.assert_staged_ok(dest, set(src.rels))
    ds = ShardDataset(dest, ranks=SINGLE)
    try:
        for i in range(len(src.keys)):
            src.check_sample(ds[i])
        assert ds.packed.metrics.counts["cache_hits"] == src.num_shards
    finally:
        ds.close()
