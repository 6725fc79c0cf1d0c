"""ShardReader.read_members_into: a batch read the way read_member_into reads one member."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import numpy as np
import pytest
from pagecache import evict

from shardio.errors import ChecksumMismatchError, StorageError
from shardio.read.deadline import DeadlineOpener
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.reader import ShardReader
from shardio.runtime.batch import payload_rows, read_batch
from shardio.storage.opener import PosixOpener


@pytest.fixture
def dataset(packed_small) -> pathlib.Path:  # type: ignore[no-untyped-def]
    return packed_small("tar")[0]


def _plan(ds: ShardReader, samples: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(member rows, shards, samples, sizes) of every payload member of ``samples``."""
    recs = ds.index.records(samples)
    rows, where = payload_rows(ds, recs)
    shards = recs["shard"].astype(np.int64)[where].tolist()
    owners = np.asarray(samples, dtype=np.int64)[where].tolist()
    sizes = ds.index.members["size"][rows].astype(np.int64).tolist()
    return rows.tolist(), shards, owners, sizes


def _read_batch(ds: ShardReader, samples: list[int]) -> list[bytes]:
    rows, shards, owners, sizes = _plan(ds, samples)
    buffers = [bytearray(n) for n in sizes]
    ds.read_members_into(rows, shards, owners, [memoryview(b) for b in buffers])
    return [bytes(b) for b in buffers]


def _one_by_one(ds: ShardReader, samples: list[int]) -> list[bytes]:
    rows, shards, owners, _ = _plan(ds, samples)
    return [
        ds.read_member(m, shard=s, sample=o) for m, s, o in zip(rows, shards, owners, strict=True)
    ]


@pytest.mark.parametrize("timed", [True, False])
def test_batch_equals_members_read_one_by_one_and_counts_the_same(
    dataset: pathlib.Path, timed: bool
) -> None:
    with ShardReader(dataset, timed=timed) as a, ShardReader(dataset, timed=timed) as b:
        samples = np.random.default_rng(0).permutation(len(a))[:50].tolist()
        assert len({a.shard_of(s) for s in samples}) > 1  # the batch spans shards
        assert _read_batch(a, samples) == _one_by_one(b, samples)
        assert a.metrics.counts["members"] == b.metrics.counts["members"] > 0
        assert a.metrics.counts["bytes_source"] == b.metrics.counts["bytes_source"] > 0
        hist = a.metrics.latency["source"]
        assert (hist.count > 0) == timed


def test_more_shards_than_open_files_still_reads_each_from_its_own(dataset: pathlib.Path) -> None:
    with ShardReader(dataset, max_open=2) as a, ShardReader(dataset) as b:
        samples = list(range(0, len(a), 7))
        assert _read_batch(a, samples) == _one_by_one(b, samples)


@pytest.mark.parametrize("deadline", [False, True])
@pytest.mark.parametrize(
    ("kind", "error"), [("flip", ChecksumMismatchError), ("eio", StorageError)]
)
def test_a_fault_mid_batch_names_its_sample(
    dataset: pathlib.Path, kind: str, error: type[Exception], deadline: bool
) -> None:
    """Read in turn here, or (``deadline``) all in one hand-off to the read deadline's I/O
    thread, each member checked there as soon as it is read: the same error, the same
    count."""
    with ShardReader(dataset) as probe:
        bad = probe.manifest.shards[1].first_sample + 1
        rows, *_ = _plan(probe, [bad])
        rec = probe.index.members[rows[0]]
        offset = int(rec["offset"]) + int(rec["size"]) // 2
        rel, key = probe.manifest.shards[1].path, probe.key(bad)
    fault = Fault(kind=kind, path=rel, offset=offset)
    samples = [0, 1, bad, 2]
    opener: Any = FaultyOpener([fault])
    if deadline:
        opener = DeadlineOpener(opener, timeout_s=30)
    with ShardReader(dataset, opener=opener) as ds:
        with pytest.raises(error) as info:
            _read_batch(ds, samples)
        assert key in str(info.value)
        counter = "checksum_failures" if kind == "flip" else "read_errors"
        assert ds.metrics.counts[counter] == 1


class _CountingOpener(PosixOpener):
    def __init__(self, delay_s: float = 0.0) -> None:
        self.advised = 0
        self.delay_s = delay_s

    def advise(self, fd: int, offset: int, length: int) -> None:
        self.advised += 1
        super().advise(fd, offset, length)

    def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
        if self.delay_s:
            time.sleep(self.delay_s)  # a cold read: slower than the page cache
        return super().pread_into(fd, target, offset)


def test_advice_only_while_reads_are_slower_than_the_page_cache(dataset: pathlib.Path) -> None:
    opener = _CountingOpener()
    with ShardReader(dataset, opener=opener) as ds:
        batches = [list(range(i, i + 8)) for i in range(0, 64, 8)]
        for batch in batches:  # warm the page cache
            read_batch(ds, batch, shared=False)
        for _ in range(100):  # a busy machine may preempt a read: until one batch is fast
            if ds.reads_cached:
                break
            read_batch(ds, batches[0], shared=False)
        assert ds.reads_cached
        before = opener.advised
        read_batch(ds, batches[0], shared=False)
        assert opener.advised == before  # the last batch came from the cache: no advice
        opener.delay_s = 0.002
        read_batch(ds, batches[1], shared=False)  # slow now: the next batch is advised
        assert not ds.reads_cached
        read_batch(ds, batches[2], shared=False)
        assert opener.advised > before


def test_keys_of_many_samples_match_each_key(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as ds:
        samples = np.arange(len(ds))[::-3]
        ds.index.records(samples)
        assert ds.index.keys(samples) == [ds.key(int(s)) for s in samples]


def test_advice_ahead_goes_out_while_the_page_cache_lacks_those_batches(
    dataset: pathlib.Path,
) -> None:
    import os

    opener = _CountingOpener()
    with ShardReader(dataset, opener=opener) as ds:
        batches = [list(range(i, i + 8)) for i in range(0, 64, 8)]
        for batch in batches:  # warm the page cache
            read_batch(ds, batch, shared=False)
        for _ in range(100):
            if ds.reads_cached:
                break
            read_batch(ds, batches[0], shared=False)
        assert ds.reads_cached
        before = opener.advised
        ds.advise(batches[3], ahead=True)  # cached: a stream's next batch needs no advice
        assert opener.advised == before
        shard = ds.shard_of(batches[3][0])
        if not hasattr(os, "RWF_NOWAIT"):
            pytest.skip("no RWF_NOWAIT here: advice ahead always goes out")
        fd = os.open(ds.shard_path(shard), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
            try:
                # The last byte: a miss may start read-ahead, which runs forward only.
                os.preadv(fd, [bytearray(1)], os.fstat(fd).st_size - 1, os.RWF_NOWAIT)
                pytest.skip("this filesystem keeps the file in memory (tmpfs)")
            except BlockingIOError:
                pass
        finally:
            os.close(fd)
        ds.advise(batches[3], ahead=True)
        assert opener.advised > before  # not cached: advised, fast reads or not


def test_on_a_network_filesystem_the_page_cache_is_asked_by_mincore(
    dataset: pathlib.Path,
) -> None:
    """A FUSE client refuses RWF_NOWAIT: there the first member's pages are asked for with
    mincore (no byte read, no request sent), and advice ahead is left out while reads are
    fast (each piece of advice would be a hand-off to the deadline's thread)."""
    from shardio.storage.fsdetect import FsInfo

    opener = _CountingOpener()
    moosefs = FsInfo(name="moosefs", magic=0x65735546, mount_type="fuse.mfs")
    assert moosefs.network
    with ShardReader(dataset, opener=opener, fs=moosefs) as ds:
        batch = list(range(8))
        read_batch(ds, batch, shared=False)
        assert ds.first_cached(batch)  # just read: its pages are there
        ds.reads_cached = True
        before = opener.advised
        ds.advise(list(range(8, 16)), ahead=True)
        assert opener.advised == before
        if not evict([ds.shard_path(ds.shard_of(0))]):
            pytest.skip("this filesystem keeps the file in memory (tmpfs)")
        ds.reads_cached = False
        assert not ds.first_cached(batch)
        ds.advise(batch, ahead=True)  # slow reads: advised
        assert opener.advised > before
