"""Every object a checkpoint takes as ``loader=`` records the id of the dataset it reads, so a
position never resumes in another dataset (issue 32): a ShardDataset given itself, a
MixedDataset (an id of its sources' ids and weights), and shardio.dali's loader (the torch
loader's id over the same dataset)."""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import pytest

from shardio.checkpoint import load_latest, save
from shardio.errors import UsageError
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.mixed import MixedDataset

Packed = Any  # tests/unit/runtime/conftest.py's Packed
NOJOB: dict[str, str] = {}
NO_ID = "records no dataset id"
REFUSED = r"holds a position in dataset .*not resumed"


def _loader_id(path: str) -> str:
    ds = ShardDataset(path)
    try:
        found = ds.loader(batch_size=8).dataset_id
    finally:
        ds.close()
    assert isinstance(found, str) and len(found) == 32
    return found


def test_a_shard_dataset_as_the_loader_records_its_id(
    packed_tar: Packed, packed_hdf5: Packed, tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    ckdir = tmp_path / "ckpt"
    ds = ShardDataset(packed_tar.path, seed=3)
    other = ShardDataset(packed_hdf5.path, seed=3)
    try:
        ds.set_epoch(1)
        save({"w": 1}, ckdir, step=1, loader=ds, environ=NOJOB)
        with pytest.raises(UsageError, match=REFUSED):
            load_latest(ckdir, loader=other, environ=NOJOB)
        with caplog.at_level(logging.WARNING):
            resumed = ShardDataset(packed_tar.path, seed=3)
            ck = load_latest(ckdir, loader=resumed, environ=NOJOB)  # its own: resumed
            loader = ds.loader(batch_size=8)  # the torch loader over it: the same id
            load_latest(ckdir, loader=loader, environ=NOJOB)
        assert ck.loader_state == ds.state_dict() and resumed.state_dict() == ds.state_dict()
        assert NO_ID not in caplog.text and "the loader has none" not in caplog.text
        resumed.close()
    finally:
        ds.close()
        other.close()


def test_a_mixed_dataset_as_the_loader_records_the_mix_id(
    packed_tar: Packed, packed_hdf5: Packed, tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    ckdir = tmp_path / "ckpt"

    def mix(weights: tuple[float, float], seed: int = 0) -> MixedDataset:
        sources = [ShardDataset(packed_tar.path), ShardDataset(packed_hdf5.path)]
        return MixedDataset(list(zip(sources, weights, strict=True)), seed=seed)

    mixed = mix((0.5, 0.5))
    assert isinstance(mixed.dataset_id, str) and mixed.dataset_id == mixed.loader(4).dataset_id
    assert mixed.dataset_id not in (_loader_id(packed_tar.path), _loader_id(packed_hdf5.path))
    assert mix((0.7, 0.3)).dataset_id != mixed.dataset_id != mix((0.5, 0.5), 9).dataset_id
    save({"w": 1}, ckdir, step=1, loader=mixed, environ=NOJOB)
    with pytest.raises(UsageError, match=REFUSED):
        load_latest(ckdir, loader=mix((0.7, 0.3)), environ=NOJOB)
    with pytest.raises(UsageError, match=REFUSED):
        load_latest(ckdir, loader=ShardDataset(packed_tar.path), environ=NOJOB)
    with caplog.at_level(logging.WARNING):
        again = mix((0.5, 0.5))
        ck = load_latest(ckdir, loader=again, environ=NOJOB)
        load_latest(ckdir, loader=again.loader(4), environ=NOJOB)  # its loader: the same id
    assert ck.loader_state == mixed.state_dict() and again.state_dict() == mixed.state_dict()
    assert NO_ID not in caplog.text and "the loader has none" not in caplog.text


@pytest.mark.dali
def test_the_dali_loader_records_the_torch_loaders_id(
    packed_tar: Packed, packed_hdf5: Packed, tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    pytest.importorskip("nvidia.dali")
    import shardio.dali as sdali

    ckdir = tmp_path / "ckpt"
    with sdali.loader(packed_tar.path, batch_size=16, seed=2) as dali:
        assert dali.dataset_id == _loader_id(packed_tar.path)
        for i, _ in enumerate(dali):
            if i == 1:
                break
        save({"w": 1}, ckdir, step=1, loader=dali, environ=NOJOB)
        state = dali.state_dict()
    assert state["consumed"] == 32
    hdf5 = ShardDataset(packed_hdf5.path, seed=2)
    with pytest.raises(UsageError, match=REFUSED):
        load_latest(ckdir, loader=hdf5.loader(batch_size=16), environ=NOJOB)
    hdf5.close()
    with caplog.at_level(logging.WARNING):
        tar = ShardDataset(packed_tar.path, seed=2)
        ck = load_latest(ckdir, loader=tar.loader(batch_size=16), environ=NOJOB)
        assert ck.loader_state == state and tar.state_dict() == state
        tar.close()
    assert NO_ID not in caplog.text
    with (
        sdali.loader(packed_hdf5.path, batch_size=16, seed=2) as other,
        pytest.raises(UsageError, match=REFUSED),
    ):
        load_latest(ckdir, loader=other, environ=NOJOB)
    with pytest.warns(sdali.UnverifiedReadWarning):  # DALI's own reader: the same id too
        unverified = sdali.loader(packed_tar.path, batch_size=16, verify=False)
    with unverified:
        assert unverified.dataset_id == _loader_id(packed_tar.path)
