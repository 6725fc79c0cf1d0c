"""``shardio parity add|drop``: give a packed dataset erasure-coded parity, or take it away."""

from __future__ import annotations

import argparse

from shardio.cli.common import EXIT_OK, add_workers, workers_of
from shardio.units import format_duration, format_size

__all__ = ["HELP", "add_arguments", "run"]


HELP = "add or drop erasure-coded parity (any M lost shards of a group rebuild)"
DESCRIPTION = (
    "Add parity to a packed dataset (M parity files per group of K shards, "
    "so that any M lost or damaged files of a group can be rebuilt by shardio verify "
    "--repair, shardio stage and a dataset's recovery=), or drop it. Both resume after a kill."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio parity``."""
    actions = parser.add_subparsers(dest="parity_action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="compute and add parity (needs pyeclib)")
    add.add_argument("dst", help="a packed dataset")
    add.add_argument(
        "--parity", required=True, metavar="K+M", help="K data shards and M parity per group"
    )
    add_workers(add, "processes, 1 to 4096 (default: the CPUs of this job, SLURM-aware)")
    drop = actions.add_parser("drop", help="remove the dataset's parity")
    drop.add_argument("dst", help="a packed dataset")


def run(args: argparse.Namespace) -> int:
    """Run ``shardio parity add|drop``."""
    from shardio.tools.parity import add_parity, drop_parity

    if args.parity_action == "add":
        result = add_parity(args.dst, args.parity, workers=workers_of(args))
        if result.already:
            print(f"{args.dst} already has parity {result.scheme}: nothing to do")
            return EXIT_OK
        rate = result.data_bytes / result.seconds if result.seconds > 0 else 0.0
        print(
            f"added parity {result.scheme} to {args.dst}: {result.groups:,} groups, "
            f"{result.files:,} files ({format_size(result.parity_bytes)}, "
            f"{result.overhead:.1%} of {format_size(result.data_bytes)} of shards) in "
            f"{format_duration(result.seconds)}, {format_size(rate)}/s"
        )
        return EXIT_OK
    result = drop_parity(args.dst)
    if result.already:
        print(f"{args.dst} has no parity: nothing to do")
        return EXIT_OK
    print(
        f"dropped parity {result.scheme or '(an interrupted add)'} from {args.dst}: removed "
        f"{result.files:,} files ({format_size(result.parity_bytes)})"
    )
    return EXIT_OK
