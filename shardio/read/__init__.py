"""The read side, torch-free: opener, resolver, member check, recovery, the packed-dataset reader.

Every byte that reaches training passes through these pieces, each in one module:

- ``opener``: ``pread`` / map / size / advise of a path (POSIX by default; ``faults`` holds a
  fault-injecting one for tests and chaos drills);
- ``resolver``: where shard k is read from now (staged copy or source) and the staging-cache
  protocol shared with ``shardio stage`` (stamps, locks, dropping and re-staging a copy);
- ``check``: the one member check (xxh3-64);
- ``packed``: :class:`PackedDataset`, which reads members through the three above;
- ``recovery`` and ``journal``: retry, re-stage, rebuild and the raise/skip policy, journaled.
"""

from __future__ import annotations
