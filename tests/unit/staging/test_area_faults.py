"""Faults of a staging area that training survives (issue 17): a bad copy on an area whose
disk went read-only is passed over for the intact source; a copy evicted under a reader is
an eviction, not a read error; stage says why it evicted.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from shardio.order.ranks import RankInfo
from shardio.read.reader import ShardReader
from shardio.runtime.dataset import ShardDataset
from shardio.staging import StageOptions, stage_dataset
from shardio.staging.protocol import write_stamp

SINGLE = RankInfo(rank=0, world_size=1)


def _rot(src: Any, dest: Any, sample: int) -> str:
    """Flip a byte of ``sample``'s payload in its staged copy and refresh the stamp (bit
    rot that the copy's stat does not show); return the shard's relative path."""
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
    write_stamp(str(dest), rel, src.manifest.shards[shard].xxh3_128, durable=False)
    return rel


@pytest.mark.parametrize("root", ["area", "src+cache"])
def test_a_bad_copy_on_a_read_only_area_reads_the_source(
    tiny_src: Any, tmp_path: Any, ro_mount: Any, caplog: Any, root: str
) -> None:
    """The defect: plain ShardDataset stopped with a lock error (EROFS on the lock file)."""
    dest = tmp_path / "area"
    stage_dataset(tiny_src.path, dest, StageOptions(durable=False))
    sample = len(tiny_src.keys) // 2
    rel = _rot(tiny_src, dest, sample)
    bad = (dest / rel).read_bytes()
    ro = ro_mount(dest)
    ds = (
        ShardDataset(ro, ranks=SINGLE)
        if root == "area"
        else ShardDataset(tiny_src.path, stage=ro, ranks=SINGLE)
    )
    try:
        tiny_src.check_sample(ds[sample])  # the right bytes, from the source
        for i in tiny_src.samples_in(rel):
            tiny_src.check_sample(ds[i])
        counts = ds.read_metrics().counts
    finally:
        ds.close()
    assert counts["checksum_failures"] == 1
    assert counts["drops"] == 1 and counts["drop_failures"] == 1
    assert counts["bytes_source"] > 0
    assert (dest / rel).read_bytes() == bad, "the copy on a read-only disk cannot go"
    said = [
        r.getMessage()
        for r in caplog.records
        if "cannot remove the bad staged copy" in r.getMessage()
    ]
    assert len(said) == 1 and "Read-only file system" in said[0], said


def test_an_evicted_copy_is_an_eviction_not_a_read_error(
    big_src: Any, tmp_path: Any, run_cli: Any
) -> None:
    """A shard located in the area, then evicted (by `stage --capacity`) before it was
    opened: read from the source, counted as an eviction, not as a read error or a drop."""
    dest = tmp_path / "area"
    stage_dataset(big_src.path, dest, StageOptions(durable=False))
    ds = ShardDataset(big_src.path, stage=dest, ranks=SINGLE, shuffle=False)
    try:
        rel = big_src.rels[5]
        assert ds.packed.shard_path(5) == str(dest / rel)  # located: the staged copy
        result = run_cli("stage", big_src.path, dest, "--capacity", "1", "--no-progress")
        assert result.rc == 0, result.stderr
        assert not (dest / rel).exists(), "the copy was not evicted: the test tests nothing"
        for i in big_src.samples_in(rel):
            big_src.check_sample(ds[i])
        counts = ds.read_metrics().counts
    finally:
        ds.close()
    assert counts["evictions"] == 1
    assert counts["read_errors"] == 0 and counts["drops"] == 0
    assert counts["bytes_source"] > 0


def test_stage_says_why_it_evicted(tiny_src: Any, tmp_path: Any, run_cli: Any) -> None:
    """--ahead without --capacity evicts what the coming epochs do not need: "to make room"
    was wrong (no capacity was set)."""
    dest = tmp_path / "area"
    assert run_cli("stage", tiny_src.path, dest, "--no-progress").rc == 0
    result = run_cli(
        "stage", tiny_src.path, dest, "--node", "0/2", "--order", "partition=node",
        "--ahead", "1", "--no-progress",
    )  # fmt: skip
    assert result.rc == 0, result.stderr
    m = re.search(r"^evicted (\d+) shard\(s\) (.*)$", result.stdout, re.M)
    assert m is not None, result.stdout
    assert int(m.group(1)) > 0
    assert m.group(2) == "staged here that epochs 0 to 1 do not need (--ahead)"
    assert "make room" not in result.stdout
    result = run_cli("stage", tiny_src.path, dest, "--capacity", "20KiB", "--no-progress")
    assert result.rc == 0, result.stderr
    assert re.search(
        r"^evicted \d+ shard\(s\) not needed now to make room within --capacity 20\.0 KiB$",
        result.stdout,
        re.M,
    ), result.stdout
