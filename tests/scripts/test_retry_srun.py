"""scripts/slurm/retry_srun.sh with a fake `srun` that fails a given number of times.

`shardio verify` is the real one behind a recording wrapper (SHARDIO_BIN), so the calls
between tries are checked in order, on a real dataset, intact or damaged.
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

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "retry_srun.sh"
SHARDIO = pathlib.Path(sys.executable).parent / "shardio"
STAMP = r"\[retry_srun\.sh \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}\]"


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


def test_fails_twice_then_succeeds_with_verify_between_tries(
    run_script: Callable[..., Any],
    tiny_dataset: pathlib.Path,
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    env = fail_env(tmp_path, 2) | {"SHARDIO_BIN": str(recording_shardio)}
    result = run_script(
        [SCRIPT, "-n", "3", "-b", "0", "-d", tiny_dataset, "--",
         "srun", "--ntasks=16", "--kill-on-bad-exit=1", "true"],
        env=env,
    )  # fmt: skip
    assert result.rc == 0, result.stderr
    assert names(result.calls) == ["srun", "verify", "srun", "verify", "srun"]
    verify = ["shardio", "verify", "--no-progress", str(tiny_dataset)]
    assert result.calls[1] == result.calls[3] == verify
    assert result.calls[0] == ["srun", "--ntasks=16", "--kill-on-bad-exit=1", "true"]
    lines = result.stderr.splitlines()
    for n in (1, 2, 3):
        assert any(re.fullmatch(rf"{STAMP} try {n}/3: srun --ntasks=16 .*", x) for x in lines)
    assert any(re.fullmatch(rf"{STAMP} try 1/3 failed with exit 1", x) for x in lines)
    assert any(re.fullmatch(rf"{STAMP} try 3/3 succeeded", x) for x in lines)
    assert f"dataset {tiny_dataset} is intact" in result.stderr
    assert "OK: verified" in result.stderr  # shardio's own report goes to stderr too
    assert result.stdout == ""


def test_always_failing_stops_after_n_tries_with_the_last_status(
    run_script: Callable[..., Any],
    tiny_dataset: pathlib.Path,
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    env = fail_env(tmp_path, 99, rc=7) | {"SHARDIO_BIN": str(recording_shardio)}
    result = run_script(
        [SCRIPT, "-n", "3", "-b", "0", "-d", tiny_dataset, "--", "srun", "true"], env=env
    )
    assert result.rc == 7
    # verify between tries only: not after the last one, when no retry follows
    assert names(result.calls) == ["srun", "verify", "srun", "verify", "srun"]
    assert "giving up after 3 tries; exit 7" in result.stderr


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
    fakebin = REPO / "tests" / "fakebin_beeond"
    env = {"PATH": os.pathsep.join([str(bin_dir), str(fakebin), os.environ["PATH"]])}
    result = run_script([SCRIPT, "-n", "4", "-b", "3", "--", "srun", "false"], env=env)
    assert result.rc == 1
    assert names(result.calls) == ["srun", "sleep 3", "srun", "sleep 6", "srun", "sleep 12", "srun"]
    assert "waiting 3s before try 2" in result.stderr
    assert "waiting 12s before try 4" in result.stderr


def test_damaged_dataset_says_what_to_do_and_retries(
    run_script: Callable[..., Any],
    tiny_dataset: pathlib.Path,
    recording_shardio: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    damaged = tmp_path / "damaged-ds"
    shutil.copytree(tiny_dataset, damaged)
    shard = sorted(damaged.glob("shards/*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member's payload
    shard.write_bytes(bytes(data))

    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(recording_shardio)}
    result = run_script([SCRIPT, "-b", "0", "-d", damaged, "--", "srun", "true"], env=env)
    assert result.rc == 0, result.stderr
    # verify exits 3; this shardio has no --repair, so nothing is repaired
    assert names(result.calls) == ["srun", "verify", "verify-help", "srun"]
    assert re.search(rf"DAMAGED \S*{shard.name}: ", result.stderr), result.stderr
    assert "no 'verify --repair' yet" in result.stderr
    assert f"check again with 'shardio verify {damaged}'" in result.stderr


def test_repair_is_used_once_shardio_offers_it(
    run_script: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    # A future shardio: `verify --help` lists --repair; verify says damaged, repair fixes it.
    future = write_exe(
        tmp_path / "shardio-future",
        "#!/usr/bin/env bash\n"
        'line=shardio; for a in "$@"; do line+=$\'\\t\'"$a"; done\n'
        'printf \'%s\\n\' "$line" >>"$SHARDIO_FAKE_LOG"\n'
        'case " $* " in\n'
        '*" --help "*) echo "  --repair   rebuild damaged shards"; exit 0 ;;\n'
        '*" --repair "*) echo "repaired 1 shard"; exit 0 ;;\n'
        '*) echo "DAMAGED shards/shard-000000.tar" >&2; exit 3 ;;\n'
        "esac\n",
    )
    env = fail_env(tmp_path, 1) | {"SHARDIO_BIN": str(future)}
    result = run_script([SCRIPT, "-b", "0", "-d", "/data/ds", "--", "srun", "true"], env=env)
    assert result.rc == 0, result.stderr
    assert names(result.calls) == ["srun", "verify", "verify-help", "repair", "srun"]
    assert result.calls[3] == ["shardio", "verify", "--repair", "--no-progress", "/data/ds"]
    assert "dataset /data/ds repaired" in result.stderr


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
        "PATH": f"{REPO / 'tests' / 'fakebin_beeond'}{os.pathsep}{env.get('PATH', '')}",
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
