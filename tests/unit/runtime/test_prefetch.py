"""GPUPrefetcher on the CPU path: same batches in the same order as the loader, exact resume
counting only delivered batches, close() that joins its thread and the loader's workers,
errors re-raised with their type; and the host half of the CUDA path (staging in reused
arenas, rebuilt from one buffer) exercised on the CPU."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import threading
import time
import weakref
from collections import namedtuple

import numpy as np
import pytest
import torch
from resuming import assert_resumed_exactly, resumed, saved
from torch.utils.data import DataLoader, Dataset

from shardio.errors import ChecksumMismatchError, UsageError
from shardio.runtime.batch import ByteColumn
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.gpucopy import DeviceByteColumn, HostStaging, fill_views
from shardio.runtime.prefetch import GPUPrefetcher

BATCH = 32
SEED = 5
MODES = ("map", "stream")


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardio-prefetch"]


def wait_until_queued(pf, n):
    """Wait until the prefetcher's thread has queued ``n`` batches (its queue is full)."""
    deadline = time.monotonic() + 30
    while pf._queue.qsize() < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pf._queue.qsize() == n


def as_plain(batch):
    """A batch with its byte columns made lists of bytes (ring slots are reused)."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, ByteColumn):
            out[key] = [None if v is None else bytes(v) for v in value]
        elif isinstance(value, torch.Tensor):
            out[key] = value.tolist()
        else:
            out[key] = value
    return out


def loader_of(packed, mode="map", workers=0):
    return ShardDataset(packed.path, mode=mode, seed=SEED).loader(BATCH, workers)


@pytest.fixture(autouse=True)
def _no_thread_left():
    before = set(prefetch_threads())
    yield
    left = set(prefetch_threads()) - before
    assert not left, f"{len(left)} shardio-prefetch thread(s) left running"


# -- same batches, same order -------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", MODES)
def test_cpu_path_delivers_the_loaders_batches_in_order(packed_tar, mode, workers):
    direct = [as_plain(b) for b in loader_of(packed_tar, mode, workers)]
    with GPUPrefetcher(loader_of(packed_tar, mode, workers), device="cpu") as pf:
        assert pf.device == torch.device("cpu")
        assert len(pf) == len(direct)
        through = []
        for batch in pf:
            packed_tar.check_batch(batch)  # types kept: ByteColumn, int64 labels, str keys
            through.append(as_plain(batch))
    assert through == direct
    packed_tar.assert_exactly_once(packed_tar.keys_of(through))


def test_cpu_path_on_hdf5_with_ring_workers(packed_hdf5):
    loader = loader_of(packed_hdf5, "map", 2)
    with GPUPrefetcher(loader, device="cpu", depth=3) as pf:
        keys = [k for b in pf for k in packed_hdf5.check_batch(b)]
    packed_hdf5.assert_exactly_once(keys)
    assert loader.transport_stats["ring"] > 0  # passed through: the slots did their work


Pair = namedtuple("Pair", "a b")  # module level: workers pickle it by name


class Nested(Dataset):
    def __len__(self):
        return 37

    def __getitem__(self, i):
        return {
            "x": torch.full((3, 4), float(i)),
            "meta": [torch.tensor(i, dtype=torch.int16), f"name-{i}"],
            "pair": Pair(torch.arange(i % 5, dtype=torch.float64), torch.tensor(i > 9)),
        }


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def nested_loader(workers=0):
    # Variable-length "pair.a" cannot be stacked: collate by hand, keeping the structure.
    def collate(items):
        return {
            "x": torch.stack([it["x"] for it in items]),
            "meta": [torch.stack([it["meta"][0] for it in items]), [it["meta"][1] for it in items]],
            "pair": [Pair(*it["pair"]) for it in items],
        }

    return DataLoader(Nested(), batch_size=8, num_workers=workers, collate_fn=collate)


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_dataloader_of_nested_batches(workers):
    direct = list(nested_loader(workers))
    with GPUPrefetcher(nested_loader(workers), device="cpu") as pf:
        through = list(pf)
    assert len(through) == len(direct) == 5
    for a, b in zip(through, direct, strict=True):
        assert_same(a, b)


def test_cpu_path_passes_batches_through_and_a_new_pass_restarts():
    batches = [{"t": torch.arange(i + 1), "k": [str(i)]} for i in range(7)]
    pf = GPUPrefetcher(batches, device="cpu", depth=1)
    first = list(pf)
    assert all(a is b for a, b in zip(first, batches, strict=True))
    assert [b["k"] for b in pf] == [[str(i)] for i in range(7)]  # iter() again: a new pass
    assert pf.staging_stats == {"arenas": 0, "allocations": 0, "bytes": 0}
    pf.close()


def test_arguments_are_checked():
    for depth in (0, -1, 1.5, True, "2"):
        with pytest.raises(UsageError, match="depth"):
            GPUPrefetcher([], device="cpu", depth=depth)
    with pytest.raises(UsageError, match="device"):
        GPUPrefetcher([], device="tpu")
    with pytest.raises(UsageError, match="device"):
        GPUPrefetcher([], device="not a device")
    with pytest.raises(UsageError, match="state_dict"):
        GPUPrefetcher([], device="cpu").state_dict()
    with pytest.raises(TypeError):
        len(GPUPrefetcher(iter([]), device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_auto_without_cuda_falls_back_to_the_cpu():
    pf = GPUPrefetcher([torch.ones(2)])  # device="auto"
    assert pf.device == torch.device("cpu")
    assert [t.tolist() for t in pf] == [[1.0, 1.0]]
    assert pf.stream is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_device_without_cuda_is_refused_not_trained_on_the_cpu(device):
    with pytest.raises(UsageError, match=f"device '{device}': CUDA is not available"):
        GPUPrefetcher([torch.ones(2)], device=device)


# -- exact resume -------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", MODES)
def test_resume_counts_only_delivered_batches(packed_tar, mode, workers):
    full = packed_tar.keys_of(loader_of(packed_tar, mode, workers))
    for k in (0, 1, 6):
        loader = loader_of(packed_tar, mode, workers)
        with GPUPrefetcher(loader, device="cpu", depth=3) as pf:
            it = iter(pf)
            head = []
            for _ in range(k):
                wait_until_queued(pf, 3)  # the loader is ahead of the consumer at each delivery
                head += next(it)["__key__"]
            wait_until_queued(pf, 3)
            assert loader.state_dict()["consumed"] >= (k + 3) * BATCH
            state = saved(pf.state_dict())
            assert state["consumed"] == k * BATCH
        assert pf.state_dict() == state  # closing drops queued batches, not the position

        with resumed(
            lambda: GPUPrefetcher(loader_of(packed_tar, mode, workers), device="cpu"), state
        ) as again:
            tail = packed_tar.keys_of(again)
        assert_resumed_exactly(head, tail, full)
        assert again.state_dict()["consumed"] == 600


def test_a_new_pass_after_stopping_early_continues_at_the_first_undelivered(packed_tar):
    full = packed_tar.keys_of(loader_of(packed_tar, "map", 2))
    pf = GPUPrefetcher(loader_of(packed_tar, "map", 2), device="cpu", depth=2)
    keys = []
    for _ in range(3):
        keys += packed_tar.keys_of(itertools.islice(iter(pf), 4))
    keys += packed_tar.keys_of(pf)
    pf.close()
    assert keys == full


def test_state_before_iterating_and_after_set_epoch_is_the_loaders(packed_tar):
    loader = loader_of(packed_tar)
    pf = GPUPrefetcher(loader, device="cpu")
    assert pf.state_dict() == loader.state_dict()
    with pf:
        epoch0 = packed_tar.keys_of(pf)
        pf.set_epoch(1)
        assert pf.state_dict() == {**loader.state_dict(), "epoch": 1, "consumed": 0}
        epoch1 = packed_tar.keys_of(pf)
    assert epoch0 != epoch1
    packed_tar.assert_exactly_once(epoch1)


# -- close, errors ------------------------------------------------------------------------------
def test_close_mid_epoch_joins_the_thread_and_stops_the_workers(packed_tar):
    before = set(multiprocessing.active_children())
    threads = set(prefetch_threads())
    loader = loader_of(packed_tar, "map", 2)
    pf = GPUPrefetcher(loader, device="cpu", depth=2)
    it = iter(pf)
    packed_tar.check_batch(next(it))
    assert len(set(prefetch_threads()) - threads) == 1
    assert len(set(multiprocessing.active_children()) - before) == 2
    pf.close()
    # Gone from threading.enumerate(): joined, not just told to stop.
    assert not set(prefetch_threads()) - threads
    assert not set(multiprocessing.active_children()) - before
    with pytest.raises(StopIteration):
        next(it)
    pf.close()  # idempotent
    loader.close()


def test_close_while_the_thread_waits_on_a_full_queue():
    threads = set(prefetch_threads())
    pulled = []

    def endless():
        for i in itertools.count():
            pulled.append(i)
            yield torch.full((4,), i)

    pf = GPUPrefetcher(endless(), device="cpu", depth=2)
    assert next(iter(pf)).tolist() == [0] * 4
    deadline = time.monotonic() + 10
    while len(pulled) < 4 and time.monotonic() < deadline:  # 2 queued, 1 waiting to be put
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(pulled) == 4  # bounded: the thread is blocked on the queue
    pf.close()
    assert not set(prefetch_threads()) - threads


def test_close_drops_the_queued_batches():
    made = []

    def batches():
        for i in range(50):
            t = torch.full((1000,), i)
            made.append(weakref.ref(t))
            yield {"t": t}
            del t

    pf = GPUPrefetcher(batches(), device="cpu", depth=3)
    got = next(iter(pf))
    wait_until_queued(pf, 3)
    pf.close()
    assert got["t"][0] == 0
    assert sum(ref() is not None for ref in made) == 1  # only the one delivered and kept


def test_shardloader_stops_its_workers_when_one_fails(packed_tar, corrupt_copy):
    copy, _, _ = corrupt_copy(packed_tar, packed_tar.keys[100])
    before = set(multiprocessing.active_children())
    with pytest.raises(ChecksumMismatchError) as info:
        for _ in ShardDataset(copy.path, seed=SEED).loader(BATCH, 2):
            pass
    # The traceback still holds the loader's frames; the workers are down all the same.
    assert info.value.__traceback__ is not None
    assert not set(multiprocessing.active_children()) - before


def test_shardloader_close_ends_its_iteration_and_is_idempotent(packed_tar):
    before = set(multiprocessing.active_children())
    loader = loader_of(packed_tar, "stream", 2)
    it = iter(loader)
    keys = packed_tar.check_batch(next(it))
    assert set(multiprocessing.active_children()) - before
    loader.close()
    assert not set(multiprocessing.active_children()) - before
    with pytest.raises(StopIteration):
        next(it)
    loader.close()
    rest = packed_tar.keys_of(loader)  # continues where it stopped, as after any abandon
    assert keys + rest == packed_tar.keys_of(loader_of(packed_tar, "stream", 2))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_error_arrives_after_the_batches_before_it(packed_tar, corrupt_copy, workers):
    order = ShardDataset(packed_tar.path, seed=SEED).rank_indices()
    bad_position = 5 * BATCH + 7
    key = packed_tar.keys[int(order[bad_position])]
    copy, shard, _ = corrupt_copy(packed_tar, key)
    loader = ShardDataset(copy.path, seed=SEED).loader(BATCH, workers)
    before = set(multiprocessing.active_children())
    threads = set(prefetch_threads())
    delivered = []
    raised = None
    pf = GPUPrefetcher(loader, device="cpu", depth=2)
    try:
        for batch in pf:
            delivered += packed_tar.check_batch(batch)
    except Exception as exc:
        raised = (type(exc), getattr(exc, "key", None), getattr(exc, "path", None))
        del exc
    assert raised == (ChecksumMismatchError, key, shard)
    assert len(delivered) == 5 * BATCH
    assert pf.state_dict()["consumed"] == 5 * BATCH
    assert not set(prefetch_threads()) - threads
    with pytest.raises(StopIteration):
        next(pf)
    pf.close()
    gc.collect()
    assert not set(multiprocessing.active_children()) - before


def test_the_same_exception_object_is_raised():
    problem = KeyError("boom")

    def failing():
        yield from (torch.zeros(1), torch.ones(1))
        raise problem

    got = []
    with GPUPrefetcher(failing(), device="cpu") as pf, pytest.raises(KeyError) as info:
        for t in pf:
            got.append(t.item())
    assert info.value is problem
    assert got == [0.0, 1.0]


# -- the host half of the CUDA path, on the CPU -------------------------------------------------
def test_staging_reuses_its_arenas_and_rebuilds_the_batch(packed_tar):
    staging = HostStaging(sets=3, pin=False)
    loader = loader_of(packed_tar, "map", 2)
    sizes = []
    seen = 0
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for batch in loader:
            expected = as_plain(batch)
            template, arena, nbytes = staging.stage(batch)
            sizes.append(nbytes)
            del batch  # the ring slot is free: the bytes now live in the arena only
            rebuilt = fill_views(template, arena.buffer[:nbytes].clone())  # the "device" copy
            jpeg = rebuilt["jpeg"]
            assert isinstance(jpeg, DeviceByteColumn)
            assert jpeg.offsets[0] == 0 and len(jpeg) == len(expected["__key__"])
            assert [bytes(jpeg.tensor(i).numpy()) for i in range(len(jpeg))] == expected["jpeg"]
            assert rebuilt["cls"].dtype == torch.int64
            assert rebuilt["cls"].tolist() == expected["cls"]
            assert rebuilt["__key__"] == expected["__key__"]
            seen += 1
        if epoch == 0:
            after_one_epoch = staging.stats()
    stats = staging.stats()
    assert seen == 2 * len(loader)
    assert stats["arenas"] == 3
    assert stats["allocations"] <= 6, stats  # a few growths, not one per batch
    assert stats == after_one_epoch  # the second epoch allocates nothing
    assert stats["bytes"] <= 3 * (max(sizes) * 1.25 + 64 * 1024)


def test_staging_keeps_dtypes_shapes_and_non_tensor_leaves():
    staging = HostStaging(sets=2, pin=False)
    buffer = torch.frombuffer(bytearray(b"..abcdefgh.."), dtype=torch.uint8)
    col = ByteColumn(buffer, np.array([2, 5, 5, 10]), np.array([True, False, True]))
    strided = torch.arange(12, dtype=torch.float32).view(3, 4).t()  # not contiguous
    batch = {
        "col": col,
        "f": strided,
        "scalar": torch.tensor(7, dtype=torch.int32),
        "empty": torch.empty(0, 3),
        "flags": torch.tensor([True, False]),
        "half": [torch.ones(3, dtype=torch.float16), ("s", 1)],
        "keys": ["a", "b"],
        "arr": np.arange(3),
    }
    template, arena, nbytes = staging.stage(batch)
    slots = dict(zip(template.keys, template.items, strict=True))
    assert slots["keys"] is batch["keys"] and slots["arr"] is batch["arr"]  # carried as they are
    out = fill_views(template, arena.buffer[:nbytes].clone())
    assert out["col"][1] is None
    assert bytes(out["col"][0].numpy()) == b"abc"
    assert bytes(out["col"][2].numpy()) == b"defgh"
    assert [None if v is None else bytes(v.numpy()) for v in out["col"]] == [
        None if v is None else bytes(v) for v in col
    ]
    for name in ("f", "scalar", "empty", "flags"):
        assert out[name].dtype == batch[name].dtype
        assert torch.equal(out[name], batch[name])
    assert torch.equal(out["half"][0], batch["half"][0]) and out["half"][1] == ("s", 1)
    # Every tensor starts aligned in the one buffer.
    assert arena.buffer.data_ptr() % 64 == 0
    assert all(slots[name].offset % 64 == 0 for name in ("f", "scalar", "empty", "flags"))
    assert out["keys"] is batch["keys"]


# -- where the workers are forked, double pinning, the copy's stall -----------------------------
@pytest.mark.parametrize("mode", MODES)
def test_the_loaders_workers_are_forked_by_the_thread_that_iterates(packed_tar, mode):
    """Never from shardio-prefetch: a fork from a second thread of a process that holds CUDA
    (and its locks) can deadlock the child."""
    import os

    forked_by: list[str] = []
    recording = [True]  # a fork hook cannot be removed: it stops recording after the test

    def note() -> None:
        if recording[0]:
            forked_by.append(threading.current_thread().name)

    os.register_at_fork(before=note)
    loader = ShardDataset(packed_tar.path, mode=mode, seed=SEED).loader(
        BATCH, 2, persistent_workers=False
    )
    try:
        with GPUPrefetcher(loader, device="cpu") as pf:
            keys = [k for b in pf for k in packed_tar.check_batch(b)]
    finally:
        recording[0] = False
    packed_tar.assert_exactly_once(keys)
    assert forked_by, "no worker was forked"
    assert set(forked_by) == {threading.current_thread().name}


def test_a_first_batch_that_fails_is_raised_at_the_first_next():
    def failing():
        raise OSError(5, "shard-000000.tar: sample 0 damaged")
        yield  # a generator

    class Loader:
        def __iter__(self):
            return failing()

    pf = GPUPrefetcher(Loader(), device="cpu")
    it = iter(pf)  # the first batch was tried here: its error waits for next()
    with pytest.raises(OSError, match="sample 0 damaged"):
        next(it)
    pf.close()


def test_pin_memory_with_a_cuda_prefetcher_is_warned_about(packed_tar):
    from shardio.runtime.gpucopy import double_pinning

    pinned = ShardDataset(packed_tar.path).loader(8, 0, pin_memory=True)
    assert pinned.pin_memory
    assert "pin_memory=False" in double_pinning(pinned, torch.device("cuda", 0))
    assert double_pinning(pinned, torch.device("cpu")) is None  # no arena on the CPU
    assert double_pinning(loader_of(packed_tar), torch.device("cuda", 0)) is None
    assert double_pinning(DataLoader([1, 2], pin_memory=True), torch.device("cuda")) is not None


def test_a_copy_not_landed_is_waited_for_and_counted():
    """The stall metric sees a copy still in flight (a stream wait alone returns at once)."""
    from shardio.runtime.gpucopy import await_copy

    class Event:  # a CUDA event whose copy lands 50 ms after it is asked about
        def __init__(self, landed: bool) -> None:
            self.landed = landed

        def query(self) -> bool:
            return self.landed

        def synchronize(self) -> None:
            time.sleep(0.05)
            self.landed = True

    assert await_copy(Event(landed=True)) == 0
    waited = await_copy(Event(landed=False))
    assert waited >= 40_000_000
