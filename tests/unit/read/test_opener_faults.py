"""The opener interface and the fault-injecting opener, read through ShardReader."""

from __future__ import annotations

import errno
import pathlib
import pickle

import pytest

from shardio.errors import ChecksumMismatchError, StorageError, UsageError
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.reader import ShardReader


def _first_shard_sample(ds: ShardReader, shard: int = 0) -> int:
    return ds.manifest.shards[shard].first_sample


def _jpeg_offset(ds: ShardReader, sample: int) -> tuple[int, int]:
    for m in ds.index.sample_member_range(sample):
        rec = ds.index.members[m]
        if ds.index.exts[int(rec["ext_id"])] != "cls":
            return int(rec["offset"]), int(rec["size"])
    raise AssertionError("no payload member")


@pytest.fixture
def dataset(packed_small) -> pathlib.Path:  # type: ignore[no-untyped-def]
    return packed_small("tar")[0]


def test_posix_reads_match(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as plain, ShardReader(dataset, opener=FaultyOpener()) as ds:
        for i in range(0, len(ds), 37):
            assert ds.read_sample(i) == plain.read_sample(i)


@pytest.mark.parametrize(
    ("kind", "error", "needle"),
    [
        ("flip", ChecksumMismatchError, "checksum mismatch"),
        ("truncate", StorageError, "truncated"),
        ("eio", StorageError, "injected EIO"),
        ("missing", StorageError, "missing"),
        ("replaced", ChecksumMismatchError, "checksum mismatch"),
    ],
)
def test_each_fault_is_an_exception_naming_the_sample(
    dataset: pathlib.Path, kind: str, error: type[Exception], needle: str
) -> None:
    with ShardReader(dataset) as probe:
        sample = _first_shard_sample(probe, 1) + 1
        offset, size = _jpeg_offset(probe, sample)
        rel = probe.manifest.shards[1].path
        key = probe.key(sample)
    fault_offset = offset + size // 2 if kind == "flip" else offset + 10
    fault = Fault(kind=kind, path=rel, offset=fault_offset)
    with ShardReader(dataset, opener=FaultyOpener([fault])) as ds:
        with pytest.raises(error) as info:
            ds.read_sample(sample)
        assert needle in str(info.value)
        if kind != "missing":
            assert key in str(info.value) or getattr(info.value, "key", None) == key
        assert info.value.sample_index == sample  # type: ignore[attr-defined]
        ds.read_sample(_first_shard_sample(ds, 0))  # other shards unharmed


def test_eio_after_bytes_and_times(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as probe:
        rel = probe.manifest.shards[0].path
        first = sum(int(probe.index.members[m]["size"]) for m in probe.index.sample_member_range(0))
    opener = FaultyOpener([Fault(kind="eio_after", path=rel, after_bytes=first, times=1)])
    with ShardReader(dataset, opener=opener) as ds:
        ds.read_sample(0)  # the first read is below the threshold
        with pytest.raises(StorageError) as info:
            ds.read_sample(1)
        assert info.value.errno == errno.EIO
        ds.read_sample(1)  # fired once: the next read succeeds
        assert opener.fired == [1]


def test_short_and_slow_reads_still_deliver_verified_bytes(dataset: pathlib.Path) -> None:
    faults = [Fault(kind="short"), Fault(kind="slow", delay_s=0.0)]
    with ShardReader(dataset) as plain, ShardReader(dataset, opener=FaultyOpener(faults)) as ds:
        for i in range(0, len(ds), 23):
            assert ds.read_sample(i) == plain.read_sample(i)
        assert ds.opener.fired[0] > 0  # type: ignore[attr-defined]


def test_intermittent_eio_is_seeded(dataset: pathlib.Path) -> None:
    def outcomes(seed: int) -> list[bool]:
        opener = FaultyOpener([Fault(kind="eio", probability=0.5, seed=seed)])
        out = []
        with ShardReader(dataset, opener=opener) as ds:
            for i in range(40):
                try:
                    ds.read_sample(i)
                    out.append(True)
                except StorageError:
                    out.append(False)
        return out

    first = outcomes(7)
    assert first == outcomes(7)
    assert True in first
    assert False in first


def test_faulty_opener_pickles_with_its_faults_and_fresh_counts(dataset: pathlib.Path) -> None:
    opener = FaultyOpener([Fault(kind="flip", path="x", offset=3, times=2)])
    opener._local().fired[0] = 1
    copy = pickle.loads(pickle.dumps(opener))
    assert copy.faults == opener.faults
    assert copy.fired == [0]


def test_map_applies_faults(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as probe:
        path = probe.shard_path(0)
    opener = FaultyOpener([Fault(kind="flip", offset=5), Fault(kind="truncate", offset=100)])
    mm = opener.map(path)
    assert mm is not None
    assert len(mm) == 100
    assert mm[5] == pathlib.Path(path).read_bytes()[5] ^ 0xFF


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "bogus"},
        {"kind": "flip", "offset": -1},
        {"kind": "eio", "probability": 1.5},
        {"kind": "slow", "delay_s": -1.0},
        {"kind": "flip", "times": -1},
    ],
)
def test_bad_fault_specs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        Fault(**kwargs)  # type: ignore[arg-type]
