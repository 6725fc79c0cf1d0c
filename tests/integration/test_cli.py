"""The ``shardio`` command end to end, through real subprocesses on real files.

pack -> verify -> inspect -> ls -> unpack round trips (tar and HDF5), size units, worker
determinism, multi-part packs and merge, verify on damaged datasets, and the Lustre layout
path with a recording fake ``lfs`` first on PATH.
"""

from __future__ import annotations

import filecmp
import json
import os
import pathlib
import shutil

import pytest
from trees import tree_files

from shardio._pool import default_workers
from shardio.cli.common import parse_part
from shardio.errors import UsageError
from shardio.format.spec import FORMAT_VERSION
from shardio.read.reader import ShardReader

SUFFIX = {"tar": ".tar", "hdf5": ".h5"}


W1 = ("--workers", "1", "--no-progress")  # one worker, no progress bar


# --------------------------------------------------------------------------- helpers


def assert_same_tree(expected: pathlib.Path, actual: pathlib.Path) -> None:
    """The two trees hold the same files (names and bytes) and nothing else."""

    def walk(cmp: filecmp.dircmp[str], rel: str) -> None:
        assert not cmp.left_only, f"missing in {actual / rel}: {cmp.left_only}"
        assert not cmp.right_only, f"extra in {actual / rel}: {cmp.right_only}"
        assert not cmp.funny_files, cmp.funny_files
        _, mismatch, errors = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files, shallow=False)
        assert not mismatch, f"differ in {rel or '.'}: {mismatch}"
        assert not errors, errors
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{rel}/{name}" if rel else name)

    walk(filecmp.dircmp(expected, actual), "")


def dataset_files(dst: pathlib.Path) -> dict[str, bytes]:
    """The published files of a dataset (shards, DALI indexes, index, manifest, report)."""
    return {
        p.relative_to(dst).as_posix(): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()
    }


def shard_files(dst: pathlib.Path, fmt: str = "tar") -> list[pathlib.Path]:
    return sorted((dst / "shards").glob(f"shard-*{SUFFIX[fmt]}"))


def manifest(dst: pathlib.Path) -> dict[str, object]:
    return json.loads((dst / "manifest.json").read_text())


def keys_from_source(root: pathlib.Path) -> list[str]:
    """WebDataset keys of an ImageNet-like tree: relative path without the extension."""
    return sorted(p.rsplit(".", 1)[0] for p in tree_files(root))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def packed(packed_small) -> pathlib.Path:
    """The small tree packed once (tar, 256 KiB shards, ~27 shards); copy before damaging."""
    return packed_small("tar", "256KiB", 1)[0]


@pytest.fixture(scope="module")
def tiny_tree(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Eight small files in two classes: for tests about options, not data volume."""
    src = tmp_path_factory.mktemp("tiny") / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(4):
            (src / cls / f"{cls}_{i}.jpg").write_bytes(bytes([i]) * (3000 + 500 * i))
    return src


@pytest.fixture
def damaged_copy(packed: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "ds"
    shutil.copytree(packed, dst)
    return dst


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_pack_verify_inspect_ls_unpack_round_trip(
    fmt: str, small_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, packed_small
) -> None:
    src_files = tree_files(small_tree)
    src_bytes = sum(len(b) for b in src_files.values())

    dst, (rc, out, err) = packed_small(fmt, "1MiB", 1)
    assert rc == 0, err
    assert err == ""
    assert out.startswith(f"packed {len(src_files)} files"), out
    assert f"into {len(src_files)} samples in" in out
    assert f"{fmt} shards" in out
    shards = shard_files(dst, fmt)
    assert len(shards) > 1
    assert f"in {len(shards)} {fmt} shards" in out
    assert not list(dst.rglob("*.shardio-tmp-*"))
    assert not (dst / ".shardio-work").exists()

    rc, out, err = run_cli("verify", dst, "--no-progress")
    assert (rc, err) == (0, ""), err
    assert out.startswith(f"OK: verified {len(shards)} shards"), out

    rc, out, err = run_cli("inspect", dst)
    assert rc == 0, err
    assert "samples       300 (600 members, extensions: cls, jpeg)" in out
    assert f"{fmt} shards" in out

    rc, out, err = run_cli("inspect", dst, "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["format_version"] == FORMAT_VERSION  # what today's shardio writes
    assert info["shard_format"] == fmt
    assert info["samples"] == len(src_files)
    assert info["members"] == 2 * len(src_files)  # the image and its cls label
    assert info["shards"] == len(shards)
    assert info["total_bytes"] == sum(p.stat().st_size for p in shards)
    assert info["data_bytes"] == src_bytes  # the packed files; labels not counted
    assert info["extensions"] == ["cls", "jpeg"]
    assert info["label_layout"] == "split-class-dirs"
    assert info["classes"] == 4

    rc, out, err = run_cli("ls", dst)
    assert rc == 0, err
    keys = out.splitlines()
    assert len(keys) == len(src_files) == len(set(keys))
    assert sorted(keys) == keys_from_source(small_tree)

    rc, out, err = run_cli("ls", dst, "--paths")
    assert rc == 0, err
    assert sorted(out.splitlines()) == sorted(src_files)

    restored = tmp_path / "restored"
    rc, out, err = run_cli("unpack", dst, restored)
    assert rc == 0, err
    assert out.startswith(f"unpacked {len(src_files)} files"), out
    assert_same_tree(small_tree, restored)


NASTY_NAMES = [
    b"c1/with space.jpg",
    "c1/\u00fcn\u00efc\u00f8d\u00e9.jpg".encode(),
    b"c1/latin1-\xe9.jpg",  # not UTF-8
    b"c1/UPPER.JPG",
    b"c1/multi.dot.name.png",
    b"c1/noext",
    b"c1/.hidden",
    b"c2/" + b"x" * 150 + b".jpg",  # longer than a ustar name field
    b"c2/pair.jpg",
    b"c2/pair.JPG",  # same stem and extension once lower-cased
    b"c2/pair.json",
    b"c2/we%ird#chars?.txt",
    b"c2/tab\there.jpg",
    b"c2/a..b.jpg",
    b"c2/trail.",
]


def test_nasty_file_names_round_trip(tmp_path: pathlib.Path, run_cli) -> None:
    src = tmp_path / "nasty"
    for name in NASTY_NAMES:
        path = os.path.join(os.fsencode(src), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(os.urandom(200) + name)
    dst = tmp_path / "ds"
    rc, out, err = run_cli("pack", src, dst, *W1)
    assert rc == 0, err
    assert out.startswith(f"packed {len(NASTY_NAMES)} files"), out
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err
    rc, out, err = run_cli("ls", dst)
    assert rc == 0, err
    keys = out.splitlines()
    assert len(keys) == len(set(keys)) == len(NASTY_NAMES) - 2  # pair.* is one sample
    assert all(k.isascii() and " " not in k and "." not in k for k in keys), keys
    restored = tmp_path / "restored"
    rc, _, err = run_cli("unpack", dst, restored)
    assert rc == 0, err
    assert_same_tree(src, restored)


def test_tar_shards_are_plain_tar_with_dali_indexes(packed: pathlib.Path) -> None:
    import tarfile

    man = manifest(packed)
    for entry in man["shards"]:  # type: ignore[union-attr]
        path = packed / entry["path"]
        with tarfile.open(path) as tf:
            names = tf.getnames()
        assert len(names) == 2 * entry["num_samples"]
        idx = (packed / entry["dali_index"]).read_text().splitlines()
        assert idx[0] == f"v1.2 {entry['num_samples']}"
        assert len(idx) == 1 + entry["num_samples"]


# --------------------------------------------------------------------------- --shard-size


@pytest.mark.parametrize(("text", "limit"), [("512KiB", 512 * 1024), ("1MiB", 1024**2)])
def test_shard_size_units(text: str, limit: int, packed_small) -> None:
    dst = packed_small("tar", text, 1)[0]
    man = manifest(dst)
    assert man["options"]["shard_size_bytes"] == limit  # type: ignore[index]
    sizes = [p.stat().st_size for p in shard_files(dst)]
    assert all(s <= limit for s in sizes), (limit, sizes)
    # Shards are filled: all but the last hold more than half the limit.
    assert all(s > limit // 2 for s in sizes[:-1]), sizes
    total = sum(sizes)
    assert len(sizes) == -(-total // limit) or len(sizes) == -(-total // limit) + 1


def test_shard_size_binary_and_plain_bytes_agree(packed_small) -> None:
    a = packed_small("tar", "512KiB", 1)[0]
    b = packed_small("tar", "524288", 1)[0]
    assert dataset_files(a) == dataset_files(b)


@pytest.mark.parametrize("text", ["12 parsecs", "abc", "0", "-5MiB", "1KiB"])
def test_bad_shard_size_is_one_line_usage_error(
    text: str, tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    dst = tmp_path / "ds"
    result = run_cli("pack", tiny_tree, dst, f"--shard-size={text}", "--no-progress")
    assert result.rc == 2
    line = assert_cli_error(result)
    if text != "1KiB":
        assert repr(text) in line
    assert not dst.exists()


# --------------------------------------------------------------------------- workers


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_workers_2_output_byte_identical_to_workers_1(fmt: str, packed_small) -> None:
    outputs = [dataset_files(packed_small(fmt, "256KiB", w)[0]) for w in (1, 2)]
    assert len([k for k in outputs[0] if k.startswith("shards/shard-")]) > 10
    assert outputs[0].keys() == outputs[1].keys()
    for name, data in outputs[0].items():
        assert outputs[1][name] == data, name


def test_default_workers_from_slurm_env() -> None:
    affinity = len(os.sched_getaffinity(0))
    assert default_workers({"SLURM_CPUS_PER_TASK": "3"}) == 3
    assert default_workers({"SLURM_CPUS_PER_TASK": "3", "SLURM_CPUS_ON_NODE": "64"}) == 3
    assert default_workers({"SLURM_CPUS_ON_NODE": "64"}) == 64
    assert default_workers({}) == affinity
    for bad in ("0", "x", "", "\u00b2"):  # refused, not skipped
        with pytest.raises(UsageError, match="SLURM_CPUS_PER_TASK="):
            default_workers({"SLURM_CPUS_PER_TASK": bad})
    assert affinity >= 1


def test_pack_uses_slurm_cpus_per_task(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, packed_small
) -> None:
    """Without --workers, SLURM_CPUS_PER_TASK decides; the output is the same as 1 worker."""
    dst = tmp_path / "slurm"
    rc, _, err = run_cli(
        "pack",
        small_tree,
        dst,
        "--shard-size",
        "1MiB",
        "--no-progress",
        env={"SLURM_CPUS_PER_TASK": "2"},
    )
    assert rc == 0, err
    assert dataset_files(dst) == dataset_files(packed_small("tar", "1MiB", 1)[0])


def test_bad_workers_is_usage_error(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    result = run_cli("pack", tiny_tree, tmp_path / "ds", "--workers", "0")
    assert result.rc == 2
    assert_cli_error(result, "--workers")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("pack",), ("pack:", "src, dst", "shardio pack --help")),
        (("frob",), ("invalid choice", "'frob'", "shardio --help")),
        (("stage", "src", "--bogus"), ("--bogus",)),
        (("pack", "a", "b", "--workers", "x"), ("--workers", "'x'")),
        (("verify", "ds", "--workers"), ("--workers", "expected one argument")),
        ((), ("COMMAND",)),
    ],
)
def test_argument_mistakes_are_one_line_usage_errors(
    args: tuple[str, ...], needles: tuple[str, ...], run_cli, assert_cli_error
) -> None:
    """argparse's own errors follow the CLI's rule: one line, exit 2, no usage dump."""
    result = run_cli(*args)
    assert result.rc == 2
    assert_cli_error(result, *needles)


# --------------------------------------------------------------------------- parts + merge


def test_parts_then_merge_equals_single_pack(
    small_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error, packed_small
) -> None:
    single = packed_small("tar", "512KiB", 1)[0]

    dst = tmp_path / "parts"
    rc, out, err = run_cli(
        "pack",
        small_tree,
        dst,
        "--part",
        "0/2",
        "--shard-size",
        "512KiB",
        *W1,
    )
    assert rc == 0, err
    assert "part 0/2 of" in out
    assert f"when all 2 parts are done, run: shardio merge {dst}" in out
    assert not (dst / "manifest.json").exists()

    # Merging before every part has finished fails clearly and changes nothing.
    before = dataset_files(dst)
    result = run_cli("merge", dst)
    assert result.rc == 2
    assert_cli_error(result, "parts 1 of 2 have not finished")
    assert dataset_files(dst) == before
    assert not (dst / "manifest.json").exists()

    rc, out, err = run_cli(
        "pack",
        small_tree,
        dst,
        "--part",
        "1/2",
        "--shard-size",
        "512KiB",
        *W1,
    )
    assert rc == 0, err
    assert not (dst / "manifest.json").exists()

    rc, out, err = run_cli("merge", dst)
    assert rc == 0, err
    assert out.startswith(f"merged 2 parts into {dst}: 300 samples"), out
    assert not (dst / ".shardio-work").exists()

    rc, out, err = run_cli("verify", dst, *W1)
    assert rc == 0, err
    assert out.startswith("OK"), out

    names = [p.name for p in shard_files(dst)]
    assert any(n.startswith("shard-p0000-") for n in names)
    assert any(n.startswith("shard-p0001-") for n in names)

    keys = {}
    for d in (single, dst):
        rc, out, err = run_cli("ls", d)
        assert rc == 0, err
        keys[d] = out.splitlines()
    assert keys[dst] == keys[single]  # same samples, same order
    m_single, m_parts = manifest(single), manifest(dst)
    for field in ("num_samples", "num_members", "data_bytes", "labels"):
        assert m_parts[field] == m_single[field], field

    restored = tmp_path / "restored"
    rc, _, err = run_cli("unpack", dst, restored)
    assert rc == 0, err
    assert_same_tree(small_tree, restored)

    # A second merge: nothing left to merge.
    result = run_cli("merge", dst)
    assert result.rc == 2
    assert_cli_error(result, "already merged")


def test_part_auto_from_slurm_env(tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli) -> None:
    auto, explicit = tmp_path / "auto", tmp_path / "explicit"
    for rank in ("0", "1"):
        rc, out, err = run_cli(
            "pack",
            tiny_tree,
            auto,
            "--part",
            "auto",
            "--shard-size",
            "8KiB",
            *W1,
            env={"SLURM_PROCID": rank, "SLURM_NTASKS": "2"},
        )
        assert rc == 0, err
        assert f"part {rank}/2 of" in out
        rc, _, err = run_cli(
            "pack",
            tiny_tree,
            explicit,
            "--part",
            f"{rank}/2",
            "--shard-size",
            "8KiB",
            *W1,
        )
        assert rc == 0, err
    for d in (auto, explicit):
        rc, _, err = run_cli("merge", d)
        assert rc == 0, err
    assert dataset_files(auto) == dataset_files(explicit)


@pytest.mark.parametrize(
    ("part", "env", "needle"),
    [
        ("auto", {}, "SLURM_PROCID"),
        ("2/2", {}, "'2/2'"),
        ("1", {}, "'1'"),
        ("auto", {"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 is not below"),
    ],
)
def test_bad_part_is_usage_error(
    part: str,
    env: dict[str, str],
    needle: str,
    tiny_tree: pathlib.Path,
    tmp_path: pathlib.Path,
    run_cli,
    assert_cli_error,
) -> None:
    dst = tmp_path / "ds"
    result = run_cli("pack", tiny_tree, dst, "--part", part, env=env)
    assert result.rc == 2
    assert_cli_error(result, needle)
    assert not dst.exists()


def test_parse_part_unit() -> None:
    assert parse_part("3/8", {}) == (3, 8)
    assert parse_part("auto", {"SLURM_PROCID": "5", "SLURM_NTASKS": "6"}) == (5, 6)
    for bad in ("8/8", "-1/4", "a/b", "3", "/4"):
        with pytest.raises(UsageError):
            parse_part(bad, {})


def test_merge_of_a_directory_without_parts(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    (tmp_path / "empty").mkdir()
    result = run_cli("merge", tmp_path / "empty")
    assert result.rc == 2
    assert_cli_error(result, str(tmp_path / "empty"))


# --------------------------------------------------------------------------- verify


def test_verify_json_on_intact_dataset(packed: pathlib.Path, run_cli) -> None:
    rc, out, err = run_cli("verify", packed, "--json", "--workers", "1")
    assert (rc, err) == (0, "")
    report = json.loads(out)
    shards = shard_files(packed)
    assert report["ok"] is True
    assert report["quick"] is False
    assert report["shards_checked"] == len(shards)
    assert report["bytes_checked"] == sum(p.stat().st_size for p in shards)
    assert report["problems"] == []


def _member_of(dst: pathlib.Path, shard_no: int) -> tuple[str, str, int, int]:
    """(shard path, sample key, member offset, member size) of a JPEG member in a shard."""
    with ShardReader(dst) as ds:
        entry = ds.manifest.shards[shard_no]
        sample = entry.first_sample + entry.num_samples // 2
        for m in ds.index.sample_member_range(sample):
            rec = ds.index.members[m]
            if ds.index.exts[int(rec["ext_id"])] == "jpeg":
                return entry.path, ds.key(sample), int(rec["offset"]), int(rec["size"])
    raise AssertionError("no jpeg member")


def _flip(path: pathlib.Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_verify_flipped_byte_names_shard_and_sample(
    workers: str, damaged_copy: pathlib.Path, run_cli
) -> None:
    shard, key, off, size = _member_of(damaged_copy, 3)
    _flip(damaged_copy / shard, off + size // 2)

    rc, out, err = run_cli("verify", damaged_copy, "--workers", workers, "--no-progress")
    assert rc == 3, (out, err)
    assert "Traceback" not in err
    assert f"DAMAGED {shard}: 1 damaged member(s)" in err
    assert f"sample {key} member jpeg" in err
    assert "FAILED: 1 of" in err
    assert "1 samples affected" in err

    rc, out, err = run_cli("verify", damaged_copy, "--json", "--workers", workers)
    assert rc == 3
    report = json.loads(out)
    assert report["ok"] is False
    [problem] = report["problems"]
    assert problem["shard"] == shard
    [bad] = problem["bad_samples"]
    assert bad["key"] == key
    assert bad["member"] == "jpeg"
    assert bad["expected"] != bad["actual"]


def test_verify_flipped_byte_in_tar_header(damaged_copy: pathlib.Path, run_cli) -> None:
    """A damaged header is outside any member: the shard checksum still catches it."""
    shard = "shards/shard-000002.tar"
    _flip(damaged_copy / shard, 5)  # inside the first member's name field
    rc, _, err = run_cli("verify", damaged_copy, *W1)
    assert rc == 3
    assert f"DAMAGED {shard}: shard checksum mismatch" in err


def test_verify_truncated_shard(damaged_copy: pathlib.Path, run_cli) -> None:
    shard = "shards/shard-000004.tar"
    path = damaged_copy / shard
    full = path.stat().st_size
    os.truncate(path, full // 2)
    for extra in ((), ("--quick",)):
        rc, _, err = run_cli("verify", damaged_copy, *extra, *W1)
        assert rc == 3, (extra, err)
        assert f"DAMAGED {shard}: size {full // 2} bytes, expected {full}" in err, err
        assert "Traceback" not in err
    rc, out, _ = run_cli("verify", damaged_copy, "--json", "--workers", "1")
    assert rc == 3
    [problem] = json.loads(out)["problems"]
    assert problem["shard"] == shard
    assert any(b["actual"] == "truncated" for b in problem["bad_samples"])


def test_verify_missing_shard(damaged_copy: pathlib.Path, run_cli) -> None:
    shard = "shards/shard-000001.tar"
    (damaged_copy / shard).unlink()
    for extra in ((), ("--quick",)):
        rc, _, err = run_cli("verify", damaged_copy, *extra, *W1)
        assert rc == 3, (extra, err)
        assert f"DAMAGED {shard}: missing" in err
    rc, out, _ = run_cli("verify", damaged_copy, "--quick", "--json", "--workers", "1")
    assert rc == 3
    report = json.loads(out)
    assert report["quick"] is True
    [problem] = report["problems"]
    # The fields of earlier releases, unchanged; newer ones are only added.
    assert {k: problem[k] for k in ("shard", "reason", "bad_samples")} == {
        "shard": shard,
        "reason": "missing",
        "bad_samples": [],
    }
    assert (problem["state"], problem["staged"]) == ("missing", False)
    assert (report["status"], report["staging_area"]) == ("damaged", None)


def test_verify_missing_dali_index(damaged_copy: pathlib.Path, run_cli) -> None:
    """A lost .idx beside an intact shard loses no training byte: "rewritable" (degraded)."""
    (damaged_copy / "shards/shard-000000.idx").unlink()
    rc, _, err = run_cli("verify", damaged_copy, "--quick", *W1)
    assert rc == 5
    assert "REWRITABLE shards/shard-000000.idx: DALI index missing beside the intact" in err


def test_verify_quick_reads_no_shard_data(damaged_copy: pathlib.Path, run_cli) -> None:
    """--quick checks existence and sizes only: a same-size shard of garbage passes it
    (while the full verify fails), and a truncated or missing one fails it."""
    garbage = damaged_copy / "shards/shard-000005.tar"
    garbage.write_bytes(b"\x55" * garbage.stat().st_size)
    rc, out, err = run_cli("verify", damaged_copy, "--quick", *W1)
    assert (rc, err) == (0, "")
    assert out.startswith("OK: quick check of"), out
    rc, out, _ = run_cli("verify", damaged_copy, "--quick", "--json", "--workers", "1")
    assert rc == 0
    assert json.loads(out)["bytes_checked"] == 0
    rc, _, err = run_cli("verify", damaged_copy, *W1)
    assert rc == 3
    assert "DAMAGED shards/shard-000005.tar" in err


def test_verify_damaged_index(damaged_copy: pathlib.Path, run_cli) -> None:
    index = damaged_copy / "index.bin"
    _flip(index, index.stat().st_size - 3)  # past the last section: a byte no reader uses
    rc, _, err = run_cli("verify", damaged_copy, *W1)
    assert rc == 3, err
    assert "DAMAGED index.bin: index checksum mismatch" in err


def test_verify_truncated_index_is_one_line(
    damaged_copy: pathlib.Path, run_cli, assert_cli_error
) -> None:
    os.truncate(damaged_copy / "index.bin", 100)  # shorter than the header
    result = run_cli("verify", damaged_copy, *W1)
    assert result.rc == 1
    assert_cli_error(result, "index.bin")


def test_unpack_of_damaged_dataset_fails_with_one_line(
    damaged_copy: pathlib.Path, tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    shard, key, off, _ = _member_of(damaged_copy, 2)
    _flip(damaged_copy / shard, off + 1)
    result = run_cli("unpack", damaged_copy, tmp_path / "out")
    assert_cli_error(result, "checksum mismatch", key)


# --------------------------------------------------------------------------- Lustre layout


def _calls(log: pathlib.Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [line.split("\t") for line in log.read_text().splitlines()]


def test_lustre_auto_stripe_set_before_any_shard(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, lustre_env
) -> None:
    env, log = lustre_env
    env["SHARDIO_FAKE_OSTS"] = "3"
    dst = tmp_path / "ds"
    # 1 GiB shards: one stripe per 256 MiB -> 4, capped by the 3 OSTs; 4 MiB stripes.
    rc, out, err = run_cli(
        "pack",
        tiny_tree,
        dst,
        "--fs-type",
        "lustre",
        "--shard-size",
        "1GiB",
        *W1,
        env=env,
    )
    assert (rc, err) == (0, ""), err
    shards_dir = str(dst / "shards")
    assert _calls(log) == [
        ["lfs", "df", shards_dir, "tars=0"],
        ["lfs", "setstripe", "-c", "3", "-S", "4M", shards_dir, "tars=0"],
    ]
    assert f"layout: Lustre layout 3x4MiB set: lfs setstripe -c 3 -S 4M {shards_dir}" in out
    layout = manifest(dst)["layout"]
    assert layout == {
        "fs_type": "lustre",
        "action": "applied",
        "stripe": "3x4MiB",
        "commands": [["lfs", "setstripe", "-c", "3", "-S", "4M", shards_dir]],
        "message": f"Lustre layout 3x4MiB set: lfs setstripe -c 3 -S 4M {shards_dir}",
    }
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def test_lustre_layout_is_set_by_each_part(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, lustre_env
) -> None:
    """Each part sets the layout of DST/shards; the second finds the first's shards there
    (which also shows the fake really sees shards), and the merged manifest records it."""
    env, log = lustre_env
    dst = tmp_path / "ds"
    for part in ("0/2", "1/2"):
        rc, _, err = run_cli(
            "pack", tiny_tree, dst, "--part", part, "--fs-type", "lustre",
            "--stripe", "2x1MiB", "--shard-size", "8KiB", *W1, env=env,
        )  # fmt: skip
        assert (rc, err) == (0, ""), err
    shards_dir = str(dst / "shards")
    calls = _calls(log)
    assert [c[:-1] for c in calls] == [["lfs", "setstripe", "-c", "2", "-S", "1M", shards_dir]] * 2
    assert calls[0][-1] == "tars=0"
    assert calls[1][-1] != "tars=0"
    rc, _, err = run_cli("merge", dst)
    assert rc == 0, err
    assert manifest(dst)["layout"]["stripe"] == "2x1MiB"  # type: ignore[index]


def test_lustre_explicit_stripe(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, lustre_env
) -> None:
    env, log = lustre_env
    dst = tmp_path / "ds"
    rc, _, err = run_cli(
        "pack",
        tiny_tree,
        dst,
        "--fs-type",
        "lustre",
        "--stripe",
        "8x4MiB",
        "--shard-size",
        "1MiB",
        *W1,
        env=env,
    )
    assert (rc, err) == (0, ""), err
    shards_dir = str(dst / "shards")
    assert _calls(log) == [["lfs", "setstripe", "-c", "8", "-S", "4M", shards_dir, "tars=0"]]
    layout = manifest(dst)["layout"]
    assert layout["action"] == "applied"  # type: ignore[index]
    assert layout["stripe"] == "8x4MiB"  # type: ignore[index]
    assert layout["commands"] == [["lfs", "setstripe", "-c", "8", "-S", "4M", shards_dir]]  # type: ignore[index]


def test_lustre_stripe_none_runs_nothing(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, lustre_env
) -> None:
    env, log = lustre_env
    dst = tmp_path / "ds"
    rc, _, err = run_cli(
        "pack",
        tiny_tree,
        dst,
        "--fs-type",
        "lustre",
        "--stripe",
        "none",
        "--shard-size",
        "1MiB",
        *W1,
        env=env,
    )
    assert (rc, err) == (0, ""), err
    assert _calls(log) == []
    layout = manifest(dst)["layout"]
    assert layout["action"] == "none"  # type: ignore[index]
    assert layout["commands"] == []  # type: ignore[index]


def test_lustre_bad_stripe_is_usage_error(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, lustre_env, assert_cli_error
) -> None:
    env, log = lustre_env
    dst = tmp_path / "ds"
    result = run_cli("pack", tiny_tree, dst, "--fs-type", "lustre", "--stripe", "8x3KiB", env=env)
    assert result.rc == 2
    assert_cli_error(result, "'8x3KiB'")
    assert _calls(log) == []
    assert not (dst / "manifest.json").exists()


@pytest.mark.parametrize("stripe", ["auto", "8x4MiB"])
def test_lustre_without_lfs_warns_once_and_packs(
    stripe: str, tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli
) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    dst = tmp_path / "ds"
    rc, _, err = run_cli(
        "pack",
        tiny_tree,
        dst,
        "--fs-type",
        "lustre",
        "--stripe",
        stripe,
        "--shard-size",
        "1MiB",
        *W1,
        env={"PATH": str(empty_bin)},
    )
    assert rc == 0, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one warning line, got {lines!r}"
    assert lines[0].startswith("shardio: WARNING: ")
    assert "lfs not found" in lines[0]
    layout = manifest(dst)["layout"]
    assert layout["action"] == "failed"  # type: ignore[index]
    rc, _, err = run_cli("verify", dst, *W1)
    assert rc == 0, err


def test_lustre_failing_lfs_warns_and_packs(
    tiny_tree: pathlib.Path, tmp_path: pathlib.Path, run_cli, lustre_env
) -> None:
    env, _ = lustre_env
    env["SHARDIO_FAKE_RC"] = "1"
    dst = tmp_path / "ds"
    rc, _, err = run_cli(
        "pack",
        tiny_tree,
        dst,
        "--fs-type",
        "lustre",
        "--stripe",
        "4x1MiB",
        "--shard-size",
        "1MiB",
        *W1,
        env=env,
    )
    assert rc == 0, err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    assert "lfs setstripe -c 4 -S 1M" in lines[0]
    assert "exited with status 1" in lines[0]
    assert manifest(dst)["layout"]["action"] == "failed"  # type: ignore[index]
