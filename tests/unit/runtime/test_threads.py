"""ShardLoader(threads=True): reader threads deliver what worker processes would, in order,
every byte verified, errors raised at their batch, and nothing left running or open."""

from __future__ import annotations

import os
import pathlib
import threading
import time

import pytest
from pagecache import evict

from shardio import ShardDataset
from shardio.errors import ChecksumMismatchError, ReadStalledError, StorageError, UsageError
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.reader import ShardReader

BATCH = 7


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shardio-reader-")]


def _no_readers_left() -> None:
    deadline = time.monotonic() + 10
    while _readers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _readers()


def _shard_fds(root: pathlib.Path) -> list[str]:
    """Descriptors of this process open on files under ``root`` (a stalled read's descriptor
    that an earlier test's deadline kept open to the process's end included: compare)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.fspath(root)):
            found.append(target)
    return found


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_threads_deliver_the_batches_and_order_of_worker_processes(packed, mode) -> None:
    before = _shard_fds(packed.path)
    ref = ShardDataset(packed.path, mode=mode, seed=3).loader(batch_size=BATCH)
    want = packed.keys_of(ref)
    ds = ShardDataset(packed.path, mode=mode, seed=3)
    loader = ds.loader(batch_size=BATCH, num_workers=3, threads=True)
    for epoch in range(2):
        loader.set_epoch(epoch)
        keys = [k for b in loader for k in packed.check_batch(b)]
        packed.assert_exactly_once(keys)
        if epoch == 0:
            assert keys == want  # batch j from thread j % 3, as from worker j % 3
    assert loader.transport_stats == {"ring": 0, "fallback": 0}  # nothing crossed processes
    snap = loader.metrics()
    assert snap.samples == 2 * len(packed.keys)
    assert snap.samples_read >= snap.samples  # the threads' figures came with the batches
    assert snap.bytes_read >= 2 * sum(len(v) for v in packed.payload.values())
    loader.close()
    ref.dataset.close()
    ds.close()  # the training process's own reader: what is left open is the copies'
    _no_readers_left()
    assert _shard_fds(packed.path) == before


def test_copies_are_kept_from_epoch_to_epoch_and_closed_with_the_loader(packed_tar) -> None:
    before = _shard_fds(packed_tar.path)
    ds = ShardDataset(packed_tar.path, seed=1)
    loader = ds.loader(batch_size=BATCH, num_workers=2, threads=True)
    list(loader)
    opens = loader.metrics().counters["opens_source"]
    # Opened once, in the training process: the threads read through duplicates.
    assert opens == packed_tar.num_shards
    loader.set_epoch(1)
    list(loader)
    assert loader.metrics().counters["opens_source"] == opens  # no shard opened again
    ds.close()
    assert len(_shard_fds(packed_tar.path)) > len(before)  # the copies' stay open
    loader.close()
    _no_readers_left()
    assert _shard_fds(packed_tar.path) == before


def test_a_run_left_early_stops_its_threads_and_resumes_exactly(packed_tar) -> None:
    ds = ShardDataset(packed_tar.path, mode="stream", seed=2)
    loader = ds.loader(batch_size=BATCH, num_workers=2, threads=True)
    it = iter(loader)
    first = [k for _ in range(3) for k in packed_tar.check_batch(next(it))]
    state = loader.state_dict()
    it.close()
    _no_readers_left()
    again = ShardDataset(packed_tar.path, mode="stream", seed=2)
    resumed = again.loader(batch_size=BATCH, num_workers=2, threads=True)
    resumed.load_state_dict(state)
    rest = [k for b in resumed for k in packed_tar.check_batch(b)]
    packed_tar.assert_exactly_once(first + rest)
    resumed.close()
    loader.close()


def test_a_corrupt_member_is_raised_at_its_batch_after_the_good_ones(
    packed_tar, corrupt_copy
) -> None:
    bad_key = packed_tar.keys[len(packed_tar.keys) // 2]
    copy, shard, _ = corrupt_copy(packed_tar, bad_key)
    ds = ShardDataset(copy.path, shuffle=False)
    delivered: list[str] = []
    loader = ds.loader(batch_size=BATCH, num_workers=2, threads=True)
    with pytest.raises(ChecksumMismatchError) as info:
        for batch in loader:
            delivered += copy.check_batch(batch)
    assert bad_key in str(info.value) or os.path.basename(shard) in str(info.value)
    # Every batch before the bad one's was delivered, and none after it.
    assert delivered == list(copy.keys[: len(delivered)])
    assert bad_key not in delivered
    assert len(delivered) == copy.keys.index(bad_key) // BATCH * BATCH
    assert loader.metrics().counters["checksum_failures"] == 1  # the thread's figures came
    _no_readers_left()


def test_a_stalled_read_is_raised_within_the_deadline_not_hung(packed_tar, tmp_path) -> None:
    """A thread cannot be killed: its read is bounded by the dataset's read deadline, and the
    stall reaches the training loop as an exception."""
    release = tmp_path / "release"
    stuck = os.path.basename(packed_tar.member_of(packed_tar.keys[-1])[0])
    opener = FaultyOpener([Fault(kind="hang", path=stuck, release=os.fspath(release))])
    ds = ShardDataset(packed_tar.path, shuffle=False, opener=opener, read_timeout_s=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(StorageError) as info:
            for _ in ds.loader(batch_size=BATCH, num_workers=2, threads=True):
                pass
        assert isinstance(info.value, ReadStalledError) or "stall" in str(info.value)
        assert time.monotonic() - started < 30
    finally:
        release.touch()
    _no_readers_left()


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"threads": "yes"}, "threads must be True or False"),
        ({"threads": True, "pin_memory": True}, "no DataLoader argument but prefetch_factor"),
        ({"threads": True, "worker_init_fn": print}, "got worker_init_fn"),
        ({"threads": True, "prefetch_factor": -1}, "prefetch_factor"),
        ({"threads": True, "prefetch_factor": 10**9}, "prefetch_factor"),
        ({"threads": True, "worker_timeout_s": 30}, "has no watchdog"),
        ({"threads": True, "timeout": 30}, "got timeout"),
    ],
)
def test_bad_thread_arguments_are_refused(packed_tar, kwargs, problem) -> None:
    ds = ShardDataset(packed_tar.path)
    with pytest.raises(UsageError, match=problem):
        ds.loader(batch_size=BATCH, num_workers=2, **kwargs)


def test_a_mix_is_refused_in_threads(packed_tar) -> None:
    from shardio import MixedDataset

    mix = MixedDataset([(ShardDataset(packed_tar.path), 1.0)], seed=0)
    with pytest.raises(UsageError, match="MixedDataset reads in worker processes"):
        mix.loader(batch_size=BATCH, num_workers=2, threads=True)


def test_threads_with_no_workers_read_in_the_training_process(packed_tar) -> None:
    loader = ShardDataset(packed_tar.path).loader(batch_size=BATCH, threads=True)
    keys = [k for b in loader for k in packed_tar.check_batch(b)]
    packed_tar.assert_exactly_once(keys)
    assert not _readers()


def test_a_transform_that_does_not_pickle_runs_in_the_threads(packed_tar) -> None:
    seen: list[int] = []  # a closure: a spawned worker could not take it

    def size(sample):  # type: ignore[no-untyped-def]
        seen.append(threading.get_ident())
        return {"n": len(sample["jpeg"])}

    ds = ShardDataset(packed_tar.path, shuffle=False, transform=size)
    sizes = [n for b in ds.loader(batch_size=BATCH, num_workers=2, threads=True) for n in b["n"]]
    assert sizes == [len(packed_tar.payload[k]) for k in packed_tar.keys]
    assert threading.get_ident() not in seen and len(set(seen)) == 2


def test_two_iterations_at_once_read_through_their_own_copies(packed_tar) -> None:
    loader = ShardDataset(packed_tar.path, seed=4).loader(
        batch_size=BATCH, num_workers=2, threads=True
    )
    first, second = iter(loader), iter(loader)
    a = [packed_tar.check_batch(next(first)) for _ in range(3)]
    b = [k for batch in second for k in packed_tar.check_batch(batch)]
    a += [packed_tar.check_batch(batch) for batch in first]
    assert len(b) > 0 and sum(map(len, a)) > 0
    loader.close()
    _no_readers_left()


def test_a_recovery_policy_in_the_threads_reports_to_the_training_process(
    packed_tar, corrupt_copy
) -> None:
    bad_key = packed_tar.keys[5]
    copy, _, _ = corrupt_copy(packed_tar, bad_key)
    ds = ShardDataset(copy.path, shuffle=False, recovery="skip")
    loader = ds.loader(batch_size=BATCH, num_workers=2, threads=True)
    keys = [k for b in loader for k in copy.check_batch(b)]
    assert bad_key not in keys and len(keys) == len(copy.keys)  # substituted, not dropped
    assert ds.recovery_stats["skip"] == 1
    assert [e["sample"] for e in ds.recovery_events] == [copy.keys.index(bad_key)]
    loader.close()


def test_a_dataset_that_cannot_be_copied_is_refused_in_one_line(packed_tar) -> None:
    class Locked:
        """A transform object holding a lock: it neither pickles nor deep-copies."""

        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __call__(self, sample):  # type: ignore[no-untyped-def]
            return sample

    ds = ShardDataset(packed_tar.path, transform=Locked())
    with pytest.raises(UsageError, match=r"cannot be copied .*use worker processes"):
        next(iter(ds.loader(batch_size=BATCH, num_workers=2, threads=True)))


def test_stream_threads_share_one_read_ahead(packed_tar, monkeypatch) -> None:
    """Reader threads share the page cache: one read-ahead reads every thread's shards."""
    from shardio.read.readahead import StreamReadahead

    started: list[list[int]] = []
    start = StreamReadahead.start

    def counted(self):  # type: ignore[no-untyped-def]
        started.append(list(self._order))
        return start(self)

    monkeypatch.setattr(StreamReadahead, "start", counted)
    with ShardReader(packed_tar.path) as reader:  # cold: a read-ahead starts at batch one
        if not evict(reader.shard_path(s) for s in range(len(reader.manifest.shards))):
            pytest.skip("this filesystem keeps the shards in memory (tmpfs)")
    ds = ShardDataset(packed_tar.path, mode="stream", seed=5, read_strategy="pfs")
    assert ds.read_choice.strategy.stream_readahead_bytes > 0
    loader = ds.loader(batch_size=BATCH, num_workers=3, threads=True)
    keys = [k for batch in loader for k in packed_tar.check_batch(batch)]
    packed_tar.assert_exactly_once(keys)
    assert len(started) == 1  # not one per thread
    assert sorted(started[0]) == list(range(packed_tar.num_shards))  # every thread's shards
    loader.close()


def test_a_closed_readers_figures_are_not_sent_again_by_the_threads(packed_tar) -> None:
    ds = ShardDataset(packed_tar.path, shuffle=False)
    for _ in ds.loader(batch_size=BATCH):  # read in this process, then its reader closed
        pass
    ds.close()
    before = ds.read_metrics().counts["samples"]
    assert before == len(packed_tar.keys)
    loader = ds.loader(batch_size=BATCH, num_workers=2, threads=True)
    list(loader)
    assert ds.read_metrics().counts["samples"] == 2 * len(packed_tar.keys)  # not 3x
    loader.close()
