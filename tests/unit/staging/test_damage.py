"""A staged copy with a flipped byte: the next stage run replaces it, and the read-through
cache never hands its bytes to training.

Two kinds of damage: a write into the copy (its ctime changes, so its stamp no longer
matches) and silent corruption that its stat does not show (bit rot on the NVMe, simulated
by refreshing the stamp after the flip), which only the per-member checksum catches.
"""

from __future__ import annotations

import re

import pytest

from shardio.order.ranks import RankInfo
from shardio.read.reader import ShardReader
from shardio.runtime.dataset import ShardDataset
from shardio.staging import StageOptions, stage_dataset
from shardio.staging.protocol import write_stamp

SUMMARY = re.compile(r"copied (\d+) .*already staged and verified (\d+), replaced (\d+)")
SINGLE = RankInfo(rank=0, world_size=1)


def _stage_all(src, dest) -> None:
    result = stage_dataset(src.path, dest, StageOptions(durable=False))
    assert result.copied == src.num_shards


def _flip(src, dest, sample: int) -> str:
    """Flip one byte in the middle of ``sample``'s payload in its staged copy; return the
    shard's relative path."""
    with ShardReader(src.path) as ds:
        shard = int(ds.index.samples[sample]["shard"])
        member = next(
            m
            for m in ds.index.sample_member_range(sample)
            if ds.index.exts[int(ds.index.members[m]["ext_id"])] == "bin"
        )
        where = int(ds.index.members[member]["offset"]) + int(ds.index.members[member]["size"]) // 2
    rel = src.rels[shard]
    with open(dest / rel, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)
        fh.seek(where)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return rel


def test_flipped_byte_is_replaced_by_the_next_stage_run(big_src, tmp_path, run_cli, helpers):
    dest = tmp_path / "stage"
    rc, out, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    rel = _flip(big_src, dest, sample=len(big_src.keys) // 2)

    rc, out, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    m = SUMMARY.search(out)
    assert m is not None, out
    assert tuple(map(int, m.groups())) == (0, big_src.num_shards - 1, 1), out
    assert "replaced 1," in out
    assert rel in err and "damaged" in err, f"the replaced copy is not named: {err!r}"
    big_src.assert_staged_ok(dest, set(big_src.rels))
    assert helpers.temp_files(dest) == []


@pytest.mark.parametrize("root", ["src+cache", "dest"])
def test_read_through_never_serves_a_written_copy(big_src, tmp_path, root):
    """A copy written after it was verified (stamp no longer matches) is not read: the
    sample comes from the source, correct."""
    dest = tmp_path / "stage"
    _stage_all(big_src, dest)
    sample = len(big_src.keys) // 3
    rel = _flip(big_src, dest, sample)
    ds = (
        ShardDataset(big_src.path, stage=dest, ranks=SINGLE)
        if root == "src+cache"
        else ShardDataset(dest, ranks=SINGLE)
    )
    try:
        for i in big_src.samples_in(rel):
            big_src.check_sample(ds[i])
        stats = ds.packed.metrics.counts
        assert stats["cache_hits"] == 0 and stats["cache_misses"] == 1, stats
        assert stats["bytes_staged"] == 0, stats
    finally:
        ds.close()


@pytest.mark.parametrize("root", ["src+cache", "dest"])
def test_read_through_drops_a_silently_corrupted_copy(big_src, tmp_path, run_cli, root):
    """Bit rot the stat cannot show: the member checksum catches it, the copy and its stamp
    are dropped, the right bytes come from the source, and the next stage copies it again."""
    dest = tmp_path / "stage"
    _stage_all(big_src, dest)
    sample = len(big_src.keys) // 3
    rel = _flip(big_src, dest, sample)
    entry = big_src.manifest.shards[big_src.rels.index(rel)]
    write_stamp(str(dest), rel, entry.xxh3_128, durable=False)  # the stat now matches again
    ds = (
        ShardDataset(big_src.path, stage=dest, ranks=SINGLE)
        if root == "src+cache"
        else ShardDataset(dest, ranks=SINGLE)
    )
    try:
        big_src.check_sample(ds[sample])
        stats = dict(ds.packed.metrics.counts)
        assert stats["drops"] == 1, stats
        assert stats["cache_hits"] == 1, stats
        assert not (dest / rel).exists(), "the bad copy is still in the cache"
        assert rel not in big_src.stamped(dest), "the bad copy's stamp is still there"
        for i in big_src.samples_in(rel):  # the rest of the shard: from the source
            big_src.check_sample(ds[i])
        assert ds.packed.metrics.counts["drops"] == 1
        assert ds.packed.metrics.counts["bytes_source"] > 0
    finally:
        ds.close()

    rc, out, err = run_cli("stage", big_src.path, dest, "--no-progress")
    assert rc == 0, err
    m = SUMMARY.search(out)
    assert m is not None, out
    assert tuple(map(int, m.groups())) == (1, big_src.num_shards - 1, 0), out
    big_src.assert_staged_ok(dest, set(big_src.rels))


def test_clean_copies_are_read_from_the_cache(big_src, tmp_path):
    dest = tmp_path / "stage"
    _stage_all(big_src, dest)
    ds = ShardDataset(big_src.path, stage=dest, ranks=SINGLE)
    try:
        for i in range(0, len(big_src.keys), 3):
            big_src.check_sample(ds[i])
        stats = ds.packed.metrics.counts
        assert stats["cache_hits"] == big_src.num_shards and stats["cache_misses"] == 0, stats
        assert stats["bytes_source"] == 0 and stats["drops"] == 0, stats
    finally:
        ds.close()
