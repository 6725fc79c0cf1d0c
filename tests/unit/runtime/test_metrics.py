"""loader.metrics(): read latency by source, counts that add up, stall fraction, workers' and
ranks' figures summed, against real files, real DataLoader workers and a slow opener."""

from __future__ import annotations

import pickle
from array import array

import pytest

from shardio import RecoveryPolicy
from shardio.errors import UsageError
from shardio.metrics import MetricsSnapshot, ReadDelta, ReadMetrics, combine
from shardio.order.ranks import RankInfo
from shardio.read.faults import Fault, FaultyOpener
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.prefetch import GPUPrefetcher
from shardio.staging.stage import StageOptions, stage_dataset

SINGLE = RankInfo()


def _epoch(loader) -> list[str]:
    keys: list[str] = []
    for batch in loader:
        keys.extend(batch["__key__"])
    return keys


def _payload_bytes(packed, keys) -> int:
    return sum(len(packed.payload[k]) for k in keys)


@pytest.mark.parametrize("mode", ["map", "stream"])
@pytest.mark.parametrize("workers", [0, 2])
def test_counts_add_up_to_the_epoch(packed, mode, workers) -> None:
    ds = ShardDataset(packed.path, mode=mode, ranks=SINGLE, seed=3)
    loader = ds.loader(batch_size=32, num_workers=workers)
    keys = _epoch(loader)
    snap = loader.metrics()
    assert isinstance(snap, MetricsSnapshot)
    assert len(keys) == len(packed.keys)
    assert snap.samples == snap.samples_read == len(packed.keys)
    assert snap.batches == -(-len(packed.keys) // 32)
    assert snap.bytes_read == snap.bytes_source == _payload_bytes(packed, packed.keys)
    assert snap.bytes_staged == 0
    assert snap.read_latency["source"].count == len(packed.keys)  # one payload member each
    assert snap.read_latency["staged"].count == 0
    assert snap.counters["members"] == len(packed.keys)
    # Each process opens each shard once (the pool holds them all).
    assert packed.num_shards <= snap.counters["opens_source"] <= packed.num_shards * max(1, workers)
    assert snap.counters["checksum_failures"] == snap.counters["read_errors"] == 0
    assert snap.steps == snap.batches - 1  # the first batch starts no step
    assert 0.0 <= snap.stall_fraction <= 1.0
    if workers:
        assert snap.transport["ring"] + snap.transport["fallback"] == snap.batches
    # A second epoch adds to the figures.
    loader.set_epoch(1)
    _epoch(loader)
    again = loader.metrics()
    assert again.samples_read == again.samples == 2 * len(packed.keys)
    assert again.counters["members"] == 2 * len(packed.keys)


def test_slow_reads_show_in_the_percentiles_and_the_stall_fraction(packed_tar) -> None:
    """Two injected delays: shards of one half 4 ms, the other 24 ms; the percentiles must
    fall inside what was injected (and the loop, computing nothing, is mostly waiting)."""
    fast, slow = 0.004, 0.024
    shard_names = sorted({packed_tar.shard_of[k] for k in packed_tar.keys})
    manifest = ShardDataset(packed_tar.path, ranks=SINGLE).packed.manifest
    slow_paths = [manifest.shards[i].path for i in shard_names[: len(shard_names) // 2]]
    faults = [Fault(kind="slow", path=p, delay_s=slow - fast) for p in slow_paths]
    faults.append(Fault(kind="slow", delay_s=fast))
    ds = ShardDataset(packed_tar.path, ranks=SINGLE, opener=FaultyOpener(faults))
    loader = ds.loader(batch_size=16, num_workers=2)
    keys = _epoch(loader)
    snap = loader.metrics()
    lat = snap.read_latency["source"]
    slow_keys = sum(1 for k in keys if manifest.shards[packed_tar.shard_of[k]].path in slow_paths)
    assert lat.count == len(keys)
    # The slack above covers scheduling on a loaded machine (2 workers on 2 CPUs).
    assert fast <= lat.p50_s <= slow * 1.5
    assert slow <= lat.p99_s <= slow * 3
    assert lat.max_s >= lat.p99_s >= lat.p95_s >= lat.p50_s
    assert fast <= lat.mean_s
    if slow_keys < len(keys) // 2:  # most reads fast: the median is a fast read
        assert lat.p50_s < slow
    # The loop does nothing but wait: the reads are the time.
    assert snap.stall_fraction > 0.5
    assert snap.wait_s >= (len(keys) * fast) / 2 * 0.9


def test_a_staged_copy_counts_as_staged(packed_tar, tmp_path) -> None:
    area = tmp_path / "area"
    stage_dataset(packed_tar.path, area, StageOptions())
    ds = ShardDataset(packed_tar.path, stage=area, ranks=SINGLE)
    loader = ds.loader(batch_size=50, num_workers=2)
    _epoch(loader)
    snap = loader.metrics()
    assert snap.bytes_staged == _payload_bytes(packed_tar, packed_tar.keys)
    assert snap.bytes_source == 0
    assert snap.read_latency["staged"].count == len(packed_tar.keys)
    assert snap.read_latency["source"].count == 0
    assert snap.counters["cache_misses"] == 0
    assert snap.counters["cache_hits"] >= packed_tar.num_shards
    assert snap.counters["opens_staged"] >= packed_tar.num_shards


def test_checksum_failures_and_substitutes_reach_the_training_process(
    packed_tar, corrupt_copy
) -> None:
    key = packed_tar.keys[7]
    bad, _shard, _at = corrupt_copy(packed_tar, key)
    ds = ShardDataset(
        bad.path,
        ranks=SINGLE,
        seed=1,
        recovery=RecoveryPolicy(policy="skip", retries=1, backoff_s=0.0),
    )
    loader = ds.loader(batch_size=25, num_workers=2)
    keys = _epoch(loader)
    snap = loader.metrics()
    assert len(keys) == len(packed_tar.keys)
    assert snap.counters["checksum_failures"] >= 2  # the read and its retry
    assert snap.counters["retries"] == 1
    assert snap.counters["substitutes"] == 1
    assert ds.recovery_stats["skip"] == 1
    assert key not in keys


def test_mapped_transport_counts_map_opens(packed_tar) -> None:
    ds = ShardDataset(packed_tar.path, ranks=SINGLE, transport="mmap")
    loader = ds.loader(batch_size=50, num_workers=2)
    _epoch(loader)
    snap = loader.metrics()
    assert snap.samples_read == len(packed_tar.keys)
    assert snap.counters["map_opens"] >= packed_tar.num_shards
    assert snap.read_latency["source"].count == len(packed_tar.keys)


def test_metrics_off_keeps_counts_local_and_times_nothing(packed_tar) -> None:
    ds = ShardDataset(packed_tar.path, ranks=SINGLE, metrics=False)
    loader = ds.loader(batch_size=50, num_workers=2)
    _epoch(loader)
    snap = loader.metrics()
    assert snap.samples == len(packed_tar.keys)  # the loop's side is always measured
    assert snap.samples_read == 0  # workers sent nothing
    assert snap.read_latency["all"].count == 0
    # In-process reads still count, untimed.
    ds0 = ShardDataset(packed_tar.path, ranks=SINGLE, metrics=False)
    loader0 = ds0.loader(batch_size=50)
    _epoch(loader0)
    snap0 = loader0.metrics()
    assert snap0.samples_read == snap0.counters["members"] == len(packed_tar.keys)
    assert snap0.bytes_read == _payload_bytes(packed_tar, packed_tar.keys)
    assert snap0.read_latency["all"].count == 0


def test_a_plain_dataloader_sees_no_metrics_entry(packed_tar) -> None:
    import torch.utils.data

    ds = ShardDataset(packed_tar.path, ranks=SINGLE)
    dl = torch.utils.data.DataLoader(ds, batch_size=10, num_workers=1, collate_fn=lambda b: b)
    first = next(iter(dl))
    assert all("__shardio_metrics__" not in sample for sample in first)


def test_closing_the_dataset_keeps_its_figures(packed_tar) -> None:
    ds = ShardDataset(packed_tar.path, ranks=SINGLE)
    for i in range(10):
        ds[i]
    ds.close()
    assert ds.read_metrics()["samples"] == 10
    ds[0]
    assert ds.read_metrics()["samples"] == 11


def test_the_prefetcher_measures_the_loop_it_feeds(packed_tar) -> None:
    ds = ShardDataset(packed_tar.path, ranks=SINGLE)
    with GPUPrefetcher(ds.loader(batch_size=50, num_workers=2), device="cpu") as pre:
        n = sum(len(b["__key__"]) for b in pre)
        snap = pre.metrics()
    assert n == snap.samples == snap.samples_read == len(packed_tar.keys)
    assert snap.batches == len(pre)
    assert snap.read_latency["source"].count == len(packed_tar.keys)


def test_a_forged_delta_is_refused() -> None:
    sink = ReadMetrics()
    with pytest.raises(UsageError, match="ReadDelta"):
        sink.absorb({"samples": 1})
    with pytest.raises(UsageError, match="bad counter"):
        sink.absorb(ReadDelta((("samples", -1),), ()))
    with pytest.raises(UsageError, match="bad counter"):
        sink.absorb(ReadDelta((("no_such", 1),), ()))
    with pytest.raises(UsageError, match="histogram"):
        sink.absorb(ReadDelta((), (("source", (((999, 1),), 0, 0, 0)),)))
    with pytest.raises(UsageError):
        sink.absorb(ReadDelta((), (("source", "junk"),)))
    with pytest.raises(UsageError, match="read times"):
        sink.absorb(ReadDelta((), (), (("source", array("q", [5, -1])),)))
    with pytest.raises(UsageError, match="read times"):
        sink.absorb(ReadDelta((), (), (("source", [5, 6]),)))
    with pytest.raises(UsageError, match="unknown source"):
        sink.absorb(ReadDelta((), (), (("nfs", array("q", [5])),)))
    assert sink.counts == ReadMetrics().counts  # nothing half-merged


def test_snapshots_round_trip_and_combine() -> None:
    a, b = ReadMetrics(), ReadMetrics()
    a.add("samples", 3)
    a.record_read(staged=True, nbytes=10, ns=2_000_000)
    b.add("samples", 5)
    b.record_read(staged=False, nbytes=7, ns=8_000_000)
    from shardio.metrics import StepTimer, snapshot

    snaps = [snapshot(m, StepTimer(), rank=r, world_size=2) for r, m in enumerate((a, b))]
    total = combine(snaps)
    assert total.samples_read == 8 and total.bytes_read == 17
    assert total.read_latency["all"].count == 2
    assert total.read_latency["all"].max_s == pytest.approx(0.008)
    restored = pickle.loads(pickle.dumps(snaps[0]))
    assert restored.to_dict() == snaps[0].to_dict()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reporter_thread_reading_meanwhile_loses_nothing(packed_tar, workers) -> None:
    import threading

    ds = ShardDataset(packed_tar.path, ranks=SINGLE)
    loader = ds.loader(batch_size=10, num_workers=workers)
    stop = threading.Event()
    seen: list[int] = []

    def watch() -> None:
        while not stop.is_set():
            seen.append(loader.metrics().read_latency["all"].count)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        keys = _epoch(loader)
    finally:
        stop.set()
        watcher.join()
    snap = loader.metrics()
    assert len(seen) > 1
    assert snap.read_latency["all"].count == snap.counters["members"] == len(keys)
    assert seen == sorted(seen)  # figures only grow
