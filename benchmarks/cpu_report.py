"""bench_cpu.py's report: medians per configuration, ratios to the floor and to the baseline.

Pure functions of the runs bench_cpu.py collected (a run: a dict with ``time_s``, ``cpu_s``,
``samples``, ``bytes``), so the tests can check the figures and the verdicts without
measuring anything.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import common

SECTION = "## CPU per verified GB"
TARGET_VS_FLOOR = 1.5  # shardio's CPU per GB at most this times the floor's
FLOOR = "floor"


def figures(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Medians over ``runs`` of: wall s, CPU-s, CPU-s per GB (10^9 bytes of payload
    delivered), CPU-s per 1,000 samples, MB/s; also the min and max wall and CPU-s."""
    walls = [r["time_s"] for r in runs]
    cpus = [r["cpu_s"] for r in runs]
    return {
        "wall": common.median(walls),
        "wall_min": min(walls),
        "wall_max": max(walls),
        "cpu": common.median(cpus),
        "cpu_min": min(cpus),
        "cpu_max": max(cpus),
        "cpu_gb": common.median([r["cpu_s"] / (r["bytes"] / 1e9) for r in runs]),
        "cpu_1000": common.median([r["cpu_s"] * 1000 / r["samples"] for r in runs]),
        "mbs": common.median([r["bytes"] / 1e6 / r["time_s"] for r in runs]),
        "n": len(runs),
    }


def find(outcomes: Sequence[Any], name: str) -> Any | None:
    """The outcome of configuration ``name``, or None."""
    return next((o for o in outcomes if o.config.name == name), None)


def cell(o: Any | None, fs: str, cache: str) -> dict[str, float] | None:
    """Figures of ``o`` on ``fs`` with ``cache``, or None if it has no run there."""
    runs = o.runs.get((fs, cache)) if o is not None else None
    return figures(runs) if runs else None


def vs_floor(o: Any, outcomes: Sequence[Any], fs: str, cache: str) -> float | None:
    """CPU per GB of ``o`` over the floor's, on the same fs and cache."""
    mine, floor = cell(o, fs, cache), cell(find(outcomes, FLOOR), fs, cache)
    if mine is None or floor is None or floor["cpu_gb"] <= 0:
        return None
    return mine["cpu_gb"] / floor["cpu_gb"]


def ceiling_of(config: Any) -> str:
    """The ceiling row of a shardio configuration: the floor with the one cost its way of
    reading cannot avoid (bench_cpu.py's docstring); "" for other rows.

    Each reads members in a random order (both modes read a shuffled order: map the
    epoch's permutation, stream a window's): in the training process alone, in as many
    processes at once (reader threads), or in a bare DataLoader's workers."""
    if not config.shardio:
        return ""
    if config.child.endswith("-threads"):
        return f"floor-shuffled-p{config.workers}"
    if config.workers:
        return f"floor-loader-w{config.workers}"
    return "floor-shuffled"


def vs_ceiling(o: Any, outcomes: Sequence[Any], fs: str, cache: str) -> float | None:
    """CPU per GB of ``o`` over its ceiling's (:func:`ceiling_of`), same fs and cache."""
    name = ceiling_of(o.config)
    mine = cell(o, fs, cache)
    ceiling = cell(find(outcomes, name), fs, cache) if name else None
    if mine is None or ceiling is None or ceiling["cpu_gb"] <= 0:
        return None
    return mine["cpu_gb"] / ceiling["cpu_gb"]


def verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def floor_verdicts(outcomes: Sequence[Any], fss: Sequence[str], caches: Sequence[str]) -> list[str]:
    """One line per shardio row (this tree's) and fs/cache: CPU/GB ≤ 1.5x the floor's."""
    lines = []
    for o in outcomes:
        if not o.config.shardio or o.config.base:
            continue
        for fs in fss:
            for cache in caches:
                r = vs_floor(o, outcomes, fs, cache)
                head = (
                    f"- {o.config.label}, {fs} {cache}: CPU/GB ≤ {TARGET_VS_FLOOR:g}x the floor: "
                )
                if r is None:
                    lines.append(head + "not measured")
                    continue
                line = f"{head}{r:.2f}x → {verdict(r <= TARGET_VS_FLOOR)}"
                c = vs_ceiling(o, outcomes, fs, cache)
                if c is not None:
                    line += f"; {c:.2f}x its ceiling ({ceiling_of(o.config)})"
                lines.append(line)
    return lines


def baseline_rows(
    outcomes: Sequence[Any], fss: Sequence[str], caches: Sequence[str]
) -> tuple[list[list[str]], list[str]]:
    """Rows new/old (wall and CPU) per shardio row, and verdict lines for "no loss of wall
    time": the new median wall at most the old one's, or within the old runs' min-max
    (PASS, within run-to-run spread); otherwise FAIL."""
    rows: list[list[str]] = []
    lines: list[str] = []
    for o in outcomes:
        if not o.config.shardio or o.config.base:
            continue
        old_o = find(outcomes, o.config.name + "-base")
        for fs in fss:
            for cache in caches:
                new, old = cell(o, fs, cache), cell(old_o, fs, cache)
                if new is None or old is None:
                    continue
                wall, cpu = new["wall"] / old["wall"], new["cpu"] / old["cpu"]
                rows.append(
                    [
                        o.config.label,
                        fs,
                        cache,
                        f"{old['wall']:.2f} ({old['wall_min']:.2f}-{old['wall_max']:.2f})",
                        f"{new['wall']:.2f} ({new['wall_min']:.2f}-{new['wall_max']:.2f})",
                        common.fmt_ratio(wall),
                        f"{old['cpu']:.2f}",
                        f"{new['cpu']:.2f}",
                        common.fmt_ratio(cpu),
                    ]
                )
                if new["wall"] <= old["wall"]:
                    word = verdict(True)
                elif new["wall"] <= old["wall_max"]:
                    word = verdict(True) + " (within the old runs' spread)"
                else:
                    word = verdict(False)
                lines.append(
                    f"- {o.config.label}, {fs} {cache}: wall new/old {wall:.2f}x, CPU "
                    f"new/old {cpu:.2f}x → {word}"
                )
    return rows, lines


def table(outcomes: Sequence[Any], fs: str, cache: str) -> str:
    """The figures of every configuration on ``fs`` with ``cache``."""
    rows = []
    for o in outcomes:
        c = cell(o, fs, cache)
        if c is None:
            why = o.status.get(fs) or "not run"
            rows.append([o.config.label, why[:120], *["-"] * 7])
            continue
        r = vs_floor(o, outcomes, fs, cache)
        c_r = vs_ceiling(o, outcomes, fs, cache)
        rows.append(
            [
                o.config.label,
                f"{c['wall']:.2f} ({c['wall_min']:.2f}-{c['wall_max']:.2f})",
                f"{c['cpu']:.2f} ({c['cpu_min']:.2f}-{c['cpu_max']:.2f})",
                f"{c['cpu_gb']:.2f}",
                f"{c['cpu_1000']:.3f}",
                f"{c['mbs']:.0f}",
                common.fmt_ratio(r) if r is not None else "n/a",
                common.fmt_ratio(c_r) if c_r is not None else "",
                str(int(c["n"])),
            ]
        )
    return common.markdown_table(
        [
            "configuration",
            "wall s, median (min-max)",
            "CPU-s (min-max)",
            "CPU-s / GB",
            "CPU-s / 1,000 samples",
            "MB/s",
            "CPU/GB ÷ floor",
            "÷ its ceiling",
            "runs",
        ],
        rows,
    )


def _shell(argv: Sequence[str], repo: str) -> str:
    return shlex.join(argv).replace(repo + "/", "")


def report(outcomes: Sequence[Any], args: Any, facts: dict[str, Any]) -> str:
    """The section's body: set-up, one table per fs and cache, verdicts, notes, commands."""
    import bench_cpu

    repo = bench_cpu.REPO
    num_samples, payload = facts["sizes"]
    shards = facts["shards"]
    shard_bytes = sum(os.path.getsize(p) for p in shards)
    versions = ", ".join(
        f"{n} {common.package_version(n)}"
        for n in (
            "torch", "numpy", "xxhash", "h5py", "webdataset", "mosaicml-streaming",
            "litdata", "spdl", "nvidia-dali-cuda120",
        )
    )  # fmt: skip
    cmd = ["PYTHONPATH=$PWD", sys.executable, "benchmarks/bench_cpu.py", *args.argv]
    cold = (
        "cold: `sync; echo 3 > /proc/sys/vm/drop_caches` after the child's imports (its "
        "libraries stay mapped), and before `cat`"
        if args.cold_ok
        else "**cold runs are not cold: dropping the caches failed**"
    )
    parts = [
        f"Run {facts['started']}; python {platform.python_version()}; {versions}.",
        "",
        common.code_line(facts["code_before"], facts["code_after"], "read"),
        (
            f"Baseline: `git worktree add --detach TMP {args.baseline}`, its compiled read "
            "path built in place (`bench_cpu.build_native`), on `PYTHONPATH` for the rows "
            "marked @" + args.baseline + " (each child checks which shardio it imported)."
            if args.baseline
            else ""
        ),
        "",
        f"Data: `scripts/gen_imagenet.py --files {args.files} --classes {args.classes} "
        f"--mean-kb {args.mean_kb:g}`: {num_samples} JPEGs, {payload / 1e9:.3f} GB of payload; "
        f"`shardio pack --shard-size {args.shard_size}` into {len(shards)} tar shards "
        f"({shard_bytes / 1e9:.3f} GB) and hdf5 shards, an MDS copy and a litdata copy "
        f"(the same shard size). {args.epochs} epochs per child (`set_epoch` between), bytes "
        f"only, batch size {args.batch_size}; {args.repeat} rounds round-robin (each round "
        f"starting one configuration later), peers {args.peer_repeat}; {cold}; warm runs "
        f"follow a read of the configuration's files. Filesystems: {', '.join(args.fss)}. "
        f"Load average before / after: {facts['load_before']} / {facts['load_after']}; "
        f"measuring took {facts['elapsed_s']:.0f} s. Machine notes: "
        f"{len(os.sched_getaffinity(0))} CPUs shared with other sessions' work (load "
        "above), so wall times are noisy; CPU-seconds much less so.",
        "",
        "CPU-s: user + system time of the child process and of every child it reaped (its "
        "DataLoader workers: the loader is collected and its workers joined before the second "
        "`getrusage`), from just after its imports (the READY/GO handshake) to after the "
        "teardown; threads (SPDL, DALI, mosaic streaming) are in-process. `cat`: its `wait4` "
        "rusage. Not counted: the kernel's page-cache work done outside the process and, on "
        "the bed, the MooseFS daemons and FUSE client. GB = 10^9 bytes of JPEG payload "
        "delivered to the training process (verified, for shardio); the floors and `cat` "
        "carry the whole payload once per epoch. Wall: from after the imports to the last "
        "batch. Every loader row includes the training process's own loop (count the bytes, "
        "read one byte per 4 KiB page of each sample); the floors do not.",
        "",
        "Ceilings: what a configuration cannot avoid, and nothing else: every member read "
        "by one `pread` and hashed with xxh3-64, all members in a random order each epoch "
        "(both shardio modes read a shuffled order: map the epoch's permutation, stream a "
        "window's; on a cold page cache random reads cost the reader more CPU than "
        "sequential ones), in one process; in as many processes at once, each a share "
        "(splitting one reader costs by itself: shared caches and memory bandwidth); and in "
        "a bare `torch.utils.data.DataLoader`'s workers, each reading a batch at a time into "
        "its own reused shared-memory slots and sending only (slot, length, digest), the "
        "training process reading one byte per page (no index, no per-sample work there: "
        'below any loader built on DataLoader workers). "÷ its ceiling": a shardio row '
        "over its configuration's (0 workers: one process; workers: the DataLoader; reader "
        "threads: the processes).",
        "",
    ]
    for fs in args.fss:
        for cache in args.caches:
            parts += [f"**{fs}, {cache}**", "", table(outcomes, fs, cache), ""]
    parts += [
        f"Target: shardio's CPU per GB ≤ {TARGET_VS_FLOOR:g}x the floor's, both modes, "
        "0 and 2 workers, warm and cold, local and bed:",
        "",
        *floor_verdicts(outcomes, args.fss, args.caches),
    ]
    rows, lines = baseline_rows(outcomes, args.fss, args.caches)
    if args.baseline and rows:
        parts += [
            "",
            f"Against {args.baseline} (no loss of wall-time speed anywhere):",
            "",
            common.markdown_table(
                [
                    "configuration",
                    "fs",
                    "cache",
                    f"wall s @{args.baseline}",
                    "wall s now",
                    "wall new/old",
                    f"CPU-s @{args.baseline}",
                    "CPU-s now",
                    "CPU new/old",
                ],
                rows,
            ),
            "",
            *lines,
        ]
    notes = [f"- {o.config.name}: {n}" for o in outcomes for n in o.notes]
    notes += [
        f"- {o.config.name}: {o.live} child process(es) still alive after the loader's "
        "teardown (e.g. multiprocessing's resource tracker); their CPU-s from `/proc` added"
        for o in outcomes
        if o.live
    ]
    notes += [
        f"- {o.config.name} on {fs}: {why}" for o in outcomes for fs, why in o.status.items() if why
    ]
    if "bed" in facts:
        bed = facts["bed"]
        notes.append(f"- bed: `{_shell(bed['bed_argv'], repo)}` (taken down at the end)")
        for what, argv in bed.get("prepared", {}).items():
            notes.append(f"- bed {what}: `{argv}`")
        if bed.get("down_failed"):
            notes.append(f"- **taking the bed down failed**: {bed['down_failed']}")
    if notes:
        parts += ["", "Notes:", "", *notes]
    parts += [
        "",
        "Reproduce (root, for the cold runs and the bed):",
        "",
        "```text",
        " ".join(shlex.quote(c) if i else c for i, c in enumerate(cmd)),
        "```",
        "",
        "Each child (DATA = the configuration's directory; RESULT = a JSON file):",
        "",
        "```text",
        *sorted(
            {
                f"cat DATA/shards/*.tar (x{args.epochs}, one process) > /dev/null"
                if o.config.kind == "cat"
                else _shell(bench_cpu._child_argv(o.config, "DATA", "RESULT", args), repo)
                for o in outcomes
            }
        ),
        "```",
    ]
    return "\n".join(parts)
