"""The byte ranges a batch's members span, per shard, nearby ranges merged (for advice)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardio.format.index import Index

__all__ = ["ADVISE_GAP", "merged_member_ranges"]

# Ranges closer than this are advised as one (reading a tar header between two members
# costs less than another request).
ADVISE_GAP = 128 * 1024


def merged_member_ranges(
    index: Index, samples: Sequence[int], *, gap: int = ADVISE_GAP
) -> list[tuple[int, int, int]]:
    """The ranges ``(shard, start, end)`` holding every member of ``samples``, in shard and
    offset order, ranges of a shard at most ``gap`` bytes apart merged into one."""
    recs = index.records(samples)
    counts = recs["n_members"].astype(np.int64)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    rows = np.repeat(recs["first_member"].astype(np.int64), counts) + (
        np.arange(total) - np.repeat(starts, counts)
    )
    shards = np.repeat(recs["shard"].astype(np.int64), counts)
    offsets = index.members["offset"][rows].astype(np.int64)
    ends = offsets + index.members["size"][rows].astype(np.int64)
    order = np.lexsort((offsets, shards))
    ranges: list[tuple[int, int, int]] = []
    cur_shard, cur_lo, cur_hi = -1, 0, 0
    for k in order.tolist():
        shard, lo, hi = int(shards[k]), int(offsets[k]), int(ends[k])
        if shard == cur_shard and lo - cur_hi <= gap:
            cur_hi = max(cur_hi, hi)
            continue
        if cur_shard >= 0:
            ranges.append((cur_shard, cur_lo, cur_hi))
        cur_shard, cur_lo, cur_hi = shard, lo, hi
    if cur_shard >= 0:
        ranges.append((cur_shard, cur_lo, cur_hi))
    return ranges
