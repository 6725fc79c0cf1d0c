"""``shardio ls``: list a dataset's sample keys, or the original paths of its files."""

from __future__ import annotations

import argparse
import sys

from shardio.cli.common import EXIT_OK

__all__ = ["HELP", "add_arguments", "run"]


HELP = "list sample keys"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio ls``."""
    parser.add_argument("dst")
    parser.add_argument("--paths", action="store_true", help="list original file paths instead")


def run(args: argparse.Namespace) -> int:
    """Run ``shardio ls``: one sample key (or member path) a line, as bytes."""
    from shardio.read.reader import ShardReader

    with ShardReader(args.dst) as ds:
        if sys.stdout is None:  # started with fd 1 closed: nobody to list to
            return EXIT_OK
        out = sys.stdout.buffer
        index = ds.index
        if args.paths:
            index.check_all()  # member records are read below without a per-sample check
            for m in range(len(index.members)):
                path = index.member_path(m)
                if path:
                    out.write(path + b"\n")
        else:
            for s in range(len(index)):
                out.write(index.key(s).encode("ascii") + b"\n")
    out.flush()
    return EXIT_OK
