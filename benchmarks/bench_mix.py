"""A mix reads at a single dataset's speed: one dataset vs a 2-source mix of the same total
samples through ``ds.loader(batch_size=64, num_workers=2)`` over the ring transport.

Usage: ``python benchmarks/bench_mix.py [--samples N] [--size BYTES]``; prints the median of
3 epochs in samples/s for each.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from shardio import MixedDataset, ShardDataset
from shardio.packing.run import PackOptions, pack


def _pack(root: str, prefix: str, files: int, size: int) -> str:
    rng = random.Random(prefix)
    src = os.path.join(root, prefix, "src")
    for i in range(files):
        d = os.path.join(src, f"c{i % 4}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{prefix}_{i:06d}.jpg"), "wb") as f:
            f.write(rng.randbytes(size))
    out = os.path.join(root, prefix, "ds")
    pack(src, out, PackOptions(shard_format="tar", shard_size_bytes=8 << 20, durable=False))
    return out


def _epochs(make, epochs: int = 3) -> float:
    loader = make().loader(64, 2)
    rates = []
    try:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            start, n = time.perf_counter(), 0
            for batch in loader:
                n += len(batch["__key__"])
            rates.append(n / (time.perf_counter() - start))
        assert loader.transport_stats["ring"] > 0
    finally:
        loader.close()
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        whole = _pack(root, "whole", args.samples, args.size)
        a = _pack(root, "a", args.samples // 2, args.size)
        b = _pack(root, "b", args.samples // 2, args.size)
        single = _epochs(lambda: ShardDataset(whole, seed=1))
        mix = _epochs(lambda: MixedDataset([(ShardDataset(a), 0.5), (ShardDataset(b), 0.5)]))
    print(f"single dataset: {single:,.0f} samples/s (median of 3 epochs)")
    print(f"2-source mix:   {mix:,.0f} samples/s ({mix / single:.0%} of the single dataset)")


if __name__ == "__main__":
    main()
