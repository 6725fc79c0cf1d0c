"""Open datasets and read samples, with markers on stderr for an strace log.

Usage: python read_syscalls.py COUNT SEED DATASET[:read[:CACHE]] ...

For each DATASET, writes ``SHARDIO-MARK open-start N`` / ``open-end N`` around
``ShardDataset(DATASET)`` (``stage=CACHE`` when given); for a ``DATASET:read`` also
``read-start N`` / ``read-end N`` around COUNT reads ``ds[i]`` of distinct samples in random
order. Prints, as JSON on stdout,
each read dataset's number of distinct shards touched.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from shardio.order.ranks import RankInfo
from shardio.runtime.dataset import ShardDataset


def mark(text: str) -> None:
    os.write(2, f"SHARDIO-MARK {text}\n".encode())


def main() -> None:
    count, seed = int(sys.argv[1]), int(sys.argv[2])
    touched: dict[str, int] = {}
    for n, spec in enumerate(sys.argv[3:]):
        path, _, what = spec.partition(":")
        what, _, cache = what.partition(":")
        mark(f"open-start {n}")
        ds = ShardDataset(path, ranks=RankInfo(), stage=cache or None)
        mark(f"open-end {n}")
        if what == "read":
            indices = np.random.default_rng(seed).permutation(len(ds))[:count]
            shards = ds.packed.index.samples["shard"][indices]
            mark(f"read-start {n}")
            total = 0
            for i in indices.tolist():
                sample = ds[i]
                total += sum(len(v) for v in sample.values() if isinstance(v, bytes))
            mark(f"read-end {n}")
            assert total > 0
            touched[str(n)] = len(set(shards.tolist()))
        ds.close()
    print(json.dumps(touched))


if __name__ == "__main__":
    main()
