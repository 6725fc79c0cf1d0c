"""SIGKILL at random points of checkpoint saves: the newest intact one is always loadable, it
is at least the last one committed, and it holds exactly the state of its step."""

from __future__ import annotations

import os
import pathlib
import random
import subprocess
import sys
import time

import pytest
from checkpointing import assert_state
from killing import kill_session

from shardio.checkpoint import load_latest
from shardio.checkpoint.audit import latest_intact, list_dir

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "checkpoint_loop.py"


def _committed(log: pathlib.Path) -> int:
    lines = log.read_text().split() if log.exists() else []
    return int(lines[-1]) if lines else -1


@pytest.mark.parametrize("seed", [1])
def test_sigkill_during_saves_leaves_the_previous_checkpoint(tmp_path: pathlib.Path, seed: int):
    rng = random.Random(seed)
    ckdir, log = tmp_path / "ckpt", tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    kills = 0
    for _ in range(6):
        err = tmp_path / "stderr"
        with err.open("ab") as stderr:
            proc = subprocess.Popen(
                [sys.executable, SCRIPT, ckdir, log, "4"], env=env, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
        before = _committed(log)
        deadline = time.monotonic() + 60
        while _committed(log) == before and proc.poll() is None:  # let it start saving
            assert time.monotonic() < deadline, "no checkpoint saved within 60 s"
            time.sleep(0.01)
        assert proc.poll() is None, err.read_text()
        time.sleep(rng.uniform(0.0, 0.6))  # somewhere inside a later save
        kill_session(proc.pid)
        proc.wait()
        kills += 1
        committed = _committed(log)
        ck = load_latest(ckdir)
        assert ck.step >= committed, f"kill {kills}: step {ck.step} < committed {committed}"
        assert ck.step <= committed + 1  # at most the save in flight, when its rename landed
        assert_state(ck.state, ck.step, mib=4)
        found, _ = latest_intact(str(ckdir))
        assert found.path == ck.path
    items, temps = list_dir(str(ckdir))
    assert all(i.manifest is not None for i in items)
    assert len(temps) <= kills  # killed saves' temp directories, nothing with a final name
