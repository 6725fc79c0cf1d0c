"""Stamps of verified staged copies: a copy is trusted while its stat matches the stamp.

A stamp records the copy's size, inode, ctime and mtime beside its xxh3-128 once the copy is
verified. Any write to the file changes its ctime, which no user can set back, so a copy
whose stat still matches its stamp needs no re-hashing.
"""

from __future__ import annotations

import contextlib
import json
import os

from shardio.storage.atomic import atomic_write

__all__ = ["STAGE_DIR", "drop_staged", "stamp_matches", "write_stamp"]

STAGE_DIR = ".shardio-stage"


def _stamp_path(dest: str, rel: str) -> str:
    return os.path.join(dest, STAGE_DIR, "ok", rel.replace("/", "__") + ".json")


def _stat_key(path: str) -> dict[str, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return {
        "size": st.st_size,
        "ino": st.st_ino,
        "ctime_ns": st.st_ctime_ns,
        "mtime_ns": st.st_mtime_ns,
    }


def stamp_matches(dest: str, rel: str, xxh3_128: str) -> bool:
    """Whether DEST holds a verified copy of ``rel`` that has not changed since (a write
    changes ctime, which no user can set back)."""
    try:
        with open(_stamp_path(dest, rel), "rb") as fh:
            stamp = json.loads(fh.read())
    except (OSError, ValueError):
        return False
    return bool(
        stamp.get("xxh3_128") == xxh3_128
        and stamp.get("stat") == _stat_key(os.path.join(dest, rel))
    )


def write_stamp(dest: str, rel: str, xxh3_128: str, durable: bool) -> None:
    """Record that the copy of ``rel`` in ``dest`` was verified against ``xxh3_128``."""
    with atomic_write(_stamp_path(dest, rel), durable=durable) as fh:
        fh.write(
            json.dumps({"xxh3_128": xxh3_128, "stat": _stat_key(os.path.join(dest, rel))}).encode(
                "ascii"
            )
        )


def drop_staged(dest: str, rel: str) -> None:
    """Remove a staged copy and its stamp (it failed its checksum, or is evicted)."""
    for path in (_stamp_path(dest, rel), os.path.join(dest, rel)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
