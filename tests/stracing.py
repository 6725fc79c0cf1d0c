"""Run a Python child under strace and hand back its log and the JSON line it printed last:
the one harness of the tests that count system calls."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest

STRACE = "/usr/bin/strace"


def run_traced(
    args: Sequence[str],
    *,
    log: pathlib.Path,
    traced: str,
    string_limit: int = 256,
    timeout: float = 120,
) -> tuple[str, Any]:
    """Run ``python *args`` under ``strace -f -y`` tracing ``traced`` calls.

    Returns:
        (the strace log, the JSON value of the child's last stdout line).

    Skips the test where ptrace is not allowed; fails it when the child fails.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    # -y prints the path behind each descriptor, so fstat(fd) calls count too.
    strace = [STRACE, "-f", "-y", "-s", str(string_limit), "-e", f"trace={traced}", "-o", str(log)]
    proc = subprocess.run(
        [*strace, sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0 and "ptrace" in proc.stderr.lower():
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return log.read_text(errors="replace"), json.loads(proc.stdout.strip().splitlines()[-1])
