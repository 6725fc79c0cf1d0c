"""What a ShardWriter finds in its destination: checked before it writes, its own part removed.

A ShardWriter writes only into a new or empty directory, or beside the other parts of the
same write; an earlier write of its own part is removed only when asked (``overwrite``), and
then only the files that write made.
"""

from __future__ import annotations

import os
import stat

from shardio.errors import FormatError, PackError, UsageError
from shardio.format.spec import WORK_DIR
from shardio.packing.dest import check_owned, inspect_dst, unlink_regular
from shardio.packing.plan import shard_name, shard_paths
from shardio.packing.workfiles import StateRecord, load_record, part_record_name, state_name
from shardio.storage.atomic import is_temp_name

__all__ = ["check_writer_dst", "holds_files", "remove_part"]


def check_writer_dst(dst: str, *, part: int, num_parts: int, fingerprint: str) -> None:
    """Refuse a ``dst`` a ShardWriter of part ``part``/``num_parts`` must not write into.

    Args:
        dst: the destination (locked by the caller).
        part, num_parts: the writer's part.
        fingerprint: the whole write's plan fingerprint (format, shard size, classes).

    Raises:
        UsageError: ``dst`` holds a dataset, an interrupted replacement, foreign files or a
            write split otherwise. FormatError: an interrupted write's files cannot be told.
        PackError: another part was begun with other options.
    """
    state = inspect_dst(dst)
    if state.commit is not None:
        raise UsageError(
            f"{dst} holds a replacement interrupted half-way (a killed pack --force): "
            "finish it with shardio pack --resume, or write into a new directory"
        )
    if state.kind == "dataset":
        raise UsageError(
            f"{dst} already holds a shardio dataset: ShardWriter never replaces one; "
            "write into a new directory"
        )
    if state.kind == "foreign":
        raise UsageError(
            f"{state.why}: ShardWriter writes only into a new or empty directory (or beside "
            "the other parts of one write)"
        )
    if state.damaged:
        raise FormatError(
            f"{state.damaged}: shardio cannot tell which files the interrupted write in "
            f"{dst} made; remove them by hand and write again"
        )
    for other in state.states:
        if other.num_parts != num_parts:
            raise UsageError(
                f"{dst} holds a write or pack split into {other.num_parts} part(s), "
                f"not {num_parts}: write into a new directory"
            )
        if other.part != part and other.plan_fingerprint != fingerprint:
            raise PackError(
                f"part {other.part}/{other.num_parts} in {dst} was begun with other "
                "options (format, shard size, classes) or by a pack: the parts would not "
                "fit together; write every part with the same options"
            )


def remove_part(dst: str, *, staging: str, part: int, num_parts: int, shard_format: str) -> None:
    """Remove what a write of part ``part``/``num_parts`` left in ``dst``: staged shards,
    fragments, published shards, records (only files that write made)."""
    work = os.path.join(dst, WORK_DIR)
    state_path = os.path.join(work, state_name(part, num_parts))
    num_shards = 0
    if os.path.lexists(state_path):
        num_shards = load_record(state_path, StateRecord).num_shards
    stem = shard_name(0, part=part, num_parts=num_parts)[:-6]  # "shard-[pNNNN-]"
    published = []
    for seq in range(num_shards):
        for rel in shard_paths(shard_name(seq, part=part, num_parts=num_parts), shard_format):
            if rel is not None and os.path.lexists(os.path.join(dst, rel)):
                published.append(rel)
    check_owned(dst, published, source=f"the earlier write of part {part}")
    for folder in (staging, os.path.join(work, "frag")):
        for name in _listdir(folder):
            if name.startswith(stem) or is_temp_name(name):
                unlink_regular(os.path.join(folder, name))
    for rel in published:
        unlink_regular(os.path.join(dst, rel))
    unlink_regular(os.path.join(work, part_record_name(part, num_parts)))
    unlink_regular(state_path)


def _listdir(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except FileNotFoundError:
        return []


def holds_files(folder: str) -> bool:
    """Whether a folder holds anything (a symlink or non-directory counts)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{folder} is not a directory: shardio does not write through it")
    return bool(os.listdir(folder))
