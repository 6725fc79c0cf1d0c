"""One parity group on disk: write its M parity files, rebuild any M of its K + M files.

A group is up to K data files (a short last group has fewer; the rest count as empty files)
and M parity files. Row ``r`` of the group is the cells at offset ``r * cell_bytes`` of every
file, a file shorter than that offset plus a cell reading as zeros there. Both functions
stream row by row, so memory is ``(K + M) * cell_bytes`` whatever the shard sizes. Every
byte is read through the opener. Every file written goes to a temp name first, and is
published under its final name only once it is complete (a rebuilt file only once its
xxh3-128 matches the one expected).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Mapping, Sequence

import xxhash

from shardio.errors import IntegrityError, UsageError
from shardio.parity.codec import ParityCodec
from shardio.storage.atomic import create_temp, publish, temp_path_for
from shardio.storage.files import refuse_irregular
from shardio.storage.opener import Opener, PosixOpener, open_named, read_fully

__all__ = ["encode_group", "rebuild_group"]


class _Reader:
    """Cells of one file of the group, zeros past ``size`` (None: a file the group lacks)."""

    def __init__(self, opener: Opener, path: str | None, size: int, what: str) -> None:
        self.opener, self.path, self.size, self.fd = opener, path, size, -1
        if path is None:
            return
        self.fd = open_named(opener, path, what=what)
        refuse_irregular(self.fd, path, what=what, close=opener.close)
        actual = opener.size(self.fd)
        if actual != size:
            opener.close(self.fd)
            self.fd = -1
            raise IntegrityError(
                errno.EIO, f"{what} {path} is {actual:,} bytes, expected {size:,}: count it lost"
            )

    def cell(self, offset: int, cell_bytes: int) -> bytes:
        buf = bytearray(cell_bytes)
        want = max(0, min(cell_bytes, self.size - offset))
        if want and self.fd >= 0:
            got = read_fully(self.opener, self.fd, memoryview(buf)[:want], offset)
            if got != want:
                raise IntegrityError(
                    errno.EIO,
                    f"{self.path} ended at {offset + got:,} bytes, expected {self.size:,}",
                )
        return bytes(buf)

    def close(self) -> None:
        if self.fd >= 0:
            self.opener.close(self.fd)
            self.fd = -1


class _Writer:
    """A file written to its temp name, hashed as written, published by :meth:`publish`."""

    def __init__(self, final: str) -> None:
        self.final, self.tmp = final, temp_path_for(final)
        self.fd = create_temp(self.tmp)
        self.hasher = xxhash.xxh3_128()
        self.size = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.hasher.update(data)
        self.size += len(data)

    def publish(self, durable: bool) -> None:
        os.close(self.fd)
        self.fd = -1
        publish(self.tmp, self.final, durable=durable)

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


def _check_group(codec: ParityCodec, data: Sequence[str], sizes: Sequence[int]) -> None:
    if not 1 <= len(data) <= codec.k:
        raise UsageError(f"a group holds 1 to {codec.k} data files, got {len(data)}")
    if len(sizes) != len(data) or any(s < 0 for s in sizes):
        raise UsageError("give one size (>= 0) per data file")


def encode_group(
    data: Sequence[str],
    sizes: Sequence[int],
    parity: Sequence[str],
    codec: ParityCodec,
    *,
    opener: Opener | None = None,
    durable: bool = True,
) -> list[tuple[int, str]]:
    """Write the M parity files of a group of data files; return (size, xxh3-128) of each.

    Args:
        data: the group's data files, in order (at most K).
        sizes: their sizes as recorded (a file of another size is refused).
        parity: the M parity files to write (published atomically; replaced if present).
        codec: the group's code.
        opener: what the data files are read through (default: POSIX calls).
        durable: fsync each parity file before publishing it.

    Raises:
        IntegrityError: a data file is not the size recorded, or ends early while read.
        StorageError: a data file cannot be read, or a parity file cannot be written.
    """
    _check_group(codec, data, sizes)
    if len(parity) != codec.m:
        raise UsageError(f"a group has {codec.m} parity files, got {len(parity)}")
    reader = opener if opener is not None else PosixOpener()
    length = max(sizes)
    readers: list[_Reader] = []
    writers: list[_Writer] = []
    try:
        readers = [_Reader(reader, p, s, "data shard") for p, s in zip(data, sizes, strict=True)]
        readers += [_Reader(reader, None, 0, "") for _ in range(codec.k - len(data))]
        writers = [_Writer(p) for p in parity]
        cell = codec.cell_bytes
        for offset in range(0, length, cell):
            cells = codec.encode([r.cell(offset, cell) for r in readers])
            keep = min(cell, length - offset)
            for writer, parity_cell in zip(writers, cells, strict=True):
                writer.write(parity_cell[:keep])
        for writer in writers:
            writer.publish(durable)
        return [(w.size, w.hasher.hexdigest()) for w in writers]
    except BaseException:
        for writer in writers:
            writer.discard()
        raise
    finally:
        for r in readers:
            r.close()


def rebuild_group(
    data: Sequence[str],
    sizes: Sequence[int],
    parity: Sequence[str],
    codec: ParityCodec,
    lost: Mapping[int, str],
    *,
    opener: Opener | None = None,
    durable: bool = True,
) -> dict[int, str]:
    """Rebuild the files ``lost`` names (index -> the xxh3-128 it must have) from K of the
    others; publish each over its path only when its digest matches.

    Indices ``0 .. len(data) - 1`` are the data files, ``K .. K + M - 1`` the parity files
    (whose size is the longest data file's). Only K surviving files are read: data first, the
    files a short group lacks (zeros) before any real one. A file not in ``lost`` is never
    written, whatever its state.

    Returns:
        {index: the path written}.

    Raises:
        IntegrityError: more than M files lost (the group is beyond repair, and nothing is
            written), a survivor of the wrong size, or a rebuilt file whose digest differs
            (a survivor was damaged too; nothing of that file is published).
        UsageError: an index that is no file of the group.
    """
    _check_group(codec, data, sizes)
    k, m = codec.k, codec.m
    if len(parity) != m:
        raise UsageError(f"a group has {m} parity files, got {len(parity)}")
    real = set(range(len(data))) | set(range(k, k + m))
    bad = sorted(set(lost) - real)
    if bad:
        raise UsageError(f"indices {bad} are no file of this group (data 0-{len(data) - 1}, "
                         f"parity {k}-{k + m - 1})")  # fmt: skip
    if len(lost) > m:
        names = ", ".join(_path(data, parity, k, i) for i in sorted(lost))
        raise IntegrityError(
            errno.EIO, f"{len(lost)} files of one group lost ({names}): beyond what its {m} "
            "parity files can rebuild"
        )  # fmt: skip
    if not lost:
        return {}
    length = max(sizes)
    size_of = {i: sizes[i] for i in range(len(data))} | {k + j: length for j in range(m)}
    absent = list(range(len(data), k))  # the files a short group lacks: free zeros
    survivors = absent + [i for i in sorted(real) if i not in lost]
    chosen = survivors[:k]
    reader = opener if opener is not None else PosixOpener()
    readers: dict[int, _Reader] = {}
    writers: dict[int, _Writer] = {}
    try:
        for i in chosen:
            if i in absent:
                readers[i] = _Reader(reader, None, 0, "")
            else:
                what = "data shard" if i < k else "parity shard"
                readers[i] = _Reader(reader, _path(data, parity, k, i), size_of[i], what)
        writers = {i: _Writer(_path(data, parity, k, i)) for i in sorted(lost)}
        cell = codec.cell_bytes
        for offset in range(0, length, cell):
            row: list[bytes | None] = [None] * (k + m)
            for i, r in readers.items():
                row[i] = r.cell(offset, cell)
            for i, got in codec.rebuild(row, wanted=sorted(lost)).items():
                keep = max(0, min(cell, size_of[i] - offset))
                if keep:
                    writers[i].write(got[:keep])
        for i, writer in writers.items():
            digest = writer.hasher.hexdigest()
            if writer.size != size_of[i] or digest != lost[i]:
                raise IntegrityError(
                    errno.EIO,
                    f"rebuilt {writer.final} does not match its manifest checksum (expected "
                    f"{lost[i]}, got {digest}): another file of its group is damaged too",
                )
        for writer in writers.values():
            writer.publish(durable)
        return {i: w.final for i, w in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    finally:
        for r in readers.values():
            r.close()


def _path(data: Sequence[str], parity: Sequence[str], k: int, index: int) -> str:
    return data[index] if index < k else parity[index - k]
