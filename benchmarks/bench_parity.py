#!/usr/bin/env python3
"""``--parity 10+2``: what it costs to pack with, what it stores, how fast it rebuilds.

Three measurements, all through shardio's own code on local disk:

1. **Pack overhead**: ``shardio pack`` of the generated ImageNet-like tree (the one
   bench_pack.py makes) with ``--workers 2``, with and without ``--parity 10+2``, alternating,
   ``--repeat`` times each (source in the page cache for both); the median wall times and
   their ratio (target: at most 1.15).
2. **Storage overhead**: parity files and cell tables against the shards, and the manifest's
   growth.
3. **Rebuild of one lost 1 GiB shard**: a dataset of ten 1 GiB shards (one 10+2 group, packed
   from ten 1 GiB files) loses shard 0; with the page cache dropped, the rebuild
   (``shardio.parity.dataset.rebuild_files``, in a child process: its peak RSS is reported) is
   timed against reading every file of the group once, cold (target: faster).

``python benchmarks/bench_parity.py [--repeat 3] [--files 4000] [--mean-kb 110]``; writes
the section "## Parity (--parity 10+2)" of benchmarks/RESULTS.md (``--no-write``: print only).
Needs root for the cold runs (drop_caches); says "warm" otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Parity (--parity 10+2)"
SCHEME = "10+2"

_REBUILD = """
import json, os, resource, sys, time
from shardio.format.manifest import load_manifest
from shardio.parity.dataset import rebuild_files
root = sys.argv[1]
man = load_manifest(os.path.join(root, "manifest.json"))
began = time.perf_counter()
done = rebuild_files(root, man, 0, [man.shards[0].path])
took = time.perf_counter() - began
print(json.dumps({"seconds": took, "rebuilt": list(done.rebuilt),
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _pack(src: str, dst: str, *extra: str) -> float:
    common.remove_path(dst)
    argv = [sys.executable, "-m", "shardio", "pack", src, dst, "--workers", "2",
            "--shard-size", "64MiB", "--no-progress", *extra]  # fmt: skip
    run = common.run_child(argv)
    if run.returncode != 0:
        raise SystemExit(f"pack failed:\n{run.stderr_tail}")
    return run.wall_s


def _read_all(paths: list[str]) -> float:
    began = time.perf_counter()
    buf = bytearray(8 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - began


def _big_dataset(workdir: str) -> str:
    """Ten 1 GiB files packed into ten 1 GiB shards with --parity 10+2 (kept between runs)."""
    root = os.path.join(workdir, "parity-1gib", "ds")
    stamp = root + ".done"
    if os.path.exists(stamp):
        return root
    tree = os.path.join(workdir, "parity-1gib", "tree", "c0")
    os.makedirs(tree, exist_ok=True)
    for i in range(10):
        with open(os.path.join(tree, f"{i:02d}.bin"), "wb") as fh:
            for _ in range(1024 - 1):  # a shard is its one member plus the tar headers
                fh.write(os.urandom(1 << 20))
            fh.write(os.urandom((1 << 20) - 4096))
    common.remove_path(root)
    argv = [sys.executable, "-m", "shardio", "pack", os.path.dirname(tree), root,
            "--shard-size", "1GiB", "--parity", SCHEME, "--workers", "2",
            "--no-progress"]  # fmt: skip
    run = common.run_child(argv)
    if run.returncode != 0:
        raise SystemExit(f"pack failed:\n{run.stderr_tail}")
    common.remove_path(os.path.dirname(tree))
    with open(stamp, "w") as fh:
        fh.write("ok\n")
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rebuilds", type=int, default=3, help="rebuild/read pairs")
    parser.add_argument("--files", type=int, default=4000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--mean-kb", type=float, default=110)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    common.hold_bench_lock(args.workdir)
    before = common.code_state(REPO)
    from shardio.format.manifest import load_manifest

    # 1. pack overhead
    src = common.ensure_tree(REPO, args.workdir, files=args.files, classes=args.classes,
                             mean_kb=args.mean_kb)  # fmt: skip
    common.warm_up(src)
    plain_dst = os.path.join(args.workdir, "parity-plain")
    parity_dst = os.path.join(args.workdir, "parity-10+2")
    plain, parity = [], []
    for _ in range(args.repeat):
        plain.append(_pack(src, plain_dst))
        parity.append(_pack(src, parity_dst, "--parity", SCHEME))
    p_med, q_med = common.median(plain), common.median(parity)
    ratio = q_med / p_med
    payload = common.tree_payload(src)[1]
    print(f"pack: plain {p_med:.2f} s, --parity {SCHEME} {q_med:.2f} s ({ratio:.3f}x)",
          file=sys.stderr)  # fmt: skip

    # 2. storage overhead
    man = load_manifest(os.path.join(parity_dst, "manifest.json"))
    base = load_manifest(os.path.join(plain_dst, "manifest.json"))
    assert man.parity is not None
    tables = sum(g.cells.size_bytes for g in man.parity.groups)
    parity_bytes = man.parity.total_bytes - tables
    grow = os.path.getsize(os.path.join(parity_dst, "manifest.json")) - os.path.getsize(
        os.path.join(plain_dst, "manifest.json")
    )
    groups = [g.num_shards for g in man.parity.groups]

    # 3. rebuild of one lost 1 GiB shard
    root = _big_dataset(args.workdir)
    big = load_manifest(os.path.join(root, "manifest.json"))
    assert big.parity is not None and len(big.parity.groups) == 1
    files = [os.path.join(root, s.path) for s in big.shards]
    files += [os.path.join(root, f.path) for f in big.parity.groups[0].parity]
    group_bytes = sum(os.path.getsize(f) for f in files)
    lost = files[0]
    saved = lost + ".saved"
    reads, rebuilds, rss = [], [], []
    cold = True
    for n in range(args.rebuilds):  # alternating which goes first: the host caches too
        for what in ("read", "rebuild") if n % 2 else ("rebuild", "read"):
            if what == "read":
                cold = common.drop_caches() and cold
                reads.append(_read_all(files))
                continue
            os.rename(lost, saved)
            try:
                result = _rebuild_figures(root)
                if result["rebuilt"] != [big.shards[0].path]:
                    raise SystemExit(f"the rebuild wrote {result['rebuilt']}, not the lost shard")
            finally:
                if os.path.exists(lost):
                    os.unlink(saved)
                else:
                    os.rename(saved, lost)
            rebuilds.append(result["seconds"])
            rss.append(result["max_rss"])
    read_s, rebuild_s = common.median(reads), common.median(rebuilds)
    result = {"seconds": rebuild_s, "max_rss": max(rss)}
    shard_bytes = big.shards[0].size_bytes
    print(f"rebuild: {rebuild_s:.2f} s, cold read of the group {read_s:.2f} s (medians)",
          file=sys.stderr)  # fmt: skip
    after = common.code_state(REPO)

    rows_pack = [
        ["plain", f"{p_med:.2f}", f"{payload / p_med / 1e6:.0f}", "1.00"],
        [f"--parity {SCHEME}", f"{q_med:.2f}", f"{payload / q_med / 1e6:.0f}", f"{ratio:.3f}"],
    ]
    runs = (
        f"plain {', '.join(f'{v:.2f}' for v in plain)} s; "
        f"parity {', '.join(f'{v:.2f}' for v in parity)} s"
    )
    share = parity_bytes / base.total_bytes
    rate = shard_bytes / result["seconds"] / 1e9
    pack_text = (
        f"**Pack overhead** (target: at most 15% slower with 2 workers). The tree of "
        f"{args.files:,} files ({payload / 1e6:,.0f} MB, bench_pack.py's), `--workers 2 "
        f"--shard-size 64MiB`, source in the page cache, plain and `--parity {SCHEME}` "
        f"alternating, median of {args.repeat} (runs: {runs}):"
    )
    storage_text = (
        f"**Storage overhead**: {len(base.shards)} shards ({base.total_bytes / 1e6:,.1f} MB) "
        f"in {len(groups)} groups of {groups}: parity files {parity_bytes / 1e6:,.1f} MB "
        f"({share:.1%} of the shards; M/K = 20%, more when the last group is short, as its "
        f"parity is as long as its longest shard), cell tables {tables:,} bytes "
        f"({tables / base.total_bytes:.4%}), manifest +{grow:,} bytes. A full group: "
        f"{big.parity.total_bytes / big.total_bytes:.2%} (the 1 GiB dataset below)."
    )
    rebuild_text = (
        f"**Rebuild of one lost 1 GiB shard** (target: faster than reading its group once "
        f"from disk, cold). Ten 1 GiB shards, one 10+2 group ({group_bytes / 2**30:.1f} GiB "
        f"with its parity); page cache {'dropped' if cold else 'warm (not root)'} before "
        f"each, {args.rebuilds} of each alternating which runs first (the VM's disk has a "
        f"cache on its host, which no drop_caches here empties; runs: read "
        f"{', '.join(f'{v:.2f}' for v in reads)} s, rebuild "
        f"{', '.join(f'{v:.2f}' for v in rebuilds)} s). Median: reading all 12 files once "
        f"took {read_s:.2f} s ({group_bytes / read_s / 1e9:.2f} GB/s); the rebuild (reads "
        f"the 9 surviving data "
        f"shards and one parity file, decodes, checks every cell against the cell table, "
        f"writes and fsyncs the shard, checks its xxh3-128) took {result['seconds']:.2f} s "
        f"({10 * shard_bytes / result['seconds'] / 1e9:.2f} GB/s of survivors read, "
        f"{rate:.2f} GB/s of shard rebuilt; {result['seconds'] / read_s:.2f}x the cold read "
        f"of the group), with a peak RSS of {result['max_rss'] / 2**20:.0f} MiB for a 1 GiB "
        "shard (rows of 12 x 1 MiB cells: memory does not grow with the shard)."
    )
    body = "\n".join(
        [
            f"`python benchmarks/bench_parity.py --repeat {args.repeat} --rebuilds "
            f"{args.rebuilds}`. " + common.code_line(before, after, "pack"),
            "",
            pack_text,
            "",
            common.markdown_table(["pack", "seconds", "MB/s of payload", "ratio"], rows_pack),
            "",
            storage_text,
            "",
            rebuild_text,
            "",
            f"- `pack --parity {SCHEME}` wall <= 1.15x plain, 2 workers: {ratio:.3f}x → "
            f"**{'PASS' if ratio <= 1.15 else 'FAIL'}**",
            f"- rebuild of one lost 1 GiB shard < one cold read of its group: "
            f"{rebuild_s / read_s:.2f}x → **{'PASS' if rebuild_s < read_s else 'FAIL'}**",
        ]
    )
    print(body)
    if not args.no_write:
        common.update_section(args.out, SECTION, body, common.results_header(args.workdir))
    return 0


def _rebuild_figures(root: str) -> dict[str, Any]:
    """Drop the page cache, rebuild shard 0 in a child; its seconds, files and peak RSS."""
    import subprocess

    common.drop_caches()
    proc = subprocess.run([sys.executable, "-c", _REBUILD, root], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"rebuild failed:\n{proc.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
