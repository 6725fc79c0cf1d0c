"""Join the parts of a pack (one per SLURM task, or the single part) into one dataset.

Reads each part's record and per-shard index fragments from the work directory, writes the
global index, the pack report and, last and atomically, the manifest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from shardio._version import __version__
from shardio.errors import FormatError, UsageError
from shardio.format.checksum import file_xxh3_128
from shardio.format.index import Index, merge_indexes, seal_manifest
from shardio.format.manifest import IndexEntry, Manifest, ShardEntry
from shardio.format.spec import (
    INDEX_FILENAME,
    MANIFEST_FILENAME,
    REPORT_FILENAME,
    WORK_DIR,
)
from shardio.storage.atomic import atomic_write, is_temp_name

__all__ = ["MergeResult", "merge_parts", "part_record_name"]

_PART_RE = re.compile(r"^part-(\d{4})-of-(\d{4})\.json$")


def part_record_name(part: int, num_parts: int) -> str:
    """File name of a part's record in the work directory."""
    return f"part-{part:04d}-of-{num_parts:04d}.json"


@dataclass(frozen=True)
class MergeResult:
    """The dataset a merge produced."""

    manifest: Manifest
    num_parts: int


def _load_parts(dst: str) -> list[dict[str, Any]]:
    work = os.path.join(dst, WORK_DIR)
    if not os.path.isdir(work):
        if os.path.exists(os.path.join(dst, MANIFEST_FILENAME)):
            raise UsageError(f"{dst} is already merged")
        raise UsageError(
            f"{dst} holds no packed parts to merge (run shardio pack --part I/N first)"
        )
    found: dict[int, int] = {}
    for name in os.listdir(work):
        m = _PART_RE.match(name)
        if m:
            found[int(m.group(1))] = int(m.group(2))
    if not found:
        raise UsageError(f"{dst} holds no finished parts to merge")
    totals = set(found.values())
    if len(totals) != 1:
        raise UsageError(f"{dst} holds parts of different splits ({sorted(totals)}): repack")
    num_parts = totals.pop()
    missing = sorted(set(range(num_parts)) - set(found))
    if missing:
        shown = ", ".join(str(m) for m in missing[:10])
        raise UsageError(f"{dst}: parts {shown} of {num_parts} have not finished: run them first")
    parts = []
    for i in range(num_parts):
        path = os.path.join(work, part_record_name(i, num_parts))
        with open(path, "rb") as fh:
            parts.append(json.loads(fh.read()))
    first = parts[0]
    for p in parts[1:]:
        for key in ("shard_format", "classes", "label_layout", "options"):
            if p[key] != first[key]:
                raise UsageError(f"{dst}: part {p['part']} was packed with a different {key}")
    return parts


def merge_parts(dst: str, *, durable: bool = True) -> MergeResult:
    """Merge the finished parts in ``dst`` into one dataset and remove the work files.

    Raises:
        UsageError: no parts, parts missing, or parts packed with different options.
    """
    parts = _load_parts(dst)
    for name in os.listdir(dst):
        if is_temp_name(name):  # left by a merge killed mid-write
            os.unlink(os.path.join(dst, name))
    work = os.path.join(dst, WORK_DIR)
    shards: list[ShardEntry] = []
    fragments: list[tuple[Index, int]] = []
    num_members = data_bytes = 0
    try:
        for part in parts:
            for rec in part["shards"]:
                stem = os.path.basename(rec["path"]).rsplit(".", 1)[0]
                frag = Index.open(os.path.join(work, "frag", stem + ".index"))
                if len(frag) != rec["num_samples"]:
                    raise FormatError(f"{dst}: index fragment of {rec['path']} is inconsistent")
                fragments.append((frag, len(shards)))
                shards.append(
                    ShardEntry(
                        path=rec["path"],
                        size_bytes=rec["size_bytes"],
                        num_samples=rec["num_samples"],
                        first_sample=sum(s.num_samples for s in shards),
                        xxh3_128=rec["xxh3_128"],
                        dali_index=rec["dali_index"],
                    )
                )
                num_members += rec["num_members"]
                data_bytes += rec["data_bytes"]
        index_path = os.path.join(dst, INDEX_FILENAME)
        with atomic_write(index_path, durable=durable) as fh:
            num_samples = merge_indexes(fh, fragments, n_shards=len(shards))
    finally:
        for frag, _ in fragments:
            frag.close()
    first = parts[0]
    report = {
        "skipped": [s for p in parts for s in p["skipped"]],
        "oversized": [k for p in parts for k in p["oversized"]],
    }
    with atomic_write(os.path.join(dst, REPORT_FILENAME), durable=durable) as fh:
        fh.write(json.dumps(report, indent=1).encode("ascii"))
    manifest = Manifest(
        shard_format=first["shard_format"],
        num_samples=num_samples,
        num_members=num_members,
        data_bytes=data_bytes,
        index=IndexEntry(
            path=INDEX_FILENAME,
            size_bytes=os.path.getsize(index_path),
            xxh3_128=file_xxh3_128(index_path),
        ),
        shards=tuple(shards),
        classes=tuple(first["classes"]) if first["classes"] is not None else None,
        label_layout=first["label_layout"],
        options=first["options"],
        layout=first["layout"],
        created_by=f"shardio {__version__}",
    )
    manifest = seal_manifest(manifest, index_path)  # per-shard index checksums, checked
    with atomic_write(os.path.join(dst, MANIFEST_FILENAME), durable=durable) as fh:
        fh.write(manifest.dumps())
    shutil.rmtree(work, ignore_errors=True)
    return MergeResult(manifest=manifest, num_parts=len(parts))
