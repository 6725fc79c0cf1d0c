"""``shardio checkpoint ls|verify|latest``: see and check checkpoints without loading them."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from typing import TYPE_CHECKING

from shardio.cli.common import EXIT_DAMAGED, EXIT_FAIL, EXIT_OK, Subparsers, one_line, print_error
from shardio.units import format_size

if TYPE_CHECKING:
    from shardio.checkpoint.audit import CheckedCheckpoint

__all__ = ["EXIT_UNAVAILABLE", "HELP", "add_arguments", "run"]

EXIT_UNAVAILABLE = 75  # EX_TEMPFAIL: the checkpoints cannot be read now; ask again later


HELP = "list, check or find the newest intact checkpoint"
DESCRIPTION = (
    "Checkpoints written by shardio.checkpoint (save, Checkpointer): list "
    "them, check every byte against their manifests, or print the newest intact one "
    "(what load_latest loads, and what a retried job resumes from). Nothing is loaded "
    "or changed."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio checkpoint``."""
    actions = parser.add_subparsers(dest="checkpoint_action", required=True, metavar="ACTION")
    ls = _add_action(actions, "ls", "list checkpoints, newest first (manifests only)")
    ver = _add_action(
        actions,
        "verify",
        "read every file and check it (exit 0 intact, 3 damaged, 75: cannot be read now, retry)",
        dir_help="a checkpoint directory, or one checkpoint in it",
    )
    ver.add_argument(
        "--read-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds one read may stall before the checkpoint is reported unreadable "
        "(default 120)",
    )
    lat = _add_action(
        actions,
        "latest",
        "print the newest intact checkpoint's path (exit 1: none; 3: all damaged; 75: "
        "cannot be read now, retry)",
    )
    lat.add_argument("--kind", choices=("full", "light"), help="only this kind")
    for action in (ls, ver, lat):  # last in each action's help
        action.add_argument("--json", action="store_true", help="JSON on stdout")


def _add_action(
    actions: Subparsers, name: str, help_text: str, dir_help: str = "a checkpoint directory"
) -> argparse.ArgumentParser:
    """One action's subparser and its DIR argument."""
    action: argparse.ArgumentParser = actions.add_parser(name, help=help_text)
    action.add_argument("dir", help=dir_help)
    return action


def _when(ns: int | None) -> str:
    if ns is None:
        return "?"
    moment = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def _line(item: CheckedCheckpoint) -> str:
    m = item.manifest
    name = os.path.basename(item.path)
    if m is None:
        if item.unreadable and not item.problems:
            return one_line(f"{name}  UNREADABLE now (not damaged; retry): {item.unreadable[0]}")
        return one_line(f"{name}  BROKEN: {item.problems[0] if item.problems else '?'}")
    ratio = m.raw_bytes / m.size_bytes if m.size_bytes else 1.0
    loader = ""
    if m.loader:
        loader = f"  loader epoch {m.loader.get('epoch', '?')} at {m.loader.get('consumed', '?')}"
    return one_line(
        f"{name}  {m.kind} step {m.step:,}  {m.world_size} rank(s)  "
        f"{format_size(m.size_bytes)} ({ratio:.2f}x)  job {m.job_id}  {_when(m.saved_at_ns)}"
        f"{loader}"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``shardio checkpoint ls|verify|latest``."""
    from shardio.checkpoint.audit import latest_intact
    from shardio.errors import CheckpointError, CheckpointUnavailableError, NoCheckpointError

    if args.checkpoint_action in ("ls", "verify"):
        try:
            return _list_or_verify(args)
        except CheckpointUnavailableError as exc:  # not damaged, not empty: ask again later
            print_error(one_line(f"shardio: {exc}"))
            return EXIT_UNAVAILABLE
    try:
        found, skipped = latest_intact(args.dir, kind=args.kind)
    except NoCheckpointError as exc:
        print_error(one_line(f"shardio: {exc}"))
        if args.json:
            print(json.dumps({"path": None, "skipped": []}))
        return EXIT_FAIL
    except CheckpointUnavailableError as exc:  # not "none": the caller must not start afresh
        print_error(one_line(f"shardio: {exc}"))
        return EXIT_UNAVAILABLE
    except CheckpointError as exc:  # every one found is damaged
        print_error(one_line(f"shardio: {exc}"))
        return EXIT_DAMAGED
    for path, reason in skipped:
        print_error(one_line(f"skipped {path}: {reason}"))
    if args.json:
        print(json.dumps({**found.to_json(), "skipped": skipped}, indent=1))
    else:
        print(found.path)
    return EXIT_OK


def _list_or_verify(args: argparse.Namespace) -> int:
    """``shardio checkpoint ls`` or ``verify``: read only, no lease asked for or taken."""
    from shardio.checkpoint.audit import list_dir, verify_checkpoints

    if args.checkpoint_action == "ls":
        items, temps = list_dir(args.dir)
        if args.json:
            doc = {"checkpoints": [i.to_json() for i in items], "incomplete": temps}
            print(json.dumps(doc, indent=1))
            return EXIT_OK
        for item in items:
            print(_line(item))
        for tmp in temps:
            print(one_line(f"{os.path.basename(tmp)}  incomplete (a save in flight or killed)"))
        if not items and not temps:
            print(one_line(f"no checkpoints in {args.dir}"))
        return EXIT_OK
    items = verify_checkpoints(args.dir, read_timeout_s=args.read_timeout)
    damaged = [i for i in items if i.problems]
    unreadable = [i for i in items if i.unreadable and not i.problems]
    # Damage found is said first (3); else a checkpoint that could not be read now is
    # neither intact nor damaged: ask again later (75).
    args.exit_code = EXIT_DAMAGED if damaged else EXIT_UNAVAILABLE if unreadable else EXIT_OK
    if args.json:
        print(json.dumps({"checkpoints": [i.to_json() for i in items]}, indent=1))
        return int(args.exit_code)
    for item in items:
        status = {"intact": "OK", "damaged": "DAMAGED"}.get(item.status, "UNREADABLE")
        print(one_line(f"{status:7s} {_line(item)}"))
        for problem in item.problems:
            print_error(one_line(f"DAMAGED {item.path}: {problem}"))
        for problem in item.unreadable:
            print_error(one_line(f"UNREADABLE {item.path} (not damaged; retry): {problem}"))
    intact = len(items) - len(damaged) - len(unreadable)
    print(
        one_line(
            f"{intact} of {len(items)} checkpoint(s) intact"
            + (f", {len(damaged)} damaged" if damaged else "")
            + (f", {len(unreadable)} cannot be read now" if unreadable else "")
        )
        if items
        else one_line(f"no checkpoints in {args.dir}")
    )
    return int(args.exit_code)
