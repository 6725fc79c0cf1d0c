"""The ``shardio`` command: its global options, its commands (one module each), one-line errors.

A ShardioError (a user's mistake or a damaged dataset) becomes one line on stderr and a
non-zero exit, never a traceback; any other exception (a bug) becomes one "internal error"
line (the traceback with -v). A reader that closes the pipe (``shardio ls DS | head``) ends
the command quietly. Output never fails on a file name that the locale cannot encode.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn, Protocol

from shardio._version import __version__
from shardio.cli import (
    audit,
    bench,
    checkpoint,
    inspect,
    ls,
    merge,
    pack,
    parity,
    stage,
    topo,
    unpack,
    verify,
)
from shardio.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    make_streams_safe,
    print_error,
    silence_stdout,
    stdout_is_closed,
)
from shardio.errors import ShardioError, UsageError

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


class Command(Protocol):
    """What a command module provides (mypy checks each module in COMMANDS against it):
    ``HELP`` (its line in ``shardio --help``), optionally ``DESCRIPTION`` and ``EPILOG``
    (around its own ``--help``), its arguments and its run."""

    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's arguments and their help to its parser."""

    def run(self, args: argparse.Namespace) -> int:
        """Run the command on its parsed arguments; return the exit code."""


# Every command, in the order `shardio --help` lists them: each module says what it is
# (HELP, DESCRIPTION, EPILOG), adds its arguments (add_arguments) and runs (run). Each
# defers its library imports to run(), so that importing them all keeps start-up fast (a
# login node, a job prologue).
COMMANDS: dict[str, Command] = {
    "pack": pack,
    "merge": merge,
    "verify": verify,
    "inspect": inspect,
    "ls": ls,
    "stage": stage,
    "parity": parity,
    "checkpoint": checkpoint,
    "audit": audit,
    "unpack": unpack,
    "topo": topo,
    "bench": bench,
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (what is wrong, where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        top, _, command = self.prog.partition(" ")  # "shardio pack" for a subcommand
        where = f"{command}: " if command else ""
        self.exit(EXIT_USAGE, f"{top}: error: {where}{message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``shardio`` parser: the global options, then every command's subparser."""
    parser = _Parser(
        prog="shardio",
        description="Pack small files into checksummed shards and verify them.",
    )
    parser.add_argument("--version", action="version", version=f"shardio {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is done")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(
            sub.add_parser(
                name,
                help=command.HELP,
                description=getattr(command, "DESCRIPTION", None),
                epilog=getattr(command, "EPILOG", None),
            )
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    make_streams_safe()
    args = argparse.Namespace(verbose=False)  # what the error lines see if parsing fails
    try:
        args = build_parser().parse_args(argv)
        return _run(args)
    except (Exception, KeyboardInterrupt) as exc:
        return _error_exit(exc, args, program=argv is None)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="shardio: %(levelname)s: %(message)s",
    )
    code = COMMANDS[args.command].run(args)
    if sys.stdout is not None:  # None when started with fd 1 closed
        sys.stdout.flush()  # a closed pipe must fail here, not at interpreter exit
    return code


def _error_exit(exc: BaseException, args: argparse.Namespace, *, program: bool) -> int:
    """Say what ended the command in one line on stderr; return its exit code."""
    if isinstance(exc, BrokenPipeError) and stdout_is_closed():
        # `shardio ls DS | head`: the reader has all it wants. A command that knew its
        # outcome before printing (a damaged verify) keeps it.
        silence_stdout()
        return int(getattr(args, "exit_code", EXIT_OK))
    if isinstance(exc, UsageError):
        print_error(f"shardio: error: {exc}")
        return EXIT_USAGE
    if isinstance(exc, ShardioError):
        print_error(f"shardio: error: {exc}")
        return EXIT_FAIL
    if isinstance(exc, OSError):
        where = f": {os.fsdecode(exc.filename)}" if isinstance(exc.filename, str | bytes) else ""
        print_error(f"shardio: error: {exc.strerror or exc}{where}")
        return EXIT_FAIL
    if isinstance(exc, KeyboardInterrupt):
        if program:  # the program itself, about to exit: a second Ctrl-C must not end it
            with contextlib.suppress(ValueError):  # in a traceback (ValueError: not the
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # main thread)
        print_error("shardio: interrupted")
        return 130
    # The last resort: a bug must not end in a bare traceback.
    if args.verbose:
        traceback.print_exception(exc, file=sys.stderr)
    hint = "" if args.verbose else "rerun with -v for the traceback; "
    print_error(f"shardio: internal error: {type(exc).__name__}: {exc} ({hint}please report it)")
    return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
