"""``--capacity``: stage the shards needed first within a byte budget, read the rest from the
source, and evict (never a shard a reader holds open) to make room for another epoch."""

from __future__ import annotations

import re

from shardio.order.ranks import RankInfo
from shardio.read.reader import ShardReader
from shardio.runtime.dataset import ShardDataset
from shardio.staging import StageOptions, node_shard_order

SINGLE = RankInfo(rank=0, world_size=1)
FROM_SOURCE = re.compile(
    r"(\d+) shard\(s\) do not fit --capacity and will be read from (.*?): (.*)"
)
EVICTED = re.compile(r"evicted (\d+) shard\(s\)")


def _plan(src, capacity: int, **options) -> tuple[list[str], list[str]]:
    """(staged, from source): the prefix of the order of first need that fits, the rest."""
    order = [src.rels[i] for i in node_shard_order(src.manifest, StageOptions(**options))]
    staged: list[str] = []
    used = 0
    for rel in order:
        size = src.size_of([rel])
        if used + size > capacity:
            break
        staged.append(rel)
        used += size
    return staged, order[len(staged) :]


def _payload_bytes(src, rels) -> int:
    shards = {src.rels.index(r) for r in rels}
    return sum(
        len(src.payload[k])
        for k, s in zip(src.keys, src.shard_of_sample, strict=True)
        if s in shards
    )


def test_capacity_stages_what_is_needed_first(big_src, tmp_path, run_cli, helpers):
    dest = tmp_path / "stage"
    capacity = big_src.manifest.total_bytes // 2
    staged, rest = _plan(big_src, capacity)
    assert staged and rest

    rc, out, err = run_cli("stage", big_src.path, dest, "--capacity", str(capacity),
                           "--no-progress")  # fmt: skip
    assert rc == 0, err
    assert f"{len(staged)} of {big_src.num_shards} shards" in out, out
    m = FROM_SOURCE.search(out)
    assert m is not None, out
    assert int(m.group(1)) == len(rest)
    assert m.group(2) == str(big_src.path)
    shown = [n for n in m.group(3).split(", ") if n != "..."]
    assert shown and shown == rest[: len(shown)], f"stdout names {shown}, the rest is {rest}"
    big_src.assert_staged_ok(dest, set(staged))
    assert big_src.size_of(big_src.staged(dest)) <= capacity
    assert helpers.temp_files(dest) == []

    ds = ShardDataset(big_src.path, stage=dest, ranks=SINGLE)
    try:
        for i in range(len(big_src.keys)):
            big_src.check_sample(ds[i])
        stats = ds.packed.metrics.counts
        assert stats["cache_hits"] == len(staged) and stats["cache_misses"] == len(rest), stats
        assert stats["bytes_staged"] == _payload_bytes(big_src, staged), stats
        assert stats["bytes_source"] == _payload_bytes(big_src, rest), stats
        assert stats["drops"] == 0
    finally:
        ds.close()

    # Staging again with the same budget copies and evicts nothing.
    rc, out, err = run_cli("stage", big_src.path, dest, "--capacity", str(capacity),
                           "--no-progress")  # fmt: skip
    assert rc == 0, err
    assert "copied 0 " in out and EVICTED.search(out) is None, out
    big_src.assert_staged_ok(dest, set(staged))


def test_eviction_skips_a_shard_a_reader_holds(big_src, tmp_path, run_cli):
    dest = tmp_path / "stage"
    capacity = big_src.manifest.total_bytes // 2
    first, _ = _plan(big_src, capacity, epoch=0)
    second, _ = _plan(big_src, capacity, epoch=1)
    not_needed = [r for r in first if r not in second]
    assert len(not_needed) >= 3, "epochs 0 and 1 need the same shards first"
    held = not_needed[len(not_needed) // 2]

    rc, out, err = run_cli("stage", big_src.path, dest, "--capacity", str(capacity),
                           "--epoch", "0", "--no-progress")  # fmt: skip
    assert rc == 0, err
    big_src.assert_staged_ok(dest, set(first))

    reader = ShardReader(big_src.path, stage=dest)
    try:
        sample = big_src.samples_in(held)[0]
        big_src.check_sample(_as_dict(reader.read_sample(sample)))
        assert reader.metrics.counts["cache_hits"] == 1  # read from the staged copy, under LOCK_SH

        rc, out, err = run_cli("stage", big_src.path, dest, "--capacity", str(capacity),
                               "--epoch", "1", "--no-progress")  # fmt: skip
        assert rc == 0, err
        staged = big_src.staged(dest)
        assert held in staged, "evicted a shard a reader holds open"
        assert held in big_src.stamped(dest)
        assert set(second) <= staged
        gone = set(first) - staged
        assert gone <= set(not_needed) - {held}, "evicted a shard needed now"
        kept = set(not_needed) - {held} - gone
        assert not kept or big_src.size_of(staged) <= capacity, (
            f"over capacity, yet kept {sorted(kept)}, which are not needed"
        )
        assert gone, "nothing was evicted"
        m = EVICTED.search(out)
        assert m is not None and int(m.group(1)) == len(gone), out
        big_src.assert_staged_ok(dest, set(second) | {held})
        # The reader goes on reading its open copy.
        for i in big_src.samples_in(held):
            big_src.check_sample(_as_dict(reader.read_sample(i)))
        assert reader.metrics.counts["drops"] == 0
    finally:
        reader.close()

    ds = ShardDataset(big_src.path, stage=dest, ranks=SINGLE)
    try:
        for i in range(len(big_src.keys)):
            big_src.check_sample(ds[i])
        assert ds.packed.metrics.counts["cache_hits"] == len(second) + 1
        assert ds.packed.metrics.counts["cache_misses"] == big_src.num_shards - len(second) - 1
    finally:
        ds.close()


def test_no_eviction_when_everything_fits(tiny_src, tmp_path, run_cli):
    """DEST holds the whole dataset and the budget is the whole dataset: a node's rerun has
    nothing to copy and must evict nothing (shards already staged count once, not twice)."""
    dest = tmp_path / "stage"
    rc, _, err = run_cli("stage", tiny_src.path, dest, "--no-progress")
    assert rc == 0, err
    needed, _ = _plan(tiny_src, tiny_src.manifest.total_bytes, node=0, num_nodes=2)
    assert set(needed) != set(tiny_src.rels), "node 0 of 2 needs every shard: no test"

    rc, out, err = run_cli("stage", tiny_src.path, dest, "--node", "0/2", "--capacity",
                           str(tiny_src.manifest.total_bytes), "--no-progress")  # fmt: skip
    assert rc == 0, err
    assert "copied 0 " in out, out
    assert EVICTED.search(out) is None, f"evicted shards though everything fits: {out}"
    tiny_src.assert_staged_ok(dest, set(tiny_src.rels))


def _as_dict(sample):
    """ShardReader.read_sample -> the ``ds[i]`` shape check_sample expects."""
    return {"__key__": sample["__key__"], "bin": sample["bin"], "cls": sample["cls"]}
