"""What ``shardio verify`` says, and what it accepts.

``--workers`` is bounded like pack's (1 to 4096, ASCII digits: ``int()`` alone takes ``٣``
and ``1_0``); a missing or empty shard's samples count among the samples affected (from the
manifest: none of their bytes can be read); ``--quick`` reads no shard data, so it prints no
data rate; the library functions refuse the same values with a UsageError before writing.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
from typing import Any

import pytest
from trees import flip_member

from shardio.cli.progressbar import ProgressBar
from shardio.errors import UsageError
from shardio.format.manifest import load_manifest
from shardio.metrics.progress import ProgressSnapshot
from shardio.tools.repair import repair_dataset
from shardio.tools.verify import verify_dataset

W1 = ("--workers", "1", "--no-progress")

BAD_WORKERS = [
    "0",
    "-1",
    "4097",
    "99999999999999999999",
    "9" * 5000,
    "\u0663",  # ARABIC-INDIC DIGIT THREE: int() reads 3
    "\u00b2",  # SUPERSCRIPT TWO: str.isdigit() says yes, int() raises
    "nan",
    "1_0",
    " 2",
    "2.0",
    "",
]


@pytest.fixture
def good(packed_small: Any) -> pathlib.Path:
    root: pathlib.Path = packed_small("tar", "256KiB", 1)[0]
    return root


@pytest.fixture
def copy(good: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    dst = tmp_path / "ds"
    shutil.copytree(good, dst)
    return dst


# --------------------------------------------------------------------------- --workers


@pytest.mark.parametrize("value", BAD_WORKERS, ids=lambda v: ascii(v)[:24])
@pytest.mark.parametrize("command", ["verify", "pack"])
def test_bad_workers_is_one_usage_line(
    command: str, value: str, good: pathlib.Path, tmp_path: pathlib.Path, run_cli, run_cli_here,
    assert_cli_error,
) -> None:  # fmt: skip
    args = [good] if command == "verify" else [good, tmp_path / "out"]
    run = run_cli if value == BAD_WORKERS[0] else run_cli_here  # one through the command
    result = run(command, *args, "--workers", value, "--no-progress")
    assert result.rc == 2, result
    line = assert_cli_error(result, "--workers")
    assert len(line) < 300, line  # 5,000 digits are not echoed back whole
    assert not (tmp_path / "out").exists()


def test_huge_slurm_cpu_count_is_capped_not_refused(good: pathlib.Path, run_cli) -> None:
    """The default comes from SLURM: a count above the pool's cap is capped (verify never
    starts more processes than shards to check anyway)."""
    rc, out, err = run_cli("verify", good, "--no-progress", env={"SLURM_CPUS_PER_TASK": "99999"})
    assert (rc, err) == (0, ""), err
    assert out.startswith("OK: verified")


@pytest.mark.parametrize("workers", [0, -3, 4097, 2.0, True, "2"])
def test_library_refuses_bad_workers_before_writing(
    workers: Any, good: pathlib.Path, copy: pathlib.Path
) -> None:
    (copy / "index.bin").write_bytes(b"not an index")  # repair would replace it first
    with pytest.raises(UsageError, match="workers"):
        verify_dataset(good, workers=workers)
    with pytest.raises(UsageError, match="workers"):
        repair_dataset(copy, source=good, workers=workers)
    assert (copy / "index.bin").read_bytes() == b"not an index"


@pytest.mark.parametrize("shard", [-1, 10**9, True, 1.0])
def test_verify_of_a_shard_the_manifest_lacks_is_refused(shard: Any, good: pathlib.Path) -> None:
    with pytest.raises(UsageError, match="is not a shard of"):
        verify_dataset(good, shards=[0, shard])


# --------------------------------------------------------------------------- samples affected


def test_missing_and_empty_shards_count_their_samples(copy: pathlib.Path, run_cli) -> None:
    shards = load_manifest(copy / "manifest.json").shards
    (copy / shards[1].path).unlink()
    (copy / shards[4].path).write_bytes(b"")
    flip_member(copy, 6)
    lost = shards[1].num_samples + shards[4].num_samples
    assert lost > 2

    rc, out, err = run_cli("verify", copy, *W1)
    assert rc == 3, err
    assert err.splitlines()[-1] == (
        f"FAILED: 3 of {len(shards)} shards damaged, {lost + 1} samples affected ({lost} in 2 "
        "missing, empty or unreadable shards, 1 with a damaged member)"
    )

    rc, out, _ = run_cli("verify", copy, "--json", "--workers", "2")
    assert rc == 3
    report = json.loads(out)
    assert report["samples_affected"] == lost + 1
    by_shard = {p["shard"]: p["samples_lost"] for p in report["problems"]}
    assert by_shard == {
        shards[1].path: shards[1].num_samples,
        shards[4].path: shards[4].num_samples,
        shards[6].path: 0,
    }


def test_quick_counts_missing_shards_and_says_what_it_did_not_check(
    copy: pathlib.Path, run_cli
) -> None:
    shards = load_manifest(copy / "manifest.json").shards
    (copy / shards[2].path).unlink()
    os.truncate(copy / shards[3].path, shards[3].size_bytes // 2)
    rc, _, err = run_cli("verify", copy, "--quick", *W1)
    assert rc == 3, err
    last = err.splitlines()[-1]
    assert last.startswith(
        f"FAILED: 2 of {len(shards)} shards damaged, {shards[2].num_samples} samples affected "
        f"({shards[2].num_samples} in 1 missing, empty or unreadable shard); --quick read no "
        "shard data, so the samples of the 1 shard(s) of the wrong size were not checked"
    ), last


# --------------------------------------------------------------------------- --quick


@pytest.mark.parametrize("workers", ["1", "2"])
def test_quick_prints_no_data_rate(workers: str, good: pathlib.Path, run_cli) -> None:
    rc, out, err = run_cli("verify", good, "--quick", "--workers", workers, "--no-progress")
    assert (rc, err) == (0, "")
    [line] = out.splitlines()
    shards = len(load_manifest(good / "manifest.json").shards)
    assert line.startswith(
        f"OK: quick check of {shards} shards (the index and each shard's size; no shard data "
        "read) in "
    ), line
    assert "B/s" not in line

    rc, out, _ = run_cli("verify", good, *W1)
    assert rc == 0
    assert "B/s" in out and " 0 B/s" not in out  # a full verify reads, so it has a rate


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quick_progress_bar_shows_a_rate_of_shards_not_bytes() -> None:
    """--quick reads no shard data: its bar counts shards per second, not "0 B/s"."""
    out = _Terminal()
    bar = ProgressBar("verifying", unit="shards", stream=out)
    bar(ProgressSnapshot(10, 0, 40, 0, 2.0))
    line = out.getvalue()
    assert "10/40 shards" in line
    assert "5 shards/s" in line
    assert "ETA 6.0s" in line
    assert "B/s" not in line and "0 B" not in line

    out = _Terminal()
    ProgressBar("verifying", unit="shards", stream=out)(ProgressSnapshot(10, 2048, 40, 8192, 2.0))
    assert "2.0 KiB/8.0 KiB  1.0 KiB/s  ETA 6.0s" in out.getvalue()  # a full verify: bytes


def test_without_workers_a_small_dataset_is_checked_in_this_process(
    good: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``workers=None`` (the CLI without --workers): a pool of the job's CPUs for a dataset
    of POOL_MIN_BYTES or more, this process for a smaller one or a quick check."""
    import shardio.tools.verify as verify_module

    pools: list[int] = []

    class Recording(verify_module.WorkerPool):  # type: ignore[misc,name-defined]
        def __init__(self, size: int, **kwargs: Any) -> None:
            pools.append(size)
            super().__init__(size, **kwargs)

    monkeypatch.setattr(verify_module, "WorkerPool", Recording)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    assert len(load_manifest(str(good / "manifest.json")).shards) >= 2
    assert verify_dataset(good, workers=None).ok and pools == []
    monkeypatch.setattr(verify_module, "POOL_MIN_BYTES", 0)
    assert verify_dataset(good, workers=None).ok and pools == [2]
    assert verify_dataset(good, workers=None, quick=True).ok and pools == [2]
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "two")
    with pytest.raises(UsageError, match="SLURM_CPUS_PER_TASK"):
        verify_dataset(good, workers=None)
