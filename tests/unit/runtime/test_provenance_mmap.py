"""The opt-in mmap transport views only the very files its workers verified.

``shardio pack --force`` of another dataset into the directory a job reads renames new shards
over the old names between two batches: every sample delivered afterwards is either the
verified byte of the dataset the job opened or a StorageError naming the replaced shard,
never a byte of the other dataset.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import random

import pytest

from shardio.cli.main import main
from shardio.errors import ChecksumMismatchError, StorageError
from shardio.runtime.batch import MappedColumn
from shardio.runtime.dataset import ShardDataset

NUM_FILES = 160
BATCH = 16


def _tree(root: pathlib.Path, seed: int) -> dict[str, bytes]:
    """NUM_FILES random files of 300-700 bytes in 4 class folders; key -> bytes."""
    rng = random.Random(seed)
    payload = {}
    for i in range(NUM_FILES):
        key = f"c{i % 4}/f{i:04d}"
        data = rng.randbytes(rng.randrange(300, 700))
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / f"{key}.bin").write_bytes(data)
        payload[key] = data
    return payload


def _pack(src: pathlib.Path, dst: pathlib.Path, *extra: str) -> None:
    argv = ["pack", os.fspath(src), os.fspath(dst), "--shard-size", "16KiB", *extra]
    assert main(argv) == 0


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, bytes]]:
    """(folder holding trees a and b, tree a's bytes by key): b has a's keys, other bytes."""
    root = tmp_path_factory.mktemp("provenance-mmap")
    first = _tree(root / "a", seed=1)
    _tree(root / "b", seed=2)  # the same keys, other bytes: a lookalike
    return root, first


@pytest.mark.parametrize("workers", [0, 2])
def test_pack_force_between_batches_delivers_no_wrong_byte(
    tmp_path: pathlib.Path,
    trees: tuple[pathlib.Path, dict[str, bytes]],
    workers: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, first = trees
    dataset = tmp_path / "ds"
    _pack(root / "a", dataset)
    ds = ShardDataset(dataset, transport="mmap", shuffle=False)
    right = wrong = 0
    errors: list[StorageError] = []
    batches = iter(ds.loader(batch_size=BATCH, num_workers=workers))
    for n in itertools.count():
        try:
            batch = next(batches)
        except StopIteration:
            break
        except StorageError as exc:  # a worker found a shard that is not its index's
            errors.append(exc)
            break
        column = batch["bin"]
        assert isinstance(column, MappedColumn)
        if n == 1:  # later batches are prefetched and their shards mapped by the workers
            _pack(root / "b", dataset, "--force")
        try:
            for key, view in zip(batch["__key__"], column, strict=True):
                if bytes(view) == first[key]:
                    right += 1
                else:
                    wrong += 1
        except StorageError as exc:
            errors.append(exc)
    capsys.readouterr()
    assert wrong == 0, f"{wrong} samples of the replacing dataset delivered"
    assert right >= BATCH  # the batch before the replacement was read
    assert errors, "every batch after the replacement was delivered: nothing was replaced?"
    for error in errors:
        message = str(error)
        assert "\n" not in message
        assert str(dataset / "shards") in message
        assert isinstance(error, ChecksumMismatchError) or (
            "mmap transport" in message
            and "no longer the file a DataLoader worker verified" in message
        ), message
    if workers:  # prefetched batches a worker verified before the replacement
        assert any(not isinstance(e, ChecksumMismatchError) for e in errors)


def test_column_of_a_replaced_shard_is_refused(
    tmp_path: pathlib.Path, trees: tuple[pathlib.Path, dict[str, bytes]]
) -> None:
    """The receiving side checks the identity the reading side sends, also in one process:
    a shard renamed over between the read and the first view is refused."""
    root, _first = trees
    _pack(root / "a", tmp_path / "ds")
    _pack(root / "b", tmp_path / "other")
    ds = ShardDataset(tmp_path / "ds", transport="mmap", shuffle=False)
    batch = next(iter(ds.loader(batch_size=BATCH)))
    column = batch["bin"]
    assert isinstance(column, MappedColumn)
    shard = column.paths[0]
    os.replace(tmp_path / "other" / os.path.relpath(shard, tmp_path / "ds"), shard)
    with pytest.raises(StorageError, match="no longer the file a DataLoader worker verified"):
        bytes(column[0])
