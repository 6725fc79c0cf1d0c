"""The manifest's optional ``labels.source``: where a pinned label map came from."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardio.errors import FormatError
from shardio.format.manifest import (
    IndexEntry,
    LabelSource,
    Manifest,
    ShardEntry,
    encode_document,
    parse_manifest,
)

HASH = "0123456789abcdef0123456789abcdef"
SOURCE = LabelSource(kind="dataset", path="/lustre/ds/train", xxh3_128=HASH)


def _manifest(**overrides: Any) -> Manifest:
    fields: dict[str, Any] = {
        "shard_format": "tar",
        "num_samples": 1,
        "num_members": 2,
        "data_bytes": 10,
        "index": IndexEntry(path="index.bin", size_bytes=1, xxh3_128=HASH, head_xxh3_64=HASH[:16]),
        "shards": (
            ShardEntry(
                path="shards/shard-000000.tar",
                size_bytes=4096,
                num_samples=1,
                first_sample=0,
                xxh3_128=HASH,
                index_xxh3_64=HASH[:16],
            ),
        ),
        "classes": ("n01", "n02"),
        "label_layout": "class-dirs",
        "pack_fingerprints": (HASH,),
    }
    fields.update(overrides)
    return Manifest(**fields)


def test_a_pinned_source_round_trips_and_an_unpinned_manifest_has_none() -> None:
    pinned = _manifest(label_source=SOURCE)
    doc = json.loads(pinned.dumps())
    assert doc["labels"] == {
        "layout": "class-dirs",
        "classes": ["n01", "n02"],
        "source": {"kind": "dataset", "path": "/lustre/ds/train", "xxh3_128": HASH},
    }
    assert parse_manifest(pinned.dumps()) == pinned
    plain = _manifest()
    assert "source" not in json.loads(plain.dumps())["labels"]
    assert parse_manifest(plain.dumps()).label_source is None


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ({"kind": "guess", "path": "/x", "xxh3_128": HASH}, "unknown kind 'guess'"),
        ({"kind": "dataset", "path": "/x", "xxh3_128": "xyz"}, "32 lower-case hex digits"),
        ({"kind": "dataset", "path": "", "xxh3_128": HASH}, "path must be a path"),
        ({"kind": "dataset", "xxh3_128": HASH}, "missing field 'path'"),
        ("/lustre/ds/train", "labels.source must be an object"),
    ],
)
def test_a_bad_source_is_refused_naming_the_field(source: object, needle: str) -> None:
    doc = json.loads(_manifest().dumps())
    doc["labels"]["source"] = source
    with pytest.raises(FormatError, match=r"labels\.source") as info:
        parse_manifest(encode_document(doc), where="m.json")
    assert needle in str(info.value)
    assert str(info.value).startswith("m.json")


def test_a_source_without_classes_is_refused() -> None:
    with pytest.raises(FormatError, match=r"labels\.source is set, but there are no classes"):
        _manifest(classes=None, label_layout="none", label_source=SOURCE)
