"""``shardio inspect``: summarise a dataset: samples, shards, labels, parity, striping and
how it would be read here; or the shuffle quality of an order of it (``--order``,
``--orders``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardio.cli.common import EXIT_OK, add_whole_number
from shardio.cli.pack_text import label_map_text
from shardio.errors import UsageError
from shardio.units import format_size

__all__ = ["HELP", "add_arguments", "run"]


HELP = "summarise a dataset"
EPILOG = (
    "With --order or --orders, inspect measures the order instead of summarising the "
    "dataset: each batch's label entropy over the dataset's (1.00: as mixed as the dataset), "
    "distinct shards per batch and per window of 8 batches, shard switches per batch, the "
    "correlation rho of delivery order with storage order (1: sequential, about 0: "
    "shuffled), and the memory the order holds. The order is a pure function of the spec, "
    "the seed and the epoch, so this is what training will read; an epoch of more than "
    "2,000 batches is measured on 2,000 of them."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio inspect``."""
    parser.add_argument("dst")
    parser.add_argument("--json", action="store_true")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--order",
        metavar="SPEC",
        default=None,
        help="measure this order: a name (random, shard-local, sequential) or key=value "
        "pairs such as order=shard-local,window=8,seed=1 (as ShardDataset's order=)",
    )
    which.add_argument(
        "--orders",
        action="store_true",
        help="compare random, shard-local (window 4), sequential and random with "
        "partition=node side by side",
    )
    add_whole_number(parser, "--batch-size", None, "samples per batch (default 32)", metavar="N")
    add_whole_number(
        parser, "--epoch", None, "the epoch to measure (default 0)", digits=19, metavar="E"
    )
    add_whole_number(
        parser,
        "--nodes",
        None,
        "nodes of a partition=node or rotating order (default 4, or the shards if fewer)",
        digits=7,
        metavar="N",
    )


_STRIPING_FS = ("lustre", "beegfs")  # the filesystems whose layout shardio sets and reads


def _exact_size(size_bytes: int) -> str:
    """``4 MiB``, ``192 KiB``: a stripe size exactly (they are multiples of 64 KiB)."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if size_bytes % unit == 0:
            return f"{size_bytes // unit} {name}"
    return f"{size_bytes:,} bytes"


def _stripe_words(stripe: str, commands: Any) -> str:
    """``stripe count 8, stripe size 4 MiB`` for the recorded ``8x4MiB``."""
    from shardio.storage.stripe_spec import StripeSpec, parse_stripe

    try:
        spec = parse_stripe(stripe)
    except UsageError:
        return f"stripe {stripe}"
    if not isinstance(spec, StripeSpec):  # "pfl": its components are in the command run
        argv = commands[0] if isinstance(commands, list) and len(commands) == 1 else None
        if isinstance(argv, list) and len(argv) > 3 and all(isinstance(a, str) for a in argv):
            return f"progressive file layout ({' '.join(argv[2:-1])})"  # no lfs, setstripe, DIR
        return "progressive file layout"
    count = "-1 (all OSTs)" if spec.count == -1 else str(spec.count)
    return f"stripe count {count}, stripe size {_exact_size(spec.size_bytes)}"


def _pack_striping(layout: dict[str, Any]) -> str:
    """What the manifest recorded about striping when the dataset was packed, in words.

    Lenient: a record this shardio would not write (an older or hand-made manifest) is
    shown as far as it can be read, never an error.
    """
    if not layout:
        return "not recorded"
    fs_type, action = layout.get("fs_type"), layout.get("action")
    stripe, message = layout.get("stripe"), layout.get("message")
    where = fs_type if isinstance(fs_type, str) and fs_type else "unknown filesystem"
    if action == "applied" and isinstance(stripe, str):
        return f"{where}, {_stripe_words(stripe, layout.get('commands'))} (set by shardio)"
    if action == "failed":
        why = f" ({message})" if isinstance(message, str) and message else ""
        return f"{where}, the filesystem's default layout: shardio could not set one{why}"
    if action == "none":
        return f"{where}, the directory's own layout (striping turned off with --stripe none)"
    if action == "skipped":
        return f"{where}, no striping"
    if isinstance(message, str) and message:
        return f"{where}: {message}"
    return f"{where}, recorded in a form this shardio does not know (see inspect --json)"


def _run_order(args: argparse.Namespace) -> int:
    """``inspect --order SPEC`` or ``inspect --orders``."""
    from shardio.cli.order_text import comparison_text, report_text
    from shardio.order.quality import MAX_BATCH_SIZE, MAX_NODES
    from shardio.order.spec import OrderSpec
    from shardio.tools.shuffle import inspect_order, inspect_orders

    batch = 32 if args.batch_size is None else args.batch_size
    epoch = 0 if args.epoch is None else args.epoch
    if not 1 <= batch <= MAX_BATCH_SIZE:
        raise UsageError(f"--batch-size must be between 1 and {MAX_BATCH_SIZE:,}, got {batch:,}")
    if epoch >= 1 << 63:
        raise UsageError(f"--epoch must be below 2**63, got {epoch}")
    if args.nodes is not None and not 1 <= args.nodes <= MAX_NODES:
        raise UsageError(f"--nodes must be between 1 and {MAX_NODES:,}, got {args.nodes:,}")
    if args.orders:
        found = inspect_orders(args.dst, batch_size=batch, epoch=epoch, nodes=args.nodes)
        if args.json:
            print(json.dumps(found.to_json(), indent=1))
        else:
            print("\n".join(comparison_text(found, batch, epoch)))
        return EXIT_OK
    spec = OrderSpec.parse(args.order)
    report = inspect_order(args.dst, spec, batch_size=batch, epoch=epoch, nodes=args.nodes)
    if args.json:
        print(json.dumps({"path": args.dst, "order_quality": report.to_dict()}, indent=1))
    else:
        print("\n".join(report_text(report, batch)))
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Run ``shardio inspect``."""
    from shardio.tools.inspect import inspect_dataset

    if args.order is not None or args.orders:
        return _run_order(args)
    for option in ("batch_size", "epoch", "nodes"):
        if getattr(args, option) is not None:
            flag = "--" + option.replace("_", "-")
            raise UsageError(f"{flag} measures an order: give --order SPEC or --orders with it")

    found = inspect_dataset(args.dst)
    man, choice, fs_type = found.manifest, found.read_choice, found.read_choice.fs.name
    if args.json:
        print(json.dumps(found.to_json(), indent=1))
        return EXIT_OK
    files = man.num_members - (man.num_samples if man.classes is not None else 0)
    mean = man.data_bytes / files if files else 0
    print(f"dataset       {args.dst}")
    print(f"format        shardio v{man.format_version}, {man.shard_format} shards")
    print(
        f"samples       {man.num_samples:,} ({man.num_members:,} members, "
        f"extensions: {', '.join(found.extensions)})"
    )
    print(
        f"shards        {len(man.shards):,}, {format_size(man.total_bytes)} "
        f"(payload {format_size(man.data_bytes)}, mean file {format_size(mean)})"
    )
    if man.classes is not None:
        print(f"classes       {label_map_text(man.classes, man.label_layout, man.label_source)}")
    else:
        print("classes       none")
    if man.parity is not None:
        section = man.parity
        share = section.total_bytes / man.total_bytes if man.total_bytes else 0.0
        print(
            f"parity        {section.scheme} in {len(section.groups):,} groups, "
            f"{format_size(section.total_bytes)} ({share:.1%} of the shards): any "
            f"{section.m} lost or damaged files of a group rebuild"
        )
    else:
        print("parity        none (shardio parity add DST --parity K+M)")
    now = found.stripe_layout if fs_type in _STRIPING_FS else "no striping"
    now = now.replace("\n", "\n" + " " * 30)  # lfs getstripe may print several lines
    print(f"stripe layout at pack time:   {_pack_striping(dict(man.layout))}")
    print(f"              filesystem now: {fs_type}, {now}")
    print(f"filesystem    {choice.fs.describe()}")
    print(f"read strategy {choice.describe()}: {choice.strategy.describe()}")
    print(f"created by    {man.created_by}")
    return EXIT_OK
