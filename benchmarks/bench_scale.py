"""Scale-out: what a node stages, and what a rank pays at start-up, from 10**6 to 10**9 samples.

One run measures:

1. staged bytes per node for N = 4, 16 and 64 simulated nodes of 8 ranks each, for the
   order of today without a partition (every rank reads from the whole dataset) against the
   ``node`` and ``rotating`` partitions, on an ImageNet-sized manifest (1,281,167 samples in
   shards of 64 MiB and of 256 MiB). Computed with ``node_shard_order`` (what
   ``shardio stage --node I/N`` copies), no bytes are copied;
2. the mixing a partition trades away: distinct shards that feed one rank over E epochs;
3. start-up of one rank of 512 (8 per node): ``ShardDataset(path)`` and its epoch order's
   first 4,096 samples, in a fresh process each, for 10**6, 10**8 and 10**9 samples in
   100,000 shards (fewer for the smaller sizes), for every order; time and resident memory
   added (RSS after minus RSS before, torch already imported), medians of ``--repeat``.
   The datasets are synthetic (scripts/gen_synthetic.py: a real manifest and index header
   over sparse record tables).

The section "## Scale-out" of benchmarks/RESULTS.md gets the figures. Not a test.

Usage::

    .venv/bin/python benchmarks/bench_scale.py [--repeat 3] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Scale-out"
IMAGENET_SAMPLES = 1_281_167
IMAGENET_BYTES = 140 * 10**9
RANKS_PER_NODE = 8
SPECS = (
    "order=random,partition=none",
    "order=shard-local,partition=none",
    "order=random,partition=node",
    "order=shard-local,partition=node",
    "order=shard-local,partition=rotating,rotate=0.25",
)
PROBE = os.path.join(REPO, "scripts", "probe_startup.py")


def _imagenet_manifest(shard_bytes: int) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_synthetic", os.path.join(REPO, "scripts", "gen_synthetic.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shards = -(-IMAGENET_BYTES // shard_bytes)
    return module.synthetic_manifest(
        samples=IMAGENET_SAMPLES, shards=shards, shard_bytes=shard_bytes
    )


def _staged_per_node(shard_bytes: int) -> list[list[str]]:
    from shardio.order import OrderSpec
    from shardio.staging import StageOptions, node_shard_order

    manifest = _imagenet_manifest(shard_bytes)
    rows = []
    for nodes in (4, 16, 64):
        row = [f"{shard_bytes >> 20} MiB", str(nodes)]
        for text in (SPECS[1], SPECS[3], SPECS[4]):
            spec = OrderSpec.parse(text)
            sizes = []
            for node in (0, nodes // 2, nodes - 1):
                options = StageOptions(
                    node=node, num_nodes=nodes, ranks_per_node=RANKS_PER_NODE, spec=spec
                )
                sizes.append(len(node_shard_order(manifest, options)) * shard_bytes)
            mean = sum(sizes) / len(sizes)
            row.append(f"{mean / 1e9:,.1f} GB ({mean / IMAGENET_BYTES:.0%})")
        row.append(f"{IMAGENET_BYTES / nodes / 1e9:,.1f} GB")
        rows.append(row)
    return rows


def _mixing(epochs: int = 8) -> list[list[str]]:
    import numpy as np

    from shardio.order import OrderSpec, RankInfo, rank_stream

    shards = 1024
    sizes = np.full(shards, IMAGENET_SAMPLES // shards)
    rows = []
    for text in SPECS:
        spec = OrderSpec.parse(text)
        layout = RankInfo(rank=5, world_size=16 * RANKS_PER_NODE, ranks_per_node=RANKS_PER_NODE)
        seen: set[int] = set()
        per_epoch = []
        for epoch in range(epochs):
            samples = rank_stream(sizes, spec, epoch, layout).materialise()
            fed = set((samples // sizes[0]).tolist())
            per_epoch.append(len(fed))
            seen |= fed
        rows.append([f"`{text}`", f"{per_epoch[0]:,}", f"{len(seen):,} of {shards:,}"])
    return rows


# Metadata calls per shard a rank touches in an epoch, as strace counts them
# (tests/unit/runtime/test_epoch_syscalls.py, 2 workers): each worker opens the shards it reads
# once; a staged copy is also locked (flock) in each worker, and its stamp checked once in
# the training process (2 lstat; the first epoch also opens and reads the stamp).
CALLS_SOURCE = 2  # open, by each of 2 workers
CALLS_STAGED = 2 * 2 + 2  # open + flock by each of 2 workers, 2 lstat in the training process


def _metadata(shard_bytes: int) -> list[list[str]]:
    import numpy as np

    from shardio.order import OrderSpec, RankInfo, rank_stream

    manifest = _imagenet_manifest(shard_bytes)
    sizes = np.array([s.num_samples for s in manifest.shards], dtype=np.int64)
    ends = np.cumsum(sizes)
    layout = RankInfo(rank=37, world_size=64 * RANKS_PER_NODE, ranks_per_node=RANKS_PER_NODE)
    rows = []
    for text in SPECS:
        samples = rank_stream(sizes, OrderSpec.parse(text), 0, layout).materialise()
        touched = len(np.unique(np.searchsorted(ends, samples, side="right")))
        rows.append(
            [
                f"{shard_bytes >> 20} MiB",
                f"`{text}`",
                f"{touched:,} of {len(sizes):,}",
                f"{touched * CALLS_SOURCE:,}",
                f"{touched * CALLS_STAGED:,}",
                f"{len(samples) * 2:,}",
            ]
        )
    return rows


def _start_up(workdir: str, repeat: int) -> list[list[str]]:
    gen = os.path.join(REPO, "scripts", "gen_synthetic.py")
    rows = []
    for samples, shards in ((10**6, 1_000), (10**8, 100_000), (10**9, 100_000)):
        path = os.path.join(workdir, f"synthetic-{samples}-{shards}")
        if not os.path.exists(os.path.join(path, "manifest.json")):
            common.remove_path(path)
            argv = [sys.executable, gen, path, "--samples", str(samples), "--shards", str(shards)]
            subprocess.run(argv, check=True, capture_output=True)
        for text in SPECS:
            runs = []
            for _ in range(repeat):
                out = subprocess.run(
                    [sys.executable, PROBE, path, text],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if out.returncode != 0:
                    raise SystemExit(out.stderr)
                runs.append(json.loads(out.stdout))
            rows.append(
                [
                    f"{samples:.0e}".replace("+0", ""),
                    f"{shards:,}",
                    f"`{text}`",
                    f"{common.median([r['open_s'] for r in runs]):.3f} s",
                    f"{common.median([r['order_s'] for r in runs]) * 1e3:.1f} ms",
                    f"{common.median([r['rss_bytes'] for r in runs]) / 1e6:,.1f} MB",
                ]
            )
            print(" | ".join(rows[-1]), file=sys.stderr)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scale-out benchmark and update RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    common.hold_bench_lock(args.workdir)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load = common.loadavg()
    code = common.code_state(REPO)
    t0 = time.perf_counter()
    staged = _staged_per_node(64 << 20) + _staged_per_node(256 << 20)
    mixing = _mixing()
    metadata = _metadata(64 << 20) + _metadata(256 << 20)
    start = _start_up(args.workdir, args.repeat)
    lines = [
        f"Run {started}, load {load} -> {common.loadavg()}, {time.perf_counter() - t0:.0f} s. "
        f"{common.code_line(code, common.code_state(REPO), 'order')}",
        "",
        "### 1. Staged bytes per node",
        "",
        f"ImageNet-1k as shards ({IMAGENET_SAMPLES:,} samples, {IMAGENET_BYTES / 1e9:.0f} GB), "
        f"{RANKS_PER_NODE} ranks per node, epoch 0, mean of nodes 0, N/2 and N-1: what "
        "`shardio stage --node I/N` copies (`node_shard_order`, no bytes moved).",
        "",
        common.markdown_table(
            [
                "shards",
                "nodes",
                "no partition (today)",
                "`partition=node`",
                "`partition=rotating`",
                "1/N of the data",
            ],
            staged,
        ),
        "",
        "### 2. Mixing: distinct shards feeding one rank",
        "",
        "1,024 shards, 16 nodes of 8 ranks, rank 5, over 8 epochs. Without a partition a rank "
        "draws from every shard in every epoch; a node partition confines it to its node's "
        "1/16; rotating a quarter of each node's shards per epoch widens that epoch by epoch.",
        "",
        common.markdown_table(["order", "shards in epoch 0", "shards over 8 epochs"], mixing),
        "",
        "### 3. Metadata calls per epoch per rank",
        "",
        "ImageNet-1k on 64 nodes of 8 ranks (rank 37, epoch 0), 2 DataLoader workers: the "
        "shards the rank's epoch touches, times the calls per shard strace counts "
        f"(tests/unit/runtime/test_epoch_syscalls.py): {CALLS_SOURCE} from the source (one open "
        f"per worker), {CALLS_STAGED} from a staging area (open and flock per worker, the "
        "stamp's 2 lstat once in the training process), against loose files (an open and a "
        "stat per file). Start-up adds a fixed few (manifest, index), whatever the size.",
        "",
        common.markdown_table(
            ["shards", "order", "shards touched", "calls, source", "calls, staged", "loose files"],
            metadata,
        ),
        "",
        "### 4. Start-up of one rank",
        "",
        "Rank 37 of 512 (8 per node): `ShardDataset(path, order=spec)` then its order's first "
        "4,096 samples, each in a fresh process (torch imported before the clock); resident "
        f"memory added; medians of {args.repeat}. Synthetic datasets (scripts/gen_synthetic.py).",
        "",
        common.markdown_table(["samples", "shards", "order", "open", "order", "RSS added"], start),
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        common.update_section(args.out, SECTION, body, common.results_header(args.workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
