"""``shardio pack``: pack a tree of files into shards and print the summary."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import TYPE_CHECKING

from shardio.cli.common import (
    EXIT_OK,
    add_no_progress,
    add_workers,
    parse_part,
    workers_of,
)
from shardio.cli.pack_text import calls_text, label_map_text, show_name, show_path
from shardio.units import format_duration, format_size, parse_size

if TYPE_CHECKING:
    from shardio.packing.run import PackResult

__all__ = ["HELP", "add_arguments", "run"]

_SKIPPED_SHOWN = 5  # skipped files listed in the pack summary; pack-report.json has all


HELP = "pack a tree of files into shards"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio pack``."""
    parser.add_argument("src", help="the tree to pack (e.g. imagenet/)")
    parser.add_argument("dst", help="the dataset directory to create")
    parser.add_argument("--format", dest="shard_format", choices=["tar", "hdf5"], default="tar")
    parser.add_argument("--shard-size", default="1GiB", help="target shard size (default 1GiB)")
    add_workers(parser, "processes, 1 to 4096 (default: the CPUs of this job, SLURM-aware)")
    parser.add_argument(
        "--labels",
        choices=["auto", "none"],
        default="auto",
        help="class labels from an ImageNet-style layout (default auto)",
    )
    pin = parser.add_mutually_exclusive_group()
    pin.add_argument(
        "--labels-from",
        default=None,
        metavar="DATASET",
        help="pin the label map to that of a packed dataset (e.g. the train split's)",
    )
    pin.add_argument(
        "--classes",
        default=None,
        metavar="FILE",
        help="pin the label map to FILE's class names, one per line (index = line - 1)",
    )
    parser.add_argument(
        "--stripe", default="auto", help="auto | none | pfl | COUNTxSIZE (e.g. 8x4MiB)"
    )
    parser.add_argument(
        "--fs-type", default=None, help="force the filesystem type (lustre, beegfs, ...)"
    )
    parser.add_argument("--part", default=None, help="pack part I/N of a multi-node pack, or auto")
    parser.add_argument(
        "--parity",
        default=None,
        metavar="K+M",
        help="also write M parity files per group of K shards (e.g. 10+2): any M lost or "
        "damaged shards of a group can be rebuilt (needs pyeclib)",
    )
    parser.add_argument("--strict", action="store_true", help="fail on files that would be skipped")
    parser.add_argument("--resume", action="store_true", help="finish an interrupted pack")
    parser.add_argument("--force", action="store_true", help="overwrite a dataset in DST")
    add_no_progress(parser, "no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``shardio pack``."""
    from shardio.cli.progressbar import ProgressBar
    from shardio.packing.run import PackOptions, pack

    part, num_parts = parse_part(args.part) if args.part else (0, 1)
    options = PackOptions(
        shard_format=args.shard_format,
        shard_size_bytes=parse_size(args.shard_size),
        workers=workers_of(args),
        labels=args.labels,
        labels_from=args.labels_from,
        classes_file=args.classes,
        stripe=args.stripe,
        fs_type=args.fs_type,
        strict=args.strict,
        resume=args.resume,
        force=args.force,
        part=part,
        num_parts=num_parts,
        parity=args.parity,
    )
    bar = None if args.no_progress else ProgressBar("packing")
    with bar or contextlib.nullcontext():  # an interrupted bar is erased
        result = pack(args.src, args.dst, options, progress=bar)
    rate = result.data_bytes / result.seconds if result.seconds > 0 else 0.0
    where = f"part {part}/{num_parts} of " if num_parts > 1 else ""
    if result.already_complete:
        print(
            f"checked {where}{args.dst}: {result.num_files:,} files "
            f"({format_size(result.data_bytes)}) in {result.num_samples:,} samples, "
            f"{result.num_shards:,} {options.shard_format} {_shards(result.num_shards)} "
            f"({format_size(result.total_bytes)}), in {format_duration(result.seconds)}"
        )
    else:
        print(
            f"packed {result.num_files:,} files ({format_size(result.data_bytes)}) into "
            f"{result.num_samples:,} samples in {result.num_shards:,} {options.shard_format} "
            f"{_shards(result.num_shards)} ({format_size(result.total_bytes)}) at "
            f"{where}{args.dst} in {format_duration(result.seconds)}: {format_size(rate)}/s, "
            f"{result.num_files / max(result.seconds, 1e-9):,.0f} files/s"
        )
    for warning in result.warnings:
        print(warning)
    if result.replaced:
        print(f"replaced the dataset that was in {args.dst}")
    if result.reused_shards and not result.already_complete:
        print(f"reused {result.reused_shards} verified shard(s) from the interrupted pack")
    print(f"labels: {_labels_text(result)}")
    print(f"layout: {result.layout.message}")
    whole = "; each part lists the whole tree" if num_parts > 1 else ""
    print(
        f"source calls: {calls_text(result.source_calls, whole)} for "
        f"{result.num_files:,} files packed"
    )
    if result.skipped:
        report = os.path.join(args.dst, "pack-report.json")  # "out/" gives "out/pack-report.json"
        print(f"skipped {len(result.skipped):,} file(s), listed in {report}:")
        for s in result.skipped[:_SKIPPED_SHOWN]:
            print(f"  {show_path(s.path)}: {s.reason}")
        if len(result.skipped) > _SKIPPED_SHOWN:
            print(f"  ... and {len(result.skipped) - _SKIPPED_SHOWN:,} more")
    if result.oversized:
        print(f"{len(result.oversized)} sample(s) larger than --shard-size got a shard each")
    parity = result.merged.manifest.parity if result.merged is not None else None
    if parity is not None:
        share = parity.total_bytes / max(1, result.total_bytes)
        print(
            f"parity: {parity.scheme}, {len(parity.groups):,} groups, "
            f"{format_size(parity.total_bytes)} ({share:.1%} of the shards)"
        )
    if num_parts > 1:
        print(f"when all {num_parts} parts are done, run: shardio merge {args.dst}")
    return EXIT_OK


def _shards(count: int) -> str:
    """``shard`` or ``shards``: "in 1 tar shard", "in 6 tar shards"."""
    return "shard" if count == 1 else "shards"


def _labels_text(result: PackResult) -> str:
    """``1,000 classes (split-class-dirs) from ...: 0 n01440764, ...`` or ``none (why)``."""
    if result.num_classes:
        text = label_map_text(result.classes, result.label_layout, result.label_source)
        empty = result.classes_without_files
        if empty:
            text += (
                f"; {len(empty):,} of them without files in this source (they keep their "
                f"index), e.g. {show_name(empty[0])}"
            )
        return text
    return f"none ({result.labels_note})" if result.labels_note else "none"
