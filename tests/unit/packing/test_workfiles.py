"""Tests for the typed work-dir records: round trips, and damage named by file."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from shardio.errors import FormatError
from shardio.packing.scan import Skipped
from shardio.packing.workfiles import (
    CommitRecord,
    PartRecord,
    ShardRecord,
    StateRecord,
    load_record,
    write_record,
)
from shardio.storage.striping import LayoutResult

FP = "0123456789abcdef" * 2

SHARD = ShardRecord(
    fingerprint=FP,
    seq=3,
    path="shards/shard-000003.tar",
    size_bytes=10240,
    num_samples=4,
    num_members=8,
    data_bytes=9000,
    xxh3_128="f" * 32,
    dali_index="shards/shard-000003.idx",
    index_size_bytes=512,
    index_xxh3_128="e" * 32,
    skipped=(Skipped(b"a/\xff.jpg", "broken symlink"),),
)
RECORDS = [
    StateRecord(fingerprint=FP, part=1, num_parts=4, num_shards=7, shard_format="hdf5"),
    SHARD,
    PartRecord(
        part=0,
        num_parts=1,
        fingerprint=FP,
        shard_format="tar",
        classes=("cat", "dog"),
        label_layout="class-dirs",
        num_listed_files=9,
        options={"shard_size_bytes": 4096},
        layout=LayoutResult(
            fs_type="ext4", action="skipped", stripe=None, commands=(), message="local"
        ),
        shards=(SHARD,),
        skipped=(Skipped(b"x", "FIFO (named pipe)"),),
        oversized=("big",),
    ),
    CommitRecord(
        remove=("shards/shard-000000.tar", "index.bin", "manifest.json"),
        move=("shards/shard-000000.h5", "index.bin", "pack-report.json"),
    ),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_records_round_trip(tmp_path: Path, record) -> None:
    path = str(tmp_path / "rec.json")
    write_record(path, record, durable=False)
    assert load_record(path, type(record)) == record


def test_state_knows_every_file_it_may_write() -> None:
    state = StateRecord(fingerprint=FP, part=2, num_parts=3, num_shards=2, shard_format="tar")
    for rel in (
        "shards/shard-p0002-000000.tar",
        "shards/shard-p0002-000000.idx",
        "shards/shard-p0002-000001.tar",
    ):
        assert state.owns(rel), rel
    for rel in (
        "shards/shard-p0002-000002.tar",  # beyond the plan
        "shards/shard-p0001-000000.tar",  # another part
        "shards/shard-000000.tar",  # a single-part name
        "shards/shard-p0002-000000.h5",  # another format
        "shards/notes.txt",
        "index.bin",
    ):
        assert not state.owns(rel), rel
    single = StateRecord(
        fingerprint=FP, part=0, num_parts=1, num_shards=10**12, shard_format="hdf5"
    )
    assert single.owns("shards/shard-000005.h5")  # no list of 10**12 names is ever built
    assert not single.owns("shards/shard-p0000-000005.h5")


def _damage(doc: dict, how: str) -> bytes:
    text = json.dumps(doc)
    if how == "truncated":
        return text[: len(text) // 2].encode()
    if how == "garbage":
        return b"\x00\xff{{{ not json"
    if how == "not-an-object":
        return b"[1, 2, 3]"
    if how == "wrong-type":
        key = next(k for k, v in doc.items() if isinstance(v, int) and not isinstance(v, bool))
        return json.dumps({**doc, key: "12"}).encode()
    if how == "negative":
        key = next(k for k, v in doc.items() if isinstance(v, int) and not isinstance(v, bool))
        return json.dumps({**doc, key: -1}).encode()
    if how == "missing-field":
        return json.dumps(dict(list(doc.items())[1:])).encode()
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how", ["truncated", "garbage", "not-an-object", "wrong-type", "negative", "missing-field"]
)
@pytest.mark.parametrize("record", RECORDS[:3], ids=lambda r: type(r).__name__)
def test_damaged_records_are_format_errors_naming_the_file(
    tmp_path: Path, record, how: str
) -> None:
    path = tmp_path / "rec.json"
    path.write_bytes(_damage(record.to_json(), how))
    with pytest.raises(FormatError) as info:
        load_record(str(path), type(record))
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "doc",
    [
        {"remove": ["../../etc/passwd"], "move": []},
        {"remove": ["notes.txt"], "move": []},
        {"remove": [], "move": ["shards/../x.tar"]},
        {"remove": [], "move": [7]},
    ],
)
def test_commit_records_list_only_dataset_files(tmp_path: Path, doc: dict) -> None:
    path = tmp_path / "commit.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=str(path)):
        load_record(str(path), CommitRecord)


def test_a_done_record_naming_another_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({**SHARD.to_json(), "path": "/etc/passwd"}))
    with pytest.raises(FormatError, match="not a shard path"):
        load_record(str(path), ShardRecord)


def test_a_fifo_in_place_of_a_record_does_not_block(tmp_path: Path) -> None:
    path = tmp_path / "rec.json"
    os.mkfifo(path)
    result: list[BaseException] = []

    def load() -> None:
        try:
            load_record(str(path), StateRecord)
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "reading a FIFO record blocked"
    assert isinstance(result[0], FormatError)
    assert str(path) in str(result[0])
