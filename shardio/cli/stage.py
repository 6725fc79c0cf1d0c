"""``shardio stage``: stage this node's shards to node-local storage (job prologue)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from shardio.cli.common import EXIT_OK, parse_part
from shardio.errors import UsageError
from shardio.order import OrderSpec, default_order
from shardio.units import format_duration, format_size, parse_size

__all__ = ["cmd_stage", "default_stage_dir", "order_spec_of"]


def default_stage_dir(src: str, environ: Mapping[str, str] | None = None) -> str:
    """The job's private node-local staging area for ``src`` (see
    shardio.cache.default_stage_dir), from this process's environment by default."""
    from shardio.cache import default_stage_dir as private_stage_dir

    return private_stage_dir(src, os.environ if environ is None else environ)


def _leading_int(text: str) -> int | None:
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    if not digits:
        return None
    return int(digits) if len(digits) <= 18 else 10**18  # too many nodes/ranks: refused later


def order_spec_of(args: argparse.Namespace, env: Mapping[str, str]) -> OrderSpec:
    """The order spec of the command line: ``--order SPEC``, else ``$SHARDIO_ORDER`` (what a
    job script sets once for its stage step and its training), else the defaults of
    ``--mode`` (ShardDataset's); ``--seed`` and ``--window-shards`` override their fields."""
    base = OrderSpec(order=default_order(args.mode))
    text = args.order if args.order is not None else env.get("SHARDIO_ORDER", "")
    spec = OrderSpec.parse(text, base)
    if args.seed is not None:
        spec = spec.with_(seed=args.seed)
    if args.window_shards is not None:
        spec = spec.with_(window_shards=args.window_shards)
    return spec


def cmd_stage(args: argparse.Namespace) -> int:
    from shardio.cache import StageOptions, clean_stage, stage_dataset
    from shardio.cli.progressbar import ProgressBar

    if args.clean:
        if len(args.paths) != 1:
            raise UsageError("stage --clean takes one path: the staging area (DEST)")
        removed = clean_stage(args.paths[0])
        print(f"removed {removed} staged shard(s) from {args.paths[0]}")
        return EXIT_OK
    if len(args.paths) > 2:
        raise UsageError("stage takes SRC and an optional DEST")
    src = args.paths[0]
    env = os.environ
    if args.node == "auto":
        node = _leading_int(env.get("SLURM_NODEID", "")) or 0
        nodes = _leading_int(env.get("SLURM_NNODES", "")) or 1
    else:
        node, nodes = parse_part(args.node, option="--node")
    ranks = args.ranks_per_node
    if ranks is None:
        ranks = _leading_int(env.get("SLURM_NTASKS_PER_NODE", "")) or 1
    options = StageOptions(
        node=node,
        num_nodes=nodes,
        ranks_per_node=ranks,
        spec=order_spec_of(args, env),
        epoch=args.epoch,
        ahead=args.ahead,
        streams=args.streams,
        capacity_bytes=parse_size(args.capacity) if args.capacity else None,
        durable=args.fsync,
    )
    dest = args.paths[1] if len(args.paths) == 2 else default_stage_dir(src, env)
    bar = None if args.no_progress else ProgressBar("staging", unit="shards")
    result = stage_dataset(src, dest, options, progress=bar)
    rate = result.bytes_copied / result.seconds if result.seconds > 0 else 0.0
    print(
        f"staged node {node}/{nodes}: {result.shards_needed - len(result.from_source):,} of "
        f"{result.shards_needed:,} shards ({format_size(result.bytes_staged)}) at {dest} in "
        f"{format_duration(result.seconds)}: copied {result.copied} "
        f"({format_size(result.bytes_copied)}, {format_size(rate)}/s), already staged and "
        f"verified {result.present}, replaced {result.replaced}, every copy verified (xxh3-128)"
    )
    print(f"for order {options.spec}, epoch {options.epoch} (training must use the same)")
    if result.from_source:
        shown = ", ".join(result.from_source[:3]) + (", ..." if len(result.from_source) > 3 else "")
        print(
            f"{len(result.from_source)} shard(s) do not fit --capacity and will be read from "
            f"{src}: {shown}"
        )
    if result.evicted:
        print(f"evicted {len(result.evicted)} shard(s) not needed now to make room")
    print(f"read it with ShardDataset({src!r}, cache={dest!r}) or ShardDataset({dest!r})")
    return EXIT_OK
