"""The ``shardio`` command: parse arguments, call the library, print results.

The only module that reads environment variables or prints. A ShardioError (a user's
mistake or a damaged dataset) becomes one line on stderr and a non-zero exit, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from shardio._version import __version__
from shardio.errors import ShardioError, UsageError
from shardio.runtime.order import ORDERS
from shardio.units import format_duration, format_size, parse_size

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_DAMAGED = 0, 1, 2, 3


def default_workers(environ: os._Environ[str] | dict[str, str] | None = None) -> int:
    """CPUs this job may use: SLURM's allocation first, then the affinity mask."""
    env = os.environ if environ is None else environ
    for var in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, len(os.sched_getaffinity(0)))


def parse_part(
    text: str, environ: dict[str, str] | None = None, *, option: str = "--part"
) -> tuple[int, int]:
    """Parse ``--part I/N`` (0-based I) or ``auto`` (SLURM_PROCID/SLURM_NTASKS)."""
    env = dict(os.environ) if environ is None else environ
    if text == "auto":
        if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
            raise UsageError("--part auto needs SLURM_PROCID and SLURM_NTASKS (run under srun)")
        text = f"{env['SLURM_PROCID']}/{env['SLURM_NTASKS']}"
    head, sep, tail = text.partition("/")
    if not sep or not head.isdigit() or not tail.isdigit() or not 0 <= int(head) < int(tail):
        raise UsageError(f"invalid {option} {text!r}: use I/N with 0 <= I < N, e.g. 0/4, or auto")
    return int(head), int(tail)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (what is wrong, where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        top, _, command = self.prog.partition(" ")  # "shardio pack" for a subcommand
        where = f"{command}: " if command else ""
        self.exit(EXIT_USAGE, f"{top}: error: {where}{message} (see {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardio",
        description="Pack small files into checksummed shards and verify them.",
    )
    parser.add_argument("--version", action="version", version=f"shardio {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is done")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("pack", help="pack a tree of files into shards")
    p.add_argument("src", help="the tree to pack (e.g. imagenet/)")
    p.add_argument("dst", help="the dataset directory to create")
    p.add_argument("--format", dest="shard_format", choices=["tar", "hdf5"], default="tar")
    p.add_argument("--shard-size", default="1GiB", help="target shard size (default 1GiB)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes (default: the CPUs of this job, SLURM-aware)",
    )
    p.add_argument(
        "--labels",
        choices=["auto", "none"],
        default="auto",
        help="class labels from an ImageNet-style layout (default auto)",
    )
    p.add_argument("--stripe", default="auto", help="auto | none | pfl | COUNTxSIZE (e.g. 8x4MiB)")
    p.add_argument(
        "--fs-type", default=None, help="force the filesystem type (lustre, beegfs, ...)"
    )
    p.add_argument("--part", default=None, help="pack part I/N of a multi-node pack, or auto")
    p.add_argument("--strict", action="store_true", help="fail on files that would be skipped")
    p.add_argument("--resume", action="store_true", help="finish an interrupted pack")
    p.add_argument("--force", action="store_true", help="overwrite a dataset in DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    m = sub.add_parser("merge", help="join the parts of a multi-node pack")
    m.add_argument("dst")

    v = sub.add_parser("verify", help="check every shard and sample checksum")
    v.add_argument("dst")
    v.add_argument(
        "--quick",
        action="store_true",
        help="check the index and shard sizes only; read no shard data",
    )
    v.add_argument("--workers", type=int, default=None)
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--no-progress", action="store_true")

    i = sub.add_parser("inspect", help="summarise a dataset")
    i.add_argument("dst")
    i.add_argument("--json", action="store_true")

    ls = sub.add_parser("ls", help="list sample keys")
    ls.add_argument("dst")
    ls.add_argument("--paths", action="store_true", help="list original file paths instead")

    st = sub.add_parser(
        "stage",
        help="copy this node's shards to node-local storage, verified (job prologue)",
        description="Stage shards from SRC to DEST (default: the job's node-local scratch), "
        "in the order training first needs them. `shardio stage --clean DEST` removes them.",
    )
    st.add_argument("paths", nargs="+", metavar="SRC [DEST]")
    st.add_argument("--node", default="auto", help="I/N (0-based) or auto (SLURM_NODEID/NNODES)")
    st.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="training ranks per node (default SLURM_NTASKS_PER_NODE or 1)",
    )
    st.add_argument("--seed", type=int, default=0, help="ShardDataset's seed")
    st.add_argument("--epoch", type=int, default=0, help="the epoch to stage for")
    st.add_argument(
        "--order",
        default="shard-local",
        choices=ORDERS,
        help="ShardDataset's order (default shard-local, stream mode's)",
    )
    st.add_argument("--window-shards", type=int, default=4)
    st.add_argument("--streams", type=int, default=4, help="parallel copy streams")
    st.add_argument("--capacity", default=None, help="stage at most this much, e.g. 800GiB")
    st.add_argument("--clean", action="store_true", help="remove a staging area (epilogue)")
    st.add_argument(
        "--fsync", action="store_true", help="fsync every copy (survives a node crash; slower)"
    )
    st.add_argument("--no-progress", action="store_true")

    u = sub.add_parser("unpack", help="restore the original tree, byte for byte")
    u.add_argument("dst")
    u.add_argument("out")
    return parser


def _cmd_pack(args: argparse.Namespace) -> int:
    from shardio.cli.progress import ProgressBar
    from shardio.packing.run import PackOptions, pack

    part, num_parts = parse_part(args.part) if args.part else (0, 1)
    options = PackOptions(
        shard_format=args.shard_format,
        shard_size_bytes=parse_size(args.shard_size),
        workers=args.workers if args.workers is not None else default_workers(),
        labels=args.labels,
        stripe=args.stripe,
        fs_type=args.fs_type,
        strict=args.strict,
        resume=args.resume,
        force=args.force,
        part=part,
        num_parts=num_parts,
    )
    bar = None if args.no_progress else ProgressBar("packing")
    result = pack(args.src, args.dst, options, progress=bar)
    rate = result.data_bytes / result.seconds if result.seconds > 0 else 0.0
    where = f"part {part}/{num_parts} of " if num_parts > 1 else ""
    print(
        f"packed {result.num_files:,} files ({format_size(result.data_bytes)}) into "
        f"{result.num_samples:,} samples in {result.num_shards:,} {options.shard_format} shards "
        f"({format_size(result.total_bytes)}) at {where}{args.dst} in "
        f"{format_duration(result.seconds)}: {format_size(rate)}/s, "
        f"{result.num_files / max(result.seconds, 1e-9):,.0f} files/s"
    )
    for warning in result.warnings:
        print(warning)
    if result.reused_shards:
        print(f"reused {result.reused_shards} verified shard(s) from the interrupted pack")
    print(f"layout: {result.layout.message}")
    if result.skipped:
        print(f"skipped {len(result.skipped):,} file(s), listed in {args.dst}/pack-report.json:")
        for s in result.skipped[:5]:
            print(f"  {os.fsdecode(s.path)}: {s.reason}")
    if result.oversized:
        print(f"{len(result.oversized)} sample(s) larger than --shard-size got a shard each")
    if num_parts > 1:
        print(f"when all {num_parts} parts are done, run: shardio merge {args.dst}")
    return EXIT_OK


def _cmd_merge(args: argparse.Namespace) -> int:
    from shardio.packing.merge import merge_parts

    result = merge_parts(args.dst)
    man = result.manifest
    print(
        f"merged {result.num_parts} parts into {args.dst}: {man.num_samples:,} samples, "
        f"{len(man.shards):,} shards, {format_size(man.total_bytes)}"
    )
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from shardio.cli.progress import ProgressBar
    from shardio.verify import verify_dataset

    workers = args.workers if args.workers is not None else default_workers()
    bar = None if args.no_progress or args.json else ProgressBar("verifying", unit="shards")
    report = verify_dataset(args.dst, quick=args.quick, workers=workers, progress=bar)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": report.ok,
                    "quick": report.quick,
                    "shards_checked": report.shards_checked,
                    "bytes_checked": report.bytes_checked,
                    "seconds": round(report.seconds, 3),
                    "problems": [
                        {
                            "shard": p.path,
                            "reason": p.reason,
                            "bad_samples": [
                                {
                                    "key": b.key,
                                    "member": b.ext,
                                    "expected": b.expected,
                                    "actual": b.actual,
                                }
                                for b in p.bad_members
                            ],
                        }
                        for p in report.problems
                    ],
                },
                indent=1,
            )
        )
        return EXIT_OK if report.ok else EXIT_DAMAGED
    mode = "quick check of" if report.quick else "verified"
    rate = report.bytes_checked / report.seconds if report.seconds > 0 else 0
    if report.ok:
        print(
            f"OK: {mode} {report.shards_checked:,} shards ({format_size(report.bytes_checked)}) "
            f"in {format_duration(report.seconds)}, {format_size(rate)}/s"
        )
        return EXIT_OK
    for p in report.problems:
        print(f"DAMAGED {p.path}: {p.reason}", file=sys.stderr)
        for b in p.bad_members:
            print(
                f"  sample {b.key} member {b.ext}: xxh3 expected {b.expected}, got {b.actual}",
                file=sys.stderr,
            )
    print(
        f"FAILED: {len(report.problems)} of {report.shards_checked:,} shards damaged, "
        f"{len(report.damaged_samples):,} samples affected",
        file=sys.stderr,
    )
    return EXIT_DAMAGED


def _cmd_inspect(args: argparse.Namespace) -> int:
    from shardio.readers.dataset import PackedDataset
    from shardio.storage.fsdetect import detect_fs_type
    from shardio.storage.striping import describe_layout

    with PackedDataset(args.dst) as ds:
        man = ds.manifest
        fs_type = detect_fs_type(args.dst)
        info = {
            "path": args.dst,
            "format_version": man.format_version,
            "shard_format": man.shard_format,
            "samples": man.num_samples,
            "members": man.num_members,
            "shards": len(man.shards),
            "data_bytes": man.data_bytes,
            "total_bytes": man.total_bytes,
            "extensions": sorted(ds.index.exts),
            "label_layout": man.label_layout,
            "classes": len(man.classes) if man.classes is not None else 0,
            "filesystem": fs_type,
            "stripe_layout": describe_layout(os.path.join(args.dst, "shards"), fs_type=fs_type),
            "created_by": man.created_by,
        }
    if args.json:
        print(json.dumps(info, indent=1))
        return EXIT_OK
    files = man.num_members - (man.num_samples if man.classes is not None else 0)
    mean = man.data_bytes / files if files else 0
    print(f"dataset       {args.dst}")
    print(f"format        shardio v{man.format_version}, {man.shard_format} shards")
    print(
        f"samples       {man.num_samples:,} ({man.num_members:,} members, "
        f"extensions: {', '.join(info['extensions'])})"
    )
    print(
        f"shards        {len(man.shards):,}, {format_size(man.total_bytes)} "
        f"(payload {format_size(man.data_bytes)}, mean file {format_size(mean)})"
    )
    if man.classes is not None:
        shown = ", ".join(man.classes[:5]) + (", ..." if len(man.classes) > 5 else "")
        print(f"classes       {len(man.classes):,} ({man.label_layout}): {shown}")
    else:
        print("classes       none")
    print(f"filesystem    {fs_type}")
    print(f"stripe layout {info['stripe_layout']}")
    print(f"created by    {man.created_by}")
    return EXIT_OK


def _cmd_ls(args: argparse.Namespace) -> int:
    from shardio.readers.dataset import PackedDataset

    out = sys.stdout.buffer
    with PackedDataset(args.dst) as ds:
        index = ds.index
        if args.paths:
            for m in range(len(index.members)):
                path = index.member_path(m)
                if path:
                    out.write(path + b"\n")
        else:
            for s in range(len(index)):
                out.write(index.key(s).encode("ascii") + b"\n")
    out.flush()
    return EXIT_OK


def default_stage_dir(src: str, environ: dict[str, str] | None = None) -> str:
    """The job's node-local scratch: $SLURM_TMPDIR, $TMPDIR, then /mnt/nvme/$USER/$JOB."""
    env = dict(os.environ) if environ is None else environ
    base = env.get("SLURM_TMPDIR") or env.get("TMPDIR")
    if not base:
        base = os.path.join("/mnt/nvme", env.get("USER", "shardio"), env.get("SLURM_JOB_ID", "0"))
    name = os.path.basename(os.path.normpath(src)) or "dataset"
    return os.path.join(base, f"shardio-{name}")


def _leading_int(text: str) -> int | None:
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def _cmd_stage(args: argparse.Namespace) -> int:
    from shardio.cli.progress import ProgressBar
    from shardio.staging import StageOptions, clean_stage, stage_dataset

    if args.clean:
        if len(args.paths) != 1:
            raise UsageError("stage --clean takes one path: the staging area (DEST)")
        removed = clean_stage(args.paths[0])
        print(f"removed {removed} staged shard(s) from {args.paths[0]}")
        return EXIT_OK
    if len(args.paths) > 2:
        raise UsageError("stage takes SRC and an optional DEST")
    src = args.paths[0]
    dest = args.paths[1] if len(args.paths) == 2 else default_stage_dir(src)
    env = dict(os.environ)
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
        seed=args.seed,
        epoch=args.epoch,
        order=args.order,
        window_shards=args.window_shards,
        streams=args.streams,
        capacity_bytes=parse_size(args.capacity) if args.capacity else None,
        durable=args.fsync,
    )
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


def _cmd_unpack(args: argparse.Namespace) -> int:
    from shardio.unpack import unpack_dataset

    result = unpack_dataset(args.dst, args.out)
    print(
        f"unpacked {result.files:,} files ({format_size(result.bytes)}) into {args.out} "
        f"in {format_duration(result.seconds)}"
    )
    return EXIT_OK


_COMMANDS = {
    "pack": _cmd_pack,
    "merge": _cmd_merge,
    "verify": _cmd_verify,
    "inspect": _cmd_inspect,
    "ls": _cmd_ls,
    "unpack": _cmd_unpack,
    "stage": _cmd_stage,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="shardio: %(levelname)s: %(message)s",
    )
    try:
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"shardio: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ShardioError as exc:
        print(f"shardio: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"shardio: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("shardio: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
