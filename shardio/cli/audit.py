"""``shardio audit``: combine the ranks' exactly-once audit records of each epoch."""

from __future__ import annotations

import argparse
import json
import sys

from shardio.cli.common import EXIT_FAIL, EXIT_OK, add_whole_number
from shardio.errors import UsageError

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "run"]


HELP = "prove each epoch delivered every sample exactly once (from the ranks' records)"
DESCRIPTION = (
    "Combine the per-rank records that ds.loader(..., audit=DIR) writes at the end of each "
    "epoch (when torch.distributed is not initialised) and print one line per epoch: its "
    "samples, each exactly once, or what is missing or repeated."
)
EPILOG = "Exit status: 0 every epoch exact, 1 an epoch not exact or incomplete, 2 bad input."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio audit``."""
    parser.add_argument("dir", metavar="DIR", help="the audit directory the ranks wrote into")
    add_whole_number(parser, "--epoch", None, "this epoch only (default: every one)", metavar="N")
    parser.add_argument("--json", action="store_true", help="one JSON object per epoch")


def run(args: argparse.Namespace) -> int:
    """Run ``shardio audit``: one line per (dataset, epoch) found."""
    from dataclasses import asdict

    from shardio.read.epochaudit import combine, read_records

    found = read_records(args.dir)
    if args.epoch is not None:
        found = {k: v for k, v in found.items() if k[1] == args.epoch}
    if not found:
        which = f" of epoch {args.epoch}" if args.epoch is not None else ""
        raise UsageError(f"{args.dir} holds no audit records{which}")
    several = len({dataset for dataset, _ in found}) > 1
    status = EXIT_OK
    for (dataset, _), records in sorted(found.items()):
        verdict = combine(records)
        if not verdict.exact:
            status = EXIT_FAIL
        if args.json:
            print(json.dumps({"dataset_id": dataset, **asdict(verdict), "line": verdict.line()}))
        else:
            print(f"{dataset[:16]}: {verdict.line()}" if several else verdict.line())
    sys.stdout.flush()
    return status
