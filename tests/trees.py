"""File-tree helpers shared by the test modules (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import pathlib


def write_tree(root: str | os.PathLike[str], files: dict[bytes, bytes]) -> str:
    """Write ``files`` (relative bytes path -> content) under ``root`` (bytes paths, so
    non-UTF-8 names survive); return ``root`` as str."""
    root_b = os.fsencode(root)
    for rel, data in files.items():
        path = os.path.join(root_b, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    return os.fsdecode(root_b)


def read_tree(root: str | os.PathLike[str]) -> dict[bytes, bytes]:
    """Every regular file under ``root`` as relative bytes path -> content."""
    root_b = os.fsencode(root)
    out: dict[bytes, bytes] = {}
    for dirpath, _dirs, names in os.walk(root_b):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root_b)] = fh.read()
    return out


def tree_files(root: pathlib.Path) -> dict[str, bytes]:
    """Regular files under ``root`` (hidden ones included, symlinks not) by relative path,
    with their bytes."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def flip_member(root: pathlib.Path, shard: int) -> str:
    """Flip a byte in the middle of a member of ``shard``; return the sample's key."""
    from shardio.read.reader import ShardReader

    with ShardReader(root) as ds:
        entry = ds.manifest.shards[shard]
        sample = entry.first_sample + entry.num_samples // 2
        member = next(iter(ds.index.sample_member_range(sample)))
        rec = ds.index.members[member]
        where = int(rec["offset"]) + int(rec["size"]) // 2
        key = ds.key(sample)
    with open(root / entry.path, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)
        fh.seek(where)
        fh.write(bytes([byte[0] ^ 0x81]))
    return key
