"""HDF5 shards: one contiguous uint8 blob plus key/offset/size/checksum tables.

Readable with plain h5py (``f["data"][off:off + size]``); shardio itself reads the blob with
``pread`` at its file offset, so readers never serialise on h5py's global lock. The blob is
allocated up front and filled with ``pwrite``; the tables are added after it.

Datasets in each file::

    data                 uint8[blob_bytes]    contiguous, aligned to the stripe size
    sample_key           str[n_samples]       WebDataset key of each sample
    sample_label         int32[n_samples]     class index or -1
    sample_first_member  uint64[n_samples]
    sample_num_members   uint32[n_samples]
    member_ext           str[n_members]
    member_offset        uint64[n_members]    relative to the start of ``data``
    member_size          uint64[n_members]
    member_xxh3_64       uint64[n_members]
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence

import numpy as np

from shardio.format.checksum import file_xxh3_128
from shardio.format.spec import HDF5_BLOB, HDF5_SHARD_VERSION
from shardio.storage.atomic import create_temp, publish, storage_error, temp_path_for
from shardio.writers.base import (
    STREAM_CHUNK_BYTES,
    ReadInto,
    SourceChangedError,
    copy_stream,
    write_sample,
)

__all__ = ["DEFAULT_HDF5_ALIGNMENT", "HDF5ShardWriter"]

DEFAULT_HDF5_ALIGNMENT = 4096


class HDF5ShardWriter:
    """Writes one HDF5 shard.

    Args:
        path: final path of the shard.
        capacity_bytes: size of the blob (the planned member bytes).
        alignment: file alignment of the blob; the stripe size on a parallel filesystem.
        durable: fsync before publishing.
    """

    suffix = ".h5"

    def __init__(
        self,
        path: str,
        *,
        capacity_bytes: int,
        alignment: int = DEFAULT_HDF5_ALIGNMENT,
        durable: bool = True,
    ) -> None:
        import h5py  # deferred: tar-only packs never load HDF5

        self.path = path
        self._tmp = temp_path_for(path)
        self._durable = durable
        self._capacity = max(capacity_bytes, 1)
        self._used = 0
        self._finished: tuple[int, str] | None = None  # what finish() returned
        self._keys: list[str] = []
        self._labels: list[int] = []
        self._first: list[int] = []
        self._count: list[int] = []
        self._exts: list[str] = []
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self._hashes: list[int] = []
        self._sample: tuple[str, int, int] = ("", 0, 0)
        self._buffer: bytearray | None = None
        try:
            os.close(create_temp(self._tmp))  # never through a symlink; h5py truncates it
            with h5py.File(
                self._tmp,
                "w",
                libver="earliest",
                alignment_threshold=min(self._capacity, 65536),
                alignment_interval=alignment,
            ) as f:
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                dcpl.set_obj_track_times(False)
                dsid = h5py.h5d.create(
                    f.id,
                    HDF5_BLOB.encode(),
                    h5py.h5t.py_create(np.dtype("uint8")),
                    h5py.h5s.create_simple((self._capacity,)),
                    dcpl=dcpl,
                )
                self._blob_offset = int(dsid.get_offset())
            self._fd = os.open(self._tmp, os.O_WRONLY)
        except OSError as exc:
            self._remove_tmp()
            raise storage_error(exc, path, "creating") from exc

    def begin_sample(self, key: str, label: int) -> None:
        """Start a sample."""
        self._sample = (key, label, len(self._offsets))

    def _reserve(self, size: int) -> int:
        """Check that ``size`` more bytes fit the blob; return their file offset."""
        if self._used + size > self._capacity:
            raise storage_error(
                OSError(errno.EFBIG, "member larger than planned"), self.path, "writing"
            )
        return self._blob_offset + self._used

    def _pwrite_all(self, data: bytes | memoryview, pos: int) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.pwrite(self._fd, view, pos)
                view, pos = view[written:], pos + written
        except OSError as exc:
            raise storage_error(exc, self.path, "writing") from exc

    def _record(self, ext: str, size: int, digest: int) -> tuple[int, int]:
        placed = (self._blob_offset + self._used, size)
        self._exts.append(ext)
        self._offsets.append(self._used)
        self._sizes.append(size)
        self._hashes.append(digest)
        self._used += size
        return placed

    def add_member(self, ext: str, data: bytes, digest: int) -> tuple[int, int]:
        """Write a member held in memory into the blob; return (file offset, size)."""
        self._pwrite_all(data, self._reserve(len(data)))
        return self._record(ext, len(data), digest)

    def add_stream(self, ext: str, size: int, readinto: ReadInto) -> tuple[int, int, int]:
        """Copy a member of ``size`` bytes into the blob in chunks with ``pwrite``.

        Raises:
            SourceChangedError: the source did not give exactly ``size`` bytes; the blob does
                not advance (the bytes written are zeroed, so no stray data stays behind).
        """
        start = self._reserve(size)
        if self._buffer is None:
            self._buffer = bytearray(STREAM_CHUNK_BYTES)
        written = 0

        def write(chunk: memoryview) -> None:
            nonlocal written
            self._pwrite_all(chunk, start + written)
            written += len(chunk)

        try:
            digest = copy_stream(size, readinto, self._buffer, write)
        except SourceChangedError:
            zeros = bytes(min(written, STREAM_CHUNK_BYTES))
            for pos in range(0, written, STREAM_CHUNK_BYTES):
                self._pwrite_all(zeros[: min(STREAM_CHUNK_BYTES, written - pos)], start + pos)
            raise
        offset, _ = self._record(ext, size, digest)
        return offset, size, digest

    def end_sample(self) -> int:
        """Close the sample; it is recorded only if it got a member."""
        key, label, first = self._sample
        count = len(self._offsets) - first
        if count:
            self._keys.append(key)
            self._labels.append(label)
            self._first.append(first)
            self._count.append(count)
        return count

    def add_sample(
        self, key: str, label: int, members: Sequence[tuple[str, bytes, int]]
    ) -> list[tuple[int, int]]:
        """Append one sample's members ``(ext, data, xxh3_64)``; return ``(offset, size)``.

        Offsets are absolute in the file (blob offset added), ready for ``pread``.
        """
        return write_sample(self, key, label, members)

    def finish(self) -> tuple[int, str]:
        """Write the tables, fsync and publish; return (size, xxh3_128).

        Again: the same result, nothing written (idempotent).
        """
        if self._finished is not None:
            return self._finished
        import h5py

        try:
            os.close(self._fd)
            self._fd = -1
            text = h5py.string_dtype("ascii")
            with h5py.File(self._tmp, "r+") as f:
                tables = {
                    "sample_key": (np.array(self._keys, dtype=object), text),
                    "sample_label": (np.array(self._labels, dtype="<i4"), None),
                    "sample_first_member": (np.array(self._first, dtype="<u8"), None),
                    "sample_num_members": (np.array(self._count, dtype="<u4"), None),
                    "member_ext": (np.array(self._exts, dtype=object), text),
                    "member_offset": (np.array(self._offsets, dtype="<u8"), None),
                    "member_size": (np.array(self._sizes, dtype="<u8"), None),
                    "member_xxh3_64": (np.array(self._hashes, dtype="<u8"), None),
                }
                for name, (values, dtype) in tables.items():
                    f.create_dataset(name, data=values, dtype=dtype, track_times=False)
                f.attrs["shardio_format_version"] = HDF5_SHARD_VERSION
                f.attrs["blob_bytes"] = self._used
            size = os.path.getsize(self._tmp)
            digest = file_xxh3_128(self._tmp)
            publish(self._tmp, self.path, durable=self._durable)
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.path, "writing") from exc
        self._finished = (size, digest)
        return self._finished

    def _remove_tmp(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

    def abort(self) -> None:
        """Close and remove the temp file."""
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1
        self._remove_tmp()
