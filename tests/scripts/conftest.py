"""Fixtures for the job scripts under scripts/slurm and scripts/beeond.

The scripts run in subprocesses with fake `srun`, `scontrol`, `beeond`, `numactl` and
`taskset` first on PATH (their folders in tests/fakebin). The fakes append their argv to
$SHARDIO_FAKE_LOG, one call a line, tab-separated. A real one-host SLURM cluster runs the same
scripts in tests/slurm; the fakes stay for what it cannot be or do: 8-GPU nodes, several NUMA
nodes, numactl, BeeOND, and failures at a chosen moment.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import NamedTuple

import pytest
from fakebins import JOB_TOOLS, fake_path, read_calls

from shardio.packing.run import PackOptions, pack

REPO = pathlib.Path(__file__).resolve().parents[2]
JOB_FAKES = fake_path(*JOB_TOOLS)
VENV_BIN = pathlib.Path(sys.executable).parent
SHARDIO = VENV_BIN / "shardio"

# Variables of the caller's shell that would change what the scripts do.
_SCRUBBED_PREFIXES = ("SLURM_", "SHARDIO_", "BEEOND_", "RETRY_SRUN_", "CUDA_", "OMP_")
_SCRUBBED = {"TMPDIR", "MASTER_ADDR", "MASTER_PORT", "TRAIN_CMD", "LOCAL_RANK", "RANK"}


class ScriptResult(NamedTuple):
    """What one script run returned, with the fakes' recorded calls."""

    rc: int
    stdout: str
    stderr: str
    calls: list[list[str]]


RunScript = Callable[..., ScriptResult]


@pytest.fixture
def fake_log(tmp_path: pathlib.Path) -> pathlib.Path:
    """Where the fakes record their calls (SHARDIO_FAKE_LOG)."""
    return tmp_path / "fake-calls.log"


@pytest.fixture
def recorded_calls(fake_log: pathlib.Path) -> Callable[[], list[list[str]]]:
    """``recorded_calls()``: the fakes' calls so far."""
    return lambda: read_calls(fake_log)


@pytest.fixture
def run_script(tmp_path: pathlib.Path, fake_log: pathlib.Path) -> RunScript:
    """``run_script(argv, env=None, timeout=60)`` -> ScriptResult.

    Runs argv with the fakes, then this venv's bin (the real ``shardio``), then the system
    PATH; ``env`` entries are added to a scrubbed copy of this environment.
    """

    def run(
        argv: list[str | os.PathLike[str]],
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> ScriptResult:
        full = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(_SCRUBBED_PREFIXES) and k not in _SCRUBBED
        }
        full["PATH"] = os.pathsep.join([JOB_FAKES, str(VENV_BIN), full.get("PATH", "")])
        full["SHARDIO_FAKE_LOG"] = str(fake_log)
        full["TMPDIR"] = str(tmp_path)
        if env:
            full.update(env)
        proc = subprocess.run(
            [os.fspath(a) for a in argv],
            capture_output=True,
            text=True,
            env=full,
            cwd=tmp_path,
            timeout=timeout,
            check=False,
        )
        return ScriptResult(proc.returncode, proc.stdout, proc.stderr, read_calls(fake_log))

    return run


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A packed dataset of 12 small files in 4 tar shards. Read-only: copy it to damage it."""
    root = tmp_path_factory.mktemp("tiny")
    src = root / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(6):
            payload = f"{cls}-{i}-".encode() * (300 + 97 * i)
            (src / cls / f"{cls}{i:02d}.bin").write_bytes(payload)
    dst = root / "tiny-ds"
    result = pack(str(src), str(dst), PackOptions(shard_size_bytes=16 * 1024, workers=1))
    assert result.num_shards >= 3, result
    return dst


@pytest.fixture(scope="session")
def tiny_source_files(tiny_dataset: pathlib.Path) -> list[bytes]:
    """The payloads packed into ``tiny_dataset``, sorted."""
    return sorted(p.read_bytes() for p in (tiny_dataset.parent / "src").rglob("*.bin"))
