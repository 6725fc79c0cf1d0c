"""The loader reports the shuffle quality each epoch delivered (shardio.runtime.quality): one
log line an epoch, ``loader.shuffle_quality``, and the same figures as the order's own
measure (``shardio inspect --order``) for the batches delivered."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from shardio.order.quality_report import QualityAccumulator, dataset_label_entropy
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.mixed import MixedDataset

QUALITY = "shardio.runtime.quality"


def test_each_epoch_logs_what_it_delivered(packed_tar, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=QUALITY)
    ds = ShardDataset(packed_tar.path, shuffle=True, seed=3)
    loader = ds.loader(batch_size=8, num_workers=2)
    delivered = []
    try:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                if epoch == 1:
                    delivered.append(list(batch["__key__"]))
        report = loader.shuffle_quality
    finally:
        loader.close()
    lines = [r.getMessage() for r in caplog.records if r.name == QUALITY]
    assert [line.split(" shuffle:")[0] for line in lines] == ["epoch 0", "epoch 1"]
    assert report is not None and report.epoch == 1
    assert report.samples_measured == len(ds)
    # The same figures, from the keys that arrived, through the accumulator directly.
    key_index = {k: i for i, k in enumerate(packed_tar.keys)}
    samples = ds.packed.index.samples
    acc = QualityAccumulator(dataset_entropy=dataset_label_entropy(samples["label"]))
    for keys in delivered:
        idx = np.array([key_index[k] for k in keys], dtype=np.int64)
        acc.observe(1, idx, samples["label"][idx], samples["shard"][idx])
    expected = acc.end_epoch(1)
    assert report.shards_per_batch == pytest.approx(expected.shards_per_batch)
    assert report.rho == pytest.approx(expected.rho)
    assert report.label_entropy == pytest.approx(expected.label_entropy)


def test_a_sequential_read_reports_rho_one_and_a_shuffle_does_not(packed_tar) -> None:
    rhos = {}
    for shuffle in (False, True):
        loader = ShardDataset(packed_tar.path, shuffle=shuffle, seed=0).loader(batch_size=8)
        for _ in loader:
            pass
        report = loader.shuffle_quality
        loader.close()
        assert report is not None
        rhos[shuffle] = report.rho
    assert rhos[False] == pytest.approx(1.0)
    assert abs(rhos[True]) < 0.5


def test_no_report_for_a_mix_or_without_the_audit(packed_tar, packed_hdf5) -> None:
    loader = ShardDataset(packed_tar.path, seed=0).loader(batch_size=8, audit=False)
    for _ in loader:
        pass
    assert loader.shuffle_quality is None
    loader.close()
    mix = MixedDataset([(ShardDataset(packed_tar.path), 1), (ShardDataset(packed_hdf5.path), 1)])
    loader = mix.loader(batch_size=8)
    for _ in loader:
        pass
    assert loader.shuffle_quality is None
    loader.close()
