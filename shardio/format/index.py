"""The binary per-sample index: its layout, and reading it (memory-mapped, checked).

Layout (little-endian, every section aligned to 64 bytes; docs/format.md is the spec)::

    header (256 bytes): magic "SHRDIDX\\0", version u32, flags u32,
                        n_samples u64, n_members u64, n_shards u64,
                        5 x (offset u64, length u64) for the sections below
    samples  SAMPLE_DTYPE  x n_samples
    members  MEMBER_DTYPE  x n_members
    keys     ASCII sample keys, concatenated
    paths    original relative paths (raw bytes), concatenated
    exts     member extensions, ASCII, joined by b"\\n"

No pickle: numpy views over an mmap, so opening 1.28 M samples costs one open and a few
page faults, and ranks on one node share the pages through the page cache.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from shardio.errors import FormatError, StorageError
from shardio.format.bounds import check_records
from shardio.format.bounds import parse_exts as _parse_exts
from shardio.format.manifest import Manifest, ShardEntry
from shardio.format.spec import (
    INDEX_HEADER_SIZE,
    INDEX_MAGIC,
    INDEX_VERSION,
)
from shardio.storage.files import open_regular

__all__ = [
    "MEMBER_DTYPE",
    "SAMPLE_DTYPE",
    "Index",
    "HEAD_STRUCT",
    "SECTION_STRUCT",
]

# One record per sample, in dataset order (sorted by shard, then position in the shard).
SAMPLE_DTYPE = np.dtype(
    [
        ("shard", "<u4"),  # index into the manifest's shard list
        ("n_members", "<u4"),
        ("first_member", "<u8"),  # index of the sample's first record in the member table
        ("key_offset", "<u8"),  # byte range of the key in the keys blob
        ("key_length", "<u4"),
        ("label", "<i4"),  # class index, or NO_LABEL
    ]
)

# One record per member (tar member / HDF5 blob slice); offsets are absolute in the shard
# file, so a reader pread()s them with no format-specific logic.
MEMBER_DTYPE = np.dtype(
    [
        ("offset", "<u8"),
        ("size", "<u8"),
        ("xxh3_64", "<u8"),
        ("path_offset", "<u8"),  # byte range of the original relative path in the paths blob
        ("path_length", "<u4"),  # 0 for members shardio made itself (the label)
        ("ext_id", "<u4"),  # index into the extension table
    ]
)

HEAD_STRUCT = struct.Struct("<8sIIQQQ")
SECTION_STRUCT = struct.Struct("<QQ")
_SECTION_NAMES = ("samples", "members", "keys", "paths", "exts")


class Index:
    """A read-only, memory-mapped view of an index file.

    Opening checks the header and the extension table only, so it costs O(1) whatever the
    index size. Opened with the dataset's manifest (:meth:`open`), each shard's records are
    checked the first time they are used (:meth:`check_shard`): their xxh3-64 against the
    manifest, and every offset, size and count against the tables and the shard's size, so a
    reader never follows a record that was altered on disk.

    Attributes:
        samples: structured array of SAMPLE_DTYPE records.
        members: structured array of MEMBER_DTYPE records.
        exts: the extension table.
        n_shards: shards the index refers to.
    """

    def __init__(self, buffer: mmap.mmap | bytes, *, path: str = "<memory>") -> None:
        self.path = path
        self._buffer = buffer
        view = memoryview(buffer)
        if len(view) < INDEX_HEADER_SIZE:
            raise FormatError(f"{path}: index is truncated ({len(view)} bytes)")
        magic, version, _flags, n_samples, n_members, n_shards = HEAD_STRUCT.unpack_from(view, 0)
        if magic != INDEX_MAGIC:
            raise FormatError(f"{path}: not a shardio index (bad magic {magic!r})")
        if version != INDEX_VERSION:
            raise FormatError(
                f"{path}: unsupported index version {version} (this shardio reads {INDEX_VERSION})"
            )
        sections = {}
        for i, name in enumerate(_SECTION_NAMES):
            off, length = SECTION_STRUCT.unpack_from(
                view, HEAD_STRUCT.size + i * SECTION_STRUCT.size
            )
            if off < INDEX_HEADER_SIZE or off + length > len(view):  # Python ints: no wrap
                raise FormatError(f"{path}: index section {name!r} runs past the end of the file")
            sections[name] = view[off : off + length]
        if (
            len(sections["samples"]) != n_samples * SAMPLE_DTYPE.itemsize
            or len(sections["members"]) != n_members * MEMBER_DTYPE.itemsize
        ):
            raise FormatError(f"{path}: index tables do not match their record counts")
        self._head = view[:INDEX_HEADER_SIZE]
        self._sections = sections
        self.n_shards = int(n_shards)
        self.samples = np.frombuffer(sections["samples"], dtype=SAMPLE_DTYPE)
        self.members = np.frombuffer(sections["members"], dtype=MEMBER_DTYPE)
        self.keys_blob = sections["keys"]
        self.paths_blob = sections["paths"]
        self.exts = _parse_exts(bytes(sections["exts"]), path)
        self._shards: tuple[ShardEntry, ...] | None = None
        self._first = np.zeros(1, dtype=np.int64)
        self._first_list: list[int] = [0]
        self._checked = bytearray()
        self._unchecked = 0  # shards not checked yet: 0 makes every check a no-op
        self._num_classes: int | None = None

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        manifest: Manifest | None = None,
        in_memory: bool = False,
    ) -> Index:
        """Memory-map an index file (a regular file; a FIFO never blocks), or read it.

        With ``manifest``, the index is bound to that dataset: its size, counts and header
        checksum must match the manifest, and shard records are checked on first use.

        Args:
            path: the index file.
            manifest: the dataset's manifest, to bind the index to.
            in_memory: for an index on a network or parallel filesystem, where a page of a
                mapping that the filesystem cannot serve (a dead data server) raises SIGBUS
                in whatever touches it, while a read fails with an ``OSError`` that can be
                handled. An index of at most :data:`IN_MEMORY_MAX_BYTES` is then read into
                this process's memory; a larger one is still mapped (its pages are shared by
                every process of the node), after one pass of ``pread`` over the whole file
                that brings it into the page cache, so a dead server fails the open with a
                :class:`StorageError` instead of a later access with SIGBUS. (Pages evicted
                under memory pressure and read again later remain exposed.)
        """
        name = os.fspath(path)
        if not os.path.lexists(name):
            raise FormatError(f"{name}: index file is missing")
        fd = open_regular(name, what="index")
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise FormatError(f"{name}: index is empty")
            if manifest is not None and size != manifest.index.size_bytes:
                raise FormatError(
                    f"{name}: index is {size:,} bytes, the manifest says "
                    f"{manifest.index.size_bytes:,}: it was altered or truncated"
                )
            buf: mmap.mmap | bytes
            if in_memory and size <= IN_MEMORY_MAX_BYTES:
                buf = _read_whole(fd, size, name)
            else:
                if in_memory:
                    _read_whole(fd, size, name, keep=False)
                try:
                    buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError) as exc:
                    raise FormatError(f"{name}: cannot map the index ({exc})") from exc
        finally:
            os.close(fd)
        index = cls(buf, path=name)
        if manifest is not None:
            index.bind(manifest)
        return index

    def bind(self, manifest: Manifest) -> None:
        """Bind to the dataset's manifest: check counts and the header (O(1)); shard records
        are checked lazily by :meth:`check_shard`.

        A format-1 manifest has no per-shard digests: the whole index is hashed against the
        manifest here instead (one pass; format-1 datasets are small legacy ones).

        Raises:
            FormatError: the index does not belong to this manifest, or was altered.
        """
        where = self.path
        if len(self.samples) != manifest.num_samples:
            raise FormatError(
                f"{where}: index holds {len(self.samples)} samples, the manifest says "
                f"{manifest.num_samples}"
            )
        if self.n_shards != len(manifest.shards):
            raise FormatError(
                f"{where}: index refers to {self.n_shards} shards, the manifest lists "
                f"{len(manifest.shards)}"
            )
        if manifest.format_version >= 2:
            if len(self.members) != manifest.num_members:
                raise FormatError(
                    f"{where}: index holds {len(self.members)} members, the manifest says "
                    f"{manifest.num_members}"
                )
            actual = self.head_digest()
            if actual != manifest.index.head_xxh3_64:
                raise FormatError(
                    f"{where}: index header or extension table was altered (xxh3 "
                    f"{actual}, the manifest says {manifest.index.head_xxh3_64})"
                )
            if any(s.index_xxh3_64 is None for s in manifest.shards):
                raise FormatError(f"{where}: the manifest lacks per-shard index checksums")
        else:
            actual = xxhash.xxh3_128_hexdigest(self._buffer)
            if actual != manifest.index.xxh3_128:
                raise FormatError(
                    f"{where}: index checksum mismatch (xxh3 {actual}, the manifest says "
                    f"{manifest.index.xxh3_128}): it was altered or damaged"
                )
        self._shards = manifest.shards
        self._first = np.array(
            [s.first_sample for s in manifest.shards] + [manifest.num_samples], dtype=np.int64
        )
        self._first_list = self._first.tolist()
        self._checked = bytearray(len(manifest.shards))
        self._unchecked = len(manifest.shards)
        self._num_classes = len(manifest.classes) if manifest.classes is not None else None

    # -- checksums ---------------------------------------------------------------------------
    def head_digest(self) -> str:
        """xxh3-64 (hex) of the header and the extension table."""
        h = xxhash.xxh3_64()
        h.update(self._head)
        h.update(self._sections["exts"])
        return h.hexdigest()

    def _slices(self, first_sample: int, num_samples: int) -> tuple[memoryview, ...]:
        """The bytes of one shard's records: samples, members, keys, paths (clamped to the
        tables; the structural check then refuses records that point outside them)."""
        size_s, size_m = SAMPLE_DTYPE.itemsize, MEMBER_DTYPE.itemsize
        sec = self._sections
        samples = sec["samples"][first_sample * size_s : (first_sample + num_samples) * size_s]
        if num_samples == 0:
            empty = memoryview(b"")
            return samples, empty, empty, empty
        head = self.samples[first_sample]
        tail = self.samples[first_sample + num_samples - 1]
        m0 = min(int(head["first_member"]), len(self.members))
        m1 = min(int(tail["first_member"]) + int(tail["n_members"]), len(self.members))
        k0 = min(int(head["key_offset"]), len(self.keys_blob))
        k1 = min(int(tail["key_offset"]) + int(tail["key_length"]), len(self.keys_blob))
        members = sec["members"][m0 * size_m : max(m0, m1) * size_m]
        p0 = p1 = 0
        if m1 > m0:
            first_m, last_m = self.members[m0], self.members[m1 - 1]
            p0 = min(int(first_m["path_offset"]), len(self.paths_blob))
            p1 = min(int(last_m["path_offset"]) + int(last_m["path_length"]), len(self.paths_blob))
        return samples, members, self.keys_blob[k0 : max(k0, k1)], self.paths_blob[p0 : max(p0, p1)]

    def shard_digest(self, first_sample: int, num_samples: int) -> str:
        """xxh3-64 (hex) of one shard's records, keys and paths (docs/format.md)."""
        h = xxhash.xxh3_64()
        for part in self._slices(first_sample, num_samples):
            h.update(part)
        return h.hexdigest()

    # -- lazy checks -------------------------------------------------------------------------
    def check_shard(self, shard: int) -> None:
        """Check shard ``shard``'s records once per process: checksum, then bounds.

        Raises:
            FormatError: the records were altered or point outside the tables or the shard.
        """
        if self._shards is None or self._checked[shard]:
            return
        entry = self._shards[shard]
        where = f"{self.path} (records of shard {entry.path})"
        if entry.index_xxh3_64 is not None:
            actual = self.shard_digest(entry.first_sample, entry.num_samples)
            if actual != entry.index_xxh3_64:
                raise FormatError(
                    f"{where}: index checksum mismatch (xxh3 {actual}, the manifest says "
                    f"{entry.index_xxh3_64}): index.bin was altered or damaged"
                )
        problem = check_records(
            self,
            shard=shard,
            first_sample=entry.first_sample,
            num_samples=entry.num_samples,
            shard_bytes=entry.size_bytes,
            num_classes=self._num_classes,
        )
        if problem is not None:
            raise FormatError(f"{where}: corrupt index: {problem}")
        self._checked[shard] = 1
        self._unchecked -= 1

    def check_sample(self, sample: int) -> None:
        """Check the records of the shard holding ``sample`` (a no-op once checked)."""
        if self._unchecked:
            shard = bisect.bisect_right(self._first_list, sample) - 1
            if not self._checked[shard]:
                self.check_shard(shard)

    def check_all(self) -> None:
        """Check every shard's records (what ``verify`` and ``ls --paths`` need)."""
        for shard in range(len(self._checked)):
            self.check_shard(shard)

    def shards_of(self, samples: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The shard of each sample, from the manifest (not from the records)."""
        return np.searchsorted(self._first, samples, side="right") - 1

    def records(self, samples: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The sample records of ``samples``, their shards checked first."""
        idx = np.asarray(samples, dtype=np.int64)
        if self._unchecked and len(idx):
            # A set, not np.unique: that loads numpy.ma on first use (8 ms per process).
            for shard in set(self.shards_of(idx).tolist()):
                if not self._checked[shard]:
                    self.check_shard(shard)
        return self.samples[idx]

    def __len__(self) -> int:
        return len(self.samples)

    def key(self, sample: int) -> str:
        """Return the key of a sample."""
        self.check_sample(sample)
        rec = self.samples[sample]
        off = int(rec["key_offset"])
        return bytes(self.keys_blob[off : off + int(rec["key_length"])]).decode("ascii")

    def keys(self, samples: Sequence[int] | np.ndarray[Any, Any]) -> list[str]:
        """Return the keys of ``samples`` (their records come checked, :meth:`records`)."""
        recs = self.samples[np.asarray(samples, dtype=np.int64)]
        blob = self.keys_blob
        starts = recs["key_offset"].astype(np.int64).tolist()
        ends = (recs["key_offset"].astype(np.int64) + recs["key_length"]).tolist()
        return [bytes(blob[lo:hi]).decode("ascii") for lo, hi in zip(starts, ends, strict=True)]

    def member_path(self, member: int) -> bytes:
        """Return the original relative path of a member (b"" if synthesised).

        The member's sample must have been checked (:meth:`records`, :meth:`key`,
        :meth:`sample_member_range` or :meth:`check_all`).
        """
        rec = self.members[member]
        off = int(rec["path_offset"])
        return bytes(self.paths_blob[off : off + int(rec["path_length"])])

    def sample_member_range(self, sample: int) -> range:
        """Return the member indices of one sample (its shard checked first)."""
        self.check_sample(sample)
        rec = self.samples[sample]
        first = int(rec["first_member"])
        return range(first, first + int(rec["n_members"]))

    def close(self) -> None:
        """Release the mapping (views taken earlier become invalid)."""
        buf = self._buffer
        self.samples = self.members = np.empty(0, dtype=SAMPLE_DTYPE)
        self.keys_blob = self.paths_blob = memoryview(b"")
        self._sections = {}
        self._head = memoryview(b"")
        if isinstance(buf, mmap.mmap):
            # A caller may still hold a view; the mapping then goes when the last view does.
            with contextlib.suppress(BufferError):
                buf.close()


_READ_CHUNK = 8 << 20  # large requests: what a parallel filesystem serves well
IN_MEMORY_MAX_BYTES = 32 << 20
"""The largest index ``Index.open(in_memory=True)`` reads into a process's own memory (every
worker holds its copy: 32 MiB is about 180,000 samples)."""


def _read_whole(fd: int, size: int, name: str, *, keep: bool = True) -> bytes:
    """Read ``size`` bytes of an open index into memory, in large requests.

    With ``keep=False`` the bytes only pass through one reused buffer (into the page cache)
    and ``b""`` is returned.

    Raises:
        StorageError: a read failed (an ``OSError`` from the filesystem, typed).
        FormatError: the file ended early (cut while it was read).
    """
    buf = bytearray(size if keep else min(size, _READ_CHUNK))
    view = memoryview(buf)
    done = 0
    while done < size:
        target = view[done : done + _READ_CHUNK] if keep else view[: min(size - done, _READ_CHUNK)]
        try:
            got = os.preadv(fd, [target], done)
        except OSError as exc:
            raise StorageError(
                exc.errno, f"cannot read index {name}: {exc.strerror or exc}"
            ) from exc
        if got == 0:
            raise FormatError(f"{name}: index is truncated ({done:,} of {size:,} bytes)")
        done += got
    return bytes(buf) if keep else b""
