"""Constants of shardio's on-disk format (specified in docs/format.md)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "CLASSES_SHOWN",
    "MAX_MANIFEST_BYTES",
    "MANIFEST_CHECKSUM_FIELD",
    "LABEL_LAYOUTS",
    "HDF5_SHARD_VERSION",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HDF5_BLOB",
    "INDEX_FILENAME",
    "INDEX_HEADER_SIZE",
    "INDEX_MAGIC",
    "INDEX_VERSION",
    "LABEL_EXT",
    "MANIFEST_FILENAME",
    "NO_LABEL",
    "REPORT_FILENAME",
    "SECTION_ALIGN",
    "SHARD_DIR",
    "SHARD_FORMATS",
    "TAR_BLOCK",
    "WORK_DIR",
]

FORMAT_NAME: Final = "shardio"
FORMAT_VERSION: Final = 3
# The HDF5 shard attribute ``shardio_format_version``: shard bytes did not change in formats 2
# and 3.
HDF5_SHARD_VERSION: Final = 1
# Format 2 on: the manifest's last field is the xxh3-128 of the document (this value zeroed).
MANIFEST_CHECKSUM_FIELD: Final = "manifest_xxh3_128"
# A manifest lists about 300 bytes per shard: 512 MiB is over a million shards.
MAX_MANIFEST_BYTES: Final = 512 * 1024 * 1024
# "writer": the labels a ShardWriter was given (its ``cls`` members), not derived from a tree.
LABEL_LAYOUTS: Final = ("none", "class-dirs", "split-class-dirs", "writer")

MANIFEST_FILENAME: Final = "manifest.json"
INDEX_FILENAME: Final = "index.bin"
REPORT_FILENAME: Final = "pack-report.json"
SHARD_DIR: Final = "shards"
# Work files of an unfinished pack (per-shard index fragments, part records). Removed by
# the final merge; its presence never makes a dataset look complete.
WORK_DIR: Final = ".shardio-work"

SHARD_FORMATS: Final = ("tar", "hdf5")
TAR_BLOCK: Final = 512
LABEL_EXT: Final = "cls"
NO_LABEL: Final = -1

# HDF5 shards: dataset names inside each file.
HDF5_BLOB: Final = "data"

INDEX_MAGIC: Final = b"SHRDIDX\x00"
INDEX_VERSION: Final = 1
INDEX_HEADER_SIZE: Final = 256
SECTION_ALIGN: Final = 64

# Classes named (with their index) where a label map is shown: the pack summary, inspect.
CLASSES_SHOWN: Final = 5
