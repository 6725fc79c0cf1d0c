"""Whether shared memory (/dev/shm) has room for the ring transport, and what to change if not.

The one place that sizes the ring against /dev/shm's free space: :meth:`BatchRing.allocate
<shardio.runtime.transport.BatchRing.allocate>` asks it before allocating, and a
ShardLoader's first iteration says its answer at WARNING level (later ones at debug level:
once per loader, not per epoch). A container's default /dev/shm (64 MiB under docker) is
the usual cause: the ring then falls back to a fresh segment per batch (slower), and where
even that finds no room a batch fails with one StorageError naming /dev/shm.
"""

from __future__ import annotations

import os

from shardio.runtime.batch import SHM_DIR
from shardio.units import format_size

__all__ = ["ring_shortfall", "shm_free_bytes"]


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int | None:
    """Free bytes in ``shm_dir`` (one ``statvfs``); None when it cannot be asked."""
    try:
        stat = os.statvfs(shm_dir)
    except OSError:
        return None  # nothing to check here: torch reports its own failure
    return stat.f_bavail * stat.f_frsize


def ring_shortfall(
    *,
    workers: int,
    slots: int,
    slot_bytes: int,
    shm_dir: str = SHM_DIR,
    free_bytes: int | None = None,
) -> str | None:
    """One line saying that shared memory has no room for a ring of ``workers x slots x
    slot_bytes`` and what to change; None when it has room (or its free size is unknown).

    Args:
        workers, slots, slot_bytes: the ring's shape (:class:`~shardio.runtime.transport.
            BatchRing`).
        shm_dir: where shared memory lives.
        free_bytes: its free bytes; :func:`shm_free_bytes` of ``shm_dir`` by default.
    """
    need = workers * slots * slot_bytes
    free = shm_free_bytes(shm_dir) if free_bytes is None else free_bytes
    if free is None or need <= free:
        return None
    return (
        f"ring transport: {need:,} bytes of shared memory needed ({workers} workers x {slots} "
        f"slots x {format_size(slot_bytes)}), {shm_dir} has {format_size(free)} free: each "
        f"batch takes a fresh segment instead (slower); enlarge {shm_dir} (docker run "
        "--shm-size, a pod's emptyDir with medium Memory) or use fewer workers, a smaller "
        "batch_size or prefetch_factor=2"
    )
