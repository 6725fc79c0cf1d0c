"""ShardDataset in map and stream mode, alone and through ``ds.loader()``: every sample's bytes,
each sample exactly once per epoch, deterministic orders, decoding, and corrupt bytes caught."""

from __future__ import annotations

import gc
import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from shardio.errors import ChecksumMismatchError, IntegrityError, UsageError
from shardio.runtime.batch import ByteColumn
from shardio.runtime.dataset import ShardDataset, ShardStreamDataset

MODES = ("map", "stream")
BATCH = 32


def shard_windows(shards: list[int], sizes: tuple[int, ...]) -> list[set[int]]:
    """Split a sequence of shard numbers into consecutive runs that each hold every sample of
    the shards they touch; fail if that is impossible."""
    windows: list[set[int]] = []
    current: set[int] = set()
    seen = needed = 0
    for shard in shards:
        if shard not in current:
            current.add(shard)
            needed += sizes[shard]
        seen += 1
        if seen == needed:
            windows.append(current)
            current, seen, needed = set(), 0, 0
    assert not current, f"the order ends inside an incomplete window of shards {current}"
    return windows


# ------------------------------------------------------------------------------- map mode


def test_map_len_and_getitem_return_source_bytes(packed):
    ds = ShardDataset(packed.path)
    assert isinstance(ds, ShardDataset)
    assert not isinstance(ds, ShardStreamDataset)
    assert len(ds) == len(packed.keys) == 600
    keys = [packed.check_sample(ds[i]) for i in range(len(ds))]
    assert keys == list(packed.keys)
    assert ds[-1]["__key__"] == packed.keys[-1]
    assert ds.classes is not None
    assert len(ds.classes) == 6


def test_map_getitem_out_of_range_raises_index_error(packed_tar):
    ds = ShardDataset(packed_tar.path)
    with pytest.raises(IndexError, match="600"):
        ds[600]
    with pytest.raises(IndexError):
        ds[-601]


def test_a_batch_of_indices_is_checked_as_each_index_is(packed_tar):
    """``__getitems__`` (the DataLoader's batch read) checks a batch of plain ints at once,
    anything else one by one: the same samples and the same errors as ``ds[i]``."""
    ds = ShardDataset(packed_tar.path)
    keys = packed_tar.keys
    for batch in ([3, 0, 599], [-1, 5, -600], [np.int64(7), 2]):
        got = ds.__getitems__(batch)
        assert got["__key__"] == [keys[int(i)] for i in batch]
    for bad, error in (([0, 600], IndexError), ([-601, 1], IndexError), ([0, 1 << 70], IndexError)):
        with pytest.raises(error):
            ds.__getitems__(bad)
    for bad in ([0, 1.0], [0, True], [0, "1"]):
        with pytest.raises(UsageError, match="sample index"):
            ds.__getitems__(bad)


@pytest.mark.parametrize("mode", MODES)
def test_dataset_survives_pickling(packed_tar, mode):
    """A DataLoader started with the spawn or forkserver context pickles the dataset."""
    ds = ShardDataset(packed_tar.path, mode=mode, seed=4)
    clone = pickle.loads(pickle.dumps(ds))
    assert type(clone) is type(ds)
    assert packed_tar.check_sample(clone[5]) == packed_tar.keys[5]
    assert clone.epoch_order().tolist() == ds.epoch_order().tolist()


def test_loader_with_forkserver_workers(packed_tar):
    """forkserver is Python 3.14's default start method on Linux; workers get a pickled copy
    of the dataset."""
    ds = ShardDataset(packed_tar.path, seed=4)
    loader = ds.loader(batch_size=100, num_workers=1, multiprocessing_context="forkserver")
    keys = [k for b in loader for k in packed_tar.check_batch(b)]
    packed_tar.assert_exactly_once(keys)


# ---------------------------------------------------------------------------- stream mode


def test_stream_iteration_covers_every_sample_once(packed):
    ds = ShardDataset(packed.path, mode="stream")
    assert isinstance(ds, ShardStreamDataset)
    assert len(ds) == 600
    keys = [packed.check_sample(sample) for sample in ds]
    packed.assert_exactly_once(keys)


def test_stream_default_order_is_shard_local(packed_tar):
    ds = ShardDataset(packed_tar.path, mode="stream", seed=1)
    keys = [s["__key__"] for s in ds]
    windows = shard_windows([packed_tar.shard_of[k] for k in keys], packed_tar.shard_sizes)
    assert all(len(w) <= 4 for w in windows)
    assert len(windows) >= -(-packed_tar.num_shards // 4)
    assert keys != list(packed_tar.keys)


# --------------------------------------------------------------------------------- loader


@pytest.mark.parametrize("mode", MODES)
def test_loader_epoch_delivers_every_sample_once_with_its_bytes(packed, mode):
    ds = ShardDataset(packed.path, mode=mode, seed=11)
    loader = ds.loader(batch_size=BATCH, num_workers=2)
    batches = list(loader)
    keys = [k for b in batches for k in packed.check_batch(b)]
    packed.assert_exactly_once(keys)
    assert len(batches) == len(loader) == -(-600 // BATCH)
    assert [len(b["__key__"]) for b in batches[:-1]] == [BATCH] * (len(batches) - 1)


@pytest.mark.parametrize("mode", MODES)
def test_loader_order_is_deterministic_and_changes_with_epoch(packed, mode):
    first = packed.keys_of(ShardDataset(packed.path, mode=mode, seed=5).loader(BATCH, 2))
    ds = ShardDataset(packed.path, mode=mode, seed=5)
    loader = ds.loader(batch_size=BATCH, num_workers=2)
    second = packed.keys_of(loader)
    assert second == first
    loader.set_epoch(1)
    third = packed.keys_of(loader)
    packed.assert_exactly_once(third)
    assert third != first
    other_seed = packed.keys_of(ShardDataset(packed.path, mode=mode, seed=6).loader(BATCH, 0))
    assert other_seed != first


@pytest.mark.parametrize("mode", MODES)
def test_unshuffled_loader_reads_in_dataset_order(packed, mode):
    ds = ShardDataset(packed.path, mode=mode, shuffle=False)
    keys = [k for b in ds.loader(batch_size=BATCH, num_workers=2) for k in packed.check_batch(b)]
    assert keys == list(packed.keys)
    if mode == "stream":
        assert [s["__key__"] for s in ShardDataset(packed.path, mode=mode, shuffle=False)] == list(
            packed.keys
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [1, 2])
def test_shard_local_order_reads_windows_of_shards(packed_tar, mode, window):
    ds = ShardDataset(packed_tar.path, mode=mode, order="shard-local", window_shards=window, seed=9)
    keys = packed_tar.keys_of(ds.loader(batch_size=BATCH, num_workers=2))
    packed_tar.assert_exactly_once(keys)
    windows = shard_windows([packed_tar.shard_of[k] for k in keys], packed_tar.shard_sizes)
    assert [len(w) for w in windows[:-1]] == [window] * (len(windows) - 1)
    assert len(windows) == -(-packed_tar.num_shards // window)
    # Samples are shuffled inside each window, not read in dataset order.
    first = keys[: sum(packed_tar.shard_sizes[s] for s in windows[0])]
    assert first != sorted(first, key=packed_tar.keys.index)


def test_random_order_mixes_across_shards(packed_tar):
    ds = ShardDataset(packed_tar.path, seed=2)
    first_batch = next(iter(ds.loader(batch_size=BATCH, num_workers=0)))["__key__"]
    assert len({packed_tar.shard_of[k] for k in first_batch}) > 4


@pytest.mark.parametrize("mode", MODES)
def test_pil_decode_gives_images(packed_tar, mode):
    ds = ShardDataset(packed_tar.path, mode=mode, decode="pil", seed=3)
    batches = list(ds.loader(batch_size=16, num_workers=2))
    keys = packed_tar.keys_of(batches)
    packed_tar.assert_exactly_once(keys)
    for batch in batches[:2]:
        assert isinstance(batch["__key__"], list)
        assert isinstance(batch["jpeg"], list)
        assert isinstance(batch["cls"], torch.Tensor)
        assert batch["cls"].dtype == torch.int64
        for key, image, label in zip(batch["__key__"], batch["jpeg"], batch["cls"], strict=True):
            assert isinstance(image, Image.Image)
            assert image.mode == "RGB"
            with Image.open(io.BytesIO(packed_tar.payload[key])) as ref:
                assert image.tobytes() == ref.convert("RGB").tobytes()
            assert int(label) == packed_tar.label[key]
    if mode == "map":
        sample = ds[3]
        assert isinstance(sample["jpeg"], Image.Image)
        assert sample["cls"] == packed_tar.label[sample["__key__"]]


@pytest.fixture(scope="module")
def packed_few(runtime_tree, pack_tree):
    """The 600 samples in 1 MiB tar shards: only a handful of shards."""
    packed = pack_tree(runtime_tree, "tar", 1024 * 1024)
    assert 2 <= packed.num_shards <= 6
    return packed


# torch warns when workers outnumber the cores (2 on CI): that is the point here.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_size", [32, 256])
def test_more_workers_than_shards_still_delivers_everything_once(packed_few, mode, batch_size):
    workers = packed_few.num_shards + 2
    ds = ShardDataset(packed_few.path, mode=mode, seed=8)
    batches = list(ds.loader(batch_size=batch_size, num_workers=workers))
    keys = [k for b in batches for k in packed_few.check_batch(b)]
    packed_few.assert_exactly_once(keys)
    assert len(batches) == -(-600 // batch_size)


# ----------------------------------------------------------------------- corrupt bytes


def test_flipped_byte_raises_checksum_mismatch_on_getitem(packed, corrupt_copy):
    bad = 137
    key = packed.keys[bad]
    copy, shard, _ = corrupt_copy(packed, key)
    ds = ShardDataset(copy.path)
    with pytest.raises(ChecksumMismatchError) as info:
        ds[bad]
    err = info.value
    assert isinstance(err, IntegrityError)
    assert isinstance(err, OSError)
    assert err.key == key
    assert err.path == shard
    assert key in str(err)
    assert err.expected != err.actual
    # The neighbours are intact, and without verification the damaged bytes come back.
    packed.check_sample(ds[bad - 1])
    packed.check_sample(ds[bad + 1])
    raw = ShardDataset(copy.path, verify=False)[bad]["jpeg"]
    assert len(raw) == len(packed.payload[key])
    assert sum(a != b for a, b in zip(raw, packed.payload[key], strict=True)) == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("workers", [0, 2])
def test_flipped_byte_raises_checksum_mismatch_from_loader(packed_tar, corrupt_copy, mode, workers):
    key = packed_tar.keys[250]
    copy, _, _ = corrupt_copy(packed_tar, key)
    ds = ShardDataset(copy.path, mode=mode, seed=1)
    delivered: list[str] = []
    raised = None
    try:
        for batch in ds.loader(batch_size=BATCH, num_workers=workers):
            delivered.extend(packed_tar.check_batch(batch))
    except Exception as exc:
        # Keep no reference to the traceback: it holds the DataLoader iterator, whose
        # workers would then only be shut down by a later garbage collection.
        raised = (type(exc), getattr(exc, "key", None), str(exc))
    gc.collect()
    assert raised is not None, "the damaged sample was not reported"
    kind, err_key, message = raised
    assert kind is ChecksumMismatchError, f"got {kind.__name__}: {message[:300]}"
    assert err_key == key
    assert key in message
    assert key not in delivered


def test_flipped_byte_raises_checksum_mismatch_in_stream_iteration(packed_tar, corrupt_copy):
    key = packed_tar.keys[10]
    copy, _, _ = corrupt_copy(packed_tar, key)
    with pytest.raises(ChecksumMismatchError) as info:
        for sample in ShardDataset(copy.path, mode="stream"):
            assert sample["__key__"] != key
    assert info.value.key == key


def test_batch_columns_are_byte_columns(packed_tar):
    ds = ShardDataset(packed_tar.path, shuffle=False)
    batch = next(iter(ds.loader(batch_size=8, num_workers=0)))
    column = batch["jpeg"]
    assert isinstance(column, ByteColumn)
    assert [bytes(v) for v in column] == [packed_tar.payload[k] for k in packed_tar.keys[:8]]
    assert bytes(column.tensor(3).numpy()) == packed_tar.payload[packed_tar.keys[3]]


def test_a_decoder_that_drops_the_key_still_loads(packed_tar):
    """The loader counts samples by key: a decode callable need not carry ``__key__``."""
    ds = ShardDataset(packed_tar.path, decode=lambda s: {"n": len(s["jpeg"])})
    keys = [k for b in ds.loader(batch_size=32, num_workers=0) for k in b["__key__"]]
    packed_tar.assert_exactly_once(keys)
