"""The read path per filesystem on the MooseFS bed: "auto" chooses pfs there, and both
strategies (map mode: local one pread per member, pfs planned requests in flight; stream
mode reads ahead with both) deliver every byte as in the source, in the same order, with
the same opens and metadata requests per sample, and still catch a flipped byte."""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
from mfsbed import Bed, PfsDataset

from shardio import ShardDataset
from shardio.bench.loop import drop_page_cache
from shardio.errors import ChecksumMismatchError
from shardio.order.ranks import RankInfo
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.reader import ShardReader
from shardio.read.strategy import ENV_VAR

BATCH = 16
SINGLE = RankInfo(rank=0, world_size=1)


def _files(data: PfsDataset) -> list[str]:
    with ShardReader(data.path) as packed:
        return [os.fspath(data.path / s.path) for s in packed.manifest.shards]


def _epoch(
    data: PfsDataset, bed: Bed, mode: str, workers: int, strategy: str
) -> tuple[list[str], dict[str, int], int]:
    """(keys in order, read counters, master requests) of one cold epoch; checks every byte."""
    drop_page_cache(_files(data), allow_global=False)  # from the chunkservers
    ds = ShardDataset(data.path, mode=mode, ranks=SINGLE, seed=11, read_strategy=strategy)
    assert ds.read_choice.strategy.name == strategy
    loader = ds.loader(batch_size=BATCH, num_workers=workers)
    keys: list[str] = []
    before = bed.stats().get("master.packets_sent", 0)
    for batch in loader:
        for i, key in enumerate(batch["__key__"]):
            assert bytes(batch["jpeg"][i]) == data.payload[key], f"wrong bytes for {key}"
            keys.append(key)
    sent = bed.stats().get("master.packets_sent", 0) - before
    counts = collections.Counter(keys)
    assert not [k for k, n in counts.items() if n > 1], "a sample was delivered twice"
    assert set(counts) == set(data.payload), "samples missing or unknown"
    return keys, dict(loader.metrics().counters), sent


def test_auto_chooses_pfs_on_the_bed(pfs_dataset: PfsDataset, monkeypatch: Any) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    ds = ShardDataset(pfs_dataset.path, ranks=SINGLE)
    assert ds.read_choice.strategy.name == "pfs"
    assert "network" in ds.read_choice.reason


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_both_strategies_read_the_same_bytes_with_the_same_opens(
    pfs_bed: Bed, pfs_dataset: PfsDataset, mode: str, workers: int
) -> None:
    local_keys, local_counts, local_sent = _epoch(pfs_dataset, pfs_bed, mode, workers, "local")
    pfs_keys, pfs_counts, pfs_sent = _epoch(pfs_dataset, pfs_bed, mode, workers, "pfs")
    assert pfs_keys == local_keys  # the epoch's order, whatever the read path
    assert pfs_counts["members"] == local_counts["members"] == len(pfs_dataset.payload)
    assert pfs_counts["opens_source"] == local_counts["opens_source"]
    assert pfs_counts["checksum_failures"] == pfs_counts["read_errors"] == 0
    # Metadata requests: the same opens; the read path adds none per sample (a few of slack
    # for the client's own attribute refreshes, which follow time, not reads).
    assert pfs_sent <= local_sent + 2 * len(_files(pfs_dataset)) + 10


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_a_flipped_byte_is_caught_on_the_bed(
    pfs_dataset: PfsDataset, mode: str, workers: int
) -> None:
    with ShardReader(pfs_dataset.path) as packed:
        sample = packed.manifest.shards[1].first_sample + 2
        shard = packed.manifest.shards[1].path
        member = next(
            m for m in packed.index.sample_member_range(sample)
            if int(packed.index.members[m]["size"]) > 0
        )  # fmt: skip
        offset = int(packed.index.members[member]["offset"])
        key = packed.key(sample)
    opener = FaultyOpener([Fault(kind="flip", path=shard, offset=offset + 5)])
    drop_page_cache(_files(pfs_dataset), allow_global=False)
    ds = ShardDataset(
        pfs_dataset.path, mode=mode, ranks=SINGLE, seed=11, read_strategy="pfs", opener=opener
    )
    with pytest.raises(ChecksumMismatchError) as info:
        for _batch in ds.loader(batch_size=BATCH, num_workers=workers):
            pass
    assert info.value.key == key
