"""Every batch transport delivers the same bytes; "ring" is the default; mapped columns gather
and pickle correctly."""

from __future__ import annotations

import pickle

import pytest

from shardio import ShardDataset, UsageError
from shardio.runtime.batch import ByteColumn, MappedColumn


@pytest.mark.parametrize("transport", ["ring", "mmap", "shm"])
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_transports_deliver_the_same_bytes(packed, transport, mode):
    ds = ShardDataset(packed.path, mode=mode, seed=3, transport=transport)
    seen = {}
    for batch in ds.loader(batch_size=16, num_workers=2):
        column = batch["jpeg"]
        assert isinstance(column, MappedColumn if transport == "mmap" else ByteColumn)
        for key, value in zip(batch["__key__"], column, strict=True):
            seen[key] = bytes(value)
    assert seen == {k: packed.payload[k] for k in packed.keys}


def test_ring_is_the_default_transport(packed_tar):
    assert ShardDataset(packed_tar.path).transport == "ring"


def test_mapped_column_gathers_into_one_buffer_and_survives_pickling(packed_tar):
    ds = ShardDataset(packed_tar.path, shuffle=False, transport="mmap")
    batch = ds.__getitems__(list(range(10)))
    column = batch["jpeg"]
    assert isinstance(column, MappedColumn)
    expected = [packed_tar.payload[k] for k in packed_tar.keys[:10]]
    buffer, offsets = column.buffer.numpy().tobytes(), column.offsets
    assert [buffer[offsets[i] : offsets[i + 1]] for i in range(10)] == expected
    clone = pickle.loads(pickle.dumps(column))
    assert [bytes(v) for v in clone] == expected
    assert bytes(clone.tensor(2).numpy()) == expected[2]


def test_unknown_transport_is_refused(packed_tar):
    with pytest.raises(UsageError, match="transport"):
        ShardDataset(packed_tar.path, transport="carrier-pigeon")


def test_a_byte_column_indexes_like_a_sequence():
    import numpy as np
    import torch

    buffer = torch.arange(12, dtype=torch.uint8)
    present = np.array([True, False, True, True])
    col = ByteColumn(buffer, np.array([2, 5, 5, 9, 12], dtype=np.int64), present)
    assert [None if v is None else bytes(v) for v in col] == [
        bytes([2, 3, 4]), None, bytes([5, 6, 7, 8]), bytes([9, 10, 11]),
    ]  # fmt: skip
    assert [None if col[i] is None else bytes(col[i]) for i in range(4)] == [
        None if v is None else bytes(v) for v in col
    ]
    assert bytes(col[-1]) == bytes([9, 10, 11])
    assert col[-3] is None
    assert bytes(col[np.int64(2)]) == bytes([5, 6, 7, 8])
    for out in (4, -5, 1 << 70):
        with pytest.raises(IndexError):
            col[out]
    with pytest.raises(TypeError):
        col[1.0]  # type: ignore[index]
