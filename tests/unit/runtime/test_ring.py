"""The ring transport: reused shared-memory slots, checked messages, views that outlive a batch.

The DataLoader tests run real workers (fork, and spawn where the ring must be pickled); the
message checks are unit-level, with a ring and a worker's reads in this process.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import shutil

import numpy as np
import pytest
import torch
from resuming import assert_resumed_exactly, resumed, saved

from shardio import ShardDataset
from shardio.errors import StorageError
from shardio.read.reader import ShardReader
from shardio.runtime.batch import ByteColumn
from shardio.runtime.transport import BUSY, FREE, BatchRing, RingBatch, max_batch_bytes

BATCH = 16


def payload_by_key(batches):
    """key -> bytes of every sample of ``batches`` (each checked to be a ByteColumn)."""
    out = {}
    for batch in batches:
        column = batch["jpeg"]
        assert isinstance(column, ByteColumn)
        for key, value in zip(batch["__key__"], column, strict=True):
            assert key not in out, f"{key} delivered twice"
            out[key] = bytes(value)
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_ring_delivers_the_bytes_of_shm_and_of_getitem(packed, mode, workers):
    ring_ds = ShardDataset(packed.path, mode=mode, seed=4)
    loader = ring_ds.loader(batch_size=BATCH, num_workers=workers)
    ring_bytes = {}
    for batch in loader:
        packed.check_batch(batch)
        ring_bytes.update(payload_by_key([batch]))
    shm = ShardDataset(packed.path, mode=mode, seed=4, transport="shm")
    shm_bytes = payload_by_key(shm.loader(batch_size=BATCH, num_workers=workers))
    map_ds = ShardDataset(packed.path)
    by_index = {s["__key__"]: s["jpeg"] for s in (map_ds[i] for i in range(len(map_ds)))}
    assert ring_bytes == shm_bytes == by_index
    assert set(ring_bytes) == set(packed.keys)
    stats = loader.transport_stats
    if workers:
        # Every batch went through a slot: one freed as soon as the loop dropped its batch.
        assert stats == {"ring": len(loader), "fallback": 0}
    else:
        assert stats == {"ring": 0, "fallback": 0}


def test_spawned_workers_read_into_the_ring_they_were_sent(packed_tar):
    """spawn pickles the dataset: the ring must arrive as the same shared memory."""
    ds = ShardDataset(packed_tar.path, seed=1)
    loader = ds.loader(batch_size=100, num_workers=1, multiprocessing_context="spawn")
    keys = [k for batch in loader for k in packed_tar.check_batch(batch)]
    packed_tar.assert_exactly_once(keys)
    assert loader.transport_stats == {"ring": len(loader), "fallback": 0}


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_resume_mid_epoch_is_exact(packed_tar, mode):
    whole = ShardDataset(packed_tar.path, mode=mode, seed=8).loader(BATCH, num_workers=2)
    expected = [(b["__key__"], payload_by_key([b])) for b in whole]
    first = ShardDataset(packed_tar.path, mode=mode, seed=8).loader(BATCH, num_workers=2)
    got = []
    for batch in first:
        got.append((batch["__key__"], payload_by_key([batch])))
        if len(got) == 7:
            state = first.state_dict()
            break
    again = resumed(
        lambda: ShardDataset(packed_tar.path, mode=mode, seed=8).loader(BATCH, num_workers=2),
        saved(state),
    )
    assert_resumed_exactly(got, [(b["__key__"], payload_by_key([b])) for b in again], expected)


def test_a_held_view_is_never_overwritten(packed_tar):
    ds = ShardDataset(packed_tar.path, seed=2)
    loader = ds.loader(batch_size=BATCH, num_workers=2, prefetch_factor=1)
    batches = iter(loader)
    batch = next(batches)
    keys = batch["__key__"]
    held_tensor = batch["jpeg"].tensor(0)
    held_view = batch["jpeg"][1]
    held_array = batch["jpeg"].buffer.numpy()[int(batch["jpeg"].offsets[2]) :]
    del batch
    gc.collect()
    later = [packed_tar.check_batch(b) for b in batches]
    # Each of the 2 x 3 slots was reused several times while the views were held.
    assert loader.transport_stats["ring"] >= 3 * 2 * 3
    assert bytes(held_tensor.numpy()) == packed_tar.payload[keys[0]]
    assert bytes(held_view) == packed_tar.payload[keys[1]]
    third = packed_tar.payload[keys[2]]
    assert bytes(held_array[: len(third)]) == third
    packed_tar.assert_exactly_once([*keys, *(k for ks in later for k in ks)])


def test_every_batch_held_falls_back_without_hanging(packed):
    ds = ShardDataset(packed.path, mode="stream", seed=6)
    loader = ds.loader(batch_size=BATCH, num_workers=2)
    batches = list(loader)  # every batch kept: the slots run out
    stats = loader.transport_stats
    assert stats["ring"] >= 2 * 6
    assert stats["fallback"] > 0
    assert stats["ring"] + stats["fallback"] == len(batches)
    keys = [k for b in batches for k in packed.check_batch(b)]
    packed.assert_exactly_once(keys)


def test_a_truncated_shard_raises_and_spares_delivered_batches(packed_tar, tmp_path):
    copy = dataclasses.replace(packed_tar, path=tmp_path / "ds")
    shutil.copytree(packed_tar.path, copy.path)
    first_shard = copy.member_of(copy.keys[0])[0]
    last_shard = copy.member_of(copy.keys[-1])[0]
    ds = ShardDataset(copy.path, shuffle=False)
    batches = iter(ds.loader(batch_size=BATCH, num_workers=2))
    held = [next(batches) for _ in range(2)]  # samples of the first shard
    os.truncate(first_shard, 0)
    os.truncate(last_shard, os.path.getsize(last_shard) // 2)
    delivered = []
    with pytest.raises(StorageError, match=r"truncated|checksum"):
        for batch in batches:
            delivered.append(copy.check_batch(batch))
    assert len(delivered) < -(-len(copy.keys) // BATCH) - 2
    for batch in held:
        copy.check_batch(batch)


def test_a_rejected_message_is_raised_and_not_counted(packed_tar, monkeypatch):
    """A forged message from a worker raises in the training process; state_dict counts
    only the batches delivered before it."""
    describe = BatchRing.describe
    ds = ShardDataset(packed_tar.path, shuffle=False)
    third = ds[2 * BATCH]["__key__"]

    def forge(self, batch, *, worker):
        message = describe(self, batch, worker=worker)
        if isinstance(message, RingBatch) and message.keys[0] == third:
            return dataclasses.replace(message, slot=self.slots)
        return message

    monkeypatch.setattr(BatchRing, "describe", forge)  # the forked workers inherit it
    loader = ds.loader(batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    seen = []
    with pytest.raises(StorageError, match="rejected: slot"):
        for batch in loader:
            seen.append(batch["__key__"])
    assert len(seen) == 2
    assert loader.state_dict()["consumed"] == 2 * BATCH


# -- unit level: a ring and a worker's reads in this process -----------------------------------


@pytest.fixture
def ring_and_reader(packed_tar):
    """(ring of 2 workers x 2 slots, dataset, read(indices, worker) -> message)."""
    ds = ShardReader(packed_tar.path)
    positions = np.arange(len(ds))
    ring = BatchRing(workers=2, slots=2, slot_bytes=max_batch_bytes(ds, positions, BATCH))

    def read(indices, worker=0):
        return ring.describe(ring.read(ds, indices, worker=worker), worker=worker)

    yield ring, ds, read
    ds.close()


def test_slot_size_is_the_largest_batch_exactly(packed_tar):
    with ShardReader(packed_tar.path) as ds:
        order = np.random.default_rng(0).permutation(len(ds))
        sizes = [
            sum(len(packed_tar.payload[ds.key(int(i))]) for i in order[k : k + BATCH])
            for k in range(0, len(order), BATCH)
        ]
        assert max_batch_bytes(ds, order, BATCH) == max(sizes)
        assert max_batch_bytes(ds, order[:0], BATCH) == 0


def test_a_slot_is_freed_when_its_last_view_goes(ring_and_reader, packed_tar):
    ring, _ds, read = ring_and_reader
    state = ring.state.view(ring.workers, ring.slots)
    message = read(list(range(BATCH)), worker=1)
    assert isinstance(message, RingBatch)
    assert (message.worker, message.slot) == (1, 0)
    assert int(state[1, 0]) == BUSY
    batch = ring.receive(message)
    packed_tar.check_batch(batch)
    view = batch["jpeg"].tensor(3)[5:]
    del batch
    gc.collect()
    assert int(state[1, 0]) == BUSY  # ``view`` still sees the slot
    del view
    assert int(state[1, 0]) == FREE


def test_a_worker_with_no_free_slot_falls_back(ring_and_reader, packed_tar):
    ring, _ds, read = ring_and_reader
    held = [ring.receive(read([i, i + 1])) for i in range(0, 2 * ring.slots, 2)]
    fallback = read([40, 41])
    assert isinstance(fallback, dict)  # a fresh segment, labels inline
    assert isinstance(fallback["cls"], np.ndarray)
    assert ring.stats() == {"ring": ring.slots, "fallback": 1}
    for batch in held:
        packed_tar.check_batch(batch)
    del held
    assert isinstance(read([40, 41]), RingBatch)


def test_a_failed_read_frees_its_slot(ring_and_reader, tmp_path, packed_tar):
    ring, ds, _read = ring_and_reader
    ds.close()
    copy = tmp_path / "ds"
    shutil.copytree(packed_tar.path, copy)
    for shard in (copy / "shards").iterdir():
        os.truncate(shard, 0)
    with ShardReader(copy) as broken, pytest.raises(StorageError, match="truncated"):
        ring.read(broken, [0, 1], worker=0)
    assert int(ring.state.view(ring.workers, ring.slots)[0].sum()) == FREE


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"ring": 12345}, "another loader iteration"),
        ({"worker": 2}, "worker 2 out of range"),
        ({"worker": True}, "worker True out of range"),
        ({"slot": -1}, "slot -1 out of range"),
        ({"slot": 1}, "slot 1 of worker 0 was not claimed"),
        ({"nbytes": 1 << 40}, "do not fit a slot"),
        ({"keys": ["a"]}, None),  # the offsets then have the wrong length
        ({"keys": (1,) * BATCH}, "keys are not a list"),
        ({"labels": np.zeros(BATCH, np.int32)}, "labels are not int64"),
        ({"extras": {"jpeg": 1}}, "extras hold other entries"),
    ],
)
def test_a_forged_message_is_rejected(ring_and_reader, change, problem):
    ring, _ds, read = ring_and_reader
    message = read(list(range(BATCH)))
    forged = dataclasses.replace(message, **change)
    with pytest.raises(StorageError, match=re.escape(problem or "rejected")):
        ring.receive(forged)
    assert ring.receive(message)["__key__"] == message.keys  # the true one still passes


def _forge_offsets(message, edit):
    ext, offsets, present = message.columns[0]
    offsets, present = offsets.copy(), present.copy()
    edit(offsets, present)
    return dataclasses.replace(message, columns=((ext, offsets, present),))


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda o, p: o.__setitem__(3, o[2] - 1), id="not-ascending"),
        pytest.param(lambda o, p: o.__setitem__(-1, o[-1] + 1), id="past-the-payload"),
        pytest.param(lambda o, p: o.__setitem__(0, -1), id="before-the-slot"),
        pytest.param(lambda o, p: p.__setitem__(4, False), id="absent-with-bytes"),
    ],
)
def test_forged_offsets_are_rejected(ring_and_reader, edit):
    ring, _ds, read = ring_and_reader
    message = read(list(range(BATCH)))
    with pytest.raises(StorageError, match="rejected: column 'jpeg'"):
        ring.receive(_forge_offsets(message, edit))


def test_a_message_is_not_received_twice_while_its_batch_lives(ring_and_reader):
    ring, _ds, read = ring_and_reader
    message = read(list(range(BATCH)))
    batch = ring.receive(message)
    with pytest.raises(StorageError, match="still in use"):
        ring.receive(message)
    assert batch["__key__"] == message.keys
    with pytest.raises(StorageError, match="not a RingBatch"):
        ring.receive({"__key__": []})  # type: ignore[arg-type]


def test_pin_memory_copies_the_batch_and_frees_the_slot(ring_and_reader, packed_tar, monkeypatch):
    """What the DataLoader's pin-memory thread calls (pinning itself needs a GPU: stood in for
    by a copy here; the GPU test below pins for real)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())
    ring, _ds, read = ring_and_reader
    message = read(list(range(BATCH)))
    pinned = message.pin_memory()
    assert int(ring.state.view(ring.workers, ring.slots)[0, message.slot]) == FREE
    packed_tar.check_batch(pinned)
    again = read(list(range(BATCH, 2 * BATCH)))  # reuses the slot
    assert again.slot == message.slot
    packed_tar.check_batch(pinned)
    failure = dataclasses.replace(again, ring=again.ring + 1).pin_memory()  # no such ring here
    assert isinstance(failure.error, StorageError)
    assert "iteration has ended" in str(failure.error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pin_memory_loader_on_gpu(packed_tar):
    ds = ShardDataset(packed_tar.path, seed=3)
    loader = ds.loader(batch_size=BATCH, num_workers=2, pin_memory=True)
    keys = []
    for batch in loader:
        assert batch["jpeg"].buffer.is_pinned()
        keys += packed_tar.check_batch(batch)
    packed_tar.assert_exactly_once(keys)
    assert loader.transport_stats == {"ring": len(loader), "fallback": 0}


def test_a_slot_a_stalled_read_may_still_write_is_never_handed_out(packed_tar, tmp_path):
    """A batch read straight into a slot, one of its reads stalled and abandoned: that slot
    stays claimed (the read writes it once it returns), the batch is read again into another
    (here it fails: the stalled shard is held), and a later batch in the other slot keeps its
    verified bytes when the late write lands."""
    import time

    from shardio.errors import ReadStalledError
    from shardio.read.deadline import DeadlineOpener
    from shardio.read.faults import Fault, FaultyOpener
    from shardio.read.unavailable import UnavailableShards

    release = tmp_path / "release"
    (tmp_path / "shm").mkdir()
    with ShardReader(packed_tar.path) as probe:
        stuck = probe.manifest.shards[1]
        other = probe.manifest.shards[3]
        mixed = [0, stuck.first_sample]  # a sample of shard 0, then one of the stuck shard
        fine = list(range(other.first_sample, other.first_sample + 2))
    opener = DeadlineOpener(
        FaultyOpener([Fault(kind="hang", path=stuck.path, release=str(release))]),
        timeout_s=0.3,
        registry=UnavailableShards("ds", hold_s=60, root=str(tmp_path / "shm")),
    )
    try:
        with ShardReader(packed_tar.path, opener=opener) as ds:
            positions = np.arange(len(ds))
            ring = BatchRing(workers=1, slots=2, slot_bytes=max_batch_bytes(ds, positions, BATCH))
            state = ring.state.view(ring.workers, ring.slots)
            with pytest.raises(ReadStalledError):  # again into slot 1: the shard is held now
                ring.read(ds, mixed, worker=0)
            assert opener.stalls == 1
            assert int(state[0, 0]) == BUSY  # given up: a stalled read may still write it
            assert int(state[0, 1]) == FREE  # the second try's, freed as any failed read's
            batch = ring.receive(ring.describe(ring.read(ds, fine, worker=0), worker=0))
            assert batch["jpeg"].buffer.data_ptr() == ring.buffer[ring.slot_bytes :].data_ptr()
            release.touch()
            deadline = time.monotonic() + 10
            while opener.abandoned and time.monotonic() < deadline:
                time.sleep(0.01)
            assert opener.abandoned == 0  # the late write has landed (in slot 0)
            assert packed_tar.check_batch(batch) == [ds.key(i) for i in fine]
            assert int(state[0, 0]) == BUSY  # for the rest of the run
    finally:
        release.touch()
