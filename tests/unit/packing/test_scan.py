"""Tests for scanning: hidden names and the label layout, the labels note, reserved exts."""

from __future__ import annotations

from pathlib import Path

import pytest
from trees import write_tree

from shardio.format.keys import decode_component
from shardio.format.spec import NO_LABEL
from shardio.packing.scan import Listing, PlannedSample, Skipped, list_tree, resolve_samples


def scan(src: str, labels: str = "auto") -> tuple[Listing, list[PlannedSample], list[Skipped]]:
    listing = list_tree(src, labels=labels)
    samples, skipped = resolve_samples(src, listing, listing.groups)
    return listing, samples, skipped


# --- hidden names and labels -------------------------------------------------------------


def test_a_stray_ds_store_does_not_turn_labels_off(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            b".DS_Store": b"finder",
            b"train/.DS_Store": b"finder",
            b".git/objects/ab": b"git",
            b"train/cat/1.jpg": b"c",
            b"train/cat/.DS_Store": b"inside a class: packed like any file",
            b"train/.cache/dog/2.jpg": b"hidden split dir",
            b"val/dog/3.jpg": b"d",
        },
    )
    listing, samples, skipped = scan(src)
    assert listing.label_layout == "split-class-dirs"
    assert listing.classes == ("cat", "dog")
    assert listing.labels_note == ""
    assert skipped == []
    reason = "hidden file outside the split-class-dirs label layout"
    assert sorted(listing.excluded, key=lambda s: s.path) == [
        Skipped(b".DS_Store", reason),
        Skipped(b".git/objects/ab", reason),
        Skipped(b"train/.DS_Store", reason),
        Skipped(b"train/.cache/dog/2.jpg", reason),
    ]
    assert [(s.key, s.label) for s in samples] == [
        ("train/cat/%2EDS_Store", 0),
        ("train/cat/1", 0),
        ("val/dog/3", 1),
    ]


def test_hidden_directory_is_never_a_class(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"cat/1.jpg": b"", b".thumbs/1.jpg": b"", b"dog/2.jpg": b""})
    listing, samples, _ = scan(src)
    assert listing.classes == ("cat", "dog")
    assert [s.path for s in listing.excluded] == [b".thumbs/1.jpg"]
    assert [s.key for s in samples] == ["cat/1", "dog/2"]


def test_hidden_files_are_packed_when_there_are_no_labels(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"a.jpg": b"1", b".hidden": b"2", b"d/.x.jpg": b"3"})
    listing, samples, _ = scan(src)
    assert listing.label_layout == "none"
    assert listing.excluded == ()
    assert sorted(s.key for s in samples) == ["%2Ehidden", "a", "d/%2Ex"]


def test_labels_none_packs_hidden_files(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"cat/1.jpg": b"", b".DS_Store": b""})
    listing, samples, _ = scan(src, labels="none")
    assert listing.excluded == ()
    assert listing.labels_note == "--labels none"
    assert {s.label for s in samples} == {NO_LABEL}
    assert len(samples) == 2


@pytest.mark.parametrize(
    ("files", "note"),
    [
        (
            {b"cat/1.jpg": b"", b"cat/2.jpg": b"", b"README.txt": b""},
            "files at different depths, e.g. README.txt",
        ),
        (
            {b"a/b/1.jpg": b"", b"a/b/2.jpg": b"", b"a/3.jpg": b""},
            "files at different depths, e.g. a/3.jpg",
        ),
        ({b"1.jpg": b"", b"2.jpg": b""}, "no class directories"),
        ({b"a/b/c/1.jpg": b""}, "every file is 3 directories deep"),
        ({b".only": b""}, "only hidden files"),
    ],
    ids=["root-file", "shallow-file", "flat", "deep", "hidden"],
)
def test_labels_note_says_why_there_are_none(
    tmp_path: Path, files: dict[bytes, bytes], note: str
) -> None:
    listing = list_tree(write_tree(tmp_path, files))
    assert listing.label_layout == "none"
    assert note in listing.labels_note
    assert listing.labels_note.endswith("; --labels none silences this")


def test_labels_note_shows_undecodable_names_safely(tmp_path: Path) -> None:
    listing = list_tree(write_tree(tmp_path, {b"c/1.jpg": b"", b"c/2.jpg": b"", b"\xff.txt": b""}))
    assert "e.g. \\xff.txt" in listing.labels_note


# --- reserved extensions --------------------------------------------------------------------


def test_reserved_webdataset_extensions_are_escaped(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            b"x.jpg": b"1",
            b"x.__key__": b"2",
            b"x.__URL__": b"3",
            b"x.__local_path__": b"4",
            b"x._one": b"5",
            b"x.%5F_key__": b"6",  # a literal name that looks like the escape
        },
    )
    _, [sample], _ = scan(src)
    exts = {f.rel: f.ext for f in sample.files}
    assert exts == {
        b"x.jpg": "jpg",
        b"x.__key__": "%5F_key__",
        b"x.__URL__": "%5F_url__",
        b"x.__local_path__": "%5F_local_path__",
        b"x._one": "_one",
        b"x.%5F_key__": "%255f_key__",
    }
    for f in sample.files:
        assert not f.ext.startswith("__")
        # Reversible: the escape decodes to the (lower-cased) original extension.
        assert decode_component(f.ext) == f.rel.split(b".", 1)[1].lower()
