"""Capacity eviction: make room in a staging area by removing shards not needed now."""

from __future__ import annotations

import os
import stat

from shardio.format.manifest import Manifest
from shardio.staging.copy import READ_NOFOLLOW
from shardio.staging.protocol import drop_staged, try_lock_for_eviction
from shardio.storage.files import unlink_inside

__all__ = ["evict_for"]


def evict_for(
    dest: str, manifest: Manifest, keep: set[str], need_bytes: int, capacity: int
) -> list[str]:
    """Remove staged shards not needed now while DEST would exceed ``capacity`` with the
    ``need_bytes`` of the kept ones; oldest first, skipping any a reader holds open.

    Args:
        dest: the staging area.
        manifest: the source's manifest (what may be staged in ``dest``).
        keep: relative paths of the shards this run stages; never evicted.
        need_bytes: the size of the kept shards.
        capacity: the bytes the area may hold.

    Returns:
        The relative paths of the shards removed.
    """
    staged = []
    for s in manifest.shards:
        if s.path in keep:
            continue
        try:
            st = os.lstat(os.path.join(dest, s.path))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            staged.append((st.st_mtime, s))
    used = sum(s.size_bytes for _, s in staged)  # the kept shards are in need_bytes
    evicted = []
    for _, entry in sorted(staged, key=lambda t: (t[0], t[1].path)):
        if used + need_bytes <= capacity:
            break
        try:
            fd = os.open(os.path.join(dest, entry.path), READ_NOFOLLOW)
        except OSError:
            continue  # gone, or no longer a file staging wrote
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            if not try_lock_for_eviction(fd):  # a reader holds it
                continue
            if not drop_staged(dest, entry.path):
                continue
            if entry.dali_index is not None:
                unlink_inside(dest, entry.dali_index)
        finally:
            os.close(fd)
        used -= entry.size_bytes
        evicted.append(entry.path)
    return evicted
