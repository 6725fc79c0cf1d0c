"""``shardio verify DST --repair --source SRC``: a packed dataset's damaged, truncated and
missing shards (and its index) replaced by verified copies from another copy of it.

The repaired dataset must be byte-identical to the good copy. A source that is another
dataset, or no source at all, is refused with one line and nothing is written; a symlink in
place of a shard is never written through or replaced; a pack holding the dataset's lock
keeps the repair out.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
from typing import Any

import pytest
from trees import flip_member

from shardio.format.manifest import load_manifest
from shardio.tools.repair import repair_dataset

W1 = ("--workers", "1", "--no-progress")
SUFFIX = {"tar": ".tar", "hdf5": ".h5"}


def files_of(root: pathlib.Path) -> dict[str, bytes]:
    """Every file under root, by relative path, with its bytes (symlinks as their target)."""
    out: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = b"->" + os.readlink(path).encode()
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out


def shard_rels(root: pathlib.Path) -> list[str]:
    return [s.path for s in load_manifest(root / "manifest.json").shards]


@pytest.fixture(params=["tar", "hdf5"])
def good(request: pytest.FixtureRequest, packed_small: Any) -> pathlib.Path:
    """The small tree packed in 256 KiB shards: a good copy (read-only by convention)."""
    root: pathlib.Path = packed_small(request.param, "256KiB", 1)[0]
    assert all(rel.endswith(SUFFIX[request.param]) for rel in shard_rels(root))
    return root


@pytest.fixture
def damaged(good: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "ds"
    shutil.copytree(good, dst)
    return dst


def test_flipped_truncated_and_missing_shards_are_repaired_byte_identical(
    good: pathlib.Path, damaged: pathlib.Path, run_cli: Any
) -> None:
    rels = shard_rels(damaged)
    flip_member(damaged, 1)
    os.truncate(damaged / rels[2], (damaged / rels[2]).stat().st_size // 3)
    (damaged / rels[3]).unlink()
    index = damaged / "index.bin"
    with open(index, "r+b") as fh:  # past the last section: a byte no reader uses
        fh.seek(index.stat().st_size - 3)
        byte = fh.read(1)
        fh.seek(index.stat().st_size - 3)
        fh.write(bytes([byte[0] ^ 0xFF]))

    rc, _, err = run_cli("verify", damaged, *W1)
    assert rc == 3, err

    rc, out, err = run_cli(
        "verify", damaged, "--repair", "--source", good, "--json", "--workers", "1"
    )
    assert rc == 4, err
    report = json.loads(out)
    assert report["status"] == "repaired"
    assert {r["shard"] for r in report["repaired"]} == {"index.bin", rels[1], rels[2], rels[3]}
    assert report["unrepaired"] == []
    assert report["repair_source"] == str(good)
    assert files_of(damaged) == files_of(good)

    rc, out, err = run_cli("verify", damaged, *W1)
    assert rc == 0, err
    assert out.startswith("OK: verified")


def test_text_output_names_what_was_fixed(
    good: pathlib.Path, damaged: pathlib.Path, run_cli: Any
) -> None:
    rels = shard_rels(damaged)
    key = flip_member(damaged, 0)
    rc, out, err = run_cli("verify", damaged, "--repair", "--source", good, *W1)
    assert rc == 4, err
    assert f"DAMAGED {rels[0]}: 1 damaged member(s)" in err
    assert f"sample {key} " in err
    assert f"repaired {rels[0]} (damaged): replaced by the verified copy from {good}" in out
    assert "REPAIRED: repaired 1 shard, could not repair 0" in out


def test_a_source_bad_too_is_reported_and_the_rest_repaired(
    good: pathlib.Path, damaged: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    source = tmp_path / "other-copy"
    shutil.copytree(good, source)
    rels = shard_rels(damaged)
    flip_member(damaged, 1)
    flip_member(source, 1)  # the same shard is bad in both copies
    (damaged / rels[2]).unlink()
    bad_before = (damaged / rels[1]).read_bytes()

    rc, out, err = run_cli(
        "verify", damaged, "--repair", "--source", source, "--json", "--workers", "1"
    )
    assert rc == 3, err
    report = json.loads(out)
    assert report["status"] == "damaged"
    assert [r["shard"] for r in report["repaired"]] == [rels[2]]
    [left] = report["unrepaired"]
    assert left["shard"] == rels[1] and left["damage"] is True
    assert "does not match its manifest checksum" in left["why"]
    assert (damaged / rels[1]).read_bytes() == bad_before  # left as it was
    assert (damaged / rels[2]).read_bytes() == (good / rels[2]).read_bytes()
    assert not [p for p in damaged.rglob("*") if "shardio-tmp" in p.name]

    rc, _, err = run_cli("verify", damaged, "--repair", "--source", source, *W1)
    assert rc == 3
    assert f"could not repair {rels[1]}: " in err
    assert "FAILED: repaired 0 shards, could not repair 1" in err


def test_rebuild_hook_is_tried_when_no_source_copy_is_good(
    good: pathlib.Path, damaged: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    source = tmp_path / "other-copy"
    shutil.copytree(good, source)
    rels = shard_rels(damaged)
    flip_member(damaged, 2)
    flip_member(source, 2)
    asked: list[int] = []

    def rebuild(shard: int) -> bool:  # a stand-in for parity: rebuilds DST's shard in place
        asked.append(shard)
        shutil.copyfile(good / rels[shard], damaged / rels[shard])
        return True

    result = repair_dataset(damaged, source=source, rebuild=rebuild)
    assert asked == [2]
    assert result.status == "repaired", result.unrepaired
    assert [r.how for r in result.repaired] == ["rebuilt (the copy in the source is bad too)"]
    assert files_of(damaged) == files_of(good)


# --------------------------------------------------------------------------- refusals


def test_a_source_of_another_dataset_is_refused(
    damaged: pathlib.Path, packed_small: Any, run_cli: Any, assert_cli_error: Any
) -> None:
    other = packed_small("tar", "1MiB", 1)[0]  # the same files, other shards
    flip_member(damaged, 0)
    before = files_of(damaged)
    result = run_cli("verify", damaged, "--repair", "--source", other, *W1)
    assert result.rc == 2
    assert_cli_error(result, f"--source {other} is not a copy of the dataset in {damaged}")
    assert files_of(damaged) == before


def test_no_source_is_refused_with_what_to_do(
    damaged: pathlib.Path, run_cli: Any, assert_cli_error: Any
) -> None:
    (damaged / shard_rels(damaged)[0]).unlink()
    before = files_of(damaged)
    result = run_cli("verify", damaged, "--repair", *W1)
    assert result.rc == 2
    assert_cli_error(result, "is a packed dataset", "--source SRC")
    assert files_of(damaged) == before


def test_the_dataset_itself_as_source_is_refused(
    damaged: pathlib.Path, run_cli: Any, assert_cli_error: Any
) -> None:
    result = run_cli("verify", damaged, "--repair", "--source", damaged, *W1)
    assert result.rc == 2
    assert_cli_error(result, "itself")


def test_a_symlink_in_place_of_a_shard_is_never_written_through(
    good: pathlib.Path, damaged: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    rels = shard_rels(damaged)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"someone else's file")
    (damaged / rels[1]).unlink()
    (damaged / rels[1]).symlink_to(victim)
    (damaged / rels[2]).unlink()

    rc, out, err = run_cli(
        "verify", damaged, "--repair", "--source", good, "--json", "--workers", "1"
    )
    assert rc == 3, err
    report = json.loads(out)
    assert [r["shard"] for r in report["repaired"]] == [rels[2]]
    [left] = report["unrepaired"]
    assert left["shard"] == rels[1]
    assert (
        "is a symlink" in left["why"] and "refusing to write through or replace it" in left["why"]
    )
    assert victim.read_bytes() == b"someone else's file"
    assert os.readlink(damaged / rels[1]) == str(victim)


def test_a_fifo_in_place_of_a_shard_never_hangs(
    good: pathlib.Path, damaged: pathlib.Path, run_cli: Any
) -> None:
    rel = shard_rels(damaged)[0]
    (damaged / rel).unlink()
    os.mkfifo(damaged / rel)
    rc, out, err = run_cli(
        "verify", damaged, "--repair", "--source", good, "--json", "--workers", "1", timeout=60
    )
    assert rc == 3, err
    [left] = json.loads(out)["unrepaired"]
    assert left["shard"] == rel and "FIFO" in left["why"]
    assert (damaged / rel).is_fifo()


def test_a_pack_holding_the_dataset_keeps_the_repair_out(
    good: pathlib.Path, damaged: pathlib.Path, run_cli: Any, assert_cli_error: Any
) -> None:
    (damaged / shard_rels(damaged)[0]).unlink()
    before = files_of(damaged)
    fd = os.open(damaged, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what `shardio pack` holds while it writes
        result = run_cli("verify", damaged, "--repair", "--source", good, *W1)
    finally:
        os.close(fd)
    assert result.rc == 2
    assert_cli_error(result, "another shardio process", str(damaged))
    assert files_of(damaged) == before
