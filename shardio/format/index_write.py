"""Writing the binary per-sample index: build one, write it, merge several, seal a manifest.

The layout (header, five sections aligned to 64 bytes) is :mod:`shardio.format.index`'s;
docs/format.md is the spec. A new manifest is sealed with the written index's digests and
the index is read back in full before anything is published.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from shardio.format.index import HEAD_STRUCT, MEMBER_DTYPE, SAMPLE_DTYPE, SECTION_STRUCT, Index
from shardio.format.manifest import Manifest
from shardio.format.spec import INDEX_HEADER_SIZE, INDEX_MAGIC, INDEX_VERSION, SECTION_ALIGN

__all__ = ["IndexBuilder", "MemberEntry", "merge_indexes", "seal_manifest", "write_index"]


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
    HEAD_STRUCT.pack_into(
        header, 0, INDEX_MAGIC, INDEX_VERSION, 0, len(samples), len(members), n_shards
    )
    for i, (off, length) in enumerate(sections):
        SECTION_STRUCT.pack_into(header, HEAD_STRUCT.size + i * SECTION_STRUCT.size, off, length)
    fh.write(header)
    written = INDEX_HEADER_SIZE
    for (off, length), blob in zip(sections, blobs, strict=True):
        fh.write(b"\0" * (off - written))
        fh.write(blob)
        written = off + length
    fh.write(b"\0" * (-written % SECTION_ALIGN))


def seal_manifest(manifest: Manifest, index_path: str) -> Manifest:
    """Fill a new manifest's index checksums from the written index, then check the index
    against it in full (what is published must open and read back).

    Returns:
        The manifest with ``index.head_xxh3_64`` and every shard's ``index_xxh3_64`` set.
    """
    index = Index.open(index_path)
    try:
        shards = tuple(
            dataclasses.replace(s, index_xxh3_64=index.shard_digest(s.first_sample, s.num_samples))
            for s in manifest.shards
        )
        sealed = dataclasses.replace(
            manifest,
            index=dataclasses.replace(manifest.index, head_xxh3_64=index.head_digest()),
            shards=shards,
        )
        index.bind(sealed)
        index.check_all()
    finally:
        index.close()
    return sealed


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
