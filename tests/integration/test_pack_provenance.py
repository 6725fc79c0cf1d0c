"""Provenance on the pack side, through the CLI: one plan per merged pack, and label maps
fixed by the class directories or pinned across splits (``--labels-from``, ``--classes``).

Also the pack summary's wording: a ``--resume`` of a finished dataset, and a cut list of
skipped files.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tarfile

import pytest
from conftest import CliResult
from trees import write_tree

from shardio.cli.main import main

W1 = ("--workers", "1", "--no-progress")


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):
    """``cli(*args)``: the shardio CLI in this process -> CliResult(rc, stdout, stderr)."""

    def run(*args: str | os.PathLike[str]) -> CliResult:
        capsys.readouterr()
        rc = main([os.fspath(a) for a in args])
        out, err = capsys.readouterr()
        return CliResult(rc, out, err)

    return run


def classes_tree(root: pathlib.Path, classes: dict[str, int]) -> pathlib.Path:
    """A class-dirs tree: ``classes`` maps a class directory to its number of files (0: an
    empty directory)."""
    root.mkdir(parents=True)
    for name, count in classes.items():
        (root / name).mkdir()
        for i in range(count):
            (root / name / f"{name}_{i}.jpg").write_bytes(f"{name}{i}".encode() * 50)
    return root


def labels_of(dst: pathlib.Path) -> dict[str, int]:
    """Sample key -> label, read from the tar shards' ``cls`` members (WebDataset layout)."""
    out: dict[str, int] = {}
    for shard in sorted((dst / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".cls"):
                    fh = tar.extractfile(member)
                    assert fh is not None
                    out[member.name[: -len(".cls")]] = int(fh.read())
    return out


def manifest_of(dst: pathlib.Path) -> dict[str, object]:
    return json.loads((dst / "manifest.json").read_text())


def move_part(from_dst: pathlib.Path, to_dst: pathlib.Path, part: int, num_parts: int) -> None:
    """Move the files of part ``part`` from one multi-part pack directory into another, as a
    user who packed the parts in separate places and gathered them would."""
    tag = f"p{part:04d}-"
    for sub in ("shards", ".shardio-work/frag"):
        for path in (from_dst / sub).iterdir():
            if tag in path.name:
                shutil.move(path, to_dst / sub / path.name)
    for kind in ("state", "part"):
        name = f"{kind}-{part:04d}-of-{num_parts:04d}.json"
        shutil.move(from_dst / ".shardio-work" / name, to_dst / ".shardio-work" / name)


# --------------------------------------------------------------------------- one plan per pack


def test_merge_refuses_parts_packed_from_different_states_of_the_tree(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """Part 0 packed before files were removed, part 1 after, gathered into one directory:
    the merge would hold part 0's removed files twice or lose part 1's; it is refused,
    naming the part, and nothing is published."""
    src = classes_tree(tmp_path / "src", {"a": 4, "b": 4, "c": 4})
    early, late = tmp_path / "early", tmp_path / "late"
    assert run_cli("pack", src, early, "--part", "0/2", "--shard-size", "4KiB", *W1).rc == 0
    for i in range(3):
        (src / "a" / f"a_{i}.jpg").unlink()
    result = run_cli("pack", src, late, "--part", "1/2", "--shard-size", "4KiB", *W1)
    assert result.rc == 0, result.stderr
    move_part(late, early, 1, 2)

    result = run_cli("merge", early, "--no-progress")
    assert result.rc == 1
    assert_cli_error(result, str(early), "part 1/2", "another state of the source tree")
    assert not (early / "manifest.json").exists()
    assert not (early / "index.bin").exists()


def test_a_part_packed_after_the_tree_changed_is_refused_at_once(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    src = classes_tree(tmp_path / "src", {"a": 3, "b": 3})
    dst = tmp_path / "ds"
    single = tmp_path / "single"
    assert run_cli("pack", src, single, "--shard-size", "4KiB", *W1).rc == 0
    assert run_cli("pack", src, dst, "--part", "0/2", "--shard-size", "4KiB", *W1).rc == 0
    extra = src / "b" / "b_9.jpg"
    extra.write_bytes(b"added later")

    result = run_cli("pack", src, dst, "--part", "1/2", "--shard-size", "4KiB", *W1)
    assert result.rc == 1
    assert_cli_error(result, f"part 0/2 in {dst}", "another state of the source")
    assert not list((dst / "shards").glob("shard-p0001-*"))

    # With the tree as part 0 saw it, part 1 packs and the merge equals a single pack.
    extra.unlink()
    assert run_cli("pack", src, dst, "--part", "1/2", "--shard-size", "4KiB", *W1).rc == 0
    result = run_cli("merge", dst, "--no-progress")
    assert result.rc == 0, result.stderr
    assert labels_of(dst) == labels_of(single)
    assert run_cli("verify", dst, *W1).rc == 0


def test_a_part_resumed_against_a_changed_tree_is_refused(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """A file added to part 1's share leaves part 0's own files alone, but the plan of the
    pack changed: resuming part 0 would give parts that do not fit together."""
    src = classes_tree(tmp_path / "src", {"a": 3, "b": 3, "c": 3, "d": 3})
    dst = tmp_path / "ds"
    assert run_cli("pack", src, dst, "--part", "0/2", "--shard-size", "4KiB", *W1).rc == 0
    (src / "d" / "d_9.jpg").write_bytes(b"added later")  # 13 samples: part 0 keeps 0..5

    result = run_cli("pack", src, dst, "--part", "0/2", "--resume", "--shard-size", "4KiB", *W1)
    assert result.rc == 1
    assert_cli_error(result, "the source or the options changed", str(dst))


def test_part_auto_packs_resumes_and_merges(tmp_path: pathlib.Path, run_cli) -> None:
    src = classes_tree(tmp_path / "src", {"a": 3, "b": 3, "empty": 0})
    dst, single = tmp_path / "ds", tmp_path / "single"
    assert run_cli("pack", src, single, "--shard-size", "4KiB", *W1).rc == 0
    for rank in ("1", "0"):
        env = {"SLURM_PROCID": rank, "SLURM_NTASKS": "2"}
        args = ("pack", src, dst, "--part", "auto", "--shard-size", "4KiB", *W1)
        result = run_cli(*args, env=env)
        assert result.rc == 0, result.stderr
        result = run_cli(*args, "--resume", env=env)  # a finished part: reused, not refused
        assert result.rc == 0, result.stderr
    result = run_cli("merge", dst, "--no-progress")
    assert result.rc == 0, result.stderr
    assert labels_of(dst) == labels_of(single)
    assert manifest_of(dst)["labels"] == manifest_of(single)["labels"]


# --------------------------------------------------------------------------- label maps


def test_an_empty_class_directory_keeps_its_index(tmp_path: pathlib.Path, cli) -> None:
    """val has no files of class b: its class c is still 2, as in train."""
    train = classes_tree(tmp_path / "train", {"a": 2, "b": 2, "c": 2})
    val = classes_tree(tmp_path / "val", {"a": 1, "b": 0, "c": 1})
    for src in (train, val):
        result = cli("pack", src, tmp_path / f"ds-{src.name}", *W1)
        assert result.rc == 0, result.stderr
    assert manifest_of(tmp_path / "ds-val")["labels"] == {
        "layout": "class-dirs",
        "classes": ["a", "b", "c"],
    }
    assert labels_of(tmp_path / "ds-val") == {"a/a_0": 0, "c/c_0": 2}
    assert labels_of(tmp_path / "ds-train")["c/c_1"] == 2
    assert (
        "labels: 3 classes (class-dirs) from the class directories: 0 a, 1 b, 2 c; 1 of them "
        "without files in this source (they keep their index), e.g. b"
    ) in result.stdout


def test_empty_class_directories_of_a_split_layout_count(tmp_path: pathlib.Path, cli) -> None:
    src = write_tree(tmp_path / "src", {b"train/a/1.jpg": b"1", b"val/c/2.jpg": b"2"})
    os.makedirs(os.path.join(src, "train", "b"))
    os.makedirs(os.path.join(src, "train", ".hidden"))
    result = cli("pack", src, tmp_path / "ds", *W1)
    assert result.rc == 0, result.stderr
    assert manifest_of(tmp_path / "ds")["labels"]["classes"] == ["a", "b", "c"]
    assert labels_of(tmp_path / "ds") == {"train/a/1": 0, "val/c/2": 2}


def test_labels_from_pins_train_s_map_on_val(tmp_path: pathlib.Path, cli) -> None:
    train = classes_tree(tmp_path / "train", {"n01": 2, "n02": 2, "n03": 2, "n04": 2})
    val = classes_tree(tmp_path / "val", {"n02": 1, "n04": 1})  # n01, n03 missing entirely
    ds_train, ds_val = tmp_path / "ds-train", tmp_path / "ds-val"
    assert cli("pack", train, ds_train, *W1).rc == 0

    result = cli("pack", val, ds_val, "--labels-from", ds_train, *W1)
    assert result.rc == 0, result.stderr
    assert labels_of(ds_val) == {"n02/n02_0": 1, "n04/n04_0": 3}
    labels = manifest_of(ds_val)["labels"]
    assert isinstance(labels, dict)
    assert labels["classes"] == ["n01", "n02", "n03", "n04"]
    assert labels["source"]["kind"] == "dataset"
    assert labels["source"]["path"] == str(ds_train)
    assert f"labels: 4 classes (class-dirs) pinned by --labels-from {ds_train}:" in result.stdout
    assert "2 of them without files in this source" in result.stdout

    result = cli("inspect", ds_val)
    assert result.rc == 0, result.stderr
    assert (
        f"classes       4 classes (class-dirs) pinned by --labels-from {ds_train}: "
        "0 n01, 1 n02, 2 n03, 3 n04"
    ) in result.stdout
    result = cli("inspect", ds_val, "--json")
    label_map = json.loads(result.stdout)["label_map"]
    assert label_map["num_classes"] == 4
    assert label_map["first"][:2] == [{"index": 0, "name": "n01"}, {"index": 1, "name": "n02"}]
    assert label_map["source"]["kind"] == "dataset"
    assert cli("verify", ds_val, *W1).rc == 0

    # Without the pin, val's own directories give n02 the index 0: what the pin prevents.
    assert cli("pack", val, tmp_path / "unpinned", *W1).rc == 0
    assert labels_of(tmp_path / "unpinned") == {"n02/n02_0": 0, "n04/n04_0": 1}


def test_a_class_directory_the_pinned_map_lacks_is_refused(
    tmp_path: pathlib.Path, cli, assert_cli_error
) -> None:
    train = classes_tree(tmp_path / "train", {"n01": 1, "n02": 1})
    val = classes_tree(tmp_path / "val", {"n01": 1, "n99": 1})
    ds_train, ds_val = tmp_path / "ds-train", tmp_path / "ds-val"
    assert cli("pack", train, ds_train, *W1).rc == 0
    result = cli("pack", val, ds_val, "--labels-from", ds_train, *W1)
    assert result.rc == 1
    assert_cli_error(result, f"class directory {val}/n99", f"--labels-from {ds_train}")
    assert not ds_val.exists()

    classes = tmp_path / "classes.txt"
    classes.write_text("n01\nn02\n")
    result = cli("pack", val, ds_val, "--classes", classes, *W1)
    assert_cli_error(result, f"class directory {val}/n99", f"--classes {classes}")


def test_classes_file_sets_the_order(tmp_path: pathlib.Path, cli) -> None:
    src = classes_tree(tmp_path / "src", {"cat": 1, "dog": 1})
    classes = tmp_path / "classes.txt"
    classes.write_bytes(b"\xef\xbb\xbfdog\r\nbird\r\ncat\r\n")  # BOM and CRLF are accepted
    dst = tmp_path / "ds"
    result = cli("pack", src, dst, "--classes", classes, *W1)
    assert result.rc == 0, result.stderr
    assert labels_of(dst) == {"dog/dog_0": 0, "cat/cat_0": 2}
    labels = manifest_of(dst)["labels"]
    assert isinstance(labels, dict)
    assert labels["classes"] == ["dog", "bird", "cat"]
    assert labels["source"]["kind"] == "classes-file"
    assert labels["source"]["path"] == str(classes)

    # A changed classes file is a changed plan: --resume refuses, even on a finished dataset.
    classes.write_text("dog\ncat\nbird\n")
    result = cli("pack", src, dst, "--classes", classes, "--resume", *W1)
    assert result.rc == 1
    assert "the source or the options changed" in result.stderr


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"cat\n\ndog\n", "line 2 is empty"),
        (b"cat\n   \n", "line 2 is empty"),
        (b"cat\ndog\ncat\n", "line 3: class 'cat' is listed already on line 1"),
        (b"cat\nd\xffg\n", "line 2: not UTF-8 text"),
        (b"cat\n dog\n", "line 2: class ' dog' has leading or trailing white space"),
        (b"a/b\n", "line 1: class 'a/b' is not a directory name"),
        (b"..\n", "line 1: class '..' is not a directory name"),
        (b".cache\n", "line 1: class '.cache' is a hidden name"),
        (b"tab\there\n", "line 1: class 'tab\\there' holds a control character"),
        (b"x" * 256 + b"\n", "line 1: class"),
        (b"", "holds no class names"),
        (b"\n", "line 1 is empty"),
    ],
    ids=[
        "empty-line",
        "blank-line",
        "duplicate",
        "not-utf8",
        "space",
        "slash",
        "dotdot",
        "hidden",
        "control",
        "too-long",
        "no-names",
        "only-newline",
    ],
)
def test_a_bad_classes_file_is_one_line_naming_file_and_line(
    content: bytes, needle: str, tmp_path: pathlib.Path, cli, assert_cli_error
) -> None:
    src = classes_tree(tmp_path / "src", {"cat": 1})
    classes = tmp_path / "classes.txt"
    classes.write_bytes(content)
    result = cli("pack", src, tmp_path / "ds", "--classes", classes, *W1)
    assert result.rc == 2
    assert_cli_error(result, f"classes file {classes}", needle)
    assert not (tmp_path / "ds").exists()


def test_a_huge_fifo_or_missing_classes_file_is_one_line(
    tmp_path: pathlib.Path, cli, assert_cli_error
) -> None:
    src = classes_tree(tmp_path / "src", {"cat": 1})
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as fh:
        fh.truncate(65 * 1024 * 1024)  # sparse: nothing is written
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, needle in (
        (huge, "more than the"),
        (fifo, "not a regular file"),
        (tmp_path / "missing.txt", "missing.txt"),
    ):
        result = cli("pack", src, tmp_path / "ds", "--classes", path, *W1)
        assert result.rc != 0
        assert_cli_error(result, str(path), needle)
        assert not (tmp_path / "ds").exists()


def test_a_bad_labels_from_is_one_line(tmp_path: pathlib.Path, cli, assert_cli_error) -> None:
    src = classes_tree(tmp_path / "src", {"cat": 1})
    flat = write_tree(tmp_path / "flat", {b"1.jpg": b"1", b"2.jpg": b"2"})
    unlabelled = tmp_path / "unlabelled"
    assert cli("pack", flat, unlabelled, *W1).rc == 0
    tampered = tmp_path / "tampered"
    assert cli("pack", src, tampered, *W1).rc == 0
    doc = (tampered / "manifest.json").read_text().replace('"cat"', '"cow"')
    (tampered / "manifest.json").write_text(doc)
    (tmp_path / "notads").mkdir()
    for given, needle in (
        (tmp_path / "nowhere", "not a directory"),
        (tmp_path / "notads", "not a packed dataset"),
        (unlabelled, "has no label map"),
        (tampered, "manifest checksum mismatch"),
    ):
        result = cli("pack", src, tmp_path / "ds", "--labels-from", given, *W1)
        assert_cli_error(result, f"--labels-from {given}", needle)
        assert not (tmp_path / "ds").exists()


def test_pinning_option_mistakes_are_usage_errors(
    tmp_path: pathlib.Path, cli, assert_cli_error, capsys: pytest.CaptureFixture[str]
) -> None:
    src = classes_tree(tmp_path / "src", {"cat": 1})
    classes = tmp_path / "classes.txt"
    classes.write_text("cat\n")
    result = cli("pack", src, tmp_path / "ds", "--classes", classes, "--labels", "none", *W1)
    assert result.rc == 2
    assert_cli_error(result, "--classes", "--labels none")
    flat = write_tree(tmp_path / "flat", {b"1.jpg": b"1"})
    result = cli("pack", flat, tmp_path / "ds", "--classes", classes, *W1)
    assert result.rc == 2
    assert_cli_error(result, "has no class directories")
    with pytest.raises(SystemExit) as info:
        main(["pack", str(src), str(tmp_path / "ds"), "--classes", "x", "--labels-from", "y"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_merge_keeps_the_pinned_map(tmp_path: pathlib.Path, run_cli, cli) -> None:
    src = classes_tree(tmp_path / "src", {"b": 3, "c": 3})
    classes = tmp_path / "classes.txt"
    classes.write_text("a\nb\nc\n")
    dst = tmp_path / "ds"
    for part in ("0/2", "1/2"):
        result = run_cli("pack", src, dst, "--part", part, "--classes", classes, *W1)
        assert result.rc == 0, result.stderr
    assert run_cli("merge", dst, "--no-progress").rc == 0
    labels = manifest_of(dst)["labels"]
    assert isinstance(labels, dict)
    assert labels["classes"] == ["a", "b", "c"]
    assert labels["source"]["kind"] == "classes-file"
    assert set(labels_of(dst).values()) == {1, 2}
    assert cli("verify", dst, *W1).rc == 0


def test_parts_pinned_to_different_maps_do_not_merge(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    src = classes_tree(tmp_path / "src", {"b": 2, "c": 2})
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("a\nb\nc\n")
    two.write_text("b\nc\n")
    early, late = tmp_path / "early", tmp_path / "late"
    assert run_cli("pack", src, early, "--part", "0/2", "--classes", one, *W1).rc == 0
    assert run_cli("pack", src, late, "--part", "1/2", "--classes", two, *W1).rc == 0
    move_part(late, early, 1, 2)
    result = run_cli("merge", early, "--no-progress")
    assert result.rc != 0
    assert_cli_error(result, "part 1")
    assert not (early / "manifest.json").exists()


# --------------------------------------------------------------------------- the summary


def test_resume_of_a_finished_dataset_says_it_is_complete(tmp_path: pathlib.Path, cli) -> None:
    src = classes_tree(tmp_path / "src", {"a": 2, "b": 2})
    dst = tmp_path / "ds"
    assert cli("pack", src, dst, *W1).rc == 0
    before = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    result = cli("pack", src, dst, "--resume", *W1)
    assert result.rc == 0, result.stderr
    assert "from the interrupted pack" not in result.stdout
    assert "packed 4 files" not in result.stdout
    assert f"checked {dst}: 4 files" in result.stdout
    assert f"{dst} was already complete: nothing to resume" in result.stdout
    assert "nothing was packed or rewritten" in result.stdout
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before


def test_the_summary_says_how_many_skipped_files_it_does_not_list(
    tmp_path: pathlib.Path, cli
) -> None:
    src = classes_tree(tmp_path / "src", {"a": 1})
    for i in range(6):
        os.symlink(tmp_path / "nowhere", src / "a" / f"broken{i}.jpg")
    result = cli("pack", src, tmp_path / "ds", *W1)
    assert result.rc == 0, result.stderr
    assert "skipped 6 file(s)" in result.stdout
    assert result.stdout.count(": broken symlink") == 5
    assert "  ... and 1 more" in result.stdout

    src5 = classes_tree(tmp_path / "src5", {"a": 1})
    for i in range(5):
        os.symlink(tmp_path / "nowhere", src5 / "a" / f"broken{i}.jpg")
    result = cli("pack", src5, tmp_path / "ds5", *W1)
    assert "skipped 5 file(s)" in result.stdout
    assert "more" not in result.stdout


def test_a_part_record_without_a_plan_is_not_merged(
    tmp_path: pathlib.Path, run_cli, assert_cli_error
) -> None:
    """A part record an older shardio wrote carries no plan: merge cannot tell it fits, so
    it refuses, naming the part; a damaged plan fingerprint names the record."""
    src = classes_tree(tmp_path / "src", {"a": 2, "b": 2})
    dst = tmp_path / "ds"
    for part in ("0/2", "1/2"):
        assert run_cli("pack", src, dst, "--part", part, *W1).rc == 0
    record = dst / ".shardio-work" / "part-0001-of-0002.json"
    doc = json.loads(record.read_text())
    good = doc.pop("plan_fingerprint")
    record.write_text(json.dumps(doc))
    result = run_cli("merge", dst, "--no-progress")
    assert_cli_error(result, "part 1/2", "did not record its plan")
    record.write_text(json.dumps({**doc, "plan_fingerprint": "not hex"}))
    result = run_cli("merge", dst, "--no-progress")
    assert_cli_error(result, str(record), "plan_fingerprint")
    record.write_text(json.dumps({**doc, "plan_fingerprint": good}))
    assert run_cli("merge", dst, "--no-progress").rc == 0
    assert not (dst / ".shardio-work").exists()


@pytest.mark.parametrize("version", ["format_v1", "format_v2"])
def test_inspect_shows_the_label_map_of_old_datasets(version: str, cli) -> None:
    golden = pathlib.Path(__file__).resolve().parents[1] / "data" / version / "tar"
    result = cli("inspect", golden)
    assert result.rc == 0, result.stderr
    assert "classes (class-dirs) from the class directories: 0 " in result.stdout
    result = cli("inspect", golden, "--json")
    label_map = json.loads(result.stdout)["label_map"]
    assert label_map["source"] == {"kind": "class-dirs"}
    assert label_map["first"][0]["index"] == 0
