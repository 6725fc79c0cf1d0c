"""``shardio stage --clean`` (the epilogue) keeps the repair journal and removes only what
shardio lists (issue 17): the journal moves beside the job's log (``$SLURM_SUBMIT_DIR``), the
current directory, or ``--keep-journal DIR``; unknown files and their folders stay.
"""

from __future__ import annotations

import os
import pathlib
import socket
from typing import Any

import pytest

from shardio.read.journal import JOURNAL_NAME, RepairJournal, read_journal
from shardio.staging import StageOptions, clean_stage, stage_dataset
from shardio.staging.clean import JOURNAL_FILE

AREA_RECORDS = ".shardio-stage"


@pytest.fixture
def area(tiny_src: Any, tmp_path: pathlib.Path, run_cli: Any) -> pathlib.Path:
    """tiny_src staged, with a repair journal of two events (as ResilientDataset writes)."""
    dest = tmp_path / "area"
    result = run_cli("stage", tiny_src.path, dest, "--no-progress")
    assert result.rc == 0, result.stderr
    journal = RepairJournal(dest / AREA_RECORDS / JOURNAL_NAME)
    journal.append({"event": "substitute", "shard": tiny_src.rels[3], "sample": 7})
    journal.append({"event": "restage", "shard": tiny_src.rels[4], "why": "checksum mismatch"})
    return dest


def _journal_name(dest: pathlib.Path, job: str = "nojob") -> str:
    host = socket.gethostname().split(".")[0]
    return f"shardio-repairs-{job}-{host}-{dest.name}.jsonl"


def test_the_journal_name_is_the_readers(tmp_path: pathlib.Path) -> None:
    assert JOURNAL_FILE == JOURNAL_NAME


def test_clean_keeps_the_journal_and_what_shardio_did_not_stage(
    area: pathlib.Path, tiny_src: Any, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    """The defect: the whole .shardio-stage folder went, journal and user files included."""
    journal = (area / AREA_RECORDS / JOURNAL_NAME).read_bytes()
    (area / AREA_RECORDS / "my-notes.txt").write_text("the user's")
    keep = tmp_path / "logs"
    keep.mkdir()
    result = run_cli("stage", "--clean", area, "--keep-journal", keep)
    assert result.rc == 0, result.stderr
    kept = keep / _journal_name(area)
    assert kept.read_bytes() == journal
    assert [e["event"] for e in read_journal(kept)] == ["substitute", "restage"]
    first, left = result.stdout.strip().splitlines()
    assert first == (
        f"removed {tiny_src.num_shards} staged shard(s) from {area}; repair journal kept at {kept}"
    )
    assert left == (
        f"left 1 file(s) shardio did not stage in {area} (and the folders holding them): "
        f"{AREA_RECORDS}/my-notes.txt"
    )
    listing = sorted(
        os.path.relpath(os.path.join(d, n), area) for d, _, ns in os.walk(area) for n in ns
    )
    assert listing == [f"{AREA_RECORDS}/my-notes.txt"]
    assert (area / AREA_RECORDS / "my-notes.txt").read_text() == "the user's"


def test_clean_puts_the_journal_beside_the_jobs_log(
    area: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    """Default: $SLURM_SUBMIT_DIR (where slurm-<job>.out is), named for the job and node."""
    submit = tmp_path / "submit"
    submit.mkdir()
    env = {"SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_ID": "4242"}
    result = run_cli("stage", "--clean", area, env=env, cwd=tmp_path)
    assert result.rc == 0, result.stderr
    assert os.listdir(submit) == [_journal_name(area, "4242")]
    assert not (area / AREA_RECORDS).exists()
    assert not area.exists() or os.listdir(area) == []


def test_clean_without_slurm_keeps_it_in_the_current_directory_and_never_overwrites(
    tiny_src: Any, tmp_path: pathlib.Path, run_cli: Any
) -> None:
    cwd = tmp_path / "here"
    cwd.mkdir()
    taken = cwd / _journal_name(tmp_path / "area")
    taken.write_text("someone else's")
    for round_ in range(2):
        dest = tmp_path / "area"
        assert run_cli("stage", tiny_src.path, dest, "--no-progress").rc == 0
        RepairJournal(dest / AREA_RECORDS / JOURNAL_NAME).append({"event": f"e{round_}"})
        result = run_cli("stage", "--clean", dest, cwd=cwd)
        assert result.rc == 0, result.stderr
    assert taken.read_text() == "someone else's"
    stem = taken.name[: -len(".jsonl")]
    assert [e["event"] for e in read_journal(cwd / f"{stem}.1.jsonl")] == ["e0"]
    assert [e["event"] for e in read_journal(cwd / f"{stem}.2.jsonl")] == ["e1"]


def test_a_bad_journal_directory_removes_nothing(
    area: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any, assert_cli_error: Any, helpers: Any
) -> None:
    before = helpers.snapshot(area)
    for bad in (tmp_path / "missing", area / AREA_RECORDS / JOURNAL_NAME):
        assert_cli_error(
            run_cli("stage", "--clean", area, "--keep-journal", bad), str(bad), "not a directory"
        )
    assert helpers.snapshot(area) == before
    assert_cli_error(run_cli("stage", area, "--keep-journal", tmp_path), "is for --clean")
    assert_cli_error(run_cli("stage", "--clean", area, "--force"), "--force is for staging")


def test_a_symlink_or_fifo_as_journal_is_left_alone(tiny_src: Any, tmp_path: pathlib.Path) -> None:
    """Not a file shardio wrote: not read, moved or removed (and a FIFO never blocks)."""
    keep = tmp_path / "keep"
    keep.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for kind in ("symlink", "fifo"):
        dest = tmp_path / f"area-{kind}"
        stage_dataset(tiny_src.path, dest, StageOptions(durable=False))
        path = dest / AREA_RECORDS / JOURNAL_NAME
        if kind == "symlink":
            path.symlink_to(victim)
        else:
            os.mkfifo(path)
        result = clean_stage(dest, journal_dir=str(keep))
        assert result.journal is None
        assert result.left == (f"{AREA_RECORDS}/{JOURNAL_NAME}",)
        assert os.path.lexists(path)
    assert victim.read_text() == "precious"
    assert os.listdir(keep) == []


def test_clean_of_a_read_only_journal_directory_says_so(
    area: pathlib.Path, tmp_path: pathlib.Path, run_cli: Any, assert_cli_error: Any, ro_mount: Any
) -> None:
    """The journal cannot be written where it should go: everything else is removed, the
    journal stays in the area, and the one error line says where it is."""
    logs = tmp_path / "logs"
    logs.mkdir()
    ro = ro_mount(logs)
    line = assert_cli_error(
        run_cli("stage", "--clean", area, "--keep-journal", ro), "repair journal stays"
    )
    assert "Read-only file system" in line
    listing = sorted(
        os.path.relpath(os.path.join(d, n), area) for d, _, ns in os.walk(area) for n in ns
    )
    assert listing == [f"{AREA_RECORDS}/{JOURNAL_NAME}"]
    assert [e["event"] for e in read_journal(area / AREA_RECORDS / JOURNAL_NAME)] == [
        "substitute",
        "restage",
    ]
