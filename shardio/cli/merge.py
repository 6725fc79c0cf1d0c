"""``shardio merge``: join the parts of a multi-node pack into one dataset."""

from __future__ import annotations

import argparse
import contextlib

from shardio.cli.common import EXIT_OK, add_no_progress, add_workers, workers_of
from shardio.cli.pack_text import calls_text
from shardio.units import format_size

__all__ = ["HELP", "add_arguments", "run"]


HELP = "join the parts of a multi-node pack"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio merge``."""
    parser.add_argument("dst")
    add_workers(parser, "processes computing parity, 1 to 4096 (default: the CPUs of this job)")
    add_no_progress(parser, "no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``shardio merge``."""
    from shardio.cli.progressbar import ProgressBar
    from shardio.packing.merge import merge_parts

    bar = None if args.no_progress else ProgressBar("merging", unit="shards")
    with bar or contextlib.nullcontext():  # an interrupted bar is erased
        result = merge_parts(args.dst, progress=bar, workers=workers_of(args))
    man = result.manifest
    print(
        f"merged {result.num_parts} parts into {args.dst}: {man.num_samples:,} samples, "
        f"{len(man.shards):,} shards, {format_size(man.total_bytes)}"
    )
    if not man.options.get("writer"):  # ShardWriter parts read no source tree
        calls = calls_text(result.source_calls)
        print(f"source calls of the {result.num_parts} part(s): {calls}")
    return EXIT_OK
