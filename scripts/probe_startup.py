#!/usr/bin/env python3
"""Time one rank's start-up on a dataset: open it, compute its epoch order's first samples.

Prints one JSON line: open_s, order_s, rss_bytes (resident memory added, torch imported
before the clock, as in a training script), steps (the rank's samples in the epoch) and the
first samples. Used by benchmarks/bench_scale.py and tests/unit/runtime/test_scale.py.

Usage::

    python scripts/probe_startup.py DATASET SPEC [--rank 37] [--world 512] [--per-node 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("spec", help='an order spec, e.g. "order=random,partition=node"')
    parser.add_argument("--rank", type=int, default=37)
    parser.add_argument("--world", type=int, default=512)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--take", type=int, default=4096)
    args = parser.parse_args(argv)
    import numpy  # noqa: F401 - imported before the clock, as by any training script
    import torch  # noqa: F401

    from shardio import ShardDataset
    from shardio.order import OrderSpec
    from shardio.order.ranks import RankInfo

    base = _rss()
    t0 = time.perf_counter()
    ranks = RankInfo(rank=args.rank, world_size=args.world, ranks_per_node=args.per_node)
    ds = ShardDataset(args.dataset, ranks=ranks, order=OrderSpec.parse(args.spec))
    t1 = time.perf_counter()
    stream = ds.rank_stream()
    first = stream.take(0, args.take)
    t2 = time.perf_counter()
    print(
        json.dumps(
            {
                "open_s": t1 - t0,
                "order_s": t2 - t1,
                "rss_bytes": _rss() - base,
                "steps": len(stream),
                "first": first[:8].tolist(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
