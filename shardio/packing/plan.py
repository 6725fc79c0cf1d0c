"""Plan the shards: cut the scanned samples, in order, into shards of a target size.

The plan is a pure function of the tree (names, kinds and sizes) and the options, so the
same tree packs to byte-identical shards whatever the number of workers. Two fingerprints
are recorded in the work directory: a part's (its shards, with every file's size and
mtime; also in the manifest), so ``--resume`` can tell a changed source or changed
options, and the whole pack's (:func:`listing_fingerprint`: the listing every part
computes alike, the label map and the options that shape the shards), so parts packed
from different states of the tree are never merged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from shardio.format.spec import SHARD_DIR, TAR_BLOCK
from shardio.packing.scan import Listing, PlannedSample

__all__ = [
    "SHARD_SUFFIX",
    "ShardPlan",
    "listing_fingerprint",
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


def listing_fingerprint(listing: Listing, options: dict[str, object]) -> str:
    """A digest of what every part of a pack must agree on: the tree's listing (every
    sample group: directory, stem, entry names and kinds; the files left out), the label
    map (layout, classes in index order, the identity of a pinned map's source) and
    ``options`` (those that shape the shards and the split)."""
    h = xxhash.xxh3_128()
    h.update(ascii(sorted(options.items())).encode())
    source = listing.label_source.identity if listing.label_source is not None else None
    h.update(ascii((listing.label_layout, listing.classes, source)).encode())
    # A group is "DIR\0STEM\0" then "NAME\0K" per entry (K: one byte, the kind), then
    # "\0". Names hold no NUL and are never empty, so the bytes parse back one way only: no
    # two listings hash the same bytes. One join keeps 1 M samples near a second.
    code = _KIND_CODE
    h.update(b"%d groups, %d excluded\0" % (len(listing.groups), len(listing.excluded)))
    h.update(
        b"".join(
            [
                g.dir_rel
                + b"\0"
                + g.stem
                + b"\0"
                + b"".join([n + b"\0" + code[k] for n, k in g.entries])
                + b"\0"
                for g in listing.groups
            ]
        )
    )
    h.update(b"".join([s.path + b"\0" for s in listing.excluded]))
    return h.hexdigest()


_KIND_CODE = {"file": b"f", "link": b"l", "other": b"o"}  # the kinds scan gives entries
