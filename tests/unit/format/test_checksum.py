"""Tests for member (xxh3-64) and whole-file (xxh3-128) checksums."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import xxhash

from shardio.errors import StorageError
from shardio.format.checksum import file_xxh3_128, hex64, member_xxh3_64, new_file_hasher


def test_member_checksum_is_xxh3_64() -> None:
    data = b"shardio" * 1000
    assert member_xxh3_64(data) == xxhash.xxh3_64_intdigest(data)
    assert member_xxh3_64(memoryview(data)) == member_xxh3_64(bytearray(data))
    assert member_xxh3_64(b"") == xxhash.xxh3_64_intdigest(b"")


def test_hex64_is_16_lower_case_digits() -> None:
    assert hex64(0) == "0" * 16
    assert hex64(0xABC) == "0000000000000abc"
    assert hex64(2**64 - 1) == "f" * 16


# Sizes around the chunk boundaries; one-byte chunks only over small files, to stay fast.
CASES = [(size, chunk) for size in (0, 1, 4095, 4096, 4097) for chunk in (1, 4096, 8 << 20)]
CASES += [(100_000, 4096), (100_000, 8 << 20)]


@pytest.mark.parametrize(("size", "chunk"), CASES)
def test_file_checksum_is_independent_of_chunking(tmp_path: Path, size: int, chunk: int) -> None:
    data = bytes((i * 131 + 7) % 251 for i in range(size))
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    expected = xxhash.xxh3_128_hexdigest(data)
    assert file_xxh3_128(path, chunk_bytes=chunk) == expected
    assert len(expected) == 32
    hasher = new_file_hasher()
    hasher.update(data)
    assert hasher.hexdigest() == expected


def test_file_checksum_of_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as info:
        file_xxh3_128(tmp_path / "nope")
    assert info.value.errno == errno.ENOENT
    assert "nope" in str(info.value)
