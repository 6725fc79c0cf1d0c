"""An undecodable sample (bytes that pass their checksum because they were packed that way, or
a decoder that raises) is one SampleDecodeError naming the dataset, the shard and the sample;
ResilientDataset's policy handles it like an unreadable sample: ``skip`` substitutes it
deterministically (journaled and counted), ``raise`` raises the typed error. Map and stream
mode, in the training process and in 2 DataLoader workers.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import pytest
from PIL import Image

from shardio import RecoveryPolicy
from shardio.errors import SampleDecodeError, ShardioError
from shardio.packing.run import PackOptions, pack
from shardio.read.journal import read_journal
from shardio.runtime.dataset import ShardDataset

NUM_FILES = 48
BAD_KEY = "c1/img0013"  # a .jpg whose bytes are no JPEG at all


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """NUM_FILES tiny JPEGs in 3 class folders, one of them garbage, packed as they are."""
    base = tmp_path_factory.mktemp("decode-errors")
    for i in range(NUM_FILES):
        key = f"c{i % 3}/img{i:04d}"
        file = base / "tree" / f"{key}.jpg"
        file.parent.mkdir(parents=True, exist_ok=True)
        if key == BAD_KEY:
            file.write_bytes(b"\xff\xd8 this is not a JPEG, only its first two bytes are" * 4)
            continue
        out = io.BytesIO()
        Image.new("RGB", (8, 8), (i * 5 % 256, 40, 90)).save(out, format="JPEG")
        file.write_bytes(out.getvalue())
    pack(
        os.fspath(base / "tree"),
        os.fspath(base / "ds"),
        PackOptions(shard_size_bytes=8 * 1024, durable=False),
    )
    return base / "ds"


def _keys(loader: Any) -> list[str]:
    return [k for batch in loader for k in batch["__key__"]]


def test_plain_dataset_names_the_sample(images: pathlib.Path) -> None:
    ds = ShardDataset(images, decode="pil", shuffle=False)
    bad = [ds.packed.key(i) for i in range(len(ds))].index(BAD_KEY)
    with pytest.raises(SampleDecodeError) as caught:
        ds[bad]
    error = caught.value
    assert isinstance(error, ShardioError)
    assert isinstance(error, ValueError)
    assert (error.key, error.sample, error.field) == (BAD_KEY, bad, "jpg")
    assert error.dataset == os.fspath(images)
    assert error.shard.startswith("shards/")
    message = str(error)
    assert f"sample {BAD_KEY!r}" in message
    assert error.shard in message
    assert os.fspath(images) in message
    assert "UnidentifiedImageError" in message
    assert "\n" not in message
    assert error.__cause__ is not None
    again = pickle.loads(pickle.dumps(error))  # crosses from a worker with its fields
    assert (again.key, again.shard, again.sample, again.field) == (
        BAD_KEY,
        error.shard,
        bad,
        "jpg",
    )
    assert str(again) == message
    assert ds[bad - 1]["jpg"].size == (8, 8)  # its neighbours decode


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_loader_raises_the_typed_error(images: pathlib.Path, workers: int) -> None:
    ds = ShardDataset(images, decode="pil", shuffle=False)
    with pytest.raises(SampleDecodeError, match=f"cannot decode field 'jpg' of sample '{BAD_KEY}'"):
        _keys(ds.loader(batch_size=8, num_workers=workers))


def test_a_raising_decoder_is_named(images: pathlib.Path) -> None:
    def decoder(sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"] == "c0/img0003":
            raise KeyError("no such field")
        return sample

    ds = ShardDataset(images, decode=decoder, shuffle=False)
    with pytest.raises(SampleDecodeError, match="cannot decode sample 'c0/img0003'") as caught:
        _keys(ds.loader(batch_size=8))
    assert caught.value.field is None
    assert isinstance(caught.value.__cause__, KeyError)


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_skip_substitutes_deterministically(
    images: pathlib.Path, tmp_path: pathlib.Path, mode: str
) -> None:
    delivered: dict[int, list[str]] = {}
    for workers in (0, 2):
        journal = tmp_path / f"repairs-{workers}.jsonl"
        ds = ShardDataset(
            images,
            mode=mode,
            decode="pil",
            seed=7,
            recovery=RecoveryPolicy(policy="skip", journal=os.fspath(journal)),
        )
        loader = ds.loader(batch_size=8, num_workers=workers)
        keys = []
        for batch in loader:
            keys += batch["__key__"]
            assert all(image.size == (8, 8) for image in batch["jpg"])
        delivered[workers] = keys
        assert BAD_KEY not in keys
        assert len(keys) == NUM_FILES  # every rank's count stays the same
        assert len(set(keys)) == NUM_FILES - 1  # one sample came twice: the substitute
        assert ds.recovery_stats["skip"] == 1
        assert ds.recovery_stats["raise"] == 0
        assert ds.recovery_stats["retry"] == 0  # intact bytes are not read again
        events = [e for e in read_journal(journal) if e["event"] == "skip"]
        assert len(events) == 1
        assert events[0]["key"] == BAD_KEY
        assert "cannot decode" in events[0]["error"]
        assert events[0]["substitute_key"] in keys
        if workers:  # the events crossed from the workers with the batches
            assert [e["key"] for e in ds.recovery_events if e["event"] == "skip"] == [BAD_KEY]
    assert delivered[0] == delivered[2]


@pytest.mark.parametrize("mode", ["map", "stream"])
@pytest.mark.parametrize("workers", [0, 2])
def test_raise_policy_raises_the_typed_error(
    images: pathlib.Path, tmp_path: pathlib.Path, mode: str, workers: int
) -> None:
    ds = ShardDataset(
        images,
        mode=mode,
        decode="torch",
        seed=7,
        recovery=RecoveryPolicy(policy="raise", journal=os.fspath(tmp_path / "repairs.jsonl")),
    )
    with pytest.raises(SampleDecodeError) as caught:
        _keys(ds.loader(batch_size=8, num_workers=workers))
    assert caught.value.key == BAD_KEY
    assert ds.recovery_stats["raise"] == 1
    assert [e["event"] for e in read_journal(tmp_path / "repairs.jsonl")] == ["raise"]


def test_skip_takes_no_undecodable_substitute(images: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A substitute is decoded before it is taken: one that fails is passed over too."""
    refused = {"c0/img0000", "c1/img0001", "c2/img0002", "c0/img0006", BAD_KEY}

    def decoder(sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"] in refused:
            raise ValueError("refused")
        return sample

    ds = ShardDataset(
        images,
        decode=decoder,
        seed=3,
        recovery=RecoveryPolicy(policy="skip", journal=os.fspath(tmp_path / "repairs.jsonl")),
    )
    keys = _keys(ds.loader(batch_size=8, num_workers=0))
    assert len(keys) == NUM_FILES
    assert not refused & set(keys)
    assert ds.recovery_stats["skip"] == len(refused)
