"""A lost DALI ``.idx`` is a function of its intact shard: ``verify`` calls it "rewritable",
``verify --repair`` writes it again (byte for byte as pack wrote it, atomically, only beside a
shard that verifies, never over a symlink), and ``stage`` stages every shard and writes the
staged ``.idx`` from the index, whatever became of the source's."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

import pytest

from shardio.format.index import Index
from shardio.format.manifest import Manifest, load_manifest
from shardio.staging.dali_index import dali_index_of

W1 = ("--workers", "1", "--no-progress")
DATA = pathlib.Path(__file__).resolve().parents[2] / "data"
EXIT_REPAIRED, EXIT_DEGRADED = 4, 5


def manifest_of(root: pathlib.Path) -> Manifest:
    return load_manifest(root / "manifest.json")


def idx_files(root: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "shards").glob("*.idx"))}


@pytest.fixture(scope="module")
def with_parity(small_tree: pathlib.Path, tmp_path_factory: pytest.TempPathFactory,
                run_cli: Any) -> pathlib.Path:  # fmt: skip
    out = tmp_path_factory.mktemp("dali-idx") / "ds"
    r = run_cli("pack", small_tree, out, "--shard-size", "512KiB", "--parity", "2+1", *W1)
    assert r.rc == 0, r.stderr
    return out


@pytest.fixture
def ds(with_parity: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "ds"
    shutil.copytree(with_parity, dst)
    return dst


@pytest.mark.parametrize("version", ["format_v1", "format_v2", "format_v3"])
def test_the_derived_idx_is_what_pack_wrote(version: str) -> None:
    root = DATA / version / "tar"
    man = manifest_of(root)
    index = Index.open(root / man.index.path, manifest=man)
    try:
        for shard, entry in enumerate(man.shards):
            assert entry.dali_index is not None
            assert dali_index_of(index, man, shard) == (root / entry.dali_index).read_bytes()
    finally:
        index.close()


def test_verify_calls_a_lost_idx_rewritable_and_repair_writes_it(
    ds: pathlib.Path, run_cli: Any
) -> None:
    man = manifest_of(ds)
    original = idx_files(ds)
    lost = man.shards[1].dali_index
    assert lost is not None
    (ds / lost).unlink()
    r = run_cli("verify", ds, "--json", "--workers", "1")
    assert r.rc == EXIT_DEGRADED, r.stdout
    report = json.loads(r.stdout)
    [problem] = report["problems"]
    assert (problem["shard"], problem["state"]) == (lost, "rewritable")
    assert report["status"] == "degraded" and report["rebuildable"] == []
    r = run_cli("verify", ds, *W1)
    assert r.rc == EXIT_DEGRADED
    assert f"REWRITABLE {lost}: DALI index missing beside the intact shard" in r.stderr
    assert "writes them again" in r.stderr
    r = run_cli("verify", ds, "--repair", *W1)
    assert r.rc == EXIT_REPAIRED, r.stderr
    assert f"repaired {lost} (rewritable): written again from the index records" in r.stdout
    assert idx_files(ds) == original
    assert run_cli("verify", ds, *W1).rc == 0


def test_without_parity_the_hint_names_the_source_that_repair_needs(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    """A dataset without parity: ``--repair`` alone is refused (exit 2), so the summary's
    hint names ``--source``, and the repair it names writes the ``.idx`` again."""
    ds, copy = tmp_path / "ds", tmp_path / "copy"
    r = run_cli("pack", small_tree, ds, "--shard-size", "512KiB", *W1)
    assert r.rc == 0, r.stderr
    shutil.copytree(ds, copy)
    original = idx_files(ds)
    lost = manifest_of(ds).shards[0].dali_index
    assert lost is not None
    (ds / lost).unlink()
    r = run_cli("verify", ds, *W1)
    assert r.rc == EXIT_DEGRADED
    assert f"shardio verify {ds} --repair --source SRC" in r.stderr
    assert run_cli("verify", ds, "--repair", *W1).rc == 2
    r = run_cli("verify", ds, "--repair", "--source", copy, *W1)
    assert r.rc == EXIT_REPAIRED, r.stderr
    assert f"repaired {lost} (rewritable): written again from the index records" in r.stdout
    assert idx_files(ds) == original


def test_repair_writes_the_idx_of_a_shard_it_rebuilt(ds: pathlib.Path, run_cli: Any) -> None:
    man = manifest_of(ds)
    original, shard = idx_files(ds), (ds / man.shards[2].path).read_bytes()
    (ds / man.shards[2].path).unlink()
    (ds / str(man.shards[2].dali_index)).unlink()
    r = run_cli("verify", ds, "--repair", *W1)
    assert r.rc == EXIT_REPAIRED, r.stderr
    assert (ds / man.shards[2].path).read_bytes() == shard
    assert idx_files(ds) == original
    assert run_cli("verify", ds, *W1).rc == 0


def test_no_idx_is_written_beside_a_shard_that_does_not_verify(
    ds: pathlib.Path, run_cli: Any
) -> None:
    """Shards 0 and 1 (one group of 2+1) are both lost: beyond the parity. The .idx of
    neither is written; the other shards' are untouched."""
    man = manifest_of(ds)
    for i in (0, 1):
        (ds / man.shards[i].path).unlink()
        (ds / str(man.shards[i].dali_index)).unlink()
    r = run_cli("verify", ds, "--repair", *W1)
    assert r.rc == 3, r.stderr
    for i in (0, 1):
        assert not (ds / str(man.shards[i].dali_index)).exists()


def test_repair_never_replaces_a_symlink_at_the_idx(
    ds: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    man = manifest_of(ds)
    rel = str(man.shards[0].dali_index)
    target = tmp_path / "elsewhere.idx"
    target.write_bytes(b"not shardio's")
    (ds / rel).unlink()
    (ds / rel).symlink_to(target)
    r = run_cli("verify", ds, *W1)
    assert r.rc == 3 and f"FOREIGN {rel}: a symlink is where the DALI index belongs" in r.stderr
    r = run_cli("verify", ds, "--repair", *W1)
    assert r.rc == 3, r.stderr
    assert f"could not repair {rel}" in r.stderr
    assert (ds / rel).is_symlink() and target.read_bytes() == b"not shardio's"


def test_stage_stages_every_shard_whose_source_idx_is_lost(
    ds: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    man = manifest_of(ds)
    original = idx_files(ds)
    for i in (0, 3):
        (ds / str(man.shards[i].dali_index)).unlink()
    # One more is garbage of a size no .idx of this shard could have: it is not read.
    (ds / str(man.shards[4].dali_index)).write_bytes(b"x" * (1 << 20))
    area = tmp_path / "area"
    r = run_cli("stage", ds, area, "--no-progress")
    assert r.rc == 0, r.stderr
    assert f"copied {len(man.shards)} " in r.stdout, r.stdout
    assert idx_files(area) == original  # written from the index, whatever the source holds
    assert not (ds / str(man.shards[0].dali_index)).exists()  # the source is not written
    assert run_cli("verify", area, *W1).rc == 0


def test_a_staged_idx_deleted_is_written_again_by_repair(
    ds: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    """The area's repair writes a lost staged .idx from the area's index, even where the
    source lost it too."""
    man = manifest_of(ds)
    original = idx_files(ds)
    area = tmp_path / "area"
    assert run_cli("stage", ds, area, "--no-progress").rc == 0
    rel = str(man.shards[2].dali_index)
    (area / rel).unlink()
    (ds / rel).unlink()
    r = run_cli("verify", area, "--repair", *W1)
    assert r.rc == EXIT_REPAIRED, r.stderr
    assert idx_files(area) == original
    assert run_cli("verify", area, *W1).rc == 0


def test_stage_without_an_index_to_derive_from_warns(
    ds: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The restage path of a reader (no derived text): a lost source .idx is a warning and
    the shard is staged all the same."""
    from shardio.metrics.progress import Counters
    from shardio.staging.copy import stage_one
    from shardio.storage.files import make_dirs_inside

    man = manifest_of(ds)
    entry = man.shards[0]
    (ds / str(entry.dali_index)).unlink()
    dest = tmp_path / "area"
    dest.mkdir()
    make_dirs_inside(os.fspath(dest), "shards")
    make_dirs_inside(os.fspath(dest), ".shardio-stage/ok")
    make_dirs_inside(os.fspath(dest), ".shardio-stage/locks")
    with caplog.at_level("WARNING"):
        _rel, outcome, copied = stage_one(
            os.fspath(ds), os.fspath(dest), entry, [], durable=False,
            counters=Counters(shared=False),
        )  # fmt: skip
    assert (outcome, copied) == ("copied", entry.size_bytes)
    assert (dest / entry.path).read_bytes() == (ds / entry.path).read_bytes()
    assert "staged without its DALI index" in caplog.text
