"""Planned reads: coalescing, batched reads and the stream read-ahead."""

from __future__ import annotations

import os
import pathlib
import threading
import time
from typing import Any

import numpy as np
import pytest
from pagecache import evict

from shardio.errors import ChecksumMismatchError, StorageError, UsageError
from shardio.read import extents, readahead
from shardio.read.deadline import DeadlineOpener
from shardio.read.extents import Request, plan_requests
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.readahead import StreamReadahead
from shardio.read.reader import ShardReader
from shardio.read.strategy import PFS, ReadStrategy
from shardio.storage.opener import PosixOpener, null_sink
from shardio.storage.residency import resident

MiB = 1 << 20


# -- plan_requests ---------------------------------------------------------------------------
def test_neighbours_within_the_gap_are_one_request() -> None:
    reqs = plan_requests([0, 110, 300], [100, 100, 50], gap_bytes=16, request_bytes=MiB)
    assert reqs == [
        Request(start=0, end=210, items=(0, 1)),
        Request(start=300, end=350, items=(2,)),
    ]


def test_members_are_taken_in_file_order() -> None:
    reqs = plan_requests([500, 0, 100], [10, 100, 10], gap_bytes=0, request_bytes=MiB)
    assert [r.items for r in reqs] == [(1, 2), (0,)]


def test_requests_stay_within_request_bytes() -> None:
    offsets = list(range(0, 10 * 100, 100))
    reqs = plan_requests(offsets, [100] * 10, gap_bytes=0, request_bytes=300)
    assert [r.items for r in reqs] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,)]
    assert all(r.end - r.start <= 300 for r in reqs)


def test_a_member_longer_than_a_request_is_its_own() -> None:
    reqs = plan_requests([0, 1000], [1000, 10], gap_bytes=0, request_bytes=100)
    assert [(r.start, r.end, r.items) for r in reqs] == [(0, 1000, (0,)), (1000, 1010, (1,))]


def test_overlapping_records_are_kept_apart() -> None:
    reqs = plan_requests([0, 50], [100, 100], gap_bytes=1000, request_bytes=MiB)
    assert [r.items for r in reqs] == [(0,), (1,)]


def test_no_gap_means_only_adjacent_members_join() -> None:
    reqs = plan_requests([0, 100, 201], [100, 100, 10], gap_bytes=0, request_bytes=MiB)
    assert [r.items for r in reqs] == [(0, 1), (2,)]


def test_empty_plan() -> None:
    assert plan_requests([], [], gap_bytes=0, request_bytes=1) == []


# -- read_members_planned --------------------------------------------------------------------
@pytest.fixture
def dataset(packed_small) -> pathlib.Path:  # type: ignore[no-untyped-def]
    return packed_small("tar")[0]


def _payload_rows(ds: ShardReader, samples: list[int]) -> tuple[list[int], list[int], list[int]]:
    rows, shards, owners = [], [], []
    recs = ds.index.records(samples)
    for sample, rec in zip(samples, recs, strict=True):
        for m in ds.index.sample_member_range(sample):
            if int(ds.index.members[m]["size"]) > 0:
                rows.append(m)
                shards.append(int(rec["shard"]))
                owners.append(sample)
    return rows, shards, owners


def _read_planned(ds: ShardReader, samples: list[int], strategy: ReadStrategy = PFS) -> list[bytes]:
    rows, shards, owners = _payload_rows(ds, samples)
    sizes = [int(ds.index.members[m]["size"]) for m in rows]
    buf = bytearray(sum(sizes))
    view = memoryview(buf)
    ends = np.cumsum(sizes).tolist()
    targets = [view[e - s : e] for s, e in zip(sizes, ends, strict=True)]
    extents.read_members_planned(ds, rows, shards, owners, targets, strategy)
    return [bytes(t) for t in targets]


def _expected(ds: ShardReader, samples: list[int]) -> list[bytes]:
    rows, shards, owners = _payload_rows(ds, samples)
    return [
        ds.read_member(m, shard=s, sample=o) for m, s, o in zip(rows, shards, owners, strict=True)
    ]


def _opener(deadline: bool) -> Any:
    """A plain POSIX opener (runs at once on plain threads, the first in the caller), or
    one under a deadline (each run on an I/O thread of its own, watched by the caller)."""
    return DeadlineOpener(PosixOpener(), timeout_s=30) if deadline else PosixOpener()


@pytest.mark.parametrize("deadline", [False, True], ids=["plain", "deadline"])
@pytest.mark.parametrize("gap", [0, 4096, 1 << 20])
def test_planned_reads_equal_member_reads(dataset: pathlib.Path, gap: int, deadline: bool) -> None:
    """Gap 0: every request one member, read into its target and hashed by the thread that
    read it; wider gaps: neighbours coalesced, copied out of a scratch buffer and hashed by
    the caller."""
    strategy = ReadStrategy(
        name="pfs", inflight=4, coalesce_gap_bytes=gap, request_bytes=64 * 1024,
        stream_readahead_bytes=0,
    )  # fmt: skip
    with ShardReader(dataset, opener=_opener(deadline)) as ds:
        samples = list(np.random.default_rng(1).permutation(len(ds))[:120])
        samples += list(range(0, 40))  # neighbours: coalesced
        expected = _expected(ds, samples)
        before = ds.metrics.counts["members"]
        again = _count_member_reads(ds)
        assert _read_planned(ds, samples, strategy) == expected
        assert again == []  # every member passed where it was read: none read again
        assert ds.metrics.counts["members"] - before == len(expected)
        assert ds.metrics.counts["read_errors"] == 0


def _count_member_reads(ds: ShardReader) -> list[int]:
    """The rows ``ds.read_member_into`` is asked for from now on (the fallback)."""
    rows: list[int] = []
    inner = ds.read_member_into

    def counted(row: int, *args: Any, **kwargs: Any) -> Any:
        rows.append(row)
        return inner(row, *args, **kwargs)

    ds.read_member_into = counted  # type: ignore[method-assign]
    return rows


@pytest.mark.parametrize("deadline", [False, True], ids=["plain", "deadline"])
def test_a_member_flipped_on_disk_is_caught_where_it_was_read(
    dataset: pathlib.Path, tmp_path: pathlib.Path, deadline: bool
) -> None:
    """A plain POSIX opener reads and hashes each run in one compiled call (under a deadline
    too): a member whose bytes on disk differ fails there, is read again the careful way,
    and raises naming its sample; the other members of the batch are not read again."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    with ShardReader(copy) as plain:
        shard = plain.manifest.shards[0]
        sample = shard.first_sample + 2
        offset, _size = _member_of(plain, sample)
    with open(copy / shard.path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x40]))
    strategy = ReadStrategy(
        name="pfs", inflight=3, coalesce_gap_bytes=0, request_bytes=MiB, stream_readahead_bytes=0
    )
    with ShardReader(copy, opener=_opener(deadline)) as ds:
        again = _count_member_reads(ds)
        with pytest.raises(ChecksumMismatchError) as info:
            _read_planned(ds, list(range(shard.first_sample, sample + 8)), strategy)
        assert info.value.key == ds.key(sample)
        assert len(again) == 1  # only the flipped member went the careful way


def _member_of(ds: ShardReader, sample: int) -> tuple[int, int]:
    for m in ds.index.sample_member_range(sample):
        rec = ds.index.members[m]
        if int(rec["size"]) > 0:
            return int(rec["offset"]), int(rec["size"])
    raise AssertionError("no payload member")


@pytest.mark.parametrize("deadline", [False, True], ids=["plain", "deadline"])
@pytest.mark.parametrize("gap", [0, 1 << 20], ids=["direct", "coalesced"])
def test_a_flipped_byte_is_still_caught(dataset: pathlib.Path, gap: int, deadline: bool) -> None:
    with ShardReader(dataset) as plain:
        shard_path = plain.manifest.shards[0].path
        sample = plain.manifest.shards[0].first_sample + 1
        offset, _size = _member_of(plain, sample)
    strategy = ReadStrategy(
        name="pfs", inflight=4, coalesce_gap_bytes=gap, request_bytes=MiB, stream_readahead_bytes=0
    )
    opener: Any = FaultyOpener([Fault(kind="flip", path=shard_path, offset=offset + 3)])
    if deadline:
        opener = DeadlineOpener(opener, timeout_s=30)
    with ShardReader(dataset, opener=opener) as ds:
        with pytest.raises(ChecksumMismatchError) as info:
            _read_planned(ds, list(range(0, sample + 5)), strategy)
        assert info.value.key == ds.key(sample)
        assert ds.metrics.counts["checksum_failures"] >= 1


def test_a_failed_request_falls_back_to_the_member_read(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as plain:
        expected = _expected(plain, list(range(60)))
    # The first reads fail once each: the planned request fails, the member read succeeds.
    opener = FaultyOpener([Fault(kind="eio", times=3)])
    with ShardReader(dataset, opener=opener) as ds:
        assert _read_planned(ds, list(range(60))) == expected


def test_short_reads_are_completed(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as plain:
        expected = _expected(plain, list(range(50)))
    with ShardReader(dataset, opener=FaultyOpener([Fault(kind="short")])) as ds:
        assert _read_planned(ds, list(range(50))) == expected


def test_a_truncated_shard_raises_a_storage_error(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as plain:
        shard_path = plain.manifest.shards[0].path
    opener = FaultyOpener([Fault(kind="truncate", path=shard_path, offset=100)])
    with ShardReader(dataset, opener=opener) as ds, pytest.raises(StorageError, match="truncat"):
        _read_planned(ds, list(range(10)))


def test_planned_reads_open_each_shard_once(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as ds:
        _read_planned(ds, list(range(len(ds))))
        _read_planned(ds, list(range(len(ds))))
        assert ds.metrics.counts["opens_source"] == len(ds.manifest.shards)


# -- StreamReadahead -------------------------------------------------------------------------
def _evict(ds: ShardReader) -> bool:
    return evict(ds.shard_path(shard) for shard in range(len(ds.manifest.shards)))


def test_readahead_reads_every_shard_once_in_order(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as ds:
        order = list(range(len(ds.manifest.shards)))[::-1]
        total = sum(ds.manifest.shards[s].size_bytes for s in order)
        if not _evict(ds):
            pytest.skip("this filesystem keeps the shards in memory (tmpfs)")
        with StreamReadahead(ds, order, request_bytes=64 * 1024, ahead_bytes=1 << 30) as ra:
            last = [ds.manifest.shards[order[-1]].first_sample]
            ra.before_batch(last)  # waits until the last shard is read past it
            deadline = time.monotonic() + 30
            while not ra.finished and time.monotonic() < deadline:
                time.sleep(0.01)
        # Each shard's first request is read; the kernel's own read-ahead may bring the
        # pages after it, and those are passed over.
        assert ra.bytes_read + ra.bytes_resident == total
        assert ra.requests >= len(order) and ra.bytes_read >= len(order) * 64 * 1024
        assert ds.metrics.counts["opens_source"] == len(order)
        assert not [t for t in threading.enumerate() if t.name == "shardio-readahead"]


def _read_ahead_whole(ds: ShardReader, order: list[int]) -> StreamReadahead:
    """A read-ahead of ``order`` in 64 KiB requests, run to its end (within 30 s)."""
    with StreamReadahead(ds, order, request_bytes=64 * 1024, ahead_bytes=1 << 30) as ra:
        ra.before_batch([len(ds) - 1])
        deadline = time.monotonic() + 30
        while not ra.finished and time.monotonic() < deadline:
            time.sleep(0.01)
    return ra


def test_readahead_fills_the_page_cache_through_the_null_device(dataset: pathlib.Path) -> None:
    """The read-ahead copies nothing into the process: each request goes to the null device
    (``sendfile``) through the opener, and the shards are in the page cache after it."""
    calls: list[str] = []

    class Recording(PosixOpener):
        def pread_into(self, fd: int, target: memoryview, offset: int) -> int:
            calls.append("pread")
            return super().pread_into(fd, target, offset)

        def copy_into(self, fd: int, out: int, offset: int, count: int) -> int:
            calls.append("copy")
            assert os.path.realpath(f"/proc/self/fd/{out}") == "/dev/null"
            return super().copy_into(fd, out, offset, count)

    with ShardReader(dataset, opener=Recording()) as ds:
        order = list(range(len(ds.manifest.shards)))
        if not _evict(ds):
            pytest.skip("this filesystem keeps the shards in memory (tmpfs)")
        ra = _read_ahead_whole(ds, order)
        assert ra.finished and ra.requests >= len(order)
        assert "copy" in calls and "pread" not in calls
        for shard in order:
            fd = os.open(ds.shard_path(shard), os.O_RDONLY)
            try:
                assert resident(fd, 0, os.fstat(fd).st_size)
            finally:
                os.close(fd)


def test_without_a_null_device_the_readahead_reads_into_its_buffer(
    dataset: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(readahead, "null_sink", lambda: None)
    with ShardReader(dataset) as ds:
        order = list(range(len(ds.manifest.shards)))
        total = sum(ds.manifest.shards[s].size_bytes for s in order)
        if not _evict(ds):
            pytest.skip("this filesystem keeps the shards in memory (tmpfs)")
        ra = _read_ahead_whole(ds, order)
        assert ra.bytes_read + ra.bytes_resident == total and ra.bytes_read > 0


def test_the_null_sink_is_the_null_device_or_nothing(tmp_path: pathlib.Path) -> None:
    fd = null_sink()
    assert fd is not None
    os.close(fd)
    planted = tmp_path / "null"
    planted.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to("/dev/null")
    assert null_sink(str(planted)) is None and planted.read_bytes() == b"keep"
    assert null_sink(str(link)) is None  # a symlink is not followed
    assert null_sink(str(tmp_path / "absent")) is None and not (tmp_path / "absent").exists()
    assert null_sink("/dev/zero") is None  # a character device, not the null one
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert null_sink(str(fifo)) is None  # never opened (an open for writing could block)


def test_readahead_passes_over_what_the_page_cache_holds(dataset: pathlib.Path) -> None:
    """A warm epoch (or a sibling worker that read a shard first): nothing is read again."""
    with ShardReader(dataset) as ds:
        order = list(range(len(ds.manifest.shards)))
        total = sum(ds.manifest.shards[s].size_bytes for s in order)
        for shard in order:  # into the page cache
            with open(ds.shard_path(shard), "rb") as fh:
                fh.read()
        with StreamReadahead(ds, order, request_bytes=16 * 1024, ahead_bytes=1 << 30) as ra:
            ra.before_batch([len(ds) - 1])
            deadline = time.monotonic() + 30
            while not ra.finished and time.monotonic() < deadline:
                time.sleep(0.01)
        assert ra.finished
        if ra.bytes_read == total:
            pytest.skip("mincore cannot tell residency here")
        assert (ra.bytes_read, ra.bytes_resident, ra.requests) == (0, total, 0)


def test_readahead_stays_within_its_bound(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as ds:
        order = list(range(len(ds.manifest.shards)))
        ra = StreamReadahead(ds, order, request_bytes=16 * 1024, ahead_bytes=64 * 1024).start()
        try:
            time.sleep(0.3)  # nothing begun: at most ahead_bytes + one request read
            assert ra.bytes_read <= 64 * 1024 + 16 * 1024
        finally:
            ra.close()


def test_a_stalled_readahead_is_left_behind(
    dataset: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(readahead, "_STALL_S", 0.3)
    release = dataset.parent / "release-readahead"
    opener = FaultyOpener([Fault(kind="hang", delay_s=30, release=os.fspath(release))])
    try:
        with ShardReader(dataset, opener=opener) as ds:
            ra = StreamReadahead(ds, [0, 1], request_bytes=1 << 20, ahead_bytes=1 << 30).start()
            began = time.monotonic()
            ra.before_batch([ds.manifest.shards[1].first_sample])
            assert time.monotonic() - began < 10  # gave up, the reader reads itself
            ra.before_batch([ds.manifest.shards[0].first_sample])  # no second wait
            assert time.monotonic() - began < 10
            ra.close()
    finally:
        release.touch()


def test_readahead_of_an_unreadable_shard_does_not_block(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as plain:
        shard_path = plain.manifest.shards[0].path
    opener = FaultyOpener([Fault(kind="eio", path=shard_path)])
    with (
        ShardReader(dataset, opener=opener) as ds,
        StreamReadahead(ds, [0, 1], request_bytes=1 << 20, ahead_bytes=1 << 30) as ra,
    ):
        ra.before_batch([0, ds.manifest.shards[1].first_sample])


@pytest.mark.parametrize(
    "change",
    [
        {"inflight": 0},
        {"inflight": 10**9},
        {"request_bytes": 0},
        {"request_bytes": 1 << 40},
        {"coalesce_gap_bytes": -1},
        {"coalesce_gap_bytes": 1 << 40},
        {"stream_readahead_bytes": -1},
    ],
)
def test_a_strategy_out_of_bounds_is_refused(change: dict[str, int]) -> None:
    values = {
        "name": "pfs", "inflight": 4, "coalesce_gap_bytes": 0, "request_bytes": MiB,
        "stream_readahead_bytes": 0,
    }  # fmt: skip
    with pytest.raises(UsageError):
        ReadStrategy(**{**values, **change})  # type: ignore[arg-type]


def test_sibling_readers_each_read_every_shard_whole(dataset: pathlib.Path) -> None:
    """Two readers of one epoch (the loader's workers) each go through the shards whole (what
    the other read first is found in the page cache, not read again); split requests
    measured slower on the bed."""
    with ShardReader(dataset) as ds:
        order = list(range(len(ds.manifest.shards)))
        total = sum(ds.manifest.shards[s].size_bytes for s in order)
        for _ in range(2):
            with StreamReadahead(ds, order, request_bytes=16 * 1024, ahead_bytes=1 << 30) as ra:
                ra.before_batch([len(ds) - 1])  # every shard begun: no bound holds it back
                deadline = time.monotonic() + 30
                while not ra.finished and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert ra.finished
                assert ra.bytes_read + ra.bytes_resident == total
