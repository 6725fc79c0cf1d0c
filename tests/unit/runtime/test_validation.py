"""Bad arguments to ShardDataset and ShardLoader fail at the call that received them, with a
UsageError (also a ValueError) naming the argument, instead of reading the wrong samples or
failing later."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shardio.errors import ShardioError, UsageError
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.loader import ShardLoader

SEED = 5


@pytest.fixture
def ds(packed_tar):
    dataset = ShardDataset(packed_tar.path, seed=SEED)
    yield dataset
    dataset.close()


def test_usage_error_is_a_value_error_and_a_shardio_error() -> None:
    assert issubclass(UsageError, ValueError)
    assert issubclass(UsageError, ShardioError)


# ---------------------------------------------------------------------------- indexes


@pytest.mark.parametrize("index", [3, np.int64(3), np.int32(3), np.uint16(3), torch.tensor(3)])
def test_integer_indexes_of_any_kind_read_the_same_sample(ds, packed_tar, index) -> None:
    sample = ds[index]
    assert packed_tar.check_sample(sample) == packed_tar.keys[3]


def test_negative_index_counts_from_the_end(ds, packed_tar) -> None:
    assert ds[-1]["__key__"] == packed_tar.keys[-1]


@pytest.mark.parametrize(
    "index",
    [1.5, 2.0, np.float64(1.0), np.float32(2.5), "3", b"3", None, True, False, np.bool_(True)],
    ids=repr,
)
def test_non_integer_index_is_refused(ds, index) -> None:
    with pytest.raises(UsageError, match="sample index must be an integer"):
        ds[index]


@pytest.mark.parametrize("index", [600, -601, 10**30])
def test_out_of_range_index_is_an_index_error(ds, index) -> None:
    with pytest.raises(IndexError, match="out of range"):
        ds[index]


def test_a_batch_with_a_float_index_is_refused(ds) -> None:
    """``__getitems__`` (what a DataLoader calls) used to truncate 1.5 to 1."""
    with pytest.raises(UsageError, match="sample index"):
        ds.__getitems__([0, 1.5, 2])
    assert ds.__getitems__([np.int64(0), 1])["__key__"] == [ds[0]["__key__"], ds[1]["__key__"]]


def test_stream_mode_refuses_float_indexes_too(packed_tar) -> None:
    stream = ShardDataset(packed_tar.path, mode="stream", seed=SEED)
    with pytest.raises(UsageError, match="sample index"):
        stream[0.5]


# ------------------------------------------------------------------------ constructor


@pytest.mark.parametrize("seed", [0, 2**64 - 1, np.int64(7), np.uint64(2**63)])
def test_good_seeds(packed_tar, seed) -> None:
    ds = ShardDataset(packed_tar.path, seed=seed)
    assert ds.seed == int(seed)
    assert type(ds.seed) is int  # a numpy seed would break json.dumps(state_dict())
    json.dumps(ds.state_dict())


@pytest.mark.parametrize(
    ("seed", "needle"),
    [
        (1.0, "seed must be an integer, got float"),
        (np.float64(3), "seed must be an integer, got float64"),
        ("42", "seed must be an integer, got str"),
        (True, "seed must be an integer, not a bool"),
        (-1, "seed must be at least 0"),
        (2**64, "seed must be below 2\\*\\*64"),
    ],
)
def test_bad_seed(packed_tar, seed, needle) -> None:
    with pytest.raises(UsageError, match=needle):
        ShardDataset(packed_tar.path, seed=seed)


@pytest.mark.parametrize(
    ("window", "needle"),
    [
        (0, "window_shards must be at least 1, got 0"),
        (-2, "window_shards must be at least 1, got -2"),
        (2.5, "window_shards must be an integer"),
        (True, "window_shards must be an integer, not a bool"),
    ],
)
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_bad_window_shards(packed_tar, mode, window, needle) -> None:
    with pytest.raises(UsageError, match=needle):
        ShardDataset(packed_tar.path, mode=mode, order="shard-local", window_shards=window)


@pytest.mark.parametrize("max_open", [0, -1, 1.5])
def test_bad_max_open(packed_tar, max_open) -> None:
    with pytest.raises(UsageError, match="max_open"):
        ShardDataset(packed_tar.path, max_open=max_open)


# -------------------------------------------------------------------------- set_epoch


@pytest.mark.parametrize(
    ("epoch", "needle"),
    [
        (-1, "epoch must be at least 0, got -1"),
        (1.0, "epoch must be an integer, got float"),
        ("2", "epoch must be an integer, got str"),
        (True, "epoch must be an integer, not a bool"),
    ],
)
def test_bad_epoch(ds, epoch, needle) -> None:
    before = ds.epoch_order().copy()
    with pytest.raises(UsageError, match=needle):
        ds.set_epoch(epoch)
    with pytest.raises(UsageError, match=needle):
        ds.loader(batch_size=8).set_epoch(epoch)
    assert ds.epoch == 0
    assert (ds.epoch_order() == before).all()


def test_numpy_epoch_is_accepted(ds) -> None:
    ds.set_epoch(np.int64(2))
    assert ds.epoch == 2
    assert type(ds.epoch) is int


# --------------------------------------------------------------------- load_state_dict


@pytest.fixture
def state(ds):
    loader = ds.loader(batch_size=16)
    it = iter(loader)
    next(it)
    it.close()
    saved = json.loads(json.dumps(loader.state_dict()))
    assert saved["consumed"] == 16
    return saved


def _without(state, key):
    return {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize(
    "key",
    ["version", "epoch", "spec", "num_samples", "consumed", "world_size", "ranks_per_node",
     "history"],
)  # fmt: skip
def test_state_missing_a_key(packed_tar, state, key) -> None:
    fresh = ShardDataset(packed_tar.path, seed=SEED)
    with pytest.raises(UsageError, match=f"lacks '{key}'"):
        fresh.load_state_dict(_without(state, key))


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("consumed", -1, "'consumed' must be at least 0"),
        ("consumed", 601, "'consumed' is 601, more than its 600 samples"),
        ("consumed", 10**20, "'consumed' is"),
        ("consumed", "16", "'consumed' must be an integer, got str"),
        ("consumed", 16.0, "'consumed' must be an integer, got float"),
        ("consumed", True, "'consumed' must be an integer, not a bool"),
        ("consumed", None, "'consumed' must be an integer"),
        ("epoch", -1, "'epoch' must be at least 0"),
        ("epoch", 1.5, "'epoch' must be an integer"),
        ("epoch", "0", "'epoch' must be an integer"),
        ("world_size", 0, "'world_size' must be at least 1"),
        ("world_size", -3, "'world_size' must be at least 1, got -3"),
        ("world_size", 2.0, "'world_size' must be an integer"),
        ("spec.seed", "5", "seed must be an integer"),
        ("spec.seed", 5.0, "seed must be an integer"),
        ("spec.window_shards", 0, "window must be at least 1"),
        ("spec.order", 3, "invalid order 3"),
        ("spec.partition", "rack", "invalid partition 'rack'"),
        ("spec.colour", "red", "unknown keys"),
        ("spec", "random", "must be a dict"),
        ("history", [[2, 1]], "'history' must be a list"),
        ("history", [[0, 1, 5]], "world_size must be at least 1"),
        ("ranks_per_node", 0, "'ranks_per_node' must be at least 1"),
        ("num_samples", "600", "'num_samples' must be an integer"),
        ("version", "1", "version '1'"),
        ("version", True, "version True"),
    ],
)
def test_state_with_a_bad_value(packed_tar, state, key, value, needle) -> None:
    fresh = ShardDataset(packed_tar.path, seed=SEED)
    loader = fresh.loader(batch_size=16)
    if key.startswith("spec."):
        bad = {**state, "spec": {**state["spec"], key[5:]: value}}
    else:
        bad = {**state, key: value}
    with pytest.raises(UsageError, match=needle.replace("(", r"\(")):
        fresh.load_state_dict(bad)
    with pytest.raises(UsageError, match=needle.replace("(", r"\(")):
        loader.load_state_dict(bad)
    # Nothing was taken from the bad state: the loader still reads the whole epoch.
    assert fresh.epoch == 0
    assert len(packed_tar.keys_of(loader)) == 600


@pytest.mark.parametrize("state_value", [None, [], "state", 3])
def test_state_that_is_not_a_dict(ds, state_value) -> None:
    with pytest.raises(UsageError, match="must be a dict"):
        ds.load_state_dict(state_value)


def test_a_good_state_still_resumes(packed_tar, state) -> None:
    fresh = ShardDataset(packed_tar.path, seed=SEED)
    loader = fresh.loader(batch_size=16)
    loader.load_state_dict(state)
    assert len(packed_tar.keys_of(loader)) == 600 - 16


def test_consumed_equal_to_num_samples_is_the_end_of_the_epoch(packed_tar, state) -> None:
    fresh = ShardDataset(packed_tar.path, seed=SEED)
    loader = fresh.loader(batch_size=16)
    loader.load_state_dict({**state, "consumed": 600})
    assert list(loader) == []


@pytest.mark.parametrize("consumed", [-1, 2.5])
def test_rank_indices_refuses_a_bad_consumed(ds, consumed) -> None:
    with pytest.raises(UsageError, match="consumed"):
        ds.rank_indices(consumed=consumed)


# ---------------------------------------------------------------------------- loader


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"batch_size": -4}, "batch_size must be at least 1"),
        ({"batch_size": 2.5}, "batch_size must be an integer, got float"),
        ({"batch_size": "8"}, "batch_size must be an integer, got str"),
        ({"batch_size": True}, "batch_size must be an integer, not a bool"),
        ({"batch_size": 8, "num_workers": -1}, "num_workers must be at least 0, got -1"),
        ({"batch_size": 8, "num_workers": 1.0}, "num_workers must be an integer, got float"),
        ({"batch_size": 8, "num_workers": True}, "num_workers must be an integer, not a bool"),
        ({"batch_size": 8, "num_workers": 99_999}, "num_workers must be at most 1024, got 99999"),
    ],
)
def test_bad_loader_arguments(ds, kwargs, needle) -> None:
    with pytest.raises(UsageError, match=needle):
        ShardLoader(ds, **kwargs)
    with pytest.raises(UsageError, match=needle):
        ds.loader(**kwargs)


def test_numpy_batch_size_is_accepted(ds, packed_tar) -> None:
    loader = ShardLoader(ds, batch_size=np.int64(100), num_workers=np.int32(0))
    assert loader.batch_size == 100
    assert len(loader) == 6
    packed_tar.assert_exactly_once(packed_tar.keys_of(loader))
