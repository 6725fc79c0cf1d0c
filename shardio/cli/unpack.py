"""``shardio unpack``: restore a dataset's original tree, byte for byte."""

from __future__ import annotations

import argparse
import contextlib

from shardio.cli.common import EXIT_OK, add_no_progress
from shardio.units import format_duration, format_size

__all__ = ["HELP", "add_arguments", "run"]


HELP = "restore the original tree, byte for byte"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio unpack``."""
    parser.add_argument("dst")
    parser.add_argument("out")
    add_no_progress(parser, "no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``shardio unpack``."""
    from shardio.cli.progressbar import ProgressBar
    from shardio.tools.unpack import unpack_dataset

    bar = None if args.no_progress else ProgressBar("unpacking")
    with bar or contextlib.nullcontext():  # an interrupted bar is erased
        result = unpack_dataset(args.dst, args.out, progress=bar)
    print(
        f"unpacked {result.files:,} files ({format_size(result.bytes)}) into {args.out} "
        f"in {format_duration(result.seconds)}"
    )
    return EXIT_OK
