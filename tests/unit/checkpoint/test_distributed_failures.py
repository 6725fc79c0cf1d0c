"""A save that fails on one rank fails on every rank, at the same call (gloo, two processes)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "dist_fail.py"
SAVE_SCRIPT = pathlib.Path(__file__).parent / "scripts" / "dist_save_fail.py"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_two_ranks(script: pathlib.Path, tmp_path: pathlib.Path) -> list[list]:
    """Run ``script`` as two gloo ranks; each rank's recorded events."""
    ckdir, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    port = str(_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    procs = [
        subprocess.Popen(
            [sys.executable, script, ckdir, out, str(r), "2", port],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + 120
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1, deadline - time.monotonic()))[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {r}:\n{outputs[r]}"
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_every_rank_sees_the_same_outcome_and_none_hangs(tmp_path: pathlib.Path) -> None:
    ranks = _run_two_ranks(SCRIPT, tmp_path)
    # The same calls raised on both ranks, at the same steps; everything else went on.
    assert [e[:3] for e in ranks[0]] == [e[:3] for e in ranks[1]]
    raised = [(e[0], e[1]) for e in ranks[0] if e[2:3] == ["raised"]]
    assert raised == [("wait", 10), ("save", 40)]
    by_rank = [{(e[0], e[1]): e for e in events} for events in ranks]
    # Rank 0's own failure is its own exception; rank 1 learns it from rank 0, by rank.
    assert "injected: the commit of step 10 failed" in by_rank[0][("wait", 10)][4]
    assert by_rank[1][("wait", 10)][3] == "CheckpointError"
    assert "rank 0: the background save of step 10 failed" in by_rank[1][("wait", 10)][4]
    # Rank 1's refused state: a UsageError there, a CheckpointError naming it on rank 0.
    assert by_rank[1][("save", 40)][3] == "UsageError"
    assert "rank 1: cannot save state['args'] (argparse.Namespace)" in by_rank[0][("save", 40)][4]
    assert [e[1] for e in ranks[0] if e[0] == "maybe_save"] == [10, 20, 30]
    assert ranks[0][-1] == ranks[1][-1] == ["loaded", 41]


@pytest.mark.slow
def test_save_and_load_failing_on_one_rank_raise_on_every_rank(tmp_path: pathlib.Path) -> None:
    ranks = _run_two_ranks(SAVE_SCRIPT, tmp_path)
    assert [e[:3] for e in ranks[0]] == [e[:3] for e in ranks[1]]
    by_rank = [{(e[0], e[1]): e for e in events} for events in ranks]
    # A loader's state_dict() raising on rank 1: its own error there, named on rank 0.
    assert by_rank[1][("save", 1)][2:4] == ["raised", "RuntimeError"]
    assert by_rank[0][("save", 1)][3] == "CheckpointError"
    assert "rank 1: injected: the loader's state_dict() failed" in by_rank[0][("save", 1)][4]
    # A bad argument on rank 1 alone.
    assert by_rank[1][("save", 2)][3] == "UsageError"
    assert "rank 1: keep must be at least 1" in by_rank[0][("save", 2)][4]
    # load_latest's loader without load_state_dict on rank 1 alone.
    assert by_rank[1][("load", 3)][3] == "UsageError"
    assert "loader must have load_state_dict()" in by_rank[1][("load", 3)][4]
    assert "rank 1: loader must have load_state_dict()" in by_rank[0][("load", 3)][4]
    # Then both go on together; nothing of the failed saves was committed.
    saved = [by_rank[r][("save", 4)] for r in range(2)]
    assert saved[0] == saved[1] and saved[0][2] == "ok" and saved[0][3].endswith("4")
    assert by_rank[0][("load", 4)] == by_rank[1][("load", 4)] == ["load", 4, "ok", "4"]
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("check"))
    assert len(names) == 1 and names[0].endswith("4")
