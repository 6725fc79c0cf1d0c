"""A sample manifest for the format tests (tests/unit/format): two tar shards, a label map,
format 3 without parity; ``_seal`` serialises a hand-edited document with its checksum."""

from __future__ import annotations

import json
from typing import Any

from shardio.format.document import encode_document
from shardio.format.manifest import IndexEntry, Manifest, ShardEntry

HASH = "0123456789abcdef0123456789abcdef"


def sample_manifest(**overrides: Any) -> Manifest:
    fields: dict[str, Any] = {
        "shard_format": "tar",
        "num_samples": 5,
        "num_members": 10,
        "data_bytes": 12345,
        "index": IndexEntry(
            path="index.bin", size_bytes=1024, xxh3_128=HASH, head_xxh3_64=HASH[:16]
        ),
        "shards": (
            ShardEntry(
                path="shards/shard-000000.tar",
                size_bytes=10240,
                num_samples=3,
                first_sample=0,
                xxh3_128=HASH,
                dali_index="shards/shard-000000.idx",
                index_xxh3_64=HASH[:16],
            ),
            ShardEntry(
                path="shards/shard-000001.tar",
                size_bytes=4096,
                num_samples=2,
                first_sample=3,
                xxh3_128=HASH[::-1],
                dali_index="shards/shard-000001.idx",
                index_xxh3_64=HASH[16:],
            ),
        ),
        "classes": ("cat", "dog \u00f1", "raw\udcff"),
        "label_layout": "class-dirs",
        "options": {"shard_size_bytes": 8192, "labels": "auto"},
        "layout": {"fs_type": "ext4", "action": "skipped"},
        "created_by": "shardio 0.1.0",
        "pack_fingerprints": (HASH,),
    }
    fields.update(overrides)
    return Manifest(**fields)


def seal_document(doc: Any) -> bytes:
    if isinstance(doc, dict) and "manifest_xxh3_128" in doc:
        doc = {k: v for k, v in doc.items() if k != "manifest_xxh3_128"}
        doc["manifest_xxh3_128"] = "0" * 32
        return encode_document(doc)
    return json.dumps(doc).encode()
