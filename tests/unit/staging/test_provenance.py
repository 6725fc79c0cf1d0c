"""A staging area is bound to the dataset it holds (issue 17): its marker records the dataset
id (the xxh3-128 of the source manifest's bytes); staging, ``stage=``, verify and repair
check it, and the default area differs per source.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from typing import Any

import pytest

from shardio import RecoveryPolicy
from shardio.errors import UsageError
from shardio.format.identity import dataset_id, short_id
from shardio.format.manifest import load_manifest
from shardio.order.ranks import RankInfo
from shardio.packing.run import PackOptions, pack
from shardio.runtime.dataset import ShardDataset
from shardio.staging import StageOptions, stage_dataset
from shardio.staging.protocol import read_area_marker

SINGLE = RankInfo(rank=0, world_size=1)
OPTIONS = StageOptions(durable=False)


@pytest.fixture(scope="module")
def twins(make_source: Any) -> tuple[Any, Any]:
    """Two different datasets whose directories share a basename (``.../train``)."""
    a = make_source("train", files=24, size_bytes=2048, shard_size_bytes=16 * 1024, seed=21)
    b = make_source("train", files=30, size_bytes=2048, shard_size_bytes=16 * 1024, seed=22)
    assert a.path.name == b.path.name == "train" and a.path != b.path
    assert dataset_id(a.path) != dataset_id(b.path)
    return a, b


def _read_all(ds: ShardDataset, src: Any) -> None:
    for i in range(len(src.keys)):
        src.check_sample(ds[i])


# --------------------------------------------------------------------------- the area


def test_default_areas_of_two_sources_with_one_name_differ(
    twins: Any, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    """`shardio stage /x/a/train` then `/x/b/train` (no DEST): two areas, each reads its own
    dataset (the defect: the second replaced the first's copies and manifest)."""
    a, b = twins
    env = {"TMPDIR": str(tmp_path)}
    dests = []
    for src in (a, b):
        result = run_cli("stage", src.path, "--no-progress", env=env)
        assert result.rc == 0, result.stderr
        [line] = [ln for ln in result.stdout.splitlines() if ln.startswith("read it with")]
        dests.append(pathlib.Path(line.rsplit("ShardDataset('", 1)[1].split("'")[0]))
    assert dests[0] != dests[1]
    for src, dest in zip((a, b), dests, strict=True):
        assert read_area_marker(str(dest))["dataset_id"] == dataset_id(src.path)
        src.assert_staged_ok(dest, set(src.rels))
        ds = ShardDataset(dest, ranks=SINGLE, shuffle=False)
        try:
            assert len(ds) == len(src.keys)
            _read_all(ds, src)
        finally:
            ds.close()


def test_staging_another_dataset_into_an_area_is_refused(
    twins: Any, tmp_path: pathlib.Path, run_cli: Any, assert_cli_error: Any, helpers: Any
) -> None:
    a, b = twins
    dest = tmp_path / "area"
    assert run_cli("stage", a.path, dest, "--no-progress").rc == 0
    before = helpers.snapshot(dest)
    line = assert_cli_error(
        run_cli("stage", b.path, dest, "--no-progress"),
        f"staging area {dest} holds dataset {short_id(dataset_id(a.path))} ({a.path})",
        f"not dataset {short_id(dataset_id(b.path))} ({b.path})",
        "--force",
    )
    assert "refusing to stage into it" in line
    assert helpers.snapshot(dest) == before, "the area was changed"
    # Through the API too.
    with pytest.raises(UsageError, match="refusing to stage into it"):
        stage_dataset(b.path, dest, OPTIONS)
    assert helpers.snapshot(dest) == before


def test_force_removes_only_what_shardio_staged_then_stages(
    twins: Any, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    a, b = twins
    dest = tmp_path / "area"
    assert run_cli("stage", a.path, dest, "--no-progress").rc == 0
    (dest / "notes.txt").write_text("the user's")
    (dest / "shards" / "mine.bin").write_bytes(b"mine")
    journal = dest / ".shardio-stage" / "repairs.jsonl"
    journal.write_text('{"event": "skip"}\n')
    extra_a = set(a.rels) - set(b.rels)
    result = run_cli("stage", b.path, dest, "--force", "--no-progress")
    assert result.rc == 0, result.stderr
    assert "removing what shardio staged there (--force)" in result.stderr
    b.assert_staged_ok(dest, set(b.rels))
    assert not any((dest / rel).exists() for rel in extra_a), "a's extra shards stayed"
    assert (dest / "notes.txt").read_text() == "the user's"
    assert (dest / "shards" / "mine.bin").read_bytes() == b"mine"
    assert journal.read_text() == '{"event": "skip"}\n'
    assert read_area_marker(str(dest))["dataset_id"] == dataset_id(b.path)
    ds = ShardDataset(dest, ranks=SINGLE, shuffle=False)
    try:
        _read_all(ds, b)
    finally:
        ds.close()


def test_an_area_without_an_id_is_told_by_its_staged_manifest(
    twins: Any, tmp_path: pathlib.Path
) -> None:
    """An older release's marker has no dataset id: the staged manifest tells the dataset."""
    a, b = twins
    dest = tmp_path / "area"
    stage_dataset(a.path, dest, OPTIONS)
    marker = dest / ".shardio-stage" / "area.json"
    doc = json.loads(marker.read_text())
    del doc["dataset_id"]
    marker.write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="refusing to stage into it"):
        stage_dataset(b.path, dest, OPTIONS)
    with pytest.raises(UsageError, match="refusing to read it as that dataset's cache"):
        ShardDataset(b.path, stage=dest, ranks=SINGLE)
    result = stage_dataset(a.path, dest, OPTIONS)  # the same dataset: kept, and identified
    assert result.present == a.num_shards and result.copied == 0
    assert json.loads(marker.read_text())["dataset_id"] == dataset_id(a.path)


# --------------------------------------------------------------------------- stage=


def test_cache_of_another_dataset_is_refused_and_never_written(
    twins: Any, tmp_path: pathlib.Path, helpers: Any
) -> None:
    """ShardDataset(dsA, stage=areaB): refused at open, in one line naming both; with
    ResilientDataset the area was overwritten with dsA's shards."""
    a, b = twins
    dest = tmp_path / "area-b"
    stage_dataset(b.path, dest, OPTIONS)
    before = helpers.snapshot(dest)
    with pytest.raises(UsageError) as info:
        ShardDataset(a.path, stage=dest, ranks=SINGLE)
    message = str(info.value)
    assert "\n" not in message
    assert f"staging area {dest} holds dataset {short_id(dataset_id(b.path))}" in message
    assert f"not dataset {short_id(dataset_id(a.path))} ({a.path})" in message
    assert helpers.snapshot(dest) == before


@pytest.mark.parametrize("kind", ["typo", "empty", "not-an-area"])
def test_a_cache_that_holds_no_area_is_said_once_and_counted(
    twins: Any, tmp_path: pathlib.Path, caplog: Any, kind: str
) -> None:
    a, _ = twins
    cache = tmp_path / "nvme" / "stage"
    if kind != "typo":
        cache.mkdir(parents=True)
    if kind == "not-an-area":
        (cache / "x.txt").write_text("x")
    caplog.set_level(logging.WARNING, logger="shardio")
    ds = ShardDataset(a.path, stage=cache, ranks=SINGLE, shuffle=False)
    try:
        _read_all(ds, a)
        counts = ds.read_metrics().counts
    finally:
        ds.close()
    said = [r for r in caplog.records if str(cache) in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    why = {"typo": "does not exist", "empty": "is empty", "not-an-area": "not a staging area"}
    assert why[kind] in said[0].getMessage()
    assert counts["cache_missing"] == 1
    assert counts["cache_hits"] == 0 and counts["bytes_source"] > 0
    assert sorted(os.listdir(tmp_path)) == (["nvme"] if kind != "typo" else [])


def test_the_own_dataset_cache_is_read(twins: Any, tmp_path: pathlib.Path) -> None:
    a, _ = twins
    dest = tmp_path / "area"
    stage_dataset(a.path, dest, OPTIONS)
    ds = ShardDataset(a.path, stage=dest, ranks=SINGLE, shuffle=False)
    try:
        _read_all(ds, a)
        counts = ds.read_metrics().counts
    finally:
        ds.close()
    assert counts["cache_missing"] == 0 and counts["bytes_source"] == 0
    assert counts["cache_hits"] == a.num_shards


# --------------------------------------------------------------------------- verify, repair


@pytest.fixture
def repacked(make_source: Any, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A dataset packed into tmp_path and staged, then re-packed in place (pack --force)
    with other shard sizes: (the dataset, its area)."""
    src = make_source("rp", files=24, size_bytes=2048, shard_size_bytes=16 * 1024, seed=23)
    tree = tmp_path / "tree"
    shutil.copytree(src.path.parent / "tree", tree)
    dataset = tmp_path / "ds"
    pack(str(tree), str(dataset), PackOptions(shard_size_bytes=16 * 1024, durable=False))
    dest = tmp_path / "area"
    stage_dataset(dataset, dest, OPTIONS)
    first = load_manifest(dataset / "manifest.json")
    pack(
        str(tree),
        str(dataset),
        PackOptions(shard_size_bytes=24 * 1024, durable=False, force=True),
    )
    assert load_manifest(dataset / "manifest.json").shards != first.shards
    (dest / first.shards[0].path).unlink()  # a copy to repair
    return dataset, dest


def test_repair_from_a_re_packed_source_is_refused(
    repacked: Any, run_cli: Any, assert_cli_error: Any, helpers: Any
) -> None:
    dataset, dest = repacked
    before = helpers.snapshot(dest)
    assert_cli_error(
        run_cli("verify", dest, "--repair", "--workers", "1", "--no-progress"),
        f"staging area {dest} holds dataset",
        f"({dataset})",
        "refusing to repair it from that source",
    )
    assert helpers.snapshot(dest) == before


def test_verify_of_an_area_says_its_source_was_re_packed(repacked: Any, run_cli: Any) -> None:
    """The source readers would fall back to is another dataset now: damage, not
    "degraded, the source is intact"."""
    dataset, dest = repacked
    result = run_cli("verify", dest, "--json", "--workers", "1")
    assert result.rc == 3, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    [problem] = report["staging_area"]["source_problems"]
    assert f"the source {dataset} now holds dataset" in problem["reason"]


def test_an_area_staged_later_for_another_dataset_is_never_written(
    twins: Any, tmp_path: pathlib.Path, helpers: Any
) -> None:
    """The cache was missing at open (said and counted), then another dataset was staged
    there: ResilientDataset reads its own dataset from the source and never re-stages its
    shards over the other dataset's copies (the defect: every copy was overwritten)."""
    a, b = twins
    dest = tmp_path / "area"
    journal = str(tmp_path / "journal.jsonl")
    policy = RecoveryPolicy(policy="raise", journal=journal)
    ds = ShardDataset(a.path, stage=dest, ranks=SINGLE, shuffle=False, recovery=policy)
    assert ds.read_metrics().counts["cache_missing"] == 1
    stage_dataset(b.path, dest, OPTIONS)
    assert set(a.rels) & b.staged(dest), "no shard names in common: the test tests nothing"
    before = helpers.snapshot(dest)
    try:
        _read_all(ds, a)
        counts = ds.read_metrics().counts
    finally:
        ds.close()
    assert counts["restages"] == 0 and counts["bytes_source"] > 0
    assert helpers.snapshot(dest) == before


def test_an_area_whose_creator_holds_or_left_only_the_area_lock_is_staged(
    twins: Any, tmp_path: pathlib.Path
) -> None:
    """A stager of the node made `.shardio-stage/area.lock` and is writing the marker (or
    was killed there): another stager waits for it and stages, it is not refused."""
    a, _ = twins
    dest = tmp_path / "area"
    (dest / ".shardio-stage").mkdir(parents=True)
    (dest / ".shardio-stage" / "area.lock").touch()
    result = stage_dataset(a.path, dest, OPTIONS)
    assert result.copied == a.num_shards
    assert read_area_marker(str(dest))["dataset_id"] == dataset_id(a.path)
