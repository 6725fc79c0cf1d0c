"""What every command shares: exit codes, argument types and options, SLURM-aware defaults,
``I/N`` parsing, and output streams that cannot fail on a file name or a closed pipe."""

from __future__ import annotations

import argparse
import io
import os
import re
import select
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from shardio._env import parse_env_int, parse_tasks_per_node, shown_value
from shardio._pool import MAX_WORKERS, check_workers, default_workers
from shardio.errors import UsageError

# What add_subparsers returns (a string: argparse's class is generic only to type checkers),
# for a command with actions of its own (checkpoint ls|verify|latest).
Subparsers: TypeAlias = "argparse._SubParsersAction[Any]"

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_DEGRADED",
    "EXIT_FAIL",
    "EXIT_OK",
    "EXIT_REPAIRED",
    "EXIT_USAGE",
    "Subparsers",
    "add_no_progress",
    "add_whole_number",
    "add_workers",
    "default_workers",
    "env_node_part",
    "env_ranks_per_node",
    "make_streams_safe",
    "one_line",
    "parse_part",
    "parse_workers",
    "print_error",
    "seconds_arg",
    "silence_stdout",
    "stdout_is_closed",
    "whole_number",
    "workers_of",
]

# 0 done (a dataset intact); 1 failed; 2 usage; 3 damage is left (a dataset's bytes, or a
# staged copy whose source is bad too); 4 `verify --repair` fixed everything it found;
# 5 a staging area is degraded: copies missing, damaged or stale, but the source they fall
# back to is intact (training works, reading from the parallel filesystem).
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_DAMAGED = 0, 1, 2, 3
EXIT_REPAIRED, EXIT_DEGRADED = 4, 5


def workers_of(args: argparse.Namespace) -> int:
    """``--workers`` as given, else the CPUs of this job (:func:`default_workers`)."""
    return int(args.workers) if args.workers is not None else default_workers()


def whole_number(option: str, *, digits: int = 9) -> Callable[[str], int]:
    """An argparse type for a count, seed or epoch option: ASCII digits only, at most
    ``digits`` of them (``int()`` also takes "٣", " 1", "+1", "1_0" and 5,000 digits).

    The range is left to the library's own check, which names the option's meaning.
    """
    pattern = re.compile(rf"0|[1-9][0-9]{{0,{digits - 1}}}")

    def parse(text: str) -> int:
        if pattern.fullmatch(text) is None:
            raise argparse.ArgumentTypeError(
                f"{option}={shown_value(text)} is not a whole number: expected at most "
                f"{digits} ASCII digits (no sign, space or leading zero)"
            )
        return int(text)

    return parse


def add_whole_number(
    parser: argparse.ArgumentParser,
    option: str,
    default: int | None,
    help_text: str,
    *,
    digits: int = 9,
    metavar: str | None = None,
) -> None:
    """``option N``: a count, seed or epoch, checked by :func:`whole_number`."""
    parser.add_argument(
        option,
        type=whole_number(option, digits=digits),
        default=default,
        metavar=metavar,
        help=help_text,
    )


def parse_workers(text: str) -> int:
    """The argparse type of ``--workers``: ASCII digits only (``int`` would take ``٣`` and
    ``1_0``), from 1 to the worker pool's cap.

    Raises:
        argparse.ArgumentTypeError: anything else, in one line that shows the value.
    """
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(
            f"invalid value {shown_value(text)}: give a number of processes from 1 to {MAX_WORKERS}"
        )
    if len(text.lstrip("0")) > len(str(MAX_WORKERS)):  # int() of 5,000 digits would fail
        raise argparse.ArgumentTypeError(
            f"must be between 1 and {MAX_WORKERS}, got {shown_value(text)}"
        )
    try:
        return check_workers(int(text), what="value")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


_SECONDS = re.compile(r"(0|[1-9][0-9]{0,4})(\.[0-9]{1,6})?")


def seconds_arg(option: str) -> Callable[[str], float]:
    """An argparse type for a deadline in seconds: ASCII digits with an optional fraction
    ("5", "0.5"), at most a day (0: none); no sign, exponent, "nan" or "inf".

    The result goes through :func:`shardio.read.timeouts.check_read_timeout` too.
    """

    def parse(text: str) -> float:
        from shardio.read.timeouts import check_read_timeout

        if _SECONDS.fullmatch(text) is None:
            raise argparse.ArgumentTypeError(
                f"{option}={text[:40]!r} is not a number of seconds (such as 5 or 0.5)"
            )
        try:
            seconds = check_read_timeout(float(text), option)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return float(seconds or 0.0)

    return parse


def add_workers(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--workers N``: processes, checked by :func:`parse_workers` (None: the default)."""
    parser.add_argument("--workers", type=parse_workers, default=None, help=help_text)


def add_no_progress(parser: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """``--no-progress``: draw no progress bar (a log or a script reads the output)."""
    parser.add_argument("--no-progress", action="store_true", help=help_text)


def _rank_of(env: Mapping[str, str], rank_name: str, world_name: str) -> tuple[int, int]:
    rank = parse_env_int(rank_name, env[rank_name])
    world = parse_env_int(world_name, env[world_name], minimum=1)
    if rank >= world:
        raise UsageError(f"{rank_name}={rank} is not below {world_name}={world}")
    return rank, world


def env_node_part(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """This node and the job's nodes, from ``SLURM_NODEID``/``SLURM_NNODES`` (``--node
    auto``); ``(0, 1)`` when neither is set (not under SLURM: one node).

    Raises:
        UsageError: only one is set, a value is malformed, or the node is not below the
            node count.
    """
    env = os.environ if environ is None else environ
    have = [name for name in ("SLURM_NODEID", "SLURM_NNODES") if name in env]
    if not have:
        return 0, 1
    if len(have) == 1:
        raise UsageError(f"--node auto needs SLURM_NODEID and SLURM_NNODES; only {have[0]} is set")
    return _rank_of(env, "SLURM_NODEID", "SLURM_NNODES")


def env_ranks_per_node(environ: Mapping[str, str] | None = None) -> int:
    """Ranks per node from ``SLURM_NTASKS_PER_NODE`` (``"8"``, or SLURM's ``"8(x4)"``);
    1 when it is not set.

    Raises:
        UsageError: malformed, or nodes run different numbers of tasks (``"4,2"``).
    """
    env = os.environ if environ is None else environ
    value = env.get("SLURM_NTASKS_PER_NODE")
    if value is None:
        return 1
    count = parse_tasks_per_node("SLURM_NTASKS_PER_NODE", value)
    if count is None:
        raise UsageError(
            f"SLURM_NTASKS_PER_NODE={value}: nodes run different numbers of tasks; "
            "give --ranks-per-node"
        )
    return count


def parse_part(
    text: str, environ: Mapping[str, str] | None = None, *, option: str = "--part"
) -> tuple[int, int]:
    """Parse ``--part I/N`` (0-based I) or ``auto`` (SLURM_PROCID/SLURM_NTASKS)."""
    env = os.environ if environ is None else environ
    if text == "auto":
        if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
            raise UsageError(f"{option} auto needs SLURM_PROCID and SLURM_NTASKS (run under srun)")
        return _rank_of(env, "SLURM_PROCID", "SLURM_NTASKS")
    head, sep, tail = text.partition("/")
    try:
        part = parse_env_int(option, head), parse_env_int(option, tail, minimum=1)
    except UsageError:
        part = (-1, 0)
    if not sep or not 0 <= part[0] < part[1]:
        raise UsageError(
            f"invalid {option} {shown_value(text)}: use I/N with 0 <= I < N, e.g. 0/4, or auto"
        )
    return part


def make_streams_safe() -> None:
    """Let stdout and stderr print any text under any locale.

    A non-UTF-8 file name decodes to lone surrogates (``os.fsdecode``); under a strict
    ``en_US.UTF-8`` stdout printing one raises UnicodeEncodeError. ``backslashreplace``
    prints it as ``\\udce9`` instead, the same under every locale.
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


# Control characters (line breaks, terminal escape sequences) in a file name must not reach
# the terminal: they are shown escaped, as Python writes them in a repr.
_CONTROL = {c: repr(chr(c))[1:-1] for c in [*range(32), *range(127, 160)]}


def one_line(text: str) -> str:
    """``text`` with control characters escaped, so an error stays one visible line whatever
    file name it holds."""
    return text.translate(_CONTROL)


def print_error(line: str) -> None:
    """Write one line to stderr; a closed stderr is ignored (there is nobody to tell)."""
    try:
        sys.stderr.write(one_line(line) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def stdout_is_closed() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (``shardio ls | head``)."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        events = poller.poll(0)
    except (OSError, ValueError, AttributeError):
        return False  # not a real descriptor: a broken pipe cannot be stdout's
    return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in events)


def silence_stdout() -> None:
    """Point stdout at /dev/null, so the flush at interpreter exit cannot fail again.

    What the Python docs recommend for SIGPIPE: without it, the exit prints "Exception
    ignored ... BrokenPipeError" and the process ends with status 120.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
