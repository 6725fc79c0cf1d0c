"""ResilientDataset through the fault-injecting opener: every fault class, map and stream,
0 and 2 workers, tar and HDF5. No wrong byte is ever delivered; each fault ends as its policy
says (recovered, substituted and journaled, or one clear error)."""

from __future__ import annotations

import collections
import pathlib
import pickle
import types
from typing import Any

import pytest

from shardio import RecoveryPolicy, SampleUnavailableError, ShardDataset
from shardio.order.ranks import RankInfo
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.journal import read_journal
from shardio.read.reader import ShardReader
from shardio.runtime.resilient import ResilientDataset

from .conftest import Packed

BATCH = 16

# (fault kind, extra Fault fields, persistent?): transient ones fire once per process.
TRANSIENT = [
    ("eio", {"times": 1}),
    ("eio", {"probability": 0.3, "seed": 5, "times": 3}),
    ("eio_after", {"after_bytes": 20_000, "times": 1}),
    ("short", {}),
    ("slow", {"delay_s": 0.001, "times": 20}),
    ("missing", {"times": 1}),
]
TRANSIENT_IDS = ["eio-once", "eio-intermittent", "eio-after", "short", "slow", "missing-once"]
PERSISTENT = ["flip", "truncate", "eio", "missing", "replaced"]


def _bad_shard(packed: Packed) -> tuple[int, str]:
    with ShardReader(packed.path) as ds:
        return 2, ds.manifest.shards[2].path


def _fault(packed: Packed, kind: str, **kw: Any) -> Fault:
    shard, rel = _bad_shard(packed)
    if kind == "flip":
        key = packed.keys[next(i for i, k in enumerate(packed.keys) if packed.shard_of[k] == shard)]
        _path, offset, size = packed.member_of(key)
        kw.setdefault("offset", offset + size // 2)
    if kind == "truncate":
        kw.setdefault("offset", 1000)
    return Fault(kind=kind, path=rel, **kw)


def _epoch(ds: Any, workers: int) -> list[dict[str, Any]]:
    return list(ds.loader(batch_size=BATCH, num_workers=workers))


def _check_bytes(packed: Packed, batches: list[dict[str, Any]]) -> list[str]:
    keys = []
    for batch in batches:
        for i, key in enumerate(batch["__key__"]):
            assert bytes(batch["jpeg"][i]) == packed.payload[key], f"wrong bytes for {key}"
            assert int(batch["cls"][i]) == packed.label[key]
            keys.append(key)
    return keys


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["map", "stream"])
@pytest.mark.parametrize(("kind", "extra"), TRANSIENT, ids=TRANSIENT_IDS)
def test_transient_faults_are_retried_and_every_sample_arrives_once(
    packed: Packed, mode: str, workers: int, kind: str, extra: dict[str, Any]
) -> None:
    opener = FaultyOpener([_fault(packed, kind, **extra)])
    ds = ShardDataset(
        packed.path,
        mode=mode,
        opener=opener,
        recovery=RecoveryPolicy(policy="raise", retries=5, backoff_s=0.0),
    )
    keys = _check_bytes(packed, _epoch(ds, workers))
    packed.assert_exactly_once(keys)
    assert ds.recovery_stats["skip"] == 0


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["map", "stream"])
@pytest.mark.parametrize("kind", PERSISTENT)
def test_persistent_faults_are_substituted_under_skip(
    packed: Packed, mode: str, workers: int, kind: str, tmp_path: pathlib.Path
) -> None:
    journal = tmp_path / "repairs.jsonl"
    opener = FaultyOpener([_fault(packed, kind)])
    ds = ShardDataset(
        packed.path,
        mode=mode,
        opener=opener,
        recovery=RecoveryPolicy(policy="skip", retries=1, backoff_s=0.0, journal=str(journal)),
    )
    keys = _check_bytes(packed, _epoch(ds, workers))
    assert len(keys) == len(packed.keys)  # the count stays the same
    skipped = [e for e in read_journal(journal) if e["event"] == "skip"]
    assert skipped, "nothing was substituted"
    shard, rel = _bad_shard(packed)
    substituted = collections.Counter(e["key"] for e in skipped)
    assert all(packed.shard_of[k] == shard for k in substituted)
    assert all(e["shard"] == rel for e in skipped)
    # every sample is delivered once or listed as substituted
    delivered = collections.Counter(keys)
    for key in packed.keys:
        assert delivered[key] >= 1 or key in substituted, key
        if key in substituted:
            assert delivered[key] == 0
    assert ds.recovery_stats["skip"] == len(skipped)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["map", "stream"])
@pytest.mark.parametrize("kind", ["flip", "truncate", "missing"])
def test_persistent_faults_raise_one_clear_error_under_raise(
    packed: Packed, mode: str, workers: int, kind: str
) -> None:
    opener = FaultyOpener([_fault(packed, kind)])
    ds = ShardDataset(
        packed.path,
        mode=mode,
        opener=opener,
        recovery=RecoveryPolicy(policy="raise", retries=2, backoff_s=0.0),
    )
    delivered: list[str] = []
    with pytest.raises(SampleUnavailableError) as info:
        for batch in ds.loader(batch_size=BATCH, num_workers=workers):
            delivered += _check_bytes(packed, [batch])
    err = info.value
    assert err.shard == _bad_shard(packed)[1]
    assert packed.shard_of[err.key] == _bad_shard(packed)[0]
    assert len(err.tried) >= 3
    assert "retry 2" in str(err)


def test_resume_after_substitution_is_exact(packed_tar: Packed, tmp_path: pathlib.Path) -> None:
    def make() -> Any:
        opener = FaultyOpener([_fault(packed_tar, "truncate")])
        return ShardDataset(
            packed_tar.path,
            opener=opener,
            seed=3,
            recovery=RecoveryPolicy(policy="skip", retries=0, journal=str(tmp_path / "j.jsonl")),
        )

    full = [b["__key__"] for b in make().loader(batch_size=BATCH, num_workers=2)]
    loader = make().loader(batch_size=BATCH, num_workers=2)
    head = []
    for i, batch in enumerate(loader):
        head.append(batch["__key__"])
        if i == 6:
            state = loader.state_dict()
            break
    resumed = make().loader(batch_size=BATCH, num_workers=2)
    resumed.load_state_dict(state)
    tail = [b["__key__"] for b in resumed]
    assert head + tail == full


def test_ranks_keep_equal_counts_under_skip(packed_tar: Packed, tmp_path: pathlib.Path) -> None:
    counts = []
    for rank in range(2):
        opener = FaultyOpener([_fault(packed_tar, "replaced")])
        ds = ShardDataset(
            packed_tar.path,
            opener=opener,
            ranks=RankInfo(rank=rank, world_size=2),
            recovery=RecoveryPolicy(policy="skip", retries=0, journal=str(tmp_path / "j.jsonl")),
        )
        counts.append(len(_check_bytes(packed_tar, _epoch(ds, 2))))
    assert counts[0] == counts[1] == -(-len(packed_tar.keys) // 2)


def test_resilient_dataset_pickles_and_getitem_recovers(packed_tar: Packed) -> None:
    opener = FaultyOpener([_fault(packed_tar, "eio", times=1)])
    ds = ShardDataset(
        packed_tar.path, opener=opener, recovery=RecoveryPolicy(policy="raise", backoff_s=0.0)
    )
    copy = pickle.loads(pickle.dumps(ds))
    assert type(copy) is ShardDataset
    assert copy.recovery_policy == ds.recovery_policy
    shard, _rel = _bad_shard(packed_tar)
    key = next(k for k in packed_tar.keys if packed_tar.shard_of[k] == shard)
    sample = copy[packed_tar.keys.index(key)]
    assert sample["jpeg"] == packed_tar.payload[key]
    assert copy.recovery_stats["retry"] == 1


def test_stream_mode_wrapper_is_iterable(packed_tar: Packed) -> None:
    from torch.utils.data import IterableDataset

    ds = ShardDataset(packed_tar.path, mode="stream", recovery="skip")
    assert isinstance(ds, IterableDataset) and isinstance(ds, ShardDataset)
    assert ds.recovery_policy is not None
    assert len(list(ds)) == len(packed_tar.keys)


def test_bad_arguments_are_refused(packed_tar: Packed) -> None:
    from shardio.errors import UsageError

    with pytest.raises(UsageError), pytest.warns(DeprecationWarning):
        ResilientDataset(str(packed_tar.path))  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        ShardDataset(packed_tar.path, recovery="ignore")
    with pytest.raises(UsageError):
        ShardDataset(packed_tar.path, recovery=RecoveryPolicy(policy="raise", retries=-1))
    with pytest.raises(UsageError):
        ShardDataset(packed_tar.path, rebuild=lambda shard: True)  # no policy to rebuild in
    with pytest.raises(UsageError):
        ShardDataset(packed_tar.path, recovery=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_recovery_is_a_policy_given_to_the_reader_not_a_subclass(
    packed_tar: Packed, mode: str
) -> None:
    """ShardDataset(recovery=...) is the one way; the older spellings (ResilientDataset, a
    plain function now, and with_recovery) warn and return the dataset's own kind with a
    policy; the dataset they were made from is unchanged."""
    opener = FaultyOpener([_fault(packed_tar, "flip")])
    plain = ShardDataset(packed_tar.path, mode=mode, opener=opener, shuffle=False)
    said = r"ResilientDataset\(ds, policy=\.\.\.\) is deprecated .* ShardDataset\(path, recovery="
    with pytest.warns(DeprecationWarning, match=said):
        wrapped = ResilientDataset(plain, policy="skip", retries=0)
    with pytest.warns(DeprecationWarning, match=r"with_recovery\(\.\.\.\) is deprecated"):
        again = plain.with_recovery("skip", retries=0)
    direct = ShardDataset(packed_tar.path, mode=mode, opener=opener, shuffle=False, recovery="skip")
    assert type(wrapped) is type(plain) is type(direct) is type(again)
    assert isinstance(ResilientDataset, types.FunctionType)  # no class, no metaclass
    assert plain.recovery_policy is None and plain.recovery_events == []
    assert again.recovery_policy.policy == wrapped.recovery_policy.policy == "skip"  # type: ignore[union-attr]
    assert wrapped.packed.restage and not plain.packed.restage  # opened with the policy's
    keys_wrapped = _check_bytes(packed_tar, _epoch(wrapped, 0))
    assert _check_bytes(packed_tar, _epoch(direct, 0)) == keys_wrapped
    assert wrapped.recovery_stats["skip"] >= 1
    assert plain.recovery_stats["skip"] == 0  # the plain one read nothing, counted nothing
    from shardio.errors import ChecksumMismatchError

    with pytest.raises(ChecksumMismatchError):
        _epoch(plain, 0)  # still raising its errors as they are
