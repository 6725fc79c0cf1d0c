"""Structural checks of index records: every offset, size and count inside its table or shard.

Run on one shard's records at a time (vectorised, a few microseconds per thousand samples), so
a reader checks only what it touches. Comparisons stay in uint64 without additions that could
wrap, so values at or above 2**63 are refused, not overflowed past the bounds.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np

from shardio.errors import FormatError

__all__ = ["IndexTables", "check_records", "parse_exts"]


class IndexTables(Protocol):
    """The tables of an index that its records point into (an ``Index`` has them)."""

    @property
    def samples(self) -> np.ndarray[Any, Any]: ...

    @property
    def members(self) -> np.ndarray[Any, Any]: ...

    @property
    def keys_blob(self) -> Any: ...

    @property
    def paths_blob(self) -> Any: ...

    @property
    def exts(self) -> tuple[str, ...]: ...


# Keys are percent-encoded (shardio.format.keys): these bytes, with "/" between directories.
_KEY_BYTES = np.zeros(256, dtype=bool)
for _b in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-+,=@~%/":
    _KEY_BYTES[_b] = True
_EXT_RE = re.compile(r"[A-Za-z0-9_\-+,=@~%]+")


def parse_exts(data: bytes, path: str) -> tuple[str, ...]:
    """Parse and check the extension table: encoded ASCII names, unique, none reserved.

    Raises:
        FormatError: a name is not what shardio writes, repeats, or starts with "__" (the
            loader's own fields, such as ``__key__``, must not come from a member).
    """
    if not data:
        return ()
    try:
        exts = tuple(data.decode("ascii").split("\n"))
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: index extension table is not ASCII") from exc
    for ext in exts:
        if not _EXT_RE.fullmatch(ext) or ext.startswith("__"):
            raise FormatError(f"{path}: index extension table holds an invalid name {ext!r}")
    if len(set(exts)) != len(exts):
        raise FormatError(f"{path}: index extension table lists a name twice")
    return exts


def _contiguous(starts: np.ndarray, lengths: np.ndarray, limit: int) -> bool:
    """Whether ranges [start, start + length) lie in [0, limit) back to back, in order."""
    if not len(starts):
        return True
    if int(starts.max()) > limit:  # uint64 compare first: no wrap below
        return False
    s = starts.astype(np.int64)
    ends = s + lengths.astype(np.int64)
    return bool(int(ends.max()) <= limit and (s[1:] == ends[:-1]).all())


def check_records(
    index: IndexTables,
    *,
    shard: int,
    first_sample: int,
    num_samples: int,
    shard_bytes: int,
    num_classes: int | None,
) -> str | None:
    """Check one shard's records; return what is wrong, or None.

    Args:
        index: the index holding the records.
        shard: the shard's number (every record must name it).
        first_sample, num_samples: the shard's samples, from the manifest.
        shard_bytes: the shard file's size, from the manifest: every member lies inside it.
        num_classes: classes of a labelled dataset (labels in [0, num_classes)), else None
            (every label is -1).
    """
    recs = index.samples[first_sample : first_sample + num_samples]
    if len(recs) != num_samples:
        return "the manifest's samples run past the sample table"
    if not num_samples:
        return None
    if (recs["shard"] != shard).any():
        return "a sample names another shard"
    if int(recs["n_members"].min()) < 1:
        return "a sample has no members"
    if not _contiguous(recs["first_member"], recs["n_members"], len(index.members)):
        return "a sample's members run past the member table or overlap another's"
    if int(recs["key_length"].min()) < 1:
        return "a sample has an empty key"
    if not _contiguous(recs["key_offset"], recs["key_length"], len(index.keys_blob)):
        return "a key runs past the keys blob or overlaps another"
    labels = recs["label"]
    if num_classes is None:
        if (labels != -1).any():
            return "a sample of an unlabelled dataset has a label"
    elif int(labels.min()) < 0 or int(labels.max()) >= num_classes:
        return f"a label is outside the {num_classes} classes"
    m0 = int(recs["first_member"][0])
    m1 = int(recs["first_member"][-1]) + int(recs["n_members"][-1])
    members = index.members[m0:m1]
    limit = np.uint64(shard_bytes)
    offsets = members["offset"]
    if (offsets > limit).any() or (members["size"] > limit - offsets).any():
        return "a member lies outside its shard file"
    if int(members["ext_id"].max()) >= len(index.exts):
        return "a member refers to an extension that is not in its table"
    if not _contiguous(members["path_offset"], members["path_length"], len(index.paths_blob)):
        return "a path runs past the paths blob or overlaps another"
    k0 = int(recs["key_offset"][0])
    k1 = int(recs["key_offset"][-1]) + int(recs["key_length"][-1])
    key_bytes = np.frombuffer(index.keys_blob[k0:k1], dtype=np.uint8)
    if not _KEY_BYTES[key_bytes].all():
        return "a key holds a byte shardio never writes in keys"
    return None
