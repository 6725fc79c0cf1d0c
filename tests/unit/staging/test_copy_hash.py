"""The verified copy hashes its temp file with reads, never through a mapping."""

from __future__ import annotations

import errno
import os
import pathlib

import pytest
import xxhash

from shardio.errors import IntegrityError
from shardio.metrics.progress import Counters
from shardio.staging import verified


def _source(tmp_path: pathlib.Path, size: int = 3 * (1 << 20) + 17) -> tuple[pathlib.Path, str]:
    src = tmp_path / "shard-000000.tar"
    src.write_bytes(os.urandom(size))
    return src, xxhash.xxh3_128_hexdigest(src.read_bytes())


def test_the_copy_is_hashed_by_reads_and_published(tmp_path: pathlib.Path) -> None:
    src, digest = _source(tmp_path)
    dst = tmp_path / "out.tar"
    got = verified.copy_verified(
        str(src), str(dst), digest, size_bytes=src.stat().st_size, durable=False,
        counters=Counters(),
    )  # fmt: skip
    assert got == src.stat().st_size
    assert dst.read_bytes() == src.read_bytes()
    assert "mmap" not in verified.__dict__  # a dead server's page would be SIGBUS


def test_a_read_error_while_hashing_is_an_error_and_nothing_is_published(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The temp file of a repair lies on the parallel filesystem: its data server may die
    # between the copy and the hash. A read of it then fails with EIO (a mapping: SIGBUS).
    src, digest = _source(tmp_path)
    dst = tmp_path / "out.tar"
    real = os.preadv

    def dying(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset >= 1 << 20:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(verified, "COPY_CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(verified.os, "preadv", dying)
    with pytest.raises(OSError) as info:
        verified.copy_verified(
            str(src), str(dst), digest, size_bytes=src.stat().st_size, durable=False,
            counters=Counters(), action="repairing",
        )  # fmt: skip
    assert info.value.errno == errno.EIO
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir()] == [src.name]  # no temp file left


def test_a_copy_cut_short_before_the_hash_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, digest = _source(tmp_path)
    dst = tmp_path / "out.tar"
    real = os.preadv

    def truncated(fd: int, buffers: list[memoryview], offset: int) -> int:
        return 0 if offset >= 1 << 20 else real(fd, buffers, offset)

    monkeypatch.setattr(verified, "COPY_CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(verified.os, "preadv", truncated)
    with pytest.raises(IntegrityError, match="does not match its manifest checksum"):
        verified.copy_verified(
            str(src), str(dst), digest, size_bytes=src.stat().st_size, durable=False,
            counters=Counters(),
        )  # fmt: skip
    assert not dst.exists()
