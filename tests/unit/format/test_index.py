"""Tests for the binary index: build, write, memory-map, merge, and reject corrupt files."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from xxhash import xxh3_128_hexdigest

from shardio.errors import FormatError, StorageError
from shardio.format.index import (
    MEMBER_DTYPE,
    SAMPLE_DTYPE,
    Index,
)
from shardio.format.index_write import IndexBuilder, MemberEntry, merge_indexes
from shardio.format.manifest import IndexEntry, Manifest, ShardEntry
from shardio.format.spec import INDEX_HEADER_SIZE, INDEX_MAGIC, NO_LABEL, SECTION_ALIGN

# Header layout from docs/format.md: magic, version u32, flags u32, n_samples, n_members,
# n_shards (u64 each), then five (offset u64, length u64) section records.
_HEAD = struct.Struct("<8sIIQQQ")
_SECTION = struct.Struct("<QQ")
SECTIONS = ("samples", "members", "keys", "paths", "exts")


def _section(data: bytes, name: str) -> tuple[int, int]:
    return _SECTION.unpack_from(data, _HEAD.size + SECTIONS.index(name) * _SECTION.size)


def _write(builder: IndexBuilder, path: Path) -> Path:
    with open(path, "wb") as fh:
        builder.write(fh)
    return path


def _samples_of(index: Index) -> list[tuple[str, int, int, list[tuple[str, int, int, int, bytes]]]]:
    """Every sample as (key, shard, label, [(ext, offset, size, xxh3, path), ...])."""
    out = []
    for i in range(len(index)):
        rec = index.samples[i]
        members = []
        for m in index.sample_member_range(i):
            mrec = index.members[m]
            members.append(
                (
                    index.exts[int(mrec["ext_id"])],
                    int(mrec["offset"]),
                    int(mrec["size"]),
                    int(mrec["xxh3_64"]),
                    index.member_path(m),
                )
            )
        out.append((index.key(i), int(rec["shard"]), int(rec["label"]), members))
    return out


SHARD_A = [
    ("cat/a", 0, [("jpg", 512, 10, 0xAAAA, b"cat/a.jpg"), ("cls", 1536, 1, 0x1, b"")]),
    ("cat/b%2Ec", 0, [("jpg", 2560, 0, 0xBBBB, b"cat/b.c.jpg"), ("cls", 3072, 1, 0x1, b"")]),
]
SHARD_B = [
    # Extensions first seen in another order, plus one the first fragment lacks.
    ("dog/x", 1, [("cls", 512, 1, 0x2, b""), ("json", 1024, 7, 0xCCCC, b"dog/x.json")]),
    (
        "dog/y",
        1,
        [("png", 2048, 99, 0xDDDD, "dog/\u00e9.png".encode()), ("jpg", 3072, 5, 9, b"dog/y.jpg")],
    ),
]


def _builder(
    samples: list[tuple[str, int, list[tuple[str, int, int, int, bytes]]]],
) -> IndexBuilder:
    builder = IndexBuilder()
    for key, label, members in samples:
        builder.add_sample(
            shard=0, key=key, label=label, members=[MemberEntry(*m) for m in members]
        )
    return builder


def test_round_trip_through_file(tmp_path: Path) -> None:
    builder = IndexBuilder(n_shards=3)
    builder.add_sample(
        shard=2,
        key="a/b%20c",
        label=7,
        members=[
            MemberEntry("jpeg", 512, 1234, 2**64 - 1, b"a/b c.JPEG"),
            MemberEntry("cls", 2048, 1, 5, b""),
        ],
    )
    builder.add_sample(
        shard=0, key="k", label=NO_LABEL, members=[MemberEntry("noext", 0, 0, 0, b"k")]
    )
    builder.add_sample(shard=1, key="none", label=0, members=[])
    assert builder.num_samples == 3
    path = _write(builder, tmp_path / "index.bin")

    index = Index.open(path)
    try:
        assert index.path == str(path)
        assert len(index) == 3
        assert index.n_shards == 3
        assert index.exts == ("jpeg", "cls", "noext")
        assert _samples_of(index) == [
            (
                "a/b%20c",
                2,
                7,
                [("jpeg", 512, 1234, 2**64 - 1, b"a/b c.JPEG"), ("cls", 2048, 1, 5, b"")],
            ),
            ("k", 0, NO_LABEL, [("noext", 0, 0, 0, b"k")]),
            ("none", 1, 0, []),
        ]
    finally:
        index.close()


def test_layout_is_aligned_and_padded(tmp_path: Path) -> None:
    path = _write(_builder(SHARD_A), tmp_path / "index.bin")
    data = path.read_bytes()
    assert data[:8] == INDEX_MAGIC
    assert len(data) % SECTION_ALIGN == 0
    magic, version, flags, n_samples, n_members, n_shards = _HEAD.unpack_from(data, 0)
    assert (magic, version, flags, n_samples, n_members, n_shards) == (INDEX_MAGIC, 1, 0, 2, 4, 1)
    offsets = [_section(data, name)[0] for name in SECTIONS]
    assert offsets[0] == INDEX_HEADER_SIZE
    assert all(off % SECTION_ALIGN == 0 for off in offsets)
    assert offsets == sorted(offsets)
    exts_off, exts_len = _section(data, "exts")
    assert data[exts_off : exts_off + exts_len] == b"jpg\ncls"


def test_empty_index_round_trip(tmp_path: Path) -> None:
    path = _write(IndexBuilder(n_shards=0), tmp_path / "index.bin")
    index = Index.open(path)
    assert len(index) == 0
    assert index.exts == ()
    assert index.n_shards == 0
    index.close()


def test_index_from_bytes_in_memory(tmp_path: Path) -> None:
    path = _write(_builder(SHARD_A), tmp_path / "index.bin")
    index = Index(path.read_bytes())
    assert index.path == "<memory>"
    assert [index.key(i) for i in range(len(index))] == ["cat/a", "cat/b%2Ec"]


def test_merge_rebases_shards_members_keys_paths_and_exts(tmp_path: Path) -> None:
    a = Index.open(_write(_builder(SHARD_A), tmp_path / "a.index"))
    b = Index.open(_write(_builder(SHARD_B), tmp_path / "b.index"))
    assert a.exts == ("jpg", "cls")
    assert b.exts == ("cls", "json", "png", "jpg")
    out = tmp_path / "merged.bin"
    with open(out, "wb") as fh:
        n = merge_indexes(fh, [(a, 0), (b, 5)], n_shards=6)
    assert n == 4
    merged = Index.open(out)
    try:
        assert merged.n_shards == 6
        assert merged.exts == ("jpg", "cls", "json", "png")
        expected = [(key, 0, label, members) for key, label, members in SHARD_A] + [
            (key, 5, label, members) for key, label, members in SHARD_B
        ]
        assert _samples_of(merged) == expected
        assert merged.samples["first_member"].tolist() == [0, 2, 4, 6]
        assert len(merged.members) == 8
    finally:
        for index in (a, b, merged):
            index.close()


def test_merge_of_no_parts_is_an_empty_index(tmp_path: Path) -> None:
    out = tmp_path / "merged.bin"
    with open(out, "wb") as fh:
        assert merge_indexes(fh, [], n_shards=0) == 0
    merged = Index.open(out)
    assert len(merged) == 0
    merged.close()


def test_merge_keeps_a_fragment_without_members(tmp_path: Path) -> None:
    empty = Index.open(_write(IndexBuilder(), tmp_path / "e.index"))
    a = Index.open(_write(_builder(SHARD_A), tmp_path / "a.index"))
    out = tmp_path / "merged.bin"
    with open(out, "wb") as fh:
        merge_indexes(fh, [(empty, 0), (a, 1)], n_shards=2)
    merged = Index.open(out)
    assert _samples_of(merged) == [(k, 1, label, m) for k, label, m in SHARD_A]
    for index in (empty, a, merged):
        index.close()


def test_close_releases_the_mapping(tmp_path: Path) -> None:
    index = Index.open(_write(_builder(SHARD_A), tmp_path / "index.bin"))
    index.close()
    assert len(index) == 0
    index.close()  # idempotent


# --- corrupt files -------------------------------------------------------------------


@pytest.fixture
def good_index(tmp_path: Path) -> bytes:
    return _write(_builder(SHARD_A + SHARD_B), tmp_path / "good.bin").read_bytes()


def _manifest_for(data: bytes, n_samples: int) -> Manifest:
    """A format-1 manifest of one 1 MiB shard holding every sample, whose index checksum is
    that of ``data``: binding passes, so only the structural checks can refuse records."""
    return Manifest(
        shard_format="tar",
        num_samples=n_samples,
        num_members=0,
        data_bytes=0,
        index=IndexEntry(path="index.bin", size_bytes=len(data), xxh3_128=xxh3_128_hexdigest(data)),
        shards=(
            ShardEntry(
                path="shards/shard-000000.tar",
                size_bytes=1 << 20,
                num_samples=n_samples,
                first_sample=0,
                xxh3_128="0" * 32,
            ),
        ),
        classes=("cat", "dog"),
        label_layout="class-dirs",
        format_version=1,
    )


def _open_corrupt(tmp_path: Path, data: bytes) -> tuple[Path, pytest.ExceptionInfo[FormatError]]:
    """The index is refused: on open (header, tables, extensions) or, bound to a manifest,
    when its records are checked, before any record is used."""
    path = tmp_path / "bad index.bin"
    path.write_bytes(data)
    with pytest.raises(FormatError) as info:
        index = Index.open(path)
        index.bind(_manifest_for(data, len(index)))
        index.check_all()
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)
    return path, info


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.bin"
    with pytest.raises(FormatError, match="missing") as info:
        Index.open(path)
    assert str(path) in str(info.value)


def test_empty_file(tmp_path: Path) -> None:
    _, info = _open_corrupt(tmp_path, b"")
    assert "empty" in str(info.value)


def test_bad_magic(tmp_path: Path, good_index: bytes) -> None:
    _, info = _open_corrupt(tmp_path, b"NOTANIDX" + good_index[8:])
    assert "magic" in str(info.value)


def test_not_an_index_at_all(tmp_path: Path) -> None:
    _, info = _open_corrupt(tmp_path, b'{"format": "shardio"}\n' * 20)
    assert "not a shardio index" in str(info.value)


@pytest.mark.parametrize("size", [1, 8, INDEX_HEADER_SIZE - 1])
def test_truncated_header(tmp_path: Path, good_index: bytes, size: int) -> None:
    _, info = _open_corrupt(tmp_path, good_index[:size])
    assert "truncated" in str(info.value)


def test_truncated_body(tmp_path: Path, good_index: bytes) -> None:
    keys_off, _ = _section(good_index, "keys")
    _, info = _open_corrupt(tmp_path, good_index[:keys_off])
    assert "past the end" in str(info.value)


@pytest.mark.parametrize("version", [0, 2, 0xFFFFFFFF])
def test_wrong_version(tmp_path: Path, good_index: bytes, version: int) -> None:
    data = bytearray(good_index)
    struct.pack_into("<I", data, 8, version)
    _, info = _open_corrupt(tmp_path, bytes(data))
    assert f"version {version}" in str(info.value)


@pytest.mark.parametrize("name", SECTIONS)
def test_section_past_eof(tmp_path: Path, good_index: bytes, name: str) -> None:
    data = bytearray(good_index)
    off, length = _section(good_index, name)
    _SECTION.pack_into(data, _HEAD.size + SECTIONS.index(name) * _SECTION.size, off, len(data))
    _, info = _open_corrupt(tmp_path, bytes(data))
    assert repr(name) in str(info.value)
    assert length < len(data)


def test_record_counts_disagree_with_tables(tmp_path: Path, good_index: bytes) -> None:
    data = bytearray(good_index)
    n_samples = _HEAD.unpack_from(data, 0)[3]
    struct.pack_into("<Q", data, 16, n_samples + 1)
    _, info = _open_corrupt(tmp_path, bytes(data))
    assert "record counts" in str(info.value)


def test_extension_id_outside_the_table(tmp_path: Path, good_index: bytes) -> None:
    data = bytearray(good_index)
    off, length = _section(good_index, "exts")
    # Shorten the table to its first extension: later ext ids now point past its end.
    first = bytes(data[off : off + length]).split(b"\n")[0]
    _SECTION.pack_into(data, _HEAD.size + SECTIONS.index("exts") * _SECTION.size, off, len(first))
    _, info = _open_corrupt(tmp_path, bytes(data))
    assert "extension" in str(info.value)


def test_non_ascii_extension_table(tmp_path: Path, good_index: bytes) -> None:
    # The spec says the extension table is ASCII; a damaged byte there must be a
    # FormatError naming the file, not a bare UnicodeDecodeError.
    data = bytearray(good_index)
    off, _ = _section(good_index, "exts")
    data[off] = 0xFF
    _open_corrupt(tmp_path, bytes(data))


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ("samples", "first_member"),
        ("samples", "key_offset"),
        ("members", "path_offset"),
    ],
)
def test_records_pointing_outside_their_tables(
    tmp_path: Path, good_index: bytes, table: str, field: str
) -> None:
    # A sample whose members or key lie past the end of their table, or a member whose path
    # does, is a corrupt index: it must be refused on open, not read as wrong data later.
    data = bytearray(good_index)
    off, length = _section(good_index, table)
    dtype = SAMPLE_DTYPE if table == "samples" else MEMBER_DTYPE
    records = np.frombuffer(bytes(data[off : off + length]), dtype=dtype).copy()
    records[field][-1] = 10_000
    data[off : off + length] = records.tobytes()
    _open_corrupt(tmp_path, bytes(data))


def _edit_record(good: bytes, table: str, row: int, **fields: int) -> bytes:
    data = bytearray(good)
    off, length = _section(good, table)
    dtype = SAMPLE_DTYPE if table == "samples" else MEMBER_DTYPE
    records = np.frombuffer(bytes(data[off : off + length]), dtype=dtype).copy()
    for name, value in fields.items():
        records[name][row] = value
    data[off : off + length] = records.tobytes()
    return bytes(data)


@pytest.mark.parametrize(
    ("table", "fields"),
    [
        # Values at or above 2**63, and pairs whose uint64 sum wraps around below the limit.
        ("members", {"offset": 2**63}),
        ("members", {"size": 2**64 - 1}),
        ("members", {"offset": 2**64 - 8, "size": 16}),
        ("samples", {"first_member": 2**63}),
        ("samples", {"first_member": 2**64 - 1, "n_members": 2}),
        ("samples", {"key_offset": 2**64 - 1, "key_length": 2}),
        ("members", {"path_offset": 2**64 - 2, "path_length": 4}),
        ("samples", {"label": 7}),
        ("samples", {"label": -5}),
        ("samples", {"shard": 3}),
        ("samples", {"n_members": 0}),
        ("samples", {"key_length": 0}),
        ("members", {"ext_id": 2**32 - 1}),
    ],
)
def test_huge_or_wrapping_values_are_refused(
    tmp_path: Path, good_index: bytes, table: str, fields: dict[str, int]
) -> None:
    _open_corrupt(tmp_path, _edit_record(good_index, table, 1, **fields))


def test_non_ascii_key_bytes_are_refused(tmp_path: Path, good_index: bytes) -> None:
    data = bytearray(good_index)
    off, _ = _section(good_index, "keys")
    data[off] = 0xE9
    _, info = _open_corrupt(tmp_path, bytes(data))
    assert "key" in str(info.value)


@pytest.mark.parametrize("ext", [b"__key__", b"__url__", b"a b", b"x.y", b""])
def test_reserved_or_invalid_extension_names_are_refused(
    tmp_path: Path, good_index: bytes, ext: bytes
) -> None:
    data = bytearray(good_index)
    off, length = _section(good_index, "exts")
    table = bytes(data[off : off + length]).split(b"\n")
    table[0] = ext
    new = b"\n".join(table)
    data[off : off + len(new)] = new
    _SECTION.pack_into(data, _HEAD.size + SECTIONS.index("exts") * _SECTION.size, off, len(new))
    _open_corrupt(tmp_path, bytes(data))


def test_a_fifo_index_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "index.bin"
    os.mkfifo(path)
    with pytest.raises(StorageError, match="FIFO"):
        Index.open(path)


# --- an index on a network filesystem: read, not only mapped ---------------------------


def test_in_memory_index_holds_no_mapping_and_reads_the_same(tmp_path: Path) -> None:
    path = _write(_builder(SHARD_A + SHARD_B), tmp_path / "index.bin")
    mapped = Index.open(path)
    read = Index.open(path, in_memory=True)
    assert isinstance(read._buffer, bytes)  # a dead server cannot SIGBUS a page of it
    assert _samples_of(read) == _samples_of(mapped)
    mapped.close()
    read.close()


def test_large_index_is_mapped_after_one_pread_pass(tmp_path: Path, monkeypatch) -> None:
    import mmap

    import shardio.format.index as index_module

    path = _write(_builder(SHARD_A + SHARD_B), tmp_path / "index.bin")
    monkeypatch.setattr(index_module, "IN_MEMORY_MAX_BYTES", 16)
    reads: list[int] = []
    real = os.preadv
    monkeypatch.setattr(
        index_module.os, "preadv", lambda fd, bufs, off: reads.append(off) or real(fd, bufs, off)
    )
    index = Index.open(path, in_memory=True)
    assert isinstance(index._buffer, mmap.mmap)
    assert reads == [0]  # the whole (small) file passed through the page cache once
    index.close()


def test_in_memory_index_that_cannot_be_read_is_a_storage_error(
    tmp_path: Path, monkeypatch
) -> None:
    import errno

    import shardio.format.index as index_module

    path = _write(_builder(SHARD_A), tmp_path / "index.bin")

    def dead(fd, bufs, off):
        raise OSError(errno.ENXIO, "No such device or address")

    monkeypatch.setattr(index_module.os, "preadv", dead)
    with pytest.raises(StorageError, match=r"cannot read index .*index.bin: No such device"):
        Index.open(path, in_memory=True)


def test_in_memory_index_cut_while_read_is_a_format_error(tmp_path: Path, monkeypatch) -> None:
    import shardio.format.index as index_module

    path = _write(_builder(SHARD_A), tmp_path / "index.bin")
    monkeypatch.setattr(index_module.os, "preadv", lambda fd, bufs, off: 0)
    with pytest.raises(FormatError, match=r"index is truncated \(0 of"):
        Index.open(path, in_memory=True)
