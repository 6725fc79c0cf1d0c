"""Ctrl-C during a multi-worker ``verify``, ``pack`` or ``verify --repair``.

A terminal's Ctrl-C is a SIGINT to the whole foreground process group: the command and its
worker processes. Each test runs the real CLI in a session of its own, slowed by a
``sitecustomize`` that sleeps in one system call (only in the processes the test names), waits
until that call has been reached (the work has started), sends SIGINT and checks what the
user sees: exactly ``shardio: interrupted`` on stderr, nothing on stdout, exit 130, no process
left behind, no temp file left, and a second run that completes.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pty
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from conftest import cli_env
from killing import kill_session, session_pids

from shardio.format.manifest import load_manifest
from shardio.storage.atomic import TEMP_MARK

TIMEOUT_S = 60.0
INTERRUPTED = "shardio: interrupted\n"

# Imported at start-up by every Python process of the command (the CLI, the forkserver and
# the workers it forks): slows os.<call> where asked, and marks the first call in each
# process with a file named by its pid.
SITECUSTOMIZE = r"""
import os, time

_call = os.environ.get("SHARDIO_TEST_SLOW_CALL")
_where = os.environ.get("SHARDIO_TEST_SLOW_WHERE", "workers")
_top = os.getpid() == os.getsid(0)  # the CLI leads its session; its workers do not
if _call and _top == (_where == "main"):
    _delay = float(os.environ["SHARDIO_TEST_SLOW_S"])
    _marks = os.environ["SHARDIO_TEST_SLOW_MARKS"]
    _real = getattr(os, _call)
    _state = []  # [whether this process is slowed], once decided at its first call

    def _slow(*args, **kwargs):
        if not _state:
            mark = os.path.join(_marks, str(os.getpid()))
            if _where == "first-worker":  # only the first worker to get here is slowed
                try:
                    os.close(os.open(os.path.join(_marks, "first"), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    mark = None
            if mark is not None:
                open(mark, "w").close()
            _state.append(mark is not None)
        if _state[0]:
            time.sleep(_delay)
        return _real(*args, **kwargs)

    setattr(os, _call, _slow)
"""


# The command as a terminal starts a foreground job: SIGINT at its default, whatever this
# process inherited (a shell without job control starts `cmd &` with SIGINT ignored, and an
# ignored signal stays ignored across exec: the command would rightly run on).
FOREGROUND = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def temp_files(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if TEMP_MARK in p.name)


def files_of(root: pathlib.Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Interrupted:
    """The outcome of one interrupted run."""

    def __init__(self, rc: int, stdout: str, stderr: str, left: list[int]) -> None:
        self.rc, self.stdout, self.stderr, self.left = rc, stdout, stderr, left

    def check(self) -> None:
        said = f"exit {self.rc}; stdout {self.stdout!r}; stderr {self.stderr!r}"
        assert "Traceback" not in self.stderr, said
        assert self.stderr == INTERRUPTED, said
        assert self.stdout == ""
        assert self.rc == 130
        assert not self.left, f"processes left behind: {self.left}"


def interrupt(
    tmp_path: pathlib.Path,
    *args: str | os.PathLike[str],
    call: str,
    where: str = "workers",
    delay_s: float = 0.2,
    at: str = "group",
    after_s: float = 0.0,
    tty: bool = False,
    signum: int = signal.SIGINT,
    again_after_s: float | None = None,
) -> Interrupted:
    """Run ``shardio ARGS`` with ``os.<call>`` slowed in ``where`` ("workers", the
    "first-worker" to make it, or "main");
    once a process there has reached it (and ``after_s`` later), send ``signum`` (SIGINT)
    ``at`` the process group ("group": a terminal's Ctrl-C), the command alone ("command":
    ``kill -INT PID``) or the slowed worker ("worker"). ``tty``:
    stderr is a terminal (a pty), so progress is drawn; the result holds what the terminal
    shows once the command has ended (see :func:`screen`). ``again_after_s``: a second
    signal that long after the first (an impatient user)."""
    site = tmp_path / "site"
    marks = tmp_path / "marks"
    site.mkdir(exist_ok=True)
    marks.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = cli_env(
        {
            "PYTHONPATH": path,
            "SHARDIO_TEST_SLOW_CALL": call,
            "SHARDIO_TEST_SLOW_WHERE": where,
            "SHARDIO_TEST_SLOW_S": str(delay_s),
            "SHARDIO_TEST_SLOW_MARKS": str(marks),
        }
    )
    master, slave = pty.openpty() if tty else (-1, -1)
    proc = subprocess.Popen(
        [sys.executable, "-c", FOREGROUND, "-m", "shardio", *map(os.fspath, args)],
        stdout=subprocess.PIPE,
        stderr=slave if tty else subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    if tty:
        os.close(slave)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not _reached(marks, proc.pid, where):
            assert proc.poll() is None, f"finished before the work started: {proc.stderr}"
            assert time.monotonic() < deadline, "the slowed call was never reached"
            time.sleep(0.005)
        time.sleep(after_s)
        for pause in [0.0] if again_after_s is None else [0.0, again_after_s]:
            time.sleep(pause)
            with contextlib.suppress(ProcessLookupError):  # it may be gone by the second
                if at == "group":
                    os.killpg(proc.pid, signum)
                elif at == "command":
                    os.kill(proc.pid, signum)
                else:
                    os.kill(min(_slowed(marks) - {proc.pid}), signum)
        proc.wait(timeout=TIMEOUT_S)  # reaped first: a worker watches for its death
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        deadline = time.monotonic() + 5  # the forkserver ends once the command has
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = session_pids(proc.pid)
        if tty:
            stderr = screen(_drain(master))
        return Interrupted(proc.returncode, stdout, stderr, left)
    finally:
        kill_session(proc.pid)
        proc.wait()
        if tty:
            os.close(master)


def _drain(master: int) -> str:
    """Everything written to the pty (every writer has closed it: read to EIO)."""
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: no writer is left
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def screen(raw: str) -> str:
    """What a terminal shows after ``raw``: ``\r`` returns to the line's start, ``ESC[K``
    erases to its end, text overwrites; the non-empty lines, each ending in a newline."""
    lines = []
    for text in raw.replace("\r\n", "\n").split("\n"):
        line: list[str] = []
        col = 0
        i = 0
        while i < len(text):
            if text.startswith("\033[K", i):
                del line[col:]
                i += 3
                continue
            char = text[i]
            i += 1
            if char == "\r":
                col = 0
                continue
            if col < len(line):
                line[col] = char
            else:
                line.append(char)
            col += 1
        if "".join(line).strip():
            lines.append("".join(line) + "\n")
    return "".join(lines)


def _slowed(marks: pathlib.Path) -> set[int]:
    return {int(name) for name in os.listdir(marks) if name.isdigit()}


def _reached(marks: pathlib.Path, top: int, where: str) -> bool:
    pids = _slowed(marks)
    return top in pids if where == "main" else bool(pids - {top})


# --------------------------------------------------------------------------- verify


@pytest.fixture
def dataset(packed_small) -> pathlib.Path:
    root: pathlib.Path = packed_small("tar", "256KiB", 1)[0]
    assert len(load_manifest(root / "manifest.json").shards) >= 20
    return root


@pytest.mark.parametrize("at", ["group", "command"], ids=["ctrl-c", "kill-int-of-the-command"])
def test_ctrl_c_during_verify_is_one_line(
    at: str, dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    result = interrupt(
        tmp_path, "verify", dataset, "--workers", "2", "--no-progress", call="preadv", at=at
    )
    result.check()


def test_ctrl_c_on_a_terminal_leaves_one_line(
    dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """On a terminal the progress bar is drawn in place: after Ctrl-C it is erased, so the
    terminal shows the one line, not the bar with "interrupted" glued to its end."""
    result = interrupt(
        tmp_path,
        "verify",
        dataset,
        "--workers",
        "2",
        call="preadv",
        where="first-worker",
        delay_s=30,
        after_s=1.0,  # the bar is redrawn every 0.25 s
        tty=True,
    )
    result.check()


def test_kill_9_of_verify_leaves_no_worker_behind(
    dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """kill -9 of verify alone (the OOM killer): its workers stop instead of waiting for
    work forever."""
    marks = tmp_path / "marks"
    result = interrupt(
        tmp_path, "verify", dataset, "--workers", "2", "--no-progress", call="preadv",
        where="first-worker", delay_s=30, at="command", signum=signal.SIGKILL,
    )  # fmt: skip
    assert result.rc == -signal.SIGKILL
    assert (marks / "first").exists()
    assert not result.left, f"processes left 5 s after the kill: {result.left}"


def test_a_verify_worker_killed_is_one_error_line(
    dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """kill -9 of a worker (the OOM killer): one line saying so, exit 1, no traceback."""
    result = interrupt(
        tmp_path, "verify", dataset, "--workers", "2", "--no-progress", call="preadv",
        where="first-worker", delay_s=30, at="worker", signum=signal.SIGKILL,
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr == (
        "shardio: error: a verify worker process died (killed by a signal or out of memory?) "
        f"before {dataset} was checked: run verify again\n"
    )
    assert result.rc == 1
    assert not result.left


def test_ctrl_c_while_a_worker_waits_for_work(
    dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """One worker is slowed in its first shard; the other checks every other shard and then
    waits for work that never comes: a SIGINT there printed that worker's traceback."""
    result = interrupt(
        tmp_path,
        "verify",
        dataset,
        "--workers",
        "2",
        "--no-progress",
        call="preadv",
        where="first-worker",
        delay_s=30,
        after_s=1.0,
    )
    result.check()


@pytest.mark.parametrize("gap_s", [0.0, 0.01, 0.1])
def test_two_ctrl_c_in_a_row_during_verify(
    gap_s: float, dataset: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A second Ctrl-C while the first is being handled once ended in an internal error
    ("release unlocked lock"), a forkserver traceback, or a hang."""
    result = interrupt(
        tmp_path, "verify", dataset, "--workers", "2", "--no-progress", call="preadv",
        again_after_s=gap_s,
    )  # fmt: skip
    result.check()


# --------------------------------------------------------------------------- pack


def test_ctrl_c_during_pack_leaves_it_resumable(
    small_tree: pathlib.Path, packed_small, tmp_path: pathlib.Path, run_cli
) -> None:
    reference = files_of(packed_small("tar", "256KiB", 1)[0])
    dst = tmp_path / "ds"
    argv = ("pack", small_tree, dst, "--shard-size", "256KiB", "--no-progress")
    result = interrupt(tmp_path, *argv, "--workers", "2", call="writev", again_after_s=0.01)
    result.check()
    assert not (dst / "manifest.json").exists()
    assert temp_files(dst) == [], "the shards being written were not cleaned up"

    rc, out, err = run_cli(*argv, "--workers", "2", "--resume")
    assert rc == 0, err
    assert out.startswith("packed 300 files"), out
    assert files_of(dst) == reference


# --------------------------------------------------------------------------- repair


@pytest.fixture
def damaged(dataset: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the dataset with three shards missing."""
    dst = tmp_path / "damaged"
    shutil.copytree(dataset, dst)
    for entry in load_manifest(dst / "manifest.json").shards[2:5]:
        (dst / entry.path).unlink()
    return dst


@pytest.mark.parametrize(
    ("call", "where"),
    [("preadv", "first-worker"), ("copy_file_range", "main")],
    ids=["while-verifying", "while-copying"],
)
def test_ctrl_c_during_repair_leaves_it_resumable(
    call: str, where: str, dataset: pathlib.Path, damaged: pathlib.Path, tmp_path: pathlib.Path,
    run_cli: Callable[..., tuple[int, str, str]],
) -> None:  # fmt: skip
    argv = ("verify", damaged, "--repair", "--source", dataset, "--no-progress")
    slow = {"delay_s": 30.0, "after_s": 1.0} if where == "first-worker" else {}
    result = interrupt(tmp_path, *argv, "--workers", "2", call=call, where=where, **slow)
    result.check()
    assert temp_files(damaged) == []

    rc, out, err = run_cli(*argv, "--workers", "2")
    assert rc == 4, err
    assert "REPAIRED" in out
    assert files_of(damaged) == files_of(dataset)
