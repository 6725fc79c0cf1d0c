"""Label maps: class indices from the class directories (empty ones too), pinned maps read
from a classes file or a dataset, and the plan fingerprint every part of a pack shares."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from trees import write_tree

from shardio.errors import FormatError, PackError, UsageError
from shardio.format.label_source import LabelSource
from shardio.packing.labels import PinnedLabels, load_classes_file
from shardio.packing.plan import listing_fingerprint
from shardio.packing.scan import list_tree, resolve_samples
from shardio.packing.workfiles import PartRecord, StateRecord

OPTIONS = {"format": "tar", "shard_size": 1 << 30, "labels": "auto", "num_parts": 2}


def pinned(*classes: str, digest: str = "1" * 32) -> PinnedLabels:
    source = LabelSource(kind="classes-file", path="/x/classes.txt", xxh3_128=digest)
    return PinnedLabels(classes, source, "--classes /x/classes.txt")


def test_empty_class_directories_keep_their_index(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"a/1.jpg": b"1", b"c/2.jpg": b"2"})
    os.mkdir(os.path.join(src, "b"))
    os.mkdir(os.path.join(src, ".thumbs"))  # hidden: never a class
    listing = list_tree(src)
    assert listing.classes == ("a", "b", "c")
    assert listing.classes_without_files() == ("b",)
    samples, _ = resolve_samples(src, listing, listing.groups)
    assert [(s.key, s.label) for s in samples] == [("a/1", 0), ("c/2", 2)]


def test_a_pinned_map_gives_the_indices_and_refuses_unknown_classes(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"b/1.jpg": b"1", b"d/2.jpg": b"2"})
    listing = list_tree(src, pinned=pinned("d", "a", "b"))
    assert listing.classes == ("d", "a", "b")
    assert listing.label_source is not None
    samples, _ = resolve_samples(src, listing, listing.groups)
    assert [(s.key, s.label) for s in samples] == [("b/1", 2), ("d/2", 0)]

    os.mkdir(os.path.join(src, "zz"))  # even an empty class directory must be in the map
    with pytest.raises(PackError, match=r"class directory .*/zz is not in the label map of "):
        list_tree(src, pinned=pinned("d", "a", "b"))


def test_a_pinned_map_needs_class_directories(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"1.jpg": b"1"})
    with pytest.raises(UsageError, match="has no class directories"):
        list_tree(src, pinned=pinned("a"))


def test_classes_file_non_ascii_names_and_order(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("狗\ncat\nn01440764\n", encoding="utf-8")
    labels = load_classes_file(str(path))
    assert labels.classes == ("狗", "cat", "n01440764")
    assert labels.source.kind == "classes-file"
    assert labels.source.path == str(path)
    src = write_tree(tmp_path / "src", {"狗/1.jpg".encode(): b"1"})
    assert list_tree(src, pinned=labels).classes == labels.classes


def test_the_plan_fingerprint_changes_with_the_tree_and_the_map(tmp_path: Path) -> None:
    files = {b"a/1.jpg": b"1", b"a/2.jpg": b"2", b"b/3.jpg": b"3"}
    src = write_tree(tmp_path / "src", files)
    base = listing_fingerprint(list_tree(src), OPTIONS)
    assert listing_fingerprint(list_tree(src), OPTIONS) == base  # deterministic

    # File contents and sizes are not in it: each part stats only its own files.
    (tmp_path / "src" / "a" / "1.jpg").write_bytes(b"longer now")
    assert listing_fingerprint(list_tree(src), OPTIONS) == base

    changed = {
        "another shard size": listing_fingerprint(
            list_tree(src), {**OPTIONS, "shard_size": 1 << 20}
        ),
        "a pinned map": listing_fingerprint(list_tree(src, pinned=pinned("a", "b")), OPTIONS),
        "another pinned file": listing_fingerprint(
            list_tree(src, pinned=pinned("a", "b", digest="2" * 32)), OPTIONS
        ),
    }
    os.mkdir(tmp_path / "src" / "c")
    changed["an empty class"] = listing_fingerprint(list_tree(src), OPTIONS)
    os.rmdir(tmp_path / "src" / "c")
    (tmp_path / "src" / "b" / "4.jpg").write_bytes(b"4")
    changed["an added file"] = listing_fingerprint(list_tree(src), OPTIONS)
    (tmp_path / "src" / "a" / "2.jpg").unlink()
    changed["a removed file too"] = listing_fingerprint(list_tree(src), OPTIONS)
    (tmp_path / "src" / "b" / "4.jpg").rename(tmp_path / "src" / "b" / "4.png")
    changed["a renamed file too"] = listing_fingerprint(list_tree(src), OPTIONS)
    assert base not in changed.values()
    assert len(set(changed.values())) == len(changed), changed


def test_records_without_a_plan_load_as_unknown() -> None:
    """Records an older shardio wrote have no plan fingerprint: None (merge refuses them)."""
    state = {
        "fingerprint": "0" * 32,
        "part": 0,
        "num_parts": 2,
        "num_shards": 1,
        "shard_format": "tar",
    }
    assert StateRecord.from_json(state, "state").plan_fingerprint is None
    record = StateRecord.from_json({**state, "plan_fingerprint": "a" * 32}, "state")
    assert record.plan_fingerprint == "a" * 32
    assert StateRecord.from_json(record.to_json(), "state") == record


def test_a_part_record_with_a_source_but_no_classes_is_refused() -> None:
    doc = {
        "part": 0,
        "num_parts": 1,
        "fingerprint": "0" * 32,
        "shard_format": "tar",
        "classes": None,
        "label_layout": "none",
        "num_listed_files": 0,
        "options": {},
        "layout": {
            "fs_type": "ext4",
            "action": "skipped",
            "stripe": None,
            "message": "",
            "commands": [],
        },
        "shards": [],
        "skipped": [],
        "oversized": [],
        "label_source": {"kind": "dataset", "path": "/d", "xxh3_128": "0" * 32},
    }
    with pytest.raises(FormatError, match="label_source is set, but there are no classes"):
        PartRecord.from_json(doc, "part")
