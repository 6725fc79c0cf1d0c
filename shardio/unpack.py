"""Restore the original tree from a dataset, byte for byte (every member verified)."""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

from shardio.errors import FormatError, StorageError, UsageError
from shardio.readers.dataset import PackedDataset

__all__ = ["UnpackResult", "unpack_dataset"]


@dataclass(frozen=True)
class UnpackResult:
    """What an unpack wrote."""

    files: int
    bytes: int
    seconds: float


def _safe_join(out: bytes, rel: bytes) -> bytes:
    parts = rel.split(b"/")
    if not rel or rel.startswith(b"/") or b".." in parts or b"" in parts:
        raise FormatError(f"index holds an unsafe path {os.fsdecode(rel)!r}: refusing to unpack")
    return os.path.join(out, rel)


def unpack_dataset(root: str | os.PathLike[str], out: str | os.PathLike[str]) -> UnpackResult:
    """Write every packed file back under ``out`` at its original relative path.

    Raises:
        UsageError: ``out`` exists and is not empty.
        ChecksumMismatchError: a member is damaged (nothing is written for it).
    """
    start = time.monotonic()
    out_b = os.fsencode(out)
    if os.path.exists(out_b) and (not os.path.isdir(out_b) or os.listdir(out_b)):
        raise UsageError(f"{os.fsdecode(out_b)} exists and is not empty: choose a new directory")
    files = nbytes = 0
    with PackedDataset(root) as ds:
        index = ds.index
        made: set[bytes] = set()
        for sample in range(len(ds)):
            shard = int(index.samples[sample]["shard"])
            for m in index.sample_member_range(sample):
                rel = index.member_path(m)
                if not rel:
                    continue  # a member shardio made (the label)
                dest = _safe_join(out_b, rel)
                data = ds.read_member(m, shard=shard, sample=sample)
                parent = os.path.dirname(dest)
                try:
                    if parent not in made:
                        os.makedirs(parent, exist_ok=True)
                        made.add(parent)
                    tmp = dest + b".shardio-unpack-tmp"
                    with open(tmp, "wb") as fh:
                        fh.write(data)
                    os.replace(tmp, dest)
                except OSError as exc:
                    raise StorageError(
                        exc.errno or errno.EIO,
                        f"cannot write {os.fsdecode(dest)}: {exc.strerror or exc}",
                    ) from exc
                files += 1
                nbytes += len(data)
    return UnpackResult(files, nbytes, time.monotonic() - start)
