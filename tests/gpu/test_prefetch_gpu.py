"""GPUPrefetcher on a CUDA device: bytes equal to the CPU path, the copy of the next batch
overlapping compute on the current one, no batch read before its copy arrived, and the
host-to-device throughput against plain ``.to(device)`` (printed, not asserted).

Skipped without CUDA; run with ``pytest -m gpu -s tests/gpu``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardio.runtime.batch import ByteColumn
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.gpucopy import DeviceByteColumn
from shardio.runtime.prefetch import GPUPrefetcher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda:0"
BATCH = 32
SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: well over 0.1 s on any current GPU


def gated(n: int, numel: int, gate: threading.Semaphore):
    """Batch i (a float32 tensor full of i + 1) is made only after ``gate`` is released."""
    for i in range(n):
        if not gate.acquire(timeout=60):
            return  # the test failed before releasing it: end, so that close() returns
        yield torch.full((numel,), float(i + 1))


def host_view(batch):
    """Keys, labels and payload bytes of a batch, on the host, whichever path it came by."""
    jpeg = batch["jpeg"]
    if isinstance(jpeg, DeviceByteColumn):
        assert jpeg.data.device.type == "cuda"
        payload = [bytes(jpeg.tensor(i).cpu().numpy()) for i in range(len(jpeg))]
    else:
        assert isinstance(jpeg, ByteColumn)
        payload = [bytes(v) for v in jpeg]
    return batch["__key__"], batch["cls"].cpu().tolist(), payload


def test_bytes_equal_the_cpu_path(packed_small):
    path, _ = packed_small("tar")

    def loader():
        return ShardDataset(path, seed=3).loader(BATCH, 2)

    with GPUPrefetcher(loader(), device="cpu") as pf:
        on_cpu = [host_view(b) for b in pf]
    with GPUPrefetcher(loader(), device=DEVICE, depth=2) as pf:
        on_gpu = []
        for batch in pf:
            assert batch["cls"].device.type == "cuda"
            on_gpu.append(host_view(batch))
        stats = pf.staging_stats
        assert all(a.buffer.is_pinned() for a in pf._staging.arenas)
    assert on_gpu == on_cpu
    assert stats["arenas"] == 3
    assert stats["allocations"] <= 6, stats


def test_resume_through_the_gpu_prefetcher(packed_small):
    path, _ = packed_small("tar")
    full = [k for b in ShardDataset(path, seed=3).loader(BATCH, 2) for k in b["__key__"]]
    with GPUPrefetcher(ShardDataset(path, seed=3).loader(BATCH, 2), device=DEVICE) as pf:
        it = iter(pf)
        head = [k for _ in range(3) for k in next(it)["__key__"]]
        time.sleep(0.2)  # the thread runs ahead; the state must not count that
        state = pf.state_dict()
    with GPUPrefetcher(ShardDataset(path, seed=3).loader(BATCH, 2), device=DEVICE) as pf:
        pf.load_state_dict(state)
        tail = [k for b in pf for k in b["__key__"]]
    assert head + tail == full


def test_no_batch_is_read_before_its_copy_arrived():
    gate = threading.Semaphore(0)
    numel = 8 * 1024 * 1024  # 32 MiB per batch
    with GPUPrefetcher(gated(6, numel, gate), device=DEVICE, depth=2) as pf:
        it = iter(pf)
        for i in range(6):
            # Hold the side stream busy, then let the loader make batch i: its copy queues
            # behind the sleep, so a consumer that did not wait would read stale memory.
            with torch.cuda.stream(pf.stream):
                torch.cuda._sleep(SLEEP_CYCLES // 4)
            gate.release()
            batch = next(it)
            assert batch.device.type == "cuda"
            ok = (batch == float(i + 1)).all()  # on the current stream, not synchronized
            assert bool(ok.item()), f"batch {i} was read before its copy finished"


def test_the_copy_of_the_next_batch_overlaps_compute_on_this_one(capsys):
    gate = threading.Semaphore(0)
    numel = 16 * 1024 * 1024  # 64 MiB per batch
    weights = torch.randn(1024, 1024, device=DEVICE)
    assert pf_stream_differs_from_current()
    overlapped = []
    with GPUPrefetcher(gated(5, numel, gate), device=DEVICE, depth=2) as pf:
        it = iter(pf)
        gate.release()
        batch = next(it)
        for i in range(4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            # Compute on batch i: a few matmuls, then a long sleep to widen the window.
            (batch[: 1024 * 1024].view(1024, 1024) @ weights).sum()
            torch.cuda._sleep(SLEEP_CYCLES)
            end.record()
            gate.release()  # only now may the loader make batch i + 1
            following = next(it)  # returns once its copy is queued on the side stream
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(pf.stream)  # after the copy of batch i + 1
            while not end.query():
                if copied.query():
                    overlapped.append(True)
                    break
            else:
                overlapped.append(False)
            torch.cuda.synchronize()
            assert bool((following == float(i + 2)).all().item())
            with capsys.disabled():
                print(
                    f"\nbatch {i}: compute {start.elapsed_time(end):.1f} ms; copy of batch "
                    f"{i + 1} done {start.elapsed_time(copied):.1f} ms after compute began"
                )
            batch = following
    assert all(overlapped), overlapped


def pf_stream_differs_from_current():
    pf = GPUPrefetcher([torch.zeros(1)], device=DEVICE)
    with pf:
        assert [t.item() for t in pf] == [0.0]
        return pf.stream is not None and pf.stream != torch.cuda.current_stream(DEVICE)


def test_host_to_device_throughput_against_plain_to(capsys):
    batches = [torch.randn(8 * 1024 * 1024) for _ in range(16)]  # 32 MiB each, pageable
    nbytes = sum(b.numel() * b.element_size() for b in batches)
    weights = torch.randn(2048, 2048, device=DEVICE)

    def step(x):
        # Compute standing in for a training step.
        for _ in range(8):
            (x[: 2048 * 2048].view(2048, 2048) @ weights).sum()

    for b in batches[:2]:  # warm up: CUDA context, allocator, kernels
        step(b.to(DEVICE))
    torch.cuda.synchronize()

    def timed(run):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def plain(compute):
        for b in batches:
            x = b.to(DEVICE)
            if compute:
                step(x)

    def prefetched(compute):
        with GPUPrefetcher(batches, device=DEVICE, depth=2) as pf:
            for x in pf:
                if compute:
                    step(x)

    results = {
        (name, compute): timed(lambda f=f, c=compute: f(c))
        for compute in (False, True)
        for name, f in (("plain .to()", plain), ("GPUPrefetcher", prefetched))
    }
    with capsys.disabled():
        print(f"\nhost-to-device, {len(batches)} batches of {nbytes // len(batches) >> 20} MiB:")
        for (name, compute), seconds in results.items():
            what = "copy + compute" if compute else "copy only"
            rate = nbytes / seconds / 1e9
            print(f"  {name:14s} {what:15s} {seconds * 1e3:8.1f} ms  {rate:6.2f} GB/s")


def test_device_memory_held_is_at_most_depth_plus_two_batches():
    """What the module doc promises: depth queued, one held by the consumer, one in copy."""
    depth, numel, n = 2, 8 << 20, 12  # 32 MiB float32 batches
    batch_bytes = numel * 4
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(DEVICE)
    peak = 0
    batches = (torch.full((numel,), float(i)) for i in range(n))
    with GPUPrefetcher(batches, device=DEVICE, depth=depth) as pf:
        for batch in pf:
            time.sleep(0.02)  # the thread fills the queue meanwhile
            peak = max(peak, torch.cuda.memory_allocated(DEVICE) - base)
            del batch
        pinned = pf.staging_stats["bytes"]
    print(f"\ndevice memory held: {peak / batch_bytes:.2f} batches; pinned arenas {pinned:,} B")
    assert peak <= (depth + 2) * batch_bytes
    assert pinned <= (depth + 1) * 1.25 * batch_bytes + (depth + 1) * (64 << 10)


def test_workers_are_forked_by_the_iterating_thread_after_cuda_is_initialised(packed_small):
    """With CUDA initialised, the loader's workers start (and read) from the main thread."""
    import os

    path, _ = packed_small("tar")
    keys = [k for b in ShardDataset(path, seed=3).loader(BATCH, 0) for k in b["__key__"]]
    torch.zeros(1, device=DEVICE)  # CUDA initialised in this process
    forked_by: list[str] = []
    recording = [True]

    def note() -> None:
        if recording[0]:
            forked_by.append(threading.current_thread().name)

    os.register_at_fork(before=note)
    loader = ShardDataset(path, seed=3).loader(BATCH, 2, persistent_workers=False)
    try:
        with GPUPrefetcher(loader, device=DEVICE) as pf:
            got = [k for b in pf for k in b["__key__"]]
    finally:
        recording[0] = False
    assert sorted(got) == sorted(keys)
    assert forked_by and set(forked_by) == {threading.current_thread().name}
