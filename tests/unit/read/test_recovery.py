"""Recovery (retry, rebuild hook, raise/skip policy) and the repair journal, torch-free."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import pytest

from shardio.errors import SampleUnavailableError, UsageError
from shardio.read.faults import Fault, FaultyOpener
from shardio.read.journal import RepairJournal, read_journal
from shardio.read.reader import ShardReader
from shardio.read.recovery import Recovery, RecoveryPolicy


@pytest.fixture
def dataset(packed_small) -> pathlib.Path:  # type: ignore[no-untyped-def]
    return packed_small("tar")[0]


def _read(ds: ShardReader) -> Any:
    return lambda indices: [ds.read_sample(i) for i in indices]


def _shard_faults(ds: ShardReader, shard: int, kind: str, **kw: Any) -> list[Fault]:
    return [Fault(kind=kind, path=ds.manifest.shards[shard].path, **kw)]


def _recovery(ds: ShardReader, waits: list[float], **kw: Any) -> Recovery:
    policy = RecoveryPolicy(**kw)
    share = list(range(len(ds)))
    return Recovery(
        ds,
        policy,
        candidates=lambda s: iter(share[(s + 1) :] + share[:s]),
        context=lambda: {"rank": 0},
        sleep=waits.append,
    )


def test_transient_eio_is_retried_with_backoff(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as probe:
        faults = _shard_faults(probe, 0, "eio", times=2)
        expected = [probe.read_sample(i) for i in range(5)]
    waits: list[float] = []
    with ShardReader(dataset, opener=FaultyOpener(faults)) as ds:
        rec = _recovery(ds, waits, retries=3, backoff_s=0.1, max_backoff_s=0.15)
        assert rec.read_batch(_read(ds), range(5)) == expected
        assert waits == [0.1, 0.15]  # doubled, capped
        assert rec.metrics["retries"] == 2
        assert [e["event"] for e in rec.drain_events()] == ["retry"]
        assert rec.drain_events() == []


def test_raise_names_shard_sample_and_everything_tried(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as probe:
        faults = _shard_faults(probe, 1, "replaced")
        sample = probe.manifest.shards[1].first_sample
        key, rel = probe.key(sample), probe.manifest.shards[1].path
    with ShardReader(dataset, opener=FaultyOpener(faults)) as ds:
        rec = _recovery(ds, [], retries=2)
        with pytest.raises(SampleUnavailableError) as info:
            rec.read_batch(_read(ds), [sample])
    err = info.value
    assert (err.shard, err.key, err.sample) == (rel, key, sample)
    assert len(err.tried) == 4  # the read, 2 retries, no rebuild source
    assert "retry 2" in str(err)
    assert "no repair source" in str(err)
    assert rec.metrics["unavailable"] == 1


def test_skip_substitutes_deterministically_and_journals(
    dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    journal = tmp_path / "repairs.jsonl"
    with ShardReader(dataset) as probe:
        faults = _shard_faults(probe, 2, "truncate", offset=0)
        bad = list(
            range(probe.manifest.shards[2].first_sample, probe.manifest.shards[3].first_sample)
        )
        n = len(probe)
    batch = [bad[0], bad[0] - 1, bad[1]]
    runs = []
    for _ in range(2):
        with ShardReader(dataset, opener=FaultyOpener(faults)) as ds:
            rec = _recovery(ds, [], policy="skip", retries=1, journal=str(journal))
            got = rec.read_batch(_read(ds), batch)
            runs.append([s["__key__"] for s in got])
            assert rec.metrics["substitutes"] == 2
            # the second bad sample of the shard is not retried again
            assert rec.metrics["retries"] == 1
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3
    events = read_journal(journal)
    skips = [e for e in events if e["event"] == "skip"]
    assert len(skips) == 4
    assert {e["sample"] for e in skips} == {bad[0], bad[1]}
    assert all(e["rank"] == 0 and e["substitute"] not in bad and e["substitute"] < n for e in skips)
    assert all("truncated" in e["error"] for e in skips)


def test_rebuild_hook_is_tried_before_the_policy(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as probe:
        faults = _shard_faults(
            probe, 0, "flip", offset=probe.index.members[0]["offset"] + 1, times=3
        )
    calls: list[int] = []
    with ShardReader(dataset, opener=FaultyOpener(faults)) as ds:
        rec = Recovery(
            ds,
            RecoveryPolicy(retries=2),
            candidates=lambda s: iter(()),
            rebuild=lambda shard: calls.append(shard) or True,
            sleep=lambda s: None,
        )
        rec.read_batch(_read(ds), [0])
    assert calls == [0]
    assert rec.metrics["rebuilds"] == 1


def test_spent_budget_skips_retries(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as probe:
        faults = _shard_faults(probe, 0, "eio", times=1)
    waits: list[float] = []
    with ShardReader(dataset, opener=FaultyOpener(faults)) as ds:
        rec = _recovery(ds, waits, retries=3, budget_s=0.0, policy="skip")
        rec.read_batch(_read(ds), [0])
    assert waits == []
    assert rec.metrics["substitutes"] == 1


def test_journal_refuses_a_symlink_and_training_goes_on(
    dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    target = tmp_path / "victim"
    target.write_text("keep\n")
    link = tmp_path / "repairs.jsonl"
    link.symlink_to(target)
    with ShardReader(dataset) as probe:
        faults = _shard_faults(probe, 0, "missing")
    with ShardReader(dataset, opener=FaultyOpener(faults)) as ds:
        rec = _recovery(ds, [], policy="skip", retries=0, journal=str(link))
        rec.read_batch(_read(ds), [0])
    assert target.read_text() == "keep\n"


def test_journal_lines_are_single_bounded_json_objects(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "j.jsonl"
    journal = RepairJournal(path)
    journal.append({"event": "skip", "error": "x" * 10_000})
    journal.append({"event": "retry"})
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert all(len(line) < 4096 for line in lines)
    assert json.loads(lines[1])["pid"] == os.getpid()


def test_journal_refuses_a_fifo_without_blocking(tmp_path: pathlib.Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match=r"not a regular file|cannot open"):
        RepairJournal(fifo).append({"event": "skip"})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "ignore"},
        {"retries": -1},
        {"retries": 1.5},
        {"backoff_s": -1},
        {"budget_s": float("nan")},
        {"max_substitutes": True},
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        RecoveryPolicy(**kwargs)


class _HoldingOpener(FaultyOpener):
    """A faulty opener that says the given shard files are held unavailable (as the read
    deadline's opener does after a stall)."""

    def __init__(self, faults: list[Fault], held: set[str]) -> None:
        super().__init__(faults)
        self.held_paths = held

    def held(self, path: str) -> float | None:
        return 100.0 if any(path.endswith(h) for h in self.held_paths) else None


def test_substitutes_on_held_shards_do_not_use_up_the_tries(dataset: pathlib.Path) -> None:
    with ShardReader(dataset) as probe:
        shards = probe.manifest.shards
        sample = shards[1].first_sample
        faults = _shard_faults(probe, 1, "truncate", offset=0)
        held = {shards[1].path, shards[2].path}
        on_held = shards[3].first_sample - sample - 1  # the draws after it on held shards
        assert on_held > 4  # more than the tries below: all would have been used up
    with ShardReader(dataset, opener=_HoldingOpener(faults, held)) as ds:
        rec = _recovery(ds, [], policy="skip", retries=0, max_substitutes=4)
        (got,) = rec.read_batch(_read(ds), [sample])
        assert got["__key__"] == ds.key(shards[3].first_sample)  # the first draw not held
        assert rec.metrics["substitutes"] == 1


def test_a_recovery_leaves_the_reader_as_it_was_opened(dataset: pathlib.Path) -> None:
    """The reader is opened with the policy's re-staging and its event hook; building a
    Recovery over it writes neither."""
    events: list[Any] = []
    with ShardReader(dataset, restage=False, on_event=events.append) as ds:
        _recovery(ds, [], restage=True)
        assert ds.restage is False
        assert ds.on_event == events.append


def test_a_substitute_is_read_through_the_descriptor_already_open(dataset: pathlib.Path) -> None:
    # A close and an open each wait behind a dead server's requests on a FUSE client (issue
    # 32): a substitute from a healthy shard costs no metadata call.
    with ShardReader(dataset) as probe:
        faults = _shard_faults(probe, 2, "eio")
        bad = probe.manifest.shards[2].first_sample
        good = probe.manifest.shards[3].first_sample
    with ShardReader(dataset, opener=FaultyOpener(faults)) as ds:
        policy = RecoveryPolicy(policy="skip", retries=0)
        rec = Recovery(ds, policy, candidates=lambda s: iter([good]), sleep=lambda s: None)
        ds.read_sample(good)  # its shard is open
        opens = ds.metrics["opens_source"]
        got = rec.read_batch(_read(ds), [bad])
        assert got[0]["__key__"] == ds.key(good)
        assert rec.metrics["substitutes"] == 1
        assert ds.metrics["opens_source"] == opens + 1  # the failing shard's open, only
