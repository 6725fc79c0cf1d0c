"""Staging decisions made once and handed on (ShardResolver.decide, PackedDataset.handoff),
and stamps read once while unchanged (StampCache): a decision gone stale costs a fallback to
the source, never a wrong byte, and never a symlink followed."""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil

import pytest

from shardio.cache.protocol import StampCache, stamp_path, write_stamp
from shardio.cache.stage import StageOptions, stage_dataset
from shardio.errors import FormatError
from shardio.read.packed import PackedDataset


@pytest.fixture
def staged(packed_small, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(dataset, staging area holding a verified copy of every shard)."""
    src = packed_small("tar", "256KiB")[0]
    area = tmp_path / "area"
    stage_dataset(src, area, StageOptions())
    return src, area


def _flip_first_member(ds: PackedDataset, path: str) -> None:
    """Flip a byte of sample 0's first member in the file at ``path``."""
    offset = int(ds.index.members[ds.index.sample_member_range(0)[0]]["offset"])
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_a_decided_copy_damaged_since_costs_a_fallback_not_a_byte(staged) -> None:
    src, area = staged
    with PackedDataset(src) as clean:
        expected = clean.read_sample(0)
    with PackedDataset(src, cache=area) as ds:
        ds.decide(range(len(ds)))
        assert ds.resolver.handed() == frozenset(range(len(ds.manifest.shards)))
        copy = ds.shard_path(0)
        _flip_first_member(ds, copy)  # the stamp no longer matches; the decision says staged
        assert ds.resolver.locate(0).staged
        assert ds.read_sample(0) == expected
        assert ds.metrics["checksum_failures"] == 1
        assert ds.metrics["drops"] == 1
        assert not ds.resolver.locate(0).staged
        assert not os.path.exists(copy), "the damaged copy was kept"


def test_a_decided_copy_replaced_by_a_symlink_is_not_followed(staged, tmp_path) -> None:
    src, area = staged
    with PackedDataset(src) as clean:
        expected = clean.read_sample(0)
        source = clean.shard_path(0)
    with PackedDataset(src, cache=area) as ds:
        ds.decide([0])
        copy = ds.shard_path(0)
        os.unlink(copy)
        os.symlink(source, copy)  # the right bytes, but not a file staging wrote
        assert ds.read_sample(0) == expected
        assert ds.metrics["bytes_staged"] == 0, "read through the symlink"
        assert ds.metrics["read_errors"] == 1
        assert os.path.islink(copy), "shardio removed a symlink it did not create"


def test_forget_checks_a_handed_shard_again(staged) -> None:
    src, area = staged
    with PackedDataset(src, cache=area) as ds:
        ds.decide([0, 1])
        os.unlink(stamp_path(str(area), ds.manifest.shards[0].path))
        assert ds.resolver.locate(0).staged  # decided: not checked again
        ds.resolver.forget(0)
        assert not ds.resolver.locate(0).staged
        assert ds.resolver.locate(1).staged


def test_without_a_staging_area_decide_is_a_no_op(staged) -> None:
    src, _area = staged
    with PackedDataset(src) as ds:
        ds.decide(range(len(ds)))
        assert ds.resolver.handed() == frozenset()
        assert not ds.resolver.locate(0).staged


def test_a_handoff_carries_the_manifest_and_decisions_but_the_index_is_checked(
    staged, tmp_path
) -> None:
    src, area = staged
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    with PackedDataset(copy, cache=area) as parent:
        parent.decide(range(len(parent)))
        handoff = pickle.loads(pickle.dumps(parent.handoff()))
        expected = [parent.read_sample(i) for i in range(3)]
    assert handoff.staged == frozenset(range(len(handoff.manifest.shards)))
    (copy / "manifest.json").write_bytes(b"not read again")
    with PackedDataset(copy, cache=area, handoff=handoff) as child:
        assert child.resolver.handed() == handoff.staged
        assert [child.read_sample(i) for i in range(3)] == expected
        assert child.metrics["cache_hits"] >= 1
    index = copy / handoff.manifest.index.path
    data = bytearray(index.read_bytes())
    data[8] ^= 0xFF  # the header: checked against the manifest at open
    index.write_bytes(bytes(data))
    with pytest.raises(FormatError):
        PackedDataset(copy, cache=area, handoff=handoff)


def test_stamp_cache_reads_a_stamp_again_once_it_is_replaced(staged) -> None:
    src, area = staged
    with PackedDataset(src) as ds:
        entry = ds.manifest.shards[0]
    dest = str(area)
    stamps = StampCache()
    assert stamps.matches(dest, entry.path, entry.xxh3_128)
    assert stamps.matches(dest, entry.path, entry.xxh3_128)  # from what was read
    write_stamp(dest, entry.path, "0" * 32, durable=False)  # published by rename: a new file
    assert not stamps.matches(dest, entry.path, entry.xxh3_128)
    write_stamp(dest, entry.path, entry.xxh3_128, durable=False)
    assert stamps.matches(dest, entry.path, entry.xxh3_128)
    stamp = stamp_path(dest, entry.path)
    real = stamp + ".real"
    os.rename(stamp, real)
    os.symlink(real, stamp)  # a valid stamp behind a symlink is no stamp
    assert not stamps.matches(dest, entry.path, entry.xxh3_128)
    os.unlink(stamp)
    assert not stamps.matches(dest, entry.path, entry.xxh3_128)
    os.rename(real, stamp)
    assert stamps.matches(dest, entry.path, entry.xxh3_128)
    with open(os.path.join(dest, entry.path), "r+b") as fh:  # the copy written: ctime moves
        first = fh.read(1)
        fh.seek(0)
        fh.write(first)
    assert not stamps.matches(dest, entry.path, entry.xxh3_128)
