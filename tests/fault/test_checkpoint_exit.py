"""A process that saves and exits at once still writes its checkpoint, and exits 0."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from shardio.checkpoint import load_latest

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "checkpoint_exit.py"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def _assert_intact(ckdir: pathlib.Path, step: int) -> None:
    ck = load_latest(ckdir)
    assert ck.step == ck.state["step"] == step
    assert torch.equal(ck.state["w"], torch.arange(1 << 20, dtype=torch.float32) * step)
    assert not [p for p in ckdir.iterdir() if p.name.startswith(".checkpoint")]


@pytest.mark.slow
def test_the_final_save_is_written_before_the_process_exits(tmp_path: pathlib.Path) -> None:
    ckdir = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, SCRIPT, ckdir, "exit"],
        check=False, capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    _assert_intact(ckdir, 7)


@pytest.mark.slow
def test_a_sigterm_handler_that_saves_and_exits(tmp_path: pathlib.Path) -> None:
    ckdir = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, ckdir, "sigterm"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    _assert_intact(ckdir, 8)
