"""Resumable state (the torchdata habit): save mid-epoch, restore into a fresh object, compare
with an uninterrupted epoch; also across a change in the number of ranks."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from resuming import assert_resumed_exactly, resumed, saved, take

from shardio.errors import UsageError
from shardio.order import EpochOrder, OrderSpec, RankInfo, rank_stream
from shardio.runtime.dataset import ShardDataset

MODES = ("map", "stream")
BATCH = 32
SEED = 21


# ------------------------------------------------------------------ single-rank resume


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", MODES)
def test_loader_resume_mid_epoch_equals_uninterrupted_epoch(packed, mode, workers):
    full = packed.keys_of(ShardDataset(packed.path, mode=mode, seed=SEED).loader(BATCH, workers))
    packed.assert_exactly_once(full)

    ds = ShardDataset(packed.path, mode=mode, seed=SEED)
    loader = ds.loader(batch_size=BATCH, num_workers=workers)
    head = take(loader, 5)
    state = saved(loader.state_dict())
    assert state["consumed"] == 5 * BATCH
    assert state["epoch"] == 0

    again = resumed(
        lambda: ShardDataset(packed.path, mode=mode, seed=SEED).loader(BATCH, workers), state
    )
    assert_resumed_exactly(head, packed.keys_of(again), full)
    assert again.state_dict()["consumed"] == 600


@pytest.mark.parametrize("mode", MODES)
def test_loader_resume_twice_and_at_the_edges(packed_tar, mode):
    full = packed_tar.keys_of(ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH))
    pieces: list[str] = []
    state = None
    for k in (0, 3, 7, 100):  # nothing, a bit, more, past the end of the epoch
        loader = ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH, 0)
        if state is not None:
            loader.load_state_dict(state)
        pieces += take(loader, k)
        state = saved(loader.state_dict())
    assert pieces == full
    assert state["consumed"] == 600
    done = ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH)
    done.load_state_dict(state)
    assert list(done) == []


@pytest.mark.parametrize("mode", MODES)
def test_reiterating_a_loader_continues_where_it_stopped(packed_tar, mode):
    full = packed_tar.keys_of(ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH))
    loader = ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH, 2)
    head = take(loader, 4)
    assert head + packed_tar.keys_of(loader) == full


@pytest.mark.parametrize("mode", MODES)
def test_resume_in_a_later_epoch(packed_tar, mode):
    ds = ShardDataset(packed_tar.path, mode=mode, seed=SEED)
    loader = ds.loader(batch_size=BATCH, num_workers=0)
    loader.set_epoch(3)
    epoch3 = packed_tar.keys_of(loader)
    packed_tar.assert_exactly_once(epoch3)

    loader = ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH, 2)
    loader.set_epoch(3)
    head = take(loader, 2)
    state = saved(loader.state_dict())
    assert state["epoch"] == 3
    again = resumed(
        lambda: ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH, 2), state
    )
    assert_resumed_exactly(head, packed_tar.keys_of(again), epoch3)


@pytest.mark.parametrize("mode", MODES)
def test_dataset_set_epoch_starts_a_full_epoch_of_its_loader(packed_tar, mode):
    """``ds.set_epoch(e)`` (the DistributedSampler habit) between epochs of ``ds.loader()``
    must give a whole new epoch, as ``loader.set_epoch(e)`` does."""
    ds = ShardDataset(packed_tar.path, mode=mode, seed=SEED)
    loader = ds.loader(batch_size=BATCH, num_workers=0)
    packed_tar.assert_exactly_once(packed_tar.keys_of(loader))
    ds.set_epoch(1)
    epoch1 = packed_tar.keys_of(loader)
    packed_tar.assert_exactly_once(epoch1)
    reference = ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(BATCH)
    reference.set_epoch(1)
    assert epoch1 == packed_tar.keys_of(reference)


def test_stream_direct_iteration_resumes_from_dataset_state(packed):
    full = [s["__key__"] for s in ShardDataset(packed.path, mode="stream", seed=SEED)]
    packed.assert_exactly_once(full)
    ds = ShardDataset(packed.path, mode="stream", seed=SEED)
    head = [s["__key__"] for s in itertools.islice(iter(ds), 77)]
    state = saved(ds.state_dict())
    assert state["consumed"] == 77
    fresh = ShardDataset(packed.path, mode="stream", seed=SEED)
    fresh.load_state_dict(state)
    tail = [packed.check_sample(s) for s in fresh]
    assert head + tail == full


def test_stream_state_stays_true_when_iteration_is_restarted(packed_tar):
    """Break out of the loop, start a new ``for`` over the dataset, checkpoint: resuming from
    that checkpoint must neither skip nor repeat samples of what was delivered."""
    ds = ShardDataset(packed_tar.path, mode="stream", seed=SEED)
    delivered = [s["__key__"] for s in itertools.islice(iter(ds), 40)]
    delivered += [s["__key__"] for s in itertools.islice(iter(ds), 25)]
    state = ds.state_dict()
    fresh = ShardDataset(packed_tar.path, mode="stream", seed=SEED)
    fresh.load_state_dict(state)
    delivered += [s["__key__"] for s in fresh]
    packed_tar.assert_exactly_once(delivered)


@pytest.mark.parametrize(
    ("change", "value"),
    [("seed", SEED + 1), ("order", "random"), ("window_shards", 2)],
)
def test_load_state_refuses_a_different_order(packed_tar, change, value):
    """A state resumes exactly only into a dataset whose epoch order is the same."""
    kwargs = {"mode": "stream", "seed": SEED, "order": "shard-local", "window_shards": 4}
    ds = ShardDataset(packed_tar.path, **kwargs)
    loader = ds.loader(batch_size=BATCH)
    take(loader, 2)
    state = loader.state_dict()
    other = ShardDataset(packed_tar.path, **{**kwargs, change: value})
    assert other.epoch_order().tolist() != ds.epoch_order().tolist()
    with pytest.raises(UsageError, match=change):
        other.loader(batch_size=BATCH).load_state_dict(state)


def test_load_state_refuses_another_dataset_and_version(packed_tar):
    ds = ShardDataset(packed_tar.path, mode="stream", seed=SEED)
    loader = ds.loader(batch_size=BATCH)
    take(loader, 1)
    state = loader.state_dict()
    with pytest.raises(UsageError, match="num_samples"):
        ds.load_state_dict({**state, "num_samples": 599})
    with pytest.raises(UsageError, match="version"):
        ds.load_state_dict({**state, "version": 99})


# ---------------------------------------------------------------------------- elastic


def expected_padding(order_keys, consumed, world, *, drop_last):
    """(per-rank count, the keys that padding repeats) for the rest of an epoch."""
    rest = len(order_keys) - consumed
    if drop_last:
        return rest // world, []
    per_rank = -(-rest // world)
    pad = per_rank * world - rest
    # Padding repeats the epoch order from its start.
    return per_rank, list(np.resize(np.array(order_keys, dtype=object), pad))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("world_before", "world_after"), [(2, 3), (3, 2), (4, 7)])
@pytest.mark.parametrize("mode", MODES)
def test_elastic_resume_with_another_number_of_ranks(
    packed_tar, mode, world_before, world_after, drop_last
):
    bs, k = 16, 5

    def dataset(rank, world):
        return ShardDataset(
            packed_tar.path,
            mode=mode,
            seed=SEED,
            drop_last=drop_last,
            ranks=RankInfo(rank=rank, world_size=world),
        )

    order_keys = [packed_tar.keys[i] for i in dataset(0, 1).epoch_order()]

    # Phase 1: every rank delivers k batches in lockstep, then the job dies.
    phase1: list[str] = []
    states = []
    for rank in range(world_before):
        loader = dataset(rank, world_before).loader(batch_size=bs, num_workers=0)
        keys = take(loader, k)
        assert len(keys) == k * bs
        phase1 += keys
        states.append(saved(loader.state_dict()))
    consumed = k * bs * world_before
    assert all(s == states[0] for s in states), "ranks disagree on the epoch position"
    assert states[0]["consumed"] == consumed
    assert sorted(phase1) == sorted(order_keys[:consumed])

    # Phase 2: another number of ranks resumes from rank 0's checkpoint.
    per_rank, padding = expected_padding(order_keys, consumed, world_after, drop_last=drop_last)
    phase2: list[str] = []
    for rank in range(world_after):
        loader = dataset(rank, world_after).loader(batch_size=bs, num_workers=0)
        loader.load_state_dict(states[0])
        keys = packed_tar.keys_of(loader)
        assert len(keys) == per_rank, f"rank {rank} of {world_after}"
        phase2 += keys

    counts = collections.Counter(phase1 + phase2)
    repeated = collections.Counter({k: n - 1 for k, n in counts.items() if n > 1})
    assert repeated == collections.Counter(padding)
    if drop_last:
        cut = (len(order_keys) - consumed) % world_after
        assert set(counts) == set(order_keys[: len(order_keys) - cut])
    else:
        assert set(counts) == set(packed_tar.keys)


@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_with_loader_workers(packed_hdf5, workers):
    """2 ranks -> 3 ranks, stream mode, batches built in worker processes."""
    bs = 16

    def loader(rank, world):
        ds = ShardDataset(
            packed_hdf5.path, mode="stream", seed=SEED, ranks=RankInfo(rank=rank, world_size=world)
        )
        return ds.loader(batch_size=bs, num_workers=workers)

    phase1 = []
    for rank in range(2):
        ld = loader(rank, 2)
        phase1 += take(ld, 6)
        state = ld.state_dict()
    phase2 = []
    for rank in range(3):
        ld = loader(rank, 3)
        ld.load_state_dict(state)
        phase2 += packed_hdf5.keys_of(ld)
    rest = 600 - 2 * 6 * bs
    assert len(phase2) == -(-rest // 3) * 3
    assert set(phase1 + phase2) == set(packed_hdf5.keys)
    assert len(phase1 + phase2) - 600 == -(-rest // 3) * 3 - rest


# --------------------------------------------------------------------- equal counts


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_the_same_count(drop_last):
    for n, world, consumed in itertools.product(
        [0, 1, 2, 5, 16, 17, 33, 100], [1, 2, 3, 4, 7, 8], [0, 1, 5]
    ):
        order = EpochOrder(np.array([n]), seed=1, epoch=0, order="random").materialise()
        done = min(consumed, n)
        rest = n - done
        spec = OrderSpec(order="random", seed=1, drop_last=drop_last)
        parts = [
            rank_stream(
                np.array([n]), spec, 0, RankInfo(rank=r, world_size=world), consumed=consumed
            ).materialise()
            for r in range(world)
        ]
        counts = {len(p) for p in parts}
        expected = rest // world if drop_last else -(-rest // world)
        assert counts == {expected}, (n, world, consumed, drop_last, counts)
        delivered = np.concatenate(parts).tolist() if parts else []
        if drop_last:
            assert len(set(delivered)) == len(delivered)
            assert sorted(delivered) == sorted(order[done : done + expected * world].tolist())
        else:
            # Padding repeats the epoch order from its very start.
            padding = np.resize(order, expected * world - rest).tolist()
            assert collections.Counter(delivered) == collections.Counter(
                order[done:].tolist() + padding
            )


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_every_rank_gets_the_same_number_of_batches(packed_tar, mode, drop_last):
    """Equal per-rank counts on the real dataset, through the loader (no hang at epoch end)."""
    bs = 16
    for world in (3, 7):
        batches = []
        keys: list[str] = []
        for rank in range(world):
            ds = ShardDataset(
                packed_tar.path,
                mode=mode,
                seed=SEED,
                drop_last=drop_last,
                ranks=RankInfo(rank=rank, world_size=world),
            )
            loader = ds.loader(batch_size=bs, num_workers=0, drop_last=drop_last)
            got = list(loader)
            assert len(got) == len(loader)
            batches.append(len(got))
            keys += packed_tar.keys_of(got)
        assert len(set(batches)) == 1, f"batches per rank differ: {batches}"
        per_rank = 600 // world if drop_last else -(-600 // world)
        expected_batches = per_rank // bs if drop_last else -(-per_rank // bs)
        assert batches[0] == expected_batches
        if not drop_last:
            assert set(keys) == set(packed_tar.keys)
        assert len(keys) - len(set(keys)) == (0 if drop_last else per_rank * world - 600)


def test_samples_per_rank_matches_rank_indices_on_the_dataset(packed_tar):
    for world, drop_last, consumed in itertools.product(
        [1, 2, 3, 5, 8], [False, True], [0, 1, 599, 600]
    ):
        sizes = set()
        for rank in range(world):
            ds = ShardDataset(
                packed_tar.path, drop_last=drop_last, ranks=RankInfo(rank=rank, world_size=world)
            )
            sizes.add(len(ds.rank_indices(consumed=consumed)))
        rest = 600 - consumed
        assert sizes == {rest // world if drop_last else -(-rest // world)}
