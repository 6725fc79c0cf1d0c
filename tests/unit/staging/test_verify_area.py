"""``shardio verify`` of a staging area checks the staged copies themselves, and ``--repair``
stages again what is missing, damaged or stale.

Before this, verify resolved each shard like a reader does (the copy if its stamp matched,
else the source) and said "OK" over a flipped, a truncated and a deleted copy. Exit codes:
0 intact, 5 degraded (the source is intact), 3 damage left (the source is bad too), 4
repaired. Planted symlinks and FIFOs are never read, written through, replaced or removed.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

import pytest

from shardio.format.checksum import file_xxh3_128
from shardio.read.reader import ShardReader
from shardio.staging import StageOptions, stage_dataset
from shardio.staging.protocol import stamp_matches, write_stamp
from shardio.tools.repair import repair_dataset
from shardio.tools.verify import verify_dataset

W1 = ("--workers", "1", "--no-progress")
TIMEOUT_S = 60  # a FIFO that blocked a check would hit it


@pytest.fixture(scope="module")
def area_src(make_source: Any) -> Any:
    """48 files of ~2 KiB in 16 KiB tar shards: 7 shards."""
    src = make_source("areads", files=48, size_bytes=2048, shard_size_bytes=16 * 1024)
    assert src.num_shards >= 6
    return src


def stage_all(src_path: pathlib.Path, dest: pathlib.Path) -> None:
    result = stage_dataset(src_path, dest, StageOptions(durable=False))
    assert result.copied + result.present == result.shards_needed


def member_at(src_path: pathlib.Path, shard: int) -> tuple[str, int, int]:
    """(sample key, offset, size) of the payload member of a sample in the middle of shard."""
    with ShardReader(src_path) as ds:
        entry = ds.manifest.shards[shard]
        sample = entry.first_sample + entry.num_samples // 2
        for m in ds.index.sample_member_range(sample):
            rec = ds.index.members[m]
            if ds.index.exts[int(rec["ext_id"])] == "bin":
                return ds.key(sample), int(rec["offset"]), int(rec["size"])
    raise AssertionError("no bin member")


def flip(path: pathlib.Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


def damage_three(src_path: pathlib.Path, dest: pathlib.Path, rels: list[str]) -> dict[str, str]:
    """Flip a member byte of copy 1, truncate copy 2, delete copy 3: {rel: kind}."""
    _key, off, size = member_at(src_path, 1)
    flip(dest / rels[1], off + size // 2)
    os.truncate(dest / rels[2], (dest / rels[2]).stat().st_size // 2)
    (dest / rels[3]).unlink()
    return {rels[1]: "flipped", rels[2]: "truncated", rels[3]: "deleted"}


def by_shard(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["shard"]: p for p in report["problems"]}


def temp_names(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*shardio-tmp*"))


# --------------------------------------------------------------------------- verify


def test_flipped_truncated_and_deleted_copies_are_each_reported(
    area_src: Any, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    rels = area_src.rels
    damage_three(area_src.path, dest, rels)

    rc, out, err = run_cli("verify", dest, "--json", "--workers", "1")
    assert rc == 5, err
    report = json.loads(out)
    assert report["ok"] is False
    assert report["status"] == "degraded"
    problems = by_shard(report)
    assert set(problems) == {rels[1], rels[2], rels[3]}
    assert all(p["staged"] for p in problems.values())
    flipped, truncated, deleted = problems[rels[1]], problems[rels[2]], problems[rels[3]]
    assert flipped["state"] == "damaged"
    [bad] = flipped["bad_samples"]
    assert bad["key"] == member_at(area_src.path, 1)[0]
    assert bad["expected"] != bad["actual"]
    assert truncated["state"] == "damaged"
    assert "size" in truncated["reason"]
    assert any(b["actual"] == "truncated" for b in truncated["bad_samples"])
    assert deleted["state"] == "missing"
    assert "deleted after it was staged" in deleted["reason"]
    area = report["staging_area"]
    assert area["source"] == os.path.abspath(area_src.path)
    assert area["copies_ok"] == area_src.num_shards - 3
    assert area["source_checked"] == 3
    assert area["source_problems"] == []

    rc, out, err = run_cli("verify", dest, *W1)
    assert rc == 5
    assert "OK" not in out
    assert f"DAMAGED {rels[1]} (staged copy): 1 damaged member(s)" in err
    assert f"MISSING {rels[3]} (staged copy)" in err
    assert f"DEGRADED: 3 of {area_src.num_shards} staged copies" in err
    assert f"the source {os.path.abspath(area_src.path)} is intact for them" in err
    assert "Traceback" not in err

    # --quick reads no data: the truncated and the deleted copy, and the flipped one as
    # stale (its stamp no longer matches, which a write always causes).
    rc, out, _ = run_cli("verify", dest, "--quick", "--json", "--workers", "1")
    assert rc == 5
    quick = by_shard(json.loads(out))
    assert {k: v["state"] for k, v in quick.items()} == {
        rels[1]: "stale",
        rels[2]: "damaged",
        rels[3]: "missing",
    }


def test_intact_area_is_ok_and_counts_bytes(area_src: Any, tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    report = verify_dataset(dest, workers=2)
    assert report.ok and report.status == "intact"
    assert report.area is not None and report.area.copies_ok == area_src.num_shards
    assert report.bytes_checked == area_src.size_of(area_src.rels)


def test_stale_but_intact_and_not_staged(area_src: Any, tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    rels = area_src.rels
    same = (dest / rels[0]).read_bytes()
    (dest / rels[0]).write_bytes(same)  # rewritten with its own bytes: stamp off, bytes fine
    (dest / rels[4]).unlink()
    (dest / ".shardio-stage" / "ok" / (rels[4].replace("/", "__") + ".json")).unlink()

    report = verify_dataset(dest)
    states = {p.path: (p.state, p.reason) for p in report.problems}
    assert states[rels[0]][0] == "stale"
    assert "bytes are intact" in states[rels[0]][1]
    # the last stage run chose it: a missing copy, not a shard this node never stages
    assert states[rels[4]][0] == "missing"
    assert "chose it" in states[rels[4]][1]
    assert report.status == "degraded"


def test_a_partly_staged_area_is_intact(
    area_src: Any, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    """``--capacity`` (or ``--node I/N``) stages a share: the other shards are not problems,
    their source is checked instead, and --repair does not stage them."""
    dest = tmp_path / "area"
    half = sum(s.size_bytes for s in area_src.manifest.shards) // 2
    result = stage_dataset(area_src.path, dest, StageOptions(durable=False, capacity_bytes=half))
    assert 0 < result.copied < area_src.num_shards
    report = verify_dataset(dest)
    assert report.status == "intact", report.problems
    assert report.area is not None
    assert report.area.not_staged == area_src.num_shards - result.copied
    assert report.area.source_checked == report.area.not_staged
    rc, out, err = run_cli("verify", dest, "--no-progress")
    assert rc == 0, err
    assert "not staged here" in out
    rc, out, err = run_cli("verify", "--repair", dest, "--no-progress")
    assert rc == 0, err
    assert len([p for p in (dest / "shards").iterdir() if p.suffix == ".tar"]) == result.copied


# --------------------------------------------------------------------------- repair


def test_repair_fixes_them_then_verify_is_clean(
    area_src: Any, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    rels = area_src.rels
    damage_three(area_src.path, dest, rels)
    # Bit rot: a flipped byte whose stamp is refreshed, so stat alone cannot tell.
    _key, off, _size = member_at(area_src.path, 5)
    flip(dest / rels[5], off + 1)
    entry = area_src.manifest.shards[5]
    write_stamp(str(dest), rels[5], entry.xxh3_128, durable=False)
    assert stamp_matches(str(dest), rels[5], entry.xxh3_128)

    rc, out, err = run_cli("verify", dest, "--repair", "--json", "--workers", "1")
    assert rc == 4, err
    report = json.loads(out)
    assert report["status"] == "repaired"
    assert report["found_status"] == "degraded"
    assert {r["shard"] for r in report["repaired"]} == {rels[1], rels[2], rels[3], rels[5]}
    assert report["unrepaired"] == []
    for rel in rels:
        assert (dest / rel).read_bytes() == (area_src.path / rel).read_bytes(), rel
        entry = area_src.manifest.shards[rels.index(rel)]
        assert stamp_matches(str(dest), rel, entry.xxh3_128), rel
    assert temp_names(dest) == []

    rc, out, err = run_cli("verify", dest, *W1)
    assert rc == 0, err
    assert out.startswith(f"OK: verified {area_src.num_shards} staged copies")

    rc, out, _ = run_cli("verify", dest, "--repair", *W1)
    assert rc == 0
    assert "nothing to repair" in out


def test_repair_prints_what_it_fixed(area_src: Any, tmp_path: pathlib.Path, run_cli: Any) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    rels = area_src.rels
    damage_three(area_src.path, dest, rels)
    rc, out, err = run_cli("verify", dest, "--repair", *W1)
    assert rc == 4, err
    assert f"repaired {rels[3]} (missing): staged again from" in out
    assert f"repaired {rels[1]} (damaged): the damaged copy was dropped" in out
    assert "REPAIRED: repaired 3 shards, could not repair 0" in out


@pytest.fixture
def own_source(area_src: Any, tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy of the source, free to damage."""
    src = tmp_path / "src"
    shutil.copytree(area_src.path, src)
    return src


def test_a_bad_source_too_is_damage_left(
    area_src: Any, own_source: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    dest = tmp_path / "area"
    stage_all(own_source, dest)
    rels = area_src.rels
    (dest / rels[2]).unlink()
    os.truncate(own_source / rels[2], 100)  # and its source: nothing to fall back to
    (dest / rels[4]).unlink()  # its source is intact: repairable

    rc, out, err = run_cli("verify", dest, "--json", "--workers", "1")
    assert rc == 3, err
    report = json.loads(out)
    assert report["status"] == "damaged"
    [bad] = report["staging_area"]["source_problems"]
    assert bad["shard"] == rels[2]
    assert "is 100 bytes" in bad["reason"]
    rc, _, err = run_cli("verify", dest, *W1)
    assert rc == 3
    assert f"DAMAGED {rels[2]} (source, read instead of the copy)" in err
    assert "FAILED: 2 of" in err and "1 of their source shards" in err

    rc, out, err = run_cli("verify", dest, "--repair", "--json", "--workers", "1")
    assert rc == 3, err
    report = json.loads(out)
    assert [r["shard"] for r in report["repaired"]] == [rels[4]]
    [left] = report["unrepaired"]
    assert left["shard"] == rels[2] and left["damage"] is True
    assert (dest / rels[4]).read_bytes() == (area_src.path / rels[4]).read_bytes()
    assert not (dest / rels[2]).exists()
    assert temp_names(dest) == []


def test_a_flipped_source_is_found_by_the_repair(
    area_src: Any, own_source: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    """The source check is quick (exists, size): a same-size flip shows when copying."""
    dest = tmp_path / "area"
    stage_all(own_source, dest)
    rels = area_src.rels
    _key, off, _size = member_at(own_source, 3)
    flip(own_source / rels[3], off)
    flip(dest / rels[3], off)

    assert verify_dataset(dest).status == "degraded"
    rc, out, err = run_cli("verify", dest, "--repair", *W1)
    assert rc == 3, (out, err)
    assert f"could not repair {rels[3]}: source shard" in err
    assert "does not match its manifest checksum" in err
    assert "FAILED: repaired 0 shards, could not repair 1" in err


def test_rebuild_hook_is_tried_when_the_source_is_bad(
    area_src: Any, own_source: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "area"
    stage_all(own_source, dest)
    rels = area_src.rels
    (dest / rels[2]).unlink()
    good = (own_source / rels[2]).read_bytes()
    os.truncate(own_source / rels[2], 10)
    asked: list[int] = []

    def rebuild(shard: int) -> bool:  # a stand-in for parity: puts the source right
        asked.append(shard)
        (own_source / rels[shard]).write_bytes(good)
        return True

    result = repair_dataset(dest, rebuild=rebuild)
    assert asked == [2]
    assert result.status == "repaired", result.unrepaired
    [fixed] = result.repaired
    assert fixed.path == rels[2] and fixed.how.startswith("rebuilt at the source")
    assert file_xxh3_128(dest / rels[2]) == area_src.manifest.shards[2].xxh3_128

    os.truncate(own_source / rels[2], 10)
    (dest / rels[2]).unlink()
    result = repair_dataset(dest, rebuild=lambda shard: False)
    assert result.status == "damaged"
    [left] = result.unrepaired
    assert "it could not be rebuilt" in left.why


# --------------------------------------------------------------------------- planted files


def test_a_planted_symlink_is_never_read_written_through_or_removed(
    area_src: Any, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    rels = area_src.rels
    # Two traps: a link to a file of someone else's, and a link to a perfect copy of the
    # shard (reading through it would "verify": it must not count as a staged copy).
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"not shardio's")
    twin = tmp_path / "twin.tar"
    twin.write_bytes((area_src.path / rels[1]).read_bytes())
    (dest / rels[0]).unlink()
    (dest / rels[0]).symlink_to(victim)
    (dest / rels[1]).unlink()
    (dest / rels[1]).symlink_to(twin)
    twin_before = twin.read_bytes()

    rc, out, err = run_cli("verify", dest, "--json", "--workers", "1")
    assert rc == 5, err  # training reads the source for both
    problems = by_shard(json.loads(out))
    assert problems[rels[0]]["state"] == problems[rels[1]]["state"] == "foreign"
    assert "symlink" in problems[rels[0]]["reason"]

    rc, out, err = run_cli("verify", dest, "--repair", "--json", "--workers", "1")
    assert rc == 5, err
    report = json.loads(out)
    assert {u["shard"] for u in report["unrepaired"]} == {rels[0], rels[1]}
    assert all("symlink" in u["why"] and not u["damage"] for u in report["unrepaired"])
    assert all("\n" not in u["why"] for u in report["unrepaired"])
    assert os.readlink(dest / rels[0]) == str(victim)
    assert os.readlink(dest / rels[1]) == str(twin)
    assert victim.read_bytes() == b"not shardio's"
    assert twin.read_bytes() == twin_before

    rc, _, err = run_cli("verify", dest, "--repair", *W1)
    assert rc == 5
    assert f"could not repair {rels[0]}: " in err and "is a symlink" in err
    assert "DEGRADED: repaired 0 shards, could not repair 2" in err


def test_a_planted_fifo_never_hangs(area_src: Any, tmp_path: pathlib.Path, run_cli: Any) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    rels = area_src.rels
    (dest / rels[2]).unlink()
    os.mkfifo(dest / rels[2])
    (dest / rels[3]).unlink()  # and a repairable one beside it

    for args in (("--json",), ("--quick", "--json")):
        rc, out, err = run_cli("verify", dest, *args, "--workers", "1", timeout=TIMEOUT_S)
        assert rc == 5, err
        assert by_shard(json.loads(out))[rels[2]]["state"] == "foreign"
    rc, out, err = run_cli(
        "verify", dest, "--repair", "--json", "--workers", "1", timeout=TIMEOUT_S
    )
    assert rc == 5, err
    report = json.loads(out)
    assert [r["shard"] for r in report["repaired"]] == [rels[3]]
    [left] = report["unrepaired"]
    assert left["shard"] == rels[2] and "FIFO" in left["why"]
    assert (dest / rels[2]).is_fifo()


# --------------------------------------------------------------------------- refusals


def test_repair_of_an_area_from_another_dataset_is_refused(
    area_src: Any, make_source: Any, tmp_path: pathlib.Path, run_cli: Any, assert_cli_error: Any
) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    (dest / area_src.rels[1]).unlink()
    other = make_source("otherds", files=24, size_bytes=2048, shard_size_bytes=16 * 1024, seed=7)
    result = run_cli("verify", dest, "--repair", "--source", other.path, *W1)
    assert result.rc == 2
    assert_cli_error(result, f"--source {other.path} is not a copy of the dataset in {dest}")
    assert not (dest / area_src.rels[1]).exists()


def test_source_without_repair_is_a_usage_error(
    area_src: Any, tmp_path: pathlib.Path, run_cli: Any, assert_cli_error: Any
) -> None:
    dest = tmp_path / "area"
    stage_all(area_src.path, dest)
    result = run_cli("verify", dest, "--source", area_src.path, *W1)
    assert result.rc == 2
    assert_cli_error(result, "--source is for --repair")
    result = run_cli("verify", dest, "--repair", "--quick", *W1)
    assert result.rc == 2
    assert_cli_error(result, "drop --quick")
