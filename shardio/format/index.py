"""The binary per-sample index: build it, memory-map it, merge per-shard fragments.

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

import contextlib
import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from shardio.errors import FormatError
from shardio.format.spec import (
    INDEX_HEADER_SIZE,
    INDEX_MAGIC,
    INDEX_VERSION,
    SECTION_ALIGN,
)

__all__ = [
    "MEMBER_DTYPE",
    "SAMPLE_DTYPE",
    "Index",
    "IndexBuilder",
    "MemberEntry",
    "merge_indexes",
    "write_index",
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

_HEAD = struct.Struct("<8sIIQQQ")
_SECTION = struct.Struct("<QQ")
_SECTION_NAMES = ("samples", "members", "keys", "paths", "exts")
# Indexes up to this many samples get their record bounds checked on open.
_FULL_CHECK_LIMIT = 50_000_000


@dataclass(frozen=True, slots=True)
class MemberEntry:
    """One member of a sample as the writer records it."""

    ext: str
    offset: int
    size: int
    xxh3_64: int
    path: bytes  # original relative path; b"" for members shardio synthesised


@dataclass
class IndexBuilder:
    """Accumulates the records of one shard (or a few) and serialises them."""

    n_shards: int = 1
    _samples: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    _members: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    _keys: bytearray = field(default_factory=bytearray)
    _paths: bytearray = field(default_factory=bytearray)
    _ext_ids: dict[str, int] = field(default_factory=dict)

    def add_sample(
        self, *, shard: int, key: str, label: int, members: Sequence[MemberEntry]
    ) -> None:
        """Append one sample and its members."""
        key_bytes = key.encode("ascii")
        self._samples.append(
            (shard, len(members), len(self._members), len(self._keys), len(key_bytes), label)
        )
        self._keys += key_bytes
        for m in members:
            ext_id = self._ext_ids.setdefault(m.ext, len(self._ext_ids))
            self._members.append(
                (m.offset, m.size, m.xxh3_64, len(self._paths), len(m.path), ext_id)
            )
            self._paths += m.path

    @property
    def num_samples(self) -> int:
        """Samples added so far."""
        return len(self._samples)

    def write(self, fh: IO[bytes]) -> None:
        """Serialise the index into an open binary file."""
        samples = np.array(self._samples, dtype=SAMPLE_DTYPE)
        members = np.array(self._members, dtype=MEMBER_DTYPE)
        exts = sorted(self._ext_ids, key=self._ext_ids.__getitem__)
        write_index(
            fh,
            samples=samples,
            members=members,
            keys=bytes(self._keys),
            paths=bytes(self._paths),
            exts=exts,
            n_shards=self.n_shards,
        )


def write_index(
    fh: IO[bytes],
    *,
    samples: np.ndarray[Any, Any],
    members: np.ndarray[Any, Any],
    keys: bytes | bytearray | memoryview,
    paths: bytes | bytearray | memoryview,
    exts: Sequence[str],
    n_shards: int,
) -> None:
    """Write a complete index from its tables."""
    blobs: list[bytes | bytearray | memoryview] = [
        np.ascontiguousarray(samples, dtype=SAMPLE_DTYPE).tobytes(),
        np.ascontiguousarray(members, dtype=MEMBER_DTYPE).tobytes(),
        keys,
        paths,
        "\n".join(exts).encode("ascii"),
    ]
    sections = []
    pos = INDEX_HEADER_SIZE
    for blob in blobs:
        sections.append((pos, len(blob)))
        pos += -(-len(blob) // SECTION_ALIGN) * SECTION_ALIGN
    header = bytearray(INDEX_HEADER_SIZE)
    _HEAD.pack_into(header, 0, INDEX_MAGIC, INDEX_VERSION, 0, len(samples), len(members), n_shards)
    for i, (off, length) in enumerate(sections):
        _SECTION.pack_into(header, _HEAD.size + i * _SECTION.size, off, length)
    fh.write(header)
    written = INDEX_HEADER_SIZE
    for (off, length), blob in zip(sections, blobs, strict=True):
        fh.write(b"\0" * (off - written))
        fh.write(blob)
        written = off + length
    fh.write(b"\0" * (-written % SECTION_ALIGN))


class Index:
    """A read-only, memory-mapped view of an index file.

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
        magic, version, _flags, n_samples, n_members, n_shards = _HEAD.unpack_from(view, 0)
        if magic != INDEX_MAGIC:
            raise FormatError(f"{path}: not a shardio index (bad magic {magic!r})")
        if version != INDEX_VERSION:
            raise FormatError(
                f"{path}: unsupported index version {version} (this shardio reads {INDEX_VERSION})"
            )
        sections = {}
        for i, name in enumerate(_SECTION_NAMES):
            off, length = _SECTION.unpack_from(view, _HEAD.size + i * _SECTION.size)
            if off + length > len(view):
                raise FormatError(f"{path}: index section {name!r} runs past the end of the file")
            sections[name] = view[off : off + length]
        if (
            len(sections["samples"]) != n_samples * SAMPLE_DTYPE.itemsize
            or len(sections["members"]) != n_members * MEMBER_DTYPE.itemsize
        ):
            raise FormatError(f"{path}: index tables do not match their record counts")
        self.n_shards = int(n_shards)
        self.samples = np.frombuffer(sections["samples"], dtype=SAMPLE_DTYPE)
        self.members = np.frombuffer(sections["members"], dtype=MEMBER_DTYPE)
        self.keys_blob = sections["keys"]
        self.paths_blob = sections["paths"]
        ext_bytes = bytes(sections["exts"])
        try:
            self.exts: tuple[str, ...] = (
                tuple(ext_bytes.decode("ascii").split("\n")) if ext_bytes else ()
            )
        except UnicodeDecodeError as exc:
            raise FormatError(f"{path}: index extension table is not ASCII") from exc
        if n_samples <= _FULL_CHECK_LIMIT:
            self._check_bounds(path)

    def _check_bounds(self, path: str) -> None:
        """Check that every record points inside its tables (vectorised; a few ms per
        million samples, skipped for huge indexes, where ``shardio verify`` does it)."""
        s, m = self.samples, self.members
        problems = []
        if len(s):
            if int((s["first_member"] + s["n_members"]).max()) > len(m):
                problems.append("a sample's members run past the member table")
            if int((s["key_offset"] + s["key_length"]).max()) > len(self.keys_blob):
                problems.append("a key runs past the keys blob")
            if int(s["shard"].max()) >= self.n_shards:
                problems.append("a sample refers to a shard beyond n_shards")
        if len(m):
            if int((m["path_offset"] + m["path_length"]).max()) > len(self.paths_blob):
                problems.append("a path runs past the paths blob")
            if int(m["ext_id"].max()) >= len(self.exts):
                problems.append("a member refers to an extension that is not in its table")
        if problems:
            raise FormatError(f"{path}: corrupt index: {problems[0]}")

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Index:
        """Memory-map an index file."""
        name = os.fspath(path)
        try:
            with open(name, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    raise FormatError(f"{name}: index is empty")
                buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError as exc:
            raise FormatError(f"{name}: index file is missing") from exc
        return cls(buf, path=name)

    def __len__(self) -> int:
        return len(self.samples)

    def key(self, sample: int) -> str:
        """Return the key of a sample."""
        rec = self.samples[sample]
        off = int(rec["key_offset"])
        return bytes(self.keys_blob[off : off + int(rec["key_length"])]).decode("ascii")

    def member_path(self, member: int) -> bytes:
        """Return the original relative path of a member (b"" if synthesised)."""
        rec = self.members[member]
        off = int(rec["path_offset"])
        return bytes(self.paths_blob[off : off + int(rec["path_length"])])

    def sample_member_range(self, sample: int) -> range:
        """Return the member indices of one sample."""
        rec = self.samples[sample]
        first = int(rec["first_member"])
        return range(first, first + int(rec["n_members"]))

    def close(self) -> None:
        """Release the mapping (views taken earlier become invalid)."""
        buf = self._buffer
        self.samples = self.members = np.empty(0, dtype=SAMPLE_DTYPE)
        self.keys_blob = self.paths_blob = memoryview(b"")
        if isinstance(buf, mmap.mmap):
            # A caller may still hold a view; the mapping then goes when the last view does.
            with contextlib.suppress(BufferError):
                buf.close()


def merge_indexes(fh: IO[bytes], parts: Iterable[tuple[Index, int]], *, n_shards: int) -> int:
    """Write one index joining several, each shifted to its first shard number.

    Args:
        fh: destination file.
        parts: (index, shard_base) pairs, in dataset order.
        n_shards: shard count of the merged dataset.

    Returns:
        The number of samples written.
    """
    samples_parts = []
    members_parts = []
    keys = bytearray()
    paths = bytearray()
    ext_ids: dict[str, int] = {}
    n_members = 0
    for index, shard_base in parts:
        remap = np.array([ext_ids.setdefault(e, len(ext_ids)) for e in index.exts], dtype="<u4")
        s = index.samples.copy()
        s["shard"] += shard_base
        s["first_member"] += n_members
        s["key_offset"] += len(keys)
        m = index.members.copy()
        m["path_offset"] += len(paths)
        if len(m):
            m["ext_id"] = remap[m["ext_id"]]
        samples_parts.append(s)
        members_parts.append(m)
        keys += index.keys_blob
        paths += index.paths_blob
        n_members += len(m)
    samples = np.concatenate(samples_parts) if samples_parts else np.empty(0, SAMPLE_DTYPE)
    members = np.concatenate(members_parts) if members_parts else np.empty(0, MEMBER_DTYPE)
    exts = sorted(ext_ids, key=ext_ids.__getitem__)
    write_index(
        fh, samples=samples, members=members, keys=keys, paths=paths, exts=exts, n_shards=n_shards
    )
    return len(samples)
