"""The metadata budget on the MooseFS bed, as a count (not a timing): two epochs of shardio
over 1,200 samples in a handful of shards send O(shards) requests to the master (the client's
``master.packets_sent``, lookups and opens in ``MOUNT/.stats``), not O(samples). The same
epochs over the loose files are measured the same way, as a control that must blow through
the bound, so the test can fail."""

from __future__ import annotations

import os
import pathlib
import random
import time
from collections.abc import Callable

import pytest
from mfsbed import Bed
from trees import write_tree

from shardio import ShardDataset
from shardio.format.manifest import load_manifest
from shardio.order.ranks import RankInfo
from shardio.packing.run import PackOptions, pack

SAMPLES = 1200
EPOCHS = 2
COUNTERS = ("master.packets_sent", "fuse_ops.lookup.master", "fuse_ops.open")


@pytest.fixture(scope="module")
def trees(pfs_bed: Bed) -> tuple[pathlib.Path, pathlib.Path, int]:
    """(loose tree, its packed dataset, shard count), both on the mount."""
    rng = random.Random(11)
    files = {
        f"train/c{c}/img{i:04d}.jpg".encode(): rng.randbytes(rng.randint(500, 1500))
        for c in range(3)
        for i in range(SAMPLES // 3)
    }
    base = pfs_bed.mount / "meta" / f"{os.getpid()}-{rng.randrange(1 << 30):x}"
    src = pathlib.Path(write_tree(base / "loose", files))
    dst = base / "ds"
    pack(
        os.fspath(src),
        os.fspath(dst),
        PackOptions(shard_format="tar", shard_size_bytes=1 << 20, durable=False),
    )
    shards = len(load_manifest(dst / "manifest.json").shards)
    assert 3 <= shards <= 12
    return src, dst, shards


def measure(bed: Bed, work: Callable[[], None]) -> tuple[dict[str, int], float]:
    """The counters' growth over ``work`` and its wall time (the master is pinged about
    once a second whatever the client does: the bound allows for it)."""
    os.sync()  # nothing left to flush from earlier writes
    before, start = bed.stats(), time.monotonic()
    work()
    elapsed = time.monotonic() - start
    after = bed.stats()
    return {k: after[k] - before[k] for k in COUNTERS}, elapsed


def shardio_epochs(dst: pathlib.Path, workers: int) -> Callable[[], None]:
    def run() -> None:
        ds = ShardDataset(dst, mode="map", ranks=RankInfo(rank=0, world_size=1), seed=1)
        loader = ds.loader(batch_size=64, num_workers=workers)
        try:
            seen = 0
            for epoch in range(EPOCHS):
                loader.set_epoch(epoch)
                seen += sum(len(b["__key__"]) for b in loader)
            assert seen == EPOCHS * SAMPLES
        finally:
            loader.close()
            ds.close()

    return run


def loose_epochs(src: pathlib.Path) -> Callable[[], None]:
    def run() -> None:
        paths = sorted(src.rglob("*.jpg"))
        assert len(paths) == SAMPLES
        rng = random.Random(3)
        for _ in range(EPOCHS):
            rng.shuffle(paths)
            for path in paths:
                path.read_bytes()

    return run


def budget(shards: int, workers: int, elapsed_s: float) -> int:
    """Requests allowed: a few per shard (and the manifest and index) per reading process,
    plus the master's pings. Loose files need at least a lookup and an open per sample."""
    return 8 * (shards + 4) * max(1, workers) + 2 * int(elapsed_s + 1)


@pytest.mark.parametrize("workers", [0, 2])
def test_metadata_requests_grow_with_shards_not_samples(
    pfs_bed: Bed, trees: tuple[pathlib.Path, pathlib.Path, int], workers: int
) -> None:
    src, dst, shards = trees
    got, elapsed = measure(pfs_bed, shardio_epochs(dst, workers))
    allowed = budget(shards, workers, elapsed)
    assert got["master.packets_sent"] <= allowed, (got, shards)
    assert got["fuse_ops.lookup.master"] + got["fuse_ops.open"] <= allowed, got

    # The control, measured the same way: loose files blow through the same bound.
    loose, loose_elapsed = measure(pfs_bed, loose_epochs(src))
    assert loose["fuse_ops.open"] >= SAMPLES  # at least one open per sample per epoch
    assert loose["master.packets_sent"] > budget(shards, workers, loose_elapsed)
    assert loose["master.packets_sent"] >= 10 * got["master.packets_sent"], (loose, got)
