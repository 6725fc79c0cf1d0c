"""Run external commands (lfs, beegfs-ctl, ...) through one injectable runner.

Every call shardio makes to a filesystem tool goes through a :class:`CommandRunner`, a plain
callable ``(argv, *, timeout_s) -> CommandResult``. The default, :func:`run_command`, uses
:mod:`subprocess`; tests pass their own runner or put recording fakes first on ``PATH``.
A runner reports a non-zero exit in :attr:`CommandResult.returncode` and raises only when the
command could not run at all (not installed, timed out).
"""

from __future__ import annotations

import logging
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shardio._check import require_seconds
from shardio.errors import CommandNotFoundError, StorageError, UsageError

__all__ = ["CommandResult", "CommandRunner", "run_command"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    """The outcome of one external command that ran to completion.

    Attributes:
        argv: the command and its arguments, as run.
        returncode: the exit status; 0 means success.
        stdout: everything the command wrote to standard output, decoded as UTF-8.
        stderr: everything the command wrote to standard error, decoded as UTF-8.
    """

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def __post_init__(self) -> None:
        # Accept any sequence (a list is the common slip) but store a hashable tuple.
        object.__setattr__(self, "argv", tuple(self.argv))
        if not self.argv:
            raise UsageError("CommandResult.argv must name a command")

    @property
    def ok(self) -> bool:
        """Whether the command exited with status 0."""
        return self.returncode == 0

    @property
    def command_line(self) -> str:
        """The command as a shell-quoted line, for log and error messages."""
        return shlex.join(self.argv)


class CommandRunner(Protocol):
    """Run one external command and return its result.

    Implementations raise :class:`~shardio.errors.CommandNotFoundError` when the executable
    is not installed and :class:`~shardio.errors.StorageError` when it cannot be run or times
    out; a command that runs and fails is reported through ``returncode``, not raised.
    """

    def __call__(self, argv: Sequence[str], *, timeout_s: float = 60.0) -> CommandResult:
        """Run ``argv`` and wait at most ``timeout_s`` seconds for it to finish."""
        ...


def run_command(argv: Sequence[str], *, timeout_s: float = 60.0) -> CommandResult:
    """Run an external command with captured, text-decoded output (the default runner).

    Args:
        argv: the command and its arguments; ``argv[0]`` is looked up on ``PATH``.
        timeout_s: seconds to wait before the command is killed.

    Returns:
        The command's exit status and output, whatever the exit status.

    Raises:
        UsageError: ``argv`` is empty or ``timeout_s`` is not positive.
        CommandNotFoundError: ``argv[0]`` is not an executable on ``PATH``.
        StorageError: the command could not be started or ran past ``timeout_s``.
    """
    args = tuple(argv)
    if not args:
        raise UsageError("run_command needs a command to run, got an empty argv")
    timeout_s = require_seconds(timeout_s, "timeout_s", positive=True)
    name = args[0]
    logger.debug("running %s (timeout %.1fs)", shlex.join(args), timeout_s)
    try:
        completed = subprocess.run(
            args,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError as exc:
        raise CommandNotFoundError(f"{name} not found on PATH") from exc
    except subprocess.TimeoutExpired as exc:
        raise StorageError(f"{name} timed out after {timeout_s:g}s: {shlex.join(args)}") from exc
    except OSError as exc:
        # PermissionError (not executable), ENOEXEC and friends: it exists but cannot run.
        raise StorageError(f"cannot run {name}: {exc.strerror or exc}") from exc
    result = CommandResult(
        argv=args,
        returncode=completed.returncode,
        stdout=completed.stdout,
        stderr=completed.stderr,
    )
    logger.debug("%s exited with status %d", name, result.returncode)
    return result
