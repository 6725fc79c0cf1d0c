"""Plan the shards: cut the scanned samples, in order, into shards of a target size.

The plan is a pure function of the tree (names, kinds and sizes) and the options, so the
same tree packs to byte-identical shards whatever the number of workers. Its fingerprint
is recorded in the work directory and the manifest, so ``--resume`` can tell a changed
source or changed options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from shardio.format.spec import SHARD_DIR, TAR_BLOCK
from shardio.packing.scan import PlannedSample

__all__ = [
    "SHARD_SUFFIX",
    "ShardPlan",
    "plan_fingerprint",
    "plan_shards",
    "shard_name",
    "shard_paths",
]

SHARD_SUFFIX = {"tar": ".tar", "hdf5": ".h5"}


@dataclass(frozen=True)
class ShardPlan:
    """The samples of one shard."""

    seq: int
    name: str
    samples: tuple[PlannedSample, ...]
    planned_bytes: int

    @property
    def num_files(self) -> int:
        """Source files in the shard."""
        return sum(len(s.files) for s in self.samples)


def shard_name(seq: int, *, part: int, num_parts: int) -> str:
    """File stem of a shard: ``shard-000012`` or, for a multi-part pack, ``shard-p0003-000012``."""
    if num_parts == 1:
        return f"shard-{seq:06d}"
    return f"shard-p{part:04d}-{seq:06d}"


def shard_paths(name: str, shard_format: str) -> tuple[str, str | None]:
    """Paths (relative to the dataset) of a shard and of its DALI index (tar only)."""
    shard = f"{SHARD_DIR}/{name}{SHARD_SUFFIX[shard_format]}"
    return shard, (f"{SHARD_DIR}/{name}.idx" if shard_format == "tar" else None)


def _tar_cost(sample: PlannedSample, labelled: bool) -> int:
    cost = sum(TAR_BLOCK + -(-f.size // TAR_BLOCK) * TAR_BLOCK for f in sample.files)
    return cost + (2 * TAR_BLOCK if labelled else 0)


def plan_shards(
    samples: Sequence[PlannedSample],
    *,
    shard_size_bytes: int,
    labelled: bool,
    part: int = 0,
    num_parts: int = 1,
) -> list[ShardPlan]:
    """Cut the samples, in order, into shards of at most ``shard_size_bytes`` each.

    A sample larger than the shard size gets a shard of its own (reported as oversized).
    """
    shards: list[ShardPlan] = []
    current: list[PlannedSample] = []
    size = 2 * TAR_BLOCK  # end-of-archive blocks

    def close() -> None:
        seq = len(shards)
        shards.append(
            ShardPlan(seq, shard_name(seq, part=part, num_parts=num_parts), tuple(current), size)
        )

    for sample in samples:
        cost = _tar_cost(sample, labelled)
        if current and size + cost > shard_size_bytes:
            close()
            current, size = [], 2 * TAR_BLOCK
        current.append(sample)
        size += cost
    if current:
        close()
    return shards


def plan_fingerprint(shards: Sequence[ShardPlan], options: dict[str, object]) -> str:
    """A digest of the plan and options: a resumed pack must see the same one."""
    h = xxhash.xxh3_128()
    h.update(repr(sorted(options.items())).encode())
    for shard in shards:
        h.update(shard.name.encode())
        for sample in shard.samples:
            h.update(b"\0s" + sample.key.encode() + str(sample.label).encode())
            for f in sample.files:
                h.update(b"\0f" + f.rel + b"\0" + f.ext.encode() + b"%d:%d" % (f.size, f.mtime_ns))
    return h.hexdigest()
