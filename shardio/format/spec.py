"""Constants of shardio's on-disk format, version 1 (specified in docs/format.md)."""

from __future__ import annotations

from typing import Final

import numpy as np

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HDF5_BLOB",
    "INDEX_FILENAME",
    "INDEX_HEADER_SIZE",
    "INDEX_MAGIC",
    "INDEX_VERSION",
    "LABEL_EXT",
    "MANIFEST_FILENAME",
    "MEMBER_DTYPE",
    "NO_LABEL",
    "REPORT_FILENAME",
    "SAMPLE_DTYPE",
    "SECTION_ALIGN",
    "SHARD_DIR",
    "SHARD_FORMATS",
    "TAR_BLOCK",
    "WORK_DIR",
]

FORMAT_NAME: Final = "shardio"
FORMAT_VERSION: Final = 1

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

# One record per sample, in dataset order (sorted by shard, then position in the shard).
SAMPLE_DTYPE: Final = np.dtype(
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
MEMBER_DTYPE: Final = np.dtype(
    [
        ("offset", "<u8"),
        ("size", "<u8"),
        ("xxh3_64", "<u8"),
        ("path_offset", "<u8"),  # byte range of the original relative path in the paths blob
        ("path_length", "<u4"),  # 0 for members shardio made itself (the label)
        ("ext_id", "<u4"),  # index into the extension table
    ]
)
