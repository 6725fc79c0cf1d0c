"""The exactly-once epoch audit end to end: real DataLoader workers, faults injected into the
delivery, resume mid-epoch, a mix, substitutions, the per-rank records and ``shardio audit``."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import shardio.runtime.audit as audit_module
from shardio.order.cursor import EpochCursor
from shardio.order.ranks import RankInfo
from shardio.read.epochaudit import read_records
from shardio.read.recovery import RecoveryPolicy
from shardio.runtime.dataset import ShardDataset
from shardio.runtime.mixed import MixedDataset

SINGLE = RankInfo()
AUDIT = "shardio.runtime.audit"


def run_job(script, dataset, out_dir, world, env, timeout_s=60.0):
    """Start ``world`` gloo ranks of ``script``, wait for all; each rank's JSON result."""
    out_dir.mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [sys.executable, str(script), str(dataset), str(out_dir)]
    procs = [
        subprocess.Popen(
            [*args, str(r), str(world), str(port)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed (rc {p.returncode}):\n{out}"
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(world)]


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == AUDIT]


def _epoch(loader) -> list[str]:
    return [k for b in loader for k in b["__key__"]]


@pytest.mark.parametrize("mode", ["map", "stream"])
def test_an_exact_epoch_logs_one_line_per_epoch(packed_tar, caplog, mode) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    ds = ShardDataset(packed_tar.path, ranks=SINGLE, seed=2, mode=mode)
    loader = ds.loader(batch_size=64, num_workers=2)  # persistent workers: epoch 1 reuses them
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        _epoch(loader)
    loader.close()
    assert _lines(caplog) == [
        "epoch 0: 600 samples, each exactly once",
        "epoch 1: 600 samples, each exactly once",
    ]
    counters = loader.metrics().counters
    assert (counters["epochs_audited"], counters["epochs_not_exact"]) == (2, 0)


def test_audit_false_audits_nothing(packed_tar, caplog) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    loader = ShardDataset(packed_tar.path, ranks=SINGLE).loader(batch_size=100, audit=False)
    _epoch(loader)
    assert _lines(caplog) == []
    assert "epochs_audited" not in loader.metrics().counters


@pytest.mark.parametrize("bad", [1.5, "", None, 0])
def test_a_bad_audit_option_is_one_usage_error(packed_tar, bad) -> None:
    from shardio.errors import UsageError

    ds = ShardDataset(packed_tar.path, ranks=SINGLE)
    if bad == "":  # a directory that is no directory: refused at the first record
        loader = ds.loader(batch_size=300, audit=bad)
        _epoch(loader)  # logged, never raised: the audit must not stop training
        return
    with pytest.raises(UsageError, match="audit must be True, False or a directory"):
        ds.loader(batch_size=300, audit=bad)


def test_a_broken_delivery_is_caught_and_its_samples_named(packed_tar, caplog, monkeypatch) -> None:
    """The third batch hands its first sample twice and never its second (injected where the
    loader tells its observers what it delivered)."""
    caplog.set_level(logging.INFO, logger=AUDIT)
    real = audit_module.sample_facts
    calls = []

    def faulty(source, values):
        values = np.array(values)
        calls.append(values.copy())
        if len(calls) == 3:
            values[1] = values[0]
        return real(source, values)

    monkeypatch.setattr(audit_module, "sample_facts", faulty)
    loader = ShardDataset(packed_tar.path, ranks=SINGLE, seed=4).loader(
        batch_size=50, num_workers=2
    )
    _epoch(loader)
    (line,) = _lines(caplog)
    first, second = int(calls[2][0]), int(calls[2][1])
    assert line.startswith("epoch 0: NOT exactly once: 600 deliveries, the plan has 600")
    assert f"rank 0 missed [{second}] and repeated [{first}]" in line
    assert loader.metrics().counters["epochs_not_exact"] == 1


def test_a_cursor_that_miscounts_is_caught(packed_tar, caplog, monkeypatch) -> None:
    """A cursor that counts one position too many after the first batch: the position jumps
    past a sample this rank never delivered, and the loader's next run skips it."""
    caplog.set_level(logging.INFO, logger=AUDIT)
    real = EpochCursor.advance
    seen = []

    def miscount(self, positions):
        seen.append(positions)
        real(self, positions + (1 if len(seen) == 1 else 0))

    monkeypatch.setattr(EpochCursor, "advance", miscount)
    ds = ShardDataset(packed_tar.path, ranks=SINGLE, seed=4)
    loader = ds.loader(batch_size=100, num_workers=0)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    batches.close()
    loader.load_state_dict(state)  # the resume the miscount breaks
    _epoch(loader)
    lines = _lines(caplog)
    assert "the position jumped from 100 to 101 without delivering 1" in lines[0]
    assert lines[-1].startswith("epoch 0: NOT exactly once: 599 deliveries, the plan has 600")
    assert f"missed [{int(ds.epoch_order()[100])}]" in lines[-1]


def test_a_resume_mid_epoch_is_audited_as_the_plan_prefix_and_the_rest(packed_tar, caplog) -> None:
    ds = ShardDataset(packed_tar.path, ranks=SINGLE, seed=6)
    loader = ds.loader(batch_size=40, num_workers=2)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    state = loader.state_dict()
    loader.close()
    caplog.set_level(logging.INFO, logger=AUDIT)
    resumed = ShardDataset(packed_tar.path, ranks=SINGLE, seed=6).loader(
        batch_size=40, num_workers=2
    )
    resumed.load_state_dict(state)  # a new process's loader: only the state is known
    assert len(_epoch(resumed)) == 400
    assert _lines(caplog) == ["epoch 0: 600 samples, each exactly once"]


def test_a_mix_is_audited_by_source_and_index(packed_tar, packed_hdf5, caplog) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    mix = MixedDataset(
        [
            (ShardDataset(packed_tar.path, ranks=SINGLE, seed=1), 0.7),
            (ShardDataset(packed_hdf5.path, ranks=SINGLE, seed=2, mode="stream"), 0.3),
        ],
        seed=3,
    )
    loader = mix.loader(batch_size=64, num_workers=2)
    n = len(_epoch(loader))
    assert _lines(caplog) == [f"epoch 0: {n:,} samples, each exactly once"]


def test_substitutes_are_counted_not_missed(packed_tar, corrupt_copy, caplog) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    bad, _shard, _at = corrupt_copy(packed_tar, packed_tar.keys[7])
    ds = ShardDataset(
        bad.path, ranks=SINGLE, seed=1, recovery=RecoveryPolicy(policy="skip", retries=0)
    )
    _epoch(ds.loader(batch_size=100, num_workers=2))
    assert _lines(caplog) == [
        "epoch 0: 600 samples, each exactly once (1 substituted, listed in the journal)"
    ]


def test_padding_and_drop_last_are_planned(packed_tar, caplog) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT)
    ds = ShardDataset(packed_tar.path, ranks=SINGLE, seed=1)
    _epoch(ds.loader(batch_size=64, drop_last=True))
    assert _lines(caplog) == ["epoch 0: 576 samples, each exactly once (24 cut by drop_last)"]


def test_padding_is_planned_not_duplicated(packed_tar, tmp_path, run_cli) -> None:
    out = _records(packed_tar, tmp_path, 7)  # 600 = 7 * 86 - 2: two planned repeats
    result = run_cli("audit", out)
    assert result.stdout == (
        "epoch 0: 600 samples, each exactly once (2 planned repeats to even the ranks)\n"
    )


def _records(packed_tar, tmp_path, world):
    """The ranks of a job without torch.distributed (one process here) writing their records
    of epoch 0."""
    out = tmp_path / "audit"
    out.mkdir()
    for rank in range(world):
        layout = RankInfo(rank=rank, world_size=world)
        ds = ShardDataset(packed_tar.path, ranks=layout, seed=9)
        assert _epoch(ds.loader(batch_size=50, audit=out))
    return out


def test_shardio_audit_combines_the_ranks_records(packed_tar, tmp_path, run_cli) -> None:
    out = _records(packed_tar, tmp_path, 3)
    names = sorted(os.listdir(out))
    assert len(names) == 3 and all(n.startswith("audit-") and "-e000000-r0000" in n for n in names)
    result = run_cli("audit", out)
    assert result.rc == 0, result.stderr
    assert result.stdout == "epoch 0: 600 samples, each exactly once\n"
    data = json.loads(run_cli("audit", out, "--json").stdout)
    assert data["exact"] and data["delivered"] == 600


def test_shardio_audit_names_a_missing_rank_and_refuses_bad_files(
    packed_tar, tmp_path, run_cli, assert_cli_error
) -> None:
    out = _records(packed_tar, tmp_path, 3)
    (rank2,) = [p for p in out.iterdir() if p.name.endswith("-r00002.json")]
    rank2.unlink()
    result = run_cli("audit", out)
    assert result.rc == 1
    assert "NOT exactly once: 400 deliveries, the plan has 600" in result.stdout
    assert "no record of rank(s) [2]" in result.stdout

    (out / rank2.name).symlink_to(next(out.iterdir()))  # a symlink in the directory
    assert_cli_error(run_cli("audit", out), rank2.name)
    (out / rank2.name).unlink()
    (out / rank2.name).write_text('{"format": "shardio-epoch-audit", "version": 1}')
    assert_cli_error(run_cli("audit", out), "malformed audit record", rank2.name)
    (out / rank2.name).write_text("{not json")
    assert_cli_error(run_cli("audit", out), "not JSON")
    (out / rank2.name).write_text('{"a": 1}')  # a foreign file with a record's name
    assert_cli_error(run_cli("audit", out), "not a shardio epoch audit record")
    assert_cli_error(run_cli("audit", tmp_path / "nowhere"), "is not a directory")
    assert_cli_error(run_cli("audit", out, "--epoch", "-1"))


def test_records_are_written_atomically_by_dataset_epoch_and_rank(packed_tar, tmp_path) -> None:
    out = _records(packed_tar, tmp_path, 2)
    found = read_records(os.fspath(out))
    ((dataset, epoch),) = found
    assert epoch == 0 and len(found[dataset, epoch]) == 2
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # no temp files left


def test_three_to_two_gloo_ranks_audit_the_resumed_epoch(
    packed_tar, scripts_dir, child_env, tmp_path
) -> None:
    """3 ranks read 4 batches each (240 samples) and stop (their state is rank 0's: the
    position is global); 2 gloo ranks resume from it and read the rest: the epoch is proved
    through torch.distributed, each sample once."""
    for rank in range(3):
        ds = ShardDataset(packed_tar.path, ranks=RankInfo(rank=rank, world_size=3), seed=5)
        loader = ds.loader(batch_size=20)
        batches = iter(loader)
        for _ in range(4):
            next(batches)
        if rank == 0:
            (tmp_path / "state.json").write_text(json.dumps(loader.state_dict()))
        loader.close()
    script = scripts_dir / "dist_audit.py"
    second = run_job(script, packed_tar.path, tmp_path / "two", 2, child_env())
    assert [r["samples"] for r in second] == [180, 180]
    assert second[0]["lines"] == ["INFO epoch 0: 600 samples, each exactly once"]
    assert second[1]["lines"] == []  # rank 0 says it for the job
    assert [(r["audited"], r["not_exact"]) for r in second] == [(1, 0), (1, 0)]
