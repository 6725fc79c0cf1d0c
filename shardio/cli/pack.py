"""``shardio pack`` and ``shardio merge``: build the options, run, print the summary."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import TYPE_CHECKING

from shardio.cli.common import EXIT_OK, default_workers, one_line, parse_part
from shardio.format.spec import CLASSES_SHOWN as _CLASSES_SHOWN
from shardio.units import format_duration, format_size, parse_size

if TYPE_CHECKING:
    from shardio.format.label_source import LabelSource
    from shardio.packing.calls import SourceCalls
    from shardio.packing.run import PackResult

__all__ = ["cmd_merge", "cmd_pack", "label_map_text"]

_SKIPPED_SHOWN = 5  # skipped files listed in the pack summary; pack-report.json has all


def cmd_pack(args: argparse.Namespace) -> int:
    from shardio.cli.progressbar import ProgressBar
    from shardio.packing.run import PackOptions, pack

    part, num_parts = parse_part(args.part) if args.part else (0, 1)
    options = PackOptions(
        shard_format=args.shard_format,
        shard_size_bytes=parse_size(args.shard_size),
        workers=args.workers if args.workers is not None else default_workers(),
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
            f"{result.num_shards:,} {options.shard_format} shards "
            f"({format_size(result.total_bytes)}), in {format_duration(result.seconds)}"
        )
    else:
        print(
            f"packed {result.num_files:,} files ({format_size(result.data_bytes)}) into "
            f"{result.num_samples:,} samples in {result.num_shards:,} {options.shard_format} "
            f"shards ({format_size(result.total_bytes)}) at {where}{args.dst} in "
            f"{format_duration(result.seconds)}: {format_size(rate)}/s, "
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
        f"source calls: {_calls_text(result.source_calls, whole)} for "
        f"{result.num_files:,} files packed"
    )
    if result.skipped:
        print(f"skipped {len(result.skipped):,} file(s), listed in {args.dst}/pack-report.json:")
        for s in result.skipped[:_SKIPPED_SHOWN]:
            print(f"  {_show_path(s.path)}: {s.reason}")
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


def _labels_text(result: PackResult) -> str:
    """``1,000 classes (split-class-dirs) from ...: 0 n01440764, ...`` or ``none (why)``."""
    if result.num_classes:
        text = label_map_text(result.classes, result.label_layout, result.label_source)
        empty = result.classes_without_files
        if empty:
            text += (
                f"; {len(empty):,} of them without files in this source (they keep their "
                f"index), e.g. {_show_name(empty[0])}"
            )
        return text
    return f"none ({result.labels_note})" if result.labels_note else "none"


def _origin_text(source: LabelSource | None, layout: str) -> str:
    if layout == "writer":
        return "given to ShardWriter"
    if source is None:
        return "from the class directories"
    if source.kind == "dataset":
        return f"pinned by --labels-from {source.path}"
    return f"pinned by --classes {source.path}"


def label_map_text(classes: tuple[str, ...], layout: str, source: LabelSource | None) -> str:
    """``4 classes (class-dirs) from the class directories: 0 cat, 1 dog, ...``."""
    shown = ", ".join(f"{i} {_show_name(n)}" for i, n in enumerate(classes[:_CLASSES_SHOWN]))
    more = ", ..." if len(classes) > _CLASSES_SHOWN else ""
    count = f"{len(classes):,} class{'es' if len(classes) != 1 else ''}"
    return f"{count} ({layout}) {_origin_text(source, layout)}: {shown}{more}"


def _show_name(name: str) -> str:
    """A class name for the terminal: undecodable bytes and control characters escaped."""
    try:
        raw = os.fsencode(name)
    except UnicodeError:  # a lone surrogate that no file name decodes to
        raw = name.encode("utf-8", "backslashreplace")
    return one_line(_show_path(raw))


def _calls_text(calls: SourceCalls, note: str = "") -> str:
    """``1,001 directory listings (1,001,000 entries), 1,000,000 stat calls, ...``."""
    return (
        f"{calls.dirs_listed:,} directory listings ({calls.entries_seen:,} entries{note}), "
        f"{calls.stat_calls:,} stat calls, {calls.opens:,} opens, {calls.fstat_calls:,} fstat"
    )


def _show_path(path: bytes) -> str:
    """A source path for the terminal: undecodable bytes as escapes, never an exception."""
    return path.decode("utf-8", "backslashreplace")


def cmd_merge(args: argparse.Namespace) -> int:
    from shardio.cli.progressbar import ProgressBar
    from shardio.packing.merge import merge_parts

    bar = None if args.no_progress else ProgressBar("merging", unit="shards")
    with bar or contextlib.nullcontext():  # an interrupted bar is erased
        workers = args.workers if args.workers is not None else default_workers()
        result = merge_parts(args.dst, progress=bar, workers=workers)
    man = result.manifest
    print(
        f"merged {result.num_parts} parts into {args.dst}: {man.num_samples:,} samples, "
        f"{len(man.shards):,} shards, {format_size(man.total_bytes)}"
    )
    if not man.options.get("writer"):  # ShardWriter parts read no source tree
        calls = _calls_text(result.source_calls)
        print(f"source calls of the {result.num_parts} part(s): {calls}")
    return EXIT_OK
