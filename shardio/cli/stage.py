"""``shardio stage``: stage this node's shards to node-local storage (job prologue)."""

from __future__ import annotations

import argparse
import errno
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from shardio.cli.common import (
    EXIT_OK,
    add_no_progress,
    add_whole_number,
    env_node_part,
    env_ranks_per_node,
    parse_part,
    seconds_arg,
)
from shardio.errors import StorageError, UsageError
from shardio.order import OrderSpec, default_order
from shardio.units import format_duration, format_size, parse_size

__all__ = ["HELP", "add_arguments", "default_stage_dir", "journal_dir_of", "order_spec_of", "run"]

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


HELP = "copy this node's shards to node-local storage, verified (job prologue)"
DESCRIPTION = (
    "Stage shards from SRC to DEST (default: the job's node-local scratch), "
    "in the order training first needs them. `shardio stage --clean DEST` removes them."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio stage``."""
    parser.add_argument("paths", nargs="+", metavar="SRC [DEST]")
    parser.add_argument(
        "--node",
        default="auto",
        help="I/N (0-based) or auto (SLURM_NODEID/NNODES); under SLURM the shares are dealt "
        "by host name (SLURM_STEP_NODELIST or SLURM_JOB_NODELIST), as training deals them",
    )
    add_whole_number(
        parser,
        "--ranks-per-node",
        None,
        "training ranks per node (default SLURM_NTASKS_PER_NODE or 1)",
    )
    parser.add_argument(
        "--order",
        default=None,
        metavar="SPEC",
        help="the order training uses: a name (random, shard-local, sequential) or "
        "key=value pairs such as order=random,seed=1,partition=node (default: "
        "$SHARDIO_ORDER, else ShardDataset's defaults for --mode)",
    )
    parser.add_argument(
        "--mode",
        choices=["map", "stream"],
        default="map",
        help="ShardDataset's mode, whose default order applies (map: random, stream: shard-local)",
    )
    add_whole_number(parser, "--seed", None, "override the spec's seed", digits=20)
    add_whole_number(parser, "--epoch", 0, "the epoch to stage for", digits=19)
    add_whole_number(
        parser,
        "--ahead",
        0,
        "also stage the shards of this many following epochs and evict the rest "
        "(a rotating order; see shardio.staging.EpochStager)",
    )
    add_whole_number(parser, "--window-shards", None, "override the spec's window")
    parser.add_argument(
        "--read-timeout",
        type=seconds_arg("--read-timeout"),
        default=None,
        metavar="S",
        help="abandon a shard whose copy stalls this many seconds (a dead data server) and "
        "stage the others (default: 120 on a network filesystem, none on a local one; 0: none)",
    )
    add_whole_number(parser, "--streams", 4, "parallel copy streams")
    parser.add_argument("--capacity", default=None, help="stage at most this much, e.g. 800GiB")
    parser.add_argument(
        "--clean",
        action="store_true",
        help="remove what shardio staged in DEST (epilogue); its repair journal is kept "
        "(see --keep-journal) and files shardio did not stage stay",
    )
    parser.add_argument(
        "--keep-journal",
        default=None,
        metavar="DIR",
        help="with --clean: move the repair journal here (default: $SLURM_SUBMIT_DIR, beside "
        "the job's log, else the current directory)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="DEST holds another dataset: remove what shardio staged there, then stage",
    )
    parser.add_argument(
        "--peers",
        default=None,
        metavar="LIST",
        help="other nodes' staging areas of this dataset, comma-separated paths or globs "
        "(e.g. '/beeond/area-*'): a shard this node lacks is copied from a peer (verified) "
        "before the source is read",
    )
    parser.add_argument(
        "--fsync", action="store_true", help="fsync every copy (survives a node crash; slower)"
    )
    add_no_progress(parser)


def default_stage_dir(src: str, environ: Mapping[str, str] | None = None) -> str:
    """The job's private node-local staging area for ``src`` (see
    shardio.staging.default_stage_dir), from this process's environment by default."""
    from shardio.staging import default_stage_dir as private_stage_dir

    return private_stage_dir(src, os.environ if environ is None else environ)


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


def journal_dir_of(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """Where ``stage --clean`` keeps the repair journal: ``--keep-journal DIR``, else the
    job's submit directory (``$SLURM_SUBMIT_DIR``, where SLURM writes the job's log), else
    the current directory."""
    chosen: str
    if args.keep_journal:
        chosen, what = str(args.keep_journal), "--keep-journal"
    elif env.get("SLURM_SUBMIT_DIR"):
        chosen, what = env["SLURM_SUBMIT_DIR"], "$SLURM_SUBMIT_DIR"
    else:
        chosen, what = os.getcwd(), "the current directory"
    if "\0" in chosen or not os.path.isdir(chosen):
        raise UsageError(
            f"{what} {chosen!r} is not a directory to keep the repair journal in: give "
            "--keep-journal DIR (nothing was removed)"
        )
    return chosen


def _clean(args: argparse.Namespace, clean_stage: Callable[..., Any]) -> int:
    if len(args.paths) != 1:
        raise UsageError("stage --clean takes one path: the staging area (DEST)")
    if args.force:
        raise UsageError("--force is for staging; --clean removes only what shardio staged")
    dest = args.paths[0]
    env = os.environ
    job = env.get("SLURM_JOB_ID") or None
    if job is not None and not _JOB_ID.fullmatch(job):
        job = None  # only a well-formed id goes into a file name
    result = clean_stage(dest, journal_dir=journal_dir_of(args, env), job=job)
    kept = f"; repair journal kept at {result.journal}" if result.journal else ""
    print(f"removed {result.removed} staged shard(s) from {dest}{kept}")
    left = result.left_line()
    if left is not None:
        print(left)
    if result.journal_error is not None:
        raise StorageError(
            errno.EIO,
            f"the repair journal stays in {dest}/.shardio-stage (copy it before the node's "
            f"disk is wiped): {result.journal_error}",
        )
    return EXIT_OK


def _evicted_line(count: int, options: Any) -> str:
    """What the eviction of a stage run did, and why."""
    if options.ahead > 0:
        last = options.epoch + options.ahead
        return (
            f"evicted {count} shard(s) staged here that epochs {options.epoch} to {last} do not "
            "need (--ahead)"
        )
    return (
        f"evicted {count} shard(s) not needed now to make room within --capacity "
        f"{format_size(options.capacity_bytes or 0)}"
    )


def _stage_timeout(src: str, given: float | None) -> float:
    """The copy deadline: ``--read-timeout``, else the default for SRC's filesystem."""
    from shardio.read.timeouts import resolve_read_timeout

    return resolve_read_timeout(src, given)


def _peers_of(text: str | None) -> tuple[str, ...]:
    """``--peers a,b,/x/area-*`` as its paths and patterns."""
    if text is None:
        return ()
    items = tuple(p.strip() for p in text.split(","))
    if not all(items):
        raise UsageError(f"--peers {text!r}: an empty path in the list")
    return items


def _node_keys_of(env: Mapping[str, str], nodes: int, *, auto: bool) -> tuple[str, ...] | None:
    """The nodes' names the deal is keyed by: SLURM's hosts (what training's rank layout
    holds, :func:`shardio.order.ranks.slurm_hosts`) when the job's node list names ``nodes``
    hosts; None (node numbers) outside SLURM.

    Raises:
        UsageError: a malformed node list, one that disagrees with ``SLURM_NODEID`` and
            ``SLURMD_NODENAME``, or (``--node auto``) one of another length than
            ``SLURM_NNODES``.
    """
    from shardio.order.ranks import slurm_hosts

    if auto and "SLURM_NNODES" not in env:
        return None  # not under SLURM: one node
    hosts = slurm_hosts(env)
    if hosts is None or len(hosts) == nodes:
        return hosts
    if auto:
        raise UsageError(
            f"SLURM_NNODES={nodes} but the job's node list names {len(hosts)} host(s): "
            "--node auto cannot tell which share is this node's"
        )
    return None  # --node I/N of another count than the job's hosts: numbered nodes


def _shown_keys(keys: tuple[str, ...]) -> str:
    return ", ".join(keys[:4]) + (f", ... ({len(keys):,} hosts)" if len(keys) > 4 else "")


def run(args: argparse.Namespace) -> int:
    """Run ``shardio stage`` (and ``stage --clean``)."""
    from shardio.cli.progressbar import ProgressBar
    from shardio.staging import StageOptions, clean_stage, stage_dataset

    if args.clean:
        return _clean(args, clean_stage)
    if args.keep_journal is not None:
        raise UsageError("--keep-journal is for --clean (where the epilogue keeps the journal)")
    if len(args.paths) > 2:
        raise UsageError("stage takes SRC and an optional DEST")
    src = args.paths[0]
    env = os.environ
    if args.node == "auto":
        node, nodes = env_node_part(env)
    else:
        node, nodes = parse_part(args.node, option="--node")
    keys = _node_keys_of(env, nodes, auto=args.node == "auto")
    ranks = args.ranks_per_node
    if ranks is None:
        ranks = env_ranks_per_node(env)
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
        force=args.force,
        read_timeout_s=_stage_timeout(src, args.read_timeout),
        peers=_peers_of(args.peers),
        node_keys=keys,
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
    print(f"node {node}/{nodes}: {result.moved_line()}")
    print(f"for order {options.spec}, epoch {options.epoch} (training must use the same)")
    if keys is not None and options.spec.partitioned:
        print(f"node {node}/{nodes} is host {keys[node]}; shares dealt by host name over "
              f"{_shown_keys(keys)}")  # fmt: skip
    if result.from_source:
        shown = ", ".join(result.from_source[:3]) + (", ..." if len(result.from_source) > 3 else "")
        print(
            f"{len(result.from_source)} shard(s) do not fit --capacity and will be read from "
            f"{src}: {shown}"
        )
    if result.evicted:
        print(_evicted_line(len(result.evicted), options))
    print(f"read it with ShardDataset({src!r}, stage={dest!r}) or ShardDataset({dest!r})")
    return EXIT_OK
