"""resident(): whether a range of an open file is in the page cache, told without a read."""

from __future__ import annotations

import os
import pathlib

import pytest

from shardio.storage.residency import resident


@pytest.fixture
def cached(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(os.urandom(256 * 1024))
    path.read_bytes()
    return path


def test_a_file_just_read_is_resident_and_one_dropped_is_not(cached: pathlib.Path) -> None:
    fd = os.open(cached, os.O_RDONLY)
    try:
        assert resident(fd, 0, 256 * 1024)
        assert resident(fd, 5000, 100)  # an offset inside a page: that page is asked
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if resident(fd, 0, 4096):
            pytest.skip("this filesystem keeps the file in memory (tmpfs)")
        assert not resident(fd, 0, 256 * 1024)
        os.pread(fd, 4096, 0)  # one page back: the range as a whole is not
        assert resident(fd, 0, 4096)
        assert not resident(fd, 0, 64 * 1024 + 1)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("offset", "length"),
    [(256 * 1024, 10), (300 * 1024, 4096), (0, 0), (-4096, 10), (0, -1), (1 << 62, 10)],
)
def test_ranges_it_cannot_vouch_for_are_not_resident(
    cached: pathlib.Path, offset: int, length: int
) -> None:
    fd = os.open(cached, os.O_RDONLY)
    try:
        assert not resident(fd, offset, length)
    finally:
        os.close(fd)


def test_a_descriptor_that_cannot_be_mapped_is_not_resident(tmp_path: pathlib.Path) -> None:
    read_end, write_end = os.pipe()  # a FIFO: no pages to ask about
    try:
        assert not resident(read_end, 0, 4096)
        assert not resident(12345, 0, 4096)  # not open
    finally:
        os.close(read_end)
        os.close(write_end)
