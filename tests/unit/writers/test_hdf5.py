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


# --- streamed members ------------------------------------------------------------------


def _source(data: bytes, *, fail_after: int | None = None):
    pos = [0]

    def readinto(view: memoryview) -> int:
        if fail_after is not None and pos[0] >= fail_after:
            raise OSError(5, "Input/output error")
        n = min(len(view), 4000, len(data) - pos[0])
        view[:n] = data[pos[0] : pos[0] + n]
        pos[0] += n
        return n

    return readinto


def test_streamed_member_reads_back(tmp_path: Path) -> None:
    payload = os.urandom(50_000)
    path = tmp_path / "shard.h5"
    writer = HDF5ShardWriter(str(path), capacity_bytes=len(payload) + 3, durable=False)
    writer.begin_sample("k", 1)
    offset, size, digest = writer.add_stream("bin", len(payload), _source(payload))
    writer.add_member("cls", b"1", member_xxh3_64(b"1"))
    assert writer.end_sample() == 2
    writer.finish()
    assert (size, digest) == (len(payload), member_xxh3_64(payload))
    with open(path, "rb") as fh:
        assert os.pread(fh.fileno(), size, offset) == payload
    with h5py.File(path, "r") as f:
        assert f.attrs["blob_bytes"] == len(payload) + 1
        assert f["member_xxh3_64"][:].tolist() == [digest, member_xxh3_64(b"1")]


@pytest.mark.parametrize("case", ["shorter", "longer", "eio"])
def test_a_changed_stream_does_not_advance_the_blob(tmp_path: Path, case: str) -> None:
    from shardio.writers.base import SourceChangedError

    payload = os.urandom(50_000)
    source = {
        "shorter": _source(payload[:-7]),
        "longer": _source(payload + b"x"),
        "eio": _source(payload, fail_after=20_000),
    }[case]
    path = tmp_path / "shard.h5"
    writer = HDF5ShardWriter(str(path), capacity_bytes=len(payload) + 10, durable=False)
    writer.begin_sample("a", 0)
    with pytest.raises(SourceChangedError):
        writer.add_stream("bin", len(payload), source)
    assert writer.end_sample() == 0  # a sample without members is not recorded
    writer.add_sample("b", 0, _members(("txt", b"after")))
    writer.finish()
    with h5py.File(path, "r") as f:
        assert [k.decode() for k in f["sample_key"][:]] == ["b"]
        assert f["member_offset"][:].tolist() == [0]  # "after" took the rolled-back space
        assert f.attrs["blob_bytes"] == 5
        blob = f["data"][:]
        assert bytes(blob[:5]) == b"after"
        assert not blob[5:].any()  # no stray bytes of the failed member stay behind


def test_finish_twice_returns_the_same_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shard.h5"
    writer = HDF5ShardWriter(str(path), capacity_bytes=1 << 16, durable=False)
    for key, label, members in SAMPLES:
        writer.add_sample(key, label, members)
    first = writer.finish()
    data = path.read_bytes()
    assert writer.finish() == first  # not EBADF from closing the file again
    assert path.read_bytes() == data and first == (len(data), file_xxh3_128(str(path)))
    writer.abort()  # after finish: the published shard stays
    assert path.read_bytes() == data
