"""The read side, torch-free: opener, resolver, member check, recovery, the packed-dataset reader.

Every byte that reaches training passes through these pieces, each in one module:

- the opener (:class:`Opener`, from :mod:`shardio.storage.opener`, where staging's copy
  reaches it too): ``pread`` / copy / map / size / advise of a path, POSIX by default;
  ``deadline`` bounds every call of one in time, ``faults`` injects faults for tests and
  chaos drills;
- ``resolver``: where shard k is read from now (staged copy or source) and the staging-cache
  protocol shared with ``shardio stage`` (stamps, locks, dropping and re-staging a copy);
- ``check``: the one member check (xxh3-64);
- ``packed``: :class:`ShardReader`, which reads members through the three above;
- ``recovery`` and ``journal``: retry, re-stage, rebuild and the raise/skip policy, journaled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardio._lazy import lazy_face

if TYPE_CHECKING:
    from shardio.read.deadline import DeadlineOpener
    from shardio.read.faults import FaultyOpener
    from shardio.storage.opener import Opener, PosixOpener

__all__ = ["DeadlineOpener", "FaultyOpener", "Opener", "PosixOpener"]

__getattr__, __dir__ = lazy_face(
    __name__,
    {
        "DeadlineOpener": "shardio.read.deadline",
        "FaultyOpener": "shardio.read.faults",
        "Opener": "shardio.storage.opener",
        "PosixOpener": "shardio.storage.opener",
    },
)
