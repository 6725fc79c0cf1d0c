"""scripts/slurm/retry_srun.sh with a fake `srun` that fails a given number of times.

`shardio verify` is the real one behind a recording wrapper (SHARDIO_BIN), so the calls
between tries are checked in order, on a real dataset or staging area: intact, damaged,
repaired from a source copy, or left damaged.

Steps that really fail (an exit code, a SIGKILL) under real srun, the repair between tries
and giving up are in tests/slurm/test_slurm_retry.py. The fake srun remains where the step
must fail in a set way many times over (each repair outcome, the backoff's sleeps, a
SIGTERM at a chosen moment, usage errors): cheap, and independent of a cluster.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from fakebins import JOB_TOOLS, fake_path

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "retry_srun.sh"
SHARDIO = pathlib.Path(sys.executable).parent / "shardio"
JOB_FAKES = fake_path(*JOB_TOOLS)


def write_exe(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    return path


@pytest.fixture
def recording_shardio(tmp_path: pathlib.Path) -> pathlib.Path:
    """A `shardio` that records its argv in the fakes' log, then runs the real one."""
    return write_exe(
        tmp_path / "shardio-rec",
        "#!/usr/bin/env bash\n"
        'line=shardio; for a in "$@"; do line+=$\'\\t\'"$a"; done\n'
        'printf \'%s\\n\' "$line" >>"$SHARDIO_FAKE_LOG"\n'
        f'exec {SHARDIO} "$@"\n',
    )


def names(calls: list[list[str]]) -> list[str]:
    """The calls as 'srun' / 'sleep N' / 'verify' / 'verify-help' / 'repair', in order."""
    out = []
    for call in calls:
        if call[0] == "srun":
            out.append("srun")
        elif call[0] == "sleep":
            out.append(f"sleep {call[1]}")
        elif "--help" in call:
            out.append("verify-help")
        elif "--repair" in call:
            out.append("repair")
        else:
            out.append(call[1])
    return out


def fail_env(tmp_path: pathlib.Path, fails: int, rc: int = 1) -> dict[str, str]:
    return {
        "SHARDIO_FAKE_SRUN_FAILS": str(fails),
        "SHARDIO_FAKE_SRUN_RC": str(rc),
        "SHARDIO_FAKE_SRUN_COUNTER": str(tmp_path / "srun-count"),
        "SLURM_CPUS_PER_TASK": "1",  # `shardio verify` then checks in-process: quicker here
    }


def test_default_is_three_tries_and_the_step_status_comes_back(
    run_script: Callable[..., Any],
) -> None:
    result = run_script([SCRIPT, "-b", "0", "--", "srun", "bash", "-c", "exit 5"])
    assert result.rc == 5
    assert names(result.calls) == ["srun"] * 3  # no -d: nothing to verify
    assert "try 3/3 failed with exit 5" in result.stderr


def test_backoff_doubles(run_script: Callable[..., Any], tmp_path: pathlib.Path) -> None:
    # A `sleep` that records instead of waiting, first on PATH.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(
        bin_dir / "sleep",
        '#!/usr/bin/env bash\nprintf "sleep\\t%s\\n" "$1" >>"$SHARDIO_FAKE_LOG"\n',
    )
    env = {"PATH": os.pathsep.join([str(bin_dir), JOB_FAKES, os.environ["PATH"]])}
    result = run_script([SCRIPT, "-n", "4", "-b", "3", "--", "srun", "false"], env=env)
    assert result.rc == 1
    assert names(result.calls) == ["srun", "sleep 3", "srun", "sleep 6", "srun", "sleep 12", "srun"]
    assert "waiting 3s before try 2" in result.stderr
    assert "waiting 12s before try 4" in result.stderr


def damage(dataset: pathlib.Path) -> pathlib.Path:
    """Flip a payload byte of the dataset's first shard; return the shard."""
    shard = sorted(dataset.glob("shards/*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member's payload
    shard.write_bytes(bytes(data))
    return shard


def test_damaged_dataset_without_a_source_says_what_to_do_and_retries(
    run_script: Callable[..., Any],
    tiny_dataset: pathlib.Path,
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    damaged = tmp_path / "damaged-ds"
    shutil.copytree(tiny_dataset, damaged)
    shard = damage(damaged)

    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(recording_shardio)}
    result = run_script([SCRIPT, "-b", "0", "-d", damaged, "--", "srun", "true"], env=env)
    assert result.rc == 0, result.stderr
    # verify exits 3; a packed dataset without -s has nothing to be repaired from
    assert names(result.calls) == ["srun", "verify", "srun"]
    assert re.search(rf"DAMAGED \S*{shard.name}: ", result.stderr), result.stderr
    assert "there is no copy to repair it from: give retry_srun.sh -s SOURCE" in result.stderr
    assert f"'shardio verify --repair --source SOURCE {damaged}'" in result.stderr
    assert "Retrying anyway." in result.stderr


def test_damaged_dataset_is_repaired_from_the_source(
    run_script: Callable[..., Any],
    tiny_dataset: pathlib.Path,
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    damaged = tmp_path / "damaged-ds"
    shutil.copytree(tiny_dataset, damaged)
    shard = damage(damaged)

    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(recording_shardio)}
    result = run_script(
        [SCRIPT, "-b", "0", "-d", damaged, "-s", tiny_dataset, "--", "srun", "true"], env=env
    )
    assert result.rc == 0, result.stderr
    assert names(result.calls) == ["srun", "verify", "repair", "srun"]
    assert result.calls[2] == [
        "shardio", "verify", "--repair", "--no-progress", "--source", str(tiny_dataset),
        str(damaged),
    ]  # fmt: skip
    assert f"dataset {damaged} repaired" in result.stderr
    assert f"repaired shards/{shard.name} (damaged)" in result.stderr
    assert shard.read_bytes() == (tiny_dataset / "shards" / shard.name).read_bytes()


@pytest.fixture
def staged(tiny_dataset: pathlib.Path, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(source, staging area): a private copy of the tiny dataset, staged."""
    from shardio.staging import StageOptions, stage_dataset

    source = tmp_path / "src-ds"
    shutil.copytree(tiny_dataset, source)
    area = tmp_path / "area"
    stage_dataset(source, area, StageOptions(durable=False))
    return source, area


def test_degraded_staging_area_is_repaired_too(
    run_script: Callable[..., Any],
    staged: tuple[pathlib.Path, pathlib.Path],
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    source, area = staged
    copy = sorted(area.glob("shards/*.tar"))[1]
    copy.unlink()

    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(recording_shardio)}
    result = run_script([SCRIPT, "-b", "0", "-d", area, "--", "srun", "true"], env=env)
    assert result.rc == 0, result.stderr
    assert names(result.calls) == ["srun", "verify", "repair", "srun"]
    # A staging area is repaired from the source it was staged from: no --source.
    assert result.calls[2] == ["shardio", "verify", "--repair", "--no-progress", str(area)]
    assert f"staging area {area} is degraded (its source is intact): repairing" in result.stderr
    assert f"dataset {area} repaired" in result.stderr
    assert copy.read_bytes() == (source / "shards" / copy.name).read_bytes()


def test_damage_left_after_the_repair_is_logged_and_retried(
    run_script: Callable[..., Any],
    staged: tuple[pathlib.Path, pathlib.Path],
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    source, area = staged
    copy = sorted(area.glob("shards/*.tar"))[0]
    copy.unlink()
    damage(source)  # the copy's source shard is bad too

    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(recording_shardio)}
    result = run_script([SCRIPT, "-b", "0", "-d", area, "--", "srun", "true"], env=env)
    assert result.rc == 0, result.stderr
    assert names(result.calls) == ["srun", "verify", "repair", "srun"]
    assert f"could not repair shards/{copy.name}: source shard" in result.stderr
    assert f"damage is left in {area} (listed above)" in result.stderr
    assert "Retrying anyway." in result.stderr


@pytest.mark.parametrize(
    ("repair_rc", "message"),
    [
        (0, "nothing left to repair"),
        (5, "is still degraded (copies listed above could not be made)"),
        (1, "repair of {ds} failed (exit 1); retrying anyway"),
    ],
)
def test_each_repair_outcome_is_logged(
    run_script: Callable[..., Any], tmp_path: pathlib.Path, repair_rc: int, message: str
) -> None:
    # A stand-in shardio: verify says degraded, the repair exits as given.
    fake = write_exe(
        tmp_path / "shardio-fake",
        "#!/usr/bin/env bash\n"
        'line=shardio; for a in "$@"; do line+=$\'\\t\'"$a"; done\n'
        'printf \'%s\\n\' "$line" >>"$SHARDIO_FAKE_LOG"\n'
        'case " $* " in\n'
        f'*" --repair "*) exit {repair_rc} ;;\n'
        '*) echo "MISSING shards/shard-000000.tar (staged copy): not staged" >&2; exit 5 ;;\n'
        "esac\n",
    )
    area = tmp_path / "area"
    (area / ".shardio-stage").mkdir(parents=True)
    (area / ".shardio-stage" / "area.json").write_text("{}")
    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(fake)}
    result = run_script([SCRIPT, "-b", "0", "-d", area, "--", "srun", "true"], env=env)
    assert result.rc == 0, result.stderr
    assert names(result.calls) == ["srun", "verify", "repair", "srun"]
    assert message.format(ds=area) in result.stderr


def test_verify_that_cannot_run_does_not_stop_the_retries(
    run_script: Callable[..., Any],
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(recording_shardio)}
    missing = tmp_path / "nowhere"
    result = run_script([SCRIPT, "-b", "0", "-d", missing, "--", "srun", "true"], env=env)
    assert result.rc == 0, result.stderr
    assert names(result.calls) == ["srun", "verify", "srun"]
    assert f"could not check {missing}" in result.stderr


def test_quick_verify_several_datasets_and_hook(
    run_script: Callable[..., Any],
    tiny_dataset: pathlib.Path,
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    hook_out = tmp_path / "hook.txt"
    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(recording_shardio)}
    result = run_script(
        [SCRIPT, "-q", "-b", "0", "-d", tiny_dataset, "-d", tiny_dataset,
         "-r", f"echo restaged >> {hook_out}", "--", "srun", "true"],
        env=env,
    )  # fmt: skip
    assert result.rc == 0, result.stderr
    quick = ["shardio", "verify", "--no-progress", "--quick", str(tiny_dataset)]
    assert result.calls[1:3] == [quick, quick]
    assert hook_out.read_text() == "restaged\n"  # once: before try 2
    assert "before try 2: echo restaged" in result.stderr


def test_sigterm_stops_the_step_and_the_retries(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDIO_FAKE_"))}
    env |= {
        "PATH": f"{JOB_FAKES}{os.pathsep}{env.get('PATH', '')}",
        "SHARDIO_FAKE_LOG": str(log),
    }
    with subprocess.Popen(
        [SCRIPT, "-n", "3", "-b", "0", "--", "srun", "sleep", "30"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        deadline = time.monotonic() + 10
        while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
    assert time.monotonic() - start < 5
    assert proc.returncode == 128 + signal.SIGTERM
    assert log.read_text().count("srun") == 1
    assert "got SIGTERM" in stderr
    assert "try 2/3" not in stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no command to run"),
        (["-n", "0", "--", "srun", "true"], "-n must be"),
        (["-n", "x", "--", "srun", "true"], "-n must be"),
        (["-b", "1.5", "--", "srun", "true"], "-b must be"),
        (["-n", "99999999999999999999999", "--", "srun", "true"], "-n must be"),
        (["-n", "9223372036854775808", "--", "srun", "true"], "-n must be"),
        (["-n", "1001", "--", "srun", "true"], "from 1 to 1000"),
        (["-b", "99999999999999999999999", "--", "srun", "true"], "-b must be"),
        (["-b", "86401", "--", "srun", "true"], "from 0 to 86400"),
        (["-z", "--", "srun", "true"], "unknown option -z"),
        (["-d"], "-d needs a value"),
    ],
)
def test_usage_errors(run_script: Callable[..., Any], argv: list[str], message: str) -> None:
    result = run_script([SCRIPT, *argv])
    assert result.rc == 2
    assert message in result.stderr
    assert "usage: retry_srun.sh" in result.stderr
    assert result.calls == []


TRAIN = """
import os, pathlib, sys
from shardio.checkpoint import load_latest, save
from shardio.errors import NoCheckpointError
ckdir, log = sys.argv[1], pathlib.Path(sys.argv[2])
resume = os.environ["SHARDIO_RESUME_FROM"]
try:
    ck = load_latest(ckdir)
    step = ck.step
    assert ck.path == resume, (ck.path, resume)
except NoCheckpointError:
    step = 0
    assert resume == "", resume
tries = len(log.read_text().split()) if log.exists() else 0
with log.open("a") as fh:
    fh.write(f"{step}\\n")
path = save({"step": step + 10}, ckdir, step=step + 10, environ={"SLURM_JOB_ID": "9"})
if tries == 1:  # the second try's checkpoint rots after it is written
    f = next(pathlib.Path(path).glob("*.pt.zst"))
    data = bytearray(f.read_bytes()); data[len(data) // 2] ^= 1; f.write_bytes(bytes(data))
sys.exit(0 if tries == 2 else 1)
"""


def test_each_try_says_which_checkpoint_it_resumes_from(
    run_script: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    ckdir, log = tmp_path / "ckpt", tmp_path / "tries"
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    result = run_script(
        [SCRIPT, "-b", "0", "-c", ckdir, "--", "srun", sys.executable, train, ckdir, log],
        env={"SHARDIO_BIN": str(SHARDIO)},
    )
    assert result.rc == 0, result.stderr
    assert log.read_text().split() == ["0", "10", "10"]  # the third skips the damaged 20
    err = result.stderr
    assert f"try 1 starts from scratch: no checkpoint in {ckdir} yet" in err
    first = ckdir / "checkpoint_vm_9_full_step000000000000010"
    second = ckdir / "checkpoint_vm_9_full_step000000000000020"
    if not first.exists():  # another host name
        first = next(ckdir.glob("checkpoint_*_step000000000000010"))
        second = next(ckdir.glob("checkpoint_*_step000000000000020"))
    assert f"try 2 resumes from checkpoint {first}" in err
    assert f"skipped {second}: " in err and "does not match its xxh3-128" in err
    assert f"try 3 resumes from checkpoint {first}" in err


def test_checkpoint_option_needs_a_value(run_script: Callable[..., Any]) -> None:
    result = run_script([SCRIPT, "-c"])
    assert result.rc == 2 and "-c needs a value" in result.stderr
