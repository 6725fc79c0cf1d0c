"""``shardio bench``: emulate training on a dataset and report what its storage delivers."""

from __future__ import annotations

import argparse
import json
import math
import os

from shardio._pool import default_workers
from shardio.cli.common import EXIT_OK, add_whole_number
from shardio.errors import StorageError, UsageError

__all__ = ["HELP", "add_arguments", "run"]

DEFAULT_COMPUTE_MS = 50.0


HELP = "emulate training (sleep per step) and report AU, throughput, read latency"
DESCRIPTION = (
    "A DLIO-style run: read the dataset in batches as training would and "
    "sleep --compute-ms per step for the model's compute; report accelerator utilisation "
    "(AU = compute time / wall time), samples/s, MB/s, read latency percentiles and the "
    "step-time spread, with PASS/FAIL lines against: read latency P99 under 100 ms "
    "(alert from 50 ms), step-time std under 5% of the mean, AU of at least 90% "
    "(MLPerf Storage counts a ResNet-50 run from 90%)."
)
EPILOG = (
    "The exit code is 0 whenever the run completed, whatever the checks say; "
    'they are in the output (and in --json under "checks").'
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``shardio bench``."""
    parser.add_argument("dataset", help="a packed dataset (shardio pack)")
    parser.add_argument("--mode", choices=["map", "stream"], default="map", help="default map")
    add_whole_number(
        parser,
        "--workers",
        None,
        "DataLoader workers (default: 4, or the CPUs of the job when fewer)",
    )
    add_whole_number(parser, "--batch", 32, "samples per batch (default 32)")
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=DEFAULT_COMPUTE_MS,
        metavar="X",
        help="emulated compute per step in ms: your model's step time on your GPU "
        f"(default {DEFAULT_COMPUTE_MS:g})",
    )
    add_whole_number(parser, "--epochs", 1, "epochs to run (default 1)")
    add_whole_number(parser, "--seed", 0, "the seed of the shuffles (default 0)", digits=20)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="empty the page cache before each epoch (root: drop_caches; otherwise "
        "POSIX_FADV_DONTNEED on every file the run reads)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="write throughput, stalls and the latency histogram as a PNG (needs matplotlib)",
    )
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="loose:DIR|webdataset",
        help="run the same loop over the original loose files under DIR, or webdataset over "
        "the same tar shards (repeatable)",
    )


def _check_plot_path(path: str) -> None:
    """Refuse a --plot path that cannot be written, before a run of many minutes."""
    from shardio.bench.plot import check_plot_path

    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--plot {path}: no directory {parent}")
    if os.path.isdir(path) and not os.path.islink(path):
        raise UsageError(f"--plot {path}: is a directory (name the PNG file to write)")
    try:
        check_plot_path(path)  # a symlink, FIFO or device is never replaced
    except StorageError as exc:
        raise UsageError(f"--plot {path}: {exc.strerror}") from exc


def _check_numbers(args: argparse.Namespace) -> None:
    if args.workers is None:
        args.workers = min(4, default_workers())
    if args.workers < 0:
        raise UsageError(f"--workers must be >= 0, got {args.workers}")
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    if args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    if not math.isfinite(args.compute_ms) or args.compute_ms < 0:
        raise UsageError(f"--compute-ms must be a number >= 0, got {args.compute_ms}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")


def run(args: argparse.Namespace) -> int:
    """Run ``shardio bench``."""
    from shardio.bench.plot import require_matplotlib, write_plot
    from shardio.bench.report import format_report, report_dict
    from shardio.bench.runners import require_torch, run_bench

    require_torch()
    from shardio.bench.settings import BenchSettings, parse_compare

    _check_numbers(args)
    settings = BenchSettings(
        mode=args.mode,
        workers=args.workers,
        batch_size=args.batch,
        compute_ms=args.compute_ms,
        epochs=args.epochs,
        seed=args.seed,
        cold=args.cold,
    )
    peers = [parse_compare(text) for text in args.compare]
    if args.plot is not None:
        require_matplotlib()  # now, not after a run of many minutes
        _check_plot_path(args.plot)
    from shardio.read.strategy import choose_strategy

    choice = choose_strategy(args.dataset)  # what the bench's ShardDataset reads with
    runs = run_bench(args.dataset, settings, compare=peers)
    shown = {
        "dataset": args.dataset,
        **settings.to_dict(),
        "compare": [str(p) for p in peers],
        "plot": args.plot,
        "filesystem": choice.fs.describe(),
        "read_strategy": f"{choice.describe()}: {choice.strategy.describe()}",
    }
    # The report first: a plot that cannot be written must not lose the figures of the run.
    if args.json:
        print(json.dumps(report_dict(runs, shown), indent=1), flush=True)
    else:
        head, _, rest = format_report(runs, shown).partition("\n")
        print(head)
        print(f"  filesystem     {shown['filesystem']}")
        print(f"  read strategy  {shown['read_strategy']}")
        print(rest, flush=True)
    if args.plot is not None:
        write_plot(runs, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return EXIT_OK
