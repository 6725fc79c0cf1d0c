"""Pack at scale: a tree of 1,000,000 small files packed as 4 ``--part`` processes and a merge.

The tree (``--files`` files of ``--min-bytes`` to ``--max-bytes`` bytes in ``--classes``
class directories) is generated once under ``--workdir`` (a ``.done`` stamp marks it
complete). Then, from a cold page cache where permitted, ``--repeat`` times each:

- ``shardio pack TREE OUT --part I/N --workers W`` for I = 0..N-1 as N concurrent processes,
  then ``shardio merge OUT`` and ``shardio verify OUT``;
- ``shardio pack TREE OUT --workers N*W`` (one process, the same worker count in all), and
  ``shardio verify`` of it.

Reported: median wall times (the parts, each and together, the merge, parts + merge, the
single pack), files/s and MB/s of source payload, the metadata calls each part made on the
source (from the pack report: directory listings, stat calls, opens), whether verify passed,
and beside them the arithmetic for a real cluster: metadata operations per epoch of
ImageNet-1k as loose files against shardio, at an assumed range of Lustre MDS rates. The
section "## Packing 1,000,000 files" of benchmarks/RESULTS.md is rewritten; other sections
are kept.

Usage::

    .venv/bin/python benchmarks/bench_scale_pack.py [--files 1000000] [--parts 4]
        [--part-workers 1] [--shard-size 256MiB] [--repeat 1] [--workdir .bench]
        [--out benchmarks/RESULTS.md] [--no-write] [--regen] [--keep]

Not a test: it measures and reports, and asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
SECTION = "## Packing 1,000,000 files"
GiB = 1024**3
MiB = 1024**2

# ImageNet-1k (ILSVRC2012) training set: files, class directories, bytes (about 140 GB).
IMAGENET_FILES = 1_281_167
IMAGENET_CLASSES = 1_000
IMAGENET_BYTES = 140 * 10**9
# An assumed range of small-file metadata operations one Lustre MDS sustains under load (an
# assumption for the arithmetic, not a measurement: it depends on the MDS hardware, the
# Lustre version, DNE and what else the filesystem serves).
MDS_RATES = (20_000, 50_000)
READERS = 1024  # reading processes of the example job: 16 nodes x 8 GPUs x 8 loader workers
IMAGES_PER_S = 50_000  # the example job's training speed (images/s, all GPUs)


# --------------------------------------------------------------------------------------------
# The tree.
# --------------------------------------------------------------------------------------------


def _sizes(n: int, lo: int, hi: int) -> list[int]:
    """Deterministic file sizes in [lo, hi] (a multiplicative hash of the file number)."""
    span = hi - lo + 1
    return [lo + (i * 2654435761 % 4294967296) % span for i in range(n)]


def _generate(tree: str, files: int, classes: int, lo: int, hi: int) -> None:
    """Write ``files`` files in ``classes`` directories: os.open/os.write/os.close per file,
    every byte drawn from one random pool (so each file differs, and it stays fast)."""
    pool = os.urandom(1 << 20)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    sizes = _sizes(files, lo, hi)
    per_class = math.ceil(files / classes)
    start = time.perf_counter()
    for c in range(classes):
        folder = os.path.join(tree, f"c{c:04d}")
        os.makedirs(folder)
        for i in range(c * per_class, min(files, (c + 1) * per_class)):
            size = sizes[i]
            off = (i * 7919) % (len(pool) - size)
            fd = os.open(os.path.join(folder, f"f{i:07d}.bin"), flags, 0o644)
            os.write(fd, pool[off : off + size])
            os.close(fd)
        if c % 100 == 99:
            done = min(files, (c + 1) * per_class)
            rate = done / (time.perf_counter() - start)
            print(f"  {done:,} files ({rate:,.0f} files/s)", file=sys.stderr, flush=True)


def ensure_tree(workdir: str, files: int, classes: int, lo: int, hi: int, regen: bool) -> str:
    """The generated tree under ``workdir``, made unless its ``.done`` stamp exists."""
    tree = os.path.join(workdir, f"scale-tree-f{files}-c{classes}-b{lo}-{hi}")
    stamp = tree + ".done"
    if os.path.exists(stamp) and not regen:
        return tree
    common.remove_path(tree)
    common.remove_path(stamp)
    print(f"generating {files:,} files in {tree}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    _generate(tree, files, classes, lo, hi)
    os.sync()
    took = time.perf_counter() - start
    with open(stamp, "w") as fh:
        fh.write(f"{files} files, {classes} classes, {lo}-{hi} bytes; generated in {took:.0f} s\n")
    return tree


# --------------------------------------------------------------------------------------------
# The runs.
# --------------------------------------------------------------------------------------------


@dataclass
class Round:
    """One repetition: the part runs with their merge and verify, and the single pack."""

    part_walls: list[float] = field(default_factory=list)
    parts_wall: float = 0.0  # first part started to last part ended
    merge_wall: float = 0.0
    single_wall: float = 0.0
    verify_parts: str = ""
    verify_single: str = ""
    scan_s: dict[str, float] = field(default_factory=dict)  # one part's scan: list, stat
    part_calls: list[dict[str, int]] = field(default_factory=list)
    single_calls: dict[str, int] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    out_bytes: int = 0
    shards: tuple[int, int] = (0, 0)
    errors: list[str] = field(default_factory=list)


def _shardio() -> str:
    return os.path.join(VENV_BIN, "shardio")


def _part_argv(tree: str, out: str, part: int, args: argparse.Namespace) -> list[str]:
    return [
        _shardio(),
        "pack",
        tree,
        out,
        "--part",
        f"{part}/{args.parts}",
        "--workers",
        str(args.part_workers),
        "--shard-size",
        args.shard_size,
        "--no-progress",
    ]


def _single_argv(tree: str, out: str, args: argparse.Namespace) -> list[str]:
    return [
        _shardio(),
        "pack",
        tree,
        out,
        "--workers",
        str(args.parts * args.part_workers),
        "--shard-size",
        args.shard_size,
        "--no-progress",
    ]


def _check(run: common.ChildRun, what: str, rnd: Round) -> bool:
    if run.returncode == 0:
        return True
    rnd.errors.append(f"{what}: exit {run.returncode}: {run.stderr_tail.strip()[-400:]}")
    print(rnd.errors[-1], file=sys.stderr)
    return False


def _verify(out: str, args: argparse.Namespace, rnd: Round) -> str:
    argv = [_shardio(), "verify", out, "--workers", str(args.parts), "--no-progress"]
    run = common.run_child(argv)
    status = "passed" if run.returncode == 0 else f"**FAILED** (exit {run.returncode})"
    print(f"  verify {os.path.basename(out)}: {status} in {run.wall_s:.1f} s", file=sys.stderr)
    if run.returncode != 0:
        rnd.errors.append(f"verify {out}: {run.stderr_tail.strip()[-400:]}")
    return f"{status} in {run.wall_s:.1f} s"


def _report_calls(out: str) -> dict[str, Any]:
    with open(os.path.join(out, "pack-report.json"), encoding="utf-8") as fh:
        return json.load(fh)["source_calls"]  # type: ignore[no-any-return]


def _shard_count(out: str) -> int:
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as fh:
        return len(json.load(fh)["shards"])


# One part's scan alone, in a child: list the whole tree, then stat part 0's files.
_SCAN = r"""
import json, sys, time
from shardio.packing.calls import SourceCalls
from shardio.packing.scan import list_tree, resolve_samples
calls = SourceCalls()
t0 = time.perf_counter()
listing = list_tree(sys.argv[1], calls=calls)
t1 = time.perf_counter()
_first, groups = listing.part(0, int(sys.argv[2]))
resolve_samples(sys.argv[1], listing, groups, calls=calls)
t2 = time.perf_counter()
print(json.dumps({"list_s": t1 - t0, "stat_s": t2 - t1, **calls.to_json()}))
"""


def _time_scan(tree: str, args: argparse.Namespace) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _SCAN, tree, str(args.parts)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        print(f"scan timing failed: {proc.stderr[-400:]}", file=sys.stderr)
        return {}
    out: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _run_round(tree: str, args: argparse.Namespace, rep: int) -> tuple[Round, bool]:
    rnd = Round()
    cold = common.drop_caches()
    rnd.scan_s = _time_scan(tree, args)
    print(f"[{rep}] scan of one part: {rnd.scan_s}", file=sys.stderr, flush=True)
    out_parts = os.path.join(args.workdir, "scale-out-parts")
    out_single = os.path.join(args.workdir, "scale-out-single")
    common.remove_path(out_parts)
    common.remove_path(out_single)
    cold = common.drop_caches() and cold
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.parts, thread_name_prefix="bench") as pool:
        futures = [
            pool.submit(common.run_child, _part_argv(tree, out_parts, i, args))
            for i in range(args.parts)
        ]
        runs = [f.result() for f in futures]
    rnd.parts_wall = time.perf_counter() - start
    rnd.part_walls = [r.wall_s for r in runs]
    rnd.peak_rss["part"] = max(r.peak_tree_rss_bytes for r in runs)
    ok = all(_check(r, f"part {i}/{args.parts}", rnd) for i, r in enumerate(runs))
    print(
        f"[{rep}] {args.parts} parts: {rnd.parts_wall:.1f} s "
        f"({', '.join(f'{w:.1f}' for w in rnd.part_walls)})",
        file=sys.stderr,
        flush=True,
    )
    if ok:
        merge = common.run_child([_shardio(), "merge", out_parts, "--no-progress"])
        rnd.merge_wall = merge.wall_s
        rnd.peak_rss["merge"] = merge.peak_tree_rss_bytes
        print(f"[{rep}] merge: {merge.wall_s:.1f} s", file=sys.stderr, flush=True)
        if _check(merge, "merge", rnd):
            rnd.part_calls = _report_calls(out_parts)["parts"]
            rnd.out_bytes = common.path_bytes(out_parts)
            rnd.verify_parts = _verify(out_parts, args, rnd)
            rnd.shards = (_shard_count(out_parts), 0)
    common.remove_path(out_parts)
    cold = common.drop_caches() and cold
    single = common.run_child(_single_argv(tree, out_single, args))
    rnd.single_wall = single.wall_s
    rnd.peak_rss["single"] = single.peak_tree_rss_bytes
    print(f"[{rep}] single pack: {single.wall_s:.1f} s", file=sys.stderr, flush=True)
    if _check(single, "single pack", rnd):
        rnd.single_calls = _report_calls(out_single)["total"]
        rnd.verify_single = _verify(out_single, args, rnd)
        rnd.shards = (rnd.shards[0], _shard_count(out_single))
    if not args.keep:
        common.remove_path(out_single)
    return rnd, cold


# --------------------------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------------------------


def _fmt_s(values: Sequence[float]) -> str:
    med = common.median(values)
    if len(values) == 1:
        return f"{med:.1f}"
    return f"{med:.1f} ({min(values):.1f}-{max(values):.1f})"


def _secs(value: float) -> str:
    """Seconds with two significant digits below 10 (0.044), one decimal above."""
    return f"{value:.2g}" if value < 10 else f"{value:,.1f}"


def _cluster_rows() -> tuple[list[list[str]], list[str]]:
    """Metadata operations per epoch of ImageNet-1k: loose files against shardio."""
    lo, hi = MDS_RATES
    listings = IMAGENET_CLASSES + 1
    rows: list[list[str]] = []

    def row(what: str, ops: int) -> None:
        rows.append(
            [
                what,
                f"{ops:,}",
                f"{_secs(ops / hi)}-{_secs(ops / lo)}",
                f"{ops / IMAGENET_FILES:.4f}",
            ]
        )

    for stats in (1, 2):
        row(
            f"loose files: 1 open + {stats} stat{'s' if stats > 1 else ''} per file, "
            f"{listings:,} directory listings",
            IMAGENET_FILES * (1 + stats) + listings,
        )
    notes = []
    for size, name in ((GiB, "1 GiB"), (256 * MiB, "256 MiB")):
        shards = math.ceil(IMAGENET_BYTES / size)
        row(
            f"shardio, {name} shards ({shards:,}): every one of {READERS:,} reading "
            "processes opens every shard once, + manifest and index each",
            shards * READERS + 2 * READERS,
        )
        row(
            f"shardio, {name} shards ({shards:,}): each shard read by one process "
            f"(shard-aware order), + manifest and index in each of {READERS:,}",
            shards + 2 * READERS,
        )
        notes.append(f"{shards:,} shards of {name}")
    return rows, notes


def _scan_lines(rounds: Sequence[Round], args: argparse.Namespace) -> list[str]:
    """What one part's scan costs alone: the whole tree's listing, then its own stats."""
    timed = [r.scan_s for r in rounds if r.scan_s]
    if not timed:
        return ["Scan of one part: not measured."]
    list_s = common.median([t["list_s"] for t in timed])
    stat_s = common.median([t["stat_s"] for t in timed])
    last = timed[-1]
    ok = [r for r in rounds if not r.errors]
    which = "not measured"
    if ok:
        parts_s = common.median([r.parts_wall + r.merge_wall for r in ok])
        single_s = common.median([r.single_wall for r in ok])
        which = (
            f"the single pack is {parts_s / single_s:.2f}x faster here"
            if single_s < parts_s
            else f"the parts + merge are {single_s / parts_s:.2f}x faster even here"
        )
    return [
        f"The scan of one part alone (a child process, cold cache, nothing else of this "
        f"benchmark running): listing the whole tree ({int(last['dirs_listed']):,} "
        f"directories, {int(last['entries_seen']):,} entries, grouped and sorted into the "
        f"global sample list) took {list_s:.1f} s, and stat'ing part 0's "
        f"{int(last['stat_calls']):,} files {stat_s:.1f} s. Every part pays the listing, so "
        f"on this {os.cpu_count()}-CPU machine the {args.parts} concurrent parts spend "
        f"about {args.parts - 1} x {list_s:.1f} s of CPU that the single pack does not, and "
        f"share the CPUs besides: {which}. On a cluster each part "
        "runs on its own node, and the parts divide the stat calls, the opens, the reads, "
        "the hashing and the shard writes between them.",
    ]


def _report(
    rounds: Sequence[Round],
    *,
    args: argparse.Namespace,
    tree: str,
    num_files: int,
    payload: int,
    cold: bool,
    started: str,
    load_before: str,
    load_after: str,
    code_before: common.CodeState,
    code_after: common.CodeState,
    gen_note: str,
) -> str:
    ok = [r for r in rounds if not r.errors]
    last = rounds[-1]
    w = args.part_workers
    rows: list[list[str]] = []

    def row(
        label: str,
        walls: Sequence[float],
        calls: dict[str, int] | None,
        rss: str,
        *,
        files: int,
        payload_bytes: int,
    ) -> None:
        if not walls:
            rows.append([label, "failed", "-", "-", "-", "-", "-", "-", rss])
            return
        med = common.median(walls)
        counts = (
            [f"{calls[k]:,}" for k in ("dirs_listed", "stat_calls", "opens", "fstat_calls")]
            if calls
            else ["-"] * 4
        )
        rows.append(
            [
                label,
                _fmt_s(walls),
                f"{files / med:,.0f}" if files else "-",
                f"{payload_bytes / 1e6 / med:.1f}" if payload_bytes else "-",
                *counts,
                rss,
            ]
        )

    mib = common.MiB
    for i in range(args.parts):
        calls = last.part_calls[i] if last.part_calls else None
        row(
            f"part {i}/{args.parts} (`--part {i}/{args.parts} --workers {w}`)",
            [r.part_walls[i] for r in rounds if r.part_walls],
            calls,
            "",
            files=calls["opens"] if calls else 0,  # the files this part packed
            payload_bytes=0,
        )
    totals = None
    if last.part_calls:
        totals = {k: sum(c[k] for c in last.part_calls) for k in last.part_calls[0]}
    row(
        f"{args.parts} parts together (concurrent; first start to last end)",
        [r.parts_wall for r in ok],
        totals,
        f"{max(r.peak_rss.get('part', 0) for r in rounds) / mib:,.0f} (largest part)",
        files=num_files,
        payload_bytes=payload,
    )
    row(
        "`shardio merge`",
        [r.merge_wall for r in ok],
        None,
        f"{max(r.peak_rss.get('merge', 0) for r in rounds) / mib:,.0f}",
        files=0,
        payload_bytes=0,
    )
    row(
        "parts + merge",
        [r.parts_wall + r.merge_wall for r in ok],
        totals,
        "",
        files=num_files,
        payload_bytes=payload,
    )
    row(
        f"single `shardio pack --workers {args.parts * w}`",
        [r.single_wall for r in rounds if r.single_calls],
        last.single_calls or None,
        f"{max(r.peak_rss.get('single', 0) for r in rounds) / mib:,.0f}",
        files=num_files,
        payload_bytes=payload,
    )
    table = common.markdown_table(
        [
            "run",
            "wall s" + (", median (min-max)" if len(rounds) > 1 else ""),
            "files/s",
            "MB/s",
            "directory listings",
            "stat calls",
            "opens",
            "fstat",
            "peak RSS MiB (process tree)",
        ],
        rows,
    )
    cluster, shard_notes = _cluster_rows()
    cluster_table = common.markdown_table(
        [
            "ImageNet-1k, one epoch",
            "metadata operations",
            f"seconds of one MDS at {MDS_RATES[1]:,}-{MDS_RATES[0]:,} ops/s",
            "per image",
        ],
        cluster,
    )
    lo, hi = MDS_RATES
    epoch_s = IMAGENET_FILES / IMAGES_PER_S
    loose_rate = (IMAGENET_FILES * 2 + IMAGENET_CLASSES + 1) / epoch_s
    shard_1g = math.ceil(IMAGENET_BYTES / GiB)
    shard_rate = (shard_1g * READERS + 2 * READERS) / epoch_s
    cache = (
        "cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before the parts and before the "
        "single pack"
        if cold
        else "**warm**: dropping caches was not permitted (not root)"
    )
    per_file = [
        f"{c['stat_calls'] / max(c['opens'], 1):.2f}" for c in last.part_calls
    ]  # stat calls per file opened, per part
    versions = ", ".join(f"{n} {common.package_version(n)}" for n in ("shardio", "xxhash"))
    argv = [
        ".venv/bin/python",
        "benchmarks/bench_scale_pack.py",
        "--files",
        str(args.files),
        "--parts",
        str(args.parts),
        "--part-workers",
        str(w),
        "--shard-size",
        args.shard_size,
        "--repeat",
        str(args.repeat),
    ]
    scale_note = ""
    if args.files != 1_000_000:
        scale_note = (
            f" **This run packed {args.files:,} files, not 1,000,000** (the figures scale "
            "with the file count; rerun with the default `--files` for the full size)."
        )
    parts = [
        f"Run {started}; {versions}.{scale_note}",
        "",
        common.code_line(code_before, code_after, "pack"),
        "",
        f"Data: {num_files:,} files of {args.min_bytes:,}-{args.max_bytes:,} bytes in "
        f"{args.classes:,} class directories, {payload / 1e9:.3f} GB of payload, "
        f"generated by this script ({gen_note}). Shard size {args.shard_size}; tar shards; "
        f"every shard fsync'ed. Cache: {cache}. {args.repeat} round(s); the outputs are "
        f"deleted after each. Load average before / after: {load_before} / {load_after}. "
        f"Shards: {last.shards[0]:,} from the parts, {last.shards[1]:,} from the single pack; "
        f"dataset size {last.out_bytes / 1e9:.2f} GB.",
        "",
        table,
        "",
        f"files/s is the tree's {num_files:,} files over the wall time (a part: the files "
        "it packed over its wall time); MB/s is source payload (10^6 "
        f"bytes) over wall time. `shardio verify` of the merged dataset: "
        f"{last.verify_parts or 'not run'}; of the single pack's: "
        f"{last.verify_single or 'not run'}.",
        "",
        "The metadata columns are the pack's own counts (`source_calls` in pack-report.json; "
        "strace agrees: tests/integration/test_pack_syscalls.py): each part lists every "
        "directory of the tree (so that every part computes the same global sample list "
        f"without talking to the others), so the {args.parts} parts together list the tree "
        f"{args.parts} times, but each file is stat'ed once, by the part that packs it, and "
        "opened once to be read (stat calls per opened file, per part: "
        f"{', '.join(per_file) or '-'}). Nothing else on the source is stat'ed: no stat per "
        "directory (the C library's opendir adds one fstat per directory listed), no fstat "
        "of a small file when it is read (only files above the 16 MiB stream threshold are "
        "fstat'ed once opened).",
        "",
        *_scan_lines(rounds, args),
        "",
        "### Metadata operations per epoch on a real cluster",
        "",
        f"ImageNet-1k's training set: {IMAGENET_FILES:,} files in {IMAGENET_CLASSES:,} "
        f"class directories, about {IMAGENET_BYTES / 1e9:.0f} GB ({', '.join(shard_notes)}). "
        "A loose-file loader (torchvision `ImageFolder`) opens every file every epoch, and "
        "Python's `open()` fstats what it opens, so a file costs an open and one or two "
        "stats (plus the close, which Lustre also sends to the MDS; not counted here). "
        f"shardio opens a shard once per reading process and epoch at most ({READERS:,} "
        "processes: e.g. 16 nodes x 8 GPUs x 8 loader workers, every one reading from every "
        "shard in a global random order), and the manifest and index once per process; "
        "it stats nothing per sample (tests/unit/runtime/test_syscalls.py). MDS rates: an "
        f"**assumed** range of {lo:,}-{hi:,} small-file metadata operations per second "
        "for one Lustre MDS under load (not measured here; it depends on the hardware, the "
        "Lustre version, DNE and the other jobs).",
        "",
        cluster_table,
        "",
        f"At {IMAGES_PER_S:,} images/s (an epoch every {epoch_s:.0f} s), loose files ask "
        f"the MDS for about {loose_rate:,.0f} operations/s ({loose_rate / hi:.1f}-"
        f"{loose_rate / lo:.1f} MDS at the assumed rates, for this one job); shardio with "
        f"1 GiB shards and every process opening every shard, about {shard_rate:,.0f}/s "
        f"({shard_rate / lo * 100:.0f}% of one MDS at the low rate), and nothing once the "
        "shards are staged to node-local NVMe. Packing itself costs one loose-file epoch of "
        "opens and stats, once (the table above), plus one directory listing of the tree "
        "per part.",
    ]
    errors = [e for r in rounds for e in r.errors]
    if errors:
        parts += ["", "Errors:", "", *(f"- {e}" for e in errors)]
    parts += [
        "",
        "Reproduce:",
        "",
        "```",
        shlex.join(argv),
        "```",
        "",
        "Commands timed (TREE = the generated tree, OUT = a fresh path under --workdir):",
        "",
        "```",
        *(
            shlex.join(_part_argv("TREE", "OUT", i, args)).replace(VENV_BIN + "/", "") + " &"
            for i in range(args.parts)
        ),
        "wait",
        "shardio merge OUT --no-progress",
        shlex.join(_single_argv("TREE", "OUT", args)).replace(VENV_BIN + "/", ""),
        "```",
    ]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Generate the tree if needed, run the packs, update RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--min-bytes", type=int, default=200)
    parser.add_argument("--max-bytes", type=int, default=2000)
    parser.add_argument("--parts", type=int, default=4, help="concurrent --part processes")
    parser.add_argument("--part-workers", type=int, default=1, help="--workers of each part")
    parser.add_argument("--shard-size", default="256MiB")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--regen", action="store_true", help="regenerate the source tree")
    parser.add_argument("--keep", action="store_true", help="keep the single pack's output")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    if not 0 < args.min_bytes <= args.max_bytes < (1 << 20):
        parser.error("need 0 < --min-bytes <= --max-bytes < 1 MiB")
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    common.hold_bench_lock(args.workdir)
    need = args.files * (4096 + 2 * (args.max_bytes + 1536))  # tree blocks + two datasets
    free = shutil.disk_usage(args.workdir).free
    if free < need:
        raise SystemExit(f"{args.workdir}: {free / 1e9:.1f} GB free, need ~{need / 1e9:.1f} GB")

    tree = ensure_tree(
        args.workdir, args.files, args.classes, args.min_bytes, args.max_bytes, args.regen
    )
    with open(tree + ".done", encoding="utf-8") as fh:
        gen_note = fh.read().strip()
    num_files, payload = common.tree_payload(tree)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_before = common.loadavg()
    code_before = common.code_state(REPO)
    rounds: list[Round] = []
    cold = True
    for rep in range(1, args.repeat + 1):
        rnd, rnd_cold = _run_round(tree, args, rep)
        rounds.append(rnd)
        cold = cold and rnd_cold
    body = _report(
        rounds,
        args=args,
        tree=tree,
        num_files=num_files,
        payload=payload,
        cold=cold,
        started=started,
        load_before=load_before,
        load_after=common.loadavg(),
        code_before=code_before,
        code_after=common.code_state(REPO),
        gen_note=gen_note,
    )
    common.publish(body, SECTION, args)
    return 0 if all(not r.errors for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
