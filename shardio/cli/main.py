"""The ``shardio`` command: parse arguments, call the library, print results.

A ShardioError (a user's mistake or a damaged dataset) becomes one line on stderr and a
non-zero exit, never a traceback; any other exception (a bug) becomes one "internal error"
line (the traceback with -v). A reader that closes the pipe (``shardio ls DS | head``) ends
the command quietly. Output never fails on a file name that the locale cannot encode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from shardio._version import __version__
from shardio.cli.bench import add_bench_parser, cmd_bench
from shardio.cli.checkpoint import add_checkpoint_parser, cmd_checkpoint
from shardio.cli.common import (
    EXIT_DAMAGED,
    EXIT_DEGRADED,
    EXIT_FAIL,
    EXIT_OK,
    EXIT_REPAIRED,
    EXIT_USAGE,
    default_workers,
    make_streams_safe,
    parse_part,
    parse_workers,
    print_error,
    silence_stdout,
    stdout_is_closed,
    whole_number,
)
from shardio.cli.pack import cmd_merge, cmd_pack, label_map_text
from shardio.cli.parity import add_parity_parser, cmd_parity
from shardio.cli.stage import cmd_stage, default_stage_dir, seconds_arg
from shardio.cli.topo import add_topo_parser, cmd_topo
from shardio.errors import ShardioError, UsageError
from shardio.units import format_duration, format_size

if TYPE_CHECKING:
    from shardio.metrics.progress import ProgressCallback
    from shardio.tools.verify_report import VerifyReport

__all__ = ["default_stage_dir", "default_workers", "main", "parse_part"]


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
        type=parse_workers,
        default=None,
        help="processes, 1 to 4096 (default: the CPUs of this job, SLURM-aware)",
    )
    p.add_argument(
        "--labels",
        choices=["auto", "none"],
        default="auto",
        help="class labels from an ImageNet-style layout (default auto)",
    )
    pin = p.add_mutually_exclusive_group()
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
    p.add_argument("--stripe", default="auto", help="auto | none | pfl | COUNTxSIZE (e.g. 8x4MiB)")
    p.add_argument(
        "--fs-type", default=None, help="force the filesystem type (lustre, beegfs, ...)"
    )
    p.add_argument("--part", default=None, help="pack part I/N of a multi-node pack, or auto")
    p.add_argument(
        "--parity",
        default=None,
        metavar="K+M",
        help="also write M parity files per group of K shards (e.g. 10+2): any M lost or "
        "damaged shards of a group can be rebuilt (needs pyeclib)",
    )
    p.add_argument("--strict", action="store_true", help="fail on files that would be skipped")
    p.add_argument("--resume", action="store_true", help="finish an interrupted pack")
    p.add_argument("--force", action="store_true", help="overwrite a dataset in DST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    m = sub.add_parser("merge", help="join the parts of a multi-node pack")
    m.add_argument("dst")
    m.add_argument(
        "--workers",
        type=parse_workers,
        default=None,
        help="processes computing parity, 1 to 4096 (default: the CPUs of this job)",
    )
    m.add_argument("--no-progress", action="store_true", help="no progress bar")

    v = sub.add_parser(
        "verify",
        help="check every shard and sample checksum (--repair: fix what is found)",
        description="Check a dataset, or a staging area's copies, against its manifest; "
        "with --repair, fix what is found.",
        epilog="exit codes: 0 intact; 3 damage is left (a dataset's shard or index, or a "
        "staged copy whose source is bad too); 4 --repair fixed everything it found; 5 a "
        "staging area is degraded (copies missing, damaged or stale, but the source they fall "
        "back to is intact: training works, reading from the source), or only parity files are "
        "bad; 1 could not check; "
        "2 usage.",
    )
    v.add_argument("dst", help="a dataset, or a staging area (shardio stage)")
    v.add_argument(
        "--quick",
        action="store_true",
        help="check the index and shard sizes only; read no shard data",
    )
    v.add_argument(
        "--repair",
        action="store_true",
        help="fix what is found: a staging area's copies are staged again from its source; "
        "a dataset's damaged or missing shards are rebuilt from its parity, or replaced "
        "(with its index) by verified copies from --source",
    )
    v.add_argument(
        "--source",
        default=None,
        metavar="SRC",
        help="with --repair: another copy of the same dataset to copy good shards from "
        "(needed for a dataset without parity; default for a staging area: the source it "
        "was staged from)",
    )
    v.add_argument(
        "--workers",
        type=parse_workers,
        default=None,
        help="processes, 1 to 4096, never more than the shards (default: the CPUs of this "
        "job, SLURM-aware)",
    )
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
        type=whole_number("--ranks-per-node"),
        default=None,
        help="training ranks per node (default SLURM_NTASKS_PER_NODE or 1)",
    )
    st.add_argument(
        "--order",
        default=None,
        metavar="SPEC",
        help="the order training uses: a name (random, shard-local, sequential) or "
        "key=value pairs such as order=random,seed=1,partition=node (default: "
        "$SHARDIO_ORDER, else ShardDataset's defaults for --mode)",
    )
    st.add_argument(
        "--mode",
        choices=["map", "stream"],
        default="map",
        help="ShardDataset's mode, whose default order applies (map: random, stream: shard-local)",
    )
    st.add_argument(
        "--seed",
        type=whole_number("--seed", digits=20),
        default=None,
        help="override the spec's seed",
    )
    st.add_argument(
        "--epoch", type=whole_number("--epoch", digits=19), default=0, help="the epoch to stage for"
    )
    st.add_argument(
        "--ahead",
        type=whole_number("--ahead"),
        default=0,
        help="also stage the shards of this many following epochs and evict the rest "
        "(a rotating order; see shardio.cache.EpochStager)",
    )
    st.add_argument(
        "--window-shards",
        type=whole_number("--window-shards"),
        default=None,
        help="override the spec's window",
    )
    st.add_argument(
        "--read-timeout",
        type=seconds_arg("--read-timeout"),
        default=None,
        metavar="S",
        help="abandon a shard whose copy stalls this many seconds (a dead data server) and "
        "stage the others (default: 120 on a network filesystem, none on a local one; 0: none)",
    )
    st.add_argument(
        "--streams", type=whole_number("--streams"), default=4, help="parallel copy streams"
    )
    st.add_argument("--capacity", default=None, help="stage at most this much, e.g. 800GiB")
    st.add_argument(
        "--clean",
        action="store_true",
        help="remove what shardio staged in DEST (epilogue); its repair journal is kept "
        "(see --keep-journal) and files shardio did not stage stay",
    )
    st.add_argument(
        "--keep-journal",
        default=None,
        metavar="DIR",
        help="with --clean: move the repair journal here (default: $SLURM_SUBMIT_DIR, beside "
        "the job's log, else the current directory)",
    )
    st.add_argument(
        "--force",
        action="store_true",
        help="DEST holds another dataset: remove what shardio staged there, then stage",
    )
    st.add_argument(
        "--fsync", action="store_true", help="fsync every copy (survives a node crash; slower)"
    )
    st.add_argument("--no-progress", action="store_true")

    add_parity_parser(sub)
    add_checkpoint_parser(sub)

    u = sub.add_parser("unpack", help="restore the original tree, byte for byte")
    u.add_argument("dst")
    u.add_argument("out")
    u.add_argument("--no-progress", action="store_true", help="no progress bar")

    add_topo_parser(sub)
    add_bench_parser(sub)
    return parser


_VERIFY_EXIT = {
    "intact": EXIT_OK,
    "repaired": EXIT_REPAIRED,
    "degraded": EXIT_DEGRADED,
    "damaged": EXIT_DAMAGED,
}


def _cmd_verify(args: argparse.Namespace) -> int:
    from shardio.cli.progressbar import ProgressBar
    from shardio.tools.verify import verify_dataset

    if args.source is not None and not args.repair:
        raise UsageError("--source is for --repair: give both, or neither")
    if args.repair and args.quick:
        raise UsageError("--repair reads every byte of what it checks: drop --quick")
    workers = args.workers if args.workers is not None else default_workers()
    bar = None if args.no_progress or args.json else ProgressBar("verifying", unit="shards")
    with bar or contextlib.nullcontext():  # an interrupted bar is erased
        if args.repair:
            return _cmd_repair(args, workers, bar)
        report = verify_dataset(args.dst, quick=args.quick, workers=workers, progress=bar)
    args.exit_code = _VERIFY_EXIT[report.status]  # kept if stdout is closed
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
        return int(args.exit_code)
    mode = "quick check of" if report.quick else "verified"
    took = format_duration(report.seconds)
    if report.quick:  # it read the index and stat'ed each shard: no data rate to speak of
        read = f"(the index and each shard's size; no shard data read) in {took}"
    else:
        rate = report.bytes_checked / report.seconds if report.seconds > 0 else 0
        read = f"({format_size(report.bytes_checked)}) in {took}, {format_size(rate)}/s"
    if report.ok:
        what = "shards"
        if report.area is not None:
            staged = report.shards_checked - report.area.not_staged
            what = f"staged copies of {report.shards_checked:,} shards"
            if report.area.not_staged:
                what += f" ({report.area.not_staged:,} not staged here: their source is intact)"
            shown = staged
        else:
            shown = report.shards_checked
            if report.parity_checked:
                what += f" and {report.parity_checked:,} parity files"
        print(f"OK: {mode} {shown:,} {what} {read}")
        return EXIT_OK
    _print_problems(report)
    if report.area is not None:
        _print_area_summary(report, args.dst)
        return int(args.exit_code)
    index_bad = sum(1 for p in report.problems if p.path == report.index_path)
    parity_bad = sum(1 for p in report.problems if p.parity)
    shards_bad = len(report.problems) - index_bad - parity_bad
    shards_bad -= sum(1 for p in report.problems if p.state == "rewritable")
    parity_text = (
        f"{parity_bad} of {report.parity_checked:,} parity files damaged or missing"
        if parity_bad
        else ""
    )
    rewritable = sum(1 for p in report.problems if p.state == "rewritable")
    if report.status == "degraded" and rewritable and not parity_bad:
        print_error(
            f"DEGRADED: {rewritable} DALI index(es) missing beside intact shards; every data "
            f"shard is intact, and shardio verify --repair {args.dst} writes them again"
        )
        return int(args.exit_code)
    if report.status == "degraded":  # parity alone: every byte of training data is intact
        print_error(
            f"DEGRADED: {parity_text}; every data shard is intact, but its group is less "
            f"protected until shardio verify --repair {args.dst} rebuilds them"
            + (f" (and {rewritable} DALI index(es) are missing)" if rewritable else "")
        )
        return int(args.exit_code)
    print_error(
        f"FAILED: {shards_bad} of {report.shards_checked:,} shards damaged"
        + (", and the index" if index_bad else "")
        + (f", and {parity_text}" if parity_bad else "")
        + f", {_samples_affected(report)}"
    )
    if report.rebuildable:
        print_error(
            f"parity can rebuild {len(report.rebuildable)} of the damaged shards: shardio "
            f"verify --repair {args.dst}"
        )
    if report.over_parity:
        groups = ", ".join(str(g) for g in report.over_parity[:5])
        more = "" if len(report.over_parity) <= 5 else f" (and {len(report.over_parity) - 5} more)"
        print_error(
            f"parity group(s) {groups}{more} lost more files than their parity: --repair "
            "rebuilds them only if no cell row lost more; otherwise they need --source SRC "
            "or a re-pack"
        )
    return EXIT_DAMAGED


def _samples_affected(report: VerifyReport) -> str:
    """``42 samples affected (40 in 1 missing, empty or unreadable shard, 2 with a damaged
    member)``: a shard that could not be read at all counts every sample the manifest gives
    it; a shard --quick found the wrong size is said to be unchecked, not counted."""
    members, lost = len(report.damaged_samples), report.samples_lost
    text = f"{members + lost:,} samples affected"
    if lost:
        shards = sum(1 for p in report.problems if p.samples_lost)
        where = f"{lost:,} in {shards:,} missing, empty or unreadable shard{'s' * (shards != 1)}"
        text += f" ({where}, {members:,} with a damaged member)" if members else f" ({where})"
    unchecked = sum(
        1 for p in report.problems if not p.samples_lost and p.reason.startswith("size ")
    )
    if report.quick and unchecked:
        text += (
            f"; --quick read no shard data, so the samples of the {unchecked:,} shard(s) of the "
            "wrong size were not checked (verify without --quick counts them)"
        )
    return text


_MEMBERS_SHOWN = 5  # damaged members listed per shard on stderr; --json has every one


def _print_problems(report: VerifyReport) -> None:
    for p in report.problems:
        if p.staged:
            print_error(f"{p.state.upper()} {p.path} (staged copy): {p.reason}")
        elif p.parity:
            print_error(f"DAMAGED {p.path} (parity): {p.reason}")
        elif p.state in ("rewritable", "foreign"):  # a DALI .idx: no training byte lost
            print_error(f"{p.state.upper()} {p.path}: {p.reason}")
        else:
            print_error(f"DAMAGED {p.path}: {p.reason}")
        for b in p.bad_members[:_MEMBERS_SHOWN]:
            got = "nothing (the file ends first)" if b.actual == "truncated" else b.actual
            print_error(f"  sample {b.key} member {b.ext}: xxh3 expected {b.expected}, got {got}")
        hidden = len(p.bad_members) - _MEMBERS_SHOWN
        if hidden > 0:
            print_error(f"  ... and {hidden:,} more damaged member(s) (--json lists them all)")
    if report.area is not None:
        for p in report.area.source_problems:
            print_error(f"DAMAGED {p.path} (source, read instead of the copy): {p.reason}")


def _print_area_summary(report: VerifyReport, dst: str) -> None:
    area = report.area
    if area is None:  # pragma: no cover - callers check
        return
    copies = sum(1 for p in report.problems if p.staged)
    head = (
        f"{copies} of {report.shards_checked:,} staged copies missing, damaged, stale or "
        "not shardio's"
    )
    if report.status == "degraded":
        print_error(
            f"DEGRADED: {head}; the source {area.source} is intact for them, so training "
            f"reads them from there (shardio verify --repair {dst} stages them again)"
        )
        return
    lost = len(area.source_problems)
    others = sum(1 for p in report.problems if not p.staged)
    print_error(
        f"FAILED: {head}"
        + (f", and {lost} of their source shards in {area.source} are bad too" if lost else "")
        + (f", and {others} damaged in the staging area's index" if others else "")
    )


def _cmd_repair(args: argparse.Namespace, workers: int, bar: ProgressCallback | None) -> int:
    from shardio.tools.repair import repair_dataset

    result = repair_dataset(args.dst, source=args.source, workers=workers, progress=bar)
    args.exit_code = _VERIFY_EXIT[result.status]
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return int(args.exit_code)
    found = result.found
    if not found.ok:
        _print_problems(found)
    for fixed in result.repaired:
        print(f"repaired {fixed.path} ({fixed.state}): {fixed.how}")
    for left in result.unrepaired:
        print_error(f"could not repair {left.path}: {left.why}")
    if result.status == "intact":
        print(f"OK: verified {found.shards_checked:,} shards: nothing to repair")
        return EXIT_OK
    summary = (
        f"repaired {_count(result.repaired, found.index_path, found.parity_paths)}, "
        f"could not repair {len(result.unrepaired)}"
    )
    if result.unrepaired:
        first = result.unrepaired[0]
        more = f" (and {len(result.unrepaired) - 1} more)" if len(result.unrepaired) > 1 else ""
        summary += f": {first.path}: {first.why}{more}"
    if result.status == "repaired":
        print(f"REPAIRED: {summary}")
    elif result.status == "degraded" and found.area is None:
        print_error(f"DEGRADED: {summary}; every data shard is intact, its parity is not")
    elif result.status == "degraded":
        print_error(f"DEGRADED: {summary}; training reads those shards from {result.source}")
    else:
        print_error(f"FAILED: {summary}; damage is left")
    return int(args.exit_code)


def _count(items: Sequence[Any], index_path: str, parity: Collection[str] = ()) -> str:
    """'3 shards', '3 shards and the index', 'the index', '2 shards and 1 parity file'."""
    index = any(i.path == index_path for i in items)
    extra = sum(1 for i in items if i.path in parity)
    shards = len(items) - index - extra
    parts = (
        [f"{shards} shard{'s' if shards != 1 else ''}"] if shards or not (index or extra) else []
    )
    if extra:
        parts.append(f"{extra} parity file{'s' if extra != 1 else ''}")
    if index:
        parts.append("the index")
    return " and ".join(parts) if len(parts) <= 2 else f"{', '.join(parts[:-1])} and {parts[-1]}"


_STRIPING_FS = ("lustre", "beegfs")  # the filesystems whose layout shardio sets and reads


def _exact_size(size_bytes: int) -> str:
    """``4 MiB``, ``192 KiB``: a stripe size exactly (they are multiples of 64 KiB)."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if size_bytes % unit == 0:
            return f"{size_bytes // unit} {name}"
    return f"{size_bytes:,} bytes"


def _stripe_words(stripe: str, commands: Any) -> str:
    """``stripe count 8, stripe size 4 MiB`` for the recorded ``8x4MiB``."""
    from shardio.storage.striping import StripeSpec, parse_stripe

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


def _cmd_inspect(args: argparse.Namespace) -> int:
    from shardio.tools.inspect import inspect_dataset

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


def _cmd_ls(args: argparse.Namespace) -> int:
    from shardio.read.packed import PackedDataset

    with PackedDataset(args.dst) as ds:
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


def _cmd_unpack(args: argparse.Namespace) -> int:
    from shardio.cli.progressbar import ProgressBar
    from shardio.tools.unpack import unpack_dataset

    bar = None if args.no_progress else ProgressBar("unpacking")
    with bar or contextlib.nullcontext():  # an interrupted bar is erased
        result = unpack_dataset(args.dst, args.out, progress=bar)
    print(
        f"unpacked {result.files:,} files ({format_size(result.bytes)}) into {args.out} "
        f"in {format_duration(result.seconds)}"
    )
    return EXIT_OK


_COMMANDS = {
    "pack": cmd_pack,
    "merge": cmd_merge,
    "verify": _cmd_verify,
    "inspect": _cmd_inspect,
    "ls": _cmd_ls,
    "unpack": _cmd_unpack,
    "stage": cmd_stage,
    "topo": cmd_topo,
    "bench": cmd_bench,
    "parity": cmd_parity,
    "checkpoint": cmd_checkpoint,
}


def _os_error_line(exc: OSError) -> str:
    where = f": {os.fsdecode(exc.filename)}" if isinstance(exc.filename, str | bytes) else ""
    return f"shardio: error: {exc.strerror or exc}{where}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code."""
    make_streams_safe()
    args = argparse.Namespace(verbose=False)
    try:
        args = _build_parser().parse_args(argv)
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="shardio: %(levelname)s: %(message)s",
        )
        code = _COMMANDS[args.command](args)
        if sys.stdout is not None:  # None when started with fd 1 closed
            sys.stdout.flush()  # a closed pipe must fail here, not at interpreter exit
        return code
    except BrokenPipeError as exc:
        if stdout_is_closed():  # `shardio ls DS | head`: the reader has all it wants
            silence_stdout()
            # A command that knew its outcome before printing (a damaged verify) keeps it.
            return int(getattr(args, "exit_code", EXIT_OK))
        print_error(_os_error_line(exc))
        return EXIT_FAIL
    except UsageError as exc:
        print_error(f"shardio: error: {exc}")
        return EXIT_USAGE
    except ShardioError as exc:
        print_error(f"shardio: error: {exc}")
        return EXIT_FAIL
    except OSError as exc:
        print_error(_os_error_line(exc))
        return EXIT_FAIL
    except KeyboardInterrupt:
        if argv is None:  # the program itself, about to exit: a second Ctrl-C must not
            with contextlib.suppress(ValueError):  # end it in a traceback (ValueError: not
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main thread)
        print_error("shardio: interrupted")
        return 130
    except Exception as exc:  # the last resort: a bug must not end in a bare traceback
        if args.verbose:
            traceback.print_exception(exc, file=sys.stderr)
        hint = "" if args.verbose else "rerun with -v for the traceback; "
        what = f"{type(exc).__name__}: {exc}"
        print_error(f"shardio: internal error: {what} ({hint}please report it)")
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
