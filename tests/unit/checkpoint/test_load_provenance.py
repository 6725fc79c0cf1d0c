"""load_latest's verdicts and a checkpoint's provenance (issue 32).

``NoCheckpointError`` means "there is none" (what restart code reads as a fresh start), never
"there is one that cannot be used now"; one given checkpoint loads that one or fails; a
directory another live job saves into is refused; pruning counts only intact checkpoints.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from checkpointing import JOB, assert_state, state_of

from shardio.checkpoint import catalog, lease, load_latest, save
from shardio.checkpoint.naming import Identity, this_host
from shardio.errors import (
    CheckpointError,
    CheckpointUnavailableError,
    NoCheckpointError,
    StorageUnavailableError,
)
from shardio.storage.runner import CommandResult

NOJOB: dict[str, str] = {}  # outside SLURM: the owner is this process


def _files(path: str) -> list[pathlib.Path]:
    return sorted(pathlib.Path(path).glob("*.pt*"))


def _flip(path: pathlib.Path, at: int = 100) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))


# -- an I/O error is not damage -----------------------------------------------------------------


def test_a_read_error_raises_retryable_naming_it_not_none_nor_a_fallback(
    ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(state_of(1), ckdir, step=1, environ=JOB)
    newest = save(state_of(2), ckdir, step=2, environ=JOB)

    def dead_server(fd: int, n: int, offset: int) -> bytes:
        raise OSError(errno.ENXIO, "No such device or address")

    monkeypatch.setattr(os, "pread", dead_server)
    with pytest.raises(CheckpointUnavailableError) as info:
        load_latest(ckdir, environ=JOB)
    assert not isinstance(info.value, NoCheckpointError)
    assert isinstance(info.value, StorageUnavailableError) and info.value.retryable
    message = str(info.value)
    assert f"checkpoint {newest} cannot be read now" in message and "\n" not in message
    monkeypatch.undo()
    assert load_latest(ckdir, environ=JOB).path == newest  # the server back: the newest


def test_a_stalled_read_and_a_stalled_listing_are_bounded_and_retryable(
    ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(state_of(1), ckdir, step=1, environ=JOB)
    real = os.pread

    def slow(fd: int, n: int, offset: int) -> bytes:
        time.sleep(1.0)
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", slow)
    began = time.monotonic()
    with pytest.raises(CheckpointUnavailableError, match=r"stalled for 0\.2 s"):
        load_latest(ckdir, read_timeout_s=0.2, environ=JOB)
    monkeypatch.undo()
    scan = catalog._scan

    def slow_scan(directory: str) -> list[str]:
        time.sleep(1.0)
        return scan(directory)

    monkeypatch.setattr(catalog, "_scan", slow_scan)
    with pytest.raises(CheckpointUnavailableError, match=r"listing the checkpoints in .* stalled"):
        load_latest(ckdir, read_timeout_s=0.2, environ=JOB)
    assert time.monotonic() - began < 5.0


def test_an_unreadable_manifest_is_not_damage(
    ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only = save(state_of(1), ckdir, step=1, environ=JOB)
    real = catalog.read_manifest

    def eio(path: str):  # type: ignore[no-untyped-def]
        if path == only:
            raise StorageUnavailableError(errno.EIO, f"cannot read manifest of {path}")
        return real(path)

    monkeypatch.setattr(catalog, "read_manifest", eio)
    with pytest.raises(CheckpointUnavailableError, match="cannot be read now"):
        load_latest(ckdir, environ=JOB)
    from shardio.checkpoint.audit import latest_intact

    with pytest.raises(CheckpointUnavailableError):
        latest_intact(str(ckdir))


def test_every_checkpoint_damaged_names_each_and_is_not_none(ckdir: pathlib.Path) -> None:
    paths = [save(state_of(s), ckdir, step=s, environ=JOB) for s in (1, 2)]
    for p in paths:
        _flip(_files(p)[0])
    with pytest.raises(CheckpointError) as info:
        load_latest(ckdir, environ=JOB)
    assert not isinstance(info.value, NoCheckpointError)
    message = str(info.value)
    assert "2 found, none loads" in message and "xxh3-128" in message
    assert all(os.path.basename(p) in message for p in paths) and "\n" not in message


def test_none_of_the_kind_asked_is_none(ckdir: pathlib.Path) -> None:
    save(state_of(1), ckdir, kind="light", step=1, environ=JOB)
    with pytest.raises(NoCheckpointError, match="no full checkpoint in"):
        load_latest(ckdir, kind="full", environ=JOB)


def test_an_intact_checkpoint_torch_load_refuses_is_an_error_not_a_fallback(
    ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(state_of(1), ckdir, step=1, environ=JOB)
    newest = save(state_of(2), ckdir, step=2, environ=JOB)

    def refuse(*args: object, **kwargs: object) -> object:
        raise RuntimeError("Weights only load failed: GLOBAL builtins.Custom")

    monkeypatch.setattr(torch, "load", refuse)  # as for a state weights_only cannot load
    with pytest.raises(CheckpointError, match="weights_only=False") as info:
        load_latest(ckdir, environ=JOB)
    assert not isinstance(info.value, NoCheckpointError)
    assert f"checkpoint {newest} not loaded" in str(info.value)  # not the older one instead


# -- one given checkpoint (SHARDIO_RESUME_FROM) ---------------------------------------------------


def test_a_given_checkpoint_loads_that_one_and_no_other(ckdir: pathlib.Path) -> None:
    older = save(state_of(1), ckdir, step=1, environ=JOB)
    newest = save(state_of(2), ckdir, step=2, environ=JOB)
    ck = load_latest(older, environ=JOB)
    assert (ck.path, ck.step, ck.skipped) == (older, 1, [])
    assert_state(ck.state, 1)
    renamed = ckdir.parent / "kept-by-hand"
    os.rename(newest, renamed)  # a checkpoint by another name: its manifest says what it is
    assert load_latest(renamed, environ=JOB).step == 2
    with pytest.raises(CheckpointError, match="is a full one, not light"):
        load_latest(older, kind="light", environ=JOB)


def test_a_given_checkpoint_damaged_or_missing_is_an_error_never_a_fallback(
    ckdir: pathlib.Path,
) -> None:
    older = save(state_of(1), ckdir, step=1, environ=JOB)
    newest = save(state_of(2), ckdir, step=2, environ=JOB)
    _flip(_files(newest)[0])
    with pytest.raises(CheckpointError, match=f"checkpoint {newest} is damaged") as info:
        load_latest(newest, environ=JOB)
    assert not isinstance(info.value, NoCheckpointError)
    gone = os.path.join(ckdir, os.path.basename(older).replace("step0", "step9"))
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_latest(gone, environ=JOB)
    assert not isinstance(info.value, NoCheckpointError)
    os.remove(os.path.join(older, "manifest.json"))
    with pytest.raises(CheckpointError, match=r"is damaged.*manifest") as info:
        load_latest(older, environ=JOB)
    assert not isinstance(info.value, NoCheckpointError)


# -- pruning counts intact checkpoints only -------------------------------------------------------


def test_keep_never_removes_the_last_intact_fallback_for_a_damaged_one(
    ckdir: pathlib.Path,
) -> None:
    first = save(state_of(1), ckdir, step=1, environ=JOB)
    second = save(state_of(2), ckdir, step=2, environ=JOB)
    _flip(_files(second)[0])  # rots after its save was checked
    third = save(state_of(3), ckdir, step=3, environ=JOB, keep=2)
    assert os.path.isdir(first) and os.path.isdir(second)  # 2 intact kept: 3 and 1
    import shutil

    shutil.rmtree(third)
    ck = load_latest(ckdir, environ=JOB)
    assert ck.step == 1 and [p for p, _ in ck.skipped] == [second]
    save(state_of(4), ckdir, step=4, environ=JOB, keep=1)
    assert sorted(p.name[-5:] for p in ckdir.iterdir() if p.name.startswith("checkpoint")) == [
        "00004"
    ]


# -- two live jobs, one directory ---------------------------------------------------------------


def _write_lease(ckdir: pathlib.Path, *, job_id: str, host: str, pid: int, age_s: float) -> None:
    ckdir.mkdir(parents=True, exist_ok=True)
    body = {"job_id": job_id, "host": host, "pid": pid,
            "renewed_ns": time.time_ns() - int(age_s * 1e9)}  # fmt: skip
    target = ckdir / lease.LEASE_NAME
    if target.is_symlink():
        target.unlink()
    os.symlink(json.dumps(body), target)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_second_live_job_is_refused_in_one_line(ckdir: pathlib.Path) -> None:
    mine = save(state_of(1), ckdir, step=1, environ=NOJOB)
    other = os.getppid()  # a live process of this host: another job saving here
    _write_lease(ckdir, job_id="nojob", host=this_host(), pid=other, age_s=1)
    with pytest.raises(CheckpointError, match=f"belongs to a process \\(pid {other}") as info:
        save(state_of(2), ckdir, step=2, environ=NOJOB, keep=1)
    assert "\n" not in str(info.value) and info.value.errno == errno.EBUSY
    with pytest.raises(CheckpointError, match="still running: its checkpoints are not loaded"):
        load_latest(ckdir, environ=NOJOB)
    assert os.path.isdir(mine)  # nothing of the other job's pruned
    assert [p.name for p in ckdir.iterdir() if p.name.startswith(".checkpoint")] == []


def test_a_finished_jobs_directory_is_taken_over(ckdir: pathlib.Path) -> None:
    first = save(state_of(1), ckdir, step=1, environ=NOJOB)
    _write_lease(ckdir, job_id="nojob", host=this_host(), pid=_dead_pid(), age_s=1)
    assert load_latest(ckdir, environ=NOJOB).path == first  # the chain resumes
    second = save(state_of(2), ckdir, step=2, environ=NOJOB, keep=1)
    assert not os.path.exists(first) and load_latest(ckdir, environ=NOJOB).path == second
    owner = lease.read_owner(str(ckdir))
    assert owner is not None and owner.pid == os.getpid()


def _identity(job: str) -> Identity:
    return Identity(rank=0, world_size=1, hosts=(this_host(),), job_id=job)


def test_slurm_is_asked_whether_the_owning_job_still_runs(ckdir: pathlib.Path) -> None:
    asked: list[list[str]] = []

    def squeue(state: str, rc: int = 0, err: str = ""):  # type: ignore[no-untyped-def]
        def run(argv, *, timeout_s: float = 60.0) -> CommandResult:  # type: ignore[no-untyped-def]
            asked.append(list(argv))
            return CommandResult(argv=argv, returncode=rc, stdout=state, stderr=err)

        return run

    def held_by(job: str) -> None:  # a process of another job (a live pid: squeue decides)
        _write_lease(ckdir, job_id=job, host="node7", pid=os.getppid(), age_s=1)

    held_by("500")
    with pytest.raises(CheckpointError, match="belongs to job 500"):
        lease.claim(str(ckdir), _identity("501"), runner=squeue("RUNNING\n"))
    assert asked[-1] == ["squeue", "-h", "-j", "500", "-o", "%T"]
    lease.claim(str(ckdir), _identity("500"), runner=squeue("RUNNING\n"))  # a requeue: its own
    held_by("500")
    lease.claim(str(ckdir), _identity("501"), runner=squeue("", 1, "Invalid job id specified"))
    owner = lease.read_owner(str(ckdir))
    assert owner is not None and owner.job_id == "501" and owner.pid == os.getpid()
    held_by("502")
    lease.claim(str(ckdir), _identity("503"), runner=squeue("COMPLETED\n"))  # a job chain
    held_by("503")
    with pytest.raises(CheckpointError, match="belongs to job 503"):
        lease.check_not_owned(str(ckdir), job_id="504", host="n1", runner=squeue("RUNNING\n"))
    held_by("503")  # no SLURM to ask: a lease renewed within LEASE_TTL_S holds
    with pytest.raises(CheckpointError, match="belongs to job 503"):
        lease.check_not_owned(str(ckdir), job_id="504", host="n1", runner=squeue("", 1, "down"))
    _write_lease(ckdir, job_id="503", host="node7", pid=1, age_s=lease.LEASE_TTL_S + 60)
    lease.check_not_owned(str(ckdir), job_id="504", host="n1", runner=squeue("", 1, "down"))


def test_a_damaged_lease_refuses_nobody(ckdir: pathlib.Path) -> None:
    ckdir.mkdir()
    (ckdir / lease.LEASE_NAME).write_text("{not json")
    assert save(state_of(1), ckdir, step=1, environ=JOB)
    # Not a lease shardio wrote: left as it is (saves go on, unguarded).
    assert (ckdir / lease.LEASE_NAME).read_text() == "{not json"
    os.remove(ckdir / lease.LEASE_NAME)
    os.symlink("/etc/passwd", ckdir / lease.LEASE_NAME)
    assert load_latest(ckdir, environ=JOB).step == 1
    assert save(state_of(2), ckdir, step=2, environ=JOB)
    assert os.readlink(ckdir / lease.LEASE_NAME) == "/etc/passwd"
    os.remove(ckdir / lease.LEASE_NAME)
    for pid, host in ((-1, this_host()), (0, this_host()), (10**30, this_host()),
                      (os.getppid(), "a\nb")):  # fmt: skip
        _write_lease(ckdir, job_id="nojob", host=host, pid=pid, age_s=1)
        assert lease.read_owner(str(ckdir)) is None
        assert load_latest(ckdir, environ=NOJOB).step == 2


# -- the dataset id rides through GPUPrefetcher ---------------------------------------------------


def test_a_checkpoint_through_gpuprefetcher_records_the_dataset_id(
    ckdir: pathlib.Path, packed_small
) -> None:
    from shardio import ShardDataset
    from shardio.errors import UsageError
    from shardio.runtime.prefetch import GPUPrefetcher

    ds_path = packed_small("tar", "256KiB", 1)[0]
    other_path = packed_small("tar", "128KiB", 1)[0]  # the same samples packed again

    def loader(path: pathlib.Path):  # type: ignore[no-untyped-def]
        return ShardDataset(path, seed=3).loader(batch_size=8, num_workers=0)

    plain = loader(ds_path)
    prefetcher = GPUPrefetcher(plain, device="cpu")
    assert prefetcher.dataset_id == plain.dataset_id is not None
    with prefetcher:
        it = iter(prefetcher)
        for _ in range(3):
            next(it)
        save({"w": torch.ones(2)}, ckdir, step=3, loader=prefetcher, environ=JOB)
    with pytest.raises(UsageError, match="another dataset, or one packed again"):
        load_latest(ckdir, loader=GPUPrefetcher(loader(other_path), device="cpu"), environ=JOB)
    again = GPUPrefetcher(loader(ds_path), device="cpu")
    ck = load_latest(ckdir, loader=again, environ=JOB)
    assert ck.manifest.loader is not None and ck.manifest.loader["consumed"] == 24


def test_a_claim_killed_holding_the_mutex_never_blocks_the_next(
    ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckdir.mkdir()
    mutex = ckdir / ".shardio-owner.lock"
    mutex.mkdir()
    old = time.time() - 3600
    os.utime(mutex, (old, old))
    assert save(state_of(1), ckdir, step=1, environ=JOB)  # the stale mutex is broken
    assert not mutex.exists()
    monkeypatch.setattr(lease, "_MUTEX_WAIT_S", 0.3)
    mutex.write_text("not a mutex shardio made")
    os.utime(mutex, (old, old))
    began = time.monotonic()
    with pytest.raises(CheckpointError, match="is held by a claim") as info:
        save(state_of(2), ckdir, step=2, environ=JOB)
    assert info.value.errno == errno.EBUSY and time.monotonic() - began < 5
    assert mutex.read_text() == "not a mutex shardio made"


_TWICE = """
import os, sys, time
sys.path.insert(0, sys.argv[3])
from checkpointing import state_of
from shardio.checkpoint import save
from shardio.errors import CheckpointError
go = float(sys.argv[2])
time.sleep(max(0.0, go - time.time()))  # both start saving at once
try:
    for step in (1, 2):
        save(state_of(step), sys.argv[1], step=step, environ={}, keep=1)
        time.sleep(1.0)
    print("saved")
except CheckpointError as exc:
    print(f"refused: {exc}")
"""


@pytest.mark.slow
def test_the_same_job_started_twice_at_once_saves_once(ckdir: pathlib.Path) -> None:
    here = str(pathlib.Path(__file__).resolve().parents[2])
    go = str(time.time() + 4.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWICE, str(ckdir), go, here],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    said = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert said[0].startswith("refused: ") and "still running" in said[0], said
    assert said[1] == "saved", said
    names = [p.name for p in ckdir.iterdir() if p.name.startswith("checkpoint_")]
    assert len(names) == 1 and names[0].endswith("step000000000000002")


def test_a_filesystem_without_symlinks_saves_unguarded(
    ckdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_symlinks(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    assert save(state_of(1), ckdir, step=1, environ=JOB)
    assert "no lease on" in caplog.text and not (ckdir / lease.LEASE_NAME).exists()
    monkeypatch.undo()
    from shardio.errors import UsageError

    with pytest.raises(UsageError, match="environ must be a mapping"):
        load_latest(ckdir, environ=["SLURM_JOB_ID=1"])  # type: ignore[arg-type]


# -- reading a running job's checkpoint: explicit, read-only, no lease ---------------------------


def _tree(ckdir: pathlib.Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``ckdir``: (mtime_ns, size, symlink target) by relative path."""
    out = {}
    for p in sorted(ckdir.rglob("*")):
        st = os.lstat(p)
        out[str(p.relative_to(ckdir))] = (
            st.st_mtime_ns,
            st.st_size,
            os.readlink(p) if p.is_symlink() else "",
        )
    return out


def test_one_given_checkpoint_of_a_live_job_loads_without_the_lease(
    ckdir: pathlib.Path,
) -> None:
    first = save(state_of(1), ckdir, step=1, environ=NOJOB)
    newest = save(state_of(2), ckdir, step=2, environ=NOJOB)
    other = os.getppid()  # a live process of this host: the training job saving here
    _write_lease(ckdir, job_id="nojob", host=this_host(), pid=other, age_s=1)
    before = _tree(ckdir)
    # An evaluation process loads one checkpoint of the running job, by its path.
    for path in (newest, first):
        ck = load_latest(path, environ=NOJOB)
        assert ck.path == path and ck.step == int(path[-5:])
        assert_state(ck.state, ck.step)
    # ...with a loader too, and under a SLURM job of its own.
    assert load_latest(newest, environ={"SLURM_JOB_ID": "4242"}).step == 2
    # Resuming "the newest" of that directory is still refused: it is the other job's.
    with pytest.raises(CheckpointError, match="still running: its checkpoints are not loaded"):
        load_latest(ckdir, environ=NOJOB)
    assert _tree(ckdir) == before  # nothing written, pruned, nor any lease taken or renewed
    owner = lease.read_owner(str(ckdir))
    assert owner is not None and owner.pid == other


def test_the_checkpoint_cli_never_takes_the_lease_nor_writes(ckdir: pathlib.Path) -> None:
    from shardio.cli.main import main

    save(state_of(1), ckdir, step=1, environ=NOJOB)
    newest = save(state_of(2), ckdir, step=2, environ=NOJOB)
    other = os.getppid()
    _write_lease(ckdir, job_id="nojob", host=this_host(), pid=other, age_s=1)
    before = _tree(ckdir)
    for argv in (
        ["checkpoint", "ls", str(ckdir)],
        ["checkpoint", "ls", "--json", str(ckdir)],
        ["checkpoint", "verify", str(ckdir)],
        ["checkpoint", "verify", str(newest)],
        ["checkpoint", "latest", str(ckdir)],
        ["checkpoint", "latest", "--kind", "full", "--json", str(ckdir)],
    ):
        assert main(argv) == 0, argv
    assert _tree(ckdir) == before
    owner = lease.read_owner(str(ckdir))
    assert owner is not None and owner.pid == other
