"""Reading a dataset on the MooseFS bed through ShardDataset's loader: map and stream mode,
0 and 2 workers; every sample's bytes equal the source file's, each sample arrives once, and
``loader.metrics()`` counts the reads as from the source (the parallel filesystem)."""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
from mfsbed import PfsDataset

from shardio import ShardDataset
from shardio.bench.loop import drop_page_cache
from shardio.order.ranks import RankInfo
from shardio.read.reader import ShardReader
from shardio.read.strategy import choose_strategy

BATCH = 16
SINGLE = RankInfo(rank=0, world_size=1)


def check_epoch(data: PfsDataset, batches: list[dict[str, Any]]) -> list[str]:
    """Every delivered sample holds its source file's bytes; each one once; returns keys."""
    keys: list[str] = []
    for batch in batches:
        for i, key in enumerate(batch["__key__"]):
            assert bytes(batch["jpeg"][i]) == data.payload[key], f"wrong bytes for {key}"
            keys.append(key)
    counts = collections.Counter(keys)
    assert not [k for k, n in counts.items() if n > 1], "a sample was delivered twice"
    assert set(counts) == set(data.payload), "samples missing or unknown"
    return keys


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_an_epoch_from_the_pfs_delivers_the_source_bytes(
    pfs_dataset: PfsDataset, mode: str, workers: int
) -> None:
    with ShardReader(pfs_dataset.path) as packed:
        files = [os.fspath(pfs_dataset.path / s.path) for s in packed.manifest.shards]
    # From the chunkservers, not the page cache the pack left (per file: other tests and
    # benchmarks share this machine's cache).
    drop_page_cache(files, allow_global=False)
    ds = ShardDataset(pfs_dataset.path, mode=mode, ranks=SINGLE, seed=5)
    loader = ds.loader(batch_size=BATCH, num_workers=workers)
    try:
        batches = list(loader)
        keys = check_epoch(pfs_dataset, batches)
        snap = loader.metrics()
    finally:
        loader.close()
        ds.close()
    shards = len(files)
    payload = sum(len(pfs_dataset.payload[k]) for k in keys)
    assert snap.samples == snap.samples_read == len(keys)
    assert snap.bytes_read == snap.bytes_source == payload  # all from the source
    assert snap.bytes_staged == 0
    assert snap.read_latency["source"].count == len(keys)
    assert snap.read_latency["staged"].count == 0
    # One open per shard per reading process at most: not one per sample.
    assert shards <= snap.counters["opens_source"] <= shards * max(1, workers)
    assert snap.counters["checksum_failures"] == snap.counters["read_errors"] == 0
    assert snap.counters["stalls"] == 0


def test_the_pfs_read_strategy_is_chosen_on_the_bed(pfs_dataset: PfsDataset) -> None:
    choice = choose_strategy(pfs_dataset.path, environ={})
    assert choice.fs.name == "moosefs"
    assert choice.strategy.name == "pfs"
    assert choice.reason == "auto: moosefs is a network filesystem"


@pytest.mark.parametrize("strategy", ["local", "pfs"])
def test_either_strategy_reads_the_same_bytes_on_the_pfs(
    pfs_dataset: PfsDataset, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The environment override (read_strategy= belongs to the reader's own tests).
    monkeypatch.setenv("SHARDIO_READ_STRATEGY", strategy)
    ds = ShardDataset(pfs_dataset.path, mode="stream", ranks=SINGLE, seed=1)
    try:
        check_epoch(pfs_dataset, list(ds.loader(batch_size=BATCH, num_workers=0)))
    finally:
        ds.close()
