"""What every command shares: exit codes, SLURM-aware defaults, ``I/N`` parsing, and
output streams that cannot fail on a file name or a closed pipe."""

from __future__ import annotations

import io
import os
import select
import sys

from shardio.errors import UsageError

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_DEGRADED",
    "EXIT_FAIL",
    "EXIT_OK",
    "EXIT_REPAIRED",
    "EXIT_USAGE",
    "default_workers",
    "make_streams_safe",
    "one_line",
    "parse_part",
    "print_error",
    "silence_stdout",
    "stdout_is_closed",
]

# 0 done (a dataset intact); 1 failed; 2 usage; 3 damage is left (a dataset's bytes, or a
# staged copy whose source is bad too); 4 `verify --repair` fixed everything it found;
# 5 a staging area is degraded: copies missing, damaged or stale, but the source they fall
# back to is intact (training works, reading from the parallel filesystem).
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_DAMAGED = 0, 1, 2, 3
EXIT_REPAIRED, EXIT_DEGRADED = 4, 5


def default_workers(environ: os._Environ[str] | dict[str, str] | None = None) -> int:
    """CPUs this job may use: SLURM's allocation first, then the affinity mask."""
    env = os.environ if environ is None else environ
    for var in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, len(os.sched_getaffinity(0)))


def parse_part(
    text: str, environ: dict[str, str] | None = None, *, option: str = "--part"
) -> tuple[int, int]:
    """Parse ``--part I/N`` (0-based I) or ``auto`` (SLURM_PROCID/SLURM_NTASKS)."""
    env = dict(os.environ) if environ is None else environ
    if text == "auto":
        if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
            raise UsageError("--part auto needs SLURM_PROCID and SLURM_NTASKS (run under srun)")
        text = f"{env['SLURM_PROCID']}/{env['SLURM_NTASKS']}"
    head, sep, tail = text.partition("/")
    if not sep or not head.isdigit() or not tail.isdigit() or not 0 <= int(head) < int(tail):
        raise UsageError(f"invalid {option} {text!r}: use I/N with 0 <= I < N, e.g. 0/4, or auto")
    return int(head), int(tail)


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
