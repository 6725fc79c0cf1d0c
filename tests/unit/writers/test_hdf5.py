"""Tests for the HDF5 shard writer, read back with plain h5py."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from shardio.errors import StorageError
from shardio.format.checksum import file_xxh3_128, member_xxh3_64
from shardio.writers.hdf5 import HDF5ShardWriter


def _members(*items: tuple[str, bytes]) -> list[tuple[str, bytes, int]]:
    return [(ext, data, member_xxh3_64(data)) for ext, data in items]


SAMPLES = [
    ("a/x", 3, _members(("jpg", b"jpeg bytes"), ("cls", b"3"))),
    ("a/empty", -1, _members(("txt", b""))),
    ("b/y%2Ez", 0, _members(("png", bytes(range(256)) * 20), ("json", b"{}"))),
]


def _write(
    path: Path, capacity: int, alignment: int = 4096
) -> tuple[list[list[tuple[int, int]]], int, str]:
    writer = HDF5ShardWriter(str(path), capacity_bytes=capacity, alignment=alignment, durable=False)
    placed = [writer.add_sample(key, label, m) for key, label, m in SAMPLES]
    assert not path.exists()
    size, digest = writer.finish()
    return placed, size, digest


@pytest.mark.parametrize("capacity", [5200, 1 << 20])
def test_plain_h5py_reads_every_member(tmp_path: Path, capacity: int) -> None:
    path = tmp_path / "shard.h5"
    placed, size, digest = _write(path, capacity)
    assert os.listdir(tmp_path) == ["shard.h5"]
    assert size == path.stat().st_size
    assert digest == file_xxh3_128(path)
    flat = [(ext, data) for _, _, ms in SAMPLES for ext, data, _ in ms]
    with h5py.File(path, "r") as f:
        blob = f["data"]
        assert blob.dtype == np.uint8
        assert blob.chunks is None
        assert blob.compression is None
        assert blob.shape == (capacity,)
        base = blob.id.get_offset()
        assert f.attrs["shardio_format_version"] == 1
        assert f.attrs["blob_bytes"] == sum(len(d) for _, d in flat)
        assert [k.decode() for k in f["sample_key"][:]] == [k for k, _, _ in SAMPLES]
        assert f["sample_label"][:].tolist() == [3, -1, 0]
        assert f["sample_num_members"][:].tolist() == [2, 1, 2]
        assert f["sample_first_member"][:].tolist() == [0, 2, 3]
        assert [e.decode() for e in f["member_ext"][:]] == [e for e, _ in flat]
        assert f["member_xxh3_64"][:].tolist() == [member_xxh3_64(d) for _, d in flat]
        offsets, sizes = f["member_offset"][:], f["member_size"][:]
        for (_, data), off, n, (abs_off, abs_n) in zip(
            flat, offsets, sizes, [p for ps in placed for p in ps], strict=True
        ):
            assert bytes(blob[int(off) : int(off) + int(n)]) == data
            assert (abs_off, abs_n) == (base + int(off), len(data))
    with open(path, "rb") as fh:
        for (_, data), (off, n) in zip(flat, [p for ps in placed for p in ps], strict=True):
            assert os.pread(fh.fileno(), n, off) == data


@pytest.mark.parametrize("capacity", [5200, 1 << 20])
@pytest.mark.parametrize("alignment", [4096, 65536])
def test_blob_is_aligned(tmp_path: Path, capacity: int, alignment: int) -> None:
    # The module documents the blob as "aligned to the stripe size", whatever the shard's
    # size; small shards (the last of a dataset, or small datasets) are no exception.
    path = tmp_path / "shard.h5"
    _write(path, capacity, alignment)
    with h5py.File(path, "r") as f:
        assert f["data"].id.get_offset() % alignment == 0


def test_overfilling_the_blob_is_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "shard.h5"
    writer = HDF5ShardWriter(str(path), capacity_bytes=10, durable=False)
    writer.add_sample("a", 0, _members(("bin", b"0123456789")))
    with pytest.raises(StorageError) as info:
        writer.add_sample("b", 0, _members(("bin", b"x")))
    assert str(path) in str(info.value)
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    writer = HDF5ShardWriter(str(tmp_path / "shard.h5"), capacity_bytes=100, durable=False)
    writer.add_sample("a", 0, _members(("bin", b"abc")))
    writer.abort()
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_unwritable_directory_names_the_shard(tmp_path: Path) -> None:
    path = str(tmp_path / "missing-dir" / "shard.h5")
    with pytest.raises(StorageError) as info:
        HDF5ShardWriter(path, capacity_bytes=10)
    assert path in str(info.value)


def test_empty_shard(tmp_path: Path) -> None:
    path = tmp_path / "shard.h5"
    writer = HDF5ShardWriter(str(path), capacity_bytes=0, durable=False)
    size, _ = writer.finish()
    assert size == path.stat().st_size
    with h5py.File(path, "r") as f:
        assert len(f["sample_key"]) == 0
        assert f.attrs["blob_bytes"] == 0
