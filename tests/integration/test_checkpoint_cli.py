"""shardio checkpoint ls|verify|latest: what a user and the retry wrapper see."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from checkpointing import state_of

from shardio.checkpoint import save

JOB = {"SLURM_JOB_ID": "31"}


@pytest.fixture
def ckdir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
    d = tmp_path / "ckpt"
    paths = [save(state_of(s), d, step=s, kind="light" if s == 3 else "full", environ=JOB)
             for s in (1, 2, 3)]  # fmt: skip
    return d, paths


def test_ls_lists_newest_first(run_cli, ckdir) -> None:
    d, paths = ckdir
    (d / f".checkpoint_31_full_step{4:015d}.shardio-tmp-0123456789abcdef").mkdir()
    r = run_cli("checkpoint", "ls", d)
    assert r.rc == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines[:3]] == [os.path.basename(p) for p in paths[::-1]]
    assert "light step 3" in lines[0] and "job 31" in lines[0] and "x)" in lines[0]
    assert "incomplete" in lines[3]
    doc = json.loads(run_cli("checkpoint", "ls", d, "--json").stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [3, 2, 1] and len(doc["incomplete"]) == 1


def test_verify_and_latest_find_damage(run_cli, ckdir) -> None:
    d, paths = ckdir
    r = run_cli("checkpoint", "verify", d)
    assert r.rc == 0 and "3 of 3 checkpoint(s) intact" in r.stdout
    r = run_cli("checkpoint", "latest", d)
    assert (r.rc, r.stdout.strip()) == (0, paths[2])
    assert run_cli("checkpoint", "latest", d, "--kind", "full").stdout.strip() == paths[1]
    (victim,) = pathlib.Path(paths[2]).glob("*.pt.zst")
    os.truncate(victim, 100)
    r = run_cli("checkpoint", "verify", d)
    assert r.rc == 3 and "2 of 3 checkpoint(s) intact" in r.stdout
    assert f"DAMAGED {paths[2]}" in r.stderr
    r = run_cli("checkpoint", "verify", paths[2])  # one checkpoint
    assert r.rc == 3
    r = run_cli("checkpoint", "latest", d)
    assert (r.rc, r.stdout.strip()) == (0, paths[1])
    assert f"skipped {paths[2]}" in r.stderr
    doc = json.loads(run_cli("checkpoint", "latest", d, "--json").stdout)
    assert doc["path"] == paths[1] and doc["skipped"][0][0] == paths[2]


def test_latest_when_there_is_none(run_cli, tmp_path: pathlib.Path) -> None:
    r = run_cli("checkpoint", "latest", tmp_path / "none")
    assert r.rc == 1 and "no checkpoint in" in r.stderr and r.stdout == ""
    d = tmp_path / "bad"
    only = save(state_of(1), d, step=1, environ=JOB)
    (pathlib.Path(only) / "manifest.json").write_text("{")
    r = run_cli("checkpoint", "latest", d)
    assert r.rc == 3 and "no intact checkpoint" in r.stderr and "not JSON" in r.stderr


def test_hostile_directories(run_cli, tmp_path: pathlib.Path) -> None:
    d = tmp_path / "ckpt"
    only = pathlib.Path(save(state_of(1), d, step=1, environ=JOB))
    (only / "manifest.json").unlink()
    os.mkfifo(only / "manifest.json")  # never blocks
    big = d / f"checkpoint_h_31_full_step{9:015d}"
    big.mkdir()
    with (big / "manifest.json").open("wb") as fh:
        fh.truncate(64 << 20)  # sparse: too large to be a manifest, never read whole
    r = run_cli("checkpoint", "verify", d, timeout=60)
    assert r.rc == 3
    assert "not a regular file" in r.stderr or "FIFO" in r.stderr
    assert "too large" in r.stderr or "bytes" in r.stderr
    r = run_cli("checkpoint", "ls", tmp_path / "file-not-dir")
    assert r.rc == 0 and "no checkpoints" in r.stdout
    (tmp_path / "f").write_text("x")
    r = run_cli("checkpoint", "verify", tmp_path / "f")
    assert r.rc == 2 and "is not a directory" in r.stderr and "Traceback" not in r.stderr
