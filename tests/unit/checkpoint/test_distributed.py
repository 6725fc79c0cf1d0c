"""Checkpoints of real torch.distributed jobs (gloo on loopback, one process per rank)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "dist_ckpt.py"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_job(action: str, ckdir: pathlib.Path, out: pathlib.Path, world: int) -> list[dict]:
    out.mkdir(parents=True)
    port = str(_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, action, ckdir, out, str(r), str(world), port],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
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
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[dict]]:
    ckdir = tmp_path_factory.mktemp("dist") / "ckpt"
    return ckdir, run_job("save", ckdir, ckdir.parent / "save-out", 2)


def test_two_ranks_save_at_once_into_one_checkpoint(saved) -> None:
    _, results = saved
    assert results[0]["paths"] == results[1]["paths"]  # every rank gets the path
    # Rank 0's clock decided: rank 1's never moved, yet both saved at the same steps.
    assert results[0]["saved_steps"] == results[1]["saved_steps"] == [10, 20]
    assert results[0]["kinds"] == results[1]["kinds"] == ["full", "full"]
    path = pathlib.Path(results[0]["paths"][0])
    names = sorted(p.name for p in path.iterdir())
    assert names[-1] == "manifest.json" and len(names) == 3
    assert names[0].endswith("_rank00000.pt.zst") and names[1].endswith("_rank00001.pt.zst")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["per_rank"] is True


def test_two_ranks_load_their_own_state_and_agree_past_damage(saved, tmp_path) -> None:
    ckdir, _ = saved
    results = run_job("load", ckdir, tmp_path / "load1", 2)
    for r, res in enumerate(results):
        assert res["per_rank"]["step"] == 20 and res["per_rank"]["state_rank"] == r
        assert res["per_rank"]["w0"] == 20 * 100 + r
        assert res["replicated"]["state_rank"] == 0  # rank 0's state stands for all
    # Damage rank 1's file of the newest: rank 0's is intact, yet both fall back together.
    newest = sorted((ckdir / "per-rank").glob("checkpoint_*full_step*20"))[0]
    (victim,) = newest.glob("*_rank00001.pt.zst")
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    results = run_job("load", ckdir, tmp_path / "load2", 2)
    for r, res in enumerate(results):
        assert res["per_rank"]["step"] == 10 and res["per_rank"]["state_rank"] == r
        ((skipped, why),) = res["per_rank"]["skipped"]
        assert skipped == str(newest) and why.startswith("rank 1:")


def test_one_rank_loads_a_replicated_checkpoint_not_a_per_rank_one(saved, tmp_path) -> None:
    ckdir, _ = saved
    (res,) = run_job("load", ckdir, tmp_path / "load-1", 1)
    assert res["replicated"]["step"] == 1 and res["replicated"]["state_rank"] == 0
    assert res["per_rank"]["type"] == "CheckpointError"  # they exist: never "none", a fresh start
    assert res["per_rank"]["error"].count("saved per rank by 2 ranks") == 3
