"""benchmarks/bench_gpu.py and scripts/gpu_check.sh without a GPU: a clear refusal (exit 2),
nothing written; the CPU smoke run of the script's own rows is ``--device cpu``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    os.path.exists("/dev/nvidia0"), reason="a GPU is here: scripts/gpu_check.sh runs it"
)
def test_without_cuda_the_gpu_benchmark_and_check_refuse_clearly(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "RESULTS.md"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "needs a CUDA device" in run.stderr
    assert "Traceback" not in run.stderr
    assert not out.exists()
    env = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path)}
    check = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert check.returncode == 2
    assert "no CUDA device" in check.stderr
