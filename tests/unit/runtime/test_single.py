"""read_one (``ds[i]``) gives what a batch of one gives, for every kind of sample."""

from __future__ import annotations

import pathlib

import pytest
from conftest import run_shardio
from trees import write_tree

from shardio import ShardDataset
from shardio.errors import ChecksumMismatchError
from shardio.read.reader import ShardReader
from shardio.runtime.batch import read_batch
from shardio.runtime.single import read_one

# Samples of several members, one without a label file, a member that is a real .cls file.
_TREE = {
    b"a/x1.jpg": b"\xff\xd8 one",
    b"a/x1.json": b'{"k": 1}',
    b"a/x2.jpg": b"\xff\xd8 two",
    b"a/x2.cls": b"7",
    b"b/y1.jpg": b"\xff\xd8 three" * 50,
    b"b/y1.txt": b"",
}


def _as_batch_of_one(ds: ShardReader, sample: int) -> dict[str, object]:
    batch = read_batch(ds, [sample], shared=False)
    out: dict[str, object] = {}
    for key, value in batch.items():
        if key == "__key__":
            out[key] = value[0]
        elif key == "cls" and not hasattr(value, "offsets"):
            out[key] = int(value[0])
        else:
            out[key] = bytes(value[0])
    return out


def _check_every_sample(root: pathlib.Path) -> None:
    with ShardReader(root) as ds:
        for sample in range(len(ds)):
            one, batch = read_one(ds, sample), _as_batch_of_one(ds, sample)
            assert one == batch
            assert list(one) == list(batch)  # the same field order
        assert ds.metrics.counts["samples"] == 2 * len(ds)


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_labelled_imagenet_samples(packed_small, fmt: str) -> None:  # type: ignore[no-untyped-def]
    _check_every_sample(packed_small(fmt)[0])


@pytest.mark.parametrize("labels", ["none", "auto"])
def test_samples_of_several_members(tmp_path: pathlib.Path, labels: str) -> None:
    write_tree(tmp_path / "src", _TREE)
    out = tmp_path / "ds"
    result = run_shardio("pack", tmp_path / "src", out, "--labels", labels, "--no-progress")
    assert result.rc == 0, result.stderr
    _check_every_sample(out)
    ds = ShardDataset(out, shuffle=False)
    samples = {ds[i]["__key__"]: ds[i] for i in range(len(ds))}
    ds.close()
    assert sorted(samples) == ["a/x1", "a/x2", "b/y1"]
    assert samples["a/x1"]["json"] == b'{"k": 1}' and samples["b/y1"]["txt"] == b""


def test_a_damaged_member_names_its_sample(packed_small, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    root = tmp_path / "ds"
    shutil.copytree(packed_small("tar")[0], root)
    with ShardReader(root) as ds:
        sample = 5
        key = ds.key(sample)
        rec = ds.index.members[int(ds.index.samples["first_member"][sample])]
        path = root / ds.manifest.shards[ds.shard_of(sample)].path
    with open(path, "r+b") as fh:
        fh.seek(int(rec["offset"]) + int(rec["size"]) // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with ShardReader(root) as ds, pytest.raises(ChecksumMismatchError, match=key):
        read_one(ds, sample)
