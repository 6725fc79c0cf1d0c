"""ReusedBuffers: an in-process batch buffer is read into again only once nothing views it."""

from __future__ import annotations

import gc

import numpy as np
import torch

from shardio.runtime.batch import ByteColumn
from shardio.runtime.reuse import MAX_KEPT_BYTES, ReusedBuffers


def _column(buffers: ReusedBuffers, fill: int, n: int = 4096) -> ByteColumn:
    buffer = buffers.allocate(n)
    buffer.fill_(fill)
    return ByteColumn(buffer, np.array([0, n // 2, n], dtype=np.int64), np.ones(2, bool))


def test_a_released_buffer_is_read_into_again() -> None:
    buffers = ReusedBuffers(keep=1)
    first = buffers.allocate(100)
    where = first.data_ptr()
    del first
    gc.collect()
    assert buffers.allocate(80).data_ptr() == where


def test_nothing_taken_from_a_batch_sees_its_bytes_change() -> None:
    buffers = ReusedBuffers(keep=1)
    column = _column(buffers, 1)
    kept = [column[0], column.tensor(1), np.asarray(column[1])]
    del column
    gc.collect()
    for later in range(2, 6):  # each of these must take a fresh buffer, not the one viewed
        _column(buffers, later)
        gc.collect()
    assert bytes(kept[0]) == b"\x01" * 2048
    assert torch.equal(kept[1], torch.ones(2048, dtype=torch.uint8))
    assert kept[2].tolist() == [1] * 2048


def test_beyond_keep_a_fresh_buffer_and_a_larger_batch_grows_one() -> None:
    buffers = ReusedBuffers(keep=2)
    held = [buffers.allocate(10), buffers.allocate(10), buffers.allocate(10)]
    assert len({t.data_ptr() for t in held}) == 3
    del held
    gc.collect()
    big = buffers.allocate(1 << 20)
    assert big.numel() == 1 << 20 and big.is_contiguous()


def test_a_slightly_larger_batch_fits_the_buffer_kept() -> None:
    """Batches of a run vary a little in size: the next, a few percent larger, is read into
    the same buffer, not a fresh one faulted in page by page."""
    buffers = ReusedBuffers(keep=1)
    first = buffers.allocate(100_000)
    where = first.data_ptr()
    del first
    gc.collect()
    again = buffers.allocate(110_000)
    assert again.data_ptr() == where and again.numel() == 110_000


def test_a_column_read_from_still_pickles_and_iterates_as_it_indexes() -> None:
    import pickle

    buffer = torch.arange(10, dtype=torch.uint8)
    column = ByteColumn(
        buffer, np.array([0, 3, 3, 10], dtype=np.int64), np.array([True, False, True])
    )
    assert bytes(column[0]) == bytes([0, 1, 2]) and column[1] is None
    again = pickle.loads(pickle.dumps(column))  # a worker's fallback batch crosses pickled
    assert [None if v is None else bytes(v) for v in again] == [
        None if v is None else bytes(v) for v in (column[i] for i in range(3))
    ]
    assert bytes(column[-1]) == bytes(range(3, 10))


def test_a_huge_batch_buffer_is_not_kept(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import shardio.runtime.reuse as reuse

    monkeypatch.setattr(reuse, "MAX_KEPT_BYTES", 1000)
    buffers = ReusedBuffers(keep=1)
    huge = buffers.allocate(2000)
    assert huge.numel() == 2000
    del huge
    gc.collect()
    assert buffers._bytes == []  # nothing of its size stays with the process
    small = buffers.allocate(500)
    assert [len(b) for b in buffers._bytes] == [500 + 500 // 8] and small.numel() == 500
    assert MAX_KEPT_BYTES >= 64 << 20  # a real batch is kept
