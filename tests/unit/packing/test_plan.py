"""Tests for scanning a source tree and planning its shards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from trees import write_tree

from shardio.errors import SourceError, UsageError
from shardio.format.spec import NO_LABEL, TAR_BLOCK
from shardio.packing.plan import plan_fingerprint, plan_shards, shard_name
from shardio.packing.scan import (
    Listing,
    PlannedFile,
    PlannedSample,
    Skipped,
    list_tree,
    resolve_samples,
)


def scan(src: str, labels: str = "auto") -> tuple[Listing, list[PlannedSample], list[Skipped]]:
    listing = list_tree(src, labels=labels)
    samples, skipped = resolve_samples(src, listing, listing.groups)
    return listing, samples, skipped


def members(sample: PlannedSample) -> list[tuple[bytes, str, int]]:
    return [(f.rel, f.ext, f.size) for f in sample.files]


# --- grouping -------------------------------------------------------------------------


def test_same_stem_in_one_directory_is_one_sample(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            b"a/x.jpg": b"1",
            b"a/x.json": b"22",
            b"a/y.jpg": b"333",
            b"b/x.jpg": b"4444",
            b"b/sub/x.jpg": b"55555",
        },
    )
    listing, samples, skipped = scan(src)
    assert skipped == []
    assert listing.num_files == 5
    assert [s.key for s in samples] == ["a/x", "a/y", "b/x", "b/sub/x"]
    assert members(samples[0]) == [(b"a/x.jpg", "jpg", 1), (b"a/x.json", "json", 2)]
    assert members(samples[2]) == [(b"b/x.jpg", "jpg", 4)]
    assert members(samples[3]) == [(b"b/sub/x.jpg", "jpg", 5)]


def test_multi_dot_names_group_by_the_last_dot(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            b"a.b.c.jpg": b"1",
            b"a.b.c.txt": b"2",
            b"a.b.jpg": b"3",
            b"noext": b"4",
            b".hidden": b"5",
        },
    )
    _, samples, _ = scan(src)
    by_key = {s.key: members(s) for s in samples}
    assert by_key == {
        "%2Ehidden": [(b".hidden", "noext", 1)],
        "a%2Eb": [(b"a.b.jpg", "jpg", 1)],
        "a%2Eb%2Ec": [(b"a.b.c.jpg", "jpg", 1), (b"a.b.c.txt", "txt", 1)],
        "noext": [(b"noext", "noext", 1)],
    }


def test_keys_encode_odd_directory_and_file_names(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path, {b"d.x y/\xff \xe9.v1.png": b"z", "\u00e9t\u00e9/n.JPG".encode(): b""}
    )
    _, samples, _ = scan(src)
    assert sorted(s.key for s in samples) == ["%C3%A9t%C3%A9/n", "d%2Ex%20y/%FF%20%E9%2Ev1"]
    for s in samples:
        assert "." not in s.key and " " not in s.key


def test_samples_are_sorted_by_directory_then_stem(tmp_path: Path) -> None:
    names = [b"b/2.x", b"a/10.x", b"a/9.x", b"B/1.x", b"a/1.x"]
    src = write_tree(tmp_path, {n: b"" for n in names})
    _, samples, _ = scan(src)
    assert [s.key for s in samples] == ["B/1", "a/1", "a/10", "a/9", "b/2"]


def test_listing_is_deterministic(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {f"d{i % 3}/f{i}.bin".encode(): b"x" * i for i in range(30)})
    assert list_tree(src) == list_tree(src)


# --- labels ---------------------------------------------------------------------------


def test_class_dirs(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"dog/1.jpg": b"", b"cat/2.jpg": b"", b"cat/3.jpg": b""})
    listing, samples, _ = scan(src)
    assert listing.label_layout == "class-dirs"
    assert listing.classes == ("cat", "dog")
    assert [(s.key, s.label) for s in samples] == [("cat/2", 0), ("cat/3", 0), ("dog/1", 1)]


def test_split_class_dirs(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            b"train/dog/1.jpg": b"",
            b"train/cat/2.jpg": b"",
            b"val/cat/3.jpg": b"",
            b"val/emu/4.jpg": b"",
        },
    )
    listing, samples, _ = scan(src)
    assert listing.label_layout == "split-class-dirs"
    assert listing.classes == ("cat", "dog", "emu")
    assert [(s.key, s.label) for s in samples] == [
        ("train/cat/2", 0),
        ("train/dog/1", 1),
        ("val/cat/3", 0),
        ("val/emu/4", 2),
    ]


def test_non_utf8_class_names_round_trip(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"\xff/1.jpg": b"", b"a/2.jpg": b""})
    listing, samples, _ = scan(src)
    assert listing.classes == ("a", os.fsdecode(b"\xff"))
    assert [(s.key, s.label) for s in samples] == [("a/2", 0), ("%FF/1", 1)]


@pytest.mark.parametrize(
    "files",
    [
        {b"cat/1.jpg": b"", b"README": b""},
        {b"cat/1.jpg": b"", b"train/dog/2.jpg": b""},
        {b"1.jpg": b"", b"2.jpg": b""},
        {b"a/b/c/1.jpg": b""},
    ],
    ids=["root-file", "depth-1-and-2", "flat", "depth-3"],
)
def test_no_labels_for_other_layouts(tmp_path: Path, files: dict[bytes, bytes]) -> None:
    listing, samples, _ = scan(write_tree(tmp_path, files))
    assert listing.label_layout == "none"
    assert listing.classes is None
    assert {s.label for s in samples} == {NO_LABEL}


def test_labels_none_disables_detection(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"dog/1.jpg": b"", b"cat/2.cls": b""})
    listing, samples, _ = scan(src, labels="none")
    assert listing.label_layout == "none"
    assert listing.classes is None
    assert {s.label for s in samples} == {NO_LABEL}
    # Without a label member, a source file may use the cls extension itself.
    assert members(samples[0]) == [(b"cat/2.cls", "cls", 0)]


def test_invalid_label_mode(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"a.jpg": b""})
    with pytest.raises(UsageError, match="'folders'"):
        list_tree(src, labels="folders")


# --- extensions -----------------------------------------------------------------------


def test_extensions_are_lower_cased_and_made_unique(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            b"c/x.JPEG": b"upper",
            b"c/x.jpeg": b"lower",
            b"c/x.Jpeg": b"mixed",
            b"c/x.cls": b"7",
            b"c/x": b"no ext",
            b"c/x.noext": b"literal noext",
            b"c/x.j p": b"space",
            b"c/x.\xc3\x89": b"non-ascii",
        },
    )
    listing, samples, _ = scan(src)
    assert listing.label_layout == "class-dirs"
    [sample] = samples
    got = members(sample)
    # Entries are taken in byte order of their names, so upper case comes first.
    assert got == [
        (b"c/x", "noext", 6),
        (b"c/x.JPEG", "jpeg", 5),
        (b"c/x.Jpeg", "jpeg_1", 5),
        (b"c/x.cls", "cls_1", 1),
        (b"c/x.j p", "j%20p", 5),
        (b"c/x.jpeg", "jpeg_2", 5),
        (b"c/x.noext", "noext_1", 13),
        (b"c/x.\xc3\x89", "%C3%89", 9),
    ]
    exts = [e for _, e, _ in got]
    assert len(set(exts)) == len(exts)
    assert "cls" not in exts  # reserved for the label member
    for ext in exts:
        assert "." not in ext and " " not in ext


def test_case_variants_are_two_members(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"x.JPEG": b"A", b"x.jpeg": b"bb"})
    _, [sample], _ = scan(src)
    assert members(sample) == [(b"x.JPEG", "jpeg", 1), (b"x.jpeg", "jpeg_1", 2)]


# --- file kinds -----------------------------------------------------------------------


def test_file_kinds_are_classified(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path, {b"d/real.txt": b"abc", b"d/zero.bin": b"", b"other/dir/f.txt": b"q"}
    )
    d = tmp_path / "d"
    os.symlink("missing-target", d / "broken.lnk")
    os.symlink("loop-b", d / "loop-a")
    os.symlink("loop-a", d / "loop-b")
    os.symlink(tmp_path / "other", d / "dirlink")
    os.symlink("real.txt", d / "good.lnk")
    os.mkfifo(d / "pipe.fifo")

    listing, samples, skipped = scan(src)
    assert listing.num_files == 9
    assert sorted((s.path, s.reason) for s in skipped) == [
        (b"d/broken.lnk", "broken symlink"),
        (b"d/dirlink", "symlink to a directory (not followed)"),
        (b"d/loop-a", "symlink loop"),
        (b"d/loop-b", "symlink loop"),
        (b"d/pipe.fifo", "FIFO (named pipe)"),
    ]
    packed = {f.rel: f.size for s in samples for f in s.files}
    assert packed == {
        b"d/good.lnk": 3,  # a symlink to a file is packed with its target's bytes
        b"d/real.txt": 3,
        b"d/zero.bin": 0,
        b"other/dir/f.txt": 1,
    }
    # The linked directory is not walked: only other/dir/f.txt is listed under it.
    assert not any(f.rel.startswith(b"d/dirlink/") for s in samples for f in s.files)


def test_skipped_json_keeps_non_utf8_paths(tmp_path: Path) -> None:
    skipped = Skipped(b"a/\xff.lnk", "broken symlink")
    doc = skipped.to_json()
    assert doc == {"path": os.fsdecode(b"a/\xff.lnk"), "reason": "broken symlink"}
    assert os.fsencode(doc["path"]) == b"a/\xff.lnk"


def test_sample_with_only_skipped_files_disappears(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {b"a.jpg": b"x"})
    os.symlink("nowhere", tmp_path / "b.jpg")
    _, samples, skipped = scan(src)
    assert [s.key for s in samples] == ["a"]
    assert [s.path for s in skipped] == [b"b.jpg"]


def test_missing_source(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SourceError, match="does not exist") as info:
        list_tree(str(missing))
    assert str(missing) in str(info.value)


def test_source_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"")
    with pytest.raises(SourceError, match="not a directory") as info:
        list_tree(str(path))
    assert str(path) in str(info.value)


def test_source_without_files(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    with pytest.raises(SourceError, match="holds no files") as info:
        list_tree(str(tmp_path))
    assert str(tmp_path) in str(info.value)


# --- shards ---------------------------------------------------------------------------


def _sample(key: str, *sizes: int) -> PlannedSample:
    return PlannedSample(
        key, 0, tuple(PlannedFile(f"{key}.{i}".encode(), f"e{i}", s) for i, s in enumerate(sizes))
    )


def _tar_bytes(sample: PlannedSample, labelled: bool) -> int:
    data = sum(TAR_BLOCK + -(-f.size // TAR_BLOCK) * TAR_BLOCK for f in sample.files)
    return data + (2 * TAR_BLOCK if labelled else 0)


@pytest.mark.parametrize("labelled", [False, True])
def test_plan_shards_cuts_at_the_size_limit(labelled: bool) -> None:
    samples = [_sample(f"s{i}", 100 * i, 700) for i in range(40)]
    limit = 16 * 1024
    shards = plan_shards(samples, shard_size_bytes=limit, labelled=labelled)
    assert [s for shard in shards for s in shard.samples] == samples
    assert [s.seq for s in shards] == list(range(len(shards)))
    assert [s.name for s in shards] == [f"shard-{i:06d}" for i in range(len(shards))]
    for i, shard in enumerate(shards):
        expected = 2 * TAR_BLOCK + sum(_tar_bytes(s, labelled) for s in shard.samples)
        assert shard.planned_bytes == expected
        assert shard.planned_bytes <= limit
        assert shard.num_files == 2 * len(shard.samples)
        if i + 1 < len(shards):
            # Greedy: the next shard's first sample would not have fitted.
            nxt = shards[i + 1].samples[0]
            assert shard.planned_bytes + _tar_bytes(nxt, labelled) > limit


def test_exact_fit_stays_in_one_shard() -> None:
    samples = [_sample("a", 512), _sample("b", 512)]
    limit = 2 * TAR_BLOCK + 2 * (2 * TAR_BLOCK)
    shards = plan_shards(samples, shard_size_bytes=limit, labelled=False)
    assert len(shards) == 1
    assert shards[0].planned_bytes == limit
    assert len(plan_shards(samples, shard_size_bytes=limit - 1, labelled=False)) == 2


def test_oversized_sample_gets_a_shard_of_its_own() -> None:
    small, big = _sample("a", 10), _sample("big", 50_000)
    samples = [small, big, _sample("c", 10), _sample("d", 10)]
    shards = plan_shards(samples, shard_size_bytes=8192, labelled=True)
    assert [tuple(s.key for s in shard.samples) for shard in shards] == [
        ("a",),
        ("big",),
        ("c", "d"),
    ]
    assert shards[1].planned_bytes > 8192
    assert shards[0].planned_bytes <= 8192
    assert shards[2].planned_bytes <= 8192


def test_first_sample_oversized() -> None:
    shards = plan_shards(
        [_sample("big", 10_000), _sample("b", 1)], shard_size_bytes=4096, labelled=False
    )
    assert [[s.key for s in shard.samples] for shard in shards] == [["big"], ["b"]]


def test_no_samples_no_shards() -> None:
    assert plan_shards([], shard_size_bytes=4096, labelled=False) == []


def test_shard_names() -> None:
    assert shard_name(0, part=0, num_parts=1) == "shard-000000"
    assert shard_name(123456, part=0, num_parts=1) == "shard-123456"
    assert shard_name(12, part=3, num_parts=8) == "shard-p0003-000012"
    assert shard_name(0, part=0, num_parts=2) == "shard-p0000-000000"
    shards = plan_shards(
        [_sample("a", 1)], shard_size_bytes=4096, labelled=False, part=5, num_parts=6
    )
    assert shards[0].name == "shard-p0005-000000"


@pytest.mark.parametrize("n_groups", [0, 1, 5, 7, 64])
@pytest.mark.parametrize("num_parts", [1, 2, 3, 8])
def test_listing_parts_are_disjoint_and_cover_all(
    tmp_path: Path, n_groups: int, num_parts: int
) -> None:
    if n_groups == 0:
        listing = Listing(groups=(), classes=None, label_layout="none", num_files=0)
    else:
        src = write_tree(tmp_path, {f"g{i:03d}.bin".encode(): b"" for i in range(n_groups)})
        listing = list_tree(src)
    seen = []
    for part in range(num_parts):
        first, groups = listing.part(part, num_parts)
        assert first == len(seen)
        seen.extend(groups)
        assert n_groups // num_parts <= len(groups) <= -(-n_groups // num_parts)
    assert tuple(seen) == listing.groups


def test_fingerprint_tracks_plan_and_options() -> None:
    samples = [_sample("a", 10), _sample("b", 20)]
    shards = plan_shards(samples, shard_size_bytes=4096, labelled=False)
    options: dict[str, object] = {"format": "tar", "shard_size": 4096}
    base = plan_fingerprint(shards, options)
    assert base == plan_fingerprint(
        plan_shards(samples, shard_size_bytes=4096, labelled=False), dict(options)
    )
    assert len(base) == 32
    assert plan_fingerprint(shards, {**options, "format": "hdf5"}) != base
    changed = plan_shards(
        [_sample("a", 10), _sample("b", 21)], shard_size_bytes=4096, labelled=False
    )
    assert plan_fingerprint(changed, options) != base


def test_planned_bytes_are_the_tar_shard_sizes(tmp_path: Path) -> None:
    from shardio.packing.run import PackOptions, pack

    files = {f"c{i % 2}/f{i}.bin".encode(): bytes([i]) * (i * 97) for i in range(12)}
    src = write_tree(tmp_path / "src", files)
    _, samples, _ = scan(src)
    shards = plan_shards(samples, shard_size_bytes=8192, labelled=True)
    result = pack(
        src,
        str(tmp_path / "out"),
        PackOptions(shard_size_bytes=8192, durable=False, fs_type="local"),
    )
    assert result.num_shards == len(shards) > 1
    sizes = [os.path.getsize(tmp_path / "out" / "shards" / f"{s.name}.tar") for s in shards]
    assert sizes == [s.planned_bytes for s in shards]
