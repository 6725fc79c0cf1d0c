#!/usr/bin/env python3
"""Write a synthetic shardio dataset of any size for start-up measurements: a real manifest
and a real index header over sparse, all-zero record tables, and no shard files.

Opening it (``ShardDataset(path)``) and computing a rank's epoch order work exactly as on a
real dataset of that size: the manifest is parsed, the index header checked against it and
its tables mapped; only reading a sample fails (its shard's records are zeros, and the shard
files do not exist). A billion samples in 100,000 shards take a 24 MB manifest and an index
file of about 72 GB that occupies a few kilobytes of disk.

Usage::

    python scripts/gen_synthetic.py OUT --samples 1000000000 --shards 100000
"""

from __future__ import annotations

import argparse
import os
import struct
import sys

import xxhash

from shardio.format.index import MEMBER_DTYPE, SAMPLE_DTYPE
from shardio.format.manifest import IndexEntry, Manifest, ShardEntry
from shardio.format.spec import (
    INDEX_HEADER_SIZE,
    INDEX_MAGIC,
    INDEX_VERSION,
    MANIFEST_FILENAME,
    SECTION_ALIGN,
)

_HEAD = struct.Struct("<8sIIQQQ")
_SECTION = struct.Struct("<QQ")
SHARD_BYTES = 64 << 20  # what each (absent) shard claims to hold


def _aligned(n: int) -> int:
    return -(-n // SECTION_ALIGN) * SECTION_ALIGN


def synthetic_manifest(
    *, samples: int, shards: int, shard_bytes: int, index: IndexEntry | None = None
) -> Manifest:
    """A manifest of ``samples`` spread evenly over ``shards`` of ``shard_bytes`` each (its
    shard files and, without ``index``, its index do not exist)."""
    base, extra = divmod(samples, shards)
    entries = []
    first = 0
    for i in range(shards):
        n = base + (1 if i < extra else 0)
        entries.append(
            ShardEntry(
                path=f"shards/shard-{i:06d}.tar",
                size_bytes=shard_bytes,
                num_samples=n,
                first_sample=first,
                xxh3_128="0" * 32,
                index_xxh3_64="0" * 16,
            )
        )
        first += n
    return Manifest(
        shard_format="tar",
        num_samples=samples,
        num_members=samples,
        data_bytes=shard_bytes * shards,
        index=index or IndexEntry(path="index.bin", size_bytes=0, xxh3_128="0" * 32),
        shards=tuple(entries),
        classes=None,
        label_layout="none",
        created_by="scripts/gen_synthetic.py",
    )


def make_synthetic(out: str, *, samples: int, shards: int) -> str:
    """Write the synthetic dataset at ``out`` (a new directory); return its path."""
    os.makedirs(out)
    exts = b"jpeg"
    lengths = [samples * SAMPLE_DTYPE.itemsize, samples * MEMBER_DTYPE.itemsize, 0, 0, len(exts)]
    header = bytearray(INDEX_HEADER_SIZE)
    _HEAD.pack_into(header, 0, INDEX_MAGIC, INDEX_VERSION, 0, samples, samples, shards)
    pos = INDEX_HEADER_SIZE
    offsets = []
    for i, length in enumerate(lengths):
        _SECTION.pack_into(header, _HEAD.size + i * _SECTION.size, pos, length)
        offsets.append(pos)
        pos += _aligned(length)
    index_path = os.path.join(out, "index.bin")
    with open(index_path, "wb") as fh:
        fh.write(header)
        fh.seek(offsets[-1])
        fh.write(exts)
        fh.truncate(pos)  # the tables stay holes: zeros that take no disk
    head = xxhash.xxh3_64()
    head.update(bytes(header))
    head.update(exts)
    manifest = synthetic_manifest(
        samples=samples,
        shards=shards,
        shard_bytes=SHARD_BYTES,
        index=IndexEntry(
            path="index.bin", size_bytes=pos, xxh3_128="0" * 32, head_xxh3_64=head.hexdigest()
        ),
    )
    with open(os.path.join(out, MANIFEST_FILENAME), "wb") as fh:
        fh.write(manifest.dumps())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--samples", type=int, default=1_000_000_000)
    parser.add_argument("--shards", type=int, default=100_000)
    args = parser.parse_args(argv)
    if args.samples < 1 or not 1 <= args.shards <= args.samples:
        parser.error("need 1 <= --shards <= --samples")
    print(make_synthetic(args.out, samples=args.samples, shards=args.shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
