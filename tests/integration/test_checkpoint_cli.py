"""shardio checkpoint ls|verify|latest: what a user and the retry wrapper see."""

from __future__ import annotations

import errno
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
    assert r.rc == 3 and "every checkpoint in" in r.stderr and "not JSON" in r.stderr


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


def test_parity_add_and_drop_keep_the_dataset_id_and_the_resume(
    run_cli, packed_small, tmp_path: pathlib.Path
) -> None:
    pytest.importorskip("pyeclib")
    import shutil

    from shardio import ShardDataset
    from shardio.checkpoint import load_latest
    from shardio.format.identity import dataset_id
    from shardio.format.manifest import load_manifest

    ds = tmp_path / "ds"
    shutil.copytree(packed_small("tar", "256KiB", 1)[0], ds)
    before = dataset_id(ds)

    def loader():  # type: ignore[no-untyped-def]
        return ShardDataset(ds, seed=1).loader(batch_size=8, num_workers=0)

    first = loader()
    it = iter(first)
    next(it)
    ckdir = tmp_path / "ckpt"
    save({"w": 1}, ckdir, step=1, loader=first, environ=JOB)
    rest = [k for b in it for k in b["__key__"]]
    r = run_cli("parity", "add", ds, "--parity", "2+1")
    assert r.rc == 0, r.stderr
    assert load_manifest(ds / "manifest.json").parity is not None
    assert dataset_id(ds) == before  # the samples did not change
    again = loader()
    assert load_latest(ckdir, loader=again, environ=JOB).step == 1  # resumed, not refused
    assert [k for b in again for k in b["__key__"]] == rest
    assert run_cli("parity", "drop", ds).rc == 0
    assert dataset_id(ds) == before


def test_latest_says_all_damaged_apart_from_none(run_cli, ckdir) -> None:
    d, paths = ckdir
    for p in paths:
        (victim,) = pathlib.Path(p).glob("*.pt*")
        os.truncate(victim, 100)
    r = run_cli("checkpoint", "latest", d)
    assert r.rc == 3 and r.stdout == ""
    assert "every checkpoint in" in r.stderr and "3 found, none loads" in r.stderr
    assert all(os.path.basename(p) in r.stderr for p in paths)
    r = run_cli("checkpoint", "latest", d.parent / "empty")
    assert r.rc == 1 and "no checkpoint in" in r.stderr


def test_latest_says_cannot_be_read_now_apart_from_none_and_damaged(
    ckdir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardio.cli.main import main

    d, paths = ckdir

    def dead_server(fd: int, n: int, offset: int) -> bytes:
        raise OSError(errno.ENXIO, "No such device or address")

    monkeypatch.setattr(os, "pread", dead_server)
    assert main(["checkpoint", "latest", str(d)]) == 75  # EX_TEMPFAIL: ask again later
    out, err = capsys.readouterr()
    assert out == "" and f"checkpoint {paths[2]} cannot be read now (not damaged; retry)" in err
    assert len(err.strip().splitlines()) == 1


def test_verify_says_cannot_be_read_now_apart_from_damaged(
    ckdir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardio.cli.main import main

    d, paths = ckdir
    real_pread = os.pread

    def dead_server(fd: int, n: int, offset: int) -> bytes:
        raise OSError(errno.ENXIO, "No such device or address")

    monkeypatch.setattr(os, "pread", dead_server)
    assert main(["checkpoint", "verify", str(d)]) == 75  # EX_TEMPFAIL, as `latest`
    out, err = capsys.readouterr()
    assert "DAMAGED" not in out + err and out.count("UNREADABLE") == 3
    assert "0 of 3 checkpoint(s) intact, 3 cannot be read now" in out
    assert f"UNREADABLE {paths[2]} (not damaged; retry)" in err and "No such device" in err
    assert main(["checkpoint", "verify", "--json", paths[1]]) == 75
    (item,) = json.loads(capsys.readouterr().out)["checkpoints"]
    assert item["status"] == "unreadable" and item["problems"] == [] and item["unreadable"]
    # Real damage is still said as such, first, when both are found.
    monkeypatch.setattr(os, "pread", real_pread)
    (victim,) = pathlib.Path(paths[0]).glob("*.pt*")
    os.truncate(victim, 100)
    assert main(["checkpoint", "verify", str(d)]) == 3
    out, _ = capsys.readouterr()
    assert "2 of 3 checkpoint(s) intact, 1 damaged" in out


def test_verify_bounds_a_stalled_manifest_read_and_file_read(
    ckdir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading
    import time

    from shardio.checkpoint import catalog
    from shardio.cli.main import main

    d, paths = ckdir
    release = threading.Event()
    real_read = catalog.read_manifest

    def stalled_manifest(path: str):  # type: ignore[no-untyped-def]
        if path == paths[2]:
            release.wait(30)  # a dead metadata server: released when the test ends
        return real_read(path)

    monkeypatch.setattr(catalog, "read_manifest", stalled_manifest)
    began = time.monotonic()
    try:
        rc = main(["checkpoint", "verify", "--read-timeout", "0.3", str(d)])
        rc_one = main(["checkpoint", "verify", "--read-timeout", "0.3", paths[2]])
    finally:
        release.set()
    assert time.monotonic() - began < 20
    assert (rc, rc_one) == (75, 75)
    out, err = capsys.readouterr()
    assert "DAMAGED" not in out + err and "stalled for 0.3 s" in err
    assert "2 of 3 checkpoint(s) intact, 1 cannot be read now" in out
