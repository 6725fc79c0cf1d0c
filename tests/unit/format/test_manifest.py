"""Tests for the manifest model, its JSON form and the validating parser."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
from manifests import HASH, sample_manifest, seal_document

from shardio.errors import FormatError, StorageError
from shardio.format.manifest import (
    IndexEntry,
    ShardEntry,
    load_manifest,
    parse_manifest,
)
from shardio.format.spec import MAX_MANIFEST_BYTES

WHERE = "/data/set one/manifest.json"


def _doc() -> dict[str, Any]:
    return copy.deepcopy(sample_manifest().to_json())


def _parse_fails(doc: Any) -> str:
    # A dict is sealed with a valid checksum, so the field checks (not the checksum) refuse it.
    data = doc if isinstance(doc, bytes) else seal_document(doc)
    with pytest.raises(FormatError) as info:
        parse_manifest(data, where=WHERE)
    message = str(info.value)
    assert message.startswith(WHERE + ": "), message
    assert "\n" not in message
    return message


def test_round_trip() -> None:
    manifest = sample_manifest()
    data = manifest.dumps()
    assert data.isascii()
    assert data.endswith(b"\n")
    parsed = parse_manifest(data, where=WHERE)
    assert parsed == manifest
    assert parsed.dumps() == data
    assert parsed.total_bytes == 10240 + 4096


def test_round_trip_hdf5_unlabelled() -> None:
    shards = (
        ShardEntry(
            path="shards/shard-000000.h5",
            size_bytes=9,
            num_samples=5,
            first_sample=0,
            xxh3_128=HASH,
            index_xxh3_64=HASH[:16],
        ),
    )
    manifest = sample_manifest(
        shard_format="hdf5", shards=shards, classes=None, label_layout="none"
    )
    parsed = parse_manifest(manifest.dumps())
    assert parsed == manifest
    assert parsed.classes is None
    assert parsed.shards[0].dali_index is None


def test_json_form_fields() -> None:
    doc = sample_manifest().to_json()
    assert list(doc)[:2] == ["format", "format_version"]
    assert doc["format"] == "shardio"
    assert doc["format_version"] == 3
    assert list(doc)[-3:] == ["parity", "shards", "manifest_xxh3_128"]
    assert doc["parity"] is None  # format 3: no parity (pack --parity fills it)
    assert doc["pack_fingerprints"] == [HASH]
    assert doc["index"]["head_xxh3_64"] == HASH[:16]
    assert doc["num_shards"] == 2
    assert doc["total_bytes"] == 14336
    assert doc["labels"] == {"layout": "class-dirs", "classes": ["cat", "dog \u00f1", "raw\udcff"]}
    assert doc["shards"][1] == {
        "path": "shards/shard-000001.tar",
        "size_bytes": 4096,
        "num_samples": 2,
        "first_sample": 3,
        "xxh3_128": HASH[::-1],
        "dali_index": "shards/shard-000001.idx",
        "index_xxh3_64": HASH[16:],
    }


def test_load_manifest_from_file(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(sample_manifest().dumps())
    assert load_manifest(path) == sample_manifest()


def test_load_missing_manifest_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    with pytest.raises(FormatError, match="no manifest") as info:
        load_manifest(path)
    assert str(path) in str(info.value)


def test_load_invalid_manifest_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(b"{not json")
    with pytest.raises(FormatError) as info:
        load_manifest(path)
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize("version", [4, 0, -1, 99])
def test_unsupported_integer_version(version: int) -> None:
    doc = _doc()
    doc["format_version"] = version
    message = _parse_fails(doc)
    assert f"unsupported format_version {version}" in message
    assert "upgrade shardio" in message


@pytest.mark.parametrize("version", ["1", True, 1.0, None, [1]])
def test_non_integer_version(version: Any) -> None:
    doc = _doc()
    doc["format_version"] = version
    assert "format_version" in _parse_fails(doc)


def test_missing_version() -> None:
    doc = _doc()
    del doc["format_version"]
    assert "format_version" in _parse_fails(doc)


@pytest.mark.parametrize(
    "data", [b"", b"{", b"\xff\xfe\x00", b'{"format": "shardio",}', b"NaN garbage"]
)
def test_malformed_json(data: bytes) -> None:
    assert "not valid JSON" in _parse_fails(data)


@pytest.mark.parametrize("doc", [[], "shardio", 1, {"format": "zarr", "format_version": 1}, {}])
def test_not_a_shardio_manifest(doc: Any) -> None:
    assert "not a shardio manifest" in _parse_fails(doc)


@pytest.mark.parametrize(
    "field",
    ["shard_format", "num_samples", "num_members", "data_bytes", "index", "labels", "shards"],
)
def test_missing_top_level_field(field: str) -> None:
    doc = _doc()
    del doc[field]
    assert f"missing field {field!r}" in _parse_fails(doc)


@pytest.mark.parametrize("field", ["path", "size_bytes", "num_samples", "first_sample", "xxh3_128"])
def test_missing_shard_field(field: str) -> None:
    doc = _doc()
    del doc["shards"][1][field]
    message = _parse_fails(doc)
    assert "shards[1]" in message
    assert f"missing field {field!r}" in message


@pytest.mark.parametrize("field", ["path", "size_bytes", "xxh3_128"])
def test_missing_index_field(field: str) -> None:
    doc = _doc()
    del doc["index"][field]
    message = _parse_fails(doc)
    assert "index" in message
    assert f"missing field {field!r}" in message


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("num_samples",), "5"),
        (("num_samples",), True),
        (("num_samples",), 5.0),
        (("data_bytes",), None),
        (("shard_format",), 1),
        (("index",), "index.bin"),
        (("labels",), ["cat"]),
        (("shards",), {"path": "x"}),
        (("shards", 0, "size_bytes"), "10240"),
        (("shards", 0, "num_samples"), False),
        (("shards", 1, "path"), ["shards", "x.tar"]),
        (("index", "size_bytes"), 1024.5),
    ],
)
def test_wrong_type(path: tuple[Any, ...], value: Any) -> None:
    doc = _doc()
    target = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    message = _parse_fails(doc)
    assert repr(path[-1]) in message
    assert "wrong type" in message


def test_shard_that_is_not_an_object() -> None:
    doc = _doc()
    doc["shards"][1] = "shards/shard-000001.tar"
    assert "shards[1] is not an object" in _parse_fails(doc)


@pytest.mark.parametrize("classes", ["cat", [1, 2], ["cat", None], {"0": "cat"}])
def test_bad_classes(classes: Any) -> None:
    doc = _doc()
    doc["labels"]["classes"] = classes
    assert "labels.classes" in _parse_fails(doc)


def test_unknown_shard_format() -> None:
    doc = _doc()
    doc["shard_format"] = "zip"
    assert "'zip'" in _parse_fails(doc)


@pytest.mark.parametrize(
    "bad",
    ["../x.tar", "/abs/x.tar", "shards/../../x.tar", "", "shards//x.tar", "shards/x/..", ".."],
)
@pytest.mark.parametrize("where", ["shard", "index", "dali_index"])
def test_path_escaping_the_dataset(bad: str, where: str) -> None:
    doc = _doc()
    if where == "shard":
        doc["shards"][0]["path"] = bad
    elif where == "index":
        doc["index"]["path"] = bad
    else:
        doc["shards"][1]["dali_index"] = bad
    message = _parse_fails(doc)
    assert repr(bad) in message
    assert "inside the dataset" in message


def test_sample_counts_not_adding_up() -> None:
    doc = _doc()
    doc["num_samples"] = 6
    assert "do not add up" in _parse_fails(doc)


def test_first_sample_must_follow_the_shard_before() -> None:
    # Readers slice the index by first_sample; a shard that claims the wrong start would
    # make verify check another shard's samples. The parser must refuse it.
    doc = _doc()
    doc["shards"][1]["first_sample"] = 2
    message = _parse_fails(doc)
    assert "first_sample" in message


@pytest.mark.parametrize("field", ["size_bytes", "num_samples", "first_sample"])
def test_negative_shard_numbers(field: str) -> None:
    doc = _doc()
    doc["shards"][0][field] = -1
    if field == "num_samples":
        doc["num_samples"] -= 4
    message = _parse_fails(doc)
    assert "negative" in message
    assert "shards/shard-000000.tar" in message


@pytest.mark.parametrize("digest", ["", "abc", HASH + "0"])
def test_shard_checksum_must_be_32_hex_digits(digest: str) -> None:
    doc = _doc()
    doc["shards"][0]["xxh3_128"] = digest
    assert "xxh3_128" in _parse_fails(doc)


def test_model_rejects_bad_values_directly() -> None:
    with pytest.raises(FormatError, match="unknown shard_format"):
        sample_manifest(shard_format="zip")
    with pytest.raises(FormatError, match="do not add up"):
        sample_manifest(num_samples=4)
    with pytest.raises(FormatError, match="inside the dataset"):
        IndexEntry(path="/index.bin", size_bytes=1, xxh3_128=HASH)


def test_an_edited_manifest_fails_its_checksum() -> None:
    data = sample_manifest().dumps()
    edited = data.replace(b'"cat"', b'"cow"')
    message = _parse_fails(edited)
    assert "checksum mismatch" in message


@pytest.mark.parametrize("cut", [1, 40, 120])
def test_a_truncated_manifest_is_refused(cut: int) -> None:
    _parse_fails(sample_manifest().dumps()[:-cut])


def test_a_format_2_manifest_without_its_checksum_is_refused() -> None:
    doc = _doc()
    del doc["manifest_xxh3_128"]
    assert "checksum" in _parse_fails(json.dumps(doc, indent=1).encode())


def test_deeply_nested_json_is_one_format_error() -> None:
    assert "nested too deeply" in _parse_fails(b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize("text", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_refused(text: bytes) -> None:
    doc = _doc()
    doc["data_bytes"] = "PLACEHOLDER"
    data = seal_document(doc).replace(b'"PLACEHOLDER"', text)
    _parse_fails(data)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("num_samples",), 2**63),
        (("data_bytes",), 10**30),
        (("shards", 0, "size_bytes"), 2**64),
        (("index", "size_bytes"), -1),
        (("shards", 0, "path"), "shards/x\x00.tar"),
        (("shards", 0, "path"), "shards/\u00e9.tar"),
        (("shards", 0, "path"), "shards/./x.tar"),
        (("shards", 0, "dali_index"), "shards/shard-000001.tar"),
        (("index", "path"), "manifest.json"),
        (("index", "path"), "shards/shard-000000.tar"),
        (("num_shards",), 3),
        (("total_bytes",), 1),
        (("labels", "classes"), ["cat", "cat"]),
        (("labels", "layout"), "nested-dirs"),
        (("labels", "layout"), "none"),
        (("pack_fingerprints",), ["xyz"]),
        (("shards", 0, "index_xxh3_64"), "ABCDEF0123456789"),
        (("index", "head_xxh3_64"), None),
        (("staged_from",), "\x00"),
        (("options",), []),
    ],
)
def test_out_of_range_or_inconsistent_fields(path: tuple[Any, ...], value: Any) -> None:
    doc = _doc()
    target = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    _parse_fails(doc)


def test_load_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    os.mkfifo(path)
    with pytest.raises(StorageError, match="FIFO"):
        load_manifest(path)


def test_load_refuses_a_huge_manifest_before_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    with open(path, "wb") as fh:
        fh.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(FormatError, match="more than"):
        load_manifest(path)


def test_format_1_manifests_still_parse_without_checksums() -> None:
    manifest = sample_manifest(
        format_version=1,
        index=IndexEntry(path="index.bin", size_bytes=1024, xxh3_128=HASH),
        pack_fingerprints=(),
    )
    data = manifest.dumps()
    assert b"manifest_xxh3_128" not in data
    assert parse_manifest(data).format_version == 1
