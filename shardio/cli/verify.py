"""``shardio verify [--repair]``: check a dataset or a staging area, fix what is found, and
say what was found in words (exit 0 intact, 3 damaged, 4 repaired, 5 degraded)."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from shardio.cli.common import (
    EXIT_DAMAGED,
    EXIT_DEGRADED,
    EXIT_OK,
    EXIT_REPAIRED,
    add_no_progress,
    add_workers,
    print_error,
    workers_of,
)
from shardio.errors import UsageError
from shardio.units import format_duration, format_size

if TYPE_CHECKING:
    from shardio.metrics.progress import ProgressCallback
    from shardio.tools.verify_report import VerifyReport

__all__ = ["HELP", "add_arguments", "run"]


HELP = "check every shard and sample checksum (--repair: fix what is found)"
DESCRIPTION = (
    "Check a dataset, or a staging area's copies, against its manifest; "
    "with --repair, fix what is found."
)
EPILOG = (
    "exit codes: 0 intact; 3 damage is left (a dataset's shard or index, or a "
    "staged copy whose source is bad too); 4 --repair fixed everything it found; 5 a "
    "staging area is degraded (copies missing, damaged or stale, but the source they fall "
    "back to is intact: training works, reading from the source), or only parity files are "
    "bad; 1 could not check; "
    "2 usage."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio verify``."""
    parser.add_argument("dst", help="a dataset, or a staging area (shardio stage)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="check the index and shard sizes only; read no shard data",
    )
    parser.add_argument(
        "--repair",
        action="store_true",
        help="fix what is found: a staging area's copies are staged again from its source; "
        "a dataset's damaged or missing shards are rebuilt from its parity, or replaced "
        "(with its index) by verified copies from --source",
    )
    parser.add_argument(
        "--source",
        default=None,
        metavar="SRC",
        help="with --repair: another copy of the same dataset to copy good shards from "
        "(needed for a dataset without parity; default for a staging area: the source it "
        "was staged from)",
    )
    add_workers(
        parser,
        "processes, 1 to 4096, never more than the shards (default: the CPUs of this "
        "job, SLURM-aware; without --repair, one for a dataset under 256 MiB or with "
        "--quick, where a pool costs more than it saves)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_no_progress(parser)


_VERIFY_EXIT = {
    "intact": EXIT_OK,
    "repaired": EXIT_REPAIRED,
    "degraded": EXIT_DEGRADED,
    "damaged": EXIT_DAMAGED,
}


def run(args: argparse.Namespace) -> int:
    """Run ``shardio verify`` (and ``verify --repair``)."""
    from shardio.cli.progressbar import ProgressBar
    from shardio.tools.verify import verify_dataset

    if args.source is not None and not args.repair:
        raise UsageError("--source is for --repair: give both, or neither")
    if args.repair and args.quick:
        raise UsageError("--repair reads every byte of what it checks: drop --quick")
    bar = None if args.no_progress or args.json else ProgressBar("verifying", unit="shards")
    with bar or contextlib.nullcontext():  # an interrupted bar is erased
        if args.repair:
            return _cmd_repair(args, workers_of(args), bar)
        # No --workers: the job's CPUs for a large dataset, one process for a small one.
        report = verify_dataset(args.dst, quick=args.quick, workers=args.workers, progress=bar)
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
        # Without parity, --repair of a dataset needs --source (repair_dataset refuses it
        # otherwise), though the .idx itself is written from the index, not copied.
        repair = f"shardio verify --repair {args.dst}"
        if not report.parity_checked:
            repair = f"shardio verify {args.dst} --repair --source SRC (another copy of it)"
        print_error(
            f"DEGRADED: {rewritable} DALI index(es) missing beside intact shards; every data "
            f"shard is intact, and {repair} writes them again"
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
