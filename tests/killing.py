"""Run a command in a session of its own and SIGKILL the whole session, as SLURM's scancel
does (shared by the crash tests)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of a session."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` and wait until none is left (10 s at most)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.01)


def run_then_kill(
    argv: Sequence[str | os.PathLike[str]],
    until: Callable[[], bool],
    *,
    env: Mapping[str, str],
    timeout_s: float,
    poll_s: float = 0.0005,
) -> bool:
    """Run ``argv`` until ``until()`` holds, then SIGKILL its session (the command and its
    workers). Returns whether the command finished successfully before the kill."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(env),
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and not until():
            assert time.monotonic() < deadline, "the command neither progressed nor finished"
            time.sleep(poll_s)
    finally:
        kill_session(proc.pid)
        proc.wait()
    return proc.returncode == 0
