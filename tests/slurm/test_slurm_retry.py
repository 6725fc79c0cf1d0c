"""scripts/slurm/retry_srun.sh around job steps of real srun that really fail.

The step is ``srun -n 1 bash -c STEP``: its first try exits with a code, its second kills
itself with SIGKILL (srun reports the task killed), its third checks the dataset with
``shardio verify``, which passes only if the wrapper repaired it between the tries. A
recording ``shardio`` (SHARDIO_BIN) and the step write one shared log, so the order of steps,
checks, repairs and the hook is seen as it happened.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import sys

import pytest
from slurmbed import Cluster

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "retry_srun.sh"
SHARDIO = pathlib.Path(sys.executable).parent / "shardio"
STAMP = r"\[retry_srun\.sh \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}\]"


@pytest.fixture
def calls_log(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "calls.log"


@pytest.fixture
def recording_shardio(tmp_path: pathlib.Path, calls_log: pathlib.Path) -> pathlib.Path:
    """A `shardio` that logs 'verify' or 'repair', then runs the real one."""
    path = tmp_path / "shardio-rec"
    path.write_text(
        "#!/usr/bin/env bash\n"
        f'case " $* " in *" --repair "*) echo repair ;; *) echo verify ;; esac >>{calls_log}\n'
        f'exec {SHARDIO} "$@"\n'
    )
    path.chmod(0o755)
    return path


def step_script(counter: pathlib.Path, log: pathlib.Path, body: str) -> str:
    """A step that counts its tries (``$n``), logs 'step N' and runs ``body``."""
    return (
        f'n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo "$n" >{counter}; '
        f'echo "step $n" >>{log}; {body}'
    )


def damage(dataset: pathlib.Path) -> pathlib.Path:
    """Flip a payload byte of the dataset's first shard; return the shard."""
    shard = sorted(dataset.glob("shards/*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member's payload
    shard.write_bytes(bytes(data))
    return shard


def test_an_exit_then_a_kill_then_success_after_the_repair(
    slurm_cluster: Cluster,
    slurm_dataset: pathlib.Path,
    recording_shardio: pathlib.Path,
    calls_log: pathlib.Path,
    tmp_path: pathlib.Path,
) -> None:
    damaged = tmp_path / "damaged-ds"
    shutil.copytree(slurm_dataset, damaged)
    shard = damage(damaged)
    body = (
        'case "$n" in 1) exit 3 ;; 2) kill -KILL $$ ;; esac; '
        f"exec {SHARDIO} verify --no-progress {damaged}"
    )
    step = step_script(tmp_path / "count", calls_log, body)
    hook = f"echo hook >>{calls_log}"
    proc = slurm_cluster.run(
        [SCRIPT, "-n", "3", "-b", "0", "-d", damaged, "-s", slurm_dataset, "-r", hook, "--",
         "srun", "-n", "1", "--kill-on-bad-exit=1", "bash", "-c", step],
        env={"SHARDIO_BIN": str(recording_shardio), "SLURM_CPUS_PER_TASK": "1"},
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert calls_log.read_text().split("\n")[:-1] == [
        "step 1", "verify", "repair",  # the damage found and repaired after try 1
        "hook", "step 2", "verify",  # intact after try 2
        "hook", "step 3",
    ]  # fmt: skip
    lines = proc.stderr.splitlines()
    for n in (1, 2, 3):  # each try logged with a timestamp and the step's command
        assert any(re.fullmatch(rf"{STAMP} try {n}/3: srun -n 1 .*", x) for x in lines)
    assert any(re.fullmatch(rf"{STAMP} try 1/3 failed with exit 3", x) for x in lines)
    assert "task 0: Killed" in proc.stderr  # srun's own report of the SIGKILL
    assert any(re.fullmatch(rf"{STAMP} try 2/3 failed with exit 137", x) for x in lines)
    assert any(re.fullmatch(rf"{STAMP} try 3/3 succeeded", x) for x in lines)
    assert proc.stdout.startswith("OK: verified")  # only the step's own output
    assert f"dataset {damaged} repaired" in proc.stderr
    assert shard.read_bytes() == (slurm_dataset / "shards" / shard.name).read_bytes()


@pytest.mark.parametrize(("body", "rc"), [("exit 7", 7), ("kill -KILL $$", 137)])
def test_gives_up_after_the_last_try_with_its_status(
    slurm_cluster: Cluster,
    slurm_dataset: pathlib.Path,
    recording_shardio: pathlib.Path,
    calls_log: pathlib.Path,
    tmp_path: pathlib.Path,
    body: str,
    rc: int,
) -> None:
    step = step_script(tmp_path / "count", calls_log, body)
    proc = slurm_cluster.run(
        [SCRIPT, "-n", "2", "-b", "0", "-d", slurm_dataset, "--",
         "srun", "-n", "1", "bash", "-c", step],
        env={"SHARDIO_BIN": str(recording_shardio), "SLURM_CPUS_PER_TASK": "1"},
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == rc, proc.stderr
    # A check between the tries only: none after the last, when no retry follows.
    assert calls_log.read_text().split("\n")[:-1] == ["step 1", "verify", "step 2"]
    assert f"try 2/2 failed with exit {rc}" in proc.stderr
    assert f"giving up after 2 tries; exit {rc}" in proc.stderr
    assert f"dataset {slurm_dataset} is intact" in proc.stderr
