"""ShardDataset(read_strategy=...): both read paths deliver the same verified bytes, in the
same order, with the same opens; the choice is validated, overridable and reaches workers."""

from __future__ import annotations

import os
import pickle
import threading

import pytest
from pagecache import evict

from shardio.errors import ChecksumMismatchError, UsageError
from shardio.order.ranks import RankInfo
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.readahead import StreamReadahead
from shardio.read.reader import ShardReader
from shardio.read.strategy import ENV_VAR
from shardio.runtime.dataset import ShardDataset

SINGLE = RankInfo()


def _evicted(root: str) -> bool:
    """The dataset's shards dropped from the page cache (False: this filesystem keeps them)."""
    with ShardReader(root) as ds:
        return evict(ds.shard_path(shard) for shard in range(len(ds.manifest.shards)))


def _cold(root: str) -> None:
    """A stream read-ahead starts at the first batch not in the page cache: drop it first."""
    if not _evicted(root):
        pytest.skip("this filesystem keeps the shards in memory (tmpfs)")


def _read(packed, mode: str, strategy: str, workers: int) -> tuple[list[str], dict[str, int]]:  # type: ignore[no-untyped-def]
    ds = ShardDataset(packed.path, mode=mode, ranks=SINGLE, seed=5, read_strategy=strategy)
    assert ds.read_choice.strategy.name == strategy
    loader = ds.loader(batch_size=32, num_workers=workers)
    keys: list[str] = []
    for batch in loader:
        keys.extend(packed.check_batch(batch))  # every byte equals the source's
    return keys, dict(loader.metrics().counters)


@pytest.mark.parametrize("mode", ["map", "stream"])
@pytest.mark.parametrize("workers", [0, 2])
def test_both_strategies_deliver_the_same_epoch(packed, mode, workers) -> None:  # type: ignore[no-untyped-def]
    local_keys, local_counts = _read(packed, mode, "local", workers)
    pfs_keys, pfs_counts = _read(packed, mode, "pfs", workers)
    packed.assert_exactly_once(pfs_keys)
    assert pfs_keys == local_keys  # the order is the epoch's, whatever the read path
    assert pfs_counts["members"] == local_counts["members"] == len(packed.keys)
    assert pfs_counts["opens_source"] == local_counts["opens_source"]
    assert pfs_counts["read_errors"] == pfs_counts["checksum_failures"] == 0


@pytest.mark.parametrize("strategy", ["pfs", "local"])
def test_stream_reads_ahead_in_a_named_thread(packed_tar, monkeypatch, strategy) -> None:  # type: ignore[no-untyped-def]
    seen: list[tuple[str, bool]] = []
    run = StreamReadahead._run

    def spy(self: StreamReadahead) -> None:
        seen.append((threading.current_thread().name, threading.current_thread().daemon))
        run(self)

    monkeypatch.setattr(StreamReadahead, "_run", spy)
    _cold(packed_tar.path)
    ds = ShardDataset(packed_tar.path, mode="stream", ranks=SINGLE, read_strategy=strategy)
    for batch in ds.loader(batch_size=16, num_workers=0):
        packed_tar.check_batch(batch)
    assert seen == [("shardio-readahead", True)]
    assert "shardio-readahead" not in {t.name for t in threading.enumerate()}


def test_the_stream_read_ahead_may_hold_the_next_whole_window(packed_tar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A window's first batch needs all its shards: the read-ahead may read the next window
    whole while this one is read (64 MiB alone stopped it halfway on the bed)."""
    bounds: list[int] = []
    init = StreamReadahead.__init__

    def spy(self: StreamReadahead, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        bounds.append(kwargs["ahead_bytes"])
        init(self, *args, **kwargs)

    monkeypatch.setattr(StreamReadahead, "__init__", spy)
    _cold(packed_tar.path)
    ds = ShardDataset(
        packed_tar.path, mode="stream", ranks=SINGLE, read_strategy="pfs", window_shards=3
    )
    sizes = sorted((s.size_bytes for s in ds.packed.manifest.shards), reverse=True)
    for batch in ds.loader(batch_size=16, num_workers=0):
        packed_tar.check_batch(batch)
    least = ds.read_choice.strategy.stream_readahead_bytes
    assert bounds == [max(least, sum(sizes[:3]))]
    assert ds._readahead_bound(1) == sum(sizes[:3])
    assert ds._readahead_bound(1 << 40) == 1 << 40
    flat = ShardDataset(packed_tar.path, mode="stream", ranks=SINGLE, order="order=random")
    assert flat._readahead_bound(7) == 7  # no windows: the strategy's bound


@pytest.mark.parametrize("strategy", ["pfs", "local"])
def test_stream_mode_reads_ahead_and_advises_nothing(packed_tar, monkeypatch, strategy) -> None:  # type: ignore[no-untyped-def]
    """Both strategies read stream mode's shards ahead (on a local disk too: a window's
    shuffled member reads are random reads, which cost CPU cold). The read-ahead fills the
    page cache: advice on top would ask for the same pages again, a call per member range."""
    started: list[int] = []
    start = StreamReadahead.start

    def spy_start(self: StreamReadahead) -> StreamReadahead:
        started.append(len(self._order))
        return start(self)

    monkeypatch.setattr(StreamReadahead, "start", spy_start)
    calls: list[int] = []
    advise = ShardReader._advise_range

    def spy(self, shard, lo, hi) -> None:  # type: ignore[no-untyped-def]
        calls.append(shard)
        advise(self, shard, lo, hi)

    monkeypatch.setattr(ShardReader, "_advise_range", spy)
    _cold(packed_tar.path)
    ds = ShardDataset(packed_tar.path, mode="stream", ranks=SINGLE, read_strategy=strategy)
    for batch in ds.loader(batch_size=16, num_workers=0):
        packed_tar.check_batch(batch)
    assert started == [packed_tar.num_shards]  # one read-ahead, of every shard
    assert calls == []
    assert ds.packed.advising  # back on once the epoch is over


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_read_ahead_starts_only_where_the_page_cache_lacks_a_batch(
    packed_tar, monkeypatch, tmp_path, workers
) -> None:  # type: ignore[no-untyped-def]
    """Cold: a read-ahead per reader, from its first batch not in the page cache. Warm (the
    epoch again): none, and the same bytes: a read-ahead that only finds resident pages
    costs CPU for nothing."""
    log = tmp_path / "starts"  # a file: the workers' starts happen in their processes
    init = StreamReadahead.__init__

    def spy(self: StreamReadahead, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()} {len(args[1])}\n")
        init(self, *args, **kwargs)

    def starts() -> list[str]:
        lines = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return lines

    monkeypatch.setattr(StreamReadahead, "__init__", spy)
    _cold(packed_tar.path)
    ds = ShardDataset(packed_tar.path, mode="stream", ranks=SINGLE, read_strategy="local", seed=3)
    loader = ds.loader(batch_size=16, num_workers=workers, persistent_workers=False)
    cold = [k for batch in loader for k in packed_tar.check_batch(batch)]
    packed_tar.assert_exactly_once(cold)
    started = starts()
    # At most one per reader; a worker whose batches a sibling's read-ahead (or reads) put in
    # the page cache first starts none.
    assert 1 <= len(started) == len({line.split()[0] for line in started}) <= max(1, workers)
    if workers == 0:
        assert started[0].split()[1] == str(packed_tar.num_shards)
    warm = [k for batch in loader for k in packed_tar.check_batch(batch)]
    assert warm == cold
    assert starts() == []


@pytest.mark.parametrize("strategy", ["local", "pfs"])
def test_the_training_process_reads_the_first_window_ahead_while_its_workers_start(
    packed_tar, monkeypatch, tmp_path, strategy
) -> None:  # type: ignore[no-untyped-def]
    """Forked workers start their read-ahead only after the ring, the forks and torch's
    worker set-up: the training process reads the run's first window ahead meanwhile, once
    (not warm, not for reader threads, not with no workers), and the epoch is the same."""
    log = tmp_path / "starts"
    init = StreamReadahead.__init__

    def spy(self: StreamReadahead, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()} {','.join(map(str, args[1]))} {kwargs['ahead_bytes']}\n")
        init(self, *args, **kwargs)

    def parent_starts() -> list[list[str]]:
        lines = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return [line.split()[1:] for line in lines if line.split()[0] == str(os.getpid())]

    monkeypatch.setattr(StreamReadahead, "__init__", spy)
    # A deadline under "pfs": the workers fork while the read-ahead's calls are in flight on
    # the training process's I/O threads (a forked child forgets them).
    timeout = 5.0 if strategy == "pfs" else 0.0
    ds = ShardDataset(
        packed_tar.path,
        mode="stream",
        ranks=SINGLE,
        read_strategy=strategy,
        seed=4,
        window_shards=2,
        read_timeout_s=timeout,
    )
    sizes = [s.size_bytes for s in ds.packed.manifest.shards]
    loader = ds.loader(batch_size=16, num_workers=2, persistent_workers=False)
    _cold(packed_tar.path)
    cold = [k for batch in loader for k in packed_tar.check_batch(batch)]
    packed_tar.assert_exactly_once(cold)
    (started,) = parent_starts()
    window = [int(s) for s in started[0].split(",")]
    first = ds._first_shards(ds.epoch_order())
    assert window == first[: len(window)]  # the shards in the order the run reaches them
    bound = ds._readahead_bound(ds.read_choice.strategy.stream_readahead_bytes)
    assert sum(sizes[s] for s in window[:-1]) < bound  # no shard past the bound
    assert int(started[1]) == sum(sizes[s] for s in window) + 1  # it reads them and ends
    assert ds._warming is None
    assert "shardio-readahead" not in {t.name for t in threading.enumerate()}
    warm = [k for batch in loader for k in packed_tar.check_batch(batch)]
    assert warm == cold
    assert parent_starts() == []  # the page cache holds the first batch: nothing read ahead
    _cold(packed_tar.path)
    alone = ds.loader(batch_size=16, num_workers=0)
    assert [k for batch in alone for k in packed_tar.check_batch(batch)] == cold
    assert [ahead for _, ahead in parent_starts()] == [str(bound)]  # its own read-ahead only
    _cold(packed_tar.path)
    threads = ds.loader(batch_size=16, num_workers=2, threads=True)
    assert sorted(k for batch in threads for k in packed_tar.check_batch(batch)) == sorted(cold)
    for shards, ahead in parent_starts():  # the reader threads' own, none of the warm-up's
        assert int(ahead) == bound != sum(sizes[int(s)] for s in shards.split(",")) + 1
    threads.close()


def _planned_calls(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    import shardio.runtime.batch as batch_module

    calls: list[int] = []
    inner = batch_module.read_members_planned

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(args[1]))
        return inner(*args, **kwargs)

    monkeypatch.setattr(batch_module, "read_members_planned", counted)
    return calls


def test_pfs_map_reads_on_io_threads_what_the_page_cache_lacks(packed_tar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = _planned_calls(monkeypatch)
    if not _evicted(packed_tar.path):
        pytest.skip("this filesystem keeps the shards in memory (tmpfs)")
    ds = ShardDataset(packed_tar.path, mode="map", ranks=SINGLE, read_strategy="pfs")
    for batch in ds.loader(batch_size=16, num_workers=0):
        packed_tar.check_batch(batch)
    assert calls  # the first batch at least: its first member was not in the page cache
    assert any(t.name == "shardio-io" for t in threading.enumerate())  # runs at once


def test_pfs_map_reads_cached_pages_in_turn(packed_tar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """From the page cache, requests in flight gain nothing and each costs a hand-off. On a
    network filesystem the batch's first member is asked for with mincore (no timing: the
    answer does not depend on how loaded the machine is)."""
    from shardio.read.strategy import PFS
    from shardio.runtime.batch import read_batch
    from shardio.storage.fsdetect import FsInfo

    calls = _planned_calls(monkeypatch)
    moosefs = FsInfo(name="moosefs", magic=0x65735546, mount_type="fuse.mfs")
    with ShardReader(packed_tar.path, fs=moosefs, read_strategy=PFS) as ds:
        batches = [list(range(i, min(i + 16, len(ds)))) for i in range(0, len(ds), 16)]
        for shard in range(len(ds.manifest.shards)):  # into the page cache
            with open(ds.shard_path(shard), "rb") as fh:
                fh.read()
        for batch in batches:
            ds.reads_cached = False  # as after a slow batch: the probe alone decides
            read_batch(ds, batch, shared=False)
    assert calls == []


@pytest.mark.parametrize("mode", ["map", "stream"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_flipped_byte_is_caught_with_the_pfs_path(packed_tar, mode, workers) -> None:  # type: ignore[no-untyped-def]
    path, offset, _size = packed_tar.member_of(packed_tar.keys[7])
    opener = FaultyOpener([Fault(kind="flip", path=path.rsplit("/", 1)[-1], offset=offset + 1)])
    ds = ShardDataset(packed_tar.path, mode=mode, ranks=SINGLE, read_strategy="pfs", opener=opener)
    with pytest.raises(ChecksumMismatchError) as info:
        for _batch in ds.loader(batch_size=16, num_workers=workers):
            pass
    assert info.value.key == packed_tar.keys[7]


def test_auto_on_a_local_disk_is_local(packed_tar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(ENV_VAR, raising=False)
    ds = ShardDataset(packed_tar.path, ranks=SINGLE)
    assert ds.read_choice.strategy.name == "local"
    assert ds.packed.read_strategy is not None
    assert ds.packed.read_strategy.inflight == 1  # today's path: one pread per member


def test_the_environment_variable_chooses(packed_tar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(ENV_VAR, "pfs")
    assert ShardDataset(packed_tar.path, ranks=SINGLE).read_choice.strategy.name == "pfs"
    # The argument wins over the variable.
    chosen = ShardDataset(packed_tar.path, ranks=SINGLE, read_strategy="local").read_choice
    assert chosen.strategy.name == "local"
    monkeypatch.setenv(ENV_VAR, "fast" * 100)
    with pytest.raises(UsageError, match=ENV_VAR):
        ShardDataset(packed_tar.path, ranks=SINGLE)


@pytest.mark.parametrize("bad", ["lustre", "", "pfs\x00", "x" * 10_000])
def test_a_bad_strategy_is_refused(packed_tar, bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="read_strategy"):
        ShardDataset(packed_tar.path, ranks=SINGLE, read_strategy=bad)


@pytest.mark.parametrize("bad", [1, True, b"pfs", ["pfs"]])
def test_a_strategy_that_is_not_a_string_is_refused(packed_tar, bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="read_strategy must be a string"):
        ShardDataset(packed_tar.path, ranks=SINGLE, read_strategy=bad)


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_the_choice_travels_to_workers(packed_tar, mode) -> None:  # type: ignore[no-untyped-def]
    ds = ShardDataset(packed_tar.path, mode=mode, ranks=SINGLE, read_strategy="pfs")
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.read_choice == ds.read_choice
    expected = ds.read_choice.strategy if mode == "map" else None
    assert copy.packed.read_strategy == expected


def test_each_of_several_workers_takes_a_share_of_the_requests(packed_tar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from shardio.runtime import reading as module

    class Info:
        id, num_workers = 0, 2

    ds = ShardDataset(packed_tar.path, mode="map", ranks=SINGLE, read_strategy="pfs")
    assert ds._batch_strategy() == ds.read_choice.strategy  # in-process: all of them
    monkeypatch.setattr(module, "worker_info", Info)
    share = ds._batch_strategy()
    assert share is not None
    assert share.inflight == module.MIN_WORKER_INFLIGHT < ds.read_choice.strategy.inflight
