"""Stalled reads (a dead data server, simulated by a "hang" fault) never stop or freeze an
epoch: the read deadline abandons them, the shard is held, its samples are substituted and
journaled, stuck workers are replaced, and a run killed during a stall resumes exactly."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from shardio import MixedDataset, RecoveryPolicy, ShardDataset, ShardLoader
from shardio.errors import ReadStalledError, SampleUnavailableError, StorageError, UsageError
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.journal import read_journal
from shardio.read.reader import ShardReader

_SUBPROCESS_TIMEOUT_S = 120


@pytest.fixture
def dataset(packed_small: Any, tmp_path: pathlib.Path) -> pathlib.Path:
    # A copy per test: the node's registry of held shards is keyed by the dataset's path.
    dst = tmp_path / "ds"
    shutil.copytree(packed_small("tar")[0], dst)
    return dst


@pytest.fixture
def release(tmp_path: pathlib.Path) -> Any:
    path = tmp_path / "release"
    yield path
    path.touch()  # every hung thread ends with the test


def _truth(root: pathlib.Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every sample's members by key, and the shard of each key."""
    with ShardReader(root) as ds:
        samples = {ds.key(i): ds.read_sample(i) for i in range(len(ds))}
        shards = [ds.manifest.shards[ds.shard_of(i)].path for i in range(len(ds))]
    return samples, shards


def _check_batch(batch: dict[str, Any], truth: dict[str, dict[str, Any]]) -> list[str]:
    keys = list(batch["__key__"])
    for field, column in batch.items():
        if field in ("__key__", "cls"):
            continue
        for key, value in zip(keys, column, strict=True):
            assert bytes(value) == truth[key][field], (key, field)
    return keys


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["map", "stream"])
def test_a_dead_shard_costs_one_deadline_and_its_samples_are_substituted(
    dataset: pathlib.Path, release: pathlib.Path, tmp_path: pathlib.Path, mode: str, workers: int
) -> None:
    truth, shard_of_key = _truth(dataset)
    keys_by_index = list(truth)
    dead = shard_of_key[len(shard_of_key) // 2]
    lost = {k for k, s in zip(keys_by_index, shard_of_key, strict=True) if s == dead}
    journal = tmp_path / "repairs.jsonl"
    opener = FaultyOpener([Fault(kind="hang", path=dead, release=str(release))])
    ds = ShardDataset(
        dataset,
        mode=mode,
        seed=1,
        read_timeout_s=0.5,
        opener=opener,
        recovery=RecoveryPolicy(policy="skip", journal=str(journal)),
    )
    loader = ShardLoader(ds, batch_size=8, num_workers=workers)
    delivered: list[str] = []
    for batch in loader:
        delivered += _check_batch(batch, truth)  # every delivered byte is the packed one
    assert len(delivered) == len(truth)
    assert not lost & set(delivered)  # none read from the dead shard
    counters = loader.metrics().counters
    assert 1 <= counters["stalls"] <= max(1, workers)  # per shard, not per sample
    assert counters["stall_ms"] >= 500 * counters["stalls"]
    assert counters["substitutes"] == len(lost)
    events = [e for e in read_journal(journal) if e["event"] == "skip"]
    assert {e["key"] for e in events} == lost
    assert all(e["substitute_key"] not in lost for e in events)
    assert any("stalled for 0.5 s" in e["error"] or "held" in e["error"] for e in events)


@pytest.mark.parametrize("workers", [0, 2])
def test_without_a_policy_a_stall_raises_naming_the_shard(
    dataset: pathlib.Path, release: pathlib.Path, workers: int
) -> None:
    with ShardReader(dataset) as probe:
        dead = probe.manifest.shards[0].path
    opener = FaultyOpener([Fault(kind="hang", path=dead, release=str(release))])
    ds = ShardDataset(dataset, shuffle=False, read_timeout_s=0.3, opener=opener)
    loader = ShardLoader(ds, batch_size=4, num_workers=workers)
    with pytest.raises(ReadStalledError) as info:
        for _ in loader:
            pass
    assert dead in str(info.value) and "stalled for 0.3 s" in str(info.value)
    assert info.value.retryable
    raising = ShardDataset(
        dataset,
        shuffle=False,
        read_timeout_s=0.3,
        opener=opener,
        recovery=RecoveryPolicy(policy="raise", retries=1, backoff_s=0),
    )
    with pytest.raises(SampleUnavailableError, match=r"held unavailable|stalled"):
        for _ in ShardLoader(raising, batch_size=4, num_workers=workers):
            pass


def _epoch_keys(root: pathlib.Path, seed: int) -> list[str]:
    ds = ShardDataset(root, seed=seed)
    return [k for b in ShardLoader(ds, batch_size=8) for k in b["__key__"]]


def test_stuck_workers_are_replaced_and_the_epoch_resumes_exactly(
    dataset: pathlib.Path, release: pathlib.Path
) -> None:
    truth, _ = _truth(dataset)
    expected = _epoch_keys(dataset, seed=3)
    with ShardReader(dataset) as probe:
        dead = probe.manifest.shards[5].path
    # No read deadline: the watchdog alone must notice (a stall the deadline cannot cover).
    opener = FaultyOpener([Fault(kind="hang", path=dead, release=str(release))])
    ds = ShardDataset(dataset, seed=3, read_timeout_s=0, opener=opener)
    loader = ShardLoader(ds, batch_size=8, num_workers=2, worker_timeout_s=2)

    def release_after_restart() -> None:
        end = time.monotonic() + 60
        while not ds.read_metrics().counts["worker_restarts"] and time.monotonic() < end:
            time.sleep(0.05)
        release.touch()

    helper = threading.Thread(target=release_after_restart, daemon=True)
    helper.start()
    delivered = [k for b in loader for k in _check_batch(b, truth)]
    helper.join(timeout=60)
    assert delivered == expected  # nothing lost, nothing twice
    assert loader.metrics().counters["worker_restarts"] >= 2


def test_workers_that_never_progress_end_in_a_storage_error(
    dataset: pathlib.Path, release: pathlib.Path
) -> None:
    with ShardReader(dataset) as probe:
        dead = probe.manifest.shards[0].path
    opener = FaultyOpener([Fault(kind="hang", path=dead, release=str(release))])
    ds = ShardDataset(dataset, shuffle=False, read_timeout_s=0, opener=opener)
    loader = ShardLoader(ds, batch_size=8, num_workers=2, worker_timeout_s=1, max_worker_restarts=1)
    with pytest.raises(StorageError, match="no batch arrived for 1 s"):
        for _ in loader:
            pass


def test_a_mix_whose_workers_hang_ends_in_a_storage_error_and_resumes_exactly(
    dataset: pathlib.Path, packed_small: Any, release: pathlib.Path
) -> None:
    """A mix's loader: a read that never returns (no deadline) kills the workers after
    worker_timeout_s and raises a StorageError; the state resumes exactly."""
    other = packed_small("hdf5")[0]
    with ShardReader(dataset) as probe:
        dead = probe.manifest.shards[len(probe.manifest.shards) // 2].path
    opener = FaultyOpener([Fault(kind="hang", path=dead, release=str(release))])

    def mix(faulty: bool) -> MixedDataset:
        kw: dict[str, Any] = {"read_timeout_s": 0, "opener": opener} if faulty else {}
        return MixedDataset(
            [(ShardDataset(dataset, seed=4, **kw), 0.5), (ShardDataset(other, seed=5), 0.5)],
            seed=2,
        )

    expected = [k for b in mix(False).loader(8) for k in b["__key__"]]
    loader = mix(True).loader(8, 2, worker_timeout_s=1)
    delivered: list[str] = []
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"no batch arrived for 1 s") as info:
        for batch in loader:
            delivered += batch["__key__"]
    assert time.monotonic() - started < 60
    assert str(dataset) in str(info.value)
    state = loader.state_dict()
    release.touch()
    again = mix(True).loader(8, 2)
    again.load_state_dict(state)
    delivered += [k for b in again for k in b["__key__"]]
    assert delivered == expected  # nothing lost, nothing twice


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"worker_timeout_s": -1}, "worker_timeout_s"),
        ({"worker_timeout_s": float("nan")}, "worker_timeout_s"),
        ({"worker_timeout_s": 1e300}, "worker_timeout_s"),
        ({"worker_timeout_s": "60"}, "worker_timeout_s"),
        ({"collate_fn": None}, "ShardLoader sets collate_fn itself"),
    ],
)
def test_mixed_loader_timeouts_are_checked(
    dataset: pathlib.Path, kwargs: dict[str, Any], message: str
) -> None:
    mixed = MixedDataset([(ShardDataset(dataset), 1.0)])
    with pytest.raises(UsageError, match=message):
        mixed.loader(4, 1, **kwargs)


_KILLED_RUN = textwrap.dedent(
    """
    import json, sys
    from shardio import ShardDataset, ShardLoader
    from shardio.read.faults import Fault, FaultyOpener
    root, dead, state_file = sys.argv[1:4]
    # No deadline and no workers: the process blocks in the stalled read until killed.
    opener = FaultyOpener([Fault(kind="hang", path=dead)])
    ds = ShardDataset(root, seed=5, read_timeout_s=0, opener=opener)
    loader = ShardLoader(ds, batch_size=4)
    for batch in loader:
        with open(state_file + ".tmp", "w") as f:
            json.dump({"state": loader.state_dict(), "keys": list(batch["__key__"])}, f)
        import os; os.replace(state_file + ".tmp", state_file)
    """
)


def test_sigkill_during_a_stall_then_resume_reads_exactly_the_rest(
    dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    expected = [k for b in ShardLoader(ShardDataset(dataset, seed=5), batch_size=4)
                for k in b["__key__"]]  # fmt: skip
    with ShardReader(dataset) as probe:
        order = [probe.shard_of(i) for i in range(len(probe))]
        keys = {probe.key(i): order[i] for i in range(len(probe))}
        # The shard of the 10th sample of the epoch: the run stalls after a few batches.
        dead = probe.manifest.shards[keys[expected[10]]].path
    state_file = tmp_path / "state.json"
    log = tmp_path / "stderr.txt"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_RUN, str(dataset), dead, str(state_file)],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        end = time.monotonic() + _SUBPROCESS_TIMEOUT_S
        while not state_file.exists() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(1.0)  # it is blocked in the stalled read by now
        assert proc.poll() is None, log.read_text()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=_SUBPROCESS_TIMEOUT_S)
    saved = json.loads(state_file.read_text())
    done = expected.index(saved["keys"][-1]) + 1
    assert expected[done - len(saved["keys"]) : done] == saved["keys"]
    ds = ShardDataset(dataset, seed=5)
    loader = ShardLoader(ds, batch_size=4, num_workers=2)
    loader.load_state_dict(saved["state"])
    rest = [k for b in loader for k in b["__key__"]]
    assert rest == expected[done:]
    assert os.path.exists(dataset / "manifest.json")
