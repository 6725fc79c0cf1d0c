"""The shard a ShardWriter is filling: its samples, index and size, then its staged files.

A tar shard is streamed into the staging folder as samples come; an HDF5 shard is held until
it is full (its size is its memory bound) and then written whole. Either is finished by
:func:`~shardio.packing.write.finish_shard_files`, as ``shardio pack`` finishes its shards.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from shardio.format.index_write import IndexBuilder, MemberEntry
from shardio.format.spec import LABEL_EXT, TAR_BLOCK
from shardio.packing.plan import shard_paths
from shardio.packing.samples import WrittenSample
from shardio.packing.workfiles import ShardRecord, fragment_path
from shardio.packing.write import finish_shard_files
from shardio.writers.hdf5 import HDF5ShardWriter
from shardio.writers.tar import TarShardWriter

__all__ = ["EMPTY_TAR_BYTES", "StagedShard", "tar_cost"]

EMPTY_TAR_BYTES = 2 * TAR_BLOCK  # end-of-archive blocks


def tar_cost(sample: WrittenSample) -> int:
    """The bytes ``sample`` takes in a tar shard (headers and padding included)."""
    return sum(TAR_BLOCK + -(-len(d) // TAR_BLOCK) * TAR_BLOCK for _, d, _ in sample.members)


@dataclass
class StagedShard:
    """The shard being filled, in the staging folder ``staging``."""

    seq: int
    name: str
    staging: str
    shard_format: str
    writer: TarShardWriter | None  # tar: streamed; HDF5: written whole when it is full
    pending: list[WrittenSample] = dataclasses.field(default_factory=list)
    builder: IndexBuilder = dataclasses.field(default_factory=IndexBuilder)
    cost: int = EMPTY_TAR_BYTES
    data_bytes: int = 0
    num_members: int = 0

    @classmethod
    def begin(cls, seq: int, name: str, *, staging: str, shard_format: str, durable: bool
              ) -> StagedShard:  # fmt: skip
        """A new, empty shard ``name`` (a tar one's file is opened now)."""
        writer = None
        if shard_format == "tar":
            writer = TarShardWriter(os.path.join(staging, name + ".tar"), durable=durable)
        return cls(seq, name, staging, shard_format, writer)

    def add(self, sample: WrittenSample) -> None:
        """Add ``sample`` (written now to a tar shard, held for an HDF5 one)."""
        if self.writer is not None:
            placed = self.writer.add_sample(sample.key, sample.label, sample.members)
            self._index(sample, placed)
        else:
            self.pending.append(sample)
        self.data_bytes += sample.data_bytes
        self.num_members += len(sample.members)

    def _index(self, sample: WrittenSample, placed: list[tuple[int, int]]) -> None:
        entries = [
            MemberEntry(
                ext,
                offset,
                size,
                digest,
                b"" if ext == LABEL_EXT else f"{sample.key}.{ext}".encode("ascii"),
            )
            for (ext, _, digest), (offset, size) in zip(sample.members, placed, strict=True)
        ]
        self.builder.add_sample(shard=0, key=sample.key, label=sample.label, members=entries)

    def finish(self, *, dst: str, alignment: int, fingerprint: str, durable: bool) -> ShardRecord:
        """Write the shard's files into the staging folder (an HDF5 one now, whole), its DALI
        index and its index fragment; return its record (not yet written)."""
        rel, dali_rel = shard_paths(self.name, self.shard_format)
        writer: TarShardWriter | HDF5ShardWriter
        if self.writer is not None:
            writer = self.writer
        else:
            writer = HDF5ShardWriter(
                os.path.join(self.staging, self.name + ".h5"),
                capacity_bytes=sum(s.data_bytes for s in self.pending),
                alignment=alignment,
                durable=durable,
            )
        try:
            if isinstance(writer, HDF5ShardWriter):
                for sample in self.pending:
                    placed = writer.add_sample(sample.key, sample.label, sample.members)
                    self._index(sample, placed)
                self.pending.clear()
        except BaseException:
            writer.abort()
            raise
        dali_path = None if dali_rel is None else os.path.join(self.staging, self.name + ".idx")
        return finish_shard_files(
            self,
            writer,
            fingerprint=fingerprint,
            seq=self.seq,
            rel_path=rel,
            dali_rel=dali_rel,
            dali_path=dali_path,
            fragment=fragment_path(dst, self.name),
            durable=durable,
        )
