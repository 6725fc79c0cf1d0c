"""The read deadline in force: checked, defaulted per filesystem, and the hold after a stall.

:class:`~shardio.read.deadline.DeadlineOpener` enforces a deadline; this module says which
one a dataset gets (a network or parallel filesystem: :data:`DEFAULT_NETWORK_TIMEOUT_S`; a
local disk: none), how long a path stalled under it is held, and whether a reading process
can be killed and replaced when a read stalls.
"""

from __future__ import annotations

import os

from shardio._check import require_seconds
from shardio.storage.fsdetect import FsInfo, describe_fs

__all__ = [
    "DEFAULT_NETWORK_TIMEOUT_S",
    "FUSE_MAGIC",
    "check_read_timeout",
    "default_read_timeout",
    "hold_for",
    "replaceable_readers",
    "resolve_read_timeout",
]

# Above Lustre's default obd_timeout (100 s) and MooseFS's first retries: a read that has not
# answered by then waits for a dead server, not for a busy one.
DEFAULT_NETWORK_TIMEOUT_S = 120.0
FUSE_MAGIC = 0x65735546  # statfs(2) of any FUSE mount


def check_read_timeout(value: object, name: str = "read_timeout_s") -> float | None:
    """A read deadline: None (the default for the filesystem), 0 (no deadline) or seconds up
    to a day (:func:`shardio._check.require_seconds`); returned as a float (None for None)."""
    return None if value is None else require_seconds(value, name)


def default_read_timeout(network: bool) -> float:
    """The deadline applied when none is given: :data:`DEFAULT_NETWORK_TIMEOUT_S` on a network
    or parallel filesystem, none (0) on a local one (a local disk does not stall for minutes,
    and the thread hop would cost every small read from the page cache)."""
    return DEFAULT_NETWORK_TIMEOUT_S if network else 0.0


def hold_for(timeout_s: float) -> float:
    """How long a path is held unavailable after one of its calls stalled: five minutes, or
    twelve deadlines when longer (a dead server rarely returns sooner, and each look at it
    costs a deadline; an epoch over a dead server must not pay it again every minute)."""
    return max(300.0, 12.0 * timeout_s)


def resolve_read_timeout(
    root: str | os.PathLike[str], requested: object, *, fs: FsInfo | None = None
) -> float:
    """The deadline in force for a dataset at ``root``: ``requested`` (checked), or the
    default for its filesystem (:func:`default_read_timeout`; ``fs``: that filesystem, as
    the caller already told it); 0 means none.

    Raises:
        UsageError: ``requested`` is not a valid deadline (:func:`check_read_timeout`).
    """
    seconds = check_read_timeout(requested)
    if seconds is not None:
        return seconds
    try:
        network = (fs if fs is not None else describe_fs(root)).network
    except OSError:  # the dataset's open reports a missing root properly
        network = False
    return default_read_timeout(network)


def replaceable_readers(fs: FsInfo | None) -> bool:
    """Whether a process that reads files of ``fs`` under a deadline can be killed and
    replaced when a read of it stalls (:meth:`DeadlineOpener.watch`), rather than reading
    through the deadline's threads: not on a FUSE mount (MooseFS, a FUSE Ceph or GPFS).

    A process that ends closes its files, and a FUSE client answers the close (a flush) of
    a file only once a pending read of it ends: with its default 30 retries MooseFS answers
    about 2 minutes later, and each such close holds one of the client's threads (libfuse
    has 10) till then. Killing the workers after one stall sent a close per dead file and
    worker; a few such closes stalled the whole mount, healthy files included (measured on
    the bed: every shard held within a minute, the epoch failed).
    """
    if fs is None:
        return True
    return fs.magic != FUSE_MAGIC and not fs.mount_type.startswith("fuse")
